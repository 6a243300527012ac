"""The functional API: one call per form, the same signature for every recipe.

    o, final_state = fastweights.recurrent(model, q, k, v, *, scale=None, initial_state=None,
                                           output_final_state=False, **inputs)
    o, final_state = fastweights.parallel(...)   # same signature
    o, final_state = fastweights.chunk(..., chunk_size=64, cu_seqlens=None, backend="auto")

`model` is a zoo name or a Recipe; the per-token inputs (g, beta, p, nu, gamma, lamb, w) are
documented in fastweights.inputs. The functional forms apply the recipe's feature map; they do
not L2-normalize q or k (that is the layer's job). Default scale: the recipe's, else K^-0.5.

Which implementation serves which (recipe class, form) is the one table `DISPATCH` below.
"""

from __future__ import annotations

import torch

from .features import apply_feature_map
from .inputs import InputError, Shapes, complete_state, validate
from .recipe import Recipe
from .reference import parallel as par
from .reference import recurrent as rec
from .state import KVCache, MemoryState, MesaState, state_map
from .zoo import resolve

Tensor = torch.Tensor

__all__ = ["recurrent", "parallel", "chunk", "forms", "recipe_class", "unavailable_reason", "FormNotAvailable",
           "DISPATCH"]

FORMS = ("recurrent", "parallel", "chunk")


class FormNotAvailable(NotImplementedError):
    """The asked form does not exist for this recipe; the message lists the forms that do."""


def recipe_class(recipe: Recipe) -> str:
    """The algorithm family a recipe belongs to (what decides which forms exist).

    softmax:      kv memory (softmax, FoX, ALiBi, DeltaFormer, PaTH)
    mesa:         exact least squares
    gated_linear: plain linear memory, dot objective, one GD step per token (LA, RetNet, Mamba2, GLA)
    delta:        plain linear memory, l2 objective, one GD step per token (rank-1 writes, any
                  number of Householder steps; DeltaNet, GDN, Comba, DeltaProduct, KDA)
    memory:       everything else, served by the generic recurrence (MLP and residual-LN
                  memories, momentum, Muon, Omega windows, inner mini-batches)
    """
    if recipe.is_softmax:
        return "softmax"
    if recipe.is_mesa:
        return "mesa"
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    simple = mem.is_plain_linear and opt.kind == "gd" and opt.minibatch == 1 and obj.window == 1
    if simple and obj.kind == "dot":
        return "gated_linear"
    if simple and obj.kind == "l2":
        return "delta"
    return "memory"


def _bare_state(recipe: Recipe) -> bool:
    """Recipes whose whole state is S [B, H, K, V]: final_state is then a bare tensor."""
    return recipe_class(recipe) in ("gated_linear", "delta") and not recipe.memory.normalize


