"""fastweights.kernels.triton.common.interpreter: the patterns its shims make work under Triton's interpreter
(each failed there on some release in pyproject's range without them), run through a small kernel and
checked element by element. On a GPU the same kernel runs compiled and must give the same numbers."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fastweights.kernels.triton.common import interpreter  # noqa: F401  (the shims, before the kernel below is defined)
from tests.kernels.helpers import DEV
from tests.tolerances import F32

pytestmark = pytest.mark.triton


@triton.jit
def _masked_copy_kernel(x, y, n, rows, BK: tl.constexpr):
    # row r copies x[r, :n] when r < rows (a scalar comparison broadcast into the block mask), else -1
    r = tl.program_id(0)
    ok = tl.arange(0, BK)
    m_k = ok < n
    v = tl.load(x + r * BK + ok, mask=m_k & (r < rows), other=-1.0)
    tl.store(y + r * BK + ok, v, mask=(ok < BK) & (r >= 0))


@triton.jit
def _run_time_range_kernel(x, lens, y, BK: tl.constexpr):
    # y[r] = sum of x[r, :lens[r]], looped over a loaded bound
    r = tl.program_id(0)
    n = tl.load(lens + r)
    acc = tl.zeros([1], dtype=tl.float32)
    for i in range(0, n):
        acc += tl.load(x + r * BK + i + tl.arange(0, 1))
    tl.store(y + r + tl.arange(0, 1), acc)


def test_a_scalar_comparison_in_a_mask_selects_rows():
    BK, R = 16, 4
    x = torch.randn(R, BK, device=DEV)
    y = torch.full((R, BK), float("nan"), device=DEV)
    _masked_copy_kernel[(R,)](x, y, 10, 2, BK=BK)
    want = torch.full((R, BK), -1.0, device=DEV)
    want[:2, :10] = x[:2, :10]
    assert torch.equal(y, want)


def test_a_range_takes_a_loaded_bound():
    BK = 16
    x = torch.randn(3, BK, device=DEV)
    lens = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEV)
    y = torch.full((3,), float("nan"), device=DEV)
    _run_time_range_kernel[(3,)](x, lens, y, BK=BK)
    want = torch.stack([x[i, :n].sum() for i, n in enumerate(lens.tolist())])
    torch.testing.assert_close(y, want, rtol=F32, atol=F32)
