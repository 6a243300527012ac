"""The Triton rows of the dispatch table (registered by `fastweights.registry`), safe to import
without Triton: the predicates look only at the recipe and the call's Target, and
`fastweights.kernels.triton` (whose `@triton.jit` decorators read TRITON_INTERPRET when they run)
is imported on a row's first call. Each predicate refuses what its kernels refuse, so "auto"
never takes a row that would raise.

gated_linear / chunk / triton      →  `gated_linear_chunk` → kernels.triton.gated.chunk_gated_triton
                                      (pipelines "staged", "fused": `gated_chunk_pipeline`)
gated_linear / recurrent / triton  →  `linear_recurrent`   → kernels.triton.decode.fused_recurrent_step
delta / recurrent / triton         →  `linear_recurrent`   (the delta rule, decay first or after)
delta / chunk / triton             →  `delta_chunk`        → kernels.triton.delta.chunk_delta_triton
                                      (DeltaNet, GDN, KDA, Comba's probe key and decay after,
                                      DeltaProduct's micro-steps: all checked on the H100, picked by "auto";
                                      staged / fused forward and backward: `delta_chunk_pipeline`)
generic / chunk / triton           →  `generic_chunk`      → torch_backend's mini-batch form with Muon's
                                      Newton–Schulz in kernels.triton.memories.newton_schulz (ATLAS; Gram side ≤ 32:
                                      limits.NS_KERNEL_MAX_DIM);
                                      TTT-Linear: `ttt_linear_chunk` → kernels.triton.memories.ttt (the whole inner
                                      loop, forward and backward; on the H100: BENCHMARKS §1j);
                                      TTT-MLP: `ttt_mlp_chunk` → kernels.triton.memories.ttt_mlp (the same for a
                                      2-layer MLP memory; interpreter-verified, not yet run on a GPU);
                                      Titans: `titans_chunk` → kernels.triton.memories.titans (its loop, forward
                                      and backward; interpreter-verified, not yet run on a GPU)
layer / conv / triton              →  kernels.triton.layer.conv.short_conv
layer / norm / triton              →  `gated_rms_norm` → kernels.triton.layer.norm.gated_rms_norm
layer / prologue / triton          →  `delta_prologue` → kernels.triton.layer.prologue.delta_prologue
mesa / chunk / triton              →  `mesa_chunk` → torch_backend's Mesa chunk form with both CG solves
                                      in kernels.triton.memories.mesa_cg (pipeline "CG kernel"; C ≤ 64, K ≤ 128,
                                      not float64; tl.dot at TF32 for bf16 q, k, v)

The recurrent rows are what a layer's decoding step runs on CUDA (`MemoryMixer.step` uses the
recurrent form, routed per call like every other). The functional form never changes the
caller's tensors, so the row copies the initial state into a fresh fp32 state and the kernel
updates that one in place: the state is read twice and written twice per call. A serving engine
that owns a pool of states calls `fused_recurrent_step(..., state_indices=...)` directly and pays
one read and one write. Gradients: the kernel has no backward, so when autograd records the call
the backward recomputes the torch reference recurrence (`torch_backend.memory_recurrent_impl`) on
the saved inputs and differentiates that — the same function, so the same gradients.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from contextlib import contextmanager
from functools import lru_cache, partial

import torch

from ..constants import constant_log_gammas
from ..recipe import Recipe
from ..state import MemoryState
from ..torch_backend import finish_state, generic_chunk_exists, memory_recurrent_impl, minibatch_chunk_impl
from .pipelines import DELTA_PIPELINES, GATED_PIPELINES, DeltaPipeline, GatedPipeline, delta_pipeline, gated_pipeline
from .variants import alternatives as _alternatives
from .variants import (
    conv_backward,
    delta_fused_backward,
    delta_fused_forward,
    delta_split_forward,
    gated_fused_forward,
    live_launch,
    split_forward_on,
    titans_backward,
    titans_single_backward,
    ttt_linear,
    ttt_linear_backward,
    ttt_mlp,
)
from .variants import titans as titans_variant

__all__ = ["gated_linear_chunk", "delta_chunk", "linear_recurrent", "short_conv", "short_conv_joint", "gated_rms_norm",
           "delta_prologue", "generic_chunk", "triton_generic_supports", "delta_chunk_pipeline",
           "gated_chunk_pipeline", "generic_chunk_pipeline", "ttt_linear_chunk", "ttt_linear_kernel_serves",
           "ttt_mlp_chunk", "ttt_mlp_kernel_serves", "titans_chunk", "titans_kernel_serves",
           "DELTA_PIPELINES", "GATED_PIPELINES", "GENERIC_PIPELINES",
           "triton_chunk_supports", "pinned",
           "triton_step_supports", "triton_conv_supports", "triton_norm_supports", "triton_prologue_supports",
           "MAX_HEAD_DIM", "delta_chunk_variants", "gated_chunk_variants", "generic_chunk_variants",
           "short_conv_variants", "delta_chunk_alternatives", "gated_chunk_alternatives", "generic_chunk_alternatives",
           "short_conv_alternatives"]

from .triton.args import MAX_HEAD_DIM  # imports torch only (no triton)
from .triton.common.limits import (
    MAX_CONV_WIDTH,
    MAX_GROUP,
    MAX_TTT_DIM,
    NS_KERNEL_MAX_DIM,
    NS_PRECISION,
    TITANS_MAX_DIM,
    TITANS_PRECISION,
    TTT_LINEAR_PRECISION,
    TTT_MINIBATCHES,
    TTT_MLP_PRECISION,
    loop_precision,
    titans_pipeline,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru_cache(maxsize=1)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_device_supports(target) -> str | None:
    """Why no Triton row can serve the call's device and dtype (None when they can):
    - a CUDA device: Triton compiles for GPUs (CPU tensors run only under the interpreter, which the
      tests use by calling a row directly, or by `tests/fake_cuda.py`);
    - triton importable (the `gpu` extra);
    - fp32, bf16 or fp16: the kernels accumulate in fp32; float64 stays on the torch reference."""
    if target.device_type != "cuda":
        return f"the Triton kernels run on CUDA devices, not {target.device_type}"
    if not _triton_installed():
        return "triton is not installed (pip install 'fastweights[gpu]')"
    if target.dtype is not None and target.dtype not in _DTYPES:
        return f"the Triton kernels take fp32, bf16 or fp16 inputs, not {target.dtype}"
    return None


def triton_memory_supports(recipe: Recipe, target) -> str | None:
    """Why the Triton memory rows (chunk and recurrent) cannot serve (None when they can): as
    `triton_device_supports`, and
    - the identity feature map: the kernels read q and k as given (a feature map would be a pass over
      them, or a fused load, not written yet);
    - no normalizer: linear attention's z would ride as an extra value column (V + 1), not wired yet;
    - no, constant, scalar or diagonal retention;
    - K, V ≤ 256: the dq/dk kernel keeps a whole key row of 16 tokens in one tile."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    if recipe.feature_map.kind != "identity":
        return f"the Triton kernels take the identity feature map, not {recipe.feature_map.kind}"
    if recipe.memory.normalize:
        return "the Triton kernels do not carry the normalizer of linear attention yet"
    if recipe.retention.kind not in ("none", "constant", "scalar", "diagonal"):
        return f"the Triton kernels take no, constant, scalar or diagonal retention, not {recipe.retention.kind}"
    for name, d in (("K", target.head_k_dim), ("V", target.head_v_dim)):
        if d is not None and d > MAX_HEAD_DIM:
            return f"the Triton kernels take head dims ≤ {MAX_HEAD_DIM}, got {name}={d}"
    return None


