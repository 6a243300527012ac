"""The training-free capacity probe: how many (key, value) pairs does each memory hold?

Nothing is learned. Each memory writes a stream of (key, value) pairs with its own update rule
(a `fastweights.Recipe` with a fixed step size and a fixed retention, written by the library's
forms: by default the quickest exact one per memory, `write(form="fast")`; form "recurrent" runs
`fastweights.recurrent` token by token and gives the same recall up to float rounding),
then every stored key is read back from the final state, and a read counts as
recalled when, among the candidate values, the one nearest to the read in cosine similarity is
its own:

    keys     k_i = x_i / ‖x_i‖,  x_i ~ N(0, I_{d_k})              stacked [B, T, d_k]
    values   v_i ~ N(0, I_{d_v})                                  stacked [B, T, d_v]
    write    M_T = the memory after the T writes                  (`write`)
    read     o_j = M_T(φ(k_j))                                    [B, R, d_v]
    recall   = mean_{b, j} 1[ argmax_c cos(o_j, u_c) = target_j ]  u_c: candidates [B, C, d_v]

B is the number of trials (independent draws, run as the batch dimension of one call); the
memory has one head. The read uses the query scale 1 (the key the pair was written at); for
the linear memories any positive scale gives the same cosine ranking.

Settings (n = number of distinct pairs; the candidates are every value ever stored):

    random  n pairs, each written once; all n read back.
            (One growing memory per trial: the reads at n = 8, 16, … are taken from the state
            after the first n writes of a single stream of 8·d_k pairs — the state after n
            writes depends on those n pairs only, so each n is an ordinary n-pair experiment.)
    skewed  pair 0 written 30 times, interleaved uniformly at random with the n − 1 others
            written once; the n − 1 others are scored (candidates: all n values).
    update  n pairs written, then every key written again (in a fresh random order) with a
            new value; every key is read and scored against its new value, the candidates
            being all 2n values (reading back the stale value is a miss). (The first n pairs
            are those of the `random` stream: the state after n writes is forked.)
    stream  8·d_k pairs written once; the last d_k/4 are scored (candidates: all 8·d_k
            values). One n only (the end of the same stream).

Memories (`probes(d_k, d_v)`; `MODELS` lists them in order):

    linear        S ← S + β φ(k) vᵀ                      dot objective, β = 1
    delta         S ← S + β φ(k)(v − Sᵀφ(k))ᵀ           l2 objective, β = 1/‖φ(k)‖² (= 1 here)
    mesa          S = (Σ φ(k)φ(k)ᵀ + λI)⁻¹ Σ φ(k) vᵀ      exact regularized least squares, λ = 1e-3
    linear_poly2, delta_poly2   as linear / delta on φ = polynomial degree 2,
                  φ(x)·φ(y) = 1 + x·y + (x·y)², K' = C(d_k + 2, 2); delta steps β = 1/‖φ(k)‖²
                  (= 1/3 for unit keys: the exact overwrite; β = 1 would diverge)
    linear_poly2h, delta_poly2h as linear_poly2 / delta_poly2 on the homogeneous map,
                  φ(x)·φ(y) = (x·y)², K' = d_k(d_k + 1)/2 (no constant term shared by every key)
    linear_decay, delta_decay   as linear / delta with constant retention γ = 0.97 (S ← γS first)
    omega         Omega rule, window c = 4, linear memory, one GD step per token on the window's
                  loss, β = 1/c (each pair is in c windows; c·β ≤ 2 keeps the step stable even
                  when a window holds c copies of one key, where β = 1 diverges)
    muon          l2 objective, momentum ν = 0.5, Newton–Schulz (5 steps): m ← νm + ∇ℓ,
                  S ← S − β NS(m). NS(m) has singular values ≈ 1 whatever the error's size, so the
                  step is set relative to the values: they are written as v/√d_v (‖v‖ ≈ 1) with
                  β = 0.25 — the same recall as (v, β·√d_v), the memory being homogeneous in (v, β),
                  while the inputs' check caps β at 2 for an l2 linear memory
    mlp           2-layer MLP memory M(x) = W₂ᵀ gelu(W₁ᵀx), hidden h = 4·d_k, per-token GD on the
                  l2 objective with β = 0.5 / (h·E[gelu(z)²]), z ~ N(0, 0.5²) (E‖gelu(W₁ᵀk)‖² = h·E[…]:
                  a half-overwrite through the output layer); W₁ ~ N(0, 0.5²), W₂ ~ N(0, 1/h),
                  drawn once per trial (the fixed random initial weights)

The step sizes of omega, muon and mlp were picked by a small sweep on this probe (docs/capacity.md).

Reads are taken from the final state directly (`read_state`): o = Sᵀφ(q) for a matrix memory,
the library's own `inner.forward` for MLP memories, Gᵀ(H + λI)⁻¹φ(q) for Mesa's statistics.
This is the exact readout every recurrence step applies (o_t = M_t(scale·φ(q_t))), done for all
R queries at once instead of R more steps — and it leaves the state untouched, whereas a
zero-strength continuation would still decay a constant-retention memory by γ per read step.
(The tests check it against such a continuation.)
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import api
from ..features import apply_feature_map
from ..inputs import PER_HEAD_INPUTS, accepted_inputs, complete_state
from ..recipe import FeatureMap, Memory, Objective, Optimizer, Recipe, Retention
from ..reference import inner
from ..reference.recurrent import memory_recurrent
from ..state import MemoryState, MesaState, compute_dtype, state_map

Tensor = torch.Tensor

__all__ = ["SETTINGS", "MODELS", "SKEW_REPEATS", "Probe", "probes", "sizes", "run_capacity", "read_state",
           "write", "recall", "format_table", "plot_capacity", "legend", "cli_main", "gelu_square_mean",
           "RECORD_FIELDS"]

SETTINGS = ("random", "skewed", "update", "stream")
MODELS = ("linear", "delta", "mesa", "linear_poly2", "delta_poly2", "linear_poly2h", "delta_poly2h",
          "linear_decay", "delta_decay", "omega", "muon", "mlp")
RECORD_FIELDS = ("setting", "model", "d_k", "n_pairs", "accuracy")
SKEW_REPEATS = 30
DECAY = 0.97
MESA_LAMBDA = 1e-3
OMEGA_WINDOW = 4
PARALLEL_CHUNK = 64  # tokens per fastweights.parallel call in write(form="fast")
MUON_NU = 0.5
MUON_BETA = 0.25
MLP_W1_STD = 0.5
MLP_STEP = 0.5


def gelu_square_mean(std: float) -> float:
    """E[gelu(z)²] for z ~ N(0, std²), by 64-point Gauss–Hermite quadrature (0.0835 at std 0.5)."""
    import numpy as np

    x, w = np.polynomial.hermite_e.hermegauss(64)
    z = torch.as_tensor(std * x, dtype=torch.float64)
    return float((torch.as_tensor(w / w.sum()) * F.gelu(z) ** 2).sum())


# ---------------------------------------------------------------------------------------- probes
@dataclass(frozen=True)
class Probe:
    """A memory under probe: a Recipe plus the fixed per-token inputs it is written with.

    beta:       the write strength β (inner learning rate); `beta_over_norm` divides it by
                ‖φ(k_t)‖² per token (β = 1 then writes the pair exactly: the delta rule's overwrite).
    nu:         momentum decay ν (momentum and muon optimizers).
    lamb:       Mesa's regularizer λ (the same for every feature).
    mlp_std:    (std of W₁, std of W₂, …) of the fixed random initial MLP weights.
    value_scale: values are written as value_scale·v (reads are scored by cosine, so for a
                memory that is positively homogeneous in (v, β) — linear, delta, Mesa, Muon —
                writing (c·v, c·β) gives c times the same state and the same recall).
    note:       one line for the table legend.
    """

    name: str
    recipe: Recipe
    beta: float = 1.0
    beta_over_norm: bool = False
    nu: float | None = None
    lamb: float | None = None
    mlp_std: tuple[float, ...] | None = None
    value_scale: float = 1.0
    note: str = ""

    def inputs(self, keys: Tensor, features: Tensor | None = None) -> dict[str, Tensor]:
        """The per-token inputs for writing `keys` [B, T, K]: beta/nu [B, T, 1], lamb [1, K'].
        features: φ(keys) [B, T, K'] when the caller has it already (else it is computed here)."""
        B, T, K = keys.shape
        acc = accepted_inputs(self.recipe)
        out: dict[str, Tensor] = {}
        kw = dict(dtype=keys.dtype, device=keys.device)
        if "beta" in acc:
            if self.beta_over_norm:
                phi = apply_feature_map(self.recipe.feature_map, keys) if features is None else features
                norm2 = phi.pow(2).sum(-1)  # [B, T]
                out["beta"] = (self.beta / norm2)[..., None]
            else:
                out["beta"] = torch.full((B, T, 1), self.beta, **kw)
        if "nu" in acc:
            out["nu"] = torch.full((B, T, 1), self.nu if self.nu is not None else 0.0, **kw)
        if "lamb" in acc:
            Kf = self.recipe.feature_map.out_dim(K)
            out["lamb"] = torch.full((1, Kf), self.lamb if self.lamb is not None else MESA_LAMBDA, **kw)
        return out

    def initial_state(self, B: int, K: int, V: int, *, dtype, generator: torch.Generator):
        """None (zeros, made by the library) or the fixed random weights of an MLP memory."""
        if not self.recipe.uses_autodiff:
            return None
        mem = self.recipe.memory
        Kf = self.recipe.feature_map.out_dim(K)
        hidden = mem.expansion * K
        dims = [Kf] + [hidden] * (mem.depth - 1) + [V]
        stds = self.mlp_std or tuple(1.0 / math.sqrt(a) for a in dims[:-1])
        weights = tuple((torch.randn(B, 1, a, b, generator=generator, dtype=torch.float64) * s).to(dtype)
                        for (a, b), s in zip(zip(dims[:-1], dims[1:]), stds))  # the same draw in any dtype
        return MemoryState(weights=weights)


_LIN = Memory(kind="linear")
_POLY2 = FeatureMap(kind="polynomial", degree=2)
_POLY2H = FeatureMap(kind="polynomial", degree=2, homogeneous=True)
_DOT = Objective(kind="dot")
_L2 = Objective(kind="l2")
_GD = Optimizer(kind="gd")
_NONE = Retention(kind="none")
_DECAY = Retention(kind="constant", gamma=DECAY)


def probes(d_k: int = 64, d_v: int | None = None) -> dict[str, Probe]:
    """Every memory of the probe, by label (the order of `MODELS`), for keys of dimension d_k
    and values of dimension d_v (default d_k). Step sizes that depend on the dimensions (muon,
    mlp) are set here."""
    d_v = d_v or d_k

    def r(name, **axes):
        return Recipe(name=name, **axes)

    hidden = 4 * d_k
    out = [
        Probe("linear", r("linear", memory=_LIN, objective=_DOT, optimizer=_GD, retention=_NONE),
              note="S += k vᵀ"),
        Probe("delta", r("delta", memory=_LIN, objective=_L2, optimizer=_GD, retention=_NONE),
              beta_over_norm=True, note="delta rule, β = 1"),
        Probe("mesa", r("mesa", memory=_LIN, objective=Objective(kind="least_squares"),
                        optimizer=Optimizer(kind="closed_form"), retention=_NONE),
              lamb=MESA_LAMBDA, note=f"exact least squares, λ = {MESA_LAMBDA:g}"),
        Probe("linear_poly2", r("linear_poly2", memory=_LIN, feature_map=_POLY2, objective=_DOT, optimizer=_GD,
                                retention=_NONE), note="S += φ(k) vᵀ, φ polynomial p = 2"),
        Probe("delta_poly2", r("delta_poly2", memory=_LIN, feature_map=_POLY2, objective=_L2, optimizer=_GD,
                               retention=_NONE),
              beta_over_norm=True, note="delta rule on φ polynomial p = 2, β = 1/‖φ(k)‖²"),
        Probe("linear_poly2h", r("linear_poly2h", memory=_LIN, feature_map=_POLY2H, objective=_DOT, optimizer=_GD,
                                 retention=_NONE), note="S += φ(k) vᵀ, φ homogeneous p = 2: φ(x)·φ(y) = (x·y)²"),
        Probe("delta_poly2h", r("delta_poly2h", memory=_LIN, feature_map=_POLY2H, objective=_L2, optimizer=_GD,
                                retention=_NONE),
              beta_over_norm=True, note="delta rule on φ homogeneous p = 2, β = 1/‖φ(k)‖²"),
        Probe("linear_decay", r("linear_decay", memory=_LIN, objective=_DOT, optimizer=_GD, retention=_DECAY),
              note=f"S = γS + k vᵀ, γ = {DECAY}"),
        Probe("delta_decay", r("delta_decay", memory=_LIN, objective=_L2, optimizer=_GD, retention=_DECAY),
              beta_over_norm=True, note=f"gated delta rule, γ = {DECAY}, β = 1"),
        Probe("omega", r("omega", memory=_LIN, objective=Objective(kind="omega", window=OMEGA_WINDOW),
                         optimizer=_GD, retention=_NONE),
              beta=1.0 / OMEGA_WINDOW, note=f"Omega rule, window c = {OMEGA_WINDOW}, β = 1/c"),
        Probe("muon", r("muon", memory=_LIN, objective=_L2, optimizer=Optimizer(kind="muon", ns_steps=5),
                        retention=_NONE),
              beta=MUON_BETA, nu=MUON_NU, value_scale=1.0 / math.sqrt(d_v),
              note=f"momentum ν = {MUON_NU} + Newton–Schulz, step {MUON_BETA}·‖v‖"),
        Probe("mlp", r("mlp", memory=Memory(kind="mlp", depth=2, expansion=4, activation="gelu"), objective=_L2,
                       optimizer=_GD, retention=_NONE),
              beta=MLP_STEP / (hidden * gelu_square_mean(MLP_W1_STD)), mlp_std=(MLP_W1_STD, 1.0 / math.sqrt(hidden)),
              note=f"2-layer gelu MLP, hidden 4·d_k, GD β = {MLP_STEP}/E‖h‖²"),
    ]
    return {p.name: p for p in out}


# ---------------------------------------------------------------------------------------- write / read
WRITE_FORMS = ("fast", "recurrent", "chunk", "parallel")


def _fast_form(recipe: Recipe, Kf: int, V: int) -> str:
    """The form `write(form="fast")` takes for a recipe: "chunk" for the gated-linear and Mesa
    classes and the delta class on narrow keys, "parallel" for the delta class on wide feature
    maps (K' > 4·V: the chunk form's per-chunk K'×K' transition then costs more than the
    parallel form, run on chunks of PARALLEL_CHUNK tokens, each continuing the last one's
    state), "state" (`_memory_write`) for the rest."""
    cls = api.recipe_class(recipe)
    if cls == "generic":
        return "state"
    if cls == "delta" and Kf > 4 * V:
        return "parallel"
    return "chunk"


def write(probe: Probe, state, keys: Tensor, values: Tensor, *, form: str = "recurrent"):
    """Write the pairs (keys [B, T, K], values [B, T, V]) into `state` (None: empty memory) with
    the probe's update rule; returns the state after the last write (what `output_final_state`
    gives: S [B, 1, K', V], a MemoryState or a MesaState).

    form "recurrent" runs `fastweights.recurrent` (token by token, the reference); "chunk" runs
    `fastweights.chunk` and "parallel" `fastweights.parallel` where that form exists (the
    linear, delta and Mesa classes: linear, delta, mesa, the poly2 and decay variants; Mesa's
    chunk form with its exact solve) and the recurrence elsewhere; "fast" (what
    `run_capacity` uses) takes per memory the quickest exact way (`_fast_form`): the chunk
    or parallel form with the keys feature-mapped once (φ(k) passed to the same recipe
    without its feature map: the same floats the form would compute), or, for omega, muon
    and mlp, the recurrence keeping the state only (`_memory_write`). Every form gives the
    same state up to float rounding ("fast" on omega, muon, mlp: the same floats as
    "recurrent")."""
    if form not in WRITE_FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, WRITE_FORMS))}, got {form!r}")
    if keys.shape[1] == 0:
        return state
    recipe, features = probe.recipe, None
    k = keys[:, :, None]  # [B, T, 1, K]
    v = probe.value_scale * values[:, :, None]  # [B, T, 1, V]
    fn, extra, fast = api.recurrent, {}, form == "fast"
    if fast:
        form = _fast_form(recipe, recipe.feature_map.out_dim(keys.shape[-1]), values.shape[-1])
        if form == "state":
            return _memory_write(probe, state, keys, values)
        if recipe.feature_map.kind != "identity":  # φ once, here, instead of for q and k in the form (and β)
            cdt = compute_dtype(keys)
            k = apply_feature_map(recipe.feature_map, k.to(cdt))  # [B, T, 1, K']
            features = k[:, :, 0] if cdt == keys.dtype else None
            recipe = dataclasses.replace(recipe, feature_map=FeatureMap())
    inputs = probe.inputs(keys, features)
    if form != "recurrent" and form in api.forms(recipe):
        fn = api.chunk if form == "chunk" else api.parallel
        if form == "chunk" and recipe.is_mesa:
            extra = {"mesa_solve": "cg", "cg_steps": 0}  # only (H, G) is kept: skip the outputs' solves
    step = PARALLEL_CHUNK if fast and fn is api.parallel else k.shape[1]
    for t in range(0, k.shape[1], step):  # the parallel form a chunk at a time: T·C instead of T² work
        sl = slice(t, t + step)
        per_token = {name: x if name in PER_HEAD_INPUTS else x[:, sl] for name, x in inputs.items()}
        _, state = fn(recipe, k[:, sl], k[:, sl], v[:, sl], scale=1.0, initial_state=state, output_final_state=True,
                      check_values=False, **per_token, **extra)
    return state


