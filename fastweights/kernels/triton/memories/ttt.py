"""TTT-Linear's inner mini-batch loop (`chunkwise.minibatch` for the recipe `ttt_linear`) in Triton: a sequential
program per (sequence, value head) each way for the recurrence through the anchors, and the read of the queries (and its
gradients) in parallel over the mini-batches.

The memory (Sun et al. 2024): a linear map with an inner bias inside a residual LayerNorm over the
value dim D (K = V = D), M(x) = x + γ ⊙ LN(x W + b) + β_ln (γ, β_ln [H, D]: outer parameters, not
trained by the inner loop); inner loss ½‖M(k) − v‖², mini-batches of b tokens aligned to the sequence
start, TTT's averaged gd: within a mini-batch every gradient is taken at its start (the anchor A, a)
and the weights at its i-th token are

    W_i = A + P_i / i,   P_i = P_0 − Σ_{j ≤ i} η_j k_jᵀ e_j,   b_i = a + p_i / i,   p_i = p_0 − Σ_{j ≤ i} η_j e_j

(η the per-token inner learning rate, the call's β; e_j = ∂ℓ_j/∂f at the anchor, f = k_j A + a;
P_0 = o (W_s − A) carries the o tokens of the mini-batch consumed before this call; 0 otherwise). The
per-token error e (rows [b, D] of one mini-batch):

    f = K A + a,  n = LN(f),  s = 1/σ(f),  dy = (K + β_ln − V) + γ ⊙ n,  u = γ ⊙ dy
    e = s ⊙ (u − mean(u) − n ⊙ mean(u ⊙ n))                                  (LayerNorm's backward)

and the read at the queries x = scale·q, in the dual form (no per-token W is formed):

    z_t = x_t A + a + (x_t P_0 + p_0) / i_t − Σ_{j ≤ t} M_tj e_j,   M_tj = η_j (x_t · k_j + 1) / i_t
    o_t = x_t + γ ⊙ LN(z_t) + β_ln                   (i_t: token t's 1-based position in its mini-batch)

Forward, two launches (the structure of the delta-class kernels and of fla's `chunk_ttt_linear`):

1. `_state_kernel`, sequential, grid (R·H,): one program per (sequence, value head) keeps the anchor (A, a) in
   registers (fp32) and walks the mini-batches computing only what the recurrence needs — f = K A + a, e by
   LayerNorm's backward, the roll A ← A − kᵀ(η ⊙ e) / b (+ P_0 / b after the first mini-batch of a call with offset
   > 0), a likewise — and stores each mini-batch's anchor (A, a) at its slot: (D² + D)·4 bytes a mini-batch (66 KB at
   D 128), 4D²/b bytes a token. It ends with (A, a, P, p) of the last mini-batch: the final weights are A + P / i for
   its i tokens (the glue). Per mini-batch 4bD² dot FLOPs on the sequential path (K A, kᵀ(η e)); the single-kernel
   forward before it also read out the queries there: 6bD² + 4b²D.
2. `_readout_kernel`, parallel, grid (anchor slots, H): one program per (mini-batch, value head) loads its anchor,
   recomputes e from it (f = K A + a) and computes z in the dual form and o = x + γ ⊙ LN(z) + β_ln; the first
   mini-batch of a sequence adds (x P_0 + p_0) / i when the call continues one. A is read in [BK, D] row blocks
   (util.LAUNCH "ttt_linear_readout" BK), each used by both x A and K A: no [D, D] tile in registers. e is recomputed
   rather than stored by the state pass: storing it would cost b·D·4 bytes a mini-batch written and read again
   (8 KB at b 16, D 128: +20 % on the readout's ≈ 82 KB of anchor, q, k, v and o with bf16 inputs) to save one
   [b, D]×[D, D] product (2bD² FLOPs, 0.5 MFLOP) in a kernel that is bound by those bytes, and the backward
   recomputes e from the anchor anyway.

The anchors (ckA, cka) are what the backward reads, as before; they are written on every call now (also without
gradients: a workspace of 4D²/b bytes a token, freed after the readout).

Backward, two launches likewise:

1. `_bwd_read_kernel`, parallel, grid (anchor slots, H): per (mini-batch, value head) the readout recomputed from its
   anchor (`_read`, as the forward's) and its own gradients: dz (LN(z)'s backward of γ ⊙ do), dq whole (x enters
   only the readout: do + dz Aᵀ + dS k, + (dz / i) P_0ᵀ in a continued call's first mini-batch, in [BT, BK] column
   blocks of A), the readout's parts of dk (dSᵀ x) and dη, per-slot partials of dγ, dβ_ln, and — for the reverse pass
   — dz and the readout's part of e's gradient (−Mᵀ dz) into two scratches [slots, H, b, D] fp32: 2·b·D·4 bytes a
   mini-batch (16 KB at b 16, D 128; 256 MiB at B 4, T 4096, H 16), a quarter of the anchors it reads. Nothing D×D
   is stored: the readout's term of the anchor's gradient, xᵀ dz, is formed by the reverse pass from dz.
2. `_bwd_kernel`, sequential, grid (R·H,): the mini-batches in reverse, each from its stored anchor: e recomputed
   (f = k A + a), de = (the pre-pass's) − η (k G + g_p) with G the end sums' gradient (dPout for the call's last
   mini-batch, else the next anchor's gradient over b), LayerNorm's backward to df, gA += xᵀ dz + kᵀ df, ga += Σ dz +
   Σ df, and dk's (−(η e) Gᵀ, + ddy, + df Aᵀ), dη's and dv's parts through e (added to the pre-pass's in place);
   P_0's own gradient when the call continues a mini-batch (HAS_P). The anchor's gradient gA [D, D] is accumulated in
   place in dA0 (seeded by the glue with dAout's), the bias's ga carried in registers. Per mini-batch 12bD² dot FLOPs
   on the sequential path (k A, k G, (η e) Gᵀ, df Aᵀ, xᵀ dz, kᵀ df); the single reverse kernel before it also
   recomputed the readout there: 16bD² + 12b²D. util.LAUNCH "ttt_linear_bwd" CARRY 1 (the default since r4s15: fwd+bwd
   9.45 → 8.58 ms at the LM shape, H200) runs `_bwd_carry_kernel` instead: the same products in the same order with gA
   carried in registers (G = gA / b, the 1/b folded into k and η e), dA0 written once at the end — per mini-batch 3·D²·4
   bytes less L2 traffic (G's read, gA's read and write: 192 KiB at D 128) and no barriers. DIRECT 1 (the default with
   CARRY): do passed in its own dtype, dq (ungrouped heads) and dv written in the inputs' dtypes by the kernels — the
   glue's fp32 copy and casts gone.

util.LAUNCH "ttt_linear_bwd" POST 1 / 2 (2 the default since r4s16: fwd+bwd 8.19 → 7.44 ms at the LM shape, H200;
docs/kernel_notes.md "TTT-Linear's chunk-parallel backward"; POST 0 runs the carry kernel above)
splits the reverse pass by what the chain needs: the pre-pass also stores each mini-batch's f = k A + a
(`_bwd_read_f_kernel`, [slots, H, b, D] fp32), the reverse pass `_bwd_chain_kernel` reads it instead of the anchor and
does per mini-batch only k G, xᵀ dz, kᵀ df (3 products, 2 of them on the chain; `_carry_step`'s 6) with gA carried in
registers, storing each mini-batch's b·G [D, D] (fp32; POST 2: bf16 with bf16 inputs) and df [b, D] (fp32), and the
parallel `_bwd_post_kernel`, grid (anchor slots, H), adds dk's other two terms −(η e) Gᵀ + df Aᵀ (e from the stored f,
A from the anchors, in [b, BK] column blocks of dk). 4 launches instead of 2; + (D² + 2bD)·4 bytes a mini-batch of
scratch (1.25 GiB at B 4, T 4096, H 16, D 128; POST 2 with bf16 inputs 0.75 GiB).

The per-(b, h) sums of dγ, dβ_ln (and the pre-pass's per-slot ones) are summed by the glue; dq, dk of grouped heads
are written per value head and summed over the group by the glue.

`ttt_linear_triton` (glue, autograd) and its torch twin on the same contract (`chunkwise.minibatch`; the tests'
tests/kernels/memories/twins.py) take and return the same tensors. Tile: the mini-batch b is one tile dim (b a power
of two, 16 ≤ b ≤ 64), D padded to a power of two ≥ 16 (D ≤ MAX_TTT_DIM). Varlen (`cu_seqlens`): one sequential program
per (sequence, head), each sequence's mini-batches from its own start, its anchors at its own slots (the glue reads
cu_seqlens on the host to place them, and each slot's sequence for the readout's grid); the dispatch row does not pass
it yet (a MemoryState carries one offset, and the torch chunk form has no varlen). fp32 operands; tl.dot at the call's
`precision` (limits.DOT_PRECISIONS: by default `limits.loop_precision("TTT-Linear", q.dtype)` — "tf32x3", three TF32
tensor-core products per dot, for fp32 and fp16 inputs; "tf32", one, for bf16 inputs; "ieee" fp32 FMAs on request).
Launch settings: util.LAUNCH's "ttt_linear_fwd" (the state pass), "ttt_linear_readout", "ttt_linear_bwd_read",
"ttt_linear_bwd" (the reverse pass). Where sequences × heads leave SMs idle (util.LAUNCH["ttt_linear_sliced"], the
rule `kernels.variants.ttt_linear`), the two sequential passes run sliced instead: the value columns over NP programs
a (sequence, head), one launch a mini-batch (`ttt_linear_sliced.py`: the same anchors stored, the same parallel
kernels after them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import ttt_linear as ttt_linear_variant
from ...variants import ttt_linear_backward as ttt_linear_backward_variant
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import MAX_TTT_DIM, TTT_LINEAR_PRECISION, TTT_MINIBATCHES, loop_precision
from ..common.util import capturing, check_precision, launch, pow2, table, tile
from .ttt_rows import _rows, _sequence, _tokens  # noqa: F401  (also imported from here by the other memories)

Tensor = torch.Tensor

__all__ = ["ttt_linear_triton", "PRECISION"]

#: The kernels' default tl.dot input precision for fp32 and fp16 inputs (bf16: limits.LOOP_BF16_PRECISION; the
#: `precision` argument; limits.DOT_PRECISIONS; why: limits).
PRECISION = TTT_LINEAR_PRECISION
LN_EPS = 1e-6  # inner.LN_EPS


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _ln(f, cm, D: tl.constexpr, EPS: tl.constexpr):
    """(LN(f), 1/σ) over the D valid columns (cm) of the rows of f [R, BD]; padded columns 0."""
    mu = tl.sum(f, axis=1) / D
    fc = tl.where(cm[None, :], f - mu[:, None], 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(fc * fc, axis=1) / D + EPS)
    return fc * inv[:, None], inv


@triton.jit
def _ln_back(n, inv, g, cm, D: tl.constexpr):
    """LayerNorm's backward s (g − mean(g) − n mean(g ⊙ n)) row-wise; padded columns 0."""
    m1 = tl.sum(g, axis=1) / D
    m2 = tl.sum(g * n, axis=1) / D
    return tl.where(cm[None, :], inv[:, None] * (g - m1[:, None] - n * m2[:, None]), 0.0)