def triton_chunk_supports(recipe: Recipe, target) -> str | None:
    """Why the chunk Triton rows (gated-linear and delta) cannot serve (None when they can): as
    `triton_memory_supports`, and a chunk size that is a power of two ≥ 16 (`args.check_chunk_args`:
    the chunk is a tile dimension; DeltaProduct's chunk counts micro-steps). The delta kernels take
    the decay first or after, a probe key (Comba) and Householder micro-steps (DeltaProduct)."""
    why = triton_memory_supports(recipe, target)
    if why is not None:
        return why
    C = target.chunk_size
    if C is not None and (C < 16 or C & (C - 1)):
        return f"the Triton chunk kernels take a chunk size that is a power of two ≥ 16, got {C}"
    return None


def _ttt_loop_serves(recipe: Recipe, kernels: str) -> str | None:
    """Why TTT's inner loop around the memory is not what `kernels` (the TTT kernels' name) take (None when it
    is): the l2 objective (no window, no probe), TTT's averaged gd over mini-batches of b ∈ TTT_MINIBATCHES, no
    retention, the identity feature map."""
    obj, opt = recipe.objective, recipe.optimizer
    if recipe.feature_map.kind != "identity" or recipe.retention.kind != "none":
        return f"the {kernels} kernels take the identity feature map and no retention"
    if not (obj.kind == "l2" and obj.window == 1 and not obj.probe):
        return f"the {kernels} kernels take the l2 objective (no window, no probe key)"
    if not (opt.kind == "gd" and opt.minibatch_average and opt.householder_steps == 1):
        return f"the {kernels} kernels take TTT's averaged mini-batch gd"
    if opt.minibatch not in TTT_MINIBATCHES:
        return f"the {kernels} kernels take a mini-batch b in {TTT_MINIBATCHES}, got {opt.minibatch}"
    return None


def ttt_linear_kernel_serves(recipe: Recipe) -> str | None:
    """Why the TTT-Linear kernels (kernels.triton.memories.ttt) cannot run `recipe` (None when they can): exactly
    TTT-Linear's shape — a linear memory with an inner bias inside the residual LayerNorm, the l2 objective
    (no window, no probe), TTT's averaged gd over mini-batches of b ∈ TTT_MINIBATCHES, no retention, the
    identity feature map. A pure function of the recipe."""
    mem = recipe.memory
    if not (mem.kind == "linear" and mem.bias and mem.residual_ln and not mem.normalize):
        return "the TTT-Linear kernels take a linear memory with an inner bias inside the residual LayerNorm"
    return _ttt_loop_serves(recipe, "TTT-Linear")


def ttt_mlp_kernel_serves(recipe: Recipe) -> str | None:
    """Why the TTT-MLP kernels (kernels.triton.memories.ttt_mlp) cannot run `recipe` (None when they can): exactly
    TTT-MLP's shape — a 2-layer MLP memory (any expansion) with GELU's tanh form and inner biases inside the
    residual LayerNorm, and TTT's loop as for TTT-Linear (the l2 objective, averaged gd over mini-batches of
    b ∈ TTT_MINIBATCHES, no retention, the identity feature map). A pure function of the recipe."""
    mem = recipe.memory
    if not (mem.kind == "mlp" and mem.depth == 2 and mem.activation == "gelu_tanh" and mem.bias
            and mem.residual_ln):
        return ("the TTT-MLP kernels take a 2-layer MLP memory (GELU, tanh form) with inner biases inside the "
                "residual LayerNorm")
    return _ttt_loop_serves(recipe, "TTT-MLP")


def titans_kernel_serves(recipe: Recipe) -> str | None:
    """Why the Titans kernel (kernels.triton.memories.titans) cannot run `recipe` (None when it can): exactly Titans'
    shape — a 2-layer MLP memory (any expansion) with GELU's erf form, no inner bias, no residual LayerNorm; the l2
    objective (no window, no probe); the momentum optimizer over mini-batches of b ∈ TTT_MINIBATCHES; scalar
    retention (decayed after the gradient: a recipe with b > 1 takes no other order); the identity feature map. A pure
    function of the recipe."""
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    if not (mem.kind == "mlp" and mem.depth == 2 and mem.activation == "gelu" and not mem.bias
            and not mem.residual_ln):
        return ("the Titans kernel takes a 2-layer MLP memory (GELU, erf form) without inner biases or residual "
                "LayerNorm")
    if recipe.feature_map.kind != "identity" or recipe.retention.kind != "scalar":
        return "the Titans kernel takes the identity feature map and scalar retention"
    if not (obj.kind == "l2" and obj.window == 1 and not obj.probe):
        return "the Titans kernel takes the l2 objective (no window, no probe key)"
    if not (opt.kind == "momentum" and opt.householder_steps == 1):
        return "the Titans kernel takes the momentum optimizer"
    if opt.minibatch not in TTT_MINIBATCHES:
        return f"the Titans kernel takes a mini-batch b in {TTT_MINIBATCHES}, got {opt.minibatch}"
    return None