def _memory_write(probe: Probe, state, keys: Tensor, values: Tensor) -> MemoryState:
    """`fastweights.recurrent` for the memories of the generic class that the probe holds (omega,
    muon, mlp), without the per-token reads the probe throws away: the same loop
    (`reference.recurrent.memory_recurrent` with readout=False) on the same inputs, so the same
    floats. The tests check it against `fastweights.recurrent`."""
    recipe = probe.recipe
    if recipe.feature_map.kind != "identity" or recipe.retention.kind != "none":
        raise ValueError(f"no state-only write for {recipe.name}; write it with form='recurrent'")
    cdt = compute_dtype(keys)
    B, T, K = keys.shape
    V = values.shape[-1]
    inputs = {name: x.to(cdt) for name, x in probe.inputs(keys).items()}  # [B, T, 1] each
    k = keys[:, :, None, None].to(cdt)  # [B, T, n=1, H=1, K]
    v = (probe.value_scale * values[:, :, None, None]).to(cdt)  # [B, T, 1, 1, V]
    if state is None:
        state = MemoryState(weights=(torch.zeros(B, 1, K, V, dtype=cdt, device=keys.device),))
    st = complete_state(recipe, state_map(state, lambda x: x.to(cdt)), B, 1, K, V)
    gamma = inputs.get("gamma")
    if gamma is None and recipe.objective.window > 1:
        gamma = torch.ones(B, T, 1, dtype=cdt, device=keys.device)  # the window weights γ (all 1 here)
    _, final = memory_recurrent(recipe, k[:, :, 0], k, v, scale=1.0, g=None, beta=inputs["beta"][:, :, None],
                                p=None, nu=inputs.get("nu"), gamma=gamma, state=st, readout=False)
    return final


