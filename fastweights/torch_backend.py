"""The torch backend: every (recipe class, form) in plain PyTorch — the reference the kernels are
tested against — plus the "compile" backend (the same chunk code through torch.compile).

Precision: this backend computes in `compute_dtype` of the inputs (fp32 for bf16/fp16/fp32,
float64 for float64), carries states in that precision and returns o in v's dtype. The cast, the
feature map and the expansion of grouped heads (H_q → H) happen here, in `prepare`, not at the
op boundary: other backends take the caller's tensors as they are.

Each `*_impl(call, **options)` below is one DISPATCH row (registered by `fastweights.registry`;
from the dispatch module it takes only FormNotAvailable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import constant_log_gammas
from .dispatch import FormNotAvailable
from .features import apply_feature_map
from .inputs import InputError, accepted_inputs, check_tensor, complete_state
from .recipe import FeatureMap, Recipe, has_bare_state, recipe_class
from .reference import parallel as par
from .reference import recurrent as rec
from .state import KVCache, MemoryState, MesaState, compute_dtype, state_map

Tensor = torch.Tensor

__all__ = ["Prepared", "prepare", "expand_heads", "no_tokens"]


def expand_heads(x: Tensor | None, groups: int, dim: int) -> Tensor | None:
    """Grouped value heads: repeat each of the H_q query/key heads `groups` times along `dim`
    (value head h reads q/k head h // groups)."""
    if x is None or groups == 1:
        return x
    return x.repeat_interleave(groups, dim=dim)


@dataclass
class Prepared:
    """A call's inputs as the torch reference computes with them: in the compute dtype,
    feature-mapped, with H heads everywhere and defaults filled in.

    q [B, T, H, K']; k [B, T, H, K'] (DeltaProduct [B, T, n, H, K']); v [B, T, H, V]
    ([B, T, n, H, V]); beta [B, T, H] ([B, T, n, H]); g None | [B, T, H] | [B, T, H, K'];
    p, w [B, T, H, ·]; nu, gamma [B, T, H]; lamb [H, K']; ln None | (γ, β) [H, V] each, the
    per-head affine of a residual-LN memory's LayerNorm (defaults 1 and 0)."""

    recipe: Recipe
    B: int
    T: int
    H: int
    K: int
    V: int
    n: int
    Kf: int
    cdt: torch.dtype
    out_dtype: torch.dtype
    scale: float
    q: Tensor
    k: Tensor
    v: Tensor
    beta: Tensor
    g: Tensor | None
    p: Tensor | None
    nu: Tensor | None
    gamma: Tensor | None
    lamb: Tensor
    w: Tensor | None
    ln: tuple[Tensor, Tensor] | None = None

    def steps(self, x: Tensor | None) -> Tensor | None:
        """x in the micro-step layout [B, T, n, H, ·] of the generic reference (a view for n = 1)."""
        return x if (x is None or self.n > 1) else x.unsqueeze(2)


def prepare(call, features: bool = True) -> Prepared:
    """The call's inputs as the torch forms take them; features=False leaves q, k (and p) raw [.., K] (the kernel
    trick's form, `chunkwise.omega`, applies φ itself; Kf is still the feature dimension K')."""
    recipe, s = call.recipe, call.shapes
    cdt = compute_dtype(call.q)
    dev = call.q.device
    B, T, H, n, Kf = s.B, s.T, s.H, s.n, s.Kf
    G = s.H // s.Hq
    fm = recipe.feature_map
    if not features:
        fm = FeatureMap()  # identity
    head = 3 if n > 1 else 2  # the head dim of k (and of DeltaProduct's v, beta)
    q = apply_feature_map(fm, expand_heads(call.q, G, 2).to(cdt))  # [B, T, H, K']
    k = apply_feature_map(fm, expand_heads(call.k, G, head).to(cdt))  # [B, T, (n,) H, K']
    v = call.v.to(cdt)  # [B, T, (n,) H, V]
    inputs = call.inputs
    beta = inputs.get("beta")
    if beta is None:
        beta = torch.ones(*((B, T, n, H) if n > 1 else (B, T, H)), dtype=cdt, device=dev)
    g = inputs.get("g")
    if recipe.retention.kind == "constant":
        g = constant_log_gammas(recipe.retention, H, cdt, dev).expand(B, T, H)  # [B, T, H]
    p = inputs.get("p")
    p = apply_feature_map(fm, expand_heads(p, G, 2).to(cdt)) if p is not None else None
    lamb = inputs.get("lamb")
    gamma = inputs.get("gamma")
    if recipe.objective.kind == "omega" and gamma is None:
        gamma = torch.ones(B, T, H, dtype=cdt, device=dev)

    def cast(x):
        return x.to(cdt) if x is not None else None

    ln = None
    if recipe.memory.residual_ln:
        lw, lb = inputs.get("ln_weight"), inputs.get("ln_bias")
        ln = (lw.to(cdt) if lw is not None else torch.ones(H, s.V, dtype=cdt, device=dev),
              lb.to(cdt) if lb is not None else torch.zeros(H, s.V, dtype=cdt, device=dev))

    return Prepared(recipe=recipe, B=B, T=T, H=H, K=s.K, V=s.V, n=n, Kf=Kf, cdt=cdt, out_dtype=call.v.dtype,
                    scale=call.scale, q=q, k=k, v=v, beta=beta.to(cdt), g=cast(g), p=p, nu=cast(inputs.get("nu")),
                    gamma=cast(gamma), w=cast(inputs.get("w")), ln=ln,
                    lamb=lamb.to(cdt) if lamb is not None else torch.ones(H, Kf, dtype=cdt, device=dev))


# ---------------------------------------------------------------------------- states
def memory_state(pr: Prepared, initial_state, rows: int | None = None) -> MemoryState:
    """The initial MemoryState in the compute dtype; `rows` is its batch (B, or N sequences with varlen)."""
    return initial_memory_state(pr.recipe, initial_state, pr.B if rows is None else rows, pr.H, pr.Kf, pr.V,
                                pr.cdt, pr.q.device)


def initial_memory_state(r: Recipe, initial_state, B: int, H: int, Kf: int, V: int, cdt: torch.dtype,
                         device) -> MemoryState:
    """`memory_state` from the call's facts alone (batch rows B, heads H, dims K', V, compute dtype, device):
    the state checked, completed and cast to `cdt` (a kernel row's glue, which prepares no tensors)."""
    if initial_state is None:
        if r.uses_autodiff:
            raise InputError(f"initial_state is required for {r.name}: the initial weights of an MLP or "
                             "residual-LN memory are outer parameters (fastweights.init_state makes them)")
        st = MemoryState(weights=(torch.zeros(B, H, Kf, V, dtype=cdt, device=device),))
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
        check_tensor("initial_state", st.weights[0], (B, H, Kf, V), values=False)
    else:
        first, last = st.weights[0], st.weights[-1]
        if first.shape[:3] != (B, H, Kf) or last.shape[-1] != V or last.shape[:2] != (B, H):
            raise InputError(f"initial_state.weights must go from [B, H, K', ·] = [{B}, {H}, {Kf}, ·] to "
                             f"[·, V={V}], got {[list(w.shape) for w in st.weights]}")
    if r.optimizer.minibatch > 1 and st.offset != 0 and st.anchor is None:
        raise InputError("initial_state.offset > 0 needs initial_state.anchor (the mini-batch start weights)")
    st = state_map(st, lambda x: x.to(cdt))
    return complete_state(r, st, B, H, Kf, V)


def finish_state(recipe: Recipe, st: MemoryState, output_final_state: bool):
    if not output_final_state:
        return None
    return st.weights[0] if has_bare_state(recipe) else st


def mesa_state(pr: Prepared, initial_state) -> MesaState:
    if initial_state is None:
        z = dict(dtype=pr.cdt, device=pr.q.device)
        return MesaState(H=torch.zeros(pr.B, pr.H, pr.Kf, pr.Kf, **z), G=torch.zeros(pr.B, pr.H, pr.Kf, pr.V, **z))
    if not isinstance(initial_state, MesaState):
        raise InputError(f"initial_state for {pr.recipe.name} must be a MesaState(H, G), "
                         f"got {type(initial_state).__name__}")
    check_tensor("initial_state.H", initial_state.H, (pr.B, pr.H, pr.Kf, pr.Kf), values=False)
    check_tensor("initial_state.G", initial_state.G, (pr.B, pr.H, pr.Kf, pr.V), values=False)
    return state_map(initial_state, lambda x: x.to(pr.cdt))


def normalizer_in(v: Tensor, S0: Tensor, st: MemoryState, normalize: bool):
    """A normalized memory (linear attention) carries z as the readout of an extra all-ones value
    column: v [.., V] → [.., V + 1], S0 [.., K', V] → [.., K', V + 1]."""
    if not normalize:
        return v, S0
    return (torch.cat([v, torch.ones_like(v[..., :1])], dim=-1),
            torch.cat([S0, st.normalizer[..., None]], dim=-1))


def normalizer_out(o: Tensor, S: Tensor, normalize: bool) -> tuple[Tensor, MemoryState]:
    """Undo `normalizer_in`: o / z and the MemoryState (weights, normalizer)."""
    if not normalize:
        return o, MemoryState(weights=(S,))
    return o[..., :-1] / (o[..., -1:] + 1e-6), MemoryState(weights=(S[..., :-1],), normalizer=S[..., -1])


# ---------------------------------------------------------------------------- implementations
def memory_recurrent_impl(call, inner_grad: str = "closed"):
    """gated_linear / delta / generic, recurrent: the generic per-token loop (reference/recurrent.py)."""
    pr = prepare(call)
    st = memory_state(pr, call.initial_state)
    o, final = rec.memory_recurrent(pr.recipe, pr.q, pr.steps(pr.k), pr.steps(pr.v), scale=pr.scale, g=pr.g,
                                    beta=pr.steps(pr.beta), p=pr.p, nu=pr.nu, gamma=pr.gamma, state=st,
                                    inner_grad=inner_grad, ln=pr.ln)
    return o.to(pr.out_dtype), finish_state(pr.recipe, final, call.output_final_state)


def linear_parallel_impl(call):
    """gated_linear / delta, parallel: the quadratic matrix form (reference/parallel.py)."""
    pr = prepare(call)
    st = memory_state(pr, call.initial_state)
    normalize = pr.recipe.memory.normalize
    v, S0 = normalizer_in(pr.steps(pr.v), st.weights[0], st, normalize)  # [B, T, n, H, V(+1)], [B, H, K', V(+1)]
    o, S = par.linear_parallel(pr.q, pr.steps(pr.k), v, scale=pr.scale, g=pr.g, beta=pr.steps(pr.beta), p=pr.p,
                               delta=recipe_class(pr.recipe) == "delta",
                               decay_first=pr.recipe.retention.decay_first, S0=S0)
    o, st = normalizer_out(o, S, normalize)
    return o.to(pr.out_dtype), finish_state(pr.recipe, st, call.output_final_state)


def _mesa(fn):
    def mesa_impl(call):
        pr = prepare(call)
        st = mesa_state(pr, call.initial_state)
        o, H, G = fn(pr.q, pr.k, pr.v, scale=pr.scale, g=pr.g, beta=pr.beta, lamb=pr.lamb, H0=st.H, G0=st.G)
        return o.to(pr.out_dtype), (MesaState(H=H, G=G) if call.output_final_state else None)
    mesa_impl.__doc__ = f"mesa: {fn.__module__}.{fn.__name__}"
    return mesa_impl


def _softmax(form: str):
    def softmax_impl(call):
        from .reference import softmax as sm

        pr = prepare(call)
        initial_state = call.initial_state
        if initial_state is not None:
            if not isinstance(initial_state, KVCache):
                raise InputError(f"initial_state for {pr.recipe.name} must be a KVCache, "
                                 f"got {type(initial_state).__name__}")
            L = initial_state.k.shape[1] if initial_state.k.dim() == 4 else -1
            check_tensor("initial_state.k", initial_state.k, (pr.B, L, pr.H, pr.K), values=False)
            check_tensor("initial_state.v", initial_state.v, (pr.B, L, pr.H, pr.V), values=False)
            initial_state = state_map(initial_state, lambda x: x.to(pr.cdt))
        fn = sm.softmax_recurrent if form == "recurrent" else sm.softmax_parallel
        beta = pr.beta if "beta" in accepted_inputs(pr.recipe) else None
        o, st = fn(pr.q, pr.k, pr.v, scale=pr.scale, objective=pr.recipe.objective.kind,
                   retention=pr.recipe.retention.kind, g=pr.g, beta=beta, w=pr.w,
                   initial_state=initial_state, output_final_state=call.output_final_state)
        return o.to(pr.out_dtype), st
    softmax_impl.__doc__ = f"softmax side, {form}: reference/softmax.py"
    return softmax_impl


def _no_varlen(recipe: Recipe, cu_seqlens):
    if cu_seqlens is not None:
        raise FormNotAvailable(f"cu_seqlens (varlen packing) is not implemented for {recipe.name}'s chunk form; "
                               "run the sequences as a padded batch or one call each")


def minibatch_chunk_impl(call, chunk_size: int = 64, cu_seqlens=None, ns=None, ns_precision: str = "ieee",
                         ns_mm=None):
    """generic, chunk: the inner mini-batch form (chunkwise/minibatch.py; chunks = the optimizer's mini-batches).
    ns: a kernel of Muon's Newton–Schulz (the Triton row's; None: the torch iteration); ns_precision: the torch
    iteration's products where it runs (`chunkwise.minibatch.NS_TORCH_PRECISIONS`: "ieee", or TF32 on CUDA); ns_mm:
    their kernel (the Triton row's at "tf32x3")."""
    from .chunkwise import omega
    from .chunkwise.minibatch import minibatch_chunk

    _no_varlen(call.recipe, cu_seqlens)
    if omega.applies(call.recipe) and omega.wide(call.shapes.Kf, call.shapes.V):  # OmegaNet's kind (gd: no
        # Newton–Schulz) with a wide state: the kernel trick on raw q, k
        pr = prepare(call, features=False)
        st = memory_state(pr, call.initial_state)
        o, final = omega.omega_chunk(pr.recipe, pr.q, pr.k, pr.v, scale=pr.scale, g=pr.g, beta=pr.beta,
                                     gamma=pr.gamma, state=st)
        return o.to(pr.out_dtype), finish_state(pr.recipe, final, call.output_final_state)
    pr = prepare(call)
    st = memory_state(pr, call.initial_state)
    o, final = minibatch_chunk(pr.recipe, pr.q, pr.k, pr.v, scale=pr.scale, g=pr.g, beta=pr.beta, nu=pr.nu,
                               gamma=pr.gamma, state=st, ln=pr.ln, ns=ns, ns_precision=ns_precision,
                               ns_mm=ns_mm)
    return o.to(pr.out_dtype), finish_state(pr.recipe, final, call.output_final_state)


def mesa_chunk_impl(call, chunk_size: int = 64, cu_seqlens=None, solve: str = "cg", cg_steps: int = 30, cg=None,
                    tf32: bool = False):
    """mesa, chunk: chunk-boundary states + chunked conjugate gradient (chunkwise/mesa.py). cg: a solver of the
    CG kernel's contract (the Triton row's `kernels.triton.memories.mesa_cg.mesa_cg`; None: the torch CG); tf32: the
    form's fp32 products on TF32 tensor cores, forward and backward (`chunkwise.mesa.tf32_matmuls`)."""
    from .chunkwise.mesa import mesa_chunk

    _no_varlen(call.recipe, cu_seqlens)
    pr = prepare(call)
    st = mesa_state(pr, call.initial_state)
    o, H, G, _ = mesa_chunk(pr.q, pr.k, pr.v, scale=pr.scale, g=pr.g, beta=pr.beta, lamb=pr.lamb, H0=st.H, G0=st.G,
                            chunk_size=chunk_size, solve=solve, cg_steps=cg_steps, cg=cg, tf32=tf32)
    return o.to(pr.out_dtype), (MesaState(H=H, G=G) if call.output_final_state else None)


def no_tokens(call, cu_seqlens=None):
    """A call with no token (T = 0 or B = 0), for every form and backend alike: o is empty [B, T, H, V] (v's dtype)
    and the final state is the initial one, as the forms return it (compute dtype, typed state
    completed; zeros when none was given; one row per sequence with cu_seqlens)."""
    from .chunkwise.varlen import num_sequences

    cls = recipe_class(call.recipe)
    if cls == "softmax":  # the recurrence over no token (or over T tokens of an empty batch)
        return _softmax("recurrent")(call)
    pr = prepare(call)
    o = call.v.new_zeros(pr.B, pr.T, pr.H, pr.V)
    if not call.output_final_state:
        return o, None
    if cls == "mesa":
        return o, mesa_state(pr, call.initial_state)
    st = memory_state(pr, call.initial_state, rows=num_sequences(cu_seqlens, pr.B, pr.T))
    return o, finish_state(pr.recipe, st, True)


_COMPILED: dict = {}


def _compiled(fn):
    """fn through torch.compile, compiled once per process (recompiling per new shape as torch.compile does)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def _linear_chunk(compile: bool):
    def linear_chunk_impl(call, chunk_size: int = 64, cu_seqlens=None):
        """gated_linear / delta, chunk: chunkwise.chunk_gated / chunkwise.chunk_delta (a normalizer
        rides along as an extra value column, as in the parallel form)."""
        from .chunkwise import chunk_delta, chunk_gated
        from .chunkwise.delta import default_inverse
        from .chunkwise.varlen import num_sequences

        pr = prepare(call)
        rows = num_sequences(cu_seqlens, pr.B, pr.T)
        st = memory_state(pr, call.initial_state, rows=rows)
        normalize = pr.recipe.memory.normalize
        v, S0 = normalizer_in(pr.v, st.weights[0], st, normalize)  # [B, T, (n,) H, V(+1)], [B or N, H, K', V(+1)]
        common = dict(scale=pr.scale, g=pr.g, beta=pr.beta, initial_state=S0, output_final_state=True,
                      chunk_size=chunk_size, cu_seqlens=cu_seqlens)
        if recipe_class(pr.recipe) == "delta":
            fn = _compiled(chunk_delta) if compile else chunk_delta
            o, S = fn(pr.q, pr.k, v, p=pr.p, decay_first=pr.recipe.retention.decay_first,
                      inverse=default_inverse(pr.q.device), **common)
        else:
            fn = _compiled(chunk_gated) if compile else chunk_gated
            o, S = fn(pr.q, pr.k, v, **common)
        o, st = normalizer_out(o, S, normalize)
        return o.to(pr.out_dtype), finish_state(pr.recipe, st, call.output_final_state)
    return linear_chunk_impl


def generic_chunk_exists(recipe: Recipe, target) -> str | None:
    """Why the generic class has no chunk form for `recipe` (None: it has one, the mini-batch form)."""
    opt = recipe.optimizer
    if opt.minibatch == 1:
        return ("its gradients are taken at the running state token by token, which has no exact "
                "chunkwise form; set optimizer.minibatch > 1 (as TTT, Titans and ATLAS train) for one")
    if recipe.objective.probe or opt.householder_steps > 1 or recipe.memory.normalize:
        return "the mini-batch chunk form covers plain per-token writes (no probe, Householder steps or normalizer)"
    return None


#: The rows' implementations, by name (registered by `fastweights.registry`).
mesa_recurrent_impl = _mesa(rec.mesa_recurrent)
mesa_parallel_impl = _mesa(par.mesa_parallel)
softmax_recurrent_impl = _softmax("recurrent")
softmax_parallel_impl = _softmax("parallel")
linear_chunk_impl = _linear_chunk(compile=False)
linear_chunk_compiled_impl = _linear_chunk(compile=True)