def _ttt_kernels(recipe: Recipe) -> str | None:
    """The name of the loop kernels that run `recipe` ("TTT-Linear", "TTT-MLP", "Titans"), or None."""
    if ttt_linear_kernel_serves(recipe) is None:
        return "TTT-Linear"
    if ttt_mlp_kernel_serves(recipe) is None:
        return "TTT-MLP"
    if titans_kernel_serves(recipe) is None:
        return "Titans"
    return None


def triton_generic_supports(recipe: Recipe, target) -> str | None:
    """Why the generic chunk Triton row cannot serve (None when it can): as `triton_device_supports`,
    a recipe whose mini-batch form exists (`torch_backend.generic_chunk_exists`), and either
    - Muon's optimizer: the torch mini-batch form with its Newton–Schulz in a kernel (the rest of the
      form is the torch row's); or
    - TTT-Linear (`ttt_linear_kernel_serves`) with head dims ≤ MAX_TTT_DIM: the whole inner mini-batch
      loop in kernels.triton.memories.ttt, forward and backward (varlen: refused as the torch row refuses it — the
      kernels take cu_seqlens, but a MemoryState carries one offset for all sequences);
    - TTT-MLP (`ttt_mlp_kernel_serves`) with head dims ≤ MAX_TTT_DIM: its whole inner loop in
      kernels.triton.memories.ttt_mlp, forward and backward (varlen refused, as for TTT-Linear, whose kernels take it
      too);
    - Titans (`titans_kernel_serves`) with head dims ≤ TITANS_MAX_DIM: its whole inner loop in
      kernels.triton.memories.titans, forward and backward, as one sequential program per (sequence, head) each way
      at head dims ≤ the launch table's titans_single_fwd MAX_DIM, else split (`limits.titans_pipeline`; varlen
      refused as for TTT).
    Every other optimizer and memory: the torch row. (An A/B measurement on the GPU: backend="torch"
    against backend="triton".)"""
    why = triton_device_supports(target) or generic_chunk_exists(recipe, target)
    if why is not None:
        return why
    if recipe.optimizer.kind == "muon":
        return None
    kernels = _ttt_kernels(recipe)
    if kernels is None:
        return (f"the generic chunk Triton row kernels Muon's Newton–Schulz and TTT's and Titans' loops only "
                f"({ttt_linear_kernel_serves(recipe)}; {ttt_mlp_kernel_serves(recipe)}; "
                f"{titans_kernel_serves(recipe)}; other recipes: the torch row)")
    widest = TITANS_MAX_DIM if kernels == "Titans" else MAX_TTT_DIM
    for name, d in (("K", target.head_k_dim), ("V", target.head_v_dim)):
        if d is not None and d > widest:
            return f"the {kernels} kernels take head dims ≤ {widest}, got {name}={d}"
    return None


#: The tl.dot input precision of each of the generic row's kernels for fp32 and fp16 inputs (limits: TTT-Linear
#: "tf32x3", TTT-MLP, Titans and the Newton–Schulz kernel "ieee", with the measurements); the loop kernels (TTT-Linear,
#: TTT-MLP; not Titans) take bf16 inputs at LOOP_BF16_PRECISION ("tf32": `limits.loop_precision`, why there).
#: `generic_chunk(..., precision=)` (one of limits.DOT_PRECISIONS, e.g. through `pinned("generic", precision=)`) runs
#: every kernel of the row at another.
PRECISIONS = {"Newton–Schulz": NS_PRECISION, "TTT-Linear": TTT_LINEAR_PRECISION, "TTT-MLP": TTT_MLP_PRECISION,
              "Titans": TITANS_PRECISION}
#: The generic row's pipelines: Muon's (the torch form, Newton–Schulz in a kernel), TTT-Linear's, TTT-MLP's and
#: Titans' (the whole loop) at their fp32/fp16 and their bf16 precision, each named with its kernels' precision.
GENERIC_PIPELINES = (f"Newton–Schulz kernel ({NS_PRECISION})",
                     *(f"{name} kernels ({prec})" for name in ("TTT-Linear", "TTT-MLP", "Titans")
                       for prec in dict.fromkeys(loop_precision(name, dt) for dt in (torch.float32, torch.bfloat16))),
                     *(f"Titans kernels ({prec}, split)" for prec in dict.fromkeys(
                         loop_precision("Titans", dt) for dt in (torch.float32, torch.bfloat16))))


def _ns_kernel(precision: str = NS_PRECISION):
    """The Newton–Schulz of the mini-batch form: the kernel (at `precision`) for an fp32 Gram side ≤
    NS_KERNEL_MAX_DIM (its backward at 32 < r ≤ MAX_NS_DIM does not fit sm_90: limits), else None (the torch
    iteration)."""
    def ns(G, steps):
        if G.dtype != torch.float32 or G.shape[-1] > NS_KERNEL_MAX_DIM:
            return None
        from .triton.memories.newton_schulz import newton_schulz_gram

        return newton_schulz_gram(G, steps, precision=precision)
    return ns


def _ns_products(precision: str):
    """The torch Newton–Schulz iteration's products at "tf32x3": the kernel `ns_bmm` (tl.dot's three TF32 products
    in registers; the torch split would write hi / lo copies of every operand through memory); else None (torch's
    bmm: fp32, or one TF32 pass inside `tf32_matmuls`)."""
    if precision != "tf32x3":
        return None
    from .triton.memories.newton_schulz import ns_bmm

    return ns_bmm