@triton.jit
def _errors_at(f, kk, vv, lnw, lnb, cm, D: tl.constexpr, EPS: tl.constexpr):
    """The inner gradient's factors at f = k A + a [BT, BD]: (n, 1/σ, dy, u, e), each [BT, BD] (1/σ [BT])."""
    n, inv = _ln(f, cm, D, EPS)
    dy = tl.where(cm[None, :], kk + lnb[None, :] - vv, 0.0) + lnw[None, :] * n
    u = lnw[None, :] * dy
    return n, inv, dy, u, _ln_back(n, inv, u, cm, D)


@triton.jit
def _errors(kk, vv, A, a, lnw, lnb, cm, D: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr):
    """The inner gradient's factors at the anchor: (n, 1/σ, dy, u, e), each [BT, BD] (1/σ [BT])."""
    return _errors_at(_dot(kk, A, PREC) + a[None, :], kk, vv, lnw, lnb, cm, D, EPS)


@triton.jit
def _anchor_step(k, v, beta, p0, ckA, cka, A, a, lnw, lnb, slot0, s, bos, Tn, off, i_h, bi, H: tl.constexpr,
                 HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr,
                 PREC: tl.constexpr, HAS_P: tl.constexpr):
    """One mini-batch s of the state pass: its anchor (A, a) stored at its slot, then (k [BT, BD], η ⊙ e [BT, BD], the
    end sum of the bias p_0 − Σ η e [BD]) — p_0 (HAS_P) the first mini-batch's only."""
    c = tl.arange(0, BD)
    cm = c < D
    ck = (slot0 + s) * H + i_h  # the anchors the readout and the backward recompute from
    tl.store(ckA + ck * D * D + (c[:, None] * D + c[None, :]), A, mask=cm[:, None] & cm[None, :])
    tl.store(cka + ck * D + c, a, mask=cm)
    kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, s, Tn, off, H, HQ, D, BD, BT)
    n, inv, dy, u, e = _errors(kk, vv, A, a, lnw, lnb, cm, D, EPS, PREC)
    ee = e * eta[:, None]
    pend = -tl.sum(ee, axis=0)
    if HAS_P:
        pend += tl.load(p0 + bi, mask=cm & (s == 0), other=0.0)
    return kk, ee, pend


@triton.jit
def _state_kernel(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, Aout, aout, Pout, pout, cu, slots, T, off,
                  NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                  EPS: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_P: tl.constexpr):
    """The forward's sequential pass, grid (R·H,): the anchors (A, a) of every mini-batch into (ckA, cka), then the
    last one's (A, a, P, p) into the outputs. Per mini-batch only the recurrence: f = k A + a, e, A ← A − kᵀ(η e)/b."""
    # HAS_P (offset > 0): the call continues a mini-batch, whose sums (P0, p0) enter the first one's end sums
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    st = (i_bh.to(tl.int64) * D + c[:, None]) * D + c[None, :]  # [BD, BD] of one (b, h) state
    bi = i_bh.to(tl.int64) * D + c
    A = tl.load(A0 + st, mask=sm, other=0.0)  # the anchor: the only [BD, BD] tile carried over the mini-batches
    a = tl.load(a0 + bi, mask=cm, other=0.0)
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    for s in range(0, ns - 1):  # every mini-batch but the last: the next anchor A + P_end / b accumulated into A
        kk, ee, pend = _anchor_step(k, v, beta, p0, ckA, cka, A, a, lnw, lnb, slot0, s, bos, Tn, off, i_h, bi, H, HQ,
                                    D, BD, BT, EPS, PREC, HAS_P)
        A = tl.dot(tl.trans(kk), ee * (-1.0 / BT), acc=A, input_precision=PREC)
        if HAS_P:
            if s == 0:
                A += tl.load(P0 + st, mask=sm, other=0.0) * (1.0 / BT)
        a = a + pend / BT
    if ns > 0:  # the call's last mini-batch (peeled: A is stored before its end sums' [BD, BD] tile is formed)
        s = ns - 1
        kk, ee, pend = _anchor_step(k, v, beta, p0, ckA, cka, A, a, lnw, lnb, slot0, s, bos, Tn, off, i_h, bi, H, HQ,
                                    D, BD, BT, EPS, PREC, HAS_P)
        tl.store(Aout + st, A, mask=sm)
        tl.store(aout + bi, a, mask=cm)
        Pend = -_dot(tl.trans(kk), ee, PREC)  # its end sums P_0 − kᵀ(η e) out (the glue forms A + P / i)
        if HAS_P:
            Pend += tl.load(P0 + st, mask=sm & (s == 0), other=0.0)
        tl.store(Pout + st, Pend, mask=sm)
        tl.store(pout + bi, pend, mask=cm)
    else:  # an empty sequence (varlen): its state and end sums are the carried ones
        tl.store(Aout + st, A, mask=sm)
        tl.store(aout + bi, a, mask=cm)
        tl.store(Pout + st, tl.load(P0 + st, mask=sm, other=0.0), mask=sm)
        tl.store(pout + bi, tl.load(p0 + bi, mask=cm, other=0.0), mask=cm)


