"""Rotary position embedding (RoPE), rotate-half layout, computed in fp32: the "rope" layer op of the dispatch
table (`torch_layer_ops.rope`; on CUDA `kernels.triton.layer.rope`, one pass each way), routed per call.

For a head vector x ∈ R^D (D even) at position p, with θ_i = base^(−2i/D), i < D/2:

    (x_i, x_{i+D/2}) ↦ (x_i cos pθ_i − x_{i+D/2} sin pθ_i,  x_{i+D/2} cos pθ_i + x_i sin pθ_i)

so q_pᵀ k_r depends on p − r only. `period` takes positions modulo a period (TTT rotates by the
position inside its inner mini-batch).
"""

from __future__ import annotations

import torch

from ..dispatch import Target, check_backend
from .routing import layer_op_row

Tensor = torch.Tensor

__all__ = ["apply_rope"]


def apply_rope(x: Tensor, start: int, *, base: float = 10000.0, period: int | None = None,
               positions: Tensor | None = None, backend: str = "auto",
               routes: dict[str, tuple[str, str]] | None = None) -> Tensor:
    """Rotate x [B, T, H, D] for positions start, …, start + T − 1, or for `positions` [B, T]
    (int, per token: padded and packed batches) when given; mod period when given. backend: of the
    "rope" layer op ("auto": the Triton row on CUDA, the torch row elsewhere); routes: where the row
    taken is recorded (a layer's `routes`, shown by its repr)."""
    check_backend(None, "rope", backend)
    target = Target.of(x.device, x.dtype, head_k_dim=x.shape[-1] if x.dim() else None)
    return layer_op_row({} if routes is None else routes, "rope", backend, target).fn(
        x, start, base=base, period=period, positions=positions)
