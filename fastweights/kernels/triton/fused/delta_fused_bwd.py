"""The fused backward of the delta rule with the decay first, no probe key and no or a scalar decay
(DeltaNet, gated DeltaNet; DeltaProduct through its interleaved micro-steps): three kernels instead
of the staged backward's ten. The maths, each formula derived, is the torch twin's
(`fastweights.chunkwise.delta_bwd`, checked against autograd in float64); in short, per chunk of C
rows with G the chunk-local cumsum, Γ = e^{G}, a = e^{G_last}, E_ij = e^{G_i − G_j} (j ≤ i) and T the
stored inverse (I + strict(diag(β) K Kᵀ ⊙ E))⁻¹ of the forward:

1. `_states_kernel`, sequential, grid (⌈V/BV⌉, sequences·H): the state S_n [K, BV] fp32 in registers,

       U_n     = T diag(β)(V − diag(Γ) K S_n)            (no W, no U': U = T X, X the UT system's rhs)
       S_{n+1} = a S_n + Kᵀ diag(e^{G_last − G}) U_n

   writing the entering states h (bf16 for bf16 inputs, fp32 for fp32) and U (v's dtype): the
   backward's recompute (`recompute_states`). With OUTPUT it also writes o = scale diag(Γ) Q S_n + Aqk U_n
   (Aqk = scale causal(Q Kᵀ ⊙ E), recomputed per chunk): a forward that needs only T from the pre-pass
   (`LAUNCH["delta_prepass"]["WU"] = 0`, delta_fused.py).
2. `_reverse_kernel`, sequential, last chunk first, grid (⌈V/BV⌉, sequences·H): dS [K, BV] fp32 in
   registers, from the final state's gradient,

       dU_n = Aqkᵀ dO_n + diag(e^{G_last − G}) K dS_{n+1}   (Aqkᵀ = scale (K Qᵀ ⊙ Eᵀ) recomputed)
       Y_n  = Tᵀ dU_n                                        (the gradient of X)
       dv_n = diag(β) Y_n,   dβ^v = Σ_v V ⊙ Y_n (per V block: partial sums)
       dS_n = a dS_{n+1} + scale Qᵀ diag(Γ) dO_n − Kᵀ diag(Γ β) Y_n

   writing dh (dS_{n+1} per chunk, h's dtype), Y (v's dtype; fp32 for fp32), dv, the dβ^v partials and dS_0.
3. `_grads_kernel`, chunk-parallel, grid (chunk slots NT, B·H_q): one program per chunk and q/k head,
   looping over the value heads of its group (grouped heads summed in registers, no summing pass)
   and, per head, over the V blocks twice: first dA = dO Uᵀ, dL = Y Uᵀ and their transposes (loaded
   transposed from memory, no tl.trans of an accumulator) [C, C]; then dQ̃ = dO hᵀ, dK̃ = U dhᵀ,
   Z = Y hᵀ [C, K] and Σ h ⊙ dh. With M1 = scale causal(dA ⊙ E), N = strict(dL ⊙ E), M2 = −diag(β) N:

       dq = M1 K + scale diag(Γ) dQ̃
       dk = M1ᵀ Q + (M2 + M2ᵀ) K + diag(e^{G_last − G}) dK̃ − diag(β Γ) Z
       dβ = Σ_parts dβ^v − Γ ⊙ rowsum(K ⊙ Z) − rowsum(N ⊙ K Kᵀ)
       dg = reverse cumsum of dG in the chunk + ∂L/∂G_last      (dG, ∂L/∂G_last: the twin's docstring)

   The inverse's gradient is −strict(Y Uᵀ) (U depends on T only through U = T X), so this kernel
   reads neither T nor V; it writes dq, dk (q's dtype), dβ (β's dtype) and dg (g's dtype): the
   staged path's two `qk_grads`, `wy_representation_bwd`, the output's local backward, the sum pass
   and the reverse cumsum in one kernel.

Two options of the last kernel, off by default until a GPU times them (issue 32; docs/kernel_notes.md "The gradient
kernel's rows over programs"): `LAUNCH["delta_fused_grads"]["ROWSUMS"]` takes dG's and dβ's rowsums against Q Kᵀ,
K Qᵀ and K Kᵀ from products dq and dk form anyway (Σ_b M_ab (k_a · x_b) = k_a · (M X)_a: rowsum(M1 ⊙ Q Kᵀ) =
rowsum(Q ⊙ M1 K), and so on), three [C, C] products fewer; `LAUNCH["delta_fused_grads_rows"]["ON"]` runs
`_grads_rows_kernel` instead, the same identities with each chunk's C rows split over C / BR programs (grid
(NT·C/BR, B·H_q)): every output row's terms are its program's but dg's reverse cumsum and ∂L/∂G_last, which it leaves
as dG's rows and per-block parts for `chunk_cumsum` to finish.

The decays and the scale are applied to the [C, BV] or [C, C] side of each product (K S_n then a
row factor Γ, not K ⊙ Γ), so q, k, v reach the tensor cores as stored — bf16 inputs are never rounded
again — and a program holds no scaled copy of a [C, K] tile. Tensor-core operands are rounded to the
inputs' dtype (`util.mm`), accumulation and the carried states are fp32.

Every constexpr depends on the head dims, the dtype, the gate, the chunk size and the flags; BV
(`value_block`) on the heads (and the batch, padded) only, never T or the packing; T, NT and the row
count R are not specialized, so a new varlen packing compiles nothing. Scope (`supports`): gate none
or scalar, K ≤ 128 (the [C, K] accumulators of `_grads_kernel`), C ≤ 64; the glue (delta.py) routes the
rest — KDA, Comba, K = 256, C = 128 — to the staged backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ...variants import delta_fused_backward
from ..common import interpreter
from ..common.layout import Layout
from ..common.limits import DELTA_FUSED_BWD_MAX_C, DELTA_FUSED_BWD_MAX_K
from ..common.util import (
    chunk_span,
    dot_dtype,
    launch,
    mm,
    pow2,
    seq_span,
    state_pass_launch,
    table,
    tile,
    varlen_args,
)
from ..stages.cumsum import chunk_cumsum

#: The fused backward's scope (larger head dims or chunks go to the staged backward, see `supports`).
MAX_K = DELTA_FUSED_BWD_MAX_K
MAX_C = DELTA_FUSED_BWD_MAX_C


def supports(g, L: Layout) -> bool:
    """Whether the fused backward takes a call with gate g (None, scalar [B, T, H] or diagonal) at layout L."""
    return (g is None or g.dim() == 3) and L.K <= MAX_K and L.C <= MAX_C


# Addressing: each kernel forms a scalar 64-bit base pointer per chunk (and head) and adds 32-bit tile offsets
# (row strides H·K, H·V, H·C of one chunk fit easily), so no [C, K] tile of 64-bit addresses sits in registers.


@triton.jit(do_not_specialize=["T", "NT"])
def _states_kernel(q, k, v, g, beta, Ti, h0, o, h, u, ht, A, cu, offsets, scale, T, NT, H: tl.constexpr,
                   HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr, OUTPUT: tl.constexpr,
                   STORE_STATES: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_A: tl.constexpr,
                   IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    # GATE 0 none, 1 scalar [B, T, H] (the raw log-decay: its chunk-local cumsum is taken here)
    # STORE_A: also Aqk = scale causal(Q Kᵀ ⊙ E) [B, T, H, C] for the reverse kernel, each chunk's by one of the
    # ⌈V/BV⌉ programs of its sequence and head (chunk c by the program c mod ⌈V/BV⌉): computed once, not per block
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    oc = tl.arange(0, C)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m_kv = m_kk[:, None] & m_vv[None, :]
    kv = kk[:, None] * V + vv[None, :]  # a state tile  [BK, BV]
    o_k = oc[:, None] * (HQ * K) + kk[None, :]  # q, k rows of a chunk  [C, BK]
    o_v = oc[:, None] * (H * V) + vv[None, :]  # v, u, o rows  [C, BV]
    o_c = oc[:, None] * (H * C) + oc[None, :]  # T rows  [C, C]
    causal = oc[:, None] >= oc[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_s.to(tl.int64) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(0, n_chunks):  # a for loop: software-pipelined on the GPU
        if STORE_STATES:
            tl.store(h + ((slot0 + c) * H + i_h) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        t0 = bos + c * C  # the chunk's first row (int64)
        n_t = tl.minimum(eos - t0, C).to(tl.int32)  # its real rows
        m_t = oc < n_t
        m_tk = m_t[:, None] & m_kk[None, :]
        m_tv = m_t[:, None] & m_vv[None, :]
        p_k = k + (t0 * HQ + i_hq) * K
        p_v = (t0 * H + i_h) * V  # offset of the chunk's rows in v, u, o
        b_k = tl.load(p_k + o_k, mask=m_tk, other=0.0)  # [C, BK]
        b_kt = tl.trans(b_k)  # Kᵀ [BK, C]: the same shared-memory tile read transposed by the tensor cores
        b_T = tl.load(Ti + (t0 * H + i_h) * C + o_c, mask=m_t[:, None], other=0.0)  # [C, C]
        b_beta = tl.load(beta + t0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_x = mm(b_k, S, DT, IEEE)  # K S_n  [C, BV]
        if GATE == 1:
            G = tl.cumsum(tl.load(g + t0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
            G_last = tl.sum(tl.where(oc == n_t - 1, G, 0.0), axis=0)
            b_x = b_x * tl.exp(G)[:, None]
        b_x = (tl.load(v + p_v + o_v, mask=m_tv, other=0.0).to(tl.float32) - b_x) * b_beta[:, None]
        b_u = mm(b_T, b_x, DT, IEEE)  # U_n = T X  [C, BV]
        if STORE_STATES:
            tl.store(u + p_v + o_v, b_u.to(u.dtype.element_ty), mask=m_tv)
        if STORE_A:
            if c % tl.num_programs(0) == i_v:
                b_q = tl.load(q + (t0 * HQ + i_hq) * K + o_k, mask=m_tk, other=0.0)  # [C, BK]
                b_A = mm(b_q, b_kt, DT, IEEE) * scale  # [C, C]
                if GATE == 1:
                    b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))  # exponent ≤ 0
                tl.store(A + (t0 * H + i_h) * C + o_c, tl.where(causal, b_A, 0.0).to(A.dtype.element_ty),
                         mask=m_t[:, None])
        if OUTPUT:
            b_q = tl.load(q + (t0 * HQ + i_hq) * K + o_k, mask=m_tk, other=0.0)  # [C, BK]
            b_A = mm(b_q, b_kt, DT, IEEE) * scale  # [C, C]
            b_o = mm(b_q, S, DT, IEEE) * scale  # [C, BV]
            if GATE == 1:
                b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))  # exponent ≤ 0
                b_o = b_o * tl.exp(G)[:, None]
            b_o += mm(tl.where(causal, b_A, 0.0), b_u, DT, IEEE)
            tl.store(o + p_v + o_v, b_o.to(o.dtype.element_ty), mask=m_tv)
        if GATE == 1:
            S = S * tl.exp(G_last)
            b_u = b_u * tl.exp(tl.where(m_t, G_last - G, 0.0))[:, None]
        S += mm(b_kt, b_u, DT, IEEE)
    if STORE_FINAL:
        tl.store(ht + (i_s.to(tl.int64) * H + i_h) * K * V + kv, S, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT", "R"])
def _reverse_kernel(q, k, v, g, beta, Ti, A, dht, do, dh, y, dv, dbv, dh0, cu, offsets, scale, T, NT, R,
                    H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, A_IN: tl.constexpr,
                    HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                    IEEE: tl.constexpr):
    # dbv: [⌈V/BV⌉, R] fp32, R = B·T·H: Σ_v V ⊙ Y over this program's value columns, per row and head
    # A_IN: Aqk read (transposed) from A [B, T, H, C] (the recompute's STORE_A), else recomputed here
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    oc = tl.arange(0, C)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m_kv = m_kk[:, None] & m_vv[None, :]
    kv = kk[:, None] * V + vv[None, :]
    o_k = oc[:, None] * (HQ * K) + kk[None, :]  # [C, BK]
    o_kt = oc[None, :] * (HQ * K) + kk[:, None]  # [BK, C]
    o_v = oc[:, None] * (H * V) + vv[None, :]  # [C, BV]
    o_ct = oc[None, :] * (H * C) + oc[:, None]  # T transposed: [j, i] → T_ij
    causal_t = oc[None, :] >= oc[:, None]  # [j, i]: i ≥ j (Aqkᵀ)
    fin = (i_s.to(tl.int64) * H + i_h) * K * V
    p_dbv = dbv + i_v.to(tl.int64) * R
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + fin + kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_c in range(0, n_chunks):  # last chunk first (a for loop: pipelined)
        c = n_chunks - 1 - i_c
        tl.store(dh + ((slot0 + c) * H + i_h) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        t0 = bos + c * C
        n_t = tl.minimum(eos - t0, C).to(tl.int32)
        m_t = oc < n_t
        m_tv = m_t[:, None] & m_vv[None, :]
        m_kt = m_kk[:, None] & m_t[None, :]
        p_k = (t0 * HQ + i_hq) * K
        p_v = (t0 * H + i_h) * V
        b_k = tl.load(k + p_k + o_k, mask=m_t[:, None] & m_kk[None, :], other=0.0)  # [C, BK]
        b_qt = tl.load(q + p_k + o_kt, mask=m_kt, other=0.0)  # Qᵀ [BK, C]
        if A_IN:
            b_At = tl.load(A + (t0 * H + i_h) * C + o_ct, mask=m_t[None, :], other=0.0)  # Aqkᵀ [j, i] = Aqk_ij
        else:
            b_At = mm(b_k, b_qt, DT, IEEE) * scale  # Aqkᵀ before decay and mask: [j, i] = scale k_j · q_i
        # (Kᵀ below: tl.trans of the loaded tile, a transposed view of its shared-memory copy — one load, and
        # half the pipeline buffers, so that two programs fit an SM; never a tl.trans of an accumulator)
        b_du = mm(b_k, dS, DT, IEEE)  # K dS_{n+1}  [C, BV]
        b_do = tl.load(do + p_v + o_v, mask=m_tv, other=0.0)  # [C, BV]
        if GATE == 1:
            G = tl.cumsum(tl.load(g + t0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
            G_last = tl.sum(tl.where(oc == n_t - 1, G, 0.0), axis=0)
            if not A_IN:
                b_At = b_At * tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0))  # exponent ≤ 0
            b_du = b_du * tl.exp(tl.where(m_t, G_last - G, 0.0))[:, None]
        if not A_IN:
            b_At = tl.where(causal_t, b_At, 0.0)
        b_du += mm(b_At, b_do, DT, IEEE)  # dU_n
        b_Tt = tl.load(Ti + (t0 * H + i_h) * C + o_ct, mask=m_t[None, :], other=0.0)  # Tᵀ  [C, C]
        b_y = mm(b_Tt, b_du, DT, IEEE)  # Y_n = Tᵀ dU_n  [C, BV]
        tl.store(y + p_v + o_v, b_y.to(y.dtype.element_ty), mask=m_tv)
        b_beta = tl.load(beta + t0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32)
        b_dv = b_y * b_beta[:, None]
        tl.store(dv + p_v + o_v, b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_v = tl.load(v + p_v + o_v, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(p_dbv + t0 * H + i_h + oc * H, tl.sum(b_v * b_y, axis=1), mask=m_t)
        b_do = b_do.to(tl.float32) * scale
        if GATE == 1:
            dS = dS * tl.exp(G_last)
            b_do = b_do * tl.exp(G)[:, None]
            b_dv = b_dv * tl.exp(G)[:, None]
        dS += mm(b_qt, b_do, DT, IEEE) - mm(tl.trans(b_k), b_dv, DT, IEEE)
    if HAS_H0:
        tl.store(dh0 + fin + kv, dS, mask=m_kv)


@triton.jit
def _gate_rows(g, m_t, n_t, oc, H: tl.constexpr):
    """(G, G_last, Γ = e^{G}, e^{G_last − G}) of a chunk's rows (g: the pointer of its first row, the rows H
    apart; n_t real rows): the chunk-local cumsum of the scalar gate."""
    G = tl.cumsum(tl.load(g + oc * H, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
    G_last = tl.sum(tl.where(oc == n_t - 1, G, 0.0), axis=0)
    return G, G_last, tl.exp(G), tl.exp(tl.where(m_t, G_last - G, 0.0))


@triton.jit
def _decayed(M, G, mask, TRANSPOSED: tl.constexpr, GATE: tl.constexpr):
    """M [C, C] masked, and times E_ij = e^{G_i − G_j} (or Eᵀ: [j, i] = e^{G_i − G_j}) with a scalar gate."""
    if GATE == 1:
        if TRANSPOSED:
            M = M * tl.exp(tl.where(mask, G[None, :] - G[:, None], 0.0))  # exponents ≤ 0 on the mask
        else:
            M = M * tl.exp(tl.where(mask, G[:, None] - G[None, :], 0.0))
    return tl.where(mask, M, 0.0)


@triton.jit(do_not_specialize=["T", "NT", "R"])
def _grads_kernel(q, k, g, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta, dg, cu, chunk_seq, chunk_local, scale, T,
                  NT, R, H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, NPART: tl.constexpr, GATE: tl.constexpr,
                  IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, ROWSUMS: tl.constexpr = 0):
    # dbv: [NPART, R] fp32 (R = B·T·H), the reverse kernel's Σ_v V ⊙ Y per value block; rq: [R] fp32 scratch
    # (grouped heads, scalar gate: dG's q-side rows from the first loop to the second)
    # ROWSUMS 1: no Q Kᵀ, K Qᵀ, K Kᵀ products — each rowsum against them taken against a product dq or dk forms
    # anyway (`_grads_rows_kernel`'s identities: Σ_b M_ab (k_a · x_b) = k_a · (M X)_a); (M2 + M2ᵀ) K as M2ᵀ K − β N K
    i_n, i_bq = tl.program_id(0), tl.program_id(1)
    i_b, i_hq = i_bq // HQ, i_bq % HQ
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    n_t = tl.minimum(eos - t0, C).to(tl.int32)  # real rows (0 in an unused varlen slot: h, dh never written)
    oc = tl.arange(0, C)
    kk = tl.arange(0, BK)
    m_kk = kk < K
    m_t = oc < n_t
    m_tk = m_t[:, None] & m_kk[None, :]
    m_kt = m_kk[:, None] & m_t[None, :]
    causal = oc[:, None] >= oc[None, :]  # [i, j]: j ≤ i
    causal_t = oc[None, :] >= oc[:, None]  # [j, i]
    p_q = q + (t0 * HQ + i_hq) * K
    p_k = k + (t0 * HQ + i_hq) * K
    o_k = oc[:, None] * (HQ * K) + kk[None, :]  # [C, BK]
    o_kt = oc[None, :] * (HQ * K) + kk[:, None]  # [BK, C]
    # ==== dq: the group's value heads summed in registers (one [C, K] accumulator live)
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    r_q = tl.zeros([C], dtype=tl.float32)  # (carried to the second loop without grouped heads)
    for j in range(0, H // HQ):
        i_h = i_hq * (H // HQ) + j
        p_v = (t0 * H + i_h) * V  # the chunk's rows in do, u, y
        p_h = (slot * H + i_h) * K * V  # its entering state in h, dh
        p_r = t0 * H + i_h  # its rows in β, g, dβ, dg, rq, dbv
        if GATE == 1:
            G, G_last, gam, gkd = _gate_rows(g + p_r, m_t, n_t, oc, H)
        dA = tl.zeros([C, C], dtype=tl.float32)  # dO Uᵀ
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            dA += mm(tl.load(do + p_v + oc[:, None] * (H * V) + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                             other=0.0),
                     tl.load(u + p_v + oc[None, :] * (H * V) + vv[:, None], mask=m_vv[:, None] & m_t[None, :],
                             other=0.0), DT, IEEE)
        M1 = _decayed(dA * scale, G if GATE == 1 else dA, causal, False, GATE)  # ∂L/∂(Q Kᵀ ⊙ E)   [i, j]
        if ROWSUMS:
            P = mm(M1, tl.load(p_k + o_k, mask=m_tk, other=0.0), DT, IEEE)
            b_dq += P
            if GATE == 1:  # rowsum(M1 ⊙ Q Kᵀ) = rowsum(Q ⊙ M1 K)
                r_q = tl.sum(tl.load(p_q + o_k, mask=m_tk, other=0.0).to(tl.float32) * P, axis=1)
        else:
            b_dq += mm(M1, tl.load(p_k + o_k, mask=m_tk, other=0.0), DT, IEEE)
            if GATE == 1:  # dG through Aqk's rows: rowsum(M1 ⊙ Q Kᵀ)
                r_q = tl.sum(M1 * mm(tl.load(p_q + o_k, mask=m_tk, other=0.0),
                                     tl.load(p_k + o_kt, mask=m_kt, other=0.0), DT, IEEE), axis=1)
        dQt = tl.zeros([C, BK], dtype=tl.float32)  # dQ̃ = dO hᵀ
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            dQt += mm(tl.load(do + p_v + oc[:, None] * (H * V) + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                              other=0.0),
                      tl.load(h + p_h + kk[None, :] * V + vv[:, None], mask=m_vv[:, None] & m_kk[None, :] & (n_t > 0),
                              other=0.0), DT, IEEE)
        if GATE == 1:
            dQt = dQt * (scale * gam)[:, None]
            r_q += tl.sum(tl.load(p_q + o_k, mask=m_tk, other=0.0).to(tl.float32) * dQt, axis=1)  # Q̃ ⊙ dQ̃
            if H // HQ > 1:
                tl.store(rq + p_r + oc * H, r_q, mask=m_t)
        else:
            dQt = dQt * scale
        b_dq += dQt
    tl.store(dq + (t0 * HQ + i_hq) * K + o_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    if H // HQ > 1:
        tl.debug_barrier()  # rq: written above by other threads of this program
    # ==== dk, dβ, dg
    strict = oc[:, None] > oc[None, :]
    strict_t = oc[None, :] > oc[:, None]
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    for j in range(0, H // HQ):
        i_h = i_hq * (H // HQ) + j
        p_v = (t0 * H + i_h) * V
        p_h = (slot * H + i_h) * K * V
        p_r = t0 * H + i_h
        b_beta = tl.load(beta + p_r + oc * H, mask=m_t, other=0.0).to(tl.float32)  # [C]
        if GATE == 1:
            G, G_last, gam, gkd = _gate_rows(g + p_r, m_t, n_t, oc, H)
            if H // HQ > 1:
                r_q = tl.load(rq + p_r + oc * H, mask=m_t, other=0.0)
        # -- dk through Aqk: M1ᵀ Q, from dAᵀ = U dOᵀ
        dAt = tl.zeros([C, C], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            dAt += mm(tl.load(u + p_v + oc[:, None] * (H * V) + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                              other=0.0),
                      tl.load(do + p_v + oc[None, :] * (H * V) + vv[:, None], mask=m_vv[:, None] & m_t[None, :],
                              other=0.0), DT, IEEE)
        M1t = _decayed(dAt * scale, G if GATE == 1 else dAt, causal_t, True, GATE)  # M1ᵀ   [j, i]
        if ROWSUMS:
            P = mm(M1t, tl.load(p_q + o_k, mask=m_tk, other=0.0), DT, IEEE)
            b_dk += P
            if GATE == 1:  # rowsum(M1ᵀ ⊙ K Qᵀ) = rowsum(K ⊙ M1ᵀ Q)
                r_dG = r_q - tl.sum(tl.load(p_k + o_k, mask=m_tk, other=0.0).to(tl.float32) * P, axis=1)
        else:
            b_dk += mm(M1t, tl.load(p_q + o_k, mask=m_tk, other=0.0), DT, IEEE)
            if GATE == 1:  # dG through Aqk's columns: colsum(M1 ⊙ Q Kᵀ) = rowsum(M1ᵀ ⊙ K Qᵀ)
                r_dG = r_q - tl.sum(M1t * mm(tl.load(p_k + o_k, mask=m_tk, other=0.0),
                                             tl.load(p_q + o_kt, mask=m_kt, other=0.0), DT, IEEE), axis=1)
        # -- dk through T (dL = Y Uᵀ and its transpose) and through K̃ (dK̃ = U dhᵀ); Σ h ⊙ dh for ∂L/∂G_last
        dL = tl.zeros([C, C], dtype=tl.float32)
        dLt = tl.zeros([C, C], dtype=tl.float32)
        dKt = tl.zeros([C, BK], dtype=tl.float32)
        hdh = tl.sum(tl.zeros([BK], dtype=tl.float32), axis=0)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            m_tv = m_t[:, None] & m_vv[None, :]
            m_vt = m_vv[:, None] & m_t[None, :]
            m_vk = m_vv[:, None] & m_kk[None, :] & (n_t > 0)
            o_v = oc[:, None] * (H * V) + vv[None, :]  # [C, BV]
            o_vt = oc[None, :] * (H * V) + vv[:, None]  # [BV, C]
            o_st = kk[None, :] * V + vv[:, None]  # [BV, BK]: a state tile transposed
            b_u = tl.load(u + p_v + o_v, mask=m_tv, other=0.0)
            dL += mm(tl.load(y + p_v + o_v, mask=m_tv, other=0.0), tl.load(u + p_v + o_vt, mask=m_vt, other=0.0),
                     DT, IEEE)
            dLt += mm(b_u, tl.load(y + p_v + o_vt, mask=m_vt, other=0.0), DT, IEEE)
            b_dht = tl.load(dh + p_h + o_st, mask=m_vk, other=0.0)
            dKt += mm(b_u, b_dht, DT, IEEE)
            if GATE == 1:
                b_ht = tl.load(h + p_h + o_st, mask=m_vk, other=0.0).to(tl.float32)
                hdh += tl.sum(tl.sum(b_ht * b_dht.to(tl.float32), axis=1), axis=0)
        kdk = tl.sum(tl.load(p_k + o_k, mask=m_tk, other=0.0).to(tl.float32) * dKt, axis=1)  # rowsum(K ⊙ dK̃)
        if GATE == 1:
            b_dk += dKt * gkd[:, None]
        else:
            b_dk += dKt
        if ROWSUMS:
            Nm = _decayed(dL, G if GATE == 1 else dL, strict, False, GATE)
            M2t = _decayed(dLt * -b_beta[None, :], G if GATE == 1 else dLt, strict_t, True, GATE)
            P = mm(Nm, tl.load(p_k + o_k, mask=m_tk, other=0.0), DT, IEEE)  # N K
            r_n = tl.sum(tl.load(p_k + o_k, mask=m_tk, other=0.0).to(tl.float32) * P, axis=1)  # rowsum(N ⊙ K Kᵀ)
            b_dk -= P * b_beta[:, None]
            P = mm(M2t, tl.load(p_k + o_k, mask=m_tk, other=0.0), DT, IEEE)  # M2ᵀ K
            b_dk += P
            if GATE == 1:  # rowsum(M2ᵀ ⊙ K Kᵀ) = rowsum(K ⊙ M2ᵀ K)
                r_dG -= b_beta * r_n + tl.sum(tl.load(p_k + o_k, mask=m_tk, other=0.0).to(tl.float32) * P, axis=1)
        else:
            b_KK = mm(tl.load(p_k + o_k, mask=m_tk, other=0.0), tl.load(p_k + o_kt, mask=m_kt, other=0.0), DT, IEEE)
            Nm = _decayed(dL, G if GATE == 1 else dL, strict, False, GATE)  # strict(dL) ⊙ E = −dLm ⊙ E   [i, j]
            M2t = _decayed(dLt * -b_beta[None, :], G if GATE == 1 else dLt, strict_t, True, GATE)  # (dP ⊙ E)ᵀ [j, i]
            r_n = tl.sum(Nm * b_KK, axis=1)  # Σ_j (dL ⊙ P)_ij = −Σ_j dLm_ij P_ij (P = K Kᵀ ⊙ E)
            if GATE == 1:  # dG through P: rowsum(dP ⊙ P) = −β r_n, colsum = rowsum(M2ᵀ ⊙ K Kᵀ) (K Kᵀ symmetric)
                r_dG -= b_beta * r_n + tl.sum(M2t * b_KK, axis=1)
            b_dk += mm(M2t - b_beta[:, None] * Nm, tl.load(p_k + o_k, mask=m_tk, other=0.0), DT, IEEE)  # (M2+M2ᵀ) K
        # -- dk through X = diag(β)(V − Γ K S_n): −diag(β Γ) Z, Z = Y hᵀ
        Z = tl.zeros([C, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            Z += mm(tl.load(y + p_v + oc[:, None] * (H * V) + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                            other=0.0),
                    tl.load(h + p_h + kk[None, :] * V + vv[:, None], mask=m_vv[:, None] & m_kk[None, :] & (n_t > 0),
                            other=0.0), DT, IEEE)
        kz = tl.sum(tl.load(p_k + o_k, mask=m_tk, other=0.0).to(tl.float32) * Z, axis=1)  # rowsum(K ⊙ Z)
        b_db = -r_n
        if GATE == 1:
            b_dk -= Z * (b_beta * gam)[:, None]
            b_db -= gam * kz
            r_dG -= gkd * kdk + b_beta * gam * kz
            dG_last = tl.exp(G_last) * hdh + tl.sum(gkd * kdk, axis=0)
            tl.store(dg + p_r + oc * H, (tl.cumsum(r_dG, axis=0, reverse=True) + dG_last).to(dg.dtype.element_ty),
                     mask=m_t)
        else:
            b_dk -= Z * b_beta[:, None]
            b_db -= kz
        p_dbv = dbv + p_r  # (a pointer stepped by R: 64-bit addresses whatever NPART·R)
        for _ in range(0, NPART):
            b_db += tl.load(p_dbv + oc * H, mask=m_t, other=0.0)
            p_dbv += R
        tl.store(dbeta + p_r + oc * H, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dk + (t0 * HQ + i_hq) * K + o_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)


@triton.jit
def _rows_of(x, oc, orr):
    """x [C] at rows orr [BR] (a one-hot sum: the same floats, e.g. G at the program's rows)."""
    return tl.sum(tl.where(oc[None, :] == orr[:, None], x[None, :], 0.0), axis=1)


@triton.jit
def _decayed_rows(M, Gr, Gc, mask, TRANSPOSED: tl.constexpr, GATE: tl.constexpr):
    """`_decayed` for a program's BR rows: M [BR, C] masked, times E_ij = e^{G_i − G_j} (i the rows, G_r, j the
    columns, G_c), or TRANSPOSED ([j, i]: j the rows) e^{G_i − G_j} with i the columns."""
    if GATE == 1:
        if TRANSPOSED:
            M = M * tl.exp(tl.where(mask, Gc[None, :] - Gr[:, None], 0.0))  # exponents ≤ 0 on the mask
        else:
            M = M * tl.exp(tl.where(mask, Gr[:, None] - Gc[None, :], 0.0))
    return tl.where(mask, M, 0.0)


@triton.jit
def _hdh_part(h, dh, i_r, K: tl.constexpr, V: tl.constexpr, KS: tl.constexpr, BV: tl.constexpr):
    """Σ h ⊙ dh over key rows [i_r·KS, (i_r + 1)·KS) of one chunk's entering state and its gradient (h, dh: the
    pointers of its [K, V] tiles): row block i_r's share of ∂L/∂G_last's state term, fp32."""
    ks = i_r * KS + tl.arange(0, KS)
    acc = tl.zeros([KS], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        o_s = ks[:, None] * V + vv[None, :]
        m_s = (ks < K)[:, None] & (vv < V)[None, :]
        acc += tl.sum(tl.load(h + o_s, mask=m_s, other=0.0).to(tl.float32)
                      * tl.load(dh + o_s, mask=m_s, other=0.0).to(tl.float32), axis=1)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["T", "NT", "R", "NSLOT"])
def _grads_rows_kernel(q, k, g, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta, rg, dgl, cu, chunk_seq, chunk_local,
                       scale, T, NT, R, NSLOT, H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       C: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NPART: tl.constexpr,
                       GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    # `_grads_kernel` with a chunk's C rows split over C / BR programs (LAUNCH["delta_fused_grads_rows"]): each holds
    # BR rows of dq, dk, dβ (every product's row side; the column side, the state tiles h, dh and the gate's cumsum
    # whole). Every row's terms are the program's own but dg's reverse cumsum over the chunk and ∂L/∂G_last, a sum
    # over the chunk's rows and state: with a scalar gate it writes dG's rows (rg: [R] fp32) and its part of
    # ∂L/∂G_last (dgl: [C / BR, NSLOT] fp32, NSLOT = B·NT·H; Σ h ⊙ dh over the state's key rows, BK / NR of them a
    # block), and `chunk_cumsum` finishes dg.
    NR: tl.constexpr = C // BR
    KS: tl.constexpr = BK // NR  # the state's key rows of this block's Σ h ⊙ dh
    i_nr, i_bq = tl.program_id(0), tl.program_id(1)
    i_n, i_r = i_nr // NR, i_nr % NR  # the row blocks of one chunk are neighbours in the grid (their tiles shared)
    i_b, i_hq = i_bq // HQ, i_bq % HQ
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load (its dgl is never read)
            return
    slot = i_b.to(tl.int64) * NT + i_n
    n_t = tl.minimum(eos - t0, C).to(tl.int32)  # the chunk's real rows (≥ 1 here)
    if i_r * BR >= n_t:  # no real row in this block (the last chunk of a sequence): only its Σ h ⊙ dh share
        if GATE == 1:
            for j in range(0, H // HQ):
                i_h = i_hq * (H // HQ) + j
                _, G_last, _, _ = _gate_rows(g + t0 * H + i_h, tl.arange(0, C) < n_t, n_t, tl.arange(0, C), H)
                p_h = (slot * H + i_h) * K * V
                tl.store(dgl + i_r.to(tl.int64) * NSLOT + slot * H + i_h,
                         tl.exp(G_last) * _hdh_part(h + p_h, dh + p_h, i_r, K, V, KS, BV))
        return
    oc = tl.arange(0, C)  # the chunk's rows, as columns of the [BR, C] products
    orr = i_r * BR + tl.arange(0, BR)  # this program's rows
    kk = tl.arange(0, BK)
    m_kk = kk < K
    m_t = oc < n_t
    m_r = orr < n_t
    # the causal masks' columns: a row block's products against the chunk's other rows see only those at or before
    # its last row (dO Uᵀ, Y Uᵀ; M1 K, N K) or at or after its first (U dOᵀ, U Yᵀ; M1ᵀ Q, M2ᵀ K): the rest is not
    # read (the masks zero them anyway)
    m_lo = oc < tl.minimum(n_t, (i_r + 1) * BR)
    m_hi = (oc >= i_r * BR) & m_t
    m_lok = m_lo[:, None] & m_kk[None, :]
    m_hik = m_hi[:, None] & m_kk[None, :]
    m_rk = m_r[:, None] & m_kk[None, :]
    causal = orr[:, None] >= oc[None, :]  # [i, j]: j ≤ i (i the program's rows)
    causal_t = oc[None, :] >= orr[:, None]  # [j, i]: i ≥ j (j the program's rows)
    p_q = q + (t0 * HQ + i_hq) * K
    p_k = k + (t0 * HQ + i_hq) * K
    o_k = oc[:, None] * (HQ * K) + kk[None, :]  # the chunk's q, k rows  [C, BK]
    o_rk = orr[:, None] * (HQ * K) + kk[None, :]  # the program's rows  [BR, BK]
    # ==== dq (and with a scalar gate dG's q-side rows, rowsum(Q ⊙ dq_h) of each value head's dq term: the row i of
    # rowsum(M1 ⊙ Q Kᵀ) is q_i · (M1 K)_i — no Q Kᵀ product)
    b_dq = tl.zeros([BR, BK], dtype=tl.float32)
    r_q = tl.zeros([BR], dtype=tl.float32)
    Z = tl.zeros([BR, BK], dtype=tl.float32)  # the rows of Y hᵀ, here with h's tile (one head a group: h read once)
    for j in range(0, H // HQ):
        i_h = i_hq * (H // HQ) + j
        p_v = (t0 * H + i_h) * V
        p_h = (slot * H + i_h) * K * V
        p_r = t0 * H + i_h
        if GATE == 1:
            G, G_last, gam, gkd = _gate_rows(g + p_r, m_t, n_t, oc, H)
            Gr = _rows_of(G, oc, orr)
        dA = tl.zeros([BR, C], dtype=tl.float32)  # the rows of dO Uᵀ
        dQt = tl.zeros([BR, BK], dtype=tl.float32)  # the rows of dO hᵀ
        for i_v in range(0, tl.cdiv(V, BV)):  # (one loop: both products read the same dO tile)
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            b_do = tl.load(do + p_v + orr[:, None] * (H * V) + vv[None, :], mask=m_r[:, None] & m_vv[None, :],
                           other=0.0)
            dA += mm(b_do, tl.load(u + p_v + oc[None, :] * (H * V) + vv[:, None], mask=m_vv[:, None] & m_lo[None, :],
                                   other=0.0), DT, IEEE)
            b_h = tl.load(h + p_h + kk[None, :] * V + vv[:, None], mask=m_vv[:, None] & m_kk[None, :], other=0.0)
            dQt += mm(b_do, b_h, DT, IEEE)
            if H // HQ == 1:
                Z += mm(tl.load(y + p_v + orr[:, None] * (H * V) + vv[None, :], mask=m_r[:, None] & m_vv[None, :],
                                other=0.0), b_h, DT, IEEE)
        M1 = _decayed_rows(dA * scale, Gr if GATE == 1 else dA, G if GATE == 1 else dA, causal, False, GATE)
        if GATE == 1:
            dq_h = mm(M1, tl.load(p_k + o_k, mask=m_lok, other=0.0), DT, IEEE) + dQt * (scale * tl.exp(Gr))[:, None]
            r_q = tl.sum(tl.load(p_q + o_rk, mask=m_rk, other=0.0).to(tl.float32) * dq_h, axis=1)
            if H // HQ > 1:
                tl.store(rq + p_r + orr * H, r_q, mask=m_r)
            b_dq += dq_h
        else:
            b_dq += mm(M1, tl.load(p_k + o_k, mask=m_lok, other=0.0), DT, IEEE) + dQt * scale
    tl.store(dq + (t0 * HQ + i_hq) * K + o_rk, b_dq.to(dq.dtype.element_ty), mask=m_rk)
    if H // HQ > 1:
        tl.debug_barrier()
    # ==== dk, dβ, dG's rows. Every rowsum against K Qᵀ or K Kᵀ is one against a product already formed: with k_a the
    # row's key, Σ_b M_ab (k_a · x_b) = k_a · (M X)_a, so rowsum(M1ᵀ ⊙ K Qᵀ) = rowsum(K ⊙ M1ᵀ Q), rowsum(M2ᵀ ⊙ K Kᵀ) =
    # rowsum(K ⊙ M2ᵀ K), r_n = rowsum(N ⊙ K Kᵀ) = rowsum(K ⊙ N K): (M2 + M2ᵀ) K as M2ᵀ K − diag(β) N K, two products
    # instead of K Kᵀ and one
    strict = orr[:, None] > oc[None, :]
    strict_t = oc[None, :] > orr[:, None]
    b_dk = tl.zeros([BR, BK], dtype=tl.float32)
    for j in range(0, H // HQ):
        i_h = i_hq * (H // HQ) + j
        p_v = (t0 * H + i_h) * V
        p_h = (slot * H + i_h) * K * V
        p_r = t0 * H + i_h
        b_beta = tl.load(beta + p_r + oc * H, mask=m_t, other=0.0).to(tl.float32)  # [C] (the columns)
        b_beta_r = tl.load(beta + p_r + orr * H, mask=m_r, other=0.0).to(tl.float32)  # [BR]
        if GATE == 1:
            G, G_last, gam, gkd = _gate_rows(g + p_r, m_t, n_t, oc, H)
            Gr = _rows_of(G, oc, orr)
            gam_r = tl.exp(Gr)
            gkd_r = tl.exp(tl.where(m_r, G_last - Gr, 0.0))
            if H // HQ > 1:
                r_q = tl.load(rq + p_r + orr * H, mask=m_r, other=0.0)
        dAt = tl.zeros([BR, C], dtype=tl.float32)  # the rows of U dOᵀ
        dL = tl.zeros([BR, C], dtype=tl.float32)  # the rows of Y Uᵀ
        dLt = tl.zeros([BR, C], dtype=tl.float32)  # the rows of U Yᵀ
        dKt = tl.zeros([BR, BK], dtype=tl.float32)  # the rows of U dhᵀ
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            m_rv = m_r[:, None] & m_vv[None, :]
            m_vhi = m_vv[:, None] & m_hi[None, :]
            o_v = orr[:, None] * (H * V) + vv[None, :]  # [BR, BV]
            o_vt = oc[None, :] * (H * V) + vv[:, None]  # [BV, C]
            b_u = tl.load(u + p_v + o_v, mask=m_rv, other=0.0)
            dAt += mm(b_u, tl.load(do + p_v + o_vt, mask=m_vhi, other=0.0), DT, IEEE)
            dKt += mm(b_u, tl.load(dh + p_h + kk[None, :] * V + vv[:, None], mask=m_vv[:, None] & m_kk[None, :],
                                   other=0.0), DT, IEEE)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m_vv = vv < V
            m_rv = m_r[:, None] & m_vv[None, :]
            m_vlo = m_vv[:, None] & m_lo[None, :]
            m_vhi = m_vv[:, None] & m_hi[None, :]
            o_v = orr[:, None] * (H * V) + vv[None, :]  # [BR, BV]
            o_vt = oc[None, :] * (H * V) + vv[:, None]  # [BV, C]
            dL += mm(tl.load(y + p_v + o_v, mask=m_rv, other=0.0), tl.load(u + p_v + o_vt, mask=m_vlo, other=0.0),
                     DT, IEEE)
            dLt += mm(tl.load(u + p_v + o_v, mask=m_rv, other=0.0), tl.load(y + p_v + o_vt, mask=m_vhi, other=0.0),
                      DT, IEEE)
        b_kr = tl.load(p_k + o_rk, mask=m_rk, other=0.0)  # the rows' keys  [BR, BK] (as stored)
        M1t = _decayed_rows(dAt * scale, Gr if GATE == 1 else dAt, G if GATE == 1 else dAt, causal_t, True, GATE)
        P = mm(M1t, tl.load(p_q + o_k, mask=m_hik, other=0.0), DT, IEEE)  # M1ᵀ Q
        kdk = tl.sum(b_kr.to(tl.float32) * dKt, axis=1)  # rowsum(K ⊙ dK̃)
        if GATE == 1:
            r_dG = r_q - tl.sum(b_kr.to(tl.float32) * P, axis=1)
            b_dk += P + dKt * gkd_r[:, None]
        else:
            b_dk += P + dKt
        Nm = _decayed_rows(dL, Gr if GATE == 1 else dL, G if GATE == 1 else dL, strict, False, GATE)
        P = mm(Nm, tl.load(p_k + o_k, mask=m_lok, other=0.0), DT, IEEE)  # N K
        r_n = tl.sum(b_kr.to(tl.float32) * P, axis=1)  # rowsum(N ⊙ K Kᵀ)
        b_dk -= P * b_beta_r[:, None]
        M2t = _decayed_rows(dLt * -b_beta[None, :], Gr if GATE == 1 else dLt, G if GATE == 1 else dLt, strict_t, True,
                            GATE)
        P = mm(M2t, tl.load(p_k + o_k, mask=m_hik, other=0.0), DT, IEEE)  # M2ᵀ K
        b_dk += P
        if GATE == 1:
            r_dG -= b_beta_r * r_n + tl.sum(b_kr.to(tl.float32) * P, axis=1)
        if H // HQ > 1:
            Z = tl.zeros([BR, BK], dtype=tl.float32)  # the rows of Y hᵀ
            for i_v in range(0, tl.cdiv(V, BV)):
                vv = i_v * BV + tl.arange(0, BV)
                m_vv = vv < V
                Z += mm(tl.load(y + p_v + orr[:, None] * (H * V) + vv[None, :], mask=m_r[:, None] & m_vv[None, :],
                                other=0.0),
                        tl.load(h + p_h + kk[None, :] * V + vv[:, None], mask=m_vv[:, None] & m_kk[None, :],
                                other=0.0), DT, IEEE)
        kz = tl.sum(b_kr.to(tl.float32) * Z, axis=1)
        b_db = -r_n
        if GATE == 1:
            b_dk -= Z * (b_beta_r * gam_r)[:, None]
            b_db -= gam_r * kz
            r_dG -= gkd_r * kdk + b_beta_r * gam_r * kz
            tl.store(rg + p_r + orr * H, r_dG, mask=m_r)
            tl.store(dgl + i_r.to(tl.int64) * NSLOT + slot * H + i_h,
                     tl.exp(G_last) * _hdh_part(h + p_h, dh + p_h, i_r, K, V, KS, BV) + tl.sum(gkd_r * kdk, axis=0))
        else:
            b_dk -= Z * b_beta_r[:, None]
            b_db -= kz
        p_dbv = dbv + p_r
        for _ in range(0, NPART):
            b_db += tl.load(p_dbv + orr * H, mask=m_r, other=0.0)
            p_dbv += R
        tl.store(dbeta + p_r + orr * H, b_db.to(dbeta.dtype.element_ty), mask=m_r)
    tl.store(dk + (t0 * HQ + i_hq) * K + o_rk, b_dk.to(dk.dtype.element_ty), mask=m_rk)


def value_block(L: Layout, name: str) -> int:
    """BV of sequential launch site `name` (util.LAUNCH[name]: BV, PROGRAMS): the widest power of two ≤ BV whose
    grid has at least PROGRAMS programs, counting the grid's rows as B·H (padded) or H (varlen: never the
    packing), down to 16 (delta_fused.value_block's rule)."""
    bv = min(tile(name, "BV"), pow2(L.V))
    rows = L.H if L.varlen else L.B * L.H
    target = tile(name, "PROGRAMS")
    while bv > 16 and rows * triton.cdiv(L.V, bv) < target:
        bv //= 2
    return bv


def _stored(dtype: torch.dtype) -> torch.dtype:
    """The dtype of h, dh and Y in memory: the inputs' bf16/fp16 (only ever tensor-core operands, which
    `util.mm` rounds to it anyway), fp32 for fp32 inputs (delta_states._stored's rule)."""
    return torch.float32 if dtype == torch.float32 else dtype


def states_forward(q, k, v, g, beta, Ti, h0, scale: float, L: Layout, *, output: bool, store_states: bool,
                   output_final_state: bool, name: str = "delta_fused_rec", A=None):
    """`_states_kernel`: (o [B, T, H, V] in v's dtype or None (`output`), h [B, NT, H, K, V] (`_stored`) and
    U [B, T, H, V] (v's dtype) or None, None (`store_states`), the final state [NS, H, K, V] fp32 or None);
    with A ([B, T, H, C], q's dtype) it also writes Aqk there (STORE_A).
    q, k [B, T, H_q, K], v [B, T, H, V], g None or [B, T, H] (raw), β [B, T, H], T [B, T, H, C] (fp32, or the
    inputs' dtype from the fused pre-pass), h0 None or [NS, H, K, V] fp32. `name`: the launch site (util.LAUNCH)."""
    dev = k.device
    DT, IEEE = dot_dtype(k.dtype)
    cu, _, _, offsets = varlen_args(L, dev)
    BV = value_block(L, name)
    o = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if output else None
    h = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=_stored(k.dtype), device=dev) if store_states else None
    u = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if store_states else None
    ht = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if output_final_state else None
    anyt = next(t for t in (o, h, ht, Ti) if t is not None)  # a placeholder for the pointers not used
    _states_kernel[(triton.cdiv(L.V, BV), L.NS * L.H)](
        q if q is not None else k, k, v, g if g is not None else k, beta, Ti, h0 if h0 is not None else anyt,
        o if o is not None else anyt, h if h is not None else anyt, u if u is not None else anyt,
        ht if ht is not None else anyt, A if A is not None else anyt, cu, offsets, scale, L.T, L.NT, H=L.H, HQ=L.Hq,
        K=L.K, V=L.V, C=L.C, BK=pow2(L.K), BV=BV, GATE=0 if g is None else 1, HAS_H0=h0 is not None, OUTPUT=output,
        STORE_STATES=store_states, STORE_FINAL=output_final_state, STORE_A=A is not None, IS_VARLEN=L.varlen,
        DT=DT, IEEE=IEEE, **state_pass_launch(name, k.dtype, L.K))
    return o, h, u, ht


def recompute_states(q, k, v, g, beta, Ti, h0, scale: float, L: Layout):
    """The backward's recompute of the forward state pass: (h [B, NT, H, K, V], U [B, T, H, V], Aqk [B, T, H, C] in
    q's dtype or None); see `states_forward`. Aqk is written for the reverse kernel with
    `LAUNCH["delta_fused_rev"]["AQK"] = 1` (else that kernel recomputes it, once per value block)."""
    kept = delta_fused_backward(table()).aqk_kept  # the variant (`kernels.variants`): the branch that names it
    A = empty_output(L.B, L.T, L.H, L.C, dtype=q.dtype, device=q.device) if kept else None
    _, h, u, _ = states_forward(q, k, v, g, beta, Ti, h0, scale, L, output=False, store_states=True,
                                output_final_state=False, A=A)
    return h, u, A


def grads_rows(L: Layout) -> int:
    """The rows per program of the gradient kernel: 0 for one program per chunk (`_grads_kernel`), else BR < C
    (`_grads_rows_kernel`, C / BR programs per chunk) — the variant's (`variants.delta_fused_backward`:
    LAUNCH["delta_fused_grads_rows"] ON, BR; BR a power of two ≥ 16, tl.dot's smallest side, below the chunk)."""
    grads = delta_fused_backward(table(), L.C)
    return grads.rows if grads.grads == "rows" else 0


def _maxnreg(name: str) -> dict:
    """{"maxnreg": LAUNCH[name]["MAXNREG"]} when set (> 0 and not under the interpreter, which has no registers), else
    {}: Triton's per-thread register cap for the launch."""
    n = tile(name, "MAXNREG")
    return {"maxnreg": n} if n > 0 and not interpreter.interpreting() else {}


def _grads_rows(q, k, g, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta, scale: float, L: Layout, BR: int, NV: int,
                DT, IEEE):
    """`_grads_kernel`'s outputs by `_grads_rows_kernel` (grid (NT·C/BR, B·H_q)): dq, dk, dβ written in place, dg
    ([B, T, H] in g's dtype, or None) returned — the kernel's dG rows and ∂L/∂G_last parts reverse-summed over
    each chunk by `chunk_cumsum` (the parts summed first: one [C/BR, B·NT·H] fp32 sum)."""
    dev = k.device
    cu, chunk_seq, chunk_local, _ = varlen_args(L, dev)
    R = L.B * L.T * L.H
    NR = L.C // BR
    nslot = L.B * L.NT * L.H
    rg = empty_output(R, dtype=torch.float32, device=dev) if g is not None else dbv
    dgl = empty_output(NR, nslot, dtype=torch.float32, device=dev) if g is not None else dbv
    _grads_rows_kernel[(L.NT * NR, L.B * L.Hq)](
        q, k, g if g is not None else k, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta, rg, dgl, cu, chunk_seq,
        chunk_local, scale, L.T, L.NT, R, nslot, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BR=BR, BK=pow2(L.K),
        BV=min(tile("delta_fused_grads_rows", "BV"), pow2(L.V)), NPART=NV, GATE=0 if g is None else 1,
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **launch("delta_fused_grads_rows"), **_maxnreg("delta_fused_grads_rows"))
    if g is None:
        return None
    return chunk_cumsum(rg.view(g.shape), L, reverse=True, add=dgl.sum(0).view(L.B, L.NT, L.H), out_dtype=g.dtype)


def fused_backward(q, k, v, g, beta, Ti, h, u, do, dht, scale: float, L: Layout, *, need_dh0: bool, A=None):
    """(dq, dk [B, T, H_q, K] in q's dtype, dv [B, T, H, V] in v's dtype, dg (g's shape and dtype) or None, dβ
    [B, T, H] in β's dtype, dS_0 [NS, H, K, V] fp32 or None (`need_dh0`)) from the inputs, T, the entering
    states h [B, NT, H, K, V] and U [B, T, H, V] (`recompute_states`, or kept by the forward), dO [B, T, H, V]
    and the final state's gradient dht [NS, H, K, V] or None (and Aqk from `recompute_states`, or None):
    `_reverse_kernel`, then `_grads_kernel`."""
    dev = k.device
    DT, IEEE = dot_dtype(k.dtype)
    cu, chunk_seq, chunk_local, offsets = varlen_args(L, dev)
    gate = 0 if g is None else 1
    BV = value_block(L, "delta_fused_rev")
    NV = triton.cdiv(L.V, BV)
    R = L.B * L.T * L.H
    dh = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=_stored(k.dtype), device=dev)
    y = empty_output(L.B, L.T, L.H, L.V, dtype=_stored(v.dtype), device=dev)
    dv = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev)
    dbv = empty_output(NV, R, dtype=torch.float32, device=dev)
    dh0 = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if need_dh0 else None
    _reverse_kernel[(NV, L.NS * L.H)](
        q, k, v, g if g is not None else k, beta, Ti, A if A is not None else Ti, dht if dht is not None else dh, do,
        dh, y, dv, dbv, dh0 if dh0 is not None else dh, cu, offsets, scale, L.T, L.NT, R, H=L.H, HQ=L.Hq, K=L.K,
        V=L.V, C=L.C, BK=pow2(L.K), BV=BV, GATE=gate, A_IN=A is not None, HAS_DHT=dht is not None, HAS_H0=need_dh0,
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **state_pass_launch("delta_fused_rev", k.dtype, L.K))
    dq = empty_output(L.B, L.T, L.Hq, L.K, dtype=q.dtype, device=dev)
    dk = empty_output(L.B, L.T, L.Hq, L.K, dtype=k.dtype, device=dev)
    dbeta = empty_output(L.B, L.T, L.H, dtype=beta.dtype, device=dev)
    rq = empty_output(R, dtype=torch.float32, device=dev) if (g is not None and L.H > L.Hq) else dbv
    grads = delta_fused_backward(table(), L.C)  # the gradient kernel's variant (`kernels.variants`): the branch
    if grads.grads == "rows":
        dg = _grads_rows(q, k, g, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta, scale, L, grads.rows, NV, DT, IEEE)
    else:
        dg = empty_output(*g.shape, dtype=g.dtype, device=dev) if g is not None else None
        _grads_kernel[(L.NT, L.B * L.Hq)](
            q, k, g if g is not None else k, beta, h, dh, u, y, do, dbv, rq, dq, dk, dbeta,
            dg if dg is not None else dbeta, cu, chunk_seq, chunk_local, scale, L.T, L.NT, R, H=L.H, HQ=L.Hq, K=L.K,
            V=L.V, C=L.C, BK=pow2(L.K), BV=min(tile("delta_fused_grads", "BV"), pow2(L.V)), NPART=NV, GATE=gate,
            IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, ROWSUMS=int(grads.grads == "rowsums"),
            **launch("delta_fused_grads"))
    return dq, dk, dv, dg, dbeta, dh0
