"""chunk_cumsum's twin: G_i = Σ_{s ≤ i} g_s within each chunk (fp32), for a scalar gate
g [B, T, H] or a diagonal one [B, T, H, K]; `reverse=True` gives the suffix sums Σ_{s ≥ i} used
by the backward (dg from dG), optionally plus a per-chunk term added to every row of the chunk.

The exclusive cumsum of the delta rule with the decay after (Comba's read decay R_i = G_{i−1},
0 on a chunk's first row) rides along through `excl`:
- forward (`exclusive=True`): R is written next to G as G's rows shifted down by one inside the
  chunk — the same floats, so R_i − G_{i−1} is exactly 0 (not G − g, whose rounding is not);
- reverse (`excl=dR`): the suffix sums of dG + (dR shifted up by one row inside the chunk),
  i.e. dg_s = Σ_{i ≥ s} dG_i + Σ_{i > s} dR_i (+ the per-chunk term), as R_i = Σ_{s < i} g_s.

Grid (chunk slots NT, B·H); one program holds a chunk's C rows (× K channels) in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, launch, pow2, varlen_args


@triton.jit(do_not_specialize=["T", "NT"])
def _cumsum_kernel(g, out, add, ex, cu, chunk_seq, chunk_local, T, NT, H: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr, REVERSE: tl.constexpr,
                   HAS_ADD: tl.constexpr, EXCL: tl.constexpr, IS_VARLEN: tl.constexpr):
    # EXCL: forward, also store the exclusive cumsum to `ex`; reverse, add `ex` shifted up by one row
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    oc = tl.arange(0, C)
    rows = t0 + oc
    m_t = rows < eos
    m_next = (oc < C - 1) & (rows + 1 < eos)  # row i + 1 is in this chunk
    slot = i_b.to(tl.int64) * NT + i_n
    if DIAG:
        cols = tl.arange(0, BK)
        m_c = cols < K
        m = m_t[:, None] & m_c[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        x = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
        if EXCL and REVERSE:
            x += tl.load(ex + off + H * K, mask=m_next[:, None] & m_c[None, :], other=0.0)
        y = tl.cumsum(x, axis=0, reverse=REVERSE)
        if HAS_ADD:
            y += tl.load(add + (slot * H + i_h) * K + cols, mask=m_c, other=0.0)[None, :]
        tl.store(out + off, y, mask=m)
        if EXCL and not REVERSE:
            tl.store(ex + off + H * K, y, mask=m_next[:, None] & m_c[None, :])
            tl.store(ex + (t0 * H + i_h) * K + cols, tl.zeros([BK], tl.float32), mask=m_c & (t0 < eos))
    else:
        off = rows * H + i_h
        x = tl.load(g + off, mask=m_t, other=0.0).to(tl.float32)
        if EXCL and REVERSE:
            x += tl.load(ex + off + H, mask=m_next, other=0.0)
        y = tl.cumsum(x, axis=0, reverse=REVERSE)
        if HAS_ADD:
            y += tl.load(add + slot * H + i_h)
        tl.store(out + off, y, mask=m_t)
        if EXCL and not REVERSE:
            tl.store(ex + off + H, y, mask=m_next)
            tl.store(ex + t0 * H + i_h + oc, tl.zeros([C], tl.float32), mask=(oc == 0) & (t0 < eos))


def chunk_cumsum(g: torch.Tensor, L: Layout, *, reverse: bool = False, add: torch.Tensor | None = None,
                 exclusive: bool = False, excl: torch.Tensor | None = None, out_dtype=torch.float32):
    """g [B, T, H] or [B, T, H, K] → the chunk-local (reverse) cumsum, same shape, `out_dtype`.
    add: None or fp32 [B, NT, H(, K)], added to every row of its chunk (after the sum).
    exclusive (forward only): return (G, R) with R the exclusive cumsum (fp32, G's rows shifted).
    excl (reverse only): None or fp32 dR of g's shape, whose strict suffix sums are added (see the
    module docstring)."""
    g = g.contiguous()
    diag = g.dim() == 4
    out = empty_output(*g.shape, dtype=out_dtype, device=g.device)
    ex = empty_output(*g.shape, dtype=torch.float32, device=g.device) if exclusive else excl
    if g.shape[1] != 0:
        _cumsum_kernel[(L.NT, L.B * L.H)](
            g, out, add if add is not None else g, ex if ex is not None else g, *varlen_args(L, g.device)[:3],
            L.T, L.NT, H=L.H, K=L.K, C=L.C, BK=pow2(L.K), DIAG=diag, REVERSE=reverse, HAS_ADD=add is not None,
            EXCL=ex is not None, IS_VARLEN=L.varlen, **launch("cumsum"))
    return (out, ex) if exclusive else out
