"""wy_representation's twin (delta class) and its backward.

Forward, per chunk with T = (I + strict_tril(diag(β) P))⁻¹ (delta_inverse.py):

    U' = T diag(β) V            [C, V]   the pseudo-values
    W  = T diag(β) (K ⊙ e^{G})  [C, K]   the read weights (exponent G ≤ 0)

K and G here are the read key and the read state's log-decay: k and G with the decay first, the
probe key p and the exclusive cumsum R with it after (Comba; the glue passes them in k's and G's
place, and the k and G gradients below are then p's and R's).

stored per token row, U' [B, T, H, V] in v's dtype and W [B, T, H, K] in k's dtype (per value
head; grouped heads read k of head h // (H / H_q)).

Backward, with dU the gradient of U' (= that of U = U' − W S_n, from delta_states.pass_states_bwd)
and dW = −dU S_nᵀ (S_n the entering state, h [B, NT, H, K, V]); Bv = diag(β) V, Bk = diag(β)(K ⊙ e^G):

    dT  = dU Bvᵀ + dW Bkᵀ,   dBv = Tᵀ dU,   dBk = Tᵀ dW
    dLm = −strict_tril(Tᵀ dT Tᵀ)                            (Lm = diag(β) P, strict)
    dv  = β ⊙ dBv
    dk  = β e^{G} ⊙ dBk   (this path only; P's path: qk_grads(k, k, dP))
    dβ_i = Σ_v v ⊙ dBv + Σ_d (k e^G) ⊙ dBk + Σ_j dLm_ij P_ij
    dG_i = Bk ⊙ dBk       (per channel; summed over d for a scalar gate)
    dP  = diag(β) dLm     fp32 [B, T, H, C]

Grid (chunk slots NT, B·H); K and V in tiles of ≤ 64; every transposed operand (Tᵀ, Bvᵀ, Bkᵀ,
S_nᵀ) is loaded transposed from memory, never a tl.trans of an accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, varlen_args


@triton.jit(do_not_specialize=["T"])
def _wy_fwd_kernel(k, v, g, beta, Ti, w, u, cu, chunk_seq, chunk_local, T, H: tl.constexpr, HQ: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, HAS_U: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                   IEEE: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    oc = tl.arange(0, C)
    b_T = tl.load(Ti + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    if HAS_U:
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m = m_t[:, None] & (vv < V)[None, :]
            off = (rows[:, None] * H + i_h) * V + vv[None, :]
            b_v = tl.load(v + off, mask=m, other=0.0).to(tl.float32) * b_beta[:, None]
            tl.store(u + off, mm(b_T, b_v, DT, IEEE).to(u.dtype.element_ty), mask=m)
    if GATE == 1:
        G = tl.load(g + rows * H + i_h, mask=m_t, other=0.0)  # [C]
    for i_k in range(0, tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (kk < K)[None, :]
        b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        b_k = b_k * b_beta[:, None]
        if GATE == 2:
            b_k = b_k * tl.exp(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m, other=0.0))
        elif GATE == 1:
            b_k = b_k * tl.exp(G)[:, None]
        tl.store(w + (rows[:, None] * H + i_h) * K + kk[None, :], mm(b_T, b_k, DT, IEEE).to(w.dtype.element_ty),
                 mask=m)


@triton.jit(do_not_specialize=["T", "NT"])
def _wy_bwd_kernel(k, v, g, beta, Ti, P, h, du, dv, dk, dbeta, dg, dP, cu, chunk_seq, chunk_local, T, NT,
                   H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
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
    oc = tl.arange(0, C)
    # Tᵀ loaded transposed from memory: b_Tt[j, i] = T_ij
    b_Tt = tl.load(Ti + (rows[None, :] * H + i_h) * C + oc[:, None], mask=m_t[None, :], other=0.0)  # [C, C]
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m_vv = vv < V
        m = m_t[:, None] & m_vv[None, :]
        off = (rows[:, None] * H + i_h) * V + vv[None, :]
        b_du = tl.load(du + off, mask=m, other=0.0)  # [C, BV] fp32
        b_vt = tl.load(v + (rows[None, :] * H + i_h) * V + vv[:, None], mask=m_vv[:, None] & m_t[None, :],
                       other=0.0).to(tl.float32) * b_beta[None, :]  # Bvᵀ  [BV, C]
        b_dT += mm(b_du, b_vt, DT, IEEE)
        b_dbv = mm(b_Tt, b_du, DT, IEEE)  # [C, BV]
        b_v = tl.load(v + off, mask=m, other=0.0).to(tl.float32)
        b_db += tl.sum(b_v * b_dbv, axis=1)
        tl.store(dv + off, (b_dbv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m)
    if GATE == 1:
        G = tl.load(g + rows * H + i_h, mask=m_t, other=0.0)  # [C]
        b_dg = tl.zeros([C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m_kk = kk < K
        m = m_t[:, None] & m_kk[None, :]
        m_tr = m_kk[:, None] & m_t[None, :]
        b_dw = tl.zeros([C, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            b_du = tl.load(du + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                           other=0.0)
            b_st = tl.load(h + ((slot * H + i_h) * K + kk[None, :]) * V + vv[:, None],
                           mask=m_vv[:, None] & m_kk[None, :], other=0.0)  # S_nᵀ  [BV, BK]
            b_dw -= mm(b_du, b_st, DT, IEEE)
        b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_tr, other=0.0).to(tl.float32)
        if GATE == 2:
            b_k = b_k * tl.exp(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m, other=0.0))
            b_kt = b_kt * tl.exp(tl.load(g + (rows[None, :] * H + i_h) * K + kk[:, None], mask=m_tr, other=0.0))
        elif GATE == 1:
            b_k = b_k * tl.exp(G)[:, None]
            b_kt = b_kt * tl.exp(G)[None, :]
        b_dT += mm(b_dw, b_kt * b_beta[None, :], DT, IEEE)  # dW Bkᵀ
        b_dbk = mm(b_Tt, b_dw, DT, IEEE)  # [C, BK]
        b_db += tl.sum(b_k * b_dbk, axis=1)  # b_k = K ⊙ e^G
        b_gdk = b_k * b_beta[:, None] * b_dbk  # Bk ⊙ dBk
        if GATE == 2:
            tl.store(dg + (rows[:, None] * H + i_h) * K + kk[None, :], b_gdk, mask=m)
        elif GATE == 1:
            b_dg += tl.sum(b_gdk, axis=1)
        b_dbk = b_dbk * b_beta[:, None]
        if GATE == 2:
            b_dbk = b_dbk * tl.exp(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m, other=0.0))
        elif GATE == 1:
            b_dbk = b_dbk * tl.exp(G)[:, None]
        tl.store(dk + (rows[:, None] * H + i_h) * K + kk[None, :], b_dbk, mask=m)
    # dLm = −strict_tril(Tᵀ dT Tᵀ); dβ from Lm = diag(β) P; dP = diag(β) dLm
    b_m = mm(mm(b_Tt, b_dT, DT, IEEE), b_Tt, DT, IEEE)  # [C, C]
    b_dl = tl.where(oc[:, None] > oc[None, :], -b_m, 0.0)
    b_P = tl.load(P + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)
    b_db += tl.sum(tl.where(oc[:, None] > oc[None, :], b_dl * b_P, 0.0), axis=1)
    tl.store(dP + (rows[:, None] * H + i_h) * C + oc[None, :], b_dl * b_beta[:, None], mask=m_t[:, None])
    tl.store(dbeta + rows * H + i_h, b_db, mask=m_t)
    if GATE == 1:
        tl.store(dg + rows * H + i_h, b_dg, mask=m_t)


def _tiles(L: Layout):
    return min(64, pow2(L.K)), min(64, pow2(L.V))


def wy_representation(k, v, G, beta, Ti, L: Layout, *, with_u: bool = True):
    """(W [B, T, H, K] in k's dtype, U' [B, T, H, V] in v's dtype, or None without `with_u`).
    k [B, T, H_q, K], v [B, T, H, V], G None or the chunk-local cumsum fp32, β [B, T, H], T from
    delta_inverse.unit_lower_inverse."""
    BK, BV = _tiles(L)
    w = empty_output(L.B, L.T, L.H, L.K, dtype=k.dtype, device=k.device)
    u = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=v.device) if with_u else None
    DT, IEEE = dot_dtype(k.dtype)
    _wy_fwd_kernel[(L.NT, L.B * L.H)](
        k, v, G if G is not None else k, beta, Ti, w, u if u is not None else w, *varlen_args(L, k.device)[:3],
        L.T, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV, GATE=0 if G is None else (2 if G.dim() == 4 else 1),
        HAS_U=with_u, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **launch("wy_fwd"))
    return w, u


def wy_representation_bwd(k, v, G, beta, Ti, P, h, du, L: Layout):
    """(dv [B, T, H, V] in v's dtype, dk [B, T, H, K] fp32 per value head (the W path), dβ [B, T, H] fp32,
    dG per row fp32 (G's shape) or None, dP [B, T, H, C] fp32). du: fp32 [B, T, H, V], the gradient of U."""
    BK, BV = _tiles(L)
    dev = k.device
    dv = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev)
    dk = empty_output(L.B, L.T, L.H, L.K, dtype=torch.float32, device=dev)
    dbeta = empty_output(L.B, L.T, L.H, dtype=torch.float32, device=dev)
    dg = empty_output(*G.shape, dtype=torch.float32, device=dev) if G is not None else None
    dP = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=dev)
    DT, IEEE = dot_dtype(k.dtype)
    _wy_bwd_kernel[(L.NT, L.B * L.H)](
        k, v, G if G is not None else k, beta, Ti, P, h, du, dv, dk, dbeta, dg if dg is not None else dk, dP,
        *varlen_args(L, dev)[:3], L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
        **launch("wy_bwd"))
    return dv, dk, dbeta, dg, dP
