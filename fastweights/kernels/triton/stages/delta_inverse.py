"""unit_lower_inverse's twin (delta class): the per-chunk inverse of the UT transform,

    T = (I + Lm)⁻¹,   Lm_ij = β_i P_ij for j < i (0 elsewhere),   P_ij = Σ_d k_id k_jd e^{G_id − G_jd},

from P [B, T, H, C] (the decayed KKᵀ of `scores.decayed_scores(k, k, G, None, 1)`; with a probe key
or the decay after Σ_d r_id k_jd e^{R_id − G_jd}, the read key r and decay R of delta.py), row i of a
chunk holding its C columns (its diagonal and upper part are ignored), and β [B, T, H]; T is stored
the same way, fp32 [B, T, H, C] (every column of a real row written, zeros above the diagonal).

Two phases in one program per chunk, with blocks of BC = 16 rows:
1. the 16×16 diagonal blocks by forward substitution, row by row in registers, all C/16 blocks
   together: T_i = e_i − Σ_{j < i} Lm_ij T_j (15 steps of a [C/16, 16, 16] elementwise update);
2. the blocks below the diagonal by distance d = 1, 2, … from it (T is unit lower, so
   T_ij = −T_ii Σ_{i' = j}^{i − 1} Lm_ii' T_i'j for blocks j < i), each a sum of 16×16 tl.dots of
   blocks already stored; a barrier between distances makes the stored blocks visible to the
   whole program.

Grid (chunk slots NT, B·H). C a power of two ≥ 16 (1 to C/16 blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, launch, varlen_args

BC = 16


@triton.jit(do_not_specialize=["T"])
def _inverse_kernel(P, beta, Ti, cu, chunk_seq, chunk_local, T, H: tl.constexpr, C: tl.constexpr,
                    BC: tl.constexpr, NB: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    oi = tl.arange(0, BC)
    # phase 1: the NB diagonal blocks at once, as [NB, BC, BC] (block s, row i, column j), by forward
    # substitution over the rows i (BC − 1 steps for all blocks together); zeros above them
    s3 = tl.arange(0, NB)[:, None, None]
    i3 = oi[None, :, None]
    j3 = oi[None, None, :]
    t3 = t0 + s3 * BC + i3  # [NB, BC, 1]
    m3 = t3 < eos
    b_l3 = tl.load(P + (t3 * H + i_h) * C + s3 * BC + j3, mask=m3, other=0.0)  # [NB, BC, BC]
    b_beta3 = tl.load(beta + t3 * H + i_h, mask=m3, other=0.0).to(tl.float32)  # [NB, BC, 1]
    b_l3 = tl.where(i3 > j3, b_l3 * b_beta3, 0.0)  # strict lower
    b_t3 = tl.where((i3 == j3) & (s3 >= 0), 1.0, 0.0)  # rows ≥ i still e_i  [NB, BC, BC]
    for i in range(1, BC):
        l_i = tl.sum(tl.where(i3 == i, b_l3, 0.0), axis=1)  # row i of each block's Lm  [NB, BC]
        row = tl.where(oi[None, :] == i, 1.0, 0.0) - tl.sum(l_i[:, :, None] * b_t3, axis=1)  # [NB, BC]
        b_t3 = tl.where(i3 == i, row[:, None, :], b_t3)
    tl.store(Ti + (t3 * H + i_h) * C + s3 * BC + j3, b_t3, mask=m3)
    for r in tl.static_range(1, NB):
        tl.store(Ti + (t3 * H + i_h) * C + r * BC + j3, tl.zeros([NB, BC, BC], tl.float32), mask=m3 & (s3 < r))
    # phase 2: block (i, j), j < i, from the blocks of smaller distance i − j
    for d in tl.static_range(1, NB):
        tl.debug_barrier()
        for ib in tl.static_range(d, NB):
            jb = ib - d
            ti = t0 + ib * BC + oi
            m_i = ti < eos
            b_beta = tl.load(beta + ti * H + i_h, mask=m_i, other=0.0).to(tl.float32)
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for r in tl.static_range(NB):
                if r >= jb and r < ib:  # (a bound loop range(jb, ib) trips the interpreter)
                    tr = t0 + r * BC + oi
                    b_l = tl.load(P + (ti[:, None] * H + i_h) * C + (r * BC + oi)[None, :], mask=m_i[:, None],
                                  other=0.0) * b_beta[:, None]  # Lm_ir  [BC, BC]
                    b_t = tl.load(Ti + (tr[:, None] * H + i_h) * C + (jb * BC + oi)[None, :],
                                  mask=(tr < eos)[:, None], other=0.0)  # T_rj
                    acc += tl.dot(b_l, b_t, input_precision="ieee")
            b_tii = tl.load(Ti + (ti[:, None] * H + i_h) * C + (ib * BC + oi)[None, :], mask=m_i[:, None],
                            other=0.0)
            b_tij = -tl.dot(b_tii, acc, input_precision="ieee")
            tl.store(Ti + (ti[:, None] * H + i_h) * C + (jb * BC + oi)[None, :], b_tij, mask=m_i[:, None])


def unit_lower_inverse(P: torch.Tensor, beta: torch.Tensor, L: Layout) -> torch.Tensor:
    """T = (I + strict_tril(diag(β) P))⁻¹ per chunk: P [B, T, H, C] fp32, β [B, T, H] → T [B, T, H, C] fp32."""
    Ti = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=P.device)
    _inverse_kernel[(L.NT, L.B * L.H)](P, beta, Ti, *varlen_args(L, P.device)[:3], L.T, H=L.H, C=L.C, BC=BC,
                                       NB=L.C // BC, IS_VARLEN=L.varlen, **launch("inverse"))
    return Ti
