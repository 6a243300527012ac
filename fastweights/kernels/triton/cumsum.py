"""chunk_cumsum's twin: G_i = Σ_{s ≤ i} g_s within each chunk (fp32), for a scalar gate
g [B, T, H] or a diagonal one [B, T, H, K]; `reverse=True` gives the suffix sums Σ_{s ≥ i} used
by the backward (dg from dG), optionally plus a per-chunk term added to every row of the chunk.

Grid (chunk slots NT, B·H); one program holds a chunk's C rows (× K channels) in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import empty_output
from .layout import Layout
from .util import LAUNCH, chunk_span, pow2, varlen_args


@triton.jit
def _cumsum_kernel(g, out, add, cu, chunk_seq, chunk_local, T, NT, H: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr, REVERSE: tl.constexpr,
                   HAS_ADD: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    slot = i_b.to(tl.int64) * NT + i_n
    if DIAG:
        cols = tl.arange(0, BK)
        m = m_t[:, None] & (cols < K)[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        x = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
        y = tl.cumsum(x, axis=0, reverse=REVERSE)
        if HAS_ADD:
            y += tl.load(add + (slot * H + i_h) * K + cols, mask=cols < K, other=0.0)[None, :]
        tl.store(out + off, y, mask=m)
    else:
        off = rows * H + i_h
        x = tl.load(g + off, mask=m_t, other=0.0).to(tl.float32)
        y = tl.cumsum(x, axis=0, reverse=REVERSE)
        if HAS_ADD:
            y += tl.load(add + slot * H + i_h)
        tl.store(out + off, y, mask=m_t)


def chunk_cumsum(g: torch.Tensor, L: Layout, *, reverse: bool = False, add: torch.Tensor | None = None,
                 out_dtype=torch.float32) -> torch.Tensor:
    """g [B, T, H] or [B, T, H, K] → the chunk-local (reverse) cumsum, same shape, `out_dtype`.
    add: None or fp32 [B, NT, H(, K)], added to every row of its chunk (after the sum)."""
    g = g.contiguous()
    diag = g.dim() == 4
    out = empty_output(*g.shape, dtype=out_dtype, device=g.device)
    if g.shape[1] == 0:
        return out
    _cumsum_kernel[(L.NT, L.B * L.H)](
        g, out, add if add is not None else g, *varlen_args(L, g.device)[:3], L.T, L.NT, H=L.H, K=L.K, C=L.C,
        BK=pow2(L.K), DIAG=diag, REVERSE=reverse, HAS_ADD=add is not None, IS_VARLEN=L.varlen, **LAUNCH)
    return out
