"""The dispatch rows of the kernel backends, safe to import without Triton: the predicates look
only at the recipe and the target, and `fastweights.kernels.triton` (whose `@triton.jit`
decorators read TRITON_INTERPRET when they run) is imported on a row's first call.

gated_linear / chunk / triton  →  `gated_linear_chunk` → kernels.triton.gated.chunk_gated_triton
"""

from __future__ import annotations

import importlib.util

import torch

from ..recipe import Recipe
from ..state import MemoryState

__all__ = ["gated_linear_chunk", "triton_gated_supports", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_gated_supports(recipe: Recipe, target) -> str | None:
    """Why the Triton row cannot serve (None when it can):
    - a CUDA device: Triton compiles for GPUs (CPU tensors run only under the interpreter, which the
      tests use by calling the row directly);
    - triton importable (the `gpu` extra);
    - fp32, bf16 or fp16 inputs: the kernels accumulate in fp32; float64 stays on the torch reference;
    - the identity feature map: the kernels read q and k as given (a feature map would be a pass over
      them, or a fused load, not written yet);
    - no normalizer: linear attention's z would ride as an extra value column (V + 1), not wired yet;
    - K, V ≤ 256: the dq/dk kernel keeps a whole key row of 16 tokens in one tile."""
    if target.device_type != "cuda":
        return f"the Triton kernels run on CUDA devices, not {target.device_type}"
    if not _triton_installed():
        return "triton is not installed (pip install 'fastweights[gpu]')"
    if target.dtype is not None and target.dtype not in _DTYPES:
        return f"the Triton kernels take fp32, bf16 or fp16 inputs, not {target.dtype}"
    if recipe.feature_map.kind != "identity":
        return f"the Triton kernels take the identity feature map, not {recipe.feature_map.kind}"
    if recipe.memory.normalize:
        return "the Triton kernels do not carry the normalizer of linear attention yet"
    for name, d in (("K", target.head_k_dim), ("V", target.head_v_dim)):
        if d is not None and d > MAX_HEAD_DIM:
            return f"the Triton kernels take head dims ≤ {MAX_HEAD_DIM}, got {name}={d}"
    return None


def gated_linear_chunk(call, chunk_size: int = 64, cu_seqlens=None):
    """gated_linear, chunk, on Triton: the Call converted as torch_backend's linear chunk does
    (constant retention → per-head log γ on every token, β absent → 1, the state bare or a
    MemoryState), but with the caller's tensors as they are (native dtype, grouped heads)."""
    from ..torch_backend import finish_state
    from .triton.gated import chunk_gated_triton

    recipe, s = call.recipe, call.shapes
    g = call.inputs.get("g")
    if recipe.retention.kind == "constant":
        g = torch.tensor(recipe.retention.log_gammas(s.H), dtype=torch.float32,
                         device=call.q.device).expand(s.B, s.T, s.H)  # [B, T, H]
    S0 = call.initial_state
    if isinstance(S0, MemoryState):
        S0 = S0.weights[0]
    o, S = chunk_gated_triton(call.q, call.k, call.v, g=g, beta=call.inputs.get("beta"), scale=call.scale,
                              initial_state=S0, output_final_state=call.output_final_state,
                              chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    return o, (finish_state(recipe, MemoryState(weights=(S,)), True) if call.output_final_state else None)


def _register():
    from ..dispatch import register

    register("gated_linear", "chunk", "triton", gated_linear_chunk, supports=triton_gated_supports)


_register()