@triton.jit
def _slot(i_slot, T, off, NS, cu, slots, seq_of, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, its first row, its tokens, the mini-batch within it) of anchor slot i_slot."""
    if IS_VARLEN:  # the slot's sequence (seq_of, from the host)
        i_b = tl.load(seq_of + i_slot)
    else:
        i_b = i_slot // NS
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    return i_b, bos, Tn, (i_slot - slot0).to(tl.int32)


@triton.jit
def _read(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, i_slot, i_b, i_h, bos, Tn, s, scale, off, H: tl.constexpr,
          HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
          EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr):
    """Mini-batch s (anchor slot i_slot) of value head i_h read from its stored anchor (A, a): e recomputed (f = k A
    + a), z in the dual form. Returns (x, k [BT, BD], η [BT], rows, validity, mask, e, S, M, LN(z) [BT, BD], 1/σ(z),
    f = k A + a [BT, BD]).
    A is read in [BK, BD] row blocks, each used by both x A and k A (no [BD, BD] tile in registers)."""
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    ipos = (r + 1).to(tl.float32)  # i: 1-based position in the mini-batch
    tri = r[:, None] >= r[None, :]
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    ck = i_slot.to(tl.int64) * H + i_h
    a = tl.load(cka + ck * D + c, mask=cm, other=0.0)
    # x A and k A over row blocks of A: x[:, j] and k[:, j] reloaded as [BT, BK] columns (L1/L2 hits)
    i_hq = i_h // (H // HQ)
    xa = tl.zeros([BT, BD], dtype=tl.float32)
    ka = tl.zeros([BT, BD], dtype=tl.float32)
    for j0 in range(0, BD, BK):
        j = j0 + tl.arange(0, BK)
        jm = j < D
        qk_off = (row[:, None] * HQ + i_hq) * D + j[None, :]
        mj = valid[:, None] & jm[None, :]
        xj = tl.load(q + qk_off, mask=mj, other=0.0).to(tl.float32) * scale
        kj = tl.load(k + qk_off, mask=mj, other=0.0).to(tl.float32)
        Aj = tl.load(ckA + ck * D * D + j[:, None] * D + c[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
        xa = tl.dot(xj, Aj, acc=xa, input_precision=PREC)
        ka = tl.dot(kj, Aj, acc=ka, input_precision=PREC)
    f = ka + a[None, :]
    n, inv, dy, u, e = _errors_at(f, kk, vv, lnw, lnb, cm, D, EPS)
    S = _dot(x, tl.trans(kk), PREC) + 1.0
    M = tl.where(tri, S * eta[None, :] / ipos[:, None], 0.0)
    z = xa + a[None, :] - _dot(M, e, PREC)
    if HAS_P:  # the carried sums P_0, p_0 of the sequence enter its first mini-batch's read only (in row blocks)
        if s == 0:
            sh = i_b.to(tl.int64) * H + i_h
            xp = tl.load(p0 + sh * D + c, mask=cm, other=0.0)[None, :] + tl.zeros([BT, BD], dtype=tl.float32)
            for j0 in range(0, BD, BK):
                j = j0 + tl.arange(0, BK)
                jm = j < D
                mj = valid[:, None] & jm[None, :]
                xj = tl.load(q + (row[:, None] * HQ + i_hq) * D + j[None, :], mask=mj, other=0.0).to(tl.float32)
                Pj = tl.load(P0 + sh * D * D + j[:, None] * D + c[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
                xp = tl.dot(xj * scale, Pj, acc=xp, input_precision=PREC)
            z += xp / ipos[:, None]
    nz, invz = _ln(z, cm, D, EPS)
    return x, kk, eta, row, valid, m, e, S, M, nz, invz, f


@triton.jit
def _readout_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, o, cu, slots, seq_of, scale, T, off, NS,
                    H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
                    HAS_P: tl.constexpr):
    """The forward's parallel readout, grid (anchor slots, H): o = x + γ ⊙ LN(z) + β_ln of one mini-batch of one value
    head from its stored anchor (`_read`)."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    cm = c < D
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    x, kk, eta, row, valid, m, e, S, M, nz, invz, f = _read(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, i_slot,
                                                            i_b, i_h, bos, Tn, s, scale, off, H, HQ, D, BD, BT, BK,
                                                            EPS, PREC, HAS_P)
    out = x + lnw[None, :] * nz + lnb[None, :]
    tl.store(o + (row[:, None] * H + i_h) * D + c[None, :], out.to(o.dtype.element_ty), mask=m)


@triton.jit
def _bwd_read_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des, glnw, glnb, cu,
                     slots, seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                     BD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                     IS_VARLEN: tl.constexpr, HAS_P: tl.constexpr):
    """The backward's parallel pre-pass, grid (anchor slots, H): the readout's own gradients of one mini-batch of one
    value head from its stored anchor (`_read` recomputed) — dq whole (x enters nothing else), the readout's parts of
    dk (dSᵀ x) and dη, the per-slot partials of dγ, dβ_ln, and for the reverse pass dz and the readout's part of de
    (−Mᵀ dz), [BT, D] each into the scratches dzs, des (fp32, slot-major like the anchors). `_bwd_read_body`."""
    _bwd_read_body(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des, glnw, glnb, dzs, cu,
                   slots, seq_of, scale, T, off, NS, H, HQ, D, BD, BT, BK, EPS, PREC, IS_VARLEN, HAS_P, False)


@triton.jit
def _bwd_read_f_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des, glnw, glnb,
                       fs, cu, slots, seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                       BD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                       IS_VARLEN: tl.constexpr, HAS_P: tl.constexpr):
    """`_bwd_read_kernel` that also stores each mini-batch's f = k A + a [BT, D] (fp32, slot-major: the scratch fs),
    which it forms anyway, for the chain-only reverse pass (`_bwd_chain_kernel`, util.LAUNCH "ttt_linear_bwd" POST):
    that pass then neither reads the anchor nor forms k A."""
    _bwd_read_body(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des, glnw, glnb, fs, cu,
                   slots, seq_of, scale, T, off, NS, H, HQ, D, BD, BT, BK, EPS, PREC, IS_VARLEN, HAS_P, True)


