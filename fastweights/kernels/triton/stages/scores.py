"""decayed_scores' twin for the gated-linear class: the intra-chunk attention matrix

    A_ij = scale Σ_d q_id β_j k_jd e^{G_id − G_jd}   for j ≤ i in the chunk, else 0,

stored per token row, A [B, T, H, C] fp32 (row i of a chunk holds its C columns j).

Grid (chunk slots NT, C / BC query sub-blocks, B·H); BC = 16. A program computes the query
rows of its sub-block s against every key sub-block r of the chunk:
- no decay / scalar decay: (q_s k_rᵀ) ⊙ e^{G_i − G_j} on the causal mask, one tl.dot per r ≤ s;
- diagonal decay, r < s: (q_s ⊙ e^{G_s − ρ}) (β k_r ⊙ e^{ρ − G_r})ᵀ with the reference row
  ρ = G of the first row of block s — every exponent ≤ 0 since G is non-increasing;
- diagonal decay, r = s: column by column, Σ_d q_id β_j k_jd e^{G_id − G_jd} elementwise with
  the exponent masked to 0 above the diagonal (≤ 0 wherever it is used);
- r > s: zeros.
Grouped value heads: value head h reads q/k head h // (H / H_q).

The query rows may carry their own log-decay R (`Gq`, default G): the delta rule's
P_ij = Σ_d r_id k_jd e^{R_id − G_jd} with Comba's exclusive cumsum R_i = G_{i−1} (cumsum.py), taken
strictly below the diagonal (`strict`: on it R_i − G_i = −g_i > 0). The reference row ρ is then
R of the block's first row (= G of the row before it), so the exponents stay ≤ 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, varlen_args

BC = 16


@triton.jit(do_not_specialize=["T"])
def _scores_kernel(q, k, g, gq, beta, A, cu, chunk_seq, chunk_local, scale, T, H: tl.constexpr, HQ: tl.constexpr,
                   K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                   HAS_BETA: tl.constexpr, STRICT: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                   IEEE: tl.constexpr):
    # GATE: 0 none, 1 scalar [B, T, H], 2 diagonal [B, T, H, K]; gq: the query rows' log-decay (g itself
    # unless it is Comba's exclusive cumsum); STRICT: j < i instead of j ≤ i
    i_n, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    oi = tl.arange(0, BC)
    ok = tl.arange(0, BK)
    m_k = ok < K
    ti = t0 + i_s * BC + oi  # query rows  [BC]
    m_i = ti < eos
    b_q = tl.load(q + (ti[:, None] * HQ + i_hq) * K + ok[None, :], mask=m_i[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32) * scale  # [BC, BK]
    if GATE == 2:
        g_i = tl.load(gq + (ti[:, None] * H + i_h) * K + ok[None, :], mask=m_i[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)  # [BC, BK]
        t_ref = t0 + i_s * BC  # the block's first row: the reference ρ
        rho = tl.load(gq + (t_ref * H + i_h) * K + ok, mask=m_k & (t_ref < eos), other=0.0).to(tl.float32)  # [BK]
        q_rho = b_q * tl.exp(tl.where(m_i[:, None], g_i - rho[None, :], 0.0))  # exponent ≤ 0
    elif GATE == 1:
        g_i = tl.load(gq + ti * H + i_h, mask=m_i, other=0.0).to(tl.float32)  # [BC]
    for i_r in range(0, C // BC):
        tj = t0 + i_r * BC + oi  # key rows  [BC]
        m_j = tj < eos
        acc = tl.zeros([BC, BC], dtype=tl.float32)
        if i_r <= i_s:
            if HAS_BETA:
                b_beta = tl.load(beta + tj * H + i_h, mask=m_j, other=0.0).to(tl.float32)
            if GATE == 2:
                if i_r < i_s:
                    # keys transposed [BK, BC], rescaled to the reference row (exponent ≤ 0)
                    m_kj = m_k[:, None] & m_j[None, :]
                    b_kt = tl.load(k + (tj[None, :] * HQ + i_hq) * K + ok[:, None], mask=m_kj, other=0.0).to(tl.float32)
                    g_jt = tl.load(g + (tj[None, :] * H + i_h) * K + ok[:, None], mask=m_kj, other=0.0).to(tl.float32)
                    b_kt = b_kt * tl.exp(tl.where(m_kj, rho[:, None] - g_jt, 0.0))
                    if HAS_BETA:
                        b_kt = b_kt * b_beta[None, :]
                    acc = mm(q_rho, b_kt, DT, IEEE)
                else:
                    for j in range(0, BC):
                        tjj = t0 + i_r * BC + j
                        ok_j = tjj < eos
                        k_j = tl.load(k + (tjj * HQ + i_hq) * K + ok, mask=m_k & ok_j, other=0.0).to(tl.float32)
                        g_j = tl.load(g + (tjj * H + i_h) * K + ok, mask=m_k & ok_j, other=0.0).to(tl.float32)
                        if HAS_BETA:
                            k_j = k_j * tl.load(beta + tjj * H + i_h, mask=ok_j, other=0.0).to(tl.float32)
                        causal = ((oi > j) if STRICT else (oi >= j)) & m_i
                        e = tl.exp(tl.where(causal[:, None], g_i - g_j[None, :], 0.0))  # exponent ≤ 0
                        col = tl.sum(b_q * k_j[None, :] * e, axis=1)  # [BC]
                        acc = tl.where(oi[None, :] == j, tl.where(causal, col, 0.0)[:, None], acc)
            else:
                m_kj = m_k[:, None] & m_j[None, :]
                b_kt = tl.load(k + (tj[None, :] * HQ + i_hq) * K + ok[:, None], mask=m_kj, other=0.0).to(tl.float32)
                if HAS_BETA:
                    b_kt = b_kt * b_beta[None, :]
                acc = mm(b_q, b_kt, DT, IEEE)
                ii, jj = (i_s * BC + oi)[:, None], (i_r * BC + oi)[None, :]
                causal = ((ii > jj) if STRICT else (ii >= jj)) & m_i[:, None] & m_j[None, :]
                if GATE == 1:
                    g_j = tl.load(g + tj * H + i_h, mask=m_j, other=0.0).to(tl.float32)
                    acc = acc * tl.exp(tl.where(causal, g_i[:, None] - g_j[None, :], 0.0))
                acc = tl.where(causal, acc, 0.0)
        tl.store(A + (ti[:, None] * H + i_h) * C + (i_r * BC + oi)[None, :], acc, mask=m_i[:, None])


def decayed_scores(q, k, G, beta, scale: float, L: Layout, *, Gq=None, strict: bool = False) -> torch.Tensor:
    """A [B, T, H, C] fp32 (see the module docstring). q, k [B, T, H_q, K]; G None or the
    chunk-local cumsum [B, T, H(, K)] fp32; beta None or [B, T, H]; Gq: the query rows' log-decay
    (G's shape; None: G); strict: zeros on the diagonal too."""
    A = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=q.device)
    bc = min(BC, L.C)
    gate = 0 if G is None else (2 if G.dim() == 4 else 1)
    DT, IEEE = dot_dtype(q.dtype)
    _scores_kernel[(L.NT, L.C // bc, L.B * L.H)](
        q, k, G if G is not None else q, Gq if Gq is not None else (G if G is not None else q),
        beta if beta is not None else q, A, *varlen_args(L, q.device)[:3],
        scale, L.T, H=L.H, HQ=L.Hq, K=L.K, C=L.C, BC=bc, BK=pow2(L.K), GATE=gate, HAS_BETA=beta is not None,
        STRICT=strict, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **launch("scores"))
    return A
