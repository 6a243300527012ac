"""chunk_outputs' twin: o = A V + Q̃ S_n per chunk, Q̃ = scale q ⊙ e^{G} (exponent ≤ 0); and its
backward for v and A:

    dV = Aᵀ dO + K̃ dS_{n+1}       (K̃ = β k ⊙ e^{G_last − G}; dS_{n+1} from states.pass_states_bwd)
    dA = dO Vᵀ on the causal mask (j ≤ i), fp32 [B, T, H, C]

Forward grid (chunk slots NT, ⌈V/BV⌉, B·H): [C, C]×[C, BV] plus Σ over K tiles [C, BK]×[BK, BV].
Backward grid (NT, B·H): one program loops over the V tiles (dA needs the sum over all of V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, tile, varlen_args


@triton.jit
def _load_rows_decay(x, g, rows, m_t, t_last, i_hx, i_h, kk, m_kk, HX: tl.constexpr, H: tl.constexpr,
                     K: tl.constexpr, GATE: tl.constexpr, LAST: tl.constexpr):
    """Rows of q or k [C, BK] (fp32) times e^{G} (LAST=False) or e^{G_last − G} (LAST=True)."""
    m = m_t[:, None] & m_kk[None, :]
    b = tl.load(x + (rows[:, None] * HX + i_hx) * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
    if GATE == 2:
        G = tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m, other=0.0)
        if LAST:
            G_last = tl.load(g + (t_last * H + i_h) * K + kk, mask=m_kk, other=0.0)
            b = b * tl.exp(tl.where(m, G_last[None, :] - G, 0.0))
        else:
            b = b * tl.exp(G)
    elif GATE == 1:
        G = tl.load(g + rows * H + i_h, mask=m_t, other=0.0)
        if LAST:
            G_last = tl.load(g + t_last * H + i_h)
            b = b * tl.exp(tl.where(m_t, G_last - G, 0.0))[:, None]
        else:
            b = b * tl.exp(G)[:, None]
    return b


@triton.jit(do_not_specialize=["T", "NT"])
def _output_fwd_kernel(q, v, g, A, h, o, cu, chunk_seq, chunk_local, scale, T, NT, H: tl.constexpr,
                       HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                       IEEE: tl.constexpr):
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    oc = tl.arange(0, C)
    vv = i_v * BV + tl.arange(0, BV)
    m_vv = vv < V
    b_A = tl.load(A + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
    b_v = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_vv[None, :], other=0.0)
    acc = mm(b_A, b_v, DT, IEEE)  # [C, BV]
    for i_k in range(0, tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m_kk = kk < K
        b_q = _load_rows_decay(q, g, rows, m_t, t0, i_hq, i_h, kk, m_kk, HQ, H, K, GATE, False) * scale
        b_h = tl.load(h + ((slot * H + i_h) * K + kk[:, None]) * V + vv[None, :],
                      mask=m_kk[:, None] & m_vv[None, :], other=0.0)  # [BK, BV]
        acc += mm(b_q, b_h, DT, IEEE)
    tl.store(o + (rows[:, None] * H + i_h) * V + vv[None, :], acc.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_vv[None, :])


@triton.jit(do_not_specialize=["T", "NT"])
def _output_bwd_kernel(k, v, g, beta, A, dh, do, dv, dA, cu, chunk_seq, chunk_local, T, NT, H: tl.constexpr,
                       HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DT: tl.constexpr, IEEE: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    t_last = tl.maximum(tl.minimum(t0 + C, eos) - 1, t0)  # an unused varlen slot (no row) still reads in bounds
    oc = tl.arange(0, C)
    # Aᵀ loaded transposed from memory: b_At[j, i] = A_ij
    b_At = tl.load(A + (rows[None, :] * H + i_h) * C + oc[:, None], mask=m_t[None, :], other=0.0)  # [C, C]
    if HAS_BETA:
        b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m_vv = vv < V
        m = m_t[:, None] & m_vv[None, :]
        b_do = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m, other=0.0)  # [C, BV]
        b_vt = tl.load(v + (rows[None, :] * H + i_h) * V + vv[:, None], mask=m_vv[:, None] & m_t[None, :],
                       other=0.0)  # [BV, C]
        b_dA += mm(b_do, b_vt, DT, IEEE)
        acc = mm(b_At, b_do, DT, IEEE)  # [C, BV]
        for i_k in range(0, tl.cdiv(K, BK)):
            kk = i_k * BK + tl.arange(0, BK)
            m_kk = kk < K
            b_k = _load_rows_decay(k, g, rows, m_t, t_last, i_hq, i_h, kk, m_kk, HQ, H, K, GATE, True)
            if HAS_BETA:
                b_k = b_k * b_beta[:, None]
            b_dh = tl.load(dh + ((slot * H + i_h) * K + kk[:, None]) * V + vv[None, :],
                           mask=m_kk[:, None] & m_vv[None, :], other=0.0)  # [BK, BV]
            acc += mm(b_k, b_dh, DT, IEEE)
        tl.store(dv + (rows[:, None] * H + i_h) * V + vv[None, :], acc.to(dv.dtype.element_ty), mask=m)
    b_dA = tl.where(oc[:, None] >= oc[None, :], b_dA, 0.0)
    tl.store(dA + (rows[:, None] * H + i_h) * C + oc[None, :], b_dA, mask=m_t[:, None])


def _tiles(L: Layout, bv: int = 64):
    """(BK, BV) for K and V at most bv (the forward's grid takes bv from util.LAUNCH)."""
    return min(64, pow2(L.K)), min(bv, pow2(L.V))


def chunk_outputs(q, v, G, A, h, scale: float, L: Layout) -> torch.Tensor:
    """o [B, T, H, V] in v's dtype."""
    BK, BV = _tiles(L, tile("output_fwd", "BV"))
    o = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=v.device)
    DT, IEEE = dot_dtype(v.dtype)
    _output_fwd_kernel[(L.NT, triton.cdiv(L.V, BV), L.B * L.H)](
        q, v, G if G is not None else q, A, h, o, *varlen_args(L, v.device)[:3], scale, L.T, L.NT, H=L.H, HQ=L.Hq,
        K=L.K, V=L.V, C=L.C, BK=BK, BV=BV, GATE=0 if G is None else (2 if G.dim() == 4 else 1),
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **launch("output_fwd"))
    return o


def chunk_outputs_bwd(k, v, G, beta, A, dh, do, L: Layout):
    """(dv [B, T, H, V] in v's dtype, dA [B, T, H, C] fp32)."""
    BK, BV = _tiles(L)
    dv = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=v.device)
    dA = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=v.device)
    DT, IEEE = dot_dtype(v.dtype)
    _output_bwd_kernel[(L.NT, L.B * L.H)](
        k, v, G if G is not None else k, beta if beta is not None else k, A, dh, do, dv, dA,
        *varlen_args(L, v.device)[:3], L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), HAS_BETA=beta is not None, IS_VARLEN=L.varlen,
        DT=DT, IEEE=IEEE, **launch("output_bwd"))
    return dv, dA