@triton.jit
def _bwd_read_body(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des, glnw, glnb, fs, cu,
                   slots, seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_P: tl.constexpr, STORE_F: tl.constexpr):
    """The pre-pass's body (`_bwd_read_kernel`; STORE_F: f = k A + a into fs too, `_bwd_read_f_kernel`)."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    ipos = (r + 1).to(tl.float32)
    tri = r[:, None] >= r[None, :]
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    x, kk, eta, row, valid, m, e, S, M, nz, invz, f = _read(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, i_slot,
                                                            i_b, i_h, bos, Tn, s, scale, off, H, HQ, D, BD, BT, BK,
                                                            EPS, PREC, HAS_P)
    ck = i_slot.to(tl.int64) * H + i_h
    # o = x + γ ⊙ LN(z) + β_ln
    hv = (row[:, None] * H + i_h) * D + c[None, :]
    dO = tl.load(do + hv, mask=m, other=0.0).to(tl.float32)
    tl.store(glnw + ck * D + c, tl.sum(dO * nz, axis=0), mask=cm)
    tl.store(glnb + ck * D + c, tl.sum(dO, axis=0), mask=cm)
    dz = _ln_back(nz, invz, lnw[None, :] * dO, cm, D)
    # z = x A + a + (x P + p) / i − M e
    dM = -_dot(dz, tl.trans(e), PREC)  # [BT, BT]
    dS = tl.where(tri, dM * eta[None, :] / ipos[:, None], 0.0)
    tl.store(dbeta + row * H + i_h, tl.sum(tl.where(tri, dM * S / ipos[:, None], 0.0), axis=0), mask=valid)
    tl.store(dk + hv, _dot(tl.trans(dS), x, PREC), mask=m)
    sc = (ck * BT + r[:, None]) * D + c[None, :]
    tl.store(dzs + sc, dz, mask=cm[None, :])
    tl.store(des + sc, -_dot(tl.trans(M), dz, PREC), mask=cm[None, :])
    if STORE_F:
        tl.store(fs + sc, f, mask=cm[None, :])
    # dx = dO + dz Aᵀ + dS k (+ (dz / i) P_0ᵀ in a continued call's first mini-batch), in [BT, BK] column blocks
    i_hq = i_h // (H // HQ)
    sh = i_b.to(tl.int64) * H + i_h
    for j0 in range(0, BD, BK):
        j = j0 + tl.arange(0, BK)
        jm = j < D
        mj = valid[:, None] & jm[None, :]
        kj = tl.load(k + (row[:, None] * HQ + i_hq) * D + j[None, :], mask=mj, other=0.0).to(tl.float32)
        Aj = tl.load(ckA + ck * D * D + j[:, None] * D + c[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
        hj = (row[:, None] * H + i_h) * D + j[None, :]
        dxj = tl.load(do + hj, mask=mj, other=0.0).to(tl.float32) + _dot(dS, kj, PREC)
        dxj = tl.dot(dz, tl.trans(Aj), acc=dxj, input_precision=PREC)
        if HAS_P:  # (P_0 read only by the sequence's first mini-batch: 0 elsewhere)
            Pj = tl.load(P0 + sh * D * D + j[:, None] * D + c[None, :], mask=jm[:, None] & cm[None, :] & (s == 0),
                         other=0.0)
            dxj = tl.dot(dz / ipos[:, None], tl.trans(Pj), acc=dxj, input_precision=PREC)
        tl.store(dq + hj, (dxj * scale).to(dq.dtype.element_ty), mask=mj)


@triton.jit
def _through_e(de, deta, dkk, kg, e, eta, n, inv, dy, u, lnw, glnw, glnb, cm, D: tl.constexpr):
    """The reverse pass's step through e [BT, BD] (both reverse kernels'): e's gradient de (the readout's part) less
    η (k G + g_p) (kg), then LayerNorm's backward to df. Returns (dη, dk with ddy, ddy, df, dγ, dβ_ln) updated."""
    de -= eta[:, None] * kg
    deta -= tl.sum(e * kg, axis=1)
    # e = s (u − mean(u) − n mean(u ⊙ n)),  u = γ ⊙ dy,  dy = k + β_ln − v + γ ⊙ n,  (n, s) = LN(f)
    dinv = tl.sum(de * e, axis=1) / inv
    du = _ln_back(n, inv, de, cm, D)
    mu_un = tl.sum(u * n, axis=1) / D
    mg_n = tl.sum(de * n, axis=1) / D
    dn = tl.where(cm[None, :], -inv[:, None] * (de * mu_un[:, None] + mg_n[:, None] * u), 0.0)
    ddy = lnw[None, :] * du
    glnw += tl.sum(du * dy + ddy * n, axis=0)
    glnb += tl.sum(ddy, axis=0)
    dn += lnw[None, :] * ddy
    dkk += ddy
    df = _ln_back(n, inv, dn, cm, D) - (dinv * inv * inv / D)[:, None] * n
    return deta, dkk, ddy, df, glnw, glnb


@triton.jit
def _bwd_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, dzs, des, dAout, daout, dPout, dpout,
                dk, dv, dbeta, dlnw, dlnb, dA0, da0, dP0, dp0, cu, slots, scale, T, off, NS,
                H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The backward's reverse sequential pass, grid (R·H,), after `_bwd_read_kernel`: per mini-batch only what chains
    through the anchors — e recomputed (f = k A + a), its gradient de = (the readout's, read) − η (k G + g_p), the
    LayerNorm's backward to df, then gA += xᵀ dz + kᵀ df, ga += Σ dz + Σ df — and the parts of dk, dη (added to the
    pre-pass's), dv, dγ, dβ_ln that come through e."""
    # HAS_P (offset > 0): the call continues a mini-batch, whose sums (P0, p0) enter the first one's read.
    # The anchor's gradient gA [BD, BD] is accumulated in place in dA0 (the glue seeds it with dAout): no [BD, BD]
    # tile is carried over the mini-batches — each one holds its anchor A and, for a while, its end sums' gradient
    # (dPout for the call's last mini-batch, else the next anchor's gradient over b: dA0 / b as it stands).
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    st = (i_bh.to(tl.int64) * D + c[:, None]) * D + c[None, :]
    bi = i_bh.to(tl.int64) * D + c
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)
    ga = tl.load(daout + bi, mask=cm, other=0.0)  # the anchor bias's gradient (a vector: carried)
    gpo = tl.load(dpout + bi, mask=cm, other=0.0)
    glnw = tl.zeros([BD], dtype=tl.float32)
    glnb = tl.zeros([BD], dtype=tl.float32)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    for si in range(0, ns):
        s = ns - 1 - si
        first = s == 0
        tl.debug_barrier()  # the previous (later) mini-batch's dA0 stores before this one's loads
        ck = (slot0 + s) * H + i_h
        A = tl.load(ckA + ck * D * D + (c[:, None] * D + c[None, :]), mask=sm, other=0.0)
        a = tl.load(cka + ck * D + c, mask=cm, other=0.0)
        x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
        n, inv, dy, u, e = _errors(kk, vv, A, a, lnw, lnb, cm, D, EPS, PREC)
        sc = (ck * BT + r[:, None]) * D + c[None, :]
        dz = tl.load(dzs + sc, mask=cm[None, :], other=0.0)  # the pre-pass's: z's gradient, the readout's part of de
        de = tl.load(des + sc, mask=cm[None, :], other=0.0)
        hv = (row[:, None] * H + i_h) * D + c[None, :]
        dkk = tl.load(dk + hv, mask=m, other=0.0)  # the pre-pass's parts of dk, dη
        deta = tl.load(dbeta + row * H + i_h, mask=valid, other=0.0)
        # the mini-batch's end sums: P_end = P − kᵀ (η ⊙ e), p_end = p − Σ η e; their gradient G: dPout for the
        # call's last mini-batch, else the next anchor's (A_{s+1} = A_s + P_end / b): dA0 / b as it stands
        if si == 0:
            G = tl.load(dPout + st, mask=sm, other=0.0)
        else:
            G = tl.load(dA0 + st, mask=sm, other=0.0) * (1.0 / BT)
        kg = _dot(kk, G, PREC) + gpo[None, :]
        dkk -= _dot(e * eta[:, None], tl.trans(G), PREC)
        if HAS_P:  # the carried sums' gradient: the first mini-batch's end sums' (and its read's)
            if first:
                dzi = dz / ipos[:, None]
                tl.store(dP0 + st, G + _dot(tl.trans(x), dzi, PREC), mask=sm)
                tl.store(dp0 + bi, gpo + tl.sum(dzi, axis=0), mask=cm)
        deta, dkk, ddy, df, glnw, glnb = _through_e(de, deta, dkk, kg, e, eta, n, inv, dy, u, lnw, glnw, glnb, cm, D)
        # f = k A + a (A read again here rather than kept from the top: one [BD, BD] tile live at a time)
        tl.debug_barrier()  # every thread's read of dA0 (G) before it is written
        gA = tl.load(dA0 + st, mask=sm, other=0.0)
        gA = tl.dot(tl.trans(x), dz, acc=gA, input_precision=PREC)
        gA = tl.dot(tl.trans(kk), df, acc=gA, input_precision=PREC)
        tl.store(dA0 + st, gA, mask=sm)
        ga += tl.sum(dz, axis=0) + tl.sum(df, axis=0)
        A = tl.load(ckA + ck * D * D + (c[:, None] * D + c[None, :]), mask=sm, other=0.0)
        dkk += _dot(df, tl.trans(A), PREC)
        # per value head: the glue sums dk over grouped heads
        tl.store(dk + hv, dkk.to(dk.dtype.element_ty), mask=m)
        tl.store(dv + hv, (-ddy).to(dv.dtype.element_ty), mask=m)
        tl.store(dbeta + row * H + i_h, deta.to(dbeta.dtype.element_ty), mask=valid)
        # into the previous mini-batch: its end sums' bias gradient
        gpo = ga / BT
    tl.store(da0 + bi, ga, mask=cm)
    tl.store(dlnw + bi, glnw, mask=cm)
    tl.store(dlnb + bi, glnb, mask=cm)


