"""ShortConv: the short causal depthwise convolution in front of most linear-memory layers.

    y_t = act( Σ_{i=0}^{W−1} w_{c,i} x_{t−W+1+i, c} + b_c ),   act = SiLU (or none)

per channel c over the last W inputs (kernel W = 4 by default; PaTH's w uses 3), zero before
the sequence. The state it carries between calls is the *tail*: the last W − 1 inputs
[B, W − 1, C], so running a sequence in pieces (prefill, then token by token) equals one run.

Documents (padding, packed sequences): with `positions` p_t (the token's position inside its
document), the tap reaching i steps back is used only when i ≤ p_t, so no convolution reads
across a document start (every tap before it counts as the zero before the sequence).

On CUDA (the rule of `layers.fused.use_fused`: x, the tail and the parameters on a CUDA device,
triton importable, fp32/bf16/fp16, W ≤ 8) the forward is one Triton kernel and the backward two
(`kernels.triton.conv.short_conv`: taps, bias, SiLU and the tail fused, fp32 arithmetic; x read in
place when only its channels are contiguous, e.g. a slice of a fused projection); elsewhere the
torch ops below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.triton.limits import MAX_CONV_WIDTH
from .fused import use_fused

Tensor = torch.Tensor

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """Depthwise causal conv1d over time with a carried tail, then SiLU.

    Args:
        channels: C, the width convolved (each channel has its own W taps).
        kernel_size: W.
        bias: a per-channel bias (Mamba2's conv has one; fla's ShortConvolution does not).
        activation: "silu" or None.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be ≥ 1, got {kernel_size}")
        if activation not in ("silu", None):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        # nn.Conv1d holds the weight [C, 1, W] and gives PyTorch's default depthwise init
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=bias, padding=0)

    def empty_tail(self, batch_size: int, *, dtype=None, device=None) -> Tensor:
        """The tail before any input: zeros [B, W − 1, C]."""
        w = self.conv.weight
        return torch.zeros(batch_size, self.kernel_size - 1, self.channels,
                           dtype=dtype or w.dtype, device=device or w.device)

    def forward(self, x: Tensor, tail: Tensor | None = None, positions: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """x [B, T, C], tail [B, W − 1, C] or None (zeros), positions [B, T] int (each token's
        position inside its document; None: one document continuing the tail) ->
        (y [B, T, C], new tail [B, W − 1, C])."""
        B, T, C = x.shape
        if tail is not None and tuple(tail.shape) != (B, self.kernel_size - 1, C):
            raise ValueError(f"conv tail must have shape {[B, self.kernel_size - 1, C]}, got {list(tail.shape)}")
        if use_fused(x, tail, positions, self.conv.weight, fits=self.kernel_size <= MAX_CONV_WIDTH):
            from ..kernels.triton.conv import short_conv  # imported on first use (TRITON_INTERPRET is read then)

            return short_conv(x, self.conv.weight, self.conv.bias, tail, positions, self.activation)
        if tail is None:
            tail = self.empty_tail(B, dtype=x.dtype, device=x.device)
        xp = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W − 1 + T, C]
        w = self.conv.weight[:, 0].to(x.dtype)  # [C, W]
        # W shifted multiply-adds (F.conv1d's CPU path is slow for these tiny depthwise shapes)
        W = self.kernel_size
        if positions is None:
            y = xp[:, 0:T] * w[:, 0]
            for i in range(1, W):
                y = y + xp[:, i:i + T] * w[:, i]  # [B, T, C]
        else:  # tap i reaches W − 1 − i steps back: only within the token's document
            y = xp[:, W - 1:W - 1 + T] * w[:, W - 1]
            for i in range(W - 1):
                reach = (positions >= W - 1 - i).to(x.dtype)[..., None]  # [B, T, 1]
                y = y + xp[:, i:i + T] * w[:, i] * reach
        if self.conv.bias is not None:
            y = y + self.conv.bias.to(x.dtype)
        if self.activation == "silu":
            y = F.silu(y)
        new_tail = xp[:, xp.shape[1] - (self.kernel_size - 1):]  # [B, W − 1, C]
        return y, new_tail

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, activation={self.activation}"
