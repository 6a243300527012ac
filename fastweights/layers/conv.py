"""ShortConv: the short causal depthwise convolution in front of most linear-memory layers.

    y_t = act( Σ_{i=0}^{W−1} w_{c,i} x_{t−W+1+i, c} + b_c ),   act = SiLU (or none)

per channel c over the last W inputs (kernel W = 4 by default; PaTH's w uses 3), zero before
the sequence. The state it carries between calls is the *tail*: the last W − 1 inputs
[B, W − 1, C], so running a sequence in pieces (prefill, then token by token) equals one run.

Documents (padding, packed sequences): with `positions` p_t (the token's position inside its
document), the tap reaching i steps back is used only when i ≤ p_t, so no convolution reads
across a document start (every tap before it counts as the zero before the sequence).

Every call runs the "conv" layer op of the dispatch table, routed from the call (device type,
the promoted dtype of x, tail, weight and bias, the width W) and the module's requested
`backend`: on CUDA ("auto": triton importable, fp32/bf16/fp16, W ≤ 8) the forward is one Triton
kernel and the backward one (`kernels.triton.layer.conv.short_conv`: taps, bias, SiLU and the tail
fused, fp32 arithmetic; x read in place when only its channels are contiguous, e.g. a slice of a
fused projection); elsewhere the torch ops (`torch_layer_ops.short_conv`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..dispatch import Target, check_backend, promoted_dtype
from ..inputs import InputError, check_choice, check_flag, check_int, check_positions
from .routing import describe_routes, layer_op_row

Tensor = torch.Tensor

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """Depthwise causal conv1d over time with a carried tail, then SiLU.

    Args:
        channels: C, the width convolved (each channel has its own W taps).
        kernel_size: W.
        bias: a per-channel bias (Mamba2's conv has one; fla's ShortConvolution does not).
        activation: "silu" or None.
        backend: of the "conv" layer op, "auto" or a name (`fastweights.layer_op_backends("conv")`).
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu",
                 backend: str = "auto"):
        super().__init__()
        check_int("channels", channels)
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
            raise InputError(f"kernel_size must be ≥ 1 (an int), got {kernel_size!r}")
        check_flag("bias", bias)
        check_choice("activation", activation, ("silu",), optional=True)
        check_backend(None, "conv", backend)
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.backend = backend
        self.routes: dict[str, tuple[str, str]] = {}
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
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[2] != self.channels or not x.is_floating_point():
            raise InputError(f"x must be a floating tensor [B, T, C={self.channels}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        B, T, C = x.shape
        if tail is not None and (not isinstance(tail, Tensor) or tuple(tail.shape) != (B, self.kernel_size - 1, C)):
            raise InputError(f"conv tail must have shape {[B, self.kernel_size - 1, C]}, got "
                             f"{list(getattr(tail, 'shape', [])) or type(tail).__name__}")
        if positions is not None:
            check_positions("positions", positions, B, T)
        w, b = self.conv.weight, self.conv.bias
        target = Target.of(x.device, promoted_dtype(x, tail, w, b), conv_width=self.kernel_size)
        return layer_op_row(self.routes, "conv", self.backend, target).fn(x, w, b, tail, positions, self.activation)

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, activation={self.activation}, "
                f"backend={self.backend}{describe_routes(self.routes)}")