@triton.jit
def _carry_step(q, k, v, beta, ckA, cka, dzs, des, dAout, dk, dv, dbeta, dP0, dp0, gA, ga, gpo, glnw, glnb, lnw, lnb,
                si, ns, slot0, bos, Tn, off, scale, i_h, st, bi, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                BD: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr):
    """Mini-batch s = ns − 1 − si of `_bwd_carry_kernel`: as `_bwd_kernel`'s loop body, with the anchor's gradient gA
    [BD, BD] carried in registers. Its end sums' gradient G is gA / b, the 1/b folded into the [BT, BD] operands k and
    η e (exact: b a power of two), so no scaled [BD, BD] copy; in the call's last mini-batch (si = 0) gA holds b·dPout
    (G = dPout exactly) and is replaced by dAout's seed before this mini-batch's terms are added. Returns (gA, ga,
    the previous mini-batch's g_p, dγ, dβ_ln)."""
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    ipos = (r + 1).to(tl.float32)
    s = ns - 1 - si
    ck = (slot0 + s) * H + i_h
    A = tl.load(ckA + ck * D * D + (c[:, None] * D + c[None, :]), mask=sm, other=0.0)
    a = tl.load(cka + ck * D + c, mask=cm, other=0.0)
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    n, inv, dy, u, e = _errors(kk, vv, A, a, lnw, lnb, cm, D, EPS, PREC)
    sc = (ck * BT + r[:, None]) * D + c[None, :]
    dz = tl.load(dzs + sc, mask=cm[None, :], other=0.0)  # the pre-pass's: z's gradient, the readout's part of de
    de = tl.load(des + sc, mask=cm[None, :], other=0.0)
    hv = (row[:, None] * H + i_h) * D + c[None, :]
    dkk = tl.load(dk + hv, mask=m, other=0.0)  # the pre-pass's parts of dk, dη
    deta = tl.load(dbeta + row * H + i_h, mask=valid, other=0.0)
    kg = _dot(kk * (1.0 / BT), gA, PREC) + gpo[None, :]
    dkk -= _dot(e * (eta * (1.0 / BT))[:, None], tl.trans(gA), PREC)
    if HAS_P:  # the carried sums' gradient: the first mini-batch's end sums' (and its read's)
        if s == 0:
            dzi = dz / ipos[:, None]
            tl.store(dP0 + st, tl.dot(tl.trans(x), dzi, acc=gA * (1.0 / BT), input_precision=PREC), mask=sm)
            tl.store(dp0 + bi, gpo + tl.sum(dzi, axis=0), mask=cm)
    if si == 0:  # b·dPout done with: the anchor's gradient starts from dAout's seed
        gA = tl.load(dAout + st, mask=sm, other=0.0)
    deta, dkk, ddy, df, glnw, glnb = _through_e(de, deta, dkk, kg, e, eta, n, inv, dy, u, lnw, glnw, glnb, cm, D)
    gA = tl.dot(tl.trans(x), dz, acc=gA, input_precision=PREC)
    gA = tl.dot(tl.trans(kk), df, acc=gA, input_precision=PREC)
    ga += tl.sum(dz, axis=0) + tl.sum(df, axis=0)
    A = tl.load(ckA + ck * D * D + (c[:, None] * D + c[None, :]), mask=sm, other=0.0)  # again (L2): not kept live
    dkk += _dot(df, tl.trans(A), PREC)
    tl.store(dk + hv, dkk.to(dk.dtype.element_ty), mask=m)
    tl.store(dv + hv, (-ddy).to(dv.dtype.element_ty), mask=m)
    tl.store(dbeta + row * H + i_h, deta.to(dbeta.dtype.element_ty), mask=valid)
    return gA, ga, ga / BT, glnw, glnb


