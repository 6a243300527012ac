"""When the layers run their fused Triton kernels: one rule, decided here from static facts only.

The fused paths (`kernels.triton.conv.short_conv` for `ShortConv`, `kernels.triton.norm.
gated_rms_norm` for `GatedRMSNorm`, `kernels.triton.prologue.delta_prologue` for the delta
layer's L2 norm, β and Mamba/KDA gate in `MemoryMixer`) compute the same maths as the layers' torch
ops in fewer passes over memory. The rule (`use_fused`):

    every tensor on a CUDA device, triton importable, every floating tensor fp32, bf16 or fp16,
    and the caller's own shape limit met (conv width W ≤ 8, norm group ≤ 8192, head dim ≤ 256)

Nothing else is looked at (no values, no try-and-fall-back): a call the kernels cannot serve by
that rule runs the torch ops, a call they can serve always runs the kernel. On the CPU the layers
run exactly their torch ops (fp64 inputs too, anywhere).

`fused_kernels(True)` forces the fused paths wherever the dtype and shape parts of the rule hold
(the tests: CPU tensors under TRITON_INTERPRET=1); `fused_kernels(False)` turns them off (the
torch ops on CUDA too: benchmarks, A/B checks). The setting is process-wide, not thread-local.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

__all__ = ["use_fused", "fused_kernels", "triton_available"]

_FORCE: list[bool | None] = [None]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """triton can be imported (the optional `gpu` extra)."""
    return importlib.util.find_spec("triton") is not None


def use_fused(*tensors: torch.Tensor | None, fits: bool = True) -> bool:
    """Whether a layer runs its fused Triton path on `tensors` (None entries ignored); `fits`: the
    caller's shape limits hold. See the module doc for the rule."""
    given = [t for t in tensors if t is not None]
    if not fits or not given or any(t.is_floating_point() and t.dtype not in _DTYPES for t in given):
        return False
    if _FORCE[0] is not None:
        return _FORCE[0]
    return all(t.is_cuda for t in given) and triton_available()


@contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, the fused paths run wherever dtype and shapes allow (True) or never (False)."""
    before = _FORCE[0]
    _FORCE[0] = bool(enabled)
    try:
        yield
    finally:
        _FORCE[0] = before