# ---------------------------------------------------------------------------- preparation
class _Prepared:
    """Inputs in the compute dtype, feature-mapped, with defaults filled in."""

    def __init__(self, recipe: Recipe, q, k, v, scale, inputs, shapes: Shapes):
        self.recipe, self.shapes = recipe, shapes
        self.out_dtype = v.dtype
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.cdt = cdt
        B, T, H, K, n = shapes.B, shapes.T, shapes.H, shapes.K, shapes.n
        self.scale = float(scale) if scale is not None else (recipe.scale if recipe.scale is not None else K ** -0.5)
        fm = recipe.feature_map
        self.q = apply_feature_map(fm, q.to(cdt))  # [B, T, H, K']
        k = k.to(cdt) if n > 1 else k.to(cdt).unsqueeze(2)  # [B, T, n, H, K]
        v = v.to(cdt) if n > 1 else v.to(cdt).unsqueeze(2)  # [B, T, n, H, V]
        self.k = apply_feature_map(fm, k)  # [B, T, n, H, K']
        self.v = v
        beta = inputs.get("beta")
        if beta is None:
            self.beta = torch.ones(B, T, n, H, dtype=cdt, device=q.device)  # [B, T, n, H]
        else:
            self.beta = beta.to(cdt) if n > 1 else beta.to(cdt).unsqueeze(2)  # [B, T, n, H]
        g = inputs.get("g")
        if recipe.retention.kind == "constant":
            lg = torch.tensor(recipe.retention.log_gammas(H), dtype=cdt, device=q.device)
            g = lg.expand(B, T, H)  # [B, T, H]
        self.g = g.to(cdt) if g is not None else None
        p = inputs.get("p")
        self.p = apply_feature_map(fm, p.to(cdt)) if p is not None else None
        self.nu = inputs["nu"].to(cdt) if inputs.get("nu") is not None else None
        self.gamma = inputs["gamma"].to(cdt) if inputs.get("gamma") is not None else None
        lamb = inputs.get("lamb")
        self.lamb = lamb.to(cdt) if lamb is not None else torch.ones(H, shapes.Kf, dtype=cdt, device=q.device)
        self.w = inputs["w"].to(cdt) if inputs.get("w") is not None else None
        if recipe.objective.kind == "omega" and self.gamma is None:
            self.gamma = torch.ones(B, T, H, dtype=cdt, device=q.device)
        self.ln = None  # residual-LN memories: the LayerNorm's per-head affine (γ, β) [H, V]
        if recipe.memory.residual_ln:
            lw, lb = inputs.get("ln_weight"), inputs.get("ln_bias")
            self.ln = (lw.to(cdt) if lw is not None else torch.ones(H, shapes.V, dtype=cdt, device=q.device),
                       lb.to(cdt) if lb is not None else torch.zeros(H, shapes.V, dtype=cdt, device=q.device))


def _check_state_tensor(name, x, shape):
    if not isinstance(x, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"{name} must be floating point, got {x.dtype}")


def _memory_state(pr: _Prepared, initial_state, rows: int | None = None) -> MemoryState:
    """The initial MemoryState in the compute dtype; `rows` is its batch (B, or N sequences with varlen)."""
    r, s = pr.recipe, pr.shapes
    B, H, Kf, V = (s.B if rows is None else rows), s.H, s.Kf, s.V
    if initial_state is None:
        if r.uses_autodiff:
            raise InputError(f"initial_state is required for {r.name}: the initial weights of an MLP or "
                             "residual-LN memory are outer parameters (fastweights.init_state makes them)")
        st = MemoryState(weights=(torch.zeros(B, H, Kf, V, dtype=pr.cdt, device=pr.q.device),))
    elif isinstance(initial_state, Tensor):
        if r.memory.kind != "linear":
            raise InputError(f"initial_state for {r.name} must be a MemoryState (MLP weights), got a tensor")
        st = MemoryState(weights=(initial_state,))
    elif isinstance(initial_state, MemoryState):
        st = initial_state
    else:
        raise InputError(f"initial_state for {r.name} must be a tensor [B, H, K, V] or a MemoryState, "
                         f"got {type(initial_state).__name__}")
    layers = 1 if r.memory.kind == "linear" else r.memory.depth
    count = layers * (2 if r.memory.bias else 1)  # (W_1, b_1, …) with inner biases
    if len(st.weights) != count:
        what = "(weight, bias) per layer" if r.memory.bias else "one matrix per layer"
        raise InputError(f"initial_state.weights for {r.name} must hold {count} tensors ({what}, {layers} "
                         f"layer{'s' if layers > 1 else ''}), got {len(st.weights)}")
    if r.memory.kind == "linear":
        _check_state_tensor("initial_state", st.weights[0], (B, H, Kf, V))
    else:
        first, last = st.weights[0], st.weights[-1]
        if first.shape[:3] != (B, H, Kf) or last.shape[-1] != V or last.shape[:2] != (B, H):
            raise InputError(f"initial_state.weights must go from [B, H, K', ·] = [{B}, {H}, {Kf}, ·] to "
                             f"[·, V={V}], got {[list(w.shape) for w in st.weights]}")
    if r.optimizer.minibatch > 1 and st.offset != 0 and st.anchor is None:
        raise InputError("initial_state.offset > 0 needs initial_state.anchor (the mini-batch start weights)")
    st = state_map(st, lambda x: x.to(pr.cdt))
    return complete_state(r, st, B, H, Kf, V)