@triton.jit
def _bwd_carry_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, p0, ckA, cka, dzs, des, dAout, daout, dPout, dpout,
                      dk, dv, dbeta, dlnw, dlnb, dA0, da0, dP0, dp0, cu, slots, scale, T, off, NS,
                      H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                      EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """`_bwd_kernel`'s reverse pass (same arguments, same results) with the anchor's gradient gA [BD, BD] carried in
    registers over the mini-batches (util.LAUNCH "ttt_linear_bwd" CARRY 1) instead of accumulated in place in dA0:
    per mini-batch no dA0 read for G, no read and write of gA (3·D²·4 bytes of L2 traffic, 192 KiB at D 128) and no
    barriers (`_carry_step`). dA0 is written once, at the end."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    c = tl.arange(0, BD)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    st = (i_bh.to(tl.int64) * D + c[:, None]) * D + c[None, :]
    bi = i_bh.to(tl.int64) * D + c
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ga = tl.load(daout + bi, mask=cm, other=0.0)  # the anchor bias's gradient (a vector: carried)
    gpo = tl.load(dpout + bi, mask=cm, other=0.0)
    glnw = tl.zeros([BD], dtype=tl.float32)
    glnb = tl.zeros([BD], dtype=tl.float32)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    gA = tl.load(dPout + st, mask=sm, other=0.0) * BT  # b·dPout: the call's last mini-batch's G is gA / b
    for si in range(0, ns):
        gA, ga, gpo, glnw, glnb = _carry_step(q, k, v, beta, ckA, cka, dzs, des, dAout, dk, dv, dbeta, dP0, dp0, gA,
                                              ga, gpo, glnw, glnb, lnw, lnb, si, ns, slot0, bos, Tn, off, scale, i_h,
                                              st, bi, H, HQ, D, BD, BT, EPS, PREC, HAS_P)
    if ns == 0:  # an empty sequence (varlen): the anchor's gradient is dAout's
        gA = tl.load(dAout + st, mask=sm, other=0.0)
    tl.store(dA0 + st, gA, mask=sm)
    tl.store(da0 + bi, ga, mask=cm)
    tl.store(dlnw + bi, glnw, mask=cm)
    tl.store(dlnb + bi, glnb, mask=cm)


@triton.jit
def _chain_step(q, k, v, beta, fs, dzs, des, dAout, dk, dv, dbeta, dP0, dp0, gs, dfs, gA, ga, gpo, glnw, glnb, lnw, lnb,
                si, ns, slot0, bos, Tn, off, scale, i_h, st, bi, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                BD: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr):
    """Mini-batch s = ns − 1 − si of `_bwd_chain_kernel`: `_carry_step` with only what cannot wait — f read from the
    pre-pass (no anchor, no k A), e and LayerNorm's rows from it, k G (G = gA / b) into de, LayerNorm's backward to
    df, gA += xᵀ dz + kᵀ df — and the two products into dk that nothing later needs, −(η e) Gᵀ and df Aᵀ, left to
    `_bwd_post_kernel`: this mini-batch's gA (b·G) [BD, BD] stored into gs (in gs's dtype) before it moves on, and df
    [BT, BD] into dfs (fp32). dk gets the pre-pass's part + ddy here (the post-pass adds the rest). Returns as
    `_carry_step`."""
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    ipos = (r + 1).to(tl.float32)
    s = ns - 1 - si
    ck = (slot0 + s) * H + i_h
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    sc = (ck * BT + r[:, None]) * D + c[None, :]
    f = tl.load(fs + sc, mask=cm[None, :], other=0.0)  # the pre-pass's f = k A + a
    n, inv, dy, u, e = _errors_at(f, kk, vv, lnw, lnb, cm, D, EPS)
    dz = tl.load(dzs + sc, mask=cm[None, :], other=0.0)  # the pre-pass's: z's gradient, the readout's part of de
    de = tl.load(des + sc, mask=cm[None, :], other=0.0)
    hv = (row[:, None] * H + i_h) * D + c[None, :]
    dkk = tl.load(dk + hv, mask=m, other=0.0)  # the pre-pass's parts of dk, dη
    deta = tl.load(dbeta + row * H + i_h, mask=valid, other=0.0)
    tl.store(gs + ck * D * D + (c[:, None] * D + c[None, :]), gA.to(gs.dtype.element_ty), mask=sm)  # b·G
    kg = _dot(kk * (1.0 / BT), gA, PREC) + gpo[None, :]
    if HAS_P:  # the carried sums' gradient: the first mini-batch's end sums' (and its read's)
        if s == 0:
            dzi = dz / ipos[:, None]
            tl.store(dP0 + st, tl.dot(tl.trans(x), dzi, acc=gA * (1.0 / BT), input_precision=PREC), mask=sm)
            tl.store(dp0 + bi, gpo + tl.sum(dzi, axis=0), mask=cm)
    if si == 0:  # b·dPout done with: the anchor's gradient starts from dAout's seed
        gA = tl.load(dAout + st, mask=sm, other=0.0)
    deta, dkk, ddy, df, glnw, glnb = _through_e(de, deta, dkk, kg, e, eta, n, inv, dy, u, lnw, glnw, glnb, cm, D)
    gA = tl.dot(tl.trans(x), dz, acc=gA, input_precision=PREC)
    gA = tl.dot(tl.trans(kk), df, acc=gA, input_precision=PREC)
    ga += tl.sum(dz, axis=0) + tl.sum(df, axis=0)
    tl.store(dfs + sc, df, mask=cm[None, :])
    tl.store(dk + hv, dkk.to(dk.dtype.element_ty), mask=m)
    tl.store(dv + hv, (-ddy).to(dv.dtype.element_ty), mask=m)
    tl.store(dbeta + row * H + i_h, deta.to(dbeta.dtype.element_ty), mask=valid)
    return gA, ga, ga / BT, glnw, glnb


@triton.jit
def _bwd_chain_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, fs, dzs, des, gs, dfs, dAout, daout, dPout, dpout,
                      dk, dv, dbeta, dlnw, dlnb, dA0, da0, dP0, dp0, cu, slots, scale, T, off, NS,
                      H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                      EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The chain-only reverse pass (util.LAUNCH "ttt_linear_bwd" POST ≥ 1), grid (R·H,), after `_bwd_read_f_kernel`:
    `_bwd_carry_kernel` with per mini-batch 3 products (k G, xᵀ dz, kᵀ df) instead of 6 and no anchor read
    (`_chain_step`); each mini-batch's b·G and df stored for `_bwd_post_kernel`."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    c = tl.arange(0, BD)
    cm = c < D
    sm = cm[:, None] & cm[None, :]
    st = (i_bh.to(tl.int64) * D + c[:, None]) * D + c[None, :]
    bi = i_bh.to(tl.int64) * D + c
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ga = tl.load(daout + bi, mask=cm, other=0.0)
    gpo = tl.load(dpout + bi, mask=cm, other=0.0)
    glnw = tl.zeros([BD], dtype=tl.float32)
    glnb = tl.zeros([BD], dtype=tl.float32)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    gA = tl.load(dPout + st, mask=sm, other=0.0) * BT  # b·dPout: the call's last mini-batch's G is gA / b
    for si in range(0, ns):
        gA, ga, gpo, glnw, glnb = _chain_step(q, k, v, beta, fs, dzs, des, dAout, dk, dv, dbeta, dP0, dp0, gs, dfs,
                                              gA, ga, gpo, glnw, glnb, lnw, lnb, si, ns, slot0, bos, Tn, off, scale,
                                              i_h, st, bi, H, HQ, D, BD, BT, EPS, PREC, HAS_P)
    if ns == 0:  # an empty sequence (varlen): the anchor's gradient is dAout's
        gA = tl.load(dAout + st, mask=sm, other=0.0)
    tl.store(dA0 + st, gA, mask=sm)
    tl.store(da0 + bi, ga, mask=cm)
    tl.store(dlnw + bi, glnw, mask=cm)
    tl.store(dlnb + bi, glnb, mask=cm)


@triton.jit
def _bwd_post_kernel(k, v, beta, lnw_ptr, lnb_ptr, ckA, fs, gs, dfs, dk, cu, slots, seq_of, T, off, NS,
                     H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The chain's deferred products, grid (anchor slots, H), after `_bwd_chain_kernel`: per mini-batch and value head
    dk += −(η e / b) (b·G)ᵀ + df Aᵀ (e from the stored f; b·G, df the chain's; A the stored anchor), in [BT, BK]
    column blocks of dk (rows [BK, BD] of b·G and of A: no [BD, BD] tile in registers)."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, s, Tn, off, H, HQ, D, BD, BT)
    ck = i_slot.to(tl.int64) * H + i_h
    sc = (ck * BT + r[:, None]) * D + c[None, :]
    f = tl.load(fs + sc, mask=cm[None, :], other=0.0)
    n, inv, dy, u, e = _errors_at(f, kk, vv, lnw, lnb, cm, D, EPS)
    ee = e * (eta * (1.0 / BT))[:, None]  # the 1/b of G folded in, as `_carry_step` does
    df = tl.load(dfs + sc, mask=cm[None, :], other=0.0)
    for j0 in range(0, BD, BK):
        j = j0 + tl.arange(0, BK)
        jm = j < D
        mj = valid[:, None] & jm[None, :]
        tm = jm[:, None] & cm[None, :]
        Gj = tl.load(gs + ck * D * D + j[:, None] * D + c[None, :], mask=tm, other=0.0).to(tl.float32)
        Aj = tl.load(ckA + ck * D * D + j[:, None] * D + c[None, :], mask=tm, other=0.0)
        hj = (row[:, None] * H + i_h) * D + j[None, :]
        dkj = tl.load(dk + hj, mask=mj, other=0.0) - _dot(ee, tl.trans(Gj), PREC)
        dkj = tl.dot(df, tl.trans(Aj), acc=dkj, input_precision=PREC)
        tl.store(dk + hj, dkj, mask=mj)


class _Plan(NamedTuple):
    """Where the mini-batches of a call lie: R sequences (B, or N with cu_seqlens), NS mini-batches per
    sequence without varlen (the kernels compute each sequence's own from cu with it), `slots` anchor slots in
    all, `first` the first slot of each sequence (int64 [N] on the device, or None), `seq_of` each slot's sequence
    (int32 [slots] on the device, or None; the readout's grid runs over the slots), `last` [R] the tokens of each
    sequence's last mini-batch after the call (its i; b for an empty sequence that starts one), `steps` the most
    mini-batches of one sequence (the sliced passes' launches)."""

    R: int
    NS: int
    slots: int
    first: Tensor | None
    seq_of: Tensor | None
    last: list[int]
    steps: int = 0


def _plan(B: int, T: int, offset: int, b: int, cu: list[int] | None, device) -> _Plan:
    def count(n):  # mini-batches a sequence of n tokens touches
        return -(-(offset + n) // b)

    def last(n):
        return offset + n - (count(n) - 1) * b

    if cu is None:
        return _Plan(B, count(T), B * count(T), None, None, [last(T)] * B, count(T))
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    counts = [count(n) for n in lengths]
    first = torch.tensor([sum(counts[:i]) for i in range(len(counts))], dtype=torch.int64, device=device)
    seq_of = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.int32, device=device)
    return _Plan(len(lengths), 0, sum(counts), first, seq_of, [last(n) for n in lengths], max(counts, default=0))


def _last_counts(plan: _Plan, dims: int, device) -> float | Tensor:
    """The tokens of each sequence's last mini-batch, to divide its end sums by: a Python number when every sequence
    has the same (no host-to-device copy, so a CUDA graph can capture the call), else [R, 1, …] (dims in all)."""
    if len(set(plan.last)) == 1:
        return float(plan.last[0])
    return torch.tensor(plan.last, dtype=torch.float32, device=device).view((-1,) + (1,) * (dims - 1))


def _geo(q, v, b: int, cu, precision: str) -> dict:
    """The constexprs every TTT-Linear kernel takes: heads, head dim and its tile, the mini-batch, LN's ε, tl.dot's
    precision, varlen."""
    Hq, D = q.shape[2:]
    return dict(H=v.shape[2], HQ=Hq, D=D, BD=pow2(D), BT=b, EPS=LN_EPS, PREC=precision, IS_VARLEN=cu is not None)


def _state_pass(k, v, beta, lnw, lnb, A0, a0, P0, p0, *, T: int, offset: int, cu, plan: _Plan, geo: dict):
    """`_state_kernel`: (ckA [slots, H, D, D], cka [slots, H, D]: every mini-batch's anchor, fp32; A, a, P, p of each
    sequence's last mini-batch, [R, H, D, D] / [R, H, D] fp32). Arguments as `_TTTLinear`'s; geo: the kernels'
    shared constexprs."""
    R, H, D = plan.R, geo["H"], geo["D"]
    f32 = dict(dtype=torch.float32, device=k.device)
    ckA = empty_output(max(plan.slots, 1), H, D, D, **f32)
    cka = empty_output(max(plan.slots, 1), H, D, **f32)
    outs = [empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32),
            empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)]
    seq = (cu if cu is not None else ckA, plan.first if plan.first is not None else ckA)
    _state_kernel[(R * H,)](k, v, beta, lnw, lnb, A0, a0, P0, p0, ckA, cka, *outs, *seq, T, offset, plan.NS, **geo,
                            HAS_P=offset > 0, **launch("ttt_linear_fwd"))
    return ckA, cka, *outs


def _readout(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, *, scale: float, T: int, offset: int, cu, plan: _Plan,
             geo: dict):
    """`_readout_kernel`: o [B, T, H, D] in v's dtype, every mini-batch read in parallel from its anchor in (ckA,
    cka) (`_state_pass`'s). Arguments as `_TTTLinear`'s."""
    B, H = q.shape[0], geo["H"]
    o = empty_output(B, T, H, geo["D"], dtype=v.dtype, device=q.device)
    if plan.slots:
        seq = (cu, plan.first, plan.seq_of) if cu is not None else (o, o, o)
        BK = min(tile("ttt_linear_readout", "BK"), geo["BD"])
        _readout_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, o, *seq, scale, T, offset,
                                         plan.NS, **geo, BK=BK, HAS_P=offset > 0, **launch("ttt_linear_readout"))
    return o


