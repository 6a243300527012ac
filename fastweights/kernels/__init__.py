"""Kernel backends (GPU). Kernels live in subpackages (`triton/`: one file per stage, a glue file
with the autograd.Function beside each chunkwise twin) and are reached only through
`fastweights.dispatch`.

`empty_output` is how every kernel launcher allocates what the kernel writes: uninitialised
memory normally, NaN-filled while `poisoned_outputs()` is active (the test suite turns it on for
kernel tests), so that an element a kernel forgets to write cannot pass a test by luck.

`split_into_grad_buffer` is a split whose backward completes, in place, a gradient buffer that a kernel's backward
allocated wider than its input (the joint q|k|v conv's dx: a column view of a [B, T, ΣN] buffer), instead of a cat.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

Tensor = torch.Tensor

__all__ = ["empty_output", "poisoned_outputs", "split_into_grad_buffer", "GRAD_BUFFER"]

_POISON = [False]


def empty_output(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape), or NaN-filled (integer dtypes: their max) while outputs are poisoned."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    if _POISON[0]:
        out.fill_(float("nan") if out.is_floating_point() else torch.iinfo(dtype).max)
    return out


@contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, `empty_output` returns NaN-filled tensors (tests of kernels)."""
    before = _POISON[0]
    _POISON[0] = True
    try:
        yield
    finally:
        _POISON[0] = before


#: The attribute marking a gradient buffer that a backward allocated wider than its input (`_conv_backward`'s
#: `into`): only such a buffer's other columns may be written by `split_into_grad_buffer`'s backward.
GRAD_BUFFER = "_fastweights_grad_buffer"


class _SplitIntoGradBuffer(torch.autograd.Function):
    """y.split(sizes, -1) whose backward assembles dy in place where it can (`split_into_grad_buffer`)."""

    @staticmethod
    def forward(ctx, y, sizes):
        ctx.sizes, ctx.shape = sizes, tuple(y.shape)
        ctx.set_materialize_grads(False)
        return tuple(y.split(list(sizes), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        offs = [sum(ctx.sizes[:i]) for i in range(len(ctx.sizes))]
        ref = next(g for g in grads if g is not None) if any(g is not None for g in grads) else None
        if ref is None:
            return None, None
        buf, own = None, None
        for i, (g, o) in enumerate(zip(grads, offs)):
            base = g._base if g is not None else None
            if (base is not None and getattr(base, GRAD_BUFFER, False) and tuple(base.shape) == ctx.shape
                    and base.dtype == ref.dtype and base.is_contiguous() and g.stride() == base.stride()
                    and g.storage_offset() - base.storage_offset() == o):
                buf, own = base, i
                break
        if buf is None:  # what split's own backward does
            return torch.cat([g if g is not None else ref.new_zeros(*ctx.shape[:-1], n)
                              for g, n in zip(grads, ctx.sizes)], dim=-1), None
        setattr(buf, GRAD_BUFFER, False)  # used once
        for i, (g, o, n) in enumerate(zip(grads, offs, ctx.sizes)):
            if i == own:
                continue
            if g is None:
                buf[..., o:o + n].zero_()
            else:
                buf[..., o:o + n].copy_(g)
        return buf, None


def split_into_grad_buffer(y: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
    """y [..., Σ sizes].split(sizes, -1) (views), whose backward writes the pieces' gradients into the buffer one of
    them already lives in — a backward that wrote its input's gradient as a column view of a fresh marked buffer of
    y's shape (`short_conv_joint(..., grad_in_base=True)`: dx of the q|k|v columns) — copying only the other
    pieces' columns (bytes: theirs, read and written, instead of all of y's in a cat); where no piece's gradient is
    such a view, the cat (split's own backward). Values bitwise split's."""
    return _SplitIntoGradBuffer.apply(y, tuple(int(n) for n in sizes))