def read_state(recipe: Recipe, state, queries: Tensor, *, lamb: float | Tensor | None = None) -> Tensor:
    """Read a final state at every query at once: queries [B, R, K] -> o [B, R, V].

    state S [B, 1, K', V]:  o = φ(q) S                        (a matrix memory, readout Sᵀφ(q))
    MemoryState:            o = M_θ(φ(q)) by `fastweights.reference.inner.forward` (linear or MLP
                            weights; divided by φ(q)·z + 1e-6 for a normalized linear memory)
    MesaState(H, G):        o = Gᵀ (H + Diag(λ))⁻¹ φ(q)      (λ: float or [1, K'] / [K'])
    The query scale is 1: the read is at the key the pair was written at.
    """
    x = apply_feature_map(recipe.feature_map, queries)  # [B, R, K']
    if isinstance(state, MesaState):
        H, G = state.H[:, 0], state.G[:, 0]  # [B, K', K'], [B, K', V]
        lam = torch.as_tensor(MESA_LAMBDA if lamb is None else lamb, dtype=H.dtype, device=H.device)
        lam = lam.reshape(-1).expand(H.shape[-1])
        xs = torch.linalg.solve(H + torch.diag_embed(lam), x.transpose(1, 2).to(H.dtype))  # [B, K', R]
        return (G.transpose(1, 2) @ xs).transpose(1, 2)  # [B, R, V]
    if isinstance(state, Tensor):
        return x.to(state.dtype) @ state[:, 0]  # [B, R, V]
    if isinstance(state, MemoryState):
        xx = x[:, None].to(state.weights[0].dtype)  # [B, 1, R, K']
        o = inner.forward(recipe.memory, state.weights, xx)[:, 0]  # [B, R, V]
        if state.normalizer is not None:
            o = o / ((x * state.normalizer[:, 0, None]).sum(-1, keepdim=True) + 1e-6)
        return o
    raise TypeError(f"cannot read a state of type {type(state).__name__}")