def generic_chunk(call, chunk_size: int = 64, cu_seqlens=None, *, precision: str | None = None):
    """generic, chunk, on Triton: TTT-Linear's, TTT-MLP's and Titans' recipes on their loop kernels, every other one on
    `torch_backend.minibatch_chunk_impl` with Muon's Newton–Schulz of every token's momentum
    (`chunkwise.minibatch._muon_step`) in one kernel each way (kernels.triton.memories.newton_schulz; Gram sides
    above NS_KERNEL_MAX_DIM stay on the torch iteration). Every kernel's tl.dot at `precision` (None: each its own,
    PRECISIONS; the TTT kernels' by q's dtype, `limits.loop_precision`), and the torch Newton–Schulz iteration's
    products at it too ("tf32", "tf32x3": TF32 tensor-core products forward and backward,
    `chunkwise.minibatch._TF32Product`, at "tf32x3" each by the kernel `ns_bmm`; the Gram matrices stay fp32) — by
    default "ieee" for every dtype: one TF32 pass puts 2.5–4 % into ATLAS's o at K 64 (emulated on the CPU; the Gram
    form squares X's condition number), 15× what rounding the inputs to bf16 does, and "tf32x3" keeps fp32's
    accuracy but is not timed yet (`scripts/minibatch_memory.py --time`, docs/kernel_notes.md)."""
    if ttt_linear_kernel_serves(call.recipe) is None:
        return ttt_linear_chunk(call, cu_seqlens, precision=precision or loop_precision("TTT-Linear", call.q.dtype))
    if ttt_mlp_kernel_serves(call.recipe) is None:
        return ttt_mlp_chunk(call, cu_seqlens, precision=precision or loop_precision("TTT-MLP", call.q.dtype))
    if titans_kernel_serves(call.recipe) is None:
        return titans_chunk(call, cu_seqlens, precision=precision or loop_precision("Titans", call.q.dtype))
    precision = precision or NS_PRECISION
    return minibatch_chunk_impl(call, chunk_size, cu_seqlens, ns=_ns_kernel(precision), ns_precision=precision,
                                ns_mm=_ns_products(precision))


def _ttt_inputs(call):
    """(the state as a fp32 MemoryState, β, γ, β_ln) of a TTT call: β absent → 1, the LayerNorm's affine absent →
    (1, 0)."""
    from ..torch_backend import initial_memory_state

    recipe, s = call.recipe, call.shapes
    dev = call.q.device
    st = initial_memory_state(recipe, call.initial_state, s.B, s.H, s.Kf, s.V, torch.float32, dev)
    beta = call.inputs.get("beta")
    if beta is None:
        beta = torch.ones(s.B, s.T, s.H, dtype=torch.float32, device=dev)
    lnw, lnb = call.inputs.get("ln_weight"), call.inputs.get("ln_bias")
    lnw = torch.ones(s.H, s.V, dtype=torch.float32, device=dev) if lnw is None else lnw
    lnb = torch.zeros(s.H, s.V, dtype=torch.float32, device=dev) if lnb is None else lnb
    return st, beta, lnw, lnb


def ttt_linear_chunk(call, cu_seqlens=None, precision: str | None = None):
    """TTT-Linear's chunk form on its kernels (`kernels.triton.memories.ttt.ttt_linear_triton`): the caller's q, k, v
    as they are (native dtype, grouped heads), β absent → 1, the LayerNorm's affine absent → (1, 0), the
    state a MemoryState (weights (W, b), anchor, offset; fp32). cu_seqlens: FormNotAvailable, as the torch
    row raises (no varlen mini-batch form yet)."""
    from .triton.memories.ttt import ttt_linear_triton

    return _ttt_chunk(call, cu_seqlens, ttt_linear_triton, precision)


def ttt_mlp_chunk(call, cu_seqlens=None, precision: str | None = None):
    """TTT-MLP's chunk form on its kernels (`kernels.triton.memories.ttt_mlp.ttt_mlp_triton`), as `ttt_linear_chunk`:
    the state a MemoryState (weights (W1, b1, W2, b2), anchor, offset; fp32); cu_seqlens: FormNotAvailable."""
    from .triton.memories.ttt_mlp import ttt_mlp_triton

    return _ttt_chunk(call, cu_seqlens, ttt_mlp_triton, precision)


def _ttt_chunk(call, cu_seqlens, kernel, precision):
    """A TTT chunk form through `kernel` (`ttt_linear_triton` / `ttt_mlp_triton`, one contract; tl.dot at
    `precision`; None: the kernel's default for q's dtype): (o, final state)."""
    from ..torch_backend import _no_varlen

    recipe = call.recipe
    _no_varlen(recipe, cu_seqlens)
    st, beta, lnw, lnb = _ttt_inputs(call)
    o, weights, anchor, offset = kernel(call.q, call.k, call.v, beta, lnw, lnb, scale=call.scale, weights=st.weights,
                                        anchor=st.anchor, offset=st.offset, minibatch=recipe.optimizer.minibatch,
                                        precision=precision)
    final = MemoryState(weights=weights, anchor=anchor, offset=offset)
    return o, finish_state(recipe, final, call.output_final_state)


def titans_chunk(call, cu_seqlens=None, precision: str | None = None):
    """Titans' chunk form on its kernels (`kernels.triton.memories.titans.titans_triton`): the caller's q, k, v as they
    are (native dtype, grouped heads), β absent → 1, the state a MemoryState (weights (W1, W2), momentum, anchor,
    offset; fp32). cu_seqlens: FormNotAvailable, as the torch row raises (no varlen mini-batch form yet)."""
    from ..torch_backend import _no_varlen, initial_memory_state
    from .triton.memories.titans import titans_triton

    recipe, s = call.recipe, call.shapes
    _no_varlen(recipe, cu_seqlens)
    dev = call.q.device
    st = initial_memory_state(recipe, call.initial_state, s.B, s.H, s.Kf, s.V, torch.float32, dev)
    beta = call.inputs.get("beta")
    if beta is None:
        beta = torch.ones(s.B, s.T, s.H, dtype=torch.float32, device=dev)
    o, weights, momentum, anchor, offset = titans_triton(
        call.q, call.k, call.v, call.inputs["g"], beta, call.inputs["nu"], scale=call.scale, weights=st.weights,
        momentum=st.momentum, anchor=st.anchor, offset=st.offset, minibatch=recipe.optimizer.minibatch,
        precision=precision)
    final = MemoryState(weights=weights, momentum=momentum, anchor=anchor, offset=offset)
    return o, finish_state(recipe, final, call.output_final_state)


