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

`joint_conv` runs several ShortConvs of one layer (q, k, v) whose inputs are adjacent column ranges of one tensor
(the joint projection) as one Triton conv each way (`kernels.triton.layer.conv.short_conv_joint`) where every one
of them routes to the Triton row and they share width, activation and bias-ness: one forward launch, one backward
launch writing dx as one [B, T, Σ C] tensor.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..dispatch import Target, check_backend, promoted_dtype
from ..inputs import InputError, check_choice, check_flag, check_int, check_positions
from .routing import describe_routes, layer_op_row

Tensor = torch.Tensor

__all__ = ["ShortConv", "joint_conv"]


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
        self.variants: dict[str, tuple[str, ...]] = {}  # the last call's launch-table variants (a record)
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
        return layer_op_row(self.routes, "conv", self.backend, target, self.variants).fn(x, w, b, tail, positions,
                                                                                         self.activation)

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, activation={self.activation}, "
                f"backend={self.backend}{describe_routes(self.routes, variants=self.variants)}")


def conv_interpreting() -> bool:
    """Whether Triton runs under its interpreter (TRITON_INTERPRET=1: CPU tensors, the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def joint_conv(convs: list[ShortConv], x: Tensor, tails: list[Tensor | None] | None = None,
               positions: Tensor | None = None, *, grad_in_base: bool = False
               ) -> tuple[list[Tensor], list[Tensor]] | None:
    """The ShortConvs `convs` (≤ 3) on the adjacent column ranges of x [B, T, Σ C_i] (channels contiguous, any row
    stride: e.g. the q|k|v columns of the joint projection) in one launch each way
    (`kernels.triton.layer.conv.short_conv_joint`) -> ([y_i [B, T, C_i]], [new tail_i [B, W − 1, C_i]]), equal
    bitwise to the convs one by one on x's column views; tails: one [B, W − 1, C_i] or None each (all or none).

    None (nothing run) where the joint launch does not apply: the convs differ in width, activation, bias-ness or
    requested backend; their rows (each conv's, recorded in its routes) are not all the one row with a joint launch
    (`fn.joint`: the Triton row's `kernels.rows.short_conv_joint`); x is not on CUDA (nor
    under TRITON_INTERPRET=1); some but not all tails given. The caller then runs each conv itself.
    grad_in_base: x's gradient written as a column view of a buffer of its base's shape
    (`kernels.split_into_grad_buffer` completes it: no cat of the projection's gradient)."""
    if not 1 <= len(convs) <= 3 or not isinstance(x, Tensor) or x.dim() != 3:
        return None
    c0 = convs[0]
    same = all(c.kernel_size == c0.kernel_size and c.activation == c0.activation and c.backend == c0.backend
               and (c.conv.bias is None) == (c0.conv.bias is None) for c in convs)
    if not same or x.shape[2] != sum(c.channels for c in convs) or not (x.is_cuda or conv_interpreting()):
        return None
    tails = list(tails) if tails is not None else [None] * len(convs)
    if any(t is None for t in tails) and not all(t is None for t in tails):
        return None
    B, T, _ = x.shape
    for c, t in zip(convs, tails):
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (B, c.kernel_size - 1, c.channels)):
            raise InputError(f"conv tail must have shape {[B, c.kernel_size - 1, c.channels]}, got "
                             f"{list(getattr(t, 'shape', [])) or type(t).__name__}")
    if positions is not None:
        check_positions("positions", positions, B, T)
    ws = [c.conv.weight for c in convs]
    bs = [c.conv.bias for c in convs] if c0.conv.bias is not None else None
    given = [t for t in tails if t is not None]
    target = Target.of(x.device, promoted_dtype(x, *given, *ws, *(bs or [])), conv_width=c0.kernel_size)
    impls = [layer_op_row(c.routes, "conv", c.backend, target, c.variants) for c in convs]
    joint = getattr(impls[0].fn, "joint", None)  # the Triton row's `rows.short_conv_joint`
    if joint is None or any(impl.fn is not impls[0].fn for impl in impls):
        return None
    return joint(x, ws, bs, tails if given else None, positions, c0.activation, grad_in_base=grad_in_base)
