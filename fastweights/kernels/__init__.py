"""Kernel backends (GPU). Kernels live in subpackages (`triton/`: one file per stage, a glue file
with the autograd.Function beside each chunkwise twin) and are reached only through
`fastweights.dispatch`.

`empty_output` is how every kernel launcher allocates what the kernel writes: uninitialised
memory normally, NaN-filled while `poisoned_outputs()` is active (the test suite turns it on for
kernel tests), so that an element a kernel forgets to write cannot pass a test by luck.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["empty_output", "poisoned_outputs"]

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