def generic_chunk_pipeline(recipe: Recipe, target) -> str:
    """The pipeline the generic chunk Triton row runs: TTT-Linear's, TTT-MLP's or Titans' kernels for the recipes
    they serve (`ttt_linear_kernel_serves`, `ttt_mlp_kernel_serves`, `titans_kernel_serves`), else the torch mini-batch
    form with Newton–Schulz in the kernel (Muon); the loop kernels named with their precision for the call's dtype, and
    Titans' with ", split" where its head dims take the split pipeline (`limits.titans_pipeline`)."""
    kernels = _ttt_kernels(recipe)
    if kernels is None:
        return GENERIC_PIPELINES[0]
    return _loop_name(kernels, target, loop_precision(kernels, target.dtype))


def _loop_name(kernels: str, target, precision: str) -> str:
    """The name of the loop kernels `kernels` at `precision` for a call with `target`: "{kernels} kernels
    ({precision})", Titans' with ", split" where the target's head dims take its split pipeline."""
    dims = [d for d in (target.head_k_dim, target.head_v_dim) if d is not None] if target is not None else []
    split = kernels == "Titans" and bool(dims) and titans_pipeline(max(dims), max(dims), _launch(None)) == "split"
    return f"{kernels} kernels ({precision}{', split' if split else ''})"


#: What `pinned` may fix on each Triton chunk row: option -> (the type or values it takes, what that is).
_PINNABLE = {"delta": ("pipeline", DeltaPipeline, "a kernels.pipelines.DeltaPipeline"),
             "gated_linear": ("pipeline", GatedPipeline, "a kernels.pipelines.GatedPipeline"),
             "generic": ("precision", None, "one of the generic row's tl.dot precisions (limits.DOT_PRECISIONS)"),
             "mesa": ("precision", None, "one of the CG kernel's tl.dot precisions (limits.DOT_PRECISIONS)")}


@contextmanager
def pinned(recipe_class: str, **option):
    """Within the block, the Triton chunk row of `recipe_class` runs every call with `option` instead of its rule's
    choice — an A/B measurement through `fw.chunk` or a model (scripts/gpu_diag.py, gpu_gated_fused.py,
    step_costs.py): "delta" `pipeline=DeltaPipeline(...)`, "gated_linear" `pipeline=GatedPipeline(...)`, "generic"
    `precision="tf32x3"` (or "ieee", "tf32": its kernels' tl.dot — Newton–Schulz, TTT-Linear, TTT-MLP, Titans), "mesa"
    `precision=` (the CG kernel's tl.dot, both solves). The
    row's `pipeline` names the pinned choice (a layer's repr, `fastweights.pipeline`); the row is put back after
    (assigning DISPATCH clears the route cache). A pipeline whose kernels cannot take a call raises there (the glue's
    error), never falls back. Yields the pinned row."""
    from ..dispatch import DISPATCH
    from ..inputs import InputError

    if recipe_class not in _PINNABLE:
        raise InputError(f"recipe_class must be one of {list(_PINNABLE)} (a Triton chunk row with options), "
                         f"got {recipe_class!r}")
    name, kind, what = _PINNABLE[recipe_class]
    if set(option) != {name}:
        raise InputError(f"the {recipe_class} chunk row takes one option, {name}=, got {sorted(option) or 'none'}")
    value = option[name]
    if kind is None:
        from .triton.common.limits import DOT_PRECISIONS

        ok = value in DOT_PRECISIONS
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise InputError(f"{name} must be {what}, got {value!r}")
    key = (recipe_class, "chunk", "triton")
    impl = DISPATCH[key]
    label = value if kind is not None else f"{'CG' if recipe_class == 'mesa' else 'Newton–Schulz'} kernel ({value})"

    def named(recipe, target):  # the generic row's TTT calls: their kernels at the pinned precision
        if recipe_class == "generic" and recipe is not None and _ttt_kernels(recipe) is not None:
            return _loop_name(_ttt_kernels(recipe), target, value)
        return label

    DISPATCH[key] = row = dataclasses.replace(impl, fn=partial(impl.fn, **option), pipeline=named)
    try:
        yield row
    finally:
        DISPATCH[key] = impl


def _gate_kind(recipe: Recipe) -> str:
    """The gate kind the kernels see: constant retention rides as a scalar log-decay on every token."""
    kind = recipe.retention.kind
    return "scalar" if kind == "constant" else kind


def delta_chunk_pipeline(recipe: Recipe, target) -> DeltaPipeline | None:
    """The pipeline `delta_chunk` runs for a call with `target` (`kernels.pipelines.delta_pipeline` on the recipe's
    gate kind, probe key and decay order and the Target's device, dtype, head dims and chunk size; the split forward
    where the kernels' launch table now switches it on, util.LAUNCH["delta_split_out"]["ON"]); None when the Target
    leaves the dtype, a head dim or the chunk size unknown."""
    t = target
    if None in (t.dtype, t.head_k_dim, t.head_v_dim, t.chunk_size):
        return None
    return delta_pipeline(gate=_gate_kind(recipe), probe=bool(recipe.objective.probe),
                          decay_first=recipe.retention.decay_first, device_type=t.device_type, dtype=t.dtype,
                          K=t.head_k_dim, V=t.head_v_dim, C=t.chunk_size,
                          split=split_forward_on())


def gated_chunk_pipeline(recipe: Recipe, target) -> GatedPipeline | None:
    """The pipeline `gated_linear_chunk` runs for a call with `target` (`kernels.pipelines.gated_pipeline`); None
    when the Target leaves the dtype or a head dim unknown."""
    t = target
    if None in (t.dtype, t.head_k_dim, t.head_v_dim):
        return None
    return gated_pipeline(gate=_gate_kind(recipe), device_type=t.device_type, dtype=t.dtype, K=t.head_k_dim,
                          V=t.head_v_dim)


def _launch(launch):
    """The launch table a row's variants are named from: `launch`, or None → the one the kernels read now."""
    if launch is not None:
        return launch
    return live_launch()