def _finish_state(recipe, st: MemoryState, output_final_state: bool):
    if not output_final_state:
        return None
    return st.weights[0] if _bare_state(recipe) else st


# ---------------------------------------------------------------------------- implementations
def _memory_recurrent(pr: _Prepared, initial_state, output_final_state, inner_grad="closed"):
    st = _memory_state(pr, initial_state)
    o, final = rec.memory_recurrent(pr.recipe, pr.q, pr.k, pr.v, scale=pr.scale, g=pr.g, beta=pr.beta,
                                    p=pr.p, nu=pr.nu, gamma=pr.gamma, state=st, inner_grad=inner_grad, ln=pr.ln)
    return o.to(pr.out_dtype), _finish_state(pr.recipe, final, output_final_state)


def _normalizer_in(v: Tensor, S0: Tensor, st: MemoryState, normalize: bool):
    """A normalized memory (linear attention) carries z as the readout of an extra all-ones value
    column: v [.., V] → [.., V + 1], S0 [.., K', V] → [.., K', V + 1]."""
    if not normalize:
        return v, S0
    return (torch.cat([v, torch.ones_like(v[..., :1])], dim=-1),
            torch.cat([S0, st.normalizer[..., None]], dim=-1))


def _normalizer_out(o: Tensor, S: Tensor, normalize: bool) -> tuple[Tensor, MemoryState]:
    """Undo `_normalizer_in`: o / z and the MemoryState (weights, normalizer)."""
    if not normalize:
        return o, MemoryState(weights=(S,))
    return o[..., :-1] / (o[..., -1:] + 1e-6), MemoryState(weights=(S[..., :-1],), normalizer=S[..., -1])


def _linear_parallel(pr: _Prepared, initial_state, output_final_state):
    st = _memory_state(pr, initial_state)
    normalize = pr.recipe.memory.normalize
    v, S0 = _normalizer_in(pr.v, st.weights[0], st, normalize)  # [B, T, n, H, V(+1)], [B, H, K', V(+1)]
    o, S = par.linear_parallel(pr.q, pr.k, v, scale=pr.scale, g=pr.g, beta=pr.beta, p=pr.p,
                               delta=recipe_class(pr.recipe) == "delta",
                               decay_first=pr.recipe.retention.decay_first, S0=S0)
    o, st = _normalizer_out(o, S, normalize)
    return o.to(pr.out_dtype), _finish_state(pr.recipe, st, output_final_state)


def _mesa_state(pr: _Prepared, initial_state) -> MesaState:
    s = pr.shapes
    if initial_state is None:
        z = dict(dtype=pr.cdt, device=pr.q.device)
        return MesaState(H=torch.zeros(s.B, s.H, s.Kf, s.Kf, **z), G=torch.zeros(s.B, s.H, s.Kf, s.V, **z))
    if not isinstance(initial_state, MesaState):
        raise InputError(f"initial_state for {pr.recipe.name} must be a MesaState(H, G), "
                         f"got {type(initial_state).__name__}")
    _check_state_tensor("initial_state.H", initial_state.H, (s.B, s.H, s.Kf, s.Kf))
    _check_state_tensor("initial_state.G", initial_state.G, (s.B, s.H, s.Kf, s.V))
    return state_map(initial_state, lambda x: x.to(pr.cdt))


def _mesa(fn):
    def run(pr: _Prepared, initial_state, output_final_state):
        st = _mesa_state(pr, initial_state)
        o, H, G = fn(pr.q, pr.k[:, :, 0], pr.v[:, :, 0], scale=pr.scale, g=pr.g, beta=pr.beta[:, :, 0],
                     lamb=pr.lamb, H0=st.H, G0=st.G)
        return o.to(pr.out_dtype), (MesaState(H=H, G=G) if output_final_state else None)
    return run