def recall(o: Tensor, candidates: Tensor, targets: Tensor) -> Tensor:
    """Per-read hits: o [B, R, V], candidates [B, C, V], targets [B, R] (long, into C) ->
    bool [B, R], true where the candidate of highest cosine similarity to o is the target.
    A zero read (nothing left in memory) is a miss."""
    sim = F.normalize(o, dim=-1) @ F.normalize(candidates, dim=-1).transpose(1, 2)  # [B, R, C]
    return (sim.argmax(-1) == targets) & (o.norm(dim=-1) > 0)


# ---------------------------------------------------------------------------------------- episodes
@dataclass
class _Read:
    """One scored read-back: after the first `at` writes of its episode (and, for `update`,
    after the fork's extra writes on a copy of that state), read `queries` and score them."""

    setting: str
    at: int  # writes of the episode done before this read
    n_pairs: int
    queries: Tensor  # [B, R, K]
    candidates: Tensor  # [B, C, V]
    targets: Tensor  # [B, R] indices into the candidates
    fork_keys: Tensor | None = None  # [B, F, K] written on a copy of the state before the read
    fork_values: Tensor | None = None  # [B, F, V]


@dataclass
class _Episode:
    keys: Tensor  # [B, T, K]
    values: Tensor  # [B, T, V]
    reads: list[_Read] = field(default_factory=list)