def delta_chunk_variants(recipe: Recipe, target, chosen, launch=None, *, sequences=None, heads=None) -> tuple:
    """The launch-table variants (`kernels.variants.Variant`) a `delta_chunk` call with `target` runs in `chosen`, its
    pipeline (a DeltaPipeline; None: unknown → none named): the fused or split forward's
    (`variants.delta_fused_forward`, `delta_split_forward`, on q's dtype — fp32 where the pipeline runs fp32 copies)
    and the fused backward's; `launch`: the table (None: the
    kernels' now). The staged stages have no variant."""
    if not isinstance(chosen, DeltaPipeline):
        return ()
    launch = _launch(launch) if {"fused", "split"} & {chosen.forward, chosen.backward} else None
    out = []
    facts = (_gate_kind(recipe), target.head_k_dim, target.chunk_size,
             torch.float32 if chosen.fp32 else target.dtype, launch)
    if chosen.forward == "fused":
        out.append(delta_fused_forward(*facts).variant)
    elif chosen.forward == "split":
        out.append(delta_split_forward(*facts))
    if chosen.backward == "fused":
        out.append(delta_fused_backward(launch, target.chunk_size).variant)
    return tuple(out)


def gated_chunk_variants(recipe: Recipe, target, chosen, launch=None, *, sequences=None, heads=None) -> tuple:
    """As `delta_chunk_variants` for `gated_linear_chunk`: the fused pipeline's forward (`variants.gated_fused_forward`:
    the scores kernel, β prefetched)."""
    if not isinstance(chosen, GatedPipeline) or chosen.pipeline != "fused":
        return ()
    return (gated_fused_forward(_launch(launch)).variant,)


def generic_chunk_variants(recipe: Recipe, target, chosen, launch=None, *, sequences=None, heads=None) -> tuple:
    """As `delta_chunk_variants` for `generic_chunk`: TTT-Linear's and TTT-MLP's kernels (`variants.ttt_linear`,
    `variants.ttt_mlp`: sliced or one program, for
    `sequences` × `heads` value heads — None: conditional on them) and, where the head dims take Titans' split
    pipeline, its sequential passes (`variants.titans`, the same rule) and its backward (READ_TERMS)."""
    kernels = None if recipe is None else _ttt_kernels(recipe)
    if kernels == "TTT-Linear":
        table = _launch(launch)
        passes = ttt_linear(sequences, heads, table)
        return (passes.variant, ttt_linear_backward(table, passes.sliced and passes.backward == "sliced").variant)
    if kernels == "TTT-MLP":
        return (ttt_mlp(sequences, heads, _launch(launch)).variant,)
    dims = [d for d in (target.head_k_dim, target.head_v_dim) if d is not None]
    if kernels != "Titans" or not dims:
        return ()
    table = _launch(launch)
    if titans_pipeline(max(dims), max(dims), table) == "split":
        return (titans_variant(sequences, heads, table).variant, titans_backward(table).variant)
    return (titans_single_backward(table).variant,)


def short_conv_variants(recipe, target, chosen, launch=None, *, sequences=None, heads=None) -> tuple:
    """The conv row's variant (`variants.conv_backward` at the Target's width, the one-pass backward the row runs)."""
    return (conv_backward(target.conv_width, _launch(launch)).variant,)


def delta_chunk_alternatives(pipeline: str | None) -> tuple[str, ...]:
    """The alternatives of the variants `delta_chunk_variants` may name in the pipeline named `pipeline`
    (`kernels.variants.alternatives`; `dispatch.rows(variants=True)`): the fused forward's and backward's."""
    return _alternatives([site for part, site in (("fused forward", "delta fused forward"),
                                                  ("split forward", "delta split forward"),
                                                  ("fused backward", "delta fused backward"))
                          if pipeline is not None and part in pipeline])


def gated_chunk_alternatives(pipeline: str | None) -> tuple[str, ...]:
    """As `delta_chunk_alternatives` for `gated_chunk_variants`: the fused pipeline's forward."""
    return _alternatives(["gated fused forward"] if pipeline is not None and pipeline.startswith("fused") else [])


def generic_chunk_alternatives(pipeline: str | None) -> tuple[str, ...]:
    """As `delta_chunk_alternatives` for `generic_chunk_variants`: TTT-Linear's and TTT-MLP's kernels and TTT-Linear's
    backward, Titans' split passes and backward or its single backward."""
    sites = ["TTT-Linear", "TTT-Linear backward"] if pipeline is not None and pipeline.startswith("TTT-Linear") else []
    sites += ["TTT-MLP"] if pipeline is not None and pipeline.startswith("TTT-MLP") else []
    titans = pipeline is not None and pipeline.startswith("Titans")
    sites += (["Titans", "Titans backward"] if "split" in pipeline else ["Titans single backward"]) if titans else []
    return _alternatives(sites)


def short_conv_alternatives(pipeline: str | None) -> tuple[str, ...]:
    """As `delta_chunk_alternatives` for `short_conv_variants`: the conv backward's."""
    return _alternatives(["conv backward"])


def _call_target(call, chunk_size: int):
    """The Target facts of a chunk call, as `api.call_target` builds them (device, q's dtype, K, V, chunk size)."""
    from ..dispatch import Target

    return Target(call.q.device.type, call.q.dtype, call.shapes.K, call.shapes.V, chunk_size)


def triton_step_supports(recipe: Recipe, target) -> str | None:
    """Why the recurrent Triton rows cannot serve (None when they can): as `triton_memory_supports`,
    and for the delta class one plain delta step per token (no probe key as Comba's, no
    Householder micro-steps as DeltaProduct's)."""
    why = triton_memory_supports(recipe, target)
    if why is not None:
        return why
    if recipe.objective.probe:
        return "the Triton step kernel reads the error at the key (no probe key p, as Comba's)"
    if recipe.optimizer.householder_steps > 1:
        return "the Triton step kernel runs one delta step per token (not DeltaProduct's micro-steps)"
    return None


def triton_conv_supports(recipe, target) -> str | None:
    """Why `short_conv` cannot serve (None when it can): as `triton_device_supports` (every floating
    tensor of the call: the Target's promoted dtype), and a width W ≤ MAX_CONV_WIDTH (its backward
    unrolls W taps twice per block)."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    if target.conv_width is not None and target.conv_width > MAX_CONV_WIDTH:
        return f"the Triton short conv takes widths W ≤ {MAX_CONV_WIDTH}, got {target.conv_width}"
    return None


def triton_norm_supports(recipe, target) -> str | None:
    """Why `gated_rms_norm` cannot serve (None when it can): as `triton_device_supports`, a group
    G ≤ MAX_GROUP (one row of G fp32 values per tile row) and a swish or sigmoid gate (or none)."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    if target.group_size is not None and target.group_size > MAX_GROUP:
        return f"the Triton norm takes groups G ≤ {MAX_GROUP}, got {target.group_size}"
    if target.gate not in (None, "swish", "sigmoid"):
        return f"the Triton norm gates by swish or sigmoid, not {target.gate}"
    return None


