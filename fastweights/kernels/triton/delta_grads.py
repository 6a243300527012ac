"""The last pass of the delta-class backward: the parts of dq, dk and dG summed, folded over the
groups of value heads and cast, in one read of each part (instead of a chain of torch adds).

    dq[b, t, j] = Σ_{h ∈ group j} dq₁[b, t, h]
    dk[b, t, j] = Σ_{h ∈ group j} (dk₁ + dk₂ + dk₃ + dk₄)[b, t, h]      (Aqk/K̃, W, P's rows, P's columns)
    dG[b, t, h] = dG₁ + dG₂ + dG₃                                        (per value head, fp32)

dq, dk come back in q's dtype [B, T, H_q, K]; group j holds value heads j·(H/H_q) … (j+1)·(H/H_q) − 1.

Grid (⌈B·T / BT⌉, H_q), BT = 32 token rows, K whole (≤ 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import empty_output
from .layout import Layout
from .util import LAUNCH, pow2

BT = 32


@triton.jit
def _sum_kernel(dq1, dk1, dk2, dk3, dk4, dg1, dg2, dg3, dq, dk, dg, R, H: tl.constexpr, HQ: tl.constexpr,
                K: tl.constexpr, GS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr):
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    kk = tl.arange(0, BK)
    m_t = rows < R
    m = m_t[:, None] & (kk < K)[None, :]
    acc_q = tl.zeros([BT, BK], dtype=tl.float32)
    acc_k = tl.zeros([BT, BK], dtype=tl.float32)
    for j in tl.static_range(GS):
        i_h = i_hq * GS + j
        off = (rows[:, None] * H + i_h) * K + kk[None, :]
        acc_q += tl.load(dq1 + off, mask=m, other=0.0)
        acc_k += (tl.load(dk1 + off, mask=m, other=0.0) + tl.load(dk2 + off, mask=m, other=0.0)
                  + tl.load(dk3 + off, mask=m, other=0.0) + tl.load(dk4 + off, mask=m, other=0.0))
        if GATE == 2:
            tl.store(dg + off, tl.load(dg1 + off, mask=m, other=0.0) + tl.load(dg2 + off, mask=m, other=0.0)
                     + tl.load(dg3 + off, mask=m, other=0.0), mask=m)
        elif GATE == 1:
            o1 = rows * H + i_h
            tl.store(dg + o1, tl.load(dg1 + o1, mask=m_t, other=0.0) + tl.load(dg2 + o1, mask=m_t, other=0.0)
                     + tl.load(dg3 + o1, mask=m_t, other=0.0), mask=m_t)
    out = (rows[:, None] * HQ + i_hq) * K + kk[None, :]
    tl.store(dq + out, acc_q.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + out, acc_k.to(dk.dtype.element_ty), mask=m)


def sum_grads(dq1, dks, dgs, dtype, L: Layout):
    """(dq, dk [B, T, H_q, K] in `dtype`, dG fp32 [B, T, H(, K)] or None) from dq₁ [B, T, H, K] fp32,
    the four dk parts (same shape) and the three dG parts (None without decay)."""
    dev = dq1.device
    dq = empty_output(L.B, L.T, L.Hq, L.K, dtype=dtype, device=dev)
    dk = empty_output(L.B, L.T, L.Hq, L.K, dtype=dtype, device=dev)
    dg = empty_output(*dgs[0].shape, dtype=torch.float32, device=dev) if dgs is not None else None
    dgs = dgs if dgs is not None else (dq1, dq1, dq1)
    R = L.B * L.T
    _sum_kernel[(triton.cdiv(R, BT), L.Hq)](
        dq1, *dks, *dgs, dq, dk, dg if dg is not None else dq, R, H=L.H, HQ=L.Hq, K=L.K, GS=L.H // L.Hq, BT=BT,
        BK=pow2(L.K), GATE=0 if dg is None else (2 if dg.dim() == 4 else 1), **LAUNCH)
    return dq, dk, dg
