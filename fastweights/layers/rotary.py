"""Rotary position embedding (RoPE), rotate-half layout, computed in fp32.

For a head vector x ∈ R^D (D even) at position p, with θ_i = base^(−2i/D), i < D/2:

    (x_i, x_{i+D/2}) ↦ (x_i cos pθ_i − x_{i+D/2} sin pθ_i,  x_{i+D/2} cos pθ_i + x_i sin pθ_i)

so q_pᵀ k_r depends on p − r only. `period` takes positions modulo a period (TTT rotates by the
position inside its inner mini-batch).
"""

from __future__ import annotations

import torch

from ..state import compute_dtype

Tensor = torch.Tensor

__all__ = ["apply_rope"]


def apply_rope(x: Tensor, start: int, *, base: float = 10000.0, period: int | None = None,
               positions: Tensor | None = None) -> Tensor:
    """Rotate x [B, T, H, D] for positions start, …, start + T − 1, or for `positions` [B, T]
    (int, per token: padded and packed batches) when given; mod period when given."""
    B, T, H, D = x.shape
    if D % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {D}")
    half = D // 2
    cdt = compute_dtype(x)
    if positions is None:
        pos = torch.arange(start, start + T, device=x.device, dtype=torch.int64)[None]  # [1, T]
    else:
        pos = positions.to(device=x.device, dtype=torch.int64)  # [B, T]
    if period is not None:
        pos = pos % period
    inv = base ** (-torch.arange(half, device=x.device, dtype=cdt) * 2.0 / D)  # [D/2]
    ang = pos.to(cdt)[..., None] * inv  # [1 or B, T, D/2]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]  # [1 or B, T, 1, D/2]
    xf = x.to(cdt)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