def triton_prologue_supports(recipe, target) -> str | None:
    """Why `delta_prologue` cannot serve (None when it can): as `triton_device_supports`, and a
    head dim K ≤ MAX_HEAD_DIM (a whole row of q or k in one tile)."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    if target.head_k_dim is not None and target.head_k_dim > MAX_HEAD_DIM:
        return f"the Triton prologue takes head dims K ≤ {MAX_HEAD_DIM}, got {target.head_k_dim}"
    return None


def gated_linear_chunk(call, chunk_size: int = 64, cu_seqlens=None, *, pipeline: GatedPipeline | None = None):
    """gated_linear, chunk, on Triton: the Call converted as torch_backend's linear chunk does
    (constant retention → per-head log γ on every token, β absent → 1, the state bare or a
    MemoryState), but with the caller's tensors as they are (native dtype, grouped heads); the
    pipeline `gated_chunk_pipeline` picks for the call, or `pipeline` (`pinned`: an A/B measurement)."""
    from .triton.gated import chunk_gated_triton

    recipe = call.recipe
    g, beta = _gates(call)
    S0 = call.initial_state
    if isinstance(S0, MemoryState):
        S0 = S0.weights[0]
    o, S = chunk_gated_triton(call.q, call.k, call.v, g=g, beta=beta, scale=call.scale,
                              initial_state=S0, output_final_state=call.output_final_state,
                              chunk_size=chunk_size, cu_seqlens=cu_seqlens, check_cu_seqlens=call.check_cu_seqlens,
                              pipeline=pipeline if pipeline is not None else
                              gated_chunk_pipeline(recipe, _call_target(call, chunk_size)))
    return o, (finish_state(recipe, MemoryState(weights=(S,)), True) if call.output_final_state else None)


def _gates(call):
    """(g [B, T, H(, K)] or None, β [B, T, H] or None) of a Call: constant retention becomes a per-head
    log γ on every token."""
    recipe, s = call.recipe, call.shapes
    g = call.inputs.get("g")
    if recipe.retention.kind == "constant":
        g = constant_log_gammas(recipe.retention, s.H, torch.float32, call.q.device).expand(s.B, s.T, s.H)
    return g, call.inputs.get("beta")


def delta_chunk(call, chunk_size: int = 64, cu_seqlens=None, *, pipeline: DeltaPipeline | None = None):
    """delta, chunk, on Triton: as `gated_linear_chunk`, through `chunk_delta_triton` (the probe key
    p of the inputs and the recipe's decay_first passed on; DeltaProduct's k, v, β of rank 5 as they are),
    with the pipeline `delta_chunk_pipeline` picks for the call, or `pipeline` (`pinned`: an A/B measurement)."""
    from .triton.delta import chunk_delta_triton

    g, beta = _gates(call)
    S0 = call.initial_state
    if isinstance(S0, MemoryState):
        S0 = S0.weights[0]
    o, S = chunk_delta_triton(call.q, call.k, call.v, g=g, beta=beta, p=call.inputs.get("p"),
                              decay_first=call.recipe.retention.decay_first, scale=call.scale, initial_state=S0,
                              output_final_state=call.output_final_state, chunk_size=chunk_size,
                              cu_seqlens=cu_seqlens, check_cu_seqlens=call.check_cu_seqlens,
                              pipeline=pipeline if pipeline is not None else
                              delta_chunk_pipeline(call.recipe, _call_target(call, chunk_size)))
    return o, (finish_state(call.recipe, MemoryState(weights=(S,)), True) if call.output_final_state else None)


class _RecurrentStep(torch.autograd.Function):
    """Forward: the fused step kernel over the call's T tokens on a fresh fp32 copy of the state.
    Backward: the torch reference recurrence recomputed on the saved inputs, differentiated."""

    @staticmethod
    def forward(ctx, call, q, k, v, g, beta, S0):
        from .triton.decode import fused_recurrent_step

        s = call.shapes
        if S0 is None:
            state = torch.zeros(s.B, s.H, s.K, s.V, dtype=torch.float32, device=q.device)
        else:
            state = S0.detach().to(torch.float32, copy=True).contiguous()
        delta = call.recipe.objective.kind == "l2"
        o = fused_recurrent_step(q, k, v, state, g=g, beta=beta, scale=call.scale, delta=delta,
                                 decay_first=call.recipe.retention.decay_first)
        ctx.call = call
        ctx.save_for_backward(q, k, v, g, beta, S0)
        return o, state

    @staticmethod
    def backward(ctx, do, dS):
        from dataclasses import replace

        saved = ctx.saved_tensors
        leaves = [None if x is None else x.detach().requires_grad_(x.is_floating_point()) for x in saved]
        q, k, v, g, beta, S0 = leaves
        inputs = dict(ctx.call.inputs)
        if "g" in inputs:
            inputs["g"] = g
        if "beta" in inputs:
            inputs["beta"] = beta
        call = replace(ctx.call, q=q, k=k, v=v, inputs=inputs, initial_state=S0, output_final_state=True)
        with torch.enable_grad():
            o, S = memory_recurrent_impl(call)
            wrt = [x for x in leaves if x is not None and x.requires_grad]
            grads = iter(torch.autograd.grad((o, S), wrt, (do, dS), allow_unused=True))
        out = [next(grads) if (x is not None and x.requires_grad) else None for x in leaves]
        return (None, *out)


def linear_recurrent(call):
    """gated_linear / delta, recurrent, on Triton (see the module docstring): the caller's tensors as
    they are (native dtype, grouped heads), the state bare or a MemoryState; the final state fp32."""

    g, beta = _gates(call)  # constant retention: expanded decays that are no input (no gradient)
    S0 = call.initial_state
    if isinstance(S0, MemoryState):
        S0 = S0.weights[0]
    o, S = _RecurrentStep.apply(call, call.q, call.k, call.v, g, beta, S0)
    return o, (finish_state(call.recipe, MemoryState(weights=(S,)), True) if call.output_final_state else None)


def short_conv(x, weight, bias=None, tail=None, positions=None, activation="silu"):
    """layer / conv on Triton: `kernels.triton.layer.conv.short_conv` (the signature of
    `torch_layer_ops.short_conv`)."""
    from .triton.layer.conv import short_conv as kernel

    return kernel(x, weight, bias, tail, positions, activation)


def short_conv_joint(x, weights, biases=None, tails=None, positions=None, activation="silu", grad_in_base=False):
    """The q, k, v convs of a layer in one launch each way: `kernels.triton.layer.conv.short_conv_joint` (x the
    q|k|v columns [B, T, Σ C_s]; lists of weights, biases, tails) -> ([y_s], [new tail_s])."""
    from .triton.layer.conv import short_conv_joint as kernel

    return kernel(x, weights, biases, tails, positions, activation, grad_in_base=grad_in_base)


short_conv.joint = short_conv_joint  # the conv row's joint launch (`layers.conv.joint_conv` finds it on the row)


def rope(x, start: int, *, base: float = 10000.0, period: int | None = None, positions=None):
    """layer / rope on Triton: `kernels.triton.layer.rope.rope` (the signature of `torch_layer_ops.rope`)."""
    from .triton.layer.rope import rope as kernel

    return kernel(x, start, base=base, period=period, positions=positions)


def triton_rope_supports(recipe, target) -> str | None:
    """Why `rope` cannot serve (None when it can): as `triton_device_supports`, and an even head dim."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    if target.head_k_dim is not None and target.head_k_dim % 2:
        return f"RoPE takes an even head dim, got {target.head_k_dim}"
    return None