def _softmax(form):
    def run(pr: _Prepared, initial_state, output_final_state):
        from .reference import softmax as sm

        s = pr.shapes
        if initial_state is not None:
            if not isinstance(initial_state, KVCache):
                raise InputError(f"initial_state for {pr.recipe.name} must be a KVCache, "
                                 f"got {type(initial_state).__name__}")
            L = initial_state.k.shape[1] if initial_state.k.dim() == 4 else -1
            _check_state_tensor("initial_state.k", initial_state.k, (s.B, L, s.H, s.K))
            _check_state_tensor("initial_state.v", initial_state.v, (s.B, L, s.H, s.V))
            initial_state = state_map(initial_state, lambda x: x.to(pr.cdt))
        fn = sm.softmax_recurrent if form == "recurrent" else sm.softmax_parallel
        beta = pr.beta[:, :, 0] if "beta" in _accepted(pr.recipe) else None
        o, st = fn(pr.q, pr.k[:, :, 0], pr.v[:, :, 0], scale=pr.scale, objective=pr.recipe.objective.kind,
                   retention=pr.recipe.retention.kind, g=pr.g, beta=beta, w=pr.w,
                   initial_state=initial_state, output_final_state=output_final_state)
        return o.to(pr.out_dtype), st
    return run


def _accepted(recipe):
    from .inputs import accepted_inputs
    return accepted_inputs(recipe)


def _no_compile(recipe, backend):
    if backend == "compile":
        raise InputError(f"backend='compile' serves the gated-linear and delta classes; {recipe.name}'s chunk "
                         "form runs with backend='torch' (or wrap the call in torch.compile yourself)")


def _minibatch_chunk(pr: _Prepared, initial_state, output_final_state, chunk_size=64, cu_seqlens=None,
                     backend="auto"):
    from .chunkwise.minibatch import minibatch_chunk

    _no_compile(pr.recipe, backend)
    _no_varlen(pr.recipe, cu_seqlens)
    st = _memory_state(pr, initial_state)
    o, final = minibatch_chunk(pr.recipe, pr.q, pr.k[:, :, 0], pr.v[:, :, 0], scale=pr.scale, g=pr.g,
                               beta=pr.beta[:, :, 0], nu=pr.nu, gamma=pr.gamma, state=st, ln=pr.ln)
    return o.to(pr.out_dtype), _finish_state(pr.recipe, final, output_final_state)


def _mesa_chunk(pr: _Prepared, initial_state, output_final_state, chunk_size=64, cu_seqlens=None,
                backend="auto", solve="cg", cg_steps=30):
    from .chunkwise.mesa import mesa_chunk

    _no_compile(pr.recipe, backend)
    _no_varlen(pr.recipe, cu_seqlens)
    st = _mesa_state(pr, initial_state)
    o, H, G, _ = mesa_chunk(pr.q, pr.k[:, :, 0], pr.v[:, :, 0], scale=pr.scale, g=pr.g, beta=pr.beta[:, :, 0],
                            lamb=pr.lamb, H0=st.H, G0=st.G, chunk_size=chunk_size, solve=solve, cg_steps=cg_steps)
    return o.to(pr.out_dtype), (MesaState(H=H, G=G) if output_final_state else None)


def _num_sequences(pr: _Prepared, cu_seqlens) -> int | None:
    """N for a valid cu_seqlens (int [N+1], 0 = cu[0] ≤ … ≤ cu[N] = T, B = 1); None without varlen."""
    if cu_seqlens is None:
        return None
    from .chunkwise.varlen import check_cu_seqlens

    return len(check_cu_seqlens(cu_seqlens, pr.shapes.B, pr.shapes.T)) - 1


_COMPILED: dict = {}