def _bwd_read(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, do, *, scale: float, T: int, offset: int, cu, plan: _Plan,
              geo: dict, dq_dtype=torch.float32, fs=None):
    """`_bwd_read_kernel`: the readout's own gradients of every mini-batch in parallel from the anchors in (ckA, cka)
    and do [B, T, H, D] (fp32, or any float dtype: loaded as fp32): (dq whole — in dq_dtype —, dk's and dη's readout
    parts [B, T, H, D] / [B, T, H] — per value head, fp32 —, dz and the readout's part of de [slots, H, b, D], dγ's
    and dβ_ln's parts [slots, H, D]). Arguments as `_TTTLinear`'s; fs (fp32 [≥ slots, H, b, D], or None): where
    `_bwd_read_f_kernel` stores each mini-batch's f = k A + a besides."""
    B, H, D = q.shape[0], geo["H"], geo["D"]
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk = empty_output(B, T, H, D, dtype=dq_dtype, device=q.device), empty_output(B, T, H, D, **f32)
    dbeta = empty_output(B, T, H, **f32)
    n = max(plan.slots, 1)
    dzs, des = empty_output(n, H, geo["BT"], D, **f32), empty_output(n, H, geo["BT"], D, **f32)
    glnw, glnb = empty_output(n, H, D, **f32), empty_output(n, H, D, **f32)
    if plan.slots:
        seq = (cu, plan.first, plan.seq_of) if cu is not None else (dq, dq, dq)
        BK = min(tile("ttt_linear_bwd_read", "BK"), geo["BD"])
        if fs is None:
            _bwd_read_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs, des,
                                              glnw, glnb, *seq, scale, T, offset, plan.NS, **geo, BK=BK,
                                              HAS_P=offset > 0, **launch("ttt_linear_bwd_read"))
        else:
            _bwd_read_f_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, do, dq, dk, dbeta, dzs,
                                                des, glnw, glnb, fs, *seq, scale, T, offset, plan.NS, **geo, BK=BK,
                                                HAS_P=offset > 0, **launch("ttt_linear_bwd_read"))
    return dq, dk, dbeta, dzs, des, glnw[:plan.slots], glnb[:plan.slots]


