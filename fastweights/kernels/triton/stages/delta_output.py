"""The delta class's output stage: forward and the chunk-local part of its backward.

Forward, per chunk: o = Aqk U + Q̃ S_n with Aqk_ij = scale Σ_d q_id k_jd e^{G_id − G_jd} (j ≤ i;
`scores.decayed_scores(q, k, G, None, scale)`), U the new values of delta_states.pass_states_fwd
and Q̃ = scale q ⊙ e^{G}: the gated class's `output.chunk_outputs` with v := U, reused as is.

Backward, the part that needs no state (the state part is delta_states.pass_states_bwd):

    dU^loc = Aqkᵀ dO      [B, T, H, V] fp32 (the state pass then adds K̃ dS_{n+1})
    dAqk   = dO Uᵀ        on the causal mask (j ≤ i), fp32 [B, T, H, C]

Grid (chunk slots NT, B·H): one program loops over the V tiles (dAqk sums over all of V); Aqkᵀ
and Uᵀ are loaded transposed from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, varlen_args
from .output import chunk_outputs

__all__ = ["chunk_outputs", "chunk_outputs_bwd_local"]


@triton.jit(do_not_specialize=["T"])
def _local_bwd_kernel(A, u, do, du, dA, cu, chunk_seq, chunk_local, T, H: tl.constexpr, V: tl.constexpr,
                      C: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                      IEEE: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    oc = tl.arange(0, C)
    b_At = tl.load(A + (rows[None, :] * H + i_h) * C + oc[:, None], mask=m_t[None, :], other=0.0)  # [C, C]: Aᵀ
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m_vv = vv < V
        m = m_t[:, None] & m_vv[None, :]
        off = (rows[:, None] * H + i_h) * V + vv[None, :]
        b_do = tl.load(do + off, mask=m, other=0.0)  # [C, BV]
        b_ut = tl.load(u + (rows[None, :] * H + i_h) * V + vv[:, None], mask=m_vv[:, None] & m_t[None, :],
                       other=0.0)  # Uᵀ  [BV, C]
        b_dA += mm(b_do, b_ut, DT, IEEE)
        tl.store(du + off, mm(b_At, b_do, DT, IEEE), mask=m)
    b_dA = tl.where(oc[:, None] >= oc[None, :], b_dA, 0.0)
    tl.store(dA + (rows[:, None] * H + i_h) * C + oc[None, :], b_dA, mask=m_t[:, None])


def chunk_outputs_bwd_local(A, u, do, L: Layout):
    """(dU^loc [B, T, H, V] fp32, dAqk [B, T, H, C] fp32) from Aqk [B, T, H, C] fp32, U and dO [B, T, H, V]."""
    BV = min(64, pow2(L.V))
    du = empty_output(L.B, L.T, L.H, L.V, dtype=torch.float32, device=u.device)
    dA = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=u.device)
    DT, IEEE = dot_dtype(u.dtype)
    _local_bwd_kernel[(L.NT, L.B * L.H)](A, u, do, du, dA, *varlen_args(L, u.device)[:3], L.T, H=L.H, V=L.V, C=L.C,
                                         BV=BV, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
                                         **launch("delta_output_bwd"))
    return du, dA
