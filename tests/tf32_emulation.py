"""TF32 on the CPU, for tests: `EmulatedTF32()` is a TorchDispatchMode that, while cuBLAS's fp32 precision is "tf32"
(what `chunkwise.common.tf32_matmuls` sets; the flag is global, so it is set on a CPU-only build too, where torch
itself ignores it), runs every fp32 mm / bmm / addmm / baddbmm on operands rounded to TF32 (10 mantissa bits: round to
nearest, ties away, as `cvt.rna.tf32.f32`; `mode="trunc"` clears the 13 low bits instead, what a tensor core handed
raw fp32 bits may do) with fp32 accumulation. The backward's products run under the same mode (autograd dispatches
them too). What it does not model: cuBLAS's own accumulation order."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EmulatedTF32", "round_tf32"]

_aten = torch.ops.aten


def round_tf32(x: torch.Tensor, mode: str = "rn") -> torch.Tensor:
    """x (fp32) rounded to TF32's 10 mantissa bits, as fp32; other dtypes unchanged."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    if mode == "rn":
        bits = bits + 0x1000
    return (bits & -8192).view(torch.float32).view(x.shape)


class EmulatedTF32(TorchDispatchMode):
    """See the module doc. `products`: how many products it rounded."""

    _OPS = {_aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1, _aten.baddbmm.default: 1}

    def __init__(self, mode: str = "rn"):
        super().__init__()
        self.mode, self.products = mode, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = self._OPS.get(func)
        on = torch.backends.cuda.matmul.fp32_precision == "tf32"
        if first is not None and on and args[first].dtype == torch.float32:
            self.products += 1
            args = list(args)
            args[first] = round_tf32(args[first], self.mode)
            args[first + 1] = round_tf32(args[first + 1], self.mode)
        return func(*args, **kwargs)
