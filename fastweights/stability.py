"""No silent divergence: the step bound of an inner step, checked on the given inputs, and the
check that a call never returns non-finite values from finite inputs without saying why.

The step bound. One gd step of the l2 or Omega objective on a plain linear memory maps the state as

    S ↦ (α·I − M) S + (writes),   M = Σ_j c_j β_j Σ_{i ∈ window(j)} γ_i φ(k_i) φ(k_i)ᵀ  (PSD)

over one *step*: a token (each Householder micro-step of DeltaProduct is one), or an inner
mini-batch of b tokens whose gradients are all taken at its start (OmegaNet, ATLAS-style b > 1;
× 1/b when averaged, TTT's 1/i). α is the retention applied across the step to the old state when
the decay comes after the step (Comba, OmegaNet: `retention.decay_first=False`), and c_j ≤ 1 the
retention of the tokens after j inside the mini-batch. The eigenvalues of α·I − M lie in
[α − λ_max(M), α], so the step cannot amplify the memory when

    λ_max(M) ≤ 1 + α          (decay after the step)
    λ_max(M) ≤ 2              (decay first, (I − M)·αS, or no retention)

and a run of such steps stays bounded at any length. `step_bound_breach` bounds λ_max(M) by its
trace, Σ_j c_j β_j Σ_i γ_i‖φ(k_i)‖² — exact for the rank-1 steps of the delta rule (β‖φ(k)‖²), an
upper bound otherwise — and names beta, the step and the value where it fails (`check_step_bound`
raises `DivergenceError` with it). Comba's probe step α·I − β φ(k)φ(p)ᵀ is checked on its one moving
eigenvalue, α − β φ(p)·φ(k) ≥ −1. With unit keys the bound reads β ≤ 2/N (1/N with the decay after),
N = `Recipe.step_normalizer()`.

The bound is sufficient, not necessary: a call is never refused for it alone. Where it fails the
call runs, and its values decide (`check_growth`): a run whose steps cannot amplify the memory keeps

    ‖S_t‖ ≤ E = ‖S_0‖ + Σ_j c_j β_j Σ_i γ_i ‖φ(k_i)‖ ‖v_i‖   (per batch row and head; / b when averaged)

(the writes' norms: retention ≤ 1 only shrinks), and |o_t| ≤ scale·‖φ(q_t)‖·E. Only a run that
breaks the bound at two or more inner steps and whose final state or outputs exceed that envelope
— the memory demonstrably grew step after step — is refused. One inner step cannot diverge: e.g.
OmegaNet with its inner mini-batch b ≥ T runs whatever the bound says.

Memories without such a bound (MLP, residual LN, inner biases, momentum, Muon), and overflow of the
values themselves, are caught after the call by `check_finite_result`, which names the recipe, the
first non-finite position and the likely cause. Both run only with `check_values=True` (each reads
tensor values: a GPU synchronization); the layers pass False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import constant_log_gammas
from .features import feature_dot
from .inputs import InputError, Shapes
from .recipe import Recipe
from .state import MemoryState, compute_dtype, state_tensors

Tensor = torch.Tensor

__all__ = ["DivergenceError", "StepBoundBreach", "step_bound_applies", "step_bound_breach", "check_step_bound",
           "check_growth", "check_finite_result"]

#: Relative slack on the bound: unit keys normalized in fp32 have ‖k‖² = 1 ± K·6e-8, and β = 2 on
#: such keys (the delta rule's own limit) must pass.
SLACK = 1e-4


class DivergenceError(InputError):
    """Finite inputs for which the recurrence can diverge (the step bound fails), or did (a
    non-finite result); the message names the argument, the bound and the position."""


def step_bound_applies(recipe: Recipe) -> bool:
    """True for the recipes whose inner step is the linear map above: gd on the l2 or Omega
    objective of a plain linear memory (DeltaNet, GDN, KDA, Comba, DeltaProduct, OmegaNet, ...)."""
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    return mem.is_plain_linear and obj.kind in ("l2", "omega") and opt.kind == "gd"


def _heads(x: Tensor, groups: int, dim: int) -> Tensor:
    """q/k heads H_q → value heads H (value head h reads key head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _log_retention(recipe: Recipe, inputs: dict, s: Shapes, dtype, device) -> Tensor | None:
    """log α per token: [B, T, H] (scalar, constant) or [B, T, H, K'] (diagonal); None without retention."""
    ret = recipe.retention
    if ret.kind == "constant":
        return constant_log_gammas(ret, s.H, dtype, device).expand(s.B, s.T, s.H)
    g = inputs.get("g")
    return None if g is None else g.to(dtype)


def _window_curvature(recipe: Recipe, curv: Tensor, inputs: dict, initial_state, dtype, *,
                      writes: bool = False) -> Tensor:
    """Σ_{i ∈ window(t)} γ_i‖φ(k_i)‖² per token [B, T, H] (writes=True: curv holds ‖φ(k_i)‖‖v_i‖ and
    the sum is of γ_i‖φ(k_i)‖‖v_i‖), the window reaching back into the initial state's window
    (already feature-mapped) when it carries one."""
    B, T, H = curv.shape
    c = recipe.objective.window
    gamma = inputs.get("gamma")
    w = curv if gamma is None else curv * gamma.to(dtype)  # [B, T, H]
    if c == 1:
        return w
    prev = w.new_zeros(B, c - 1, H)
    if isinstance(initial_state, MemoryState) and initial_state.window_k is not None:
        wk, wg = initial_state.window_k.to(dtype), initial_state.window_gamma.to(dtype)
        if writes:
            prev = wk.norm(dim=-1) * initial_state.window_v.to(dtype).norm(dim=-1) * wg  # [B, c − 1, H]
        else:
            prev = (wk * wk).sum(-1) * wg  # [B, c − 1, H]
    if prev.shape[0] != B:  # packed sequences (cu_seqlens): the largest row's window, an upper bound
        prev = prev.amax(0, keepdim=True).expand(B, -1, -1)
    return torch.cat([prev, w], dim=1).unfold(1, c, 1).sum(-1)  # [B, T, H]


@dataclass(frozen=True)
class StepBoundBreach:
    """Where the step bound fails. text: what fails where (names beta, the step and the value);
    advice: how to meet it; steps: the most inner steps of one batch row and head that break it."""

    text: str
    advice: str
    steps: int


def check_step_bound(recipe: Recipe, shapes: Shapes, k: Tensor, inputs: dict, initial_state=None) -> None:
    """Raise DivergenceError when some inner step of these inputs can amplify the memory (the
    sufficient bound alone, see the module doc; the API refuses a call only by `check_growth`)."""
    breach = step_bound_breach(recipe, shapes, k, inputs, initial_state)
    if breach is not None:
        raise DivergenceError(f"{breach.text}, so the step can amplify the memory and the recurrence diverge. "
                              f"{breach.advice}, or pass check_values=False to run it anyway")


def step_bound_breach(recipe: Recipe, shapes: Shapes, k: Tensor, inputs: dict, initial_state=None
                      ) -> StepBoundBreach | None:
    """Where some inner step of these inputs can amplify the memory (see the module doc), or None;
    None for recipes without the bound and for empty calls."""
    s = shapes
    if not step_bound_applies(recipe) or s.B * s.T * s.H == 0 or torch.compiler.is_compiling():
        return None
    dtype = compute_dtype(k)
    fm, ret, opt = recipe.feature_map, recipe.retention, recipe.optimizer
    groups = s.H // s.Hq
    kh = _heads(k.to(dtype), groups, 3 if s.n > 1 else 2)  # [B, T, (n,) H, K]
    p = inputs.get("p")
    probe = p is not None
    if probe:
        curv = feature_dot(fm, _heads(p.to(dtype), groups, 2), kh)  # φ(p)·φ(k)  [B, T, H]
    else:
        curv = feature_dot(fm, kh, kh)  # ‖φ(k)‖²  [B, T, (n,) H]
    beta = inputs.get("beta")
    beta = torch.ones_like(curv) if beta is None else beta.to(dtype)  # [B, T, (n,) H]
    if s.n == 1:
        curv, beta = curv.unsqueeze(2), beta.unsqueeze(2)  # [B, T, 1, H]
    log_a = _log_retention(recipe, inputs, s, dtype, k.device)  # [B, T, H(, K')] or None
    decay_after = log_a is not None and not ret.decay_first
    if recipe.objective.kind == "omega":
        lam = beta[:, :, 0] * _window_curvature(recipe, curv[:, :, 0], inputs, initial_state, dtype)  # [B, T, H]
    else:
        lam = (beta * curv)  # [B, T, n, H]
    b = opt.minibatch
    if b == 1:
        lam = lam if lam.dim() == 4 else lam.unsqueeze(2)  # [B, T, n, H]
        bound = torch.full_like(lam, 2.0)
        if decay_after:
            alpha = log_a.exp() if log_a.dim() == 3 else log_a.min(-1).values.exp()  # [B, T, H]
            bound[:, :, 0] = 1.0 + alpha  # the decay rides on micro-step 0 only
        where = _where_token
    else:
        lam = lam if lam.dim() == 3 else lam[:, :, 0]  # [B, T, H] (no micro-steps with b > 1)
        lam, bound = _minibatch_steps(lam, log_a if decay_after else None, b, opt.minibatch_average, initial_state)
        where = _where_minibatch(b, initial_state)
    ratio = lam / bound
    worst = ratio.max()
    if not bool(worst > 1.0 + SLACK):
        return None
    over = ratio > 1.0 + SLACK  # [B, T, n, H] or [B, M, H]
    steps = int(over.flatten(1, -2).sum(1).max())  # per batch row and head
    idx = [int(i) for i in (ratio == worst).nonzero()[0]]
    value, limit = lam[tuple(idx)].item(), bound[tuple(idx)].item()
    return StepBoundBreach(
        text=f"beta is too large for {recipe.name}'s inner step with these keys: {_step_text(recipe, probe)} = "
             f"{value:.4g} exceeds "
             f"{f'1 + α = {limit:.4g} (α: the retention across the step)' if decay_after else '2'} {where(idx, s)}",
        advice=f"With unit keys (as the layers normalize them) β ≤ "
               f"{(1.0 if decay_after else 2.0) / recipe.step_normalizer():.4g} always satisfies the bound; scale "
               f"beta down or normalize k",
        steps=steps)


def check_growth(recipe: Recipe, shapes: Shapes, q: Tensor, k: Tensor, v: Tensor, inputs: dict, initial_state,
                 scale: float, result, breach: StepBoundBreach | None) -> None:
    """Raise DivergenceError when a run that breaks the step bound at two or more inner steps
    produced a final state or outputs beyond the envelope E of any non-amplifying run (see the
    module doc): the memory grew step after step. A no-op without a breach, or with one step."""
    if breach is None or breach.steps < 2 or torch.compiler.is_compiling():
        return
    s, fm = shapes, recipe.feature_map
    o, final = result
    dtype = compute_dtype(k)
    groups = s.H // s.Hq
    kh = _heads(k.to(dtype), groups, 3 if s.n > 1 else 2)  # [B, T, (n,) H, K]
    size = feature_dot(fm, kh, kh).clamp(min=0).sqrt() * v.to(dtype).norm(dim=-1)  # ‖φ(k)‖‖v‖ [B, T, (n,) H]
    if recipe.objective.kind == "omega":
        size = _window_curvature(recipe, size, inputs, initial_state, dtype, writes=True)  # [B, T, H]
    beta = inputs.get("beta")
    writes = size if beta is None else size * beta.to(dtype)
    if s.n > 1:
        writes = writes.sum(2)  # the micro-steps' writes  [B, T, H]
    if recipe.optimizer.minibatch > 1 and recipe.optimizer.minibatch_average:
        writes = writes / recipe.optimizer.minibatch
    envelope = writes.sum(1) + _state_norm(initial_state, s.B, dtype)  # [B, H]
    grown = []
    if final is not None:
        got = _state_norm(final, s.B, dtype)  # [B, H]
        grown.append(("the final state's norm", got, envelope.expand_as(got)))
    if isinstance(o, Tensor) and o.numel():
        qn = feature_dot(fm, q.to(dtype), q.to(dtype)).clamp(min=0).sqrt()  # [B, T, H_q]
        reach = scale * _heads(qn, groups, 2).amax(1) * envelope  # [B, H]
        grown.append(("an output's norm", o.to(dtype).norm(dim=-1).amax(1), reach))
    for what, got, limit in grown:
        ratio = got / limit.clamp(min=torch.finfo(dtype).tiny)
        if bool((ratio > 1.0 + SLACK).any()):
            b, h = (int(i) for i in (ratio == ratio.max()).nonzero()[0])
            raise DivergenceError(
                f"{breach.text}, and this run diverged: {what} reaches {got[b, h].item():.4g} (batch {b}, head "
                f"{h}), {ratio[b, h].item():.3g}× the most any run whose steps do not amplify the memory can "
                f"reach with these inputs ({limit[b, h].item():.4g}). {breach.advice}; or pass check_values=False "
                f"to get the raw result")


def _state_norm(state, B: int, dtype) -> Tensor:
    """‖S‖_F per batch row and head [B, H] of a bare [N, H, K', V] state or a MemoryState's first
    weight (N ≠ B: packed sequences, the largest row for every row); 0 without a state."""
    if state is None:
        return torch.zeros((), dtype=dtype)
    w = state.weights[0] if isinstance(state, MemoryState) else state
    n = w.to(dtype).flatten(2).norm(dim=-1)  # [N, H]
    return n if n.shape[0] == B else n.amax(0, keepdim=True)


def _minibatch_steps(lam: Tensor, log_a: Tensor | None, b: int, average: bool, initial_state):
    """Per inner mini-batch m: (trace bound of λ_max(M_m), its bound) [B, M, H], from the per-token
    λ_t [B, T, H]; log_a the retention (decay after the step) or None. The mini-batches start where
    the initial state's offset says (a chained call may begin inside one)."""
    B, T, H = lam.shape
    offset = initial_state.offset if isinstance(initial_state, MemoryState) else 0
    group = (torch.arange(T, device=lam.device) + offset) // b  # mini-batch of each token  [T]
    M = (T - 1 + offset) // b + 1
    weight = torch.ones_like(lam)
    bound = lam.new_full((B, M, H), 2.0)
    if log_a is not None:
        G = log_a.cumsum(1)  # inclusive cumsum  [B, T, H(, K')]
        starts = torch.arange(M, device=lam.device) * b - offset  # first token of each mini-batch  [M]
        first, last = starts.clamp(min=0), (starts + b - 1).clamp(max=T - 1)  # [M] each
        G_end = G[:, last]  # [B, M, H(, K')]
        G_before = torch.cat([torch.zeros_like(G[:, :1]), G], dim=1)[:, first]  # [B, M, H(, K')]
        after = G_end[:, group] - G  # log retention of the tokens after j in its mini-batch  [B, T, H(, K')]
        span = G_end - G_before  # log α over the mini-batch
        if log_a.dim() == 4:  # diagonal: the largest factor for the trace, the smallest α for the bound
            after, span = after.max(-1).values, span.min(-1).values
        weight = after.exp()
        bound = 1.0 + span.exp()
    contrib = weight * lam / (b if average else 1)  # [B, T, H]
    total = lam.new_zeros(B, M, H).index_add_(1, group, contrib)  # [B, M, H]
    return total, bound


def _where_token(idx, s: Shapes) -> str:
    b, t, j, h = idx
    return f"at batch {b}, token {t}{f', micro-step {j}' if s.n > 1 else ''}, head {h}"


def _where_minibatch(b: int, initial_state):
    offset = initial_state.offset if isinstance(initial_state, MemoryState) else 0

    def where(idx, s: Shapes) -> str:
        row, m, h = idx
        t0 = max(0, m * b - offset)
        return f"in the inner mini-batch of b={b} tokens from token {t0} (batch {row}, head {h})"
    return where


def _step_text(recipe: Recipe, probe: bool) -> str:
    identity = recipe.feature_map.kind == "identity"

    def phi(x):
        return x if identity else f"φ({x})"

    if probe:
        return f"β·{phi('p')}·{phi('k')}"
    opt, obj = recipe.optimizer, recipe.objective
    window = f"Σ_(window of {obj.window}) γ_i‖{phi('k_i')}‖²" if obj.kind == "omega" else f"‖{phi('k')}‖²"
    if opt.minibatch == 1:
        return f"β·{window}"
    avg = " / b" if opt.minibatch_average else ""
    return f"Σ_(mini-batch) c_j·β_j·{window}{avg} (c_j: the retention after token j)"


def check_finite_result(recipe: Recipe, form: str, result, breach: StepBoundBreach | None = None) -> None:
    """Raise DivergenceError when the output or final state of a call whose inputs were checked
    finite holds nan or inf, naming the first position and what it means for this recipe (the
    step bound's breach, when the inputs broke it)."""
    if torch.compiler.is_compiling():
        return
    o, final = result
    parts = [("output", o)] + [("final state", x) for x in state_tensors(final)]
    for what, x in parts:
        if not (isinstance(x, Tensor) and x.is_floating_point() and x.numel()) or bool(torch.isfinite(x).all()):
            continue
        idx = [int(i) for i in (~torch.isfinite(x)).nonzero()[0]]
        at = f" at [b, t, h, v] = {idx}" if what == "output" else ""
        cause = _cause(recipe, x.dtype) if breach is None else \
            f"{breach.text}, and the recurrence diverged. {breach.advice}"
        raise DivergenceError(
            f"fastweights.{form}({recipe.name!r}) produced a non-finite {what}{at} from finite inputs: "
            f"{cause}; or pass check_values=False to get the raw result")


def _cause(recipe: Recipe, dtype) -> str:
    if step_bound_applies(recipe):
        return (f"every inner step met the step bound (fastweights.stability), so the memory cannot grow "
                f"geometrically: a value overflowed {dtype} (inputs of very large magnitude?); scale the "
                f"inputs down or compute in float64")
    mem, opt = recipe.memory, recipe.optimizer
    if recipe.uses_autodiff or opt.has_momentum:
        return (f"the inner loop of {recipe.name} ({opt.describe()}; memory: {mem.describe()}) has no step "
                f"bound that can be checked up front, and it diverged for these inputs: lower beta "
                f"(example_inputs draws β ∈ (0, 0.1) for trained memories) or the key norms")
    return f"a value overflowed {dtype} (inputs of very large magnitude?); scale the inputs down or use float64"
