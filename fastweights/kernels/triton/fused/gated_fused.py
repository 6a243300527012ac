"""The fused pipeline of the gated-linear class (linear attention, RetNet, Mamba2, GLA): one sequential kernel
forward; backward a states recompute, one reverse sequential kernel and one chunk-parallel kernel — instead of
the staged pipeline's four (forward) and eight (backward) kernels and their torch glue (gated.py).

Maths (chunks of C rows; inside chunk n, G_i = Σ_{s ≤ i} g_s the chunk-local cumsum, G_L its value at the
chunk's last real row, S_n the state entering the chunk, k̂ = βk; g none, scalar per head and token, or
diagonal — per key channel d, GLA — where every e^{G} below acts channel by channel on the key side):

    A_ij    = scale Σ_d q_id k̂_jd e^{G_id − G_jd}  (j ≤ i, else 0)     Q̃ = scale q ⊙ e^{G}
    o       = Q̃ S_n + A V                                             K̃ = k̂ ⊙ e^{G_L − G}
    S_{n+1} = Diag(e^{G_L}) S_n + K̃ᵀ V

Backward, with dS_{n+1} the gradient of the state leaving chunk n (the final state's for the last):

    dS_n    = Diag(e^{G_L}) dS_{n+1} + Q̃ᵀ dO                          (reverse sequential)
    dA      = dO Vᵀ (j ≤ i),   dV = Aᵀ dO + K̃ dS_{n+1}
    dq_i    = scale Σ_j dA_ij k̂_j ⊙ e^{G_i − G_j} + scale e^{G_i} ⊙ (S_n dO_i)
    dk̂_j    = scale Σ_i dA_ij q_i ⊙ e^{G_i − G_j} + e^{G_L − G_j} ⊙ (dS_{n+1} v_j)
    dk      = β dk̂,   dβ_j = k_j·dk̂_j,   dG_i = q_i ⊙ dq_i − k_i ⊙ dk_i      (summed over d: scalar g)
    ∂L/∂G_L = Σ_v S_{n+1} ⊙ dS_{n+1} = e^{G_L} ⊙ Σ_v S_n ⊙ dS_{n+1} + Σ_j K̃_j ⊙ (dS_{n+1} v_j)   (idem)
    dg_s    = Σ_{i ≥ s} dG_i + ∂L/∂G_L                                (in the chunk, s ≤ its last row)

Kernels (each beside its torch twin: `chunkwise.gated.chunk_gated` for the forward, `chunkwise.gated_bwd`
for the backward stages):

1. `_fwd_kernel`, sequential, grid (⌈V/BV⌉, sequences·H): the state S [K, BV] fp32 in registers across the
   sequence's chunks; per chunk G = tl.cumsum(g) in registers, A recomputed (one [C, K]·[K, C] product per
   V block), o = Q̃ S + A V, then the update. WRITE_O = 0 (the backward's recompute) skips q, A and o and
   writes only the entering states h (`stored_state_dtype`: bf16 for bf16 inputs, as the staged path).
   With `LAUNCH["gated_fused_fwd"]["AQK"] = 1` the scores come instead from `_scores_kernel` (chunk-parallel,
   grid (NT, B·H): A once per chunk, stored in the operand dtype — for bf16 exactly what the forward would cast
   it to — and read by every V block; twin: `chunkwise.common.decayed_scores`): one [C, C] tensor per token row
   written and read, for 1/NV of the QKᵀ work (NV = 4 V blocks at B = 1, T = 32,768, H = 16). Off by default.
   β of chunk c+1 is loaded while chunk c is computed (`LAUNCH["gated_fused_fwd"]["PREFETCH"] = 1`): β's
   strided 2-byte loads are not software-pipelined by Triton (q, k, v and g are, as cp.async), so loaded where
   used each chunk would wait a global-memory round trip on the state's dependency chain.
2. `_bwd_states_kernel`, sequential in reverse, grid (⌈V/BV⌉, sequences·H): dS [K, BV] fp32 in registers;
   writes dh (dS_{n+1} of each chunk, bf16 for bf16 inputs) and dS_0.
3. `_bwd_chunk_kernel`, chunk-parallel, grid (chunk slots NT, B·H), one chunk (all C rows, all K) per
   program looping over the V tiles: dv; dA and dAᵀ, S_n dO and dS_{n+1} v accumulated over V; then dq, dk,
   dβ, dG and — the chunk's rows all in the program — the reverse cumsum of dG plus ∂L/∂G_L, so dg is
   final (no cumsum kernel, no torch sums). Transposed operands are loaded transposed from memory or
   recomputed as their own products (Aᵀ = k̂ qᵀ, dAᵀ = V dOᵀ): no tl.trans of an accumulator.

Exponents. No and scalar decay: every exponent ≤ 0 (differences of chunk-local cumsums in the order that makes
them so, masked entries 0 before the exp). The diagonal decay has no C×C decay matrix; A and the intra-chunk
parts of dq, dk are then one tensor-core product each through the chunk's per-channel mid-range reference ρ,
e^{G_id − G_jd} = e^{G_id − ρ_d} e^{ρ_d − G_jd}, whenever the chunk's widest per-channel decay span
max_d (max_i G_id − min_i G_id) is ≤ SPAN = 60 nats: both factors within e^{±30}, the masked products (j > i,
discarded) within e^{60}, far from fp32's overflow at e^{88.7} (GLA's gates, logsigmoid/16, decay ≈ 3 nats a
chunk of 64). A chunk that decays more on some channel takes the exact path instead — column by column,
elementwise, every exponent ≤ 0 (a run-time branch per chunk; ~10× the fast path's time for that chunk).

Bytes at the anchor (B = 4, T = 4096, H = 16, K = V = 128, C = 64, bf16 q/k/v/dO; one [B, T, H, 128] bf16
tensor = 67 MB, h or dh [B, NT, H, K, V] bf16 = 134 MB, a scalar g fp32 1 MB, GLA's g [B, T, H, K] fp32 134 MB;
floors at 3.0 TB/s; the V blocks' re-reads of q, k and the transposed re-loads counted as L2 hits):

| kernel | reads | writes | MB no/scalar decay | floor µs | MB GLA | floor µs |
|---|---|---|---:|---:|---:|---:|
| forward `_fwd_kernel` | q, k, v, g | o | 269 | 90 | 403 | 134 |
| backward: `_fwd_kernel` (states only, recompute) | k, v, g | h | 269 | 90 | 403 | 134 |
| backward: `_bwd_states_kernel` | q, g, dO | dh | 269 | 90 | 403 | 134 |
| backward: `_bwd_chunk_kernel` | q, k, v, g, dO, h, dh | dq, dk, dv, dg | 739 | 246 | 1,007 | 336 |
| **forward + backward** | | | **1,546** | **515** | **2,216** | **739** |

The staged pipeline moves ≈ 4,931 MB (scalar) and ≈ 6,929 MB (GLA) for the same work (docs/kernels.md: 1.64
and 2.31 ms floors). Keeping h from the forward instead of recomputing it
(`GatedPipeline("fused", recompute_states=False)`) writes 134 MB more in the forward and saves 269 MB (GLA 403)
in the backward, for K·V/C·2 = 512 bytes per token and head of saved memory: off by default (the LM memory
goal), as in the delta class. Tensor-core work as executed
(masked halves included), at the anchor: forward 2.4 MFLOP per (chunk, V block) at BV 32 (QKᵀ 1.05 — recomputed
per V block —, Q̃S, AV, K̃ᵀV: 39 GFLOP), recompute and reverse pass 8.6 GFLOP each, chunk kernel 12.6 MFLOP per
chunk (52 GFLOP): 108 GFLOP, ≈ 0.14 ms at 772 TFLOP/s — under the byte floor, so every kernel is memory- or
latency-bound (the sequential ones: 64 chunks walked per program at the anchor, 512 at T = 32,768).

Every constexpr depends on the head dims, the dtype, the gate kind, the chunk size and the flags (SPAN is a
module constant); T and NT are not specialized, so a varlen call with another packing reuses the compiled
kernels. BV (the sequential kernels' value columns) comes from `value_block`: the heads alone (varlen) or
batch × heads (padded) against a program target, never from T or the packing, and not below
LAUNCH["gated_fused_fwd"]["MIN_BV"] = 32 (`value_block`: call 3 on the H100 failed only in BV 16
specializations; docs/kernel_notes.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import gated_fused_forward
from ..common.layout import Layout
from ..common.limits import GATED_FUSED_MAX_HEAD_DIM_CUDA as FUSED_MAX_HEAD_DIM_CUDA
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
from ..stages.states import stored_state_dtype

#: The diagonal decay's fast path (GLA): a chunk whose per-channel decay spans at most SPAN nats computes its
#: scores and their gradients as tensor-core products through the chunk's mid-range reference ρ (factors within
#: e^{±SPAN/2}, masked products within e^{SPAN}: far from fp32's e^{88}); a chunk that decays more (on any
#: channel) takes the exact elementwise path, every exponent ≤ 0. A constexpr of the kernels.
SPAN = 60.0


@triton.jit
def _scalar_decay(gb, m_t, last, C: tl.constexpr, H: tl.constexpr):
    """(G [C] the chunk-local cumsum of the scalar log-decay, G_L its value at local row `last`); gb points at
    the chunk's first row (and the head)."""
    oc = tl.arange(0, C)
    G = tl.cumsum(tl.load(gb + oc * H, mask=m_t, other=0.0).to(tl.float32), axis=0)
    G_last = tl.sum(tl.where(oc == last, G, 0.0), axis=0)
    return G, G_last


