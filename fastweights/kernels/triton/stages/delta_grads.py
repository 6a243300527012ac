"""The last pass of the delta-class backward: the parts of dq, dk (dp) and dG (dR) summed, folded
over the groups of value heads and cast, in one read of each part (instead of a chain of torch adds).

    dq[b, t, j] = Σ_{h ∈ group j} dq₁[b, t, h]
    dk[b, t, j] = Σ_{h ∈ group j} (dk₁ + dk₂ + dk₃ + dk₄)[b, t, h]      (Aqk/K̃, W, P's rows, P's columns)
    dG[b, t, h] = dG₁ + dG₂ + dG₃                                        (per value head, fp32)

With a probe key p (Comba) the read-key parts — W's and P's rows, dk₂ and dk₃ — are p's:
dk = Σ (dk₁ + dk₄), dp = Σ (dk₂ + dk₃). With the read decay the exclusive cumsum R (decay after),
its parts are kept apart: dG = dG₁ + dG₃ (Aqk/K̃, P's columns), dR = dG₂ + dG₄ (W, P's rows), fp32.

dq, dk, dp come back in q's dtype [B, T, H_q, K]; group j holds value heads j·(H/H_q) … (j+1)·(H/H_q) − 1.

Grid (⌈B·T / BT⌉, H_q), BT = 32 token rows, K whole (≤ 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import launch, pow2

BT = 32


@triton.jit
def _sum_gates(dg1, dg2, dg3, dg4, dg, dgx, o, m, EXCL: tl.constexpr):
    """dG (and dR with EXCL) of the rows at offsets o (mask m)."""
    if EXCL:
        tl.store(dg + o, tl.load(dg1 + o, mask=m, other=0.0) + tl.load(dg3 + o, mask=m, other=0.0), mask=m)
        tl.store(dgx + o, tl.load(dg2 + o, mask=m, other=0.0) + tl.load(dg4 + o, mask=m, other=0.0), mask=m)
    else:
        tl.store(dg + o, tl.load(dg1 + o, mask=m, other=0.0) + tl.load(dg2 + o, mask=m, other=0.0)
                 + tl.load(dg3 + o, mask=m, other=0.0), mask=m)


@triton.jit(do_not_specialize=["R"])
def _sum_kernel(dq1, dk1, dk2, dk3, dk4, dg1, dg2, dg3, dg4, dq, dk, dp, dg, dgx, R, H: tl.constexpr,
                HQ: tl.constexpr, K: tl.constexpr, GS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                GATE: tl.constexpr, PROBE: tl.constexpr, EXCL: tl.constexpr):
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    kk = tl.arange(0, BK)
    m_t = rows < R
    m = m_t[:, None] & (kk < K)[None, :]
    acc_q = tl.zeros([BT, BK], dtype=tl.float32)
    acc_k = tl.zeros([BT, BK], dtype=tl.float32)
    acc_p = tl.zeros([BT, BK], dtype=tl.float32)
    for j in tl.static_range(GS):
        i_h = i_hq * GS + j
        off = (rows[:, None] * H + i_h) * K + kk[None, :]
        acc_q += tl.load(dq1 + off, mask=m, other=0.0)
        if PROBE:
            acc_k += tl.load(dk1 + off, mask=m, other=0.0) + tl.load(dk4 + off, mask=m, other=0.0)
            acc_p += tl.load(dk2 + off, mask=m, other=0.0) + tl.load(dk3 + off, mask=m, other=0.0)
        else:
            acc_k += (tl.load(dk1 + off, mask=m, other=0.0) + tl.load(dk2 + off, mask=m, other=0.0)
                      + tl.load(dk3 + off, mask=m, other=0.0) + tl.load(dk4 + off, mask=m, other=0.0))
        if GATE == 2:
            _sum_gates(dg1, dg2, dg3, dg4, dg, dgx, off, m, EXCL)
        elif GATE == 1:
            _sum_gates(dg1, dg2, dg3, dg4, dg, dgx, rows * H + i_h, m_t, EXCL)
    out = (rows[:, None] * HQ + i_hq) * K + kk[None, :]
    tl.store(dq + out, acc_q.to(dq.dtype.element_ty), mask=m)
    if PROBE:
        tl.store(dp + out, acc_p.to(dp.dtype.element_ty), mask=m)
    tl.store(dk + out, acc_k.to(dk.dtype.element_ty), mask=m)


def sum_grads(dq1, dks, dgs, dtype, L: Layout, *, probe: bool = False):
    """(dq, dk, dp (None without `probe`) [B, T, H_q, K] in `dtype`, dG fp32 [B, T, H(, K)] or None,
    dR fp32 or None) from dq₁ [B, T, H, K] fp32, the four dk parts (same shape) and the three dG
    parts — four with the exclusive read decay (dR's two last) — or None without decay."""
    dev = dq1.device
    dq = empty_output(L.B, L.T, L.Hq, L.K, dtype=dtype, device=dev)
    dk = empty_output(L.B, L.T, L.Hq, L.K, dtype=dtype, device=dev)
    dp = empty_output(L.B, L.T, L.Hq, L.K, dtype=dtype, device=dev) if probe else None
    dg = empty_output(*dgs[0].shape, dtype=torch.float32, device=dev) if dgs is not None else None
    excl = dgs is not None and len(dgs) == 4
    dgx = empty_output(*dgs[0].shape, dtype=torch.float32, device=dev) if excl else None
    dgs = (tuple(dgs) + (dq1,)) if (dgs is not None and not excl) else (dgs if dgs is not None else (dq1,) * 4)
    R = L.B * L.T
    _sum_kernel[(triton.cdiv(R, BT), L.Hq)](
        dq1, *dks, *dgs, dq, dk, dp if probe else dq, dg if dg is not None else dq, dgx if excl else dq, R, H=L.H,
        HQ=L.Hq, K=L.K, GS=L.H // L.Hq, BT=BT, BK=pow2(L.K), GATE=0 if dg is None else (2 if dg.dim() == 4 else 1),
        PROBE=probe, EXCL=excl, **launch("delta_grads"))
    return dq, dk, dp, dg, dgx