def sizes(d_k: int) -> list[int]:
    """The numbers of pairs probed: d_k/8, d_k/4, …, 8·d_k (powers of two times d_k/8)."""
    base = max(1, d_k // 8)
    return [base * 2 ** i for i in range(7)]


def _generator(seed: int, *parts) -> torch.Generator:
    """A generator seeded by (seed, parts): the same data for every model and every subset run."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32("/".join(map(str, (seed, *parts))).encode()))
    return g


def _pairs(gen, B, n, d_k, d_v, dtype):
    x = torch.randn(B, n, d_k, generator=gen, dtype=torch.float64)
    keys = x / x.norm(dim=-1, keepdim=True)  # [B, n, K] unit keys
    values = torch.randn(B, n, d_v, generator=gen, dtype=torch.float64)  # [B, n, V]
    return keys.to(dtype), values.to(dtype)


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, N, D] gathered along N by idx [B, M] -> [B, M, D]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def _episodes(settings: Sequence[str], d_k: int, d_v: int, trials: int, seed: int, ns: Sequence[int],
              dtype) -> list[_Episode]:
    """The write streams and their scored reads.

    `random`, `update` and `stream` share one stream of pairs per trial (seeded by (seed,
    "stream")): `random` reads the first n keys after n writes; `update` forks the state after
    n writes and rewrites those n keys (fresh order, new values seeded by (seed, "update", n));
    `stream` reads the last d_k/4 keys after 8·d_k writes. `skewed` has one stream per n."""
    B = trials
    out = []
    shared = [s for s in settings if s in ("random", "update", "stream")]
    if shared:
        lengths = [8 * d_k] if "stream" in shared else []
        if "random" in shared or "update" in shared:
            lengths.append(max(ns))
        total = max(lengths)
        keys, values = _pairs(_generator(seed, "stream"), B, total, d_k, d_v, dtype)
        ep = _Episode(keys, values)
        for n in ns:
            if "random" in shared:
                ep.reads.append(_Read("random", n, n, keys[:, :n], values[:, :n], torch.arange(n).expand(B, n)))
            if "update" in shared:
                gen = _generator(seed, "update", n)
                new = torch.randn(B, n, d_v, generator=gen, dtype=torch.float64).to(dtype)  # [B, n, V]
                perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(B)])  # [B, n]
                cands = torch.cat([values[:, :n], new], dim=1)  # [B, 2n, V]: stale values first
                ep.reads.append(_Read("update", n, n, keys[:, :n], cands, (n + torch.arange(n)).expand(B, n),
                                      fork_keys=_take(keys[:, :n], perm), fork_values=_take(new, perm)))
        if "stream" in shared:
            n, last = 8 * d_k, max(1, d_k // 4)
            ep.reads.append(_Read("stream", n, n, keys[:, n - last:n], values[:, :n],
                                  torch.arange(n - last, n).expand(B, last)))
        ep.reads.sort(key=lambda r: r.at)
        out.append(ep)
    if "skewed" in settings:
        for n in ns:  # pair 0 written SKEW_REPEATS times, interleaved at random with the n − 1 others
            gen = _generator(seed, "skewed", n)
            keys, values = _pairs(gen, B, n, d_k, d_v, dtype)
            order = torch.cat([torch.zeros(SKEW_REPEATS, dtype=torch.long), torch.arange(1, n)])
            idx = torch.stack([order[torch.randperm(order.numel(), generator=gen)] for _ in range(B)])  # [B, T]
            ep = _Episode(_take(keys, idx), _take(values, idx))
            ep.reads.append(_Read("skewed", idx.shape[1], n, keys[:, 1:], values, torch.arange(1, n).expand(B, n - 1)))
            out.append(ep)
    return out


def _run_episode(probe: Probe, ep: _Episode, d_k: int, d_v: int, seed: int, form: str):
    """Yield (setting, n_pairs, recall) for every read of the episode, writing as it goes."""
    B = ep.keys.shape[0]
    state = probe.initial_state(B, d_k, d_v, dtype=ep.keys.dtype, generator=_generator(seed, "init", probe.name))
    t = 0
    for rd in ep.reads:
        state = write(probe, state, ep.keys[:, t:rd.at], ep.values[:, t:rd.at], form=form)
        t = rd.at
        st = state
        if rd.fork_keys is not None:  # the library's forms return new tensors: `state` is left as it was
            st = write(probe, state, rd.fork_keys, rd.fork_values, form=form)
        o = read_state(probe.recipe, st, rd.queries, lamb=probe.lamb)
        yield rd.setting, rd.n_pairs, recall(o, rd.candidates, rd.targets).double().mean().item()


# ---------------------------------------------------------------------------------------- driver
def check_arguments(*, d_k: int = 64, d_v: int | None = None, settings: Sequence[str] = SETTINGS,
                    models: Sequence[str | Probe] = MODELS, trials: int = 4) -> tuple[list[str], list[Probe]]:
    """Validate `run_capacity`'s arguments (ValueError naming the argument); returns the settings
    (deduplicated) and the chosen probes."""
    if isinstance(d_k, bool) or not isinstance(d_k, int) or d_k < 16 or d_k % 8:
        raise ValueError(f"d_k must be a multiple of 8, at least 16, got {d_k!r} (the probe writes n = d_k/8, "
                         "d_k/4, ..., 8·d_k pairs: whole ratios of d_k, the smallest n ≥ 2)")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    d_v = d_v or d_k
    settings = list(dict.fromkeys(settings))
    for s in settings:
        if s not in SETTINGS:
            raise ValueError(f"settings: unknown setting {s!r}; settings: {', '.join(SETTINGS)}")
    table = probes(d_k, d_v)
    chosen = []
    for m in models:
        if isinstance(m, Probe):
            chosen.append(m)
        elif m in table:
            chosen.append(table[m])
        else:
            raise ValueError(f"models: unknown model {m!r}; models: {', '.join(MODELS)} (or a Probe)")
    return settings, chosen


def run_capacity(*, d_k: int = 64, d_v: int | None = None, settings: Sequence[str] = SETTINGS,
                 models: Sequence[str | Probe] = MODELS, seed: int = 0, trials: int = 4,
                 ns: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                 form: str = "fast") -> list[dict]:
    """Run the probe; returns one record per (setting, model, n), in that order:
    {"setting", "model", "d_k", "n_pairs", "accuracy"} (accuracy = recall in [0, 1], averaged
    over `trials` draws and every scored read).

    d_k, d_v: key and value dimensions (d_v defaults to d_k); ns: the numbers of pairs
    (default `sizes(d_k)`; `stream` always writes 8·d_k); models: labels of `probes()` or Probe
    objects; seed: the data (keys, values, write orders, MLP initial weights) depend on
    (seed, setting, n) only, so every model sees the same pairs and a run of a subset of
    models or settings reproduces the full run's numbers; form: see `write` ("fast": the same
    recall as "recurrent", the token-by-token reference, up to float rounding).
    """
    settings, chosen = check_arguments(d_k=d_k, d_v=d_v, settings=settings, models=models, trials=trials)
    d_v = d_v or d_k
    ns = sorted(set(ns)) if ns is not None else sizes(d_k)
    if not ns or min(ns) < 2:
        raise ValueError(f"ns must be numbers of pairs ≥ 2, got {ns!r}")
    episodes = _episodes(settings, d_k, d_v, trials, seed, ns, dtype)
    rows = []
    for i, probe in enumerate(chosen):
        for ep in episodes:
            for setting, n, a in _run_episode(probe, ep, d_k, d_v, seed, form):
                rows.append(((settings.index(setting), i, n),
                             {"setting": setting, "model": probe.name, "d_k": d_k, "n_pairs": n, "accuracy": a}))
    return [rec for _, rec in sorted(rows, key=lambda r: r[0])]


# ---------------------------------------------------------------------------------------- output
def _ratio(n: int, d_k: int) -> str:
    if n >= d_k:
        return f"{n // d_k}" if n % d_k == 0 else f"{n / d_k:.2g}"
    return f"1/{d_k // n}" if d_k % n == 0 else f"{n / d_k:.2g}"


def format_table(records: Sequence[dict]) -> str:
    """Recall as text: one block per setting, one row per model, one column per n."""
    lines = []
    settings = list(dict.fromkeys(r["setting"] for r in records))
    for setting in settings:
        rows = [r for r in records if r["setting"] == setting]
        d_k = rows[0]["d_k"]
        ns = sorted({r["n_pairs"] for r in rows})
        models = list(dict.fromkeys(r["model"] for r in rows))
        acc = {(r["model"], r["n_pairs"]): r["accuracy"] for r in rows}
        w = max(12, *(len(m) for m in models))
        head = {"random": "n pairs written once, all read back",
                "skewed": f"one pair written {SKEW_REPEATS}× among n − 1 written once; the others read",
                "update": "n pairs, then every key rewritten with a new value; read vs the new value",
                "stream": f"{8 * d_k} pairs streamed; the last {max(1, d_k // 4)} read"}.get(setting, "")
        lines.append(f"[{setting}] {head}")
        lines.append("n".ljust(w) + "".join(f"{n:>7}" for n in ns))
        lines.append("n/d_k".ljust(w) + "".join(f"{_ratio(n, d_k):>7}" for n in ns))
        for m in models:
            cells = "".join(f"{acc[(m, n)]:>7.3f}" if (m, n) in acc else f"{'—':>7}" for n in ns)
            lines.append(m.ljust(w) + cells)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#000000", "#b8860b")
"""One colour per memory of MODELS (matplotlib's tab10, then black and dark goldenrod)."""
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")


def plot_capacity(records: Sequence[dict], path: str | Path) -> Path:
    """Recall vs n/d_k, one panel per setting, one line per model; `stream` (one n) is drawn
    as bars. Writes a PNG at `path` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = list(dict.fromkeys(r["setting"] for r in records))
    models = list(dict.fromkeys(r["model"] for r in records))
    order = {m: i for i, m in enumerate(MODELS)}  # the same colour and marker for a memory in every run
    idx = {m: order.get(m, len(MODELS) + j) for j, m in enumerate(models)}
    colors = {m: _COLORS[idx[m] % len(_COLORS)] for m in models}
    markers = {m: _MARKERS[idx[m] % len(_MARKERS)] for m in models}
    styles = {m: ("--" if m.endswith("_decay") else ":" if m.endswith("_poly2") else "-") for m in models}
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        rows = [r for r in records if r["setting"] == setting]
        d_k = rows[0]["d_k"]
        if len({r["n_pairs"] for r in rows}) == 1:
            names = [r["model"] for r in rows]
            vals = [r["accuracy"] for r in rows]
            ax.barh(range(len(rows)), vals, color=[colors[m] for m in names])
            for y, v in enumerate(vals):  # the number too: a bar of 0 is otherwise invisible
                ax.text(min(v, 0.86) + 0.02, y, f"{v:.2f}", va="center", fontsize=7,
                        color="white" if v > 0.86 else "black")
            ax.set_yticks(range(len(rows)), names, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, 1.02)
            ax.set_xlabel(f"recall of the last {max(1, d_k // 4)} of {rows[0]['n_pairs']} pairs")
        else:
            for m in models:
                pts = sorted((r["n_pairs"] / d_k, r["accuracy"]) for r in rows if r["model"] == m)
                if pts:
                    ax.plot(*zip(*pts), styles[m], marker=markers[m], ms=4, color=colors[m], label=m)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["n_pairs"] for r in rows})
            ax.set_xticks([n / d_k for n in ticks], [_ratio(n, d_k) for n in ticks])
            ax.axvline(1.0, color="0.7", lw=0.8)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("n / d_k")
            ax.set_ylabel("recall")
        ax.set_title(f"{setting} (d_k = {d_k})")
        ax.grid(alpha=0.3)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        ncol = len(labels) if len(labels) <= 8 else -(-len(labels) // 2)  # one row, or two even ones
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.12 if len(labels) > 8 else 0.08) if handles else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- command line
def legend(d_k: int = 64, d_v: int | None = None, models: Sequence[str] = MODELS) -> str:
    """One line per memory: its label and its update rule with the fixed step sizes."""
    table = probes(d_k, d_v)
    w = max(len(m) for m in models)
    return "\n".join(f"  {m.ljust(w)}  {table[m].note}" for m in models if m in table) + "\n"


def cli_main(args) -> int:
    """`fastweights capacity`: run the probe, print the table, write the PNG (and the JSON).

    args: d_k, settings, models, seed, trials, out, json, form (an argparse Namespace)."""
    import json
    import sys
    import time

    from .. import cliargs

    settings = args.settings or list(SETTINGS)
    models = args.models or list(MODELS)
    threads = getattr(args, "threads", 1)
    try:  # everything the run will need, before the probe runs
        cliargs.threads("--threads", threads, zero_ok=True)
        cliargs.nonnegative("--seed", args.seed)
        cliargs.positive("--trials", args.trials)
        check_arguments(d_k=args.d_k, settings=settings, models=models, trials=args.trials)
        if args.json is not None:  # ('' too: refused, never read as "not given")
            cliargs.writable_file("--json", args.json)
        cliargs.writable_dir("--out", args.out)
    except ValueError as e:
        print(f"error: {cliargs.flag_message(e, ('d_k', 'trials', 'settings', 'models', 'seed'))}", file=sys.stderr)
        return 2
    if threads:  # the probe is thousands of tiny ops: one thread beats a pool that shares its cores
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    records = run_capacity(d_k=args.d_k, settings=settings, models=models, seed=args.seed, trials=args.trials,
                           form=getattr(args, "form", "fast"))
    wall = time.perf_counter() - t0
    print(f"capacity probe: d_k = d_v = {args.d_k}, {args.trials} trials, seed {args.seed}; recall = share of reads "
          "whose nearest stored value (cosine) is their own\n")
    print(format_table(records))
    print("memories:")
    print(legend(args.d_k, models=[m for m in models if m in MODELS]))
    png = plot_capacity(records, Path(args.out) / "capacity.png")
    print(f"plot: {png}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"json: {path}")
    print(f"probe time: {wall:.1f} s")
    return 0