@triton.jit
def _op(x, DT: tl.constexpr, IEEE: tl.constexpr):
    """x as a tensor-core operand of `util.mm`: cast to DT (bf16/fp16 inputs), fp32 kept for fp32 inputs (IEEE 1).
    The same numbers as `mm`'s own cast, with half the registers while the operand waits."""
    if IEEE == 1:
        return x.to(tl.float32)
    else:
        return x.to(DT)


@triton.jit
def _diag_rows(gb, m_t, kk, m_kk, C: tl.constexpr, H: tl.constexpr, K: tl.constexpr):
    """G [C, BK]: the chunk-local cumsum of the diagonal log-decay, rows as loaded (gb: the chunk's first row)."""
    oc = tl.arange(0, C)
    m = m_t[:, None] & m_kk[None, :]
    return tl.cumsum(tl.load(gb + oc[:, None] * (H * K) + kk[None, :], mask=m, other=0.0).to(tl.float32), axis=0)


@triton.jit
def _diag_cols(gb, m_t, last, kk, m_kk, C: tl.constexpr, H: tl.constexpr, K: tl.constexpr):
    """(Gᵀ [BK, C]: the cumsum of the transposed load, G_L [BK]: its column at local row `last`)."""
    oc = tl.arange(0, C)
    m = m_kk[:, None] & m_t[None, :]
    Gt = tl.cumsum(tl.load(gb + oc[None, :] * (H * K) + kk[:, None], mask=m, other=0.0).to(tl.float32), axis=1)
    return Gt, tl.sum(tl.where(oc[None, :] == last, Gt, 0.0), axis=1)


@triton.jit
def _reference(G):
    """(ρ [BK] the mid-range of G [C, BK] per channel, the chunk's widest per-channel span max_d (max_i G − min_i G)).
    With span ≤ SPAN, e^{G_id − G_jd} = e^{G_id − ρ_d} e^{ρ_d − G_jd} with both factors in [e^{−SPAN/2}, e^{SPAN/2}]:
    the diagonal-decay scores as one tensor-core product (`_diag_scores`)."""
    hi = tl.max(G, axis=0)
    lo = tl.min(G, axis=0)
    return (hi + lo) * 0.5, tl.max(hi - lo, axis=0)


