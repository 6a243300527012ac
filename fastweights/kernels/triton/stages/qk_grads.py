"""The backward of decayed_scores and of the Q̃, K̃ rows: dq, dk, dβ and the per-row dG.

With dA = dO Vᵀ (causal, from output.chunk_outputs_bwd), h the entering state S_n and dh the
gradient of the leaving state dS_{n+1} of each chunk:

    dq_i  = scale Σ_{j ≤ i} dA_ij (β_j k_j ⊙ e^{G_i − G_j})  +  scale e^{G_i} ⊙ (S_n dO_i)
    dk̂_j  = scale Σ_{i ≥ j} dA_ij (q_i ⊙ e^{G_i − G_j})      +  e^{G_last − G_j} ⊙ (dS_{n+1} v_j)
    dk_j  = β_j dk̂_j,   dβ_j = Σ_d k_jd dk̂_jd
    dG_i  = q_i ⊙ dq_i − k_i ⊙ dk_i    (summed over d for a scalar gate)

(k̂ = βk). dg is then the chunk-local suffix sum of dG plus ∂L/∂G_last of the chunk
(cumsum.chunk_cumsum(reverse=True, add=…)).

Grid (chunk slots NT, C / BC row blocks, B·H), BC = 16 with diagonal decay, 32 otherwise (by default:
util.LAUNCH), K whole in
one tile (K ≤ 256).
Diagonal decay keeps every exponent ≤ 0 as the forward does: blocks of rows against earlier
(dq) or later (dk) blocks through a reference row — the first row of the query block for dq,
the last real row of the key block for dk — and the diagonal 16×16 blocks elementwise, row by
row. Every transposed operand is loaded transposed from memory (no tl.trans of an accumulator).

The query rows may carry their own log-decay R (`Gq`: the delta rule's P = R̃Kᵀ with Comba's
exclusive cumsum R, scores.py): the exponents read R on the query side (G_i → R_i above), the
masks are strict (j < i: dA is strictly lower there, and R_i − G_i = −g_i > 0 must not reach an
exp), the reference row of dq is R of the block's first row, and the per-row dG comes back in two
parts, q ⊙ dq (of R) and −k ⊙ dk (of G).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, tile, varlen_args

# Rows per program (util.LAUNCH["qk_grads"]): BC_DIAG = 16 with diagonal decay (the diagonal block is
# walked row by row), BC = 32 without decay or with a scalar one (each program reads the chunk's states
# S_n and dS_{n+1} whole, so fewer, taller blocks read them fewer times); any power of two ≥ 16, ≤ C.


@triton.jit
def _inter(v, h, dh, do, ts, m_s, slot, i_h, ok, m_k, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
           HAS_INTER: tl.constexpr):
    """(S_n dO_i, dS_{n+1} v_j) for the block's rows [BC, BK] each, fp32, over the V tiles (the
    states loaded transposed from memory); zeros when HAS_INTER is off."""
    inter_q = tl.zeros([BC, BK], dtype=tl.float32)
    inter_k = tl.zeros([BC, BK], dtype=tl.float32)
    if HAS_INTER:
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            m_sv = m_s[:, None] & m_vv[None, :]
            m_vk = m_vv[:, None] & m_k[None, :]
            st = ((slot * H + i_h) * K + ok[None, :]) * V + vv[:, None]  # [BV, BK] transposed state offsets
            b_do = tl.load(do + (ts[:, None] * H + i_h) * V + vv[None, :], mask=m_sv, other=0.0)
            b_v = tl.load(v + (ts[:, None] * H + i_h) * V + vv[None, :], mask=m_sv, other=0.0)
            inter_q += mm(b_do, tl.load(h + st, mask=m_vk, other=0.0), DT, IEEE)
            inter_k += mm(b_v, tl.load(dh + st, mask=m_vk, other=0.0), DT, IEEE)
    return inter_q, inter_k


@triton.jit(do_not_specialize=["T", "NT"])
def _qk_grads_kernel(q, k, v, g, gq, beta, h, dh, do, dA, dq, dk, dbeta, dg, dgq, fk1, fk2, fg1, fg2, cu, chunk_seq,
                     chunk_local, scale, T, NT,
                     H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                     HAS_BETA: tl.constexpr, HAS_INTER: tl.constexpr, EXCL: tl.constexpr, FOLD: tl.constexpr,
                     IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    # EXCL: the query rows' log-decay is gq (Comba's exclusive cumsum), masks strict, dG in two parts
    # FOLD: q is k (the delta rule's KKᵀ backward): dk := dq + dk + fk1 + fk2, dG := dG + fg1 + fg2
    i_n, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    t_last = tl.maximum(tl.minimum(t0 + C, eos) - 1, t0)  # an unused varlen slot (no row) still reads in bounds
    oi = tl.arange(0, BC)
    ok = tl.arange(0, BK)
    m_k = ok < K
    ts = t0 + i_s * BC + oi  # this block's rows  [BC]
    m_s = ts < eos
    m_sk = m_s[:, None] & m_k[None, :]
    b_q = tl.load(q + (ts[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_sk, other=0.0).to(tl.float32)
    b_k = tl.load(k + (ts[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_sk, other=0.0).to(tl.float32)
    if HAS_BETA:
        b_beta = tl.load(beta + ts * H + i_h, mask=m_s, other=0.0).to(tl.float32)
    if GATE == 2:
        G_s = tl.load(g + (ts[:, None] * H + i_h) * K + ok[None, :], mask=m_sk, other=0.0)  # [BC, BK]
        G_last = tl.load(g + (t_last * H + i_h) * K + ok, mask=m_k, other=0.0)  # [BK]
        if EXCL:
            Gq_s = tl.load(gq + (ts[:, None] * H + i_h) * K + ok[None, :], mask=m_sk, other=0.0)  # [BC, BK]
        else:
            Gq_s = G_s
    elif GATE == 1:
        G_s = tl.load(g + ts * H + i_h, mask=m_s, other=0.0)  # [BC]
        G_last = tl.load(g + t_last * H + i_h)
        if EXCL:
            Gq_s = tl.load(gq + ts * H + i_h, mask=m_s, other=0.0)  # [BC]
        else:
            Gq_s = G_s

    # ---- intra-chunk parts
    acc_q = tl.zeros([BC, BK], dtype=tl.float32)
    acc_k = tl.zeros([BC, BK], dtype=tl.float32)
    if GATE == 2:
        t_rq = t0 + i_s * BC  # reference row of dq: the block's first row
        rho_q = tl.load(gq + (t_rq * H + i_h) * K + ok, mask=m_k & (t_rq < eos), other=0.0)
        t_rk = tl.minimum(t0 + i_s * BC + BC, eos) - 1  # reference row of dk: the block's last real row
        rho_k = tl.load(g + (t_rk * H + i_h) * K + ok, mask=m_k & (t_rk >= t0), other=0.0)
        for i_r in range(0, C // BC):
            tr = t0 + i_r * BC + oi
            m_r = tr < eos
            m_rk = m_r[:, None] & m_k[None, :]
            if i_r < i_s:  # dq: earlier key block r
                b_dA = tl.load(dA + (ts[:, None] * H + i_h) * C + (i_r * BC + oi)[None, :], mask=m_s[:, None],
                               other=0.0)  # [BC, BC] rows s, cols r
                k_r = tl.load(k + (tr[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_rk, other=0.0).to(tl.float32)
                if HAS_BETA:
                    k_r = k_r * tl.load(beta + tr * H + i_h, mask=m_r, other=0.0).to(tl.float32)[:, None]
                G_r = tl.load(g + (tr[:, None] * H + i_h) * K + ok[None, :], mask=m_rk, other=0.0)
                k_r = k_r * tl.exp(tl.where(m_rk, rho_q[None, :] - G_r, 0.0))  # exponent ≤ 0
                acc_q += mm(b_dA, k_r, DT, IEEE)
            if i_r > i_s:  # dk: later query block r
                b_dAt = tl.load(dA + (tr[None, :] * H + i_h) * C + (i_s * BC + oi)[:, None], mask=m_r[None, :],
                                other=0.0)  # [BC, BC]: [j in s, i in r] = dA_ij
                q_r = tl.load(q + (tr[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_rk, other=0.0).to(tl.float32)
                G_r = tl.load(gq + (tr[:, None] * H + i_h) * K + ok[None, :], mask=m_rk, other=0.0)
                q_r = q_r * tl.exp(tl.where(m_rk, G_r - rho_k[None, :], 0.0))  # exponent ≤ 0
                acc_k += mm(b_dAt, q_r, DT, IEEE)
        acc_q = acc_q * tl.exp(tl.where(m_sk, Gq_s - rho_q[None, :], 0.0))
        acc_k = acc_k * tl.exp(tl.where(m_sk, rho_k[None, :] - G_s, 0.0))
        # the diagonal block, row by row / column by column (exponents masked to 0 off the mask)
        for j in range(0, BC):
            tj = t0 + i_s * BC + j
            ok_j = tj < eos
            # dq: column j of the block (key row j)
            dA_col = tl.load(dA + (ts * H + i_h) * C + i_s * BC + j, mask=m_s, other=0.0)  # [BC]
            k_j = tl.load(k + (tj * HQ + i_hq) * K + ok, mask=m_k & ok_j, other=0.0).to(tl.float32)
            if HAS_BETA:
                k_j = k_j * tl.load(beta + tj * H + i_h, mask=ok_j, other=0.0).to(tl.float32)
            G_j = tl.load(g + (tj * H + i_h) * K + ok, mask=m_k & ok_j, other=0.0)
            below = ((oi > j) if EXCL else (oi >= j)) & m_s
            acc_q += dA_col[:, None] * k_j[None, :] * tl.exp(tl.where(below[:, None], Gq_s - G_j[None, :], 0.0))
            # dk: row j of the block (query row j) against the block's keys i ≤ j
            dA_row = tl.load(dA + (tj * H + i_h) * C + i_s * BC + oi, mask=(oi <= j) & ok_j, other=0.0)  # [BC]
            q_j = tl.load(q + (tj * HQ + i_hq) * K + ok, mask=m_k & ok_j, other=0.0).to(tl.float32)
            if EXCL:
                G_j = tl.load(gq + (tj * H + i_h) * K + ok, mask=m_k & ok_j, other=0.0)  # the query row's R_j
            above = ((oi < j) if EXCL else (oi <= j)) & m_s & ok_j
            acc_k += dA_row[:, None] * q_j[None, :] * tl.exp(tl.where(above[:, None], G_j[None, :] - G_s, 0.0))
    else:
        # inter-chunk parts first, decayed, so one accumulator per gradient (dk's intra part is
        # scaled through dA, dq's whole sum at the end)
        acc_q, acc_k = _inter(v, h, dh, do, ts, m_s, slot, i_h, ok, m_k, H, K, V, BC, BK, BV, DT, IEEE, HAS_INTER)
        if GATE == 1:
            acc_q = acc_q * tl.exp(Gq_s)[:, None]
            acc_k = acc_k * tl.exp(tl.where(m_s, G_last - G_s, 0.0))[:, None]
        for i_r in range(0, C // BC):
            tr = t0 + i_r * BC + oi
            m_r = tr < eos
            m_rk = m_r[:, None] & m_k[None, :]
            if i_r <= i_s:
                b_dA = tl.load(dA + (ts[:, None] * H + i_h) * C + (i_r * BC + oi)[None, :], mask=m_s[:, None],
                               other=0.0)  # rows s, cols r (causal already)
                if GATE == 1:
                    G_r = tl.load(g + tr * H + i_h, mask=m_r, other=0.0)
                    ii, jj = (i_s * BC + oi)[:, None], (i_r * BC + oi)[None, :]
                    keep = ((ii > jj) if EXCL else (ii >= jj)) & m_s[:, None] & m_r[None, :]
                    b_dA = b_dA * tl.exp(tl.where(keep, Gq_s[:, None] - G_r[None, :], 0.0))
                k_r = tl.load(k + (tr[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_rk, other=0.0).to(tl.float32)
                if HAS_BETA:
                    k_r = k_r * tl.load(beta + tr * H + i_h, mask=m_r, other=0.0).to(tl.float32)[:, None]
                acc_q += mm(b_dA, k_r, DT, IEEE)
            if i_r >= i_s:
                b_dAt = tl.load(dA + (tr[None, :] * H + i_h) * C + (i_s * BC + oi)[:, None], mask=m_r[None, :],
                                other=0.0)  # [j in s, i in r]
                if GATE == 1:
                    G_r = tl.load(gq + tr * H + i_h, mask=m_r, other=0.0)  # the query rows' log-decay
                    ii, jj = (i_r * BC + oi)[None, :], (i_s * BC + oi)[:, None]
                    keep = ((ii > jj) if EXCL else (ii >= jj)) & m_r[None, :] & m_s[:, None]
                    b_dAt = b_dAt * tl.exp(tl.where(keep, G_r[None, :] - G_s[:, None], 0.0))
                q_r = tl.load(q + (tr[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_rk, other=0.0).to(tl.float32)
                acc_k += mm(b_dAt * scale, q_r, DT, IEEE)
    if GATE == 2:
        # ---- inter-chunk parts: S_n dO_i and dS_{n+1} v_j
        inter_q, inter_k = _inter(v, h, dh, do, ts, m_s, slot, i_h, ok, m_k, H, K, V, BC, BK, BV, DT, IEEE, HAS_INTER)
        b_dq = (acc_q + inter_q * tl.exp(Gq_s)) * scale
        b_dkb = acc_k * scale + inter_k * tl.exp(tl.where(m_sk, G_last[None, :] - G_s, 0.0))
    else:
        b_dq = acc_q * scale
        b_dkb = acc_k
    if HAS_BETA:
        b_dk = b_dkb * b_beta[:, None]
        tl.store(dbeta + ts * H + i_h, tl.sum(b_k * b_dkb, axis=1), mask=m_s)
    else:
        b_dk = b_dkb
    off = (ts[:, None] * H + i_h) * K + ok[None, :]
    if FOLD:
        b_sum = b_dk + b_dq + tl.load(fk1 + off, mask=m_sk, other=0.0) + tl.load(fk2 + off, mask=m_sk, other=0.0)
        tl.store(dk + off, b_sum.to(dk.dtype.element_ty), mask=m_sk)
    else:
        tl.store(dq + off, b_dq.to(dq.dtype.element_ty), mask=m_sk)
        tl.store(dk + off, b_dk.to(dk.dtype.element_ty), mask=m_sk)
    if EXCL:
        if GATE == 2:
            tl.store(dg + off, -(b_k * b_dk), mask=m_sk)
            tl.store(dgq + off, b_q * b_dq, mask=m_sk)
        elif GATE == 1:
            tl.store(dg + ts * H + i_h, -tl.sum(b_k * b_dk, axis=1), mask=m_s)
            tl.store(dgq + ts * H + i_h, tl.sum(b_q * b_dq, axis=1), mask=m_s)
    elif GATE == 2:
        b_g = b_q * b_dq - b_k * b_dk
        if FOLD:
            b_g += tl.load(fg1 + off, mask=m_sk, other=0.0) + tl.load(fg2 + off, mask=m_sk, other=0.0)
        tl.store(dg + off, b_g, mask=m_sk)
    elif GATE == 1:
        b_g = tl.sum(b_q * b_dq - b_k * b_dk, axis=1)
        if FOLD:
            b_g += tl.load(fg1 + ts * H + i_h, mask=m_s, other=0.0) + tl.load(fg2 + ts * H + i_h, mask=m_s, other=0.0)
        tl.store(dg + ts * H + i_h, b_g, mask=m_s)


def qk_grads(q, k, v, G, beta, h, dh, do, dA, scale: float, L: Layout, *, grad_dtype=None, Gq=None, fold=None):
    """(dq, dk [B, T, H, K] per value head — in `grad_dtype`, by default q's dtype without grouped
    heads and fp32 with them (for the sum over each group); dβ [B, T, H] fp32 or None; dG per row,
    fp32, G's shape, or None — with `Gq` the pair (dG of the keys' G, dG of the queries' Gq)).
    h = None (v, dh, do then unused): the intra-chunk parts only (the delta class's KKᵀ backward).
    Gq: the query rows' own log-decay (Comba's exclusive cumsum; G's shape), strict masks.
    fold = (dk₁, dk₂, dG₁, dG₂): q is k (the delta rule's KKᵀ backward without a probe, H_q = H, no Gq):
    the other paths' fp32 parts of dk [B, T, H, K] and dG (None without decay) are added in the kernel,
    so (None, dk in q's dtype = dq + dk + dk₁ + dk₂, dβ, dG + dG₁ + dG₂) come back — no summing pass."""
    dev = q.device
    inter = h is not None
    if not inter:
        v = dh = do = h = dA
    if fold is not None and (L.H != L.Hq or Gq is not None or (G is None) != (fold[2] is None)):
        raise ValueError("qk_grads(fold=…) needs H_q = H, no Gq, and dG parts exactly when there is a decay")
    gdt = grad_dtype if grad_dtype is not None else (q.dtype if L.H == L.Hq else torch.float32)
    dq = empty_output(L.B, L.T, L.H, L.K, dtype=gdt, device=dev) if fold is None else None
    dk = empty_output(L.B, L.T, L.H, L.K, dtype=gdt, device=dev)
    dbeta = empty_output(L.B, L.T, L.H, dtype=torch.float32, device=dev) if beta is not None else None
    dg = empty_output(*G.shape, dtype=torch.float32, device=dev) if G is not None else None
    excl = Gq is not None and G is not None
    dgq = empty_output(*G.shape, dtype=torch.float32, device=dev) if excl else None
    gate = 0 if G is None else (2 if G.dim() == 4 else 1)
    bc = min(tile("qk_grads", "BC_DIAG" if gate == 2 else "BC"), L.C)
    DT, IEEE = dot_dtype(q.dtype)
    _qk_grads_kernel[(L.NT, L.C // bc, L.B * L.H)](
        q, k, v, G if G is not None else q, Gq if excl else (G if G is not None else q),
        beta if beta is not None else q, h, dh, do, dA, dq if dq is not None else dk, dk,
        dbeta if dbeta is not None else dk, dg if dg is not None else dk, dgq if excl else dk,
        *((f if f is not None else dk) for f in (fold or (dk,) * 4)), *varlen_args(L, dev)[:3], scale, L.T, L.NT,
        H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BC=bc, BK=pow2(L.K), BV=min(64, pow2(L.V)),
        GATE=gate, HAS_BETA=beta is not None, HAS_INTER=inter, EXCL=excl, FOLD=fold is not None, IS_VARLEN=L.varlen,
        DT=DT, IEEE=IEEE, **launch("qk_grads"))
    return dq, dk, dbeta, ((dg, dgq) if excl else dg)
