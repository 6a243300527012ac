"""Rotary position embedding (`layers.rotary`'s maths, rotate-half layout) in one Triton pass each way.

For x [B, T, H, D] (D even, h = D / 2) at position p_t (start + t, or positions[b, t]; mod `period` when given) and
θ_i = base^(−2i/D) (`inv` [h] fp32: `torch_layer_ops.rope_frequencies`, the torch twin's):

    a_{t,i} = fp32(p_t) · θ_i
    y_{t,i} = x_{t,i} cos a − x_{t,i+h} sin a,   y_{t,i+h} = x_{t,i+h} cos a + x_{t,i} sin a

in fp32 registers, y in x's dtype. The backward is the inverse rotation of dy (a rotation's transpose): the same
kernel at −a (SIGN = −1). Nothing is saved but the positions.

Grid (⌈B·T / BR⌉, H): BR tokens × one head a program; the torch twin (`torch_layer_ops.rope`) builds cos and sin
[.., T, h] in fp32 and makes ~9 passes over an fp32 copy of x each way (the preset transformer's step: ≈ 15 ms of its
49 ms of GPU time at 8×2048, docs/results/gpu/r4s9/call2). Bytes here: read x (or dy), write y (or dx): 2·N·e.
x may be any layout whose last dim is contiguous (its B, T and H strides are passed); y is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ....torch_layer_ops import rope_frequencies
from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.util import launch, tile

Tensor = torch.Tensor

__all__ = ["rope"]


@triton.jit
def _rope_kernel(x, y, inv, pos, start, period, N, T, H, sxb, sxt, sxh, HALF: tl.constexpr, BH: tl.constexpr,
                 BR: tl.constexpr, HAS_POS: tl.constexpr, HAS_PERIOD: tl.constexpr, SIGN: tl.constexpr):
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    rows = (i_r * BR + tl.arange(0, BR)).to(tl.int64)  # b·T + t
    mr = rows < N
    b, t = rows // T, rows % T
    if HAS_POS:
        p = tl.load(pos + rows, mask=mr, other=0)
    else:
        p = start + t
    if HAS_PERIOD:
        p = p % period
    i = tl.arange(0, BH)
    mi = i < HALF
    th = tl.load(inv + i, mask=mi, other=0.0)
    a = p.to(tl.float32)[:, None] * th[None, :]  # [BR, BH]
    c, s = tl.cos(a), tl.sin(a) * SIGN
    m = mr[:, None] & mi[None, :]
    base = b * sxb + t * sxt + i_h * sxh
    x1 = tl.load(x + base[:, None] + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + base[:, None] + (i + HALF)[None, :], mask=m, other=0.0).to(tl.float32)
    out = (rows * H + i_h) * (2 * HALF)
    tl.store(y + out[:, None] + i[None, :], (x1 * c - x2 * s).to(y.dtype.element_ty), mask=m)
    tl.store(y + out[:, None] + (i + HALF)[None, :], (x2 * c + x1 * s).to(y.dtype.element_ty), mask=m)


def _rotate(x: Tensor, inv: Tensor, start: int, period: int | None, positions: Tensor | None, sign: int) -> Tensor:
    """y [B, T, H, D] contiguous, x rotated by sign·a (see the module doc)."""
    B, T, H, D = x.shape
    y = empty_output(B, T, H, D, dtype=x.dtype, device=x.device)
    N = B * T
    if N * H == 0:
        return y
    BR = tile("rope", "BR")
    pos = positions if positions is not None else inv  # (a dummy pointer when there are none)
    _rope_kernel[(triton.cdiv(N, BR), H)](
        x, y, inv, pos, int(start), int(period) if period is not None else 1, N, T, H,
        x.stride(0), x.stride(1), x.stride(2), HALF=D // 2, BH=triton.next_power_of_2(D // 2), BR=BR,
        HAS_POS=positions is not None, HAS_PERIOD=period is not None, SIGN=sign, **launch("rope"))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inv, start, period, positions):
        ctx.save_for_backward(inv, positions)
        ctx.start, ctx.period = start, period
        return _rotate(x, inv, start, period, positions, 1)

    @staticmethod
    def backward(ctx, dy):
        inv, positions = ctx.saved_tensors
        return _rotate(dy.contiguous(), inv, ctx.start, ctx.period, positions, -1), None, None, None, None


def rope(x: Tensor, start: int, *, base: float = 10000.0, period: int | None = None,
         positions: Tensor | None = None) -> Tensor:
    """x [B, T, H, D] (fp32 / bf16 / fp16, D even, last dim contiguous) rotated for positions start … start + T − 1
    or `positions` [B, T] (int), mod `period` when given: `torch_layer_ops.rope`'s contract, y contiguous in x's
    dtype."""
    if x.dim() != 4:
        raise InputError(f"x must be [B, T, H, D], got shape {list(x.shape)}")
    B, T, H, D = x.shape
    if D % 2:
        raise InputError(f"RoPE needs an even head dimension, got {D}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"x must be fp32, bf16 or fp16 for the Triton RoPE, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    pos = None
    if positions is not None:
        if tuple(positions.shape) != (B, T):
            raise InputError(f"positions must be [B, T] = {[B, T]}, got {list(positions.shape)}")
        pos = positions.to(device=x.device, dtype=torch.int64).contiguous()
    inv = rope_frequencies(D, base, x.device, torch.float32)  # [D/2], the twin's
    return _Rope.apply(x, inv, int(start), period, pos)