@triton.jit
def _diag_scores(b_q, b_kht, G, Gt, scale, C: tl.constexpr, SPAN: tl.constexpr, DT: tl.constexpr,
                 IEEE: tl.constexpr):
    """A_ij = scale Σ_d q_id k̂_jd e^{G_id − G_jd} (j ≤ i, else 0), fp32 [C, C]; b_q [C, BK] raw, b_kht = K̂ᵀ [BK, C]
    fp32. Span ≤ SPAN (`_reference`): (scale Q ⊙ e^{G − ρ})(K̂ᵀ ⊙ e^{ρ − Gᵀ}), one product. Otherwise (a decay of more
    than SPAN nats inside the chunk on some channel) exactly, column by column: every exponent ≤ 0."""
    oc = tl.arange(0, C)
    rho, span = _reference(G)
    if span <= SPAN:
        b_qa = _op(b_q.to(tl.float32) * scale * tl.exp(G - rho[None, :]), DT, IEEE)
        b_ka = _op(b_kht * tl.exp(rho[:, None] - Gt), DT, IEEE)
        b_A = mm(b_qa, b_ka, DT, IEEE)
    else:
        b_A = tl.zeros([C, C], dtype=tl.float32)
        b_qs = b_q.to(tl.float32) * scale
        for j in range(0, C):
            k_j = tl.sum(tl.where(oc[None, :] == j, b_kht, 0.0), axis=1)  # [BK]
            G_j = tl.sum(tl.where(oc[:, None] == j, G, 0.0), axis=0)  # [BK]
            e = tl.exp(tl.where((oc >= j)[:, None], G - G_j[None, :], 0.0))  # exponent ≤ 0 on the mask
            col = tl.sum(b_qs * k_j[None, :] * e, axis=1)  # [C]
            b_A = tl.where(oc[None, :] == j, col[:, None], b_A)
    return tl.where(oc[:, None] >= oc[None, :], b_A, 0.0)