class _TTTLinear(torch.autograd.Function):
    """Forward: `_state_kernel` (or, where `kernels.variants.ttt_linear` slices it,
    `ttt_linear_sliced.sliced_state_pass`: the same anchors), then `_readout_kernel`; backward: `_bwd_read_kernel`, then
    `_bwd_carry_kernel` or `_bwd_kernel` (CARRY), or with POST `_bwd_read_f_kernel`, `_bwd_chain_kernel`,
    `_bwd_post_kernel` (`kernels.variants.ttt_linear_backward`; or `ttt_linear_sliced.sliced_reverse`). q, k
    [B, T, H_q, D], v [B, T, H, D], beta [B, T, H], lnw, lnb [H, D], A0, P0 [R, H, D, D] and a0, p0 [R, H, D] (fp32:
    the anchor and the carried sums of each of the R sequences), then scale, offset, the mini-batch b, cu (int32 [N+1]
    on the device, or None), the `_Plan` and tl.dot's precision. Returns (o [B, T, H, D] in v's dtype, A, a, P, p of
    each sequence's last mini-batch, fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, lnw, lnb, A0, a0, P0, p0, scale, offset, b, cu, plan, precision):
        T = q.shape[1]
        geo = _geo(q, v, b, cu, precision)
        # the variant (`kernels.variants.ttt_linear`): the one branch that picks the sequential passes and names them
        chosen = ttt_linear_variant(plan.R, geo["H"], table(), captured=capturing(q))
        if chosen.sliced:  # the value columns over NP programs, one launch a mini-batch
            from .ttt_linear_sliced import sliced_state_pass

            ckA, cka, *outs, fs, st = sliced_state_pass(k, v, beta, lnw, lnb, A0, a0, P0, p0, T=T, offset=offset,
                                                        cu=cu, plan=plan, steps=plan.steps, geo=geo, NP=chosen.NP)
        else:
            ckA, cka, *outs = _state_pass(k, v, beta, lnw, lnb, A0, a0, P0, p0, T=T, offset=offset, cu=cu, plan=plan,
                                          geo=geo)
        o = _readout(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, scale=scale, T=T, offset=offset, cu=cu, plan=plan,
                     geo=geo)
        ctx.sliced = chosen.sliced and chosen.backward == "sliced"  # the sliced reverse pass (f, st kept for it)
        ctx.np = chosen.NP
        seq = (cu, plan.first) if cu is not None else ()
        ctx.save_for_backward(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, *((fs, st) if ctx.sliced else ()), *seq)
        ctx.geo, ctx.scale, ctx.offset, ctx.plan = geo, scale, offset, plan
        return (o, *outs)

    @staticmethod
    def backward(ctx, do, dA, da, dP, dp):
        q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, *seq = ctx.saved_tensors
        fs, st = seq[:2] if ctx.sliced else (None, None)
        seq = seq[2:] if ctx.sliced else seq
        B, T, Hq, D = q.shape
        H = v.shape[2]
        R, plan, geo = ctx.plan.R, ctx.plan, ctx.geo
        dev = q.device
        f32 = dict(dtype=torch.float32, device=dev)

        def grad_in(g, *shape):
            return torch.zeros(*shape, **f32) if g is None else g.float().contiguous()

        # DIRECT 1 (util.LAUNCH "ttt_linear_bwd"): do read in its own dtype by the pre-pass (which loads it as fp32),
        # dq (ungrouped heads) and dv written in the inputs' dtypes by the kernels: no fp32 copies and casts
        backward = ttt_linear_backward_variant(table(), ctx.sliced)  # (`variants.ttt_linear_backward` names it)
        direct = backward.direct
        do = do.contiguous() if direct and do is not None else grad_in(do, B, T, H, D)
        gs = [grad_in(dA, R, H, D, D), grad_in(da, R, H, D), grad_in(dP, R, H, D, D), grad_in(dp, R, H, D)]
        dv = empty_output(B, T, H, D, dtype=v.dtype if direct else torch.float32, device=dev)
        dlnw, dlnb = empty_output(R, H, D, **f32), empty_output(R, H, D, **f32)
        has_p = ctx.offset > 0  # else P0 = 0 is no input of the state: no gradient
        # POST ≥ 1 (the one-program reverse pass only): the pre-pass stores f = k A + a for the chain-only reverse pass
        post = backward.post and not ctx.sliced
        n = max(plan.slots, 1)
        fks = empty_output(n, H, geo["BT"], D, **f32) if post else None  # f = k A + a (not the sliced pass's fs)
        dq, dk, dbeta, dzs, des, glnw, glnb = _bwd_read(q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, do,
                                                        scale=ctx.scale, T=T, offset=ctx.offset,
                                                        cu=seq[0] if seq else None, plan=plan, geo=geo,
                                                        dq_dtype=q.dtype if direct and Hq == H else torch.float32,
                                                        fs=fks)
        if ctx.sliced:  # the value columns over NP programs, one launch a mini-batch
            from .ttt_linear_sliced import sliced_reverse

            dk, dv, dbeta, dA0, da0, dP0, dp0, dlnw, dlnb = sliced_reverse(
                q, k, v, beta, lnw, lnb, P0, ckA, fs, st, dzs, des, dk, dbeta, gs, scale=ctx.scale, T=T,
                offset=ctx.offset, cu=seq[0] if seq else None, first=seq[1] if seq else None, plan=plan,
                steps=plan.steps, geo=geo, NP=ctx.np)
        elif post:  # the chain-only reverse pass, then dk's deferred products in parallel
            dA0, da0 = empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)
            dP0, dp0 = (empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)) if has_p else (dA0, da0)
            # b·G of every mini-batch: fp32, or bf16 under POST 2 with bf16 inputs (an fp16 one could underflow)
            g_dtype = torch.bfloat16 if backward.post == 2 and q.dtype == torch.bfloat16 else torch.float32
            gsc = empty_output(n, H, D, D, dtype=g_dtype, device=dev)
            dfs = empty_output(n, H, geo["BT"], D, **f32)
            cu_first = seq if seq else (dq, dq)
            _bwd_chain_kernel[(R * H,)](q, k, v, beta, lnw, lnb, fks, dzs, des, gsc, dfs, *gs, dk, dv, dbeta, dlnw,
                                        dlnb, dA0, da0, dP0, dp0, *cu_first, ctx.scale, T, ctx.offset, plan.NS, **geo,
                                        HAS_P=has_p, **launch("ttt_linear_bwd"))
            if plan.slots:
                slots = (seq[0], plan.first, plan.seq_of) if seq else (dq, dq, dq)
                BK = min(tile("ttt_linear_bwd_post", "BK"), geo["BD"])
                _bwd_post_kernel[(plan.slots, H)](k, v, beta, lnw, lnb, ckA, fks, gsc, dfs, dk, *slots, T, ctx.offset,
                                                  plan.NS, **geo, BK=BK, **launch("ttt_linear_bwd_post"))
        else:
            # CARRY 1 (util.LAUNCH "ttt_linear_bwd"): the anchor's gradient carried in registers, written once
            carry = backward.carry
            # else accumulated in place by the kernel in dA0 (seeded with dAout's)
            dA0 = empty_output(R, H, D, D, **f32) if carry else gs[0].clone()
            da0 = empty_output(R, H, D, **f32)
            dP0, dp0 = (empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)) if has_p else (dA0, da0)
            seq = seq if seq else (dq, dq)
            kernel = _bwd_carry_kernel if carry else _bwd_kernel
            kernel[(R * H,)](q, k, v, beta, lnw, lnb, P0, p0, ckA, cka, dzs, des, *gs, dk, dv, dbeta, dlnw, dlnb, dA0,
                             da0, dP0, dp0, *seq, ctx.scale, T, ctx.offset, plan.NS, **geo, HAS_P=has_p,
                             **launch("ttt_linear_bwd"))
        if Hq != H:  # grouped heads: the value heads of one q/k head summed
            dq = dq.view(B, T, Hq, H // Hq, D).sum(3)
            dk = dk.view(B, T, Hq, H // Hq, D).sum(3)
        dlnw = dlnw.sum(0) + glnw.sum(0)
        dlnb = dlnb.sum(0) + glnb.sum(0)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), dlnw.to(lnw.dtype),
                dlnb.to(lnb.dtype), dA0, da0, *((dP0, dp0) if has_p else (None, None)), None, None, None, None,
                None, None)


def check_ttt_call(name: str, q, k, v, beta, ln_weight, ln_bias, offset: int, minibatch: int, cu_seqlens):
    """The checks every TTT kernel (`name`: "TTT-Linear", "TTT-MLP") makes of its call but the weights': (H, D, cu,
    R) — value heads, head dim, the boundaries of cu_seqlens (a list, or None) and the state's rows — or InputError
    naming the argument (shapes and dtypes; cu_seqlens's values)."""
    from ....chunkwise.varlen import check_cu_seqlens
    from ....inputs import check_tensor
    from ..args import check_qkv

    B, T, Hq, H, D, V = check_qkv(q, k, v)
    if V != D:
        raise InputError(f"the {name} kernels take v's head dim equal to q's and k's D={D}, got {V}")
    if D > MAX_TTT_DIM:
        raise InputError(f"the {name} kernels take head dims D ≤ {MAX_TTT_DIM}, got {D}")
    if minibatch not in TTT_MINIBATCHES:
        raise InputError(f"the {name} kernels take a mini-batch b in {TTT_MINIBATCHES}, got {minibatch!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < minibatch:
        raise InputError(f"offset must be an int in [0, {minibatch}), got {offset!r}")
    check_tensor("beta", beta, (B, T, H), values=False)
    check_tensor("ln_weight", ln_weight, (H, D), values=False)
    check_tensor("ln_bias", ln_bias, (H, D), values=False)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    return H, D, cu, B if cu is None else len(cu) - 1  # R: one state row per sequence


def _check(q, k, v, beta, ln_weight, ln_bias, weights, anchor, offset: int, minibatch: int, cu_seqlens):
    """The boundaries of cu_seqlens (a list, or None), or InputError naming the argument the kernels cannot take
    (shapes and dtypes; cu_seqlens's values)."""
    from ....inputs import check_tensor

    H, D, cu, R = check_ttt_call("TTT-Linear", q, k, v, beta, ln_weight, ln_bias, offset, minibatch, cu_seqlens)
    for name, pair in (("weights", weights), ("anchor", anchor)):
        if pair is None and name == "anchor":
            continue
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"{name} must be a pair (W [R, H, D, D], b [R, H, 1, D]), R = {R} sequences")
        check_tensor(f"{name}[0]", pair[0], (R, H, D, D), values=False)
        check_tensor(f"{name}[1]", pair[1], (R, H, 1, D), values=False)
    if offset and anchor is None:
        raise InputError("offset > 0 needs the anchor (the weights the mini-batch started from)")
    return cu


def ttt_linear_triton(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                      minibatch: int = 16, cu_seqlens=None, precision: str | None = None):
    """TTT-Linear's chunk form on the kernels (see the module doc); differentiable in every tensor.

    q, k: [B, T, H_q, D]; v: [B, T, H, D] (H_q | H: value head h reads q/k head h // (H / H_q)), one dtype of
    fp32/bf16/fp16; beta [B, T, H] (the inner learning rates η); ln_weight, ln_bias [H, D] (γ, β_ln);
    weights (W [R, H, D, D], b [R, H, 1, D]) the memory's state, one row per sequence (R = B, or N with
    cu_seqlens: int [N+1] packing N sequences along T with B = 1, each with its own state and mini-batches
    aligned to its own start, every one continuing its carried mini-batch by `offset` tokens); anchor (same)
    the weights the carried mini-batch started from, needed when offset > 0 (tokens of it consumed before the
    call); minibatch b. Returns (o [B, T, H, D] in v's dtype, end weights (W, b), anchor (W, b) of the last
    mini-batch — fp32, R rows — and the offset after the call; with cu_seqlens, a list: each sequence's):
    `chunkwise.minibatch`'s final MemoryState fields. precision: tl.dot's input precision (limits.DOT_PRECISIONS;
    None: `limits.loop_precision` for q's dtype)."""
    precision = check_precision(loop_precision("TTT-Linear", q.dtype) if precision is None else precision)
    cu = _check(q, k, v, beta, ln_weight, ln_bias, weights, anchor, offset, minibatch, cu_seqlens)
    B, T = q.shape[:2]
    W, bias = (w.float() for w in weights)
    if offset:
        A0, a0 = (w.float() for w in anchor)
        P0, p0 = offset * (W - A0), offset * (bias - a0)  # what the consumed tokens added, times their count
    else:
        A0, a0 = W, bias
        P0, p0 = torch.zeros_like(W), torch.zeros_like(bias)
    plan = _plan(B, T, offset, minibatch, cu, q.device)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), ln_weight.contiguous(),
            ln_bias.contiguous(), A0.contiguous(), a0.squeeze(2).contiguous(), P0.contiguous(),
            p0.squeeze(2).contiguous())
    cu_dev = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    o, A, a, P, p = _TTTLinear.apply(*args, float(scale), offset, minibatch, cu_dev, plan, precision)
    a, p = a.unsqueeze(2), p.unsqueeze(2)
    last = _last_counts(plan, 4, q.device)  # a number, or [R, 1, 1, 1]
    if cu is None:
        off = (offset + T) % minibatch
    else:
        off = [(offset + e - s) % minibatch for s, e in zip(cu[:-1], cu[1:])]
    return o, (A + P / last, a + p / last), (A, a), off