def gated_rms_norm(o, z, weight, *, group_size: int, eps: float = 1e-5, activation: str = "swish",
                   norm_before_gate: bool = True):
    """layer / norm on Triton: `kernels.triton.layer.norm.gated_rms_norm` (the signature of
    `torch_layer_ops.gated_rms_norm`; no affine weight: a weight of ones [group_size])."""
    from .triton.layer.norm import gated_rms_norm as kernel

    if weight is None:
        weight = torch.ones(group_size, dtype=torch.float32, device=o.device)
    return kernel(o, z, weight, eps=eps, activation=activation, norm_before_gate=norm_before_gate)


def delta_prologue(q, k, b, a, A_log=None, dt_bias=None, *, gate="mamba", beta_max: float = 1.0, eps: float = 1e-6):
    """layer / prologue on Triton: `kernels.triton.layer.prologue.delta_prologue` (the signature of
    `torch_layer_ops.delta_prologue`)."""
    from .triton.layer.prologue import delta_prologue as kernel

    return kernel(q, k, b, a, A_log, dt_bias, gate=gate, beta_max=beta_max, eps=eps)


# ---------------------------------------------------------------------------- Mesa's chunk row (the CG kernel)
from .triton.common.limits import MAX_CG_C, MAX_CG_K  # noqa: E402  (the Mesa row's block, kept apart)

__all__ += ["mesa_chunk", "triton_mesa_supports", "mesa_chunk_pipeline", "MESA_PIPELINES"]

#: The Mesa chunk row's one pipeline: torch's chunk form with both CG solves in the kernel.
MESA_PIPELINES = ("CG kernel",)


def triton_mesa_supports(recipe: Recipe, target) -> str | None:
    """Why the Mesa chunk Triton row cannot serve (None when it can): as `triton_device_supports` (float64: the
    torch row), chunks C ≤ MAX_CG_C (the chunk size bounds C = min(chunk size, T)) and a key feature dim
    K' ≤ MAX_CG_K — the CG kernel's register tiles (`kernels.triton.memories.mesa_cg.cg_kernel_serves`). The rest of the
    form is the torch row's, so nothing else differs."""
    why = triton_device_supports(target)
    if why is not None:
        return why
    C = target.chunk_size
    if C is not None and C > MAX_CG_C:
        return f"the Mesa CG kernel takes chunks C ≤ {MAX_CG_C}, got chunk_size={C}"
    K = target.head_k_dim
    if K is not None and recipe is not None and recipe.feature_map.out_dim(K) > MAX_CG_K:
        return f"the Mesa CG kernel takes key dims ≤ {MAX_CG_K}, got {recipe.feature_map.out_dim(K)}"
    return None


def mesa_chunk_pipeline(recipe: Recipe, target) -> str:
    """The pipeline the Mesa chunk row runs: its one, "CG kernel"."""
    return MESA_PIPELINES[0]


def mesa_chunk(call, chunk_size: int = 64, cu_seqlens=None, solve: str = "cg", cg_steps: int = 30,
               precision: str | None = None):
    """mesa, chunk, on Triton: `torch_backend.mesa_chunk_impl` with the forward's and the backward's CG solves
    (and the residual) in `kernels.triton.memories.mesa_cg.mesa_cg` — one launch per solve instead of ~14 per iteration,
    its tl.dot at `precision` (None: `limits.mesa_cg_precision(q's dtype)`, "tf32" for bf16, else "ieee";
    `pinned("mesa", precision=)` sets it for A/B runs). At "tf32" the torch form's own fp32 products (the chunk
    states, the outputs, the solves' gradients, and their autograd) run on TF32 tensor cores too, with autocast off
    inside the form (`chunkwise.mesa._TF32Region`): on the H200 those products were ≈ 19 ms of MesaNet's 138 ms LM
    micro-batch as fp32 FMA GEMMs (r4s11 call 2), and autocast's casts of their operands ≈ 20 ms more (call 3).
    solve="exact" (the check) runs the exact solve here as on the torch row."""
    import functools

    from ..torch_backend import mesa_chunk_impl
    from .triton.common.limits import mesa_cg_precision
    from .triton.memories.mesa_cg import mesa_cg

    precision = precision or mesa_cg_precision(call.q.dtype)
    cg = functools.partial(mesa_cg, precision=precision)
    return mesa_chunk_impl(call, chunk_size, cu_seqlens, solve=solve, cg_steps=cg_steps, cg=cg,
                           tf32=precision == "tf32")