@triton.jit(do_not_specialize=["T", "NT"])
def _fwd_kernel(q, k, v, g, beta, h0, A, o, h, ht, cu, offsets, scale, T, NT, H: tl.constexpr, HQ: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                GATE: tl.constexpr, HAS_BETA: tl.constexpr, HAS_H0: tl.constexpr, WRITE_O: tl.constexpr,
                A_IN: tl.constexpr, STORE_STATES: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                SPAN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr):
    # GATE 0 none, 1 scalar [B, T, H], 2 diagonal [B, T, H, K]; WRITE_O 0: the states only (h, the final state);
    # A_IN: the scores A from `_scores_kernel` (as this kernel would compute them, already in the operand dtype);
    # PREFETCH: β of chunk c+1 loaded while chunk c is computed (β's strided 2-byte loads are not pipelined by
    # Triton's cp.async pipeliner: loaded where used, each chunk would wait one global-memory latency for it)
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
    # tile offsets from the chunk's first row (int32; the row's int64 offset goes into a scalar base pointer)
    off_q = oc[:, None] * (HQ * K) + kk[None, :]  # [C, BK]
    off_kt = oc[None, :] * (HQ * K) + kk[:, None]  # [BK, C]
    off_v = oc[:, None] * (H * V) + vv[None, :]  # [C, BV]
    GK: tl.constexpr = K if GATE == 2 else 1
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_s.to(tl.int64) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    if HAS_BETA and PREFETCH:
        b_beta_nx = tl.load(beta + bos * H + i_h + oc * H, mask=oc < eos - bos, other=0.0)  # the first chunk's β
    for c in range(0, n_chunks):  # a for loop: software-pipelined on the GPU
        if STORE_STATES:
            tl.store(h + ((slot0 + c) * H + i_h) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        r0 = bos + c * C  # the chunk's first row
        m_t = oc < eos - r0
        gb = g + (r0 * H + i_h) * GK
        last = (tl.minimum(bos + c * C + C, eos) - 1 - bos - c * C).to(tl.int32)  # the last real row
        if HAS_BETA:
            if PREFETCH:  # this chunk's β (loaded one chunk ago), then the next chunk's (all masked after the last)
                b_beta = b_beta_nx.to(tl.float32)  # [C]
                b_beta_nx = tl.load(beta + (r0 + C) * H + i_h + oc * H, mask=oc < eos - r0 - C, other=0.0)
            else:
                b_beta = tl.load(beta + r0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32)  # [C]
        # operands are cast to the tensor cores' dtype as soon as they are formed (register room: S, A and
        # the [C, K] tiles of one chunk are live together); the products accumulate in fp32
        b_kt = tl.load(k + (r0 * HQ + i_hq) * K + off_kt, mask=m_kk[:, None] & m_t[None, :],
                       other=0.0)  # [BK, C] in k's dtype
        vb = (r0 * H + i_h) * V
        b_v = tl.load(v + vb + off_v, mask=m_t[:, None] & m_vv[None, :], other=0.0)  # [C, BV]
        if GATE == 1:
            G, G_last = _scalar_decay(gb, m_t, last, C, H)
        elif GATE == 2:
            Gt, G_last = _diag_cols(gb, m_t, last, kk, m_kk, C, H, K)
        if WRITE_O:
            b_q = tl.load(q + (r0 * HQ + i_hq) * K + off_q, mask=m_t[:, None] & m_kk[None, :], other=0.0)  # [C, BK]
        if WRITE_O and A_IN:
            if GATE == 2:
                b_qd = _op(b_q.to(tl.float32) * scale * tl.exp(_diag_rows(gb, m_t, kk, m_kk, C, H, K)), DT, IEEE)
            elif GATE == 1:
                b_qd = _op(b_q.to(tl.float32) * (scale * tl.exp(G))[:, None], DT, IEEE)
            else:
                b_qd = _op(b_q.to(tl.float32) * scale, DT, IEEE)
            b_A = _op(tl.load(A + (r0 * H + i_h) * C + oc[:, None] * (H * C) + oc[None, :], mask=m_t[:, None],
                              other=0.0), DT, IEEE)
            b_o = mm(b_qd, S, DT, IEEE) + mm(b_A, b_v, DT, IEEE)
            tl.store(o + vb + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_vv[None, :])
        elif WRITE_O and GATE == 2:
            G = _diag_rows(gb, m_t, kk, m_kk, C, H, K)
            if HAS_BETA:
                b_kht = b_kt.to(tl.float32) * b_beta[None, :]
            else:
                b_kht = b_kt.to(tl.float32)
            b_A = _op(_diag_scores(b_q, b_kht, G, Gt, scale, C, SPAN, DT, IEEE), DT, IEEE)
            b_qd = _op(b_q.to(tl.float32) * scale * tl.exp(G), DT, IEEE)  # Q̃ = scale q ⊙ e^{G}
            b_o = mm(b_qd, S, DT, IEEE) + mm(b_A, b_v, DT, IEEE)
            tl.store(o + vb + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_vv[None, :])
        elif WRITE_O:
            if HAS_BETA:
                b_kh = _op(b_kt.to(tl.float32) * b_beta[None, :], DT, IEEE)  # K̂ᵀ
            else:
                b_kh = b_kt
            b_A = mm(_op(b_q.to(tl.float32) * scale, DT, IEEE), b_kh, DT, IEEE)  # scale Q K̂ᵀ  [C, C]
            if GATE == 1:
                b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))  # exponent ≤ 0
                b_qd = _op(b_q.to(tl.float32) * (scale * tl.exp(G))[:, None], DT, IEEE)  # Q̃
            else:
                b_qd = _op(b_q.to(tl.float32) * scale, DT, IEEE)
            b_A = _op(tl.where(causal, b_A, 0.0), DT, IEEE)
            b_o = mm(b_qd, S, DT, IEEE) + mm(b_A, b_v, DT, IEEE)
            tl.store(o + vb + off_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_vv[None, :])
        # K̃ᵀ = K̂ᵀ ⊙ e^{G_L − G}
        if GATE == 1:
            e_k = tl.exp(tl.where(m_t, G_last - G, 0.0))
            if HAS_BETA:
                e_k = e_k * b_beta
            b_kd = _op(b_kt.to(tl.float32) * e_k[None, :], DT, IEEE)
            S = S * tl.exp(G_last)
        elif GATE == 2:
            e_k = tl.exp(tl.where(m_t[None, :], G_last[:, None] - Gt, 0.0))  # [BK, C], exponent ≤ 0
            if HAS_BETA:
                e_k = e_k * b_beta[None, :]
            b_kd = _op(b_kt.to(tl.float32) * e_k, DT, IEEE)
            S = S * tl.exp(G_last)[:, None]
        elif HAS_BETA:
            b_kd = _op(b_kt.to(tl.float32) * b_beta[None, :], DT, IEEE)
        else:
            b_kd = b_kt
        S += mm(b_kd, b_v, DT, IEEE)
    if STORE_FINAL:
        tl.store(ht + (i_s.to(tl.int64) * H + i_h) * K * V + kv, S, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def _scores_kernel(q, k, g, beta, A, cu, chunk_seq, chunk_local, scale, T, H: tl.constexpr, HQ: tl.constexpr,
                   K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr,
                   IS_VARLEN: tl.constexpr, SPAN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    """A [C, C] of one chunk (the forward kernel's scores, the same operations), stored in the operand dtype
    (`_op`: what the forward kernel casts them to before A V), for `_fwd_kernel(A_IN=True)`: computed once per
    chunk instead of once per chunk and V block. Grid (chunk slots NT, B·H)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    oc = tl.arange(0, C)
    kk = tl.arange(0, BK)
    m_t = oc < eos - t0
    m_kk = kk < K
    causal = oc[:, None] >= oc[None, :]
    last = (tl.minimum(t0 + C, eos) - 1 - t0).to(tl.int32)
    GK: tl.constexpr = K if GATE == 2 else 1
    gb = g + (t0 * H + i_h) * GK
    b_q = tl.load(q + (t0 * HQ + i_hq) * K + oc[:, None] * (HQ * K) + kk[None, :], mask=m_t[:, None] & m_kk[None, :],
                  other=0.0)  # [C, BK]
    b_kht = tl.load(k + (t0 * HQ + i_hq) * K + oc[None, :] * (HQ * K) + kk[:, None],
                    mask=m_kk[:, None] & m_t[None, :], other=0.0).to(tl.float32)  # [BK, C]
    if HAS_BETA:
        b_kht = b_kht * tl.load(beta + t0 * H + i_h + oc * H, mask=m_t, other=0.0).to(tl.float32)[None, :]
    if GATE == 2:
        G = _diag_rows(gb, m_t, kk, m_kk, C, H, K)
        Gt, _ = _diag_cols(gb, m_t, last, kk, m_kk, C, H, K)
        b_A = _diag_scores(b_q, b_kht, G, Gt, scale, C, SPAN, DT, IEEE)
    else:
        b_A = mm(_op(b_q.to(tl.float32) * scale, DT, IEEE), _op(b_kht, DT, IEEE), DT, IEEE)
        if GATE == 1:
            G, _ = _scalar_decay(gb, m_t, last, C, H)
            b_A = b_A * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
        b_A = tl.where(causal, b_A, 0.0)
    tl.store(A + (t0 * H + i_h) * C + oc[:, None] * (H * C) + oc[None, :], _op(b_A, DT, IEEE).to(A.dtype.element_ty),
             mask=m_t[:, None])


@triton.jit(do_not_specialize=["T", "NT"])
def _bwd_states_kernel(q, g, do, dht, dh, dh0, cu, offsets, scale, T, NT, H: tl.constexpr, HQ: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DT: tl.constexpr, IEEE: tl.constexpr):
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
    fin = (i_s.to(tl.int64) * H + i_h) * K * V
    off_qt = oc[None, :] * (HQ * K) + kk[:, None]  # [BK, C]
    off_v = oc[:, None] * (H * V) + vv[None, :]  # [C, BV]
    GK: tl.constexpr = K if GATE == 2 else 1
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + fin + kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_c in range(0, n_chunks):  # last chunk first (a for loop: pipelined)
        c = n_chunks - 1 - i_c
        tl.store(dh + ((slot0 + c) * H + i_h) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        r0 = bos + c * C
        m_t = oc < eos - r0
        gb = g + (r0 * H + i_h) * GK
        last = (tl.minimum(bos + c * C + C, eos) - 1 - bos - c * C).to(tl.int32)
        b_qt = tl.load(q + (r0 * HQ + i_hq) * K + off_qt, mask=m_kk[:, None] & m_t[None, :],
                       other=0.0).to(tl.float32) * scale  # [BK, C]
        b_do = tl.load(do + (r0 * H + i_h) * V + off_v, mask=m_t[:, None] & m_vv[None, :], other=0.0)  # [C, BV]
        if GATE == 1:
            G, G_last = _scalar_decay(gb, m_t, last, C, H)
            b_qt = b_qt * tl.exp(tl.where(m_t, G, 0.0))[None, :]
            dS = dS * tl.exp(G_last)
        elif GATE == 2:
            Gt, G_last = _diag_cols(gb, m_t, last, kk, m_kk, C, H, K)
            b_qt = b_qt * tl.exp(tl.where(m_t[None, :], Gt, 0.0))
            dS = dS * tl.exp(G_last)[:, None]
        dS += mm(b_qt, b_do, DT, IEEE)
    if HAS_H0:
        tl.store(dh0 + fin + kv, dS, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT"])
def _bwd_chunk_kernel(q, k, v, g, beta, h, dh, do, dq, dk, dv, dg, dbeta, cu, chunk_seq, chunk_local, scale, T, NT,
                      H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_BETA: tl.constexpr,
                      IS_VARLEN: tl.constexpr, SPAN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    oc = tl.arange(0, C)
    kk = tl.arange(0, BK)
    m_t = oc < eos - t0
    m_kk = kk < K
    m_tk = m_t[:, None] & m_kk[None, :]
    m_kt = m_kk[:, None] & m_t[None, :]
    last = (tl.minimum(t0 + C, eos) - 1 - t0).to(tl.int32)  # −1 for an unused varlen slot (nothing stored)
    # base pointers at the chunk's first row (int64), tile offsets int32
    q = q + (t0 * HQ + i_hq) * K
    k = k + (t0 * HQ + i_hq) * K
    v = v + (t0 * H + i_h) * V
    do = do + (t0 * H + i_h) * V
    dv = dv + (t0 * H + i_h) * V
    dq = dq + (t0 * H + i_h) * K
    dk = dk + (t0 * H + i_h) * K
    beta = beta + t0 * H + i_h
    dbeta = dbeta + t0 * H + i_h
    GK: tl.constexpr = K if GATE == 2 else 1
    gb = g + (t0 * H + i_h) * GK
    dg = dg + (t0 * H + i_h) * GK
    off_qk = oc[:, None] * (HQ * K) + kk[None, :]  # [C, BK]
    off_qkt = oc[None, :] * (HQ * K) + kk[:, None]  # [BK, C]
    causal = oc[:, None] >= oc[None, :]  # [i, j]: j ≤ i
    causal_t = oc[:, None] <= oc[None, :]  # [j, i]: j ≤ i
    if HAS_BETA:
        b_beta = tl.load(beta + oc * H, mask=m_t, other=0.0).to(tl.float32)  # [C]
    # Aᵀ[j, i] = scale k̂_j·q_i e^{G_i − G_j} (j ≤ i), and K̃ = k̂ ⊙ e^{G_L − G} (tensor-core operands: _op)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)  # [C, BK]
    if HAS_BETA:
        b_khf = b_k.to(tl.float32) * b_beta[:, None]
    else:
        b_khf = b_k.to(tl.float32)
    if GATE == 2:
        G = _diag_rows(gb, m_t, kk, m_kk, C, H, K)  # [C, BK]
        G_last = tl.sum(tl.where(oc[:, None] == last, G, 0.0), axis=0)  # [BK]
        b_kd = _op(b_khf * tl.exp(tl.where(m_tk, G_last[None, :] - G, 0.0)), DT, IEEE)
        rho, span = _reference(G)
        if span <= SPAN:  # one product through the chunk's reference ρ (see _diag_scores)
            Gt, _ = _diag_cols(gb, m_t, last, kk, m_kk, C, H, K)
            b_qa_t = tl.load(q + off_qkt, mask=m_kt, other=0.0).to(tl.float32) * scale * tl.exp(Gt - rho[:, None])
            b_At = mm(_op(b_khf * tl.exp(rho[None, :] - G), DT, IEEE), _op(b_qa_t, DT, IEEE), DT, IEEE)
        else:  # exactly, query column by query column (every exponent ≤ 0)
            b_At = tl.zeros([C, C], dtype=tl.float32)
            for r in range(0, C):
                q_r = tl.load(q + r * (HQ * K) + kk, mask=m_kk & (t0 + r < eos), other=0.0)
                G_r = tl.sum(tl.where(oc[:, None] == r, G, 0.0), axis=0)  # [BK]
                e = tl.exp(tl.where((oc <= r)[:, None], G_r[None, :] - G, 0.0))
                col = tl.sum(b_khf * q_r.to(tl.float32)[None, :] * e, axis=1) * scale  # [C]
                b_At = tl.where(oc[None, :] == r, col[:, None], b_At)
    else:
        if GATE == 1:
            G, G_last = _scalar_decay(gb, m_t, last, C, H)
            e_k = tl.exp(tl.where(m_t, G_last - G, 0.0))  # e^{G_L − G_j}  [C]
        b_kh = _op(b_khf, DT, IEEE)
        b_qt = _op(tl.load(q + off_qkt, mask=m_kt, other=0.0).to(tl.float32) * scale, DT, IEEE)  # [BK, C]
        b_At = mm(b_kh, b_qt, DT, IEEE)  # [C(j), C(i)]
        if GATE == 1:
            b_At = b_At * tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0))
            b_kd = _op(b_khf * e_k[:, None], DT, IEEE)
        else:
            b_kd = b_kh
    b_At = _op(tl.where(causal_t, b_At, 0.0), DT, IEEE)
    # over the V tiles: dv; dA = dO Vᵀ, dAᵀ = V dOᵀ; S_n dO_i and dS_{n+1} v_j (as rows [C, BK]); ⟨S_n, dS_{n+1}⟩
    b_dA = tl.zeros([C, C], dtype=tl.float32)
    b_dAt = tl.zeros([C, C], dtype=tl.float32)
    b_sq = tl.zeros([C, BK], dtype=tl.float32)
    b_sk = tl.zeros([C, BK], dtype=tl.float32)
    b_ss = tl.zeros([BK], dtype=tl.float32)
    state = (slot * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m_vv = vv < V
        m_tv = m_t[:, None] & m_vv[None, :]
        m_vt = m_vv[:, None] & m_t[None, :]
        m_vk = m_vv[:, None] & m_kk[None, :]
        off_tv = oc[:, None] * (H * V) + vv[None, :]  # [C, BV]
        off_vt = oc[None, :] * (H * V) + vv[:, None]  # [BV, C]
        b_do = tl.load(do + off_tv, mask=m_tv, other=0.0)
        b_v = tl.load(v + off_tv, mask=m_tv, other=0.0)
        b_dot = tl.load(do + off_vt, mask=m_vt, other=0.0)
        b_vt = tl.load(v + off_vt, mask=m_vt, other=0.0)
        st = state + kk[None, :] * V + vv[:, None]  # [BV, BK] transposed state offsets
        b_St = tl.load(h + st, mask=m_vk, other=0.0)  # S_nᵀ
        b_dSt = tl.load(dh + st, mask=m_vk, other=0.0)  # dS_{n+1}ᵀ
        b_dS = tl.load(dh + state + kk[:, None] * V + vv[None, :], mask=m_kk[:, None] & m_vv[None, :],
                       other=0.0)  # [BK, BV]
        b_dA += mm(b_do, b_vt, DT, IEEE)
        b_dAt += mm(b_v, b_dot, DT, IEEE)
        b_sq += mm(b_do, b_St, DT, IEEE)
        b_sk += mm(b_v, b_dSt, DT, IEEE)
        b_ss += tl.sum(b_St.to(tl.float32) * b_dSt.to(tl.float32), axis=0)
        b_dv = mm(b_At, b_do, DT, IEEE) + mm(b_kd, b_dS, DT, IEEE)
        tl.store(dv + off_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
    # dq_i = scale Σ_j dA_ij e^{G_i − G_j} k̂_j + scale e^{G_i} (S_n dO_i)
    # dk̂_j = scale Σ_i dA_ij e^{G_i − G_j} q_i + e^{G_L − G_j} (dS_{n+1} v_j)
    b_dA = tl.where(causal, b_dA, 0.0) * scale
    b_dAt = tl.where(causal_t, b_dAt, 0.0) * scale
    # q, k (and k̂, K̃, G) loaded or rebuilt again here rather than kept live across the V loop (registers)
    b_q = tl.load(q + off_qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0.0)
    if HAS_BETA:
        b_khf = b_k.to(tl.float32) * b_beta[:, None]
    else:
        b_khf = b_k.to(tl.float32)
    # ∂L/∂G_L = e^{G_L}⟨S_n, dS_{n+1}⟩ + Σ_j K̃_j·(dS_{n+1} v_j) (per channel with the diagonal decay), and the
    # inter-chunk parts of dq, dk̂ first (their accumulators then die)
    if GATE == 2:
        G = _diag_rows(gb, m_t, kk, m_kk, C, H, K)
        e_k = tl.exp(tl.where(m_tk, G_last[None, :] - G, 0.0))  # [C, BK]
        d_last = tl.exp(G_last) * b_ss + tl.sum(_op(b_khf * e_k, DT, IEEE).to(tl.float32) * b_sk, axis=0)  # [BK]
        b_dq = b_sq * (scale * tl.exp(G))
        b_dkh = b_sk * e_k
        rho, span = _reference(G)
        if span <= SPAN:
            b_dq += mm(_op(b_dA, DT, IEEE), _op(b_khf * tl.exp(rho[None, :] - G), DT, IEEE), DT, IEEE) \
                * tl.exp(G - rho[None, :])
            b_dkh += mm(_op(b_dAt, DT, IEEE), _op(b_q.to(tl.float32) * tl.exp(G - rho[None, :]), DT, IEEE), DT,
                        IEEE) * tl.exp(rho[None, :] - G)
        else:  # exactly, row by row (every exponent ≤ 0)
            b_qf = b_q.to(tl.float32)
            for r in range(0, C):
                G_r = tl.sum(tl.where(oc[:, None] == r, G, 0.0), axis=0)  # [BK]
                dA_row = tl.sum(tl.where(oc[:, None] == r, b_dA, 0.0), axis=0)  # dA_rj over j  [C]
                dA_col = tl.sum(tl.where(oc[None, :] == r, b_dA, 0.0), axis=1)  # dA_ir over i  [C]
                row_q = tl.sum(dA_row[:, None] * b_khf * tl.exp(tl.where((oc <= r)[:, None], G_r[None, :] - G, 0.0)),
                               axis=0)
                row_k = tl.sum(dA_col[:, None] * b_qf * tl.exp(tl.where((oc >= r)[:, None], G - G_r[None, :], 0.0)),
                               axis=0)
                b_dq += tl.where(oc[:, None] == r, row_q[None, :], 0.0)
                b_dkh += tl.where(oc[:, None] == r, row_k[None, :], 0.0)
    else:
        b_kh = _op(b_khf, DT, IEEE)
        if GATE == 1:
            d_last = tl.exp(G_last) * tl.sum(b_ss, axis=0) + tl.sum(
                tl.sum(_op(b_khf * e_k[:, None], DT, IEEE).to(tl.float32) * b_sk, axis=1), axis=0)
            b_dA = b_dA * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
            b_dAt = b_dAt * tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0))
            b_dq = b_sq * (scale * tl.exp(tl.where(m_t, G, 0.0)))[:, None]
            b_dkh = b_sk * e_k[:, None]
        else:
            b_dq = b_sq * scale
            b_dkh = b_sk
        b_dq += mm(_op(b_dA, DT, IEEE), b_kh, DT, IEEE)
        b_dkh += mm(_op(b_dAt, DT, IEEE), b_q, DT, IEEE)
    if HAS_BETA:
        b_dk = b_dkh * b_beta[:, None]
        tl.store(dbeta + oc * H, tl.sum(b_k.to(tl.float32) * b_dkh, axis=1), mask=m_t)
    else:
        b_dk = b_dkh
    off = oc[:, None] * (H * K) + kk[None, :]
    tl.store(dq + off, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    # dg_s = Σ_{i ≥ s} (q_i·dq_i − k_i·dk_i) + ∂L/∂G_L
    if GATE == 1:
        b_dG = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, axis=1)  # [C]
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + d_last
        tl.store(dg + oc * H, b_dg.to(dg.dtype.element_ty), mask=m_t)
    elif GATE == 2:
        b_dG = b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk  # [C, BK]
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + d_last[None, :]
        tl.store(dg + off, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def value_block(L: Layout) -> int:
    """BV of the sequential kernels: the widest power of two ≤ LAUNCH["gated_fused_fwd"]["BV"] (≤ 32 for
    K > 128: the [K, BV] fp32 state tile's registers) whose grid has at least LAUNCH[...]["PROGRAMS"]
    programs, counting the grid's rows as B·H (padded) or H (varlen: never the packing, so a new packing
    never compiles a new BV), halving down to LAUNCH[...]["MIN_BV"] (or to the V tile, if narrower).

    MIN_BV is 32: every failure of the H100's call 3 (the illegal memory access at B1 T32768 H16 D128 and the
    wrong or NaN outputs at K = V = 256) came from a BV 16 specialization of the forward (wgmma N = 16 on 32-byte
    swizzled operand rows); BV 16 stays a launch choice (MIN_BV = 16), checked by scripts/gpu_gated_fused.py in
    subprocesses. In the latency-bound regime where the rule would pick 16 (B·H ≤ 32) a BV 32 program walks the
    same chain of chunks, with half as many QKᵀ recomputations in all."""
    cap = tile("gated_fused_fwd", "BV")
    bv = min(cap if L.K <= 128 else min(cap, 32), pow2(L.V))
    rows = L.H if L.varlen else L.B * L.H
    target = tile("gated_fused_fwd", "PROGRAMS")
    floor = tile("gated_fused_fwd", "MIN_BV")
    while bv > floor and rows * triton.cdiv(L.V, bv) < target:
        bv //= 2
    return bv


def fused_programs(L: Layout) -> dict:
    """The launch grids at layout L: {"sequential": programs of the forward and reverse passes, "chunk":
    programs of the backward's chunk kernel, "BV": the sequential kernels' value block} (the GPU script's
    report)."""
    bv = value_block(L)
    return {"sequential": L.NS * L.H * triton.cdiv(L.V, bv), "chunk": L.NT * L.B * L.H, "BV": bv}


def _gate(g) -> int:
    return 0 if g is None else (2 if g.dim() == 4 else 1)


def forward(q, k, v, g, beta, h0, scale: float, L: Layout, *, write_o: bool = True, store_states: bool = False,
            output_final_state: bool = False):
    """One run of `_fwd_kernel` (after `_scores_kernel` with LAUNCH AQK = 1 and `write_o`). q, k [B, T, H_q, K],
    v [B, T, H, V] (one dtype), g None or the raw log-decay [B, T, H] (scalar) or [B, T, H, K] (diagonal; the
    kernels take its chunk-local cumsum), β None or [B, T, H], h0 None or [NS, H, K, V] fp32. Returns (o
    [B, T, H, V] in v's dtype or None (`write_o`), h [B, NT, H, K, V] in `stored_state_dtype` or None
    (`store_states`), the final state [NS, H, K, V] fp32 or None)."""
    if k.is_cuda and max(L.K, L.V) > FUSED_MAX_HEAD_DIM_CUDA:
        raise InputError(f"the fused gated-linear pipeline takes K, V ≤ {FUSED_MAX_HEAD_DIM_CUDA} on a GPU, got "
                         f"K={L.K}, V={L.V} (not yet checked on the H100: scripts/gpu_gated_fused.py); the staged "
                         "pipeline serves these head dims (kernels.pipelines.gated_pipeline routes them there)")
    dev = k.device
    DT, IEEE = dot_dtype(k.dtype)
    cu, _, _, offsets = varlen_args(L, dev)
    BV = value_block(L)
    A = None
    chosen = gated_fused_forward(table())  # the variants (`kernels.variants`): the branch that names them
    if write_o and chosen.scores_kernel:  # the scores once per chunk (`_scores_kernel`)
        A = empty_output(L.B, L.T, L.H, L.C, dtype=k.dtype, device=dev)
        _scores_kernel[(L.NT, L.B * L.H)](
            q, k, g if g is not None else k, beta if beta is not None else k, A, *varlen_args(L, dev)[:3], scale,
            L.T, H=L.H, HQ=L.Hq, K=L.K, C=L.C, BK=pow2(L.K), GATE=_gate(g), HAS_BETA=beta is not None,
            IS_VARLEN=L.varlen, SPAN=SPAN, DT=DT, IEEE=IEEE, **launch("gated_fused_scores"))
    kw = state_pass_launch("gated_fused_fwd", k.dtype, L.K)
    if write_o and _gate(g) == 2:  # the diagonal decay's scores: more live tiles (docs: sm_90 spills at 4 warps)
        kw["num_warps"] = tile("gated_fused_fwd", "WARPS_DIAG")
    o = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev) if write_o else None
    h = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=stored_state_dtype(k.dtype), device=dev) if store_states \
        else None
    ht = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if output_final_state else None
    _fwd_kernel[(triton.cdiv(L.V, BV), L.NS * L.H)](
        q, k, v, g if g is not None else k, beta if beta is not None else k, h0 if h0 is not None else k,
        A if A is not None else k, o if o is not None else v, h if h is not None else v, ht if ht is not None else v,
        cu, offsets, scale,
        L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=pow2(L.K), BV=BV, GATE=_gate(g),
        HAS_BETA=beta is not None, HAS_H0=h0 is not None, WRITE_O=write_o, A_IN=A is not None,
        STORE_STATES=store_states, STORE_FINAL=output_final_state, IS_VARLEN=L.varlen, SPAN=SPAN, DT=DT, IEEE=IEEE,
        PREFETCH=chosen.prefetch, **kw)
    return o, h, ht


def states_bwd(q, g, do, dht, scale: float, L: Layout, *, need_dh0: bool):
    """`_bwd_states_kernel`: (dh [B, NT, H, K, V] in `stored_state_dtype`: the gradient of the state leaving
    each chunk slot, dh0 [NS, H, K, V] fp32 or None). dht None or [NS, H, K, V] (the final state's gradient)."""
    dev = q.device
    DT, IEEE = dot_dtype(q.dtype)
    cu, _, _, offsets = varlen_args(L, dev)
    BV = value_block(L)
    dh = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=stored_state_dtype(q.dtype), device=dev)
    dh0 = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if need_dh0 else None
    _bwd_states_kernel[(triton.cdiv(L.V, BV), L.NS * L.H)](
        q, g if g is not None else q, do, dht if dht is not None else dh, dh, dh0 if dh0 is not None else dh, cu,
        offsets, scale, L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=pow2(L.K), BV=BV, GATE=_gate(g),
        HAS_DHT=dht is not None, HAS_H0=need_dh0, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
        **state_pass_launch("gated_fused_bwd_states", q.dtype, L.K))
    return dh, dh0


def _chunk_bv(L: Layout, dtype) -> int:
    """The chunk kernel's V tile: LAUNCH["gated_fused_bwd_chunk"]["BV"], at most 32 for fp32 inputs (their
    fp32 operand tiles staged in shared memory: 213–246 KB at BV 64, K = 128 on sm_90, over the H100's 227 KB)."""
    bv = min(tile("gated_fused_bwd_chunk", "BV"), pow2(L.V))
    return min(bv, 32) if dtype == torch.float32 else bv


def chunk_bwd(q, k, v, g, beta, h, dh, do, scale: float, L: Layout, *, grad_dtype=None):
    """`_bwd_chunk_kernel`: (dq, dk [B, T, H, K] per value head in `grad_dtype` (default q's dtype without
    grouped heads, fp32 with them, for the sum over each group), dv [B, T, H, V] in v's dtype, dg like g
    (fp32, the final gradient of the raw log-decay) or None, dβ [B, T, H] fp32 or None)."""
    dev = q.device
    DT, IEEE = dot_dtype(q.dtype)
    gdt = grad_dtype if grad_dtype is not None else (q.dtype if L.H == L.Hq else torch.float32)
    dq = empty_output(L.B, L.T, L.H, L.K, dtype=gdt, device=dev)
    dk = empty_output(L.B, L.T, L.H, L.K, dtype=gdt, device=dev)
    dv = empty_output(L.B, L.T, L.H, L.V, dtype=v.dtype, device=dev)
    dg = empty_output(*g.shape, dtype=torch.float32, device=dev) if g is not None else None
    dbeta = empty_output(L.B, L.T, L.H, dtype=torch.float32, device=dev) if beta is not None else None
    _bwd_chunk_kernel[(L.NT, L.B * L.H)](
        q, k, v, g if g is not None else q, beta if beta is not None else q, h, dh, do, dq, dk, dv,
        dg if dg is not None else dq, dbeta if dbeta is not None else dq, *varlen_args(L, dev)[:3], scale, L.T, L.NT,
        H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=pow2(L.K), BV=_chunk_bv(L, q.dtype),
        GATE=_gate(g), HAS_BETA=beta is not None, IS_VARLEN=L.varlen, SPAN=SPAN, DT=DT, IEEE=IEEE,
        **launch("gated_fused_bwd_chunk"))
    return dq, dk, dv, dg, dbeta


class ChunkGatedFused(torch.autograd.Function):
    """The fused pipeline as one autograd node (the twin of `gated.ChunkGatedTriton`: same arguments and
    results, and `recompute_states`). Saved: the inputs, and h only with recompute_states False: the backward
    recomputes the entering states h (one states-only run of the forward kernel) instead of the forward keeping
    them — −K·V/C elements per token and head of saved memory (512 bytes in bf16 at K = V = 128, C = 64) for 134 MB
    more traffic at the anchor; the gradients are bitwise the same."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, L, output_final_state, recompute_states=True):
        keep = not recompute_states and any(ctx.needs_input_grad)
        o, h, ht = forward(q, k, v, g, beta, h0, scale, L, store_states=keep, output_final_state=output_final_state)
        ctx.save_for_backward(q, k, v, g, beta, h0, h)
        ctx.scale, ctx.L, ctx.output_final_state = scale, L, output_final_state
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, h = ctx.saved_tensors
        scale, L = ctx.scale, ctx.L
        do = do.contiguous()
        if h is None:  # recompute_states: the entering states from one states-only run of the forward kernel
            _, h, _ = forward(q, k, v, g, beta, h0, scale, L, write_o=False, store_states=True)
        dht = dht.contiguous() if (dht is not None and ctx.output_final_state) else None
        dh, dh0 = states_bwd(q, g, do, dht, scale, L, need_dh0=h0 is not None)
        dq, dk, dv, dg, dbeta = chunk_bwd(q, k, v, g, beta, h, dh, do, scale, L)
        if L.H != L.Hq:  # grouped heads: each q/k head's gradient is the sum over its value heads
            dq = dq.view(L.B, L.T, L.Hq, L.H // L.Hq, L.K).sum(3)
            dk = dk.view(L.B, L.T, L.Hq, L.H // L.Hq, L.K).sum(3)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype) if g is not None else None,
                dbeta.to(beta.dtype) if beta is not None else None, dh0, None, None, None, None)
