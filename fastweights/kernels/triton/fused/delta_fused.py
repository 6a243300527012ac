"""The fused forward of the delta class with the decay first (DeltaNet, gated DeltaNet, KDA; DeltaProduct
through its interleaved micro-steps): two kernels instead of the staged pipeline's six.

1. `_prepass_kernel`, chunk-parallel, grid (chunk slots NT, B·H): per chunk, in registers,

       G   = chunk-local cumsum of g                       (scalar gate; in the kernel)
       P   = strict_tril(K Kᵀ ⊙ e^{G_i − G_j})             (none/scalar; KDA: read from `scores`, see below)
       T   = (I + diag(β) P)⁻¹                              (`_unit_lower_inverse`, or by INV the others)
       W   = T diag(β)(K ⊙ e^{G}),  U' = T diag(β) V       (stored: k's and v's dtype)
       T   stored (the backward's input) when a gradient is wanted: in the inputs' dtype — bf16 for bf16 inputs, which
           every reader rounds it to as a tensor-core operand anyway — fp32 for fp32 inputs.

   B·H·NT programs: it fills the GPU at any shape.
2. `_fused_fwd_kernel`, sequential, grid (⌈V/BV⌉, sequences·H): the state S [K, BV] fp32 in registers
   across the sequence's chunks; per chunk n, with Q̃ = scale q ⊙ e^{G}, K̃ = k ⊙ e^{G_last − G}:

       U_n     = U'_n − W_n S_n
       o_n     = Q̃_n S_n + Aqk_n U_n,   Aqk = scale (Q Kᵀ ⊙ e^{G_i − G_j}) on j ≤ i
       S_{n+1} = e^{G_last} ⊙ S_n + K̃_nᵀ U_n

   writing o, and — only where the caller keeps them for the backward (`DeltaPipeline(recompute_states=False)`)
   — the entering states h (bf16 for bf16 inputs, as `delta_states`), U and the final state.
   Aqk is computed in the loop for no/scalar decay (one more [C, K]·[K, C] product per chunk and V
   block, no bytes), or — `LAUNCH["delta_prepass"]["AQK"] = 1` — once per chunk by the pre-pass and read
   (fp32, 2 × 67 MB at the anchor, for 1/NV of the tensor work); for the diagonal decay (KDA) it is read
   from `scores.decayed_scores`, as is P: the per-channel decay needs that kernel's 16-row reference
   blocks (every exponent ≤ 0).

The same maths and roundings as the staged pipeline (delta.py): tensor-core operands in the inputs'
dtype (`util.mm`), fp32 accumulation and state, U rounded to v's dtype where the staged output
stage reads it. The only new piece is the in-register inverse, in one of three forms (`LAUNCH["delta_prepass"]["INV"]`,
`kernels.variants.INVERSE_FORMS`): 0, the default (`_unit_lower_inverse`): 16×16 diagonal blocks by forward
substitution, then (I + N)⁻¹ with N = B⁻¹L_off strictly block-lower by products (I − N)(I + N²)(I + N⁴)… (exact:
N^{C/16} = 0); 1 (`_unit_lower_inverse_rec`, the twin of `chunkwise.delta.block_unit_lower_inverse`): 2×2 block
recursion on the whole [C, C] tile by masked products, no reshape; 2: the 16×16 blocks by that recursion as batched
[NB, 16, 16] products, then the doubling of 0. Fp32 products throughout ("ieee" for fp32 inputs, "tf32x3" —
fp32-accurate on the tensor cores — otherwise). (The product form (I − L)(I + L²)(I + L⁴)(I + L⁸) on the 16×16
blocks is not offered: its powers of L grow where β ≈ 2 and the keys are near parallel, 0.36 relative error in T
against 7e-6 — docs/kernel_notes.md "The pre-pass's inverse (r4s14 helper prepass-inverse)".)

Every constexpr depends on the head dims, the dtype, the gate kind, the chunk size and the flags only;
T and NT are not specialized (`do_not_specialize`), so a varlen call with another packing reuses the
compiled kernels. BV (the value columns per sequential program) comes from `value_block`: the heads
alone (varlen) or batch × heads (padded) against a program target, never from T or the packing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import INVERSE_FORMS, delta_fused_forward
from ..common.layout import Layout
from ..common.limits import DELTA_FUSED_MAX_HEAD_DIM_CUDA
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
from ..stages.scores import decayed_scores
from .delta_fused_bwd import states_forward, supports

BC = 16  # rows of the inverse's diagonal blocks
INVERSE_CODES = {name: code for code, name in INVERSE_FORMS.items()}  # the pre-pass's INV constexpr by form


@triton.jit
def _unit_lower_inverse(b_L, C: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr,
                        PREC: tl.constexpr, LEAF_REC: tl.constexpr = 0):
    """(I + b_L)⁻¹ for b_L [C, C] fp32 strictly lower (zeros on and above the diagonal), in registers.

    Phase 1: the NB = C/BC diagonal blocks as [NB, BC, BC], inverted all together: by forward substitution over the
    BC rows (LEAF_REC 0, the default: 15 steps of [NB, BC, BC] selections and sums), or (LEAF_REC 1,
    LAUNCH["delta_prepass"]["INV"] = 2) by 2×2 block recursion X_{2s} = X_s − X_s (M_s X_s) from X_2 = I − M_1, as
    batched [NB, BC, BC] products at PREC (3 levels of two). Phase 2: with B = I + (b_L's diagonal blocks) and L_off
    the rest, (I + b_L)⁻¹ = (I + N)⁻¹ B⁻¹, N = B⁻¹ L_off, and (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)… up to N^{NB−1}.
    Blocks move between [C, C] and [NB, BC, BC] through 0/1 selector products (exact: one term per sum)."""
    oc = tl.arange(0, C)
    ob = tl.arange(0, BC)
    same = (oc[:, None] // BC) == (oc[None, :] // BC)  # [C, C]: the same diagonal block
    # [C, BC] ← the diagonal blocks' rows: D[r, j] = L[r, (r // BC)·BC + j]
    sel = tl.where((oc[:, None] % BC) == ob[None, :], 1.0, 0.0)  # [C, BC]
    D = tl.dot(tl.where(same, b_L, 0.0), sel, input_precision="ieee")
    l3 = tl.reshape(D, (NB, BC, BC))  # block s, row i, column j
    i3 = ob[None, :, None]
    j3 = ob[None, None, :]
    t3 = tl.where((i3 == j3) & (tl.arange(0, NB)[:, None, None] >= 0), 1.0, 0.0)  # rows ≥ i still e_i
    if LEAF_REC:
        t3 = t3 - tl.where((i3 // 2) == (j3 // 2), l3, 0.0)  # X_2 (l3 is 0 on the diagonal)
        tl.static_assert(BC == 16)  # (the module's BC: levels s = 2, 4, 8)
        for m in tl.static_range(1, 4):  # s = 2^m: the s-blocks into 2s-blocks  [NB, BC, BC]
            M3 = tl.where(((i3 >> (m + 1)) == (j3 >> (m + 1))) & ((i3 >> m) != (j3 >> m)), l3, 0.0)
            t3 = t3 - tl.dot(t3, tl.dot(M3, t3, input_precision=PREC), input_precision=PREC)
    else:
        for i in range(1, BC):
            l_i = tl.sum(tl.where(i3 == i, l3, 0.0), axis=1)  # row i of each block  [NB, BC]
            row = tl.where(ob[None, :] == i, 1.0, 0.0) - tl.sum(l_i[:, :, None] * t3, axis=1)  # [NB, BC]
            t3 = tl.where(i3 == i, row[:, None, :], t3)
    # B⁻¹ as [C, C]: Binv[r, c] = t3[r // BC, r % BC, c % BC] on the diagonal blocks
    selt = tl.where(ob[:, None] == (oc[None, :] % BC), 1.0, 0.0)  # [BC, C]
    Binv = tl.where(same, tl.dot(tl.reshape(t3, (C, BC)), selt, input_precision="ieee"), 0.0)
    X = Binv
    if NB > 1:
        N = tl.dot(Binv, tl.where(same, 0.0, b_L), input_precision=PREC)  # strictly block-lower
        X = X - tl.dot(N, X, input_precision=PREC)
        Np = N
        for _ in tl.static_range(1, LOG_NB):  # (I + N^{2^m}) for 2 ≤ 2^m < NB
            Np = tl.dot(Np, Np, input_precision=PREC)
            X = X + tl.dot(Np, X, input_precision=PREC)
    return X


@triton.jit
def _unit_lower_inverse_rec(b_L, C: tl.constexpr, LOG_C: tl.constexpr, PREC: tl.constexpr):
    """(I + b_L)⁻¹ for b_L [C, C] fp32 strictly lower, in registers, by 2×2 block recursion on the whole tile
    (LAUNCH["delta_prepass"]["INV"] = 1; the twin of `chunkwise.delta.block_unit_lower_inverse`):

        [[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]],  i.e.  X_{2s} = X_s − X_s (M_s X_s)

    with X_s [C, C] the inverse of (I + b_L)'s diagonal s × s blocks and M_s b_L's entries in the lower-left s × s
    quarter of each diagonal 2s × 2s block (masks on the [C, C] tile: no reshape, no selector). X_2 = I − M_1 takes no
    product; each of the log₂C − 1 further levels takes two [C, C] products at PREC (exact zeros stay zero: the
    tile stays block-diagonal). 10 products at C = 64, 8 at 32, 6 at 16. One [C, C] tile carries both across the
    levels: W holds X_s inside the s-blocks and b_L's entries not yet used outside them (b_L and X_s are not live
    together: 32 registers a thread fewer at C 64, 4 warps)."""
    oc = tl.arange(0, C)
    r = oc[:, None]
    c = oc[None, :]
    W = tl.where((r // 2) == (c // 2), tl.where(r == c, 1.0, 0.0) - b_L, b_L)  # X_2 inside the 2-blocks, b_L outside
    for m in tl.static_range(1, LOG_C):  # s = 2^m: merge the s-blocks into 2s-blocks
        inside = (r >> m) == (c >> m)  # the s-blocks: X_s there
        quarter = ((r >> (m + 1)) == (c >> (m + 1))) & ((r >> m) != (c >> m))  # the 2s-blocks' lower-left quarters
        X = tl.where(inside, W, 0.0)
        M = tl.where(quarter, W, 0.0)  # b_L there
        # X_{2s} = X_s − X_s M X_s: X_s inside the s-blocks (kept), −X_s M X_s on the quarters (zero elsewhere)
        W = tl.where(quarter, -tl.dot(X, tl.dot(M, X, input_precision=PREC), input_precision=PREC), W)
    return W


@triton.jit(do_not_specialize=["T"])
def _prepass_kernel(q, k, v, g, beta, P, Ti, w, u1, A, cu, chunk_seq, chunk_local, scale, T, H: tl.constexpr,
                    HQ: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    BC: tl.constexpr, NB: tl.constexpr, LOG_NB: tl.constexpr, GATE: tl.constexpr, P_IN: tl.constexpr,
                    STORE_T: tl.constexpr, STORE_A: tl.constexpr, STORE_WU: tl.constexpr, IS_VARLEN: tl.constexpr,
                    DT: tl.constexpr, IEEE: tl.constexpr, PREC: tl.constexpr, RAW_KV: tl.constexpr,
                    INV: tl.constexpr, LOG_C: tl.constexpr):
    # GATE 0 none, 1 scalar [B, T, H], 2 diagonal [B, T, H, K] (then P_IN: P read from memory);
    # RAW_KV (GATE 0/1): W = (T diag(β e^{G})) K and U' = (T diag(β)) V — the row factors on T's columns, k and v to
    # the tensor cores as stored (0: β and the decay applied to fp32 copies of the k and v tiles);
    # STORE_A (GATE 0/1): also Aqk = scale (Q Kᵀ ⊙ e^{G_i − G_j}) on j ≤ i, fp32, for the sequential kernel
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    oc = tl.arange(0, C)
    rows = t0 + oc
    m_t = rows < eos
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    strict = oc[:, None] > oc[None, :]
    if GATE == 1:
        G = tl.cumsum(tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
    if P_IN:
        b_P = tl.load(P + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)
    else:
        b_P = tl.zeros([C, C], dtype=tl.float32)
        if STORE_A:
            b_A = tl.zeros([C, C], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            kk = i_k * BK + tl.arange(0, BK)
            m_kk = kk < K
            b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_t[:, None] & m_kk[None, :],
                          other=0.0)  # [C, BK]
            b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kk[:, None] & m_t[None, :],
                           other=0.0)  # [BK, C]
            b_P += mm(b_k, b_kt, DT, IEEE)
            if STORE_A:
                b_q = tl.load(q + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_t[:, None] & m_kk[None, :],
                              other=0.0).to(tl.float32) * scale
                b_A += mm(b_q, b_kt, DT, IEEE)
        causal = oc[:, None] >= oc[None, :]
        if GATE == 1:
            b_P = b_P * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))  # exponent ≤ 0 below the diagonal
            if STORE_A:
                b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
        if STORE_A:
            tl.store(A + (rows[:, None] * H + i_h) * C + oc[None, :], tl.where(causal, b_A, 0.0), mask=m_t[:, None])
    b_L = tl.where(strict, b_P * b_beta[:, None], 0.0)
    if INV == 1:  # the inverse by 2×2 block recursion on the [C, C] tile (masks and products only)
        b_T = _unit_lower_inverse_rec(b_L, C, LOG_C, PREC)  # [C, C] fp32
    else:  # 16×16 diagonal blocks by forward substitution (INV 0) or batched recursion (INV 2), then doubling
        b_T = _unit_lower_inverse(b_L, C, BC, NB, LOG_NB, PREC, INV == 2)  # [C, C] fp32
    if STORE_T:
        tl.store(Ti + (rows[:, None] * H + i_h) * C + oc[None, :], b_T.to(Ti.dtype.element_ty), mask=m_t[:, None])
    if STORE_WU and RAW_KV and GATE != 2:
        b_Tb = b_T * b_beta[None, :]  # T diag(β)  [C, C]
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m = m_t[:, None] & (vv < V)[None, :]
            off = (rows[:, None] * H + i_h) * V + vv[None, :]
            b_v = tl.load(v + off, mask=m, other=0.0)
            tl.store(u1 + off, mm(b_Tb, b_v, DT, IEEE).to(u1.dtype.element_ty), mask=m)
        if GATE == 1:
            b_Tb = b_Tb * tl.exp(G)[None, :]  # T diag(β e^{G})
        for i_k in range(0, tl.cdiv(K, BK)):
            kk = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (kk < K)[None, :]
            b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m, other=0.0)
            tl.store(w + (rows[:, None] * H + i_h) * K + kk[None, :],
                     mm(b_Tb, b_k, DT, IEEE).to(w.dtype.element_ty), mask=m)
    elif STORE_WU:  # (not with LAUNCH["delta_prepass"]["WU"] = 0: the sequential kernel then reads T)
        for i_v in range(0, tl.cdiv(V, BV)):
            vv = i_v * BV + tl.arange(0, BV)
            m = m_t[:, None] & (vv < V)[None, :]
            off = (rows[:, None] * H + i_h) * V + vv[None, :]
            b_v = tl.load(v + off, mask=m, other=0.0).to(tl.float32) * b_beta[:, None]
            tl.store(u1 + off, mm(b_T, b_v, DT, IEEE).to(u1.dtype.element_ty), mask=m)
        for i_k in range(0, tl.cdiv(K, BK)):
            kk = i_k * BK + tl.arange(0, BK)
            m = m_t[:, None] & (kk < K)[None, :]
            b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            b_k = b_k * b_beta[:, None]
            if GATE == 2:
                b_k = b_k * tl.exp(tl.cumsum(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m,
                                                     other=0.0).to(tl.float32), axis=0))
            elif GATE == 1:
                b_k = b_k * tl.exp(G)[:, None]
            tl.store(w + (rows[:, None] * H + i_h) * K + kk[None, :],
                     mm(b_T, b_k, DT, IEEE).to(w.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "NT"])
def _fused_fwd_kernel(q, k, g, w, u1, A, h0, o, h, ht, u, cu, offsets, scale, T, NT, H: tl.constexpr,
                      HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, GATE: tl.constexpr, A_IN: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE_FINAL: tl.constexpr, STORE_STATES: tl.constexpr, IS_VARLEN: tl.constexpr,
                      DT: tl.constexpr, IEEE: tl.constexpr, RAW_QK: tl.constexpr, OUTPUT: tl.constexpr):
    # OUTPUT 0: the states alone (h, U, the final state; no q, no Aqk, no o) — the split forward's sequential pass
    # where delta_fused_bwd._states_kernel does not take the call (delta_split.py)
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
    causal = oc[:, None] >= oc[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_s.to(tl.int64) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(0, n_chunks):  # a for loop: software-pipelined on the GPU
        if STORE_STATES:
            tl.store(h + ((slot0 + c) * H + i_h) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        rows = bos + c * C + oc
        m_t = rows < eos
        last = (tl.minimum(bos + c * C + C, eos) - 1 - bos - c * C).to(tl.int32)  # the last real row in the chunk
        m_tk = m_t[:, None] & m_kk[None, :]
        m_kt = m_kk[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_vv[None, :]
        if RAW_QK:  # q, kᵀ as stored (the glue passes 0 for the diagonal gate): scale, decays on the other sides
            if OUTPUT:
                b_q = tl.load(q + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_tk, other=0.0)  # [C, BK]
            b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kt, other=0.0)  # [BK, C]
        else:
            if OUTPUT:
                b_q = tl.load(q + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_tk, other=0.0).to(tl.float32)
                b_q = b_q * scale  # [C, BK]
            b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kt, other=0.0).to(tl.float32)
        if RAW_QK:
            qf = tl.zeros([C], dtype=tl.float32) + scale  # o's row factor scale·e^{G}
            kf = tl.where(m_t, 1.0, 0.0)  # U's row factor e^{G_last − G} before Kᵀ U
            if not OUTPUT:
                pass
            elif A_IN:
                b_A = tl.load(A + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)
            else:
                b_A = mm(b_q, b_kt, DT, IEEE) * scale  # scale Q Kᵀ  [C, C]
            if GATE == 1:
                G = tl.cumsum(tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
                G_last = tl.sum(tl.where(oc == last, G, 0.0), axis=0)
                if OUTPUT and not A_IN:
                    b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
                qf = qf * tl.exp(G)
                kf = tl.exp(tl.where(m_t, G_last - G, 0.0))
        elif not OUTPUT:
            pass
        elif A_IN:
            b_A = tl.load(A + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
        else:
            b_A = mm(b_q, b_kt, DT, IEEE)  # scale Q Kᵀ  [C, C]
        # the decays: Q̃ = Q ⊙ e^{G}, K̃ᵀ = Kᵀ ⊙ e^{G_last − G}, a = e^{G_last}, Aqk ⊙ e^{G_i − G_j} (no/scalar)
        if RAW_QK:
            pass  # the decays above
        elif GATE == 1:
            G = tl.cumsum(tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
            G_last = tl.sum(tl.where(oc == last, G, 0.0), axis=0)
            if OUTPUT:
                if not A_IN:
                    b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
                b_q = b_q * tl.exp(G)[:, None]
            b_kt = b_kt * tl.exp(tl.where(m_t, G_last - G, 0.0))[None, :]
        elif GATE == 2:
            if OUTPUT:
                G = tl.cumsum(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_tk, other=0.0)
                              .to(tl.float32), axis=0)  # [C, BK]
                b_q = b_q * tl.exp(G)
            Gt = tl.cumsum(tl.load(g + (rows[None, :] * H + i_h) * K + kk[:, None], mask=m_kt, other=0.0)
                           .to(tl.float32), axis=1)  # [BK, C]
            G_last = tl.sum(tl.where(oc[None, :] == last, Gt, 0.0), axis=1)  # [BK]
            b_kt = b_kt * tl.exp(tl.where(m_kt, G_last[:, None] - Gt, 0.0))
        if OUTPUT and not A_IN:
            b_A = tl.where(causal, b_A, 0.0)
        b_w = tl.load(w + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_tk, other=0.0)  # [C, BK]
        off_u = (rows[:, None] * H + i_h) * V + vv[None, :]
        b_u = tl.load(u1 + off_u, mask=m_tv, other=0.0).to(tl.float32) - mm(b_w, S, DT, IEEE)  # [C, BV]
        if STORE_STATES:
            tl.store(u + off_u, b_u.to(u.dtype.element_ty), mask=m_tv)
        if OUTPUT:
            if RAW_QK:
                b_o = qf[:, None] * mm(b_q, S, DT, IEEE) + mm(b_A, b_u, DT, IEEE)
            else:
                b_o = mm(b_q, S, DT, IEEE) + mm(b_A, b_u, DT, IEEE)
            tl.store(o + off_u, b_o.to(o.dtype.element_ty), mask=m_tv)
        if GATE == 1:
            S = S * tl.exp(G_last)
        elif GATE == 2:
            S = S * tl.exp(G_last)[:, None]
        if RAW_QK:
            S += mm(b_kt, b_u * kf[:, None], DT, IEEE)
        else:
            S += mm(b_kt, b_u, DT, IEEE)
    if STORE_FINAL:
        tl.store(ht + (i_s.to(tl.int64) * H + i_h) * K * V + kv, S, mask=m_kv)


def value_block(L: Layout) -> int:
    """BV of the sequential kernel: the widest power of two ≤ LAUNCH["delta_fused_fwd"]["BV"] (≤ 32 for
    K > 128: the [K, BV] fp32 state tile's registers) whose grid has at least LAUNCH[...]["PROGRAMS"]
    programs, counting the rows of the grid as B·H (padded) or H (varlen: one sequence, the worst case —
    never the packing, so a new packing never compiles a new BV), down to 16."""
    cap = tile("delta_fused_fwd", "BV")
    bv = min(cap if L.K <= 128 else min(cap, 32), pow2(L.V))
    rows = L.H if L.varlen else L.B * L.H
    target = tile("delta_fused_fwd", "PROGRAMS")
    while bv > 16 and rows * triton.cdiv(L.V, bv) < target:
        bv //= 2
    return bv


def fused_programs(L: Layout) -> dict:
    """The launch grids of the fused forward at layout L: {"prepass": programs, "sequential": programs,
    "BV": the sequential kernel's value block} (for the GPU script's report)."""
    bv = value_block(L)
    return {"prepass": L.NT * L.B * L.H, "sequential": L.NS * L.H * triton.cdiv(L.V, bv), "BV": bv}


#: Head dims the fused forward takes on a GPU (`limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA`): K = V = 256 (bf16) hit an
#: illegal memory access on the H100 (tests/kernels/fused/test_triton_delta_fused.py::test_cuda_realistic,
#: 2026-11-25); the interpreter passes it.
FUSED_MAX_HEAD_DIM_CUDA = DELTA_FUSED_MAX_HEAD_DIM_CUDA


def prepass(q, k, v, g, beta, scale: float, L: Layout, *, store_T: bool, t_form: bool = False):
    """The fused forward's first kernel alone (`_prepass_kernel`, with the variants the launch table picks:
    `kernels.variants.delta_fused_forward`), for `fused_forward` and for timing it alone
    (scripts/gpu_prepass_inverse.py). Inputs as `fused_forward`'s. Returns (the DeltaFusedForward that ran, W
    [B, T, H, K] and U' [B, T, H, V] in k's / v's dtype (the T form: both are T, unwritten placeholders), T
    [B, T, H, C] in q's dtype or None (written where `store_T` or the T form), Aqk [B, T, H, C] fp32 or None
    (written with Aqk from the pre-pass; for the diagonal decay, from the scores kernel)). t_form: T only (no W, U',
    Aqk) whatever the launch table says — the split forward's pre-pass where delta_fused_bwd's states kernel takes the
    call (`supports`)."""
    dev = q.device
    gate = 0 if g is None else (2 if g.dim() == 4 else 1)
    DT, IEEE = dot_dtype(q.dtype)
    cu, chunk_seq, chunk_local, offsets = varlen_args(L, dev)
    P = A = None
    # the variants (`kernels.variants.delta_fused_forward`, the one branch that picks them and names them): t_form,
    # U = T X in the sequential loop (delta_fused_bwd._states_kernel), the pre-pass writing T only; Aqk from the
    # pre-pass; raw k, v and q, k; the inverse's precision
    chosen = delta_fused_forward(("none", "scalar", "diagonal")[gate], L.K, L.C, q.dtype, table())
    t_form = chosen.t_form or t_form
    assert not t_form or supports(g, L)  # the T form only where its state kernel takes the call
    aqk_in_prepass = chosen.aqk_in_prepass and not t_form
    if aqk_in_prepass:
        A = empty_output(L.B, L.T, L.H, L.C, dtype=torch.float32, device=dev)
    if gate == 2:  # KDA: P and Aqk from the 16-row-block scores kernel (the per-channel decay)
        G = chunk_cumsum(g, L)
        P = decayed_scores(k, k, G, None, 1.0, L)
        A = decayed_scores(q, k, G, None, scale, L)
        del G
    w = empty_output(L.B, L.T, L.H, L.K, dtype=k.dtype, device=dev) if not t_form else None
    u1 = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if not t_form else None
    # T in the inputs' dtype for bf16/fp16 (every reader rounds it to that dtype as a tensor-core operand)
    Ti = empty_output(L.B, L.T, L.H, L.C, dtype=q.dtype, device=dev) if store_T or t_form else None
    if t_form:
        w = u1 = Ti  # placeholders (not written)
    BK = min(64, pow2(L.K))
    _prepass_kernel[(L.NT, L.B * L.H)](
        q, k, v, g if g is not None else k, beta, P if P is not None else w, Ti if Ti is not None else w, w, u1,
        A if aqk_in_prepass else w, cu, chunk_seq, chunk_local, scale, L.T, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C,
        BK=BK, BV=min(64, pow2(L.V)), BC=BC,
        NB=L.C // BC, LOG_NB=(L.C // BC).bit_length() - 1, GATE=gate, P_IN=P is not None, STORE_T=Ti is not None,
        STORE_A=aqk_in_prepass, STORE_WU=not t_form, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
        PREC="ieee" if IEEE == 1 else chosen.inverse, RAW_KV=int(chosen.raw_kv and not t_form),
        INV=INVERSE_CODES[chosen.inverse_form], LOG_C=L.C.bit_length() - 1, **launch("delta_prepass"))
    del P
    return chosen, w, u1, Ti, A


def fused_forward(q, k, v, g, beta, h0, scale: float, L: Layout, *, output_final_state: bool, store_states: bool,
                  store_T: bool):
    """The decay-first delta rule's forward in two kernels (see the module docstring).

    q, k [B, T, H_q, K], v [B, T, H, V] (one dtype), g None / [B, T, H] / [B, T, H, K] (the raw
    log-decay: the kernels take its chunk-local cumsum), β [B, T, H], h0 None or [NS, H, K, V] fp32.
    Returns (o [B, T, H, V] in v's dtype, T [B, T, H, C] in q's dtype or None (`store_T`), h [B, NT, H, K, V]
    (the staged pass's stored dtype) and U [B, T, H, V] or None, None (`store_states`), the final state
    [NS, H, K, V] fp32 or None (`output_final_state`))."""
    check_head_dims(q, L, "fused")
    chosen, w, u1, Ti, A = prepass(q, k, v, g, beta, scale, L, store_T=store_T)
    if chosen.t_form:
        o, h, u, ht = states_forward(q, k, v, g, beta, Ti, h0, scale, L, output=True, store_states=store_states,
                                     output_final_state=output_final_state, name="delta_fused_fwd_t")
        return o, (Ti if store_T else None), h, u, ht
    o, h, u, ht = sequential(q, k, v, g, w, u1, A, h0, scale, L, output=True, store_states=store_states,
                             output_final_state=output_final_state, raw_qk=chosen.raw_qk)
    return o, Ti, h, u, ht


def check_head_dims(q, L: Layout, form: str) -> None:
    """The GPU's head-dim limit of `_fused_fwd_kernel` (FUSED_MAX_HEAD_DIM_CUDA), for the forward `form` ("fused" or
    "split", whose states pass runs that kernel beyond delta_fused_bwd's scope): InputError beyond it."""
    if q.is_cuda and max(L.K, L.V) > FUSED_MAX_HEAD_DIM_CUDA:
        raise InputError(f"the {form} delta forward takes K, V ≤ {FUSED_MAX_HEAD_DIM_CUDA} on a GPU, got K={L.K}, "
                         f"V={L.V} (an illegal memory access at K = V = 256 in bf16 on the H100, Triton 3.6, "
                         "2026-11-25, not found yet): pass pipeline=DeltaPipeline(forward='staged', ...) for these "
                         "head dims")


def sequential(q, k, v, g, w, u1, A, h0, scale: float, L: Layout, *, output: bool, store_states: bool,
               output_final_state: bool, raw_qk: bool):
    """`_fused_fwd_kernel` on the pre-pass's W, U' (and Aqk or None): (o [B, T, H, V] in v's dtype or None (`output`),
    h [B, NT, H, K, V] in q's dtype and U [B, T, H, V] in v's dtype or None, None (`store_states`), the final state
    [NS, H, K, V] fp32 or None). output=False: the states alone (OUTPUT 0: no q, Aqk or o in the loop)."""
    dev = q.device
    gate = 0 if g is None else (2 if g.dim() == 4 else 1)
    DT, IEEE = dot_dtype(q.dtype)
    cu, _, _, offsets = varlen_args(L, dev)
    BV = value_block(L)
    o = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if output else None
    h = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=q.dtype, device=dev) if store_states else None
    u = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if store_states else None
    ht = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if output_final_state else None
    anyt = next(t for t in (o, h, ht) if t is not None)  # a placeholder for the pointers not used
    _fused_fwd_kernel[(triton.cdiv(L.V, BV), L.NS * L.H)](
        q, k, g if g is not None else q, w, u1, A if A is not None else w, h0 if h0 is not None else w,
        o if o is not None else anyt, h if h is not None else anyt, ht if ht is not None else anyt,
        u if u is not None else anyt, cu, offsets, scale, L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C,
        BK=pow2(L.K), BV=BV, GATE=gate, A_IN=A is not None and output, HAS_H0=h0 is not None,
        STORE_FINAL=output_final_state, STORE_STATES=store_states, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
        RAW_QK=raw_qk, OUTPUT=output, **state_pass_launch("delta_fused_fwd", q.dtype, L.K))
    return o, h, u, ht