def _core(fn, backend: str):
    """The chunk core itself (backend "auto"/"torch") or its torch.compile'd twin ("compile",
    compiled once per process and core; recompiles per new shape as torch.compile does)."""
    if backend != "compile":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def _linear_chunk(pr: _Prepared, initial_state, output_final_state, chunk_size=64, cu_seqlens=None,
                  backend="auto"):
    """Gated-linear and delta classes: chunkwise.chunk_gated / chunkwise.chunk_delta (a
    normalizer rides along as an extra value column, as in the parallel form)."""
    from .chunkwise import chunk_delta, chunk_gated

    rows = _num_sequences(pr, cu_seqlens)
    st = _memory_state(pr, initial_state, rows=rows)
    normalize = pr.recipe.memory.normalize
    v, S0 = _normalizer_in(pr.v, st.weights[0], st, normalize)  # [B, T, n, H, V(+1)], [B or N, H, K', V(+1)]
    n = pr.shapes.n
    k = pr.k if n > 1 else pr.k[:, :, 0]  # [B, T, n, H, K'] or [B, T, H, K']
    v = v if n > 1 else v[:, :, 0]
    beta = pr.beta if n > 1 else pr.beta[:, :, 0]
    common = dict(scale=pr.scale, g=pr.g, beta=beta, initial_state=S0, output_final_state=True,
                  chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if recipe_class(pr.recipe) == "delta":
        o, S = _core(chunk_delta, backend)(pr.q, k, v, p=pr.p, decay_first=pr.recipe.retention.decay_first,
                                           **common)
    else:
        o, S = _core(chunk_gated, backend)(pr.q, k, v, **common)
    o, st = _normalizer_out(o, S, normalize)
    return o.to(pr.out_dtype), _finish_state(pr.recipe, st, output_final_state)


def _no_varlen(recipe, cu_seqlens):
    if cu_seqlens is not None:
        raise FormNotAvailable(f"cu_seqlens (varlen packing) is not implemented for {recipe.name}'s chunk form; "
                               "run the sequences as a padded batch or one call each")


#: (recipe class, form) -> implementation.
DISPATCH = {
    ("gated_linear", "chunk"): _linear_chunk,
    ("delta", "chunk"): _linear_chunk,
    ("mesa", "chunk"): _mesa_chunk,
    ("memory", "chunk"): _minibatch_chunk,
    ("softmax", "recurrent"): _softmax("recurrent"),
    ("softmax", "parallel"): _softmax("parallel"),
    ("mesa", "recurrent"): _mesa(rec.mesa_recurrent),
    ("mesa", "parallel"): _mesa(par.mesa_parallel),
    ("gated_linear", "recurrent"): _memory_recurrent,
    ("gated_linear", "parallel"): _linear_parallel,
    ("delta", "recurrent"): _memory_recurrent,
    ("delta", "parallel"): _linear_parallel,
    ("memory", "recurrent"): _memory_recurrent,
}


def unavailable_reason(recipe: Recipe, form: str) -> str | None:
    """Why `form` does not exist for `recipe` (None when it does)."""
    cls = recipe_class(recipe)
    if (cls, form) not in DISPATCH:
        return f"no {form} algorithm is exact for the {cls} class"
    if form == "chunk" and cls == "memory":
        opt = recipe.optimizer
        if opt.minibatch == 1:
            return ("its gradients are taken at the running state token by token, which has no exact "
                    "chunkwise form; set optimizer.minibatch > 1 (as TTT, Titans and ATLAS train) for one")
        if recipe.objective.probe or opt.householder_steps > 1 or recipe.memory.normalize:
            return "the mini-batch chunk form covers plain per-token writes (no probe, Householder steps or normalizer)"
    return None


def forms(model) -> list[str]:
    """The forms that exist for a model (zoo name or Recipe)."""
    recipe = resolve(model)
    return [f for f in FORMS if unavailable_reason(recipe, f) is None]


def _run(form: str, model, q, k, v, scale, initial_state, output_final_state, inputs, check_values=True, **extra):
    recipe = resolve(model)
    reason = unavailable_reason(recipe, form)
    if reason is not None:
        raise FormNotAvailable(f"the {form} form does not exist for {recipe.name}: {reason}; "
                               f"available forms: {', '.join(forms(recipe))}")
    impl = DISPATCH[(recipe_class(recipe), form)]
    shapes = validate(recipe, q, k, v, inputs, check_values=check_values)
    pr = _Prepared(recipe, q, k, v, scale, inputs, shapes)
    return impl(pr, initial_state, output_final_state, **extra)


def recurrent(model, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, initial_state=None,
              output_final_state: bool = False, inner_grad: str = "closed", check_values: bool = True, **inputs):
    """The exact per-token recurrence (any dtype, float64 included); also the decode step.

    Args:
        model: zoo name or Recipe.
        q, k: [B, T, H, K]; v: [B, T, H, V] (DeltaProduct: k [B, T, n_h, H, K], v [B, T, n_h, H, V]).
        scale: query multiplier; default the recipe's, else K^-0.5.
        initial_state: S [B, H, K', V] (plain linear memories), MemoryState, MesaState or KVCache.
        output_final_state: also return the state after the last token.
        inner_grad: "closed" (hand-written backprop through the memory) or "autodiff"
            (torch.func.grad); both exact.
        check_values: False skips the input checks that read tensor values (finite, g ≤ 0, β
            range, λ > 0), each a GPU synchronization; shapes and dtypes are always checked. The
            layers pass False: they build these inputs by construction.
        **inputs: g, beta, p, nu, gamma, lamb, w as the recipe takes (fastweights.inputs).
    Returns:
        (o [B, T, H, V] in v's dtype, final state or None).
    """
    if inner_grad not in ("closed", "autodiff"):
        raise InputError(f"inner_grad must be 'closed' or 'autodiff', got {inner_grad!r}")
    recipe = resolve(model)
    extra = {"inner_grad": inner_grad} if recipe_class(recipe) in ("gated_linear", "delta", "memory") else {}
    return _run("recurrent", recipe, q, k, v, scale, initial_state, output_final_state, inputs, check_values,
                **extra)


def parallel(model, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, initial_state=None,
             output_final_state: bool = False, check_values: bool = True, **inputs):
    """The quadratic matrix form (same signature and results as `recurrent`)."""
    return _run("parallel", model, q, k, v, scale, initial_state, output_final_state, inputs, check_values)


def chunk(model, q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = 64, scale: float | None = None,
          initial_state=None, output_final_state: bool = False, cu_seqlens: Tensor | None = None,
          backend: str = "auto", check_values: bool = True, **inputs):
    """The chunkwise-parallel training form: same signature and results as `recurrent`.

    Args (beyond `recurrent`'s):
        chunk_size: tokens per chunk (gated-linear, delta and Mesa classes; mini-batch memories
            chunk by their own optimizer.minibatch).
        cu_seqlens: int tensor [N+1] (flash-attention's varlen convention, B = 1) packing N
            sequences; initial_state and the final state then have N rows.
        backend: "torch" (plain PyTorch, eager), "compile" (the same code through torch.compile:
            fewer kernels, a one-time compile of about a minute; gated-linear and delta classes)
            or "auto" (the fastest implementation that needs no compile step: "torch" until
            the Triton kernels land).
        mesa_solve, cg_steps (Mesa only): "cg" (default, `cg_steps` = 30 iterations) or "exact".
    """
    if backend not in ("auto", "torch", "compile"):
        raise InputError(f"backend must be 'auto', 'torch' or 'compile', got {backend!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    extra = {}
    for key, name in (("mesa_solve", "solve"), ("cg_steps", "cg_steps")):
        if key in inputs:
            extra[name] = inputs.pop(key)
    return _run("chunk", model, q, k, v, scale, initial_state, output_final_state, inputs, check_values,
                chunk_size=chunk_size, cu_seqlens=cu_seqlens, backend=backend, **extra)
