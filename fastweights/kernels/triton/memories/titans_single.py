"""Titans' inner mini-batch loop (`chunkwise.minibatch` for the recipe `titans`) in one Triton program per
(sequence, value head) each way: the "single" pipeline, which `titans.titans_triton` runs at head dims ≤ the launch
table's titans_single_fwd MAX_DIM (`limits.titans_pipeline`; wider ones take `titans.py`'s split pipeline). Its glue
(checks, plan) is `titans.titans_triton`'s; this module holds the kernels and their autograd Function `_Titans`.
The design of `ttt_mlp.py` (the MLP's weights in a per-program global scratch streamed in hidden tiles) for Titans'
memory and optimizer, each way (the backward walks the mini-batches in reverse from their stored start states).

The maths — the memory, its loss and optimizer, the per-mini-batch coefficients, the dual form of the reads and the
backward's chain down to the gates — is `titans.py`'s module doc (one place for both pipelines); what follows is what
this pipeline's two kernels do with it.

Where the weights live: θ and m (4·K·F·4 bytes per (sequence, head): 256 KiB at K = V = 64, F = 256) in the final
state's output tensors, which the kernel first fills with the initial state and then updates in place, mini-batch by
mini-batch — each tile of W1 [K, BF], M1, W2 [BF, V], M2 is rewritten in the same iteration that read it, after the
read (as `ttt_mlp.py`'s rolled slot; a `tl.debug_barrier` between mini-batches, num_stages = 1). The carried anchor
(offset > 0) is read from its own input in the first mini-batch only; the last mini-batch's anchor is written out.
With SAVE (a backward is wanted) the forward also copies each mini-batch's start state θ_s, m_s into its slot (one
per mini-batch: 16·K·F bytes at K = V), which the backward reads back.

Forward (`_fwd_kernel`), per mini-batch: the coefficients from the gates ([b, b] in registers); pass 1 over the
hidden tiles accumulates f (then e); pass 2 recomputes Z, forms dz, the read's z1 and h, accumulates o's two start
terms and h Hdᵀ, and rewrites the tile's W1, M1, W2, M2 to the segment's end; o from the accumulators.

Backward (`_bwd_kernel`): the mini-batches in reverse, from the gradients of each segment's end state and ō (the
chain of `titans.py`'s module doc), kept in place ([R·H, ·]).

What the forward keeps for it beside the start states: util.LAUNCH "titans_single_bwd" KEEP (2 by default since r4s15:
fwd+bwd 18.11 → 14.59 ms at B 64, T 512, H 2, D 64, bf16, H200): 1 also e, h W2_s, h M2_s [b, V] and h Hdᵀ [b, b] a
mini-batch ((3V + b)·4 bytes a token), and the backward skips its passes A and B below (54DF + 10bF dot FLOPs a token);
2 also the read's Z, e U2ᵀ, z1, X W1_s, X M1_s [b, F] (20F bytes a token), which pass C reads instead of recomputing the
read and pass D reads for Z (44DF + 8bF). The dependency chain (which products read the carried gradients):
docs/kernel_notes.md "Titans' single backward".

Per mini-batch: pass A (e at the anchor), pass B (the read's sums over the hidden dim: h W2_s, h M2_s, h Hdᵀ), pass C
(per hidden tile: everything above but f's side of the anchor; ∂/∂Z but its f̄ term to a [b, F] scratch; the start
state's gradients written over the end's), pass D (per tile: the f̄ terms, Ū into the start weights' gradient or the
carried anchor's). The final anchor's gradient joins the last mini-batch's start weights' (or the carried anchor's).
dq, dk of grouped heads are written per value head and summed by the glue.

FLOPs and bytes per token (K = V = D, F = 4D as the zoo's; a multiply-add 2 FLOPs; the O(bD) and O(b²D) terms left
out):
- forward: pass 1 K U1, Hd U2 (4DF); pass 2 K U1 again, e U2ᵀ, X W1_s, X M1_s, h W2_s, h M2_s and the four end
  updates Kᵀ(C_L dz), Kᵀ(Cm_L dz), Hdᵀ(C_L e), Hdᵀ(Cm_L e) (22DF), (C ∘ XKᵀ) dz and h Hdᵀ (4bF):
  26DF + 4bF = 104D² + 16bD, 442 kFLOP at D = 64, b = 16 (of which 2DF recompute pass 1's Z rather than keep it).
- on-chip traffic (the state's scratch, L2-resident): per mini-batch pass 1 reads U1, U2 (8DF bytes), pass 2 reads
  W1, W2, M1, M2 (the anchor is W_s's tile, read once) and writes them (32DF): 40DF/b = 160D²/b bytes a token,
  40 KiB at D = 64, b = 16 (with SAVE, 16DF more written a mini-batch: the start state's copy, to HBM below).
- backward: pass A 4DF, pass B (the read again) 12DF + 4bF, pass C 44DF + 10bF, pass D 10DF: 70DF + 14bF =
  280D² + 56bD, 1.20 MFLOP at D = 64, b = 16 (2.7× the forward).
- backward on-chip traffic: per mini-batch the start state read 3× and the anchor 3× (as the start weights' tile:
  read again), the state's gradients read twice and written twice (pass D: W1, W2 only), the [b, F] scratch once each
  way: ≈ 112DF/b = 448D²/b bytes a token (112 KiB at D = 64, b = 16).
- HBM: q, k, v in and o out (2K + 2V elements a token), the three gates (3 a token), and their gradients likewise in
  the backward; the state read and written once per call; the start states saved for the backward, 16DF/b =
  64D²/b bytes a token written by the forward and read by the backward (16 KiB at D = 64, b = 16).
The tl.dot products are fp32 at the call's `precision` (by default `limits.loop_precision("Titans", q.dtype)`: "ieee",
FMAs, at every input dtype); one program
walks its sequence's T/b mini-batches in order, B·H programs in all.

Limits: K, V ≤ MAX_TTT_DIM (each padded to a power of two ≥ 16), F any width (tiles masked), b ∈ TTT_MINIBATCHES;
varlen (`cu_seqlens`: one program per (sequence, head), each sequence's mini-batches from its own start); grouped
heads (value head h reads q/k head h // (H / H_q)).
fp32 operands. Launch settings: util.LAUNCH's "titans_single_fwd", "titans_single_bwd" (8 warps: at 4, sm_90's
ptxas builds the fp32 forward at K = 128 with 32 registers and ~17 KB of spills; num_stages 1: the loops re-read what
a previous pass wrote); the hidden tile: `titans.hidden_tile` at TILE_ELEMENTS. Timed on an H200:
docs/kernel_notes.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ...variants import titans_single_backward
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import TITANS_PRECISION
from ..common.util import launch, table
from .ttt import _sequence

Tensor = torch.Tensor

__all__ = ["PRECISION"]

#: The kernel's default tl.dot input precision for fp32 and fp16 inputs (bf16: limits.LOOP_BF16_PRECISION; the
#: `precision` argument; limits.DOT_PRECISIONS).
PRECISION = TITANS_PRECISION

#: The most fp32 values of one [max(K, V), BF] weight tile (the hidden tile BF = this / pow2(max(K, V)), in
#: [16, pow2(F)]): pass 2 holds four of them (W1, M1, W2, M2) and the anchor's two.
TILE_ELEMENTS = 2048
_RSQRT2 = tl.constexpr(0.7071067811865476)  # 1 / √2 (a constexpr: a jit function reads only those globals)
_RSQRT2PI = tl.constexpr(0.3989422804014327)  # 1 / √(2π)
_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: log ν's clamp


@triton.jit
def _gelu(z):
    """(σ(z), σ'(z)) of GELU's erf form, elementwise: σ = z Φ(z), σ' = Φ(z) + z φ(z)."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * _RSQRT2))
    return z * cdf, cdf + z * tl.exp(-0.5 * z * z) * _RSQRT2PI


@triton.jit
def _rows(q, k, v, g, beta, nu, bos, i_h, s, T, off, scale, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr,
          DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """Mini-batch s's rows of the sequence at row bos of T tokens (position r is its token s·b + r − off): x = scale·q,
    k [BT, BDK] and v [BT, BDV] (fp32, 0 outside the sequence), the gates log a, β [BT] (0 outside) and ν [BT] (1
    outside), the token rows' offsets, their validity and the [BT, BDV] mask of o."""
    r = tl.arange(0, BT)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    t = s * BT + r - off
    valid = (t >= 0) & (t < T)
    row = bos + tl.where(valid, t, 0)
    i_hq = i_h // (H // HQ)
    mk = valid[:, None] & (ck < DK)[None, :]
    mv = valid[:, None] & (cv < DV)[None, :]
    qk = (row[:, None] * HQ + i_hq) * DK + ck[None, :]
    x = tl.load(q + qk, mask=mk, other=0.0).to(tl.float32) * scale
    kk = tl.load(k + qk, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
    gate = row * H + i_h
    lg = tl.load(g + gate, mask=valid, other=0.0).to(tl.float32)
    eta = tl.load(beta + gate, mask=valid, other=0.0).to(tl.float32)
    nn = tl.load(nu + gate, mask=valid, other=1.0).to(tl.float32)
    return x, kk, vv, lg, eta, nn, row, valid, mv


@triton.jit
def _keys(k, v, g, beta, nu, bos, i_h, s, T, off, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr,
          DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """Mini-batch s's key-side rows of the sequence at row bos of T tokens (position r is its token s·b + r − off):
    k [BT, BDK] and v [BT, BDV] (fp32, 0 outside the sequence), the gates log a, β [BT] (0 outside) and ν [BT] (1
    outside), the token rows' offsets, their validity and the [BT, BDV] mask of o."""
    r = tl.arange(0, BT)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    t = s * BT + r - off
    valid = (t >= 0) & (t < T)
    row = bos + tl.where(valid, t, 0)
    i_hq = i_h // (H // HQ)
    mk = valid[:, None] & (ck < DK)[None, :]
    mv = valid[:, None] & (cv < DV)[None, :]
    kk = tl.load(k + (row[:, None] * HQ + i_hq) * DK + ck[None, :], mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
    gate = row * H + i_h
    lg = tl.load(g + gate, mask=valid, other=0.0).to(tl.float32)
    eta = tl.load(beta + gate, mask=valid, other=0.0).to(tl.float32)
    nn = tl.load(nu + gate, mask=valid, other=1.0).to(tl.float32)
    return kk, vv, lg, eta, nn, row, valid, mv


@triton.jit
def _rows_e(es, slot, BT: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr):
    """The stored e [BT, BDV] of anchor slot row `slot` (`_state_kernel`'s; 0 in the padded columns)."""
    r = tl.arange(0, BT)
    cv = tl.arange(0, BDV)
    return tl.load(es + slot * (BT * DV) + r[:, None] * DV + cv[None, :], mask=(cv < DV)[None, :], other=0.0)


@triton.jit
def _coefficients(lg, eta, nn, valid, BT: tl.constexpr, PREC: tl.constexpr):
    """The segment's coefficients from its gates log a, β, ν [BT] and its rows' validity (module doc): per row A_t,
    c_t [BT], the matrix C [BT, BT], and the last row's A_L, N_L, c_L (scalars), C_L, Cm_L [BT]."""
    r = tl.arange(0, BT)
    tri = r[:, None] >= r[None, :]
    la = tl.sum(tl.where(tri, lg[None, :], 0.0), axis=1)  # log A_t (an inclusive cumsum)
    ln = tl.sum(tl.where(tri, tl.log(tl.maximum(nn, _TINY))[None, :], 0.0), axis=1)  # log N_t
    # A_t / A_u for u ≤ t and u a token of the segment (a padded row adds no m_u to θ)
    Ra = tl.where(tri & valid[None, :], tl.exp(tl.where(tri, la[:, None] - la[None, :], 0.0)), 0.0)
    Cm = tl.where(tri, -eta[None, :] * tl.exp(tl.where(tri, ln[:, None] - ln[None, :], 0.0)), 0.0)
    C = tl.dot(Ra, Cm, input_precision=PREC)
    Nt = tl.exp(ln)
    At = tl.exp(la)
    ct = tl.sum(Ra * Nt[None, :], axis=1)
    end = r == BT - 1
    C_L = tl.sum(tl.where(end[:, None], C, 0.0), axis=0)
    Cm_L = tl.sum(tl.where(end[:, None], Cm, 0.0), axis=0)
    A_L = tl.sum(tl.where(end, At, 0.0), axis=0)
    N_L = tl.sum(tl.where(end, Nt, 0.0), axis=0)
    c_L = tl.sum(tl.where(end, ct, 0.0), axis=0)
    return At, ct, C, A_L, N_L, c_L, C_L, Cm_L


@triton.jit
def _hidden(f0, ck, ckm, cv, cvm, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BF: tl.constexpr):
    """Hidden tile f0's indices fc [BF], mask fm, and within one (sequence, head) the offsets o1 [BDK, BF] of a
    [K, F] matrix's tile and o2 [BF, BDV] of an [F, V] one's, with their masks m1, m2."""
    fc = f0 + tl.arange(0, BF)
    fm = fc < F
    return fc, fm, ck[:, None] * F + fc[None, :], fc[:, None] * DV + cv[None, :], ckm[:, None] & fm[None, :], \
        fm[:, None] & cvm[None, :]


@triton.jit
def _anchor(A1_0, A2_0, i_a, W1, W2, i_w, s, o1, o2, m1, m2, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr,
            HAS_A: tl.constexpr):
    """The anchor's tiles (U1 [BDK, BF], U2 [BF, BDV]) in mini-batch s: the carried anchor's (row i_a of A1_0, A2_0)
    in the first mini-batch of a call with offset > 0 (HAS_A), else the segment's start weights' (row i_w of W1, W2).
    (A branch, not a select between two masked loads: one read in flight; sm_90's build of the select at K = 128,
    4 warps, bf16 spilled 17.7 KB.)"""
    if HAS_A:
        if s == 0:
            U1 = tl.load(A1_0 + i_a * (DK * F) + o1, mask=m1, other=0.0)
            U2 = tl.load(A2_0 + i_a * (F * DV) + o2, mask=m2, other=0.0)
        else:
            U1 = tl.load(W1 + i_w * (DK * F) + o1, mask=m1, other=0.0)
            U2 = tl.load(W2 + i_w * (F * DV) + o2, mask=m2, other=0.0)
    else:
        U1 = tl.load(W1 + i_w * (DK * F) + o1, mask=m1, other=0.0)
        U2 = tl.load(W2 + i_w * (F * DV) + o2, mask=m2, other=0.0)
    return U1, U2


@triton.jit
def _state_tiles(W1, W2, M1, M2, i_w, o1, o2, m1, m2, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr):
    """One hidden tile of (W1, M1) [BDK, BF] and (W2, M2) [BF, BDV] at row i_w; 0 outside the masks."""
    p1 = i_w * (DK * F) + o1
    p2 = i_w * (F * DV) + o2
    return tl.load(W1 + p1, mask=m1, other=0.0), tl.load(M1 + p1, mask=m1, other=0.0), \
        tl.load(W2 + p2, mask=m2, other=0.0), tl.load(M2 + p2, mask=m2, other=0.0)


@triton.jit
def _tile_z(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC: tl.constexpr):
    """One hidden tile of the anchor's side and the read's first layer before its GELU: (Z, Hd, σ'(Z), e U2ᵀ, dz,
    X W1_s, X M1_s, z1), each [BT, BF]."""
    Z = tl.dot(kk, U1, input_precision=PREC)
    Hd, dg = _gelu(Z)
    g1 = tl.dot(e, tl.trans(U2), input_precision=PREC)
    dz = g1 * dg
    P1 = tl.dot(x, w1, input_precision=PREC)
    Q1 = tl.dot(x, mm1, input_precision=PREC)
    z1 = At[:, None] * P1 + ct[:, None] * Q1 + tl.dot(X1, dz, input_precision=PREC)
    return Z, Hd, dg, g1, dz, P1, Q1, z1


@triton.jit
def _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC: tl.constexpr):
    """One hidden tile of the anchor's side and the read's first layer: (Z, Hd, σ'(Z), e U2ᵀ, dz, X W1_s, X M1_s,
    h, σ'(z1)), each [BT, BF]."""
    Z, Hd, dg, g1, dz, P1, Q1, z1 = _tile_z(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
    h, dh = _gelu(z1)
    return Z, Hd, dg, g1, dz, P1, Q1, h, dh


@triton.jit
def _kept_rows(kv, ks, slot, BT: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr):
    """What the forward kept of mini-batch slot `slot` (KEEP ≥ 1): e, h W2_s, h M2_s [BT, BDV] (0 in the padded
    columns) and h Hdᵀ [BT, BT]."""
    r = tl.arange(0, BT)
    cv = tl.arange(0, BDV)
    pv = (slot * 3 * BT + r[:, None]) * DV + cv[None, :]
    mv = (cv < DV)[None, :]
    S2 = tl.load(ks + (slot * BT + r[:, None]) * BT + r[None, :])
    return tl.load(kv + pv, mask=mv, other=0.0), tl.load(kv + pv + BT * DV, mask=mv, other=0.0), \
        tl.load(kv + pv + 2 * BT * DV, mask=mv, other=0.0), S2


@triton.jit
def _kept_tile(kt, slot, zr, fc, fm, F: tl.constexpr, BT: tl.constexpr, J: tl.constexpr):
    """Array J of the forward's kept [BT, F] tiles of mini-batch slot `slot` (KEEP 2; J: 0 Z, 1 e U2ᵀ, 2 z1,
    3 X W1_s, 4 X M1_s) at hidden tile fc [BF] (zr: r[:, None] · F)."""
    return tl.load(kt + (slot * 5 + J) * (BT * F) + zr + fc[None, :], mask=fm[None, :], other=0.0)


@triton.jit
def _pass_f(kk, vv, mv, A1_0, A2_0, i_a, W1, W2, i_w, s, ck, ckm, cv, cvm, DK: tl.constexpr, DV: tl.constexpr,
            F: tl.constexpr, BT: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
            HAS_A: tl.constexpr):
    """e = M_θ₀(K) − V [BT, BDV] at the anchor (`_anchor`), over the hidden tiles; 0 outside the rows and columns."""
    f = tl.zeros([BT, BDV], dtype=tl.float32)
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        U1, U2 = _anchor(A1_0, A2_0, i_a, W1, W2, i_w, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
        Hd, _ = _gelu(tl.dot(kk, U1, input_precision=PREC))
        f += tl.dot(Hd, U2, input_precision=PREC)
    return tl.where(mv, f - vv, 0.0)


@triton.jit(do_not_specialize=["NS"])
def _fwd_kernel(q, k, v, g, beta, nu, W1_0, W2_0, M1_0, M2_0, A1_0, A2_0, o, W1, W2, M1, M2, A1o, A2o,
                sw1, sw2, sm1, sm2, kv, ks, kt, cu, slots, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BF: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr, SAVE: tl.constexpr,
                IS_VARLEN: tl.constexpr, KEEP: tl.constexpr = 0):
    # W1, W2, M1, M2 [R·H, ·]: the final state's outputs, the running state (filled with the initial one first);
    # with SAVE, sw1, sw2, sm1, sm2 [slots·H, ·]: every mini-batch's start state, for the backward; with SAVE and
    # KEEP ≥ 1 also kv [slots·H, 3, BT, V] (e, h W2_s, h M2_s) and ks [slots·H, BT, BT] (h Hdᵀ), with KEEP 2 kt
    # [slots·H, 5, BT, F] (Z, e U2ᵀ, z1, X W1_s, X M1_s): what the backward reads instead of recomputing
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H  # i_b: the sequence (batch row, or cu_seqlens's)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    empty = ns == 0  # a sequence of no mini-batch (varlen's empty one, no carried mini-batch): its anchor as it was
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        p1 = i_bh * (DK * F) + o1
        p2 = i_bh * (F * DV) + o2
        tl.store(W1 + p1, tl.load(W1_0 + p1, mask=m1, other=0.0), mask=m1)
        tl.store(M1 + p1, tl.load(M1_0 + p1, mask=m1, other=0.0), mask=m1)
        tl.store(W2 + p2, tl.load(W2_0 + p2, mask=m2, other=0.0), mask=m2)
        tl.store(M2 + p2, tl.load(M2_0 + p2, mask=m2, other=0.0), mask=m2)
        tl.store(A1o + p1, tl.load(A1_0 + p1, mask=m1 & empty, other=0.0), mask=m1 & empty)
        tl.store(A2o + p2, tl.load(A2_0 + p2, mask=m2 & empty, other=0.0), mask=m2 & empty)
    for s in range(0, ns):
        tl.debug_barrier()  # the previous mini-batch's (or the copy's) stores before this one's loads
        last = s == ns - 1
        x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                       BDK, BDV, BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        # pass 1: e = ∂ℓ/∂f at the anchor
        e = _pass_f(kk, vv, mv, A1_0, A2_0, i_bh, W1, W2, i_bh, s, ck, ckm, cv, cvm, DK, DV, F, BT, BDV, BF,
                    PREC, HAS_A)
        X1 = C * tl.dot(x, tl.trans(kk), input_precision=PREC)  # C ∘ X Kᵀ
        zW = tl.zeros([BT, BDV], dtype=tl.float32)  # h W2_s
        zM = tl.zeros([BT, BDV], dtype=tl.float32)  # h M2_s
        S2 = tl.zeros([BT, BT], dtype=tl.float32)  # h Hdᵀ
        eC = e * C_L[:, None]
        eM = e * Cm_L[:, None]
        slot = (slot0 + s) * H + i_h
        r = tl.arange(0, BT)
        pv = (slot * 3 * BT + r[:, None]) * DV + cv[None, :]  # kv's rows (KEEP ≥ 1)
        zr = r[:, None] * F  # + fc[None, :]: kt's rows (KEEP 2)
        if SAVE:
            if KEEP >= 1:
                tl.store(kv + pv, e, mask=cvm[None, :])
        # pass 2: per hidden tile, dz, the read's first layer, o's accumulators, and the tile's end state
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(W1, W2, M1, M2, i_bh, o1, o2, m1, m2, DK, DV, F)
            if SAVE:
                tl.store(sw1 + slot * (DK * F) + o1, w1, mask=m1)
                tl.store(sm1 + slot * (DK * F) + o1, mm1, mask=m1)
                tl.store(sw2 + slot * (F * DV) + o2, w2, mask=m2)
                tl.store(sm2 + slot * (F * DV) + o2, mm2, mask=m2)
            U1, U2 = w1, w2
            if HAS_A:
                if s == 0:  # the carried anchor (a branch, as `_anchor`'s)
                    U1 = tl.load(A1_0 + p1, mask=m1, other=0.0)
                    U2 = tl.load(A2_0 + p2, mask=m2, other=0.0)
            Z, Hd, dg, g1, dz, P1, Q1, z1 = _tile_z(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
            h, dh = _gelu(z1)
            if SAVE:
                if KEEP >= 2:
                    kp = kt + slot * 5 * (BT * F) + zr + fc[None, :]
                    tl.store(kp, Z, mask=fm[None, :])
                    tl.store(kp + BT * F, g1, mask=fm[None, :])
                    tl.store(kp + 2 * BT * F, z1, mask=fm[None, :])
                    tl.store(kp + 3 * BT * F, P1, mask=fm[None, :])
                    tl.store(kp + 4 * BT * F, Q1, mask=fm[None, :])
            zW += tl.dot(h, w2, input_precision=PREC)
            zM += tl.dot(h, mm2, input_precision=PREC)
            S2 += tl.dot(h, tl.trans(Hd), input_precision=PREC)
            # the call's last mini-batch: its anchor out
            tl.store(A1o + p1, U1, mask=m1 & last)
            tl.store(A2o + p2, U2, mask=m2 & last)
            kT = tl.trans(kk)
            HT = tl.trans(Hd)
            tl.store(W1 + p1, A_L * w1 + c_L * mm1 + tl.dot(kT, dz * C_L[:, None], input_precision=PREC), mask=m1)
            tl.store(M1 + p1, N_L * mm1 + tl.dot(kT, dz * Cm_L[:, None], input_precision=PREC), mask=m1)
            tl.store(W2 + p2, A_L * w2 + c_L * mm2 + tl.dot(HT, eC, input_precision=PREC), mask=m2)
            tl.store(M2 + p2, N_L * mm2 + tl.dot(HT, eM, input_precision=PREC), mask=m2)
        out = At[:, None] * zW + ct[:, None] * zM + tl.dot(C * S2, e, input_precision=PREC)
        tl.store(o + (row[:, None] * H + i_h) * DV + cv[None, :], out.to(o.dtype.element_ty), mask=mv)
        if SAVE:
            if KEEP >= 1:
                tl.store(kv + pv + BT * DV, zW, mask=cvm[None, :])
                tl.store(kv + pv + 2 * BT * DV, zM, mask=cvm[None, :])
                tl.store(ks + (slot * BT + r[:, None]) * BT + r[None, :], S2)


@triton.jit
def _gelu2(z):
    """σ''(z) of GELU's erf form: φ(z) (2 − z²)."""
    return tl.exp(-0.5 * z * z) * _RSQRT2PI * (2.0 - z * z)


@triton.jit
def _coefficients_back(lg, eta, nn, valid, dAt, dct, dC, dA_L, dN_L, dc_L, dC_L, dCm_L, BT: tl.constexpr,
                       PREC: tl.constexpr):
    """`_coefficients`'s backward: from the gradients of A_t, c_t [BT], C [BT, BT], A_L, N_L, c_L (scalars) and C_L,
    Cm_L [BT] to those of the gates: (d log a, dβ, dν) [BT]."""
    r = tl.arange(0, BT)
    tri = r[:, None] >= r[None, :]
    end = r == BT - 1
    la = tl.sum(tl.where(tri, lg[None, :], 0.0), axis=1)
    ln = tl.sum(tl.where(tri, tl.log(tl.maximum(nn, _TINY))[None, :], 0.0), axis=1)
    Ra = tl.where(tri & valid[None, :], tl.exp(tl.where(tri, la[:, None] - la[None, :], 0.0)), 0.0)
    Rn = tl.where(tri, tl.exp(tl.where(tri, ln[:, None] - ln[None, :], 0.0)), 0.0)
    Cm = -eta[None, :] * Rn
    Nt = tl.exp(ln)
    At = tl.exp(la)
    # the last rows: C_L, Cm_L, A_L, N_L, c_L
    dC = dC + tl.where(end[:, None], dC_L[None, :], 0.0)
    dCm = tl.where(end[:, None], dCm_L[None, :], 0.0)
    dAt = dAt + tl.where(end, dA_L, 0.0)
    dct = dct + tl.where(end, dc_L, 0.0)
    # C = R_A Cm,  c_t = Σ_u (R_A)_tu N_u
    dRa = tl.dot(dC, tl.trans(Cm), input_precision=PREC) + dct[:, None] * Nt[None, :]
    dCm += tl.dot(tl.trans(Ra), dC, input_precision=PREC)
    dNt = tl.where(end, dN_L, 0.0) + tl.sum(Ra * dct[:, None], axis=0)
    # R_A = mask · exp(log A_t − log A_u), A_t = exp(log A_t)
    GRa = dRa * Ra
    dla = tl.sum(GRa, axis=1) - tl.sum(GRa, axis=0) + dAt * At
    # Cm_tj = −β_j (R_N)_tj, R_N = mask · exp(log N_t − log N_j), N_t = exp(log N_t)
    dbeta = -tl.sum(dCm * Rn, axis=0)
    GRn = dCm * Cm
    dln = tl.sum(GRn, axis=1) - tl.sum(GRn, axis=0) + dNt * Nt
    # the inclusive cumsums: Σ_{t ≥ τ}
    dlg = tl.sum(tl.where(tri, dla[:, None], 0.0), axis=0)
    dnu = tl.where(nn > _TINY, tl.sum(tl.where(tri, dln[:, None], 0.0), axis=0) / nn, 0.0)
    return dlg, dbeta, dnu


@triton.jit(do_not_specialize=["NS"])
def _bwd_kernel(q, k, v, g, beta, nu, A1_0, A2_0, sw1, sw2, sm1, sm2, do, GW1, GW2, GM1, GM2, GA1, GA2,
                dq, dk, dv, dg_ptr, dbeta, dnu, dZs, kv, ks, kt, cu, slots, scale, T, off, NS, H: tl.constexpr,
                HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BDK: tl.constexpr,
                BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr,
                IS_VARLEN: tl.constexpr, KEEP: tl.constexpr = 0):
    # GW1, GW2, GM1, GM2 [R·H, ·]: seeded with the final state's gradients, rewritten in place mini-batch by
    # mini-batch (in reverse) to the gradients of each one's start state: at the end, the initial state's. GA1, GA2:
    # seeded with the final anchor's gradient; the last mini-batch moves it to its start weights' unless its anchor is
    # the carried one, whose gradient they accumulate. dZs [R·H, BT, F]: ∂/∂Z between passes C and D.
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    zs = i_bh * (BT * F) + r[:, None] * F  # + fc[None, :]: the scratch rows
    zr = r[:, None] * F  # + fc[None, :]: kt's rows (KEEP 2)
    # kv, ks, kt: what the forward kept (`_fwd_kernel`; KEEP ≥ 1: no pass A or B; KEEP 2: no read recomputed)
    for si in range(0, ns):
        tl.debug_barrier()  # the previous (later) mini-batch's gradient stores before this one's loads
        s = ns - 1 - si
        slot = (slot0 + s) * H + i_h
        carried = s < 0
        if HAS_A:
            carried = s == 0
        fresh = carried == 0
        lastmb = si == 0
        x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                       BDK, BDV, BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        if KEEP >= 1:  # e and the read's sums as the forward formed them
            e, P2, Q2, S2 = _kept_rows(kv, ks, slot, BT, DV, BDV)
            S1 = tl.dot(x, tl.trans(kk), input_precision=PREC)
            X1 = C * S1
        else:
            # pass A: e at the anchor
            e = _pass_f(kk, vv, mv, A1_0, A2_0, i_bh, sw1, sw2, slot, s, ck, ckm, cv, cvm, DK, DV, F, BT, BDV, BF,
                        PREC, HAS_A)
            S1 = tl.dot(x, tl.trans(kk), input_precision=PREC)
            X1 = C * S1
            # pass B: the read's sums over the hidden dim, h W2_s, h M2_s, h Hdᵀ
            P2 = tl.zeros([BT, BDV], dtype=tl.float32)
            Q2 = tl.zeros([BT, BDV], dtype=tl.float32)
            S2 = tl.zeros([BT, BT], dtype=tl.float32)
            for f0 in range(0, F, BF):
                fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
                w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
                U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
                Z, Hd, dg, g1, dz, P1, Q1, h, dh = _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
                P2 += tl.dot(h, w2, input_precision=PREC)
                Q2 += tl.dot(h, mm2, input_precision=PREC)
                S2 += tl.dot(h, tl.trans(Hd), input_precision=PREC)
        # o = A ⊙ P2 + c ⊙ Q2 + (C ∘ S2) e
        dO = tl.load(do + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        dAt = tl.sum(dO * P2, axis=1)
        dct = tl.sum(dO * Q2, axis=1)
        Ee = tl.dot(dO, tl.trans(e), input_precision=PREC)  # do_t · e_j
        dC = Ee * S2
        dS2 = Ee * C
        de = tl.dot(tl.trans(C * S2), dO, input_precision=PREC)
        Ado = At[:, None] * dO
        cdo = ct[:, None] * dO
        eC = e * C_L[:, None]
        eM = e * Cm_L[:, None]
        D1 = tl.zeros([BT, BT], dtype=tl.float32)  # dz1 dzᵀ
        dX = tl.zeros([BT, BDK], dtype=tl.float32)
        dK = tl.zeros([BT, BDK], dtype=tl.float32)
        HG2 = tl.zeros([BT, BDV], dtype=tl.float32)  # Hd GW2_e
        HM2 = tl.zeros([BT, BDV], dtype=tl.float32)  # Hd GM2_e
        dC_L = tl.zeros([BT], dtype=tl.float32)
        dCm_L = tl.zeros([BT], dtype=tl.float32)
        sAL = tl.zeros([BF], dtype=tl.float32)  # per hidden unit, summed after the loop: dA_L, dc_L, dN_L
        scL = tl.zeros([BF], dtype=tl.float32)
        sNL = tl.zeros([BF], dtype=tl.float32)
        # pass C: per hidden tile, the read's and the end state's gradients; the start state's gradient but for the
        # anchor's f-side (pass D)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
            gw1, gm1, gw2, gm2 = _state_tiles(GW1, GW2, GM1, GM2, i_bh, o1, o2, m1, m2, DK, DV, F)
            if KEEP >= 2:  # the read's tile as the forward formed it (U1 unused here: its load is dead)
                Z = _kept_tile(kt, slot, zr, fc, fm, F, BT, 0)
                g1 = _kept_tile(kt, slot, zr, fc, fm, F, BT, 1)
                P1 = _kept_tile(kt, slot, zr, fc, fm, F, BT, 3)
                Q1 = _kept_tile(kt, slot, zr, fc, fm, F, BT, 4)
                Hd, dg = _gelu(Z)
                dz = g1 * dg
                h, dh = _gelu(_kept_tile(kt, slot, zr, fc, fm, F, BT, 2))
            else:
                Z, Hd, dg, g1, dz, P1, Q1, h, dh = _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
            # the read's second layer through h, and Hd's uses but f's
            dz1 = (tl.dot(Ado, tl.trans(w2), input_precision=PREC) + tl.dot(cdo, tl.trans(mm2), input_precision=PREC)
                   + tl.dot(dS2, Hd, input_precision=PREC)) * dh
            dHd = tl.dot(tl.trans(dS2), h, input_precision=PREC) + tl.dot(eC, tl.trans(gw2), input_precision=PREC) \
                + tl.dot(eM, tl.trans(gm2), input_precision=PREC)
            HG2 += tl.dot(Hd, gw2, input_precision=PREC)
            HM2 += tl.dot(Hd, gm2, input_precision=PREC)
            # the read's first layer z1 = A ⊙ X W1_s + c ⊙ X M1_s + (C ∘ X Kᵀ) dz
            dAt += tl.sum(dz1 * P1, axis=1)
            dct += tl.sum(dz1 * Q1, axis=1)
            Adz1 = At[:, None] * dz1
            cdz1 = ct[:, None] * dz1
            dX += tl.dot(Adz1, tl.trans(w1), input_precision=PREC) + tl.dot(cdz1, tl.trans(mm1), input_precision=PREC)
            D1 += tl.dot(dz1, tl.trans(dz), input_precision=PREC)
            # dz's uses: the read, W1_e and M1_e
            KG1 = tl.dot(kk, gw1, input_precision=PREC)
            KM1 = tl.dot(kk, gm1, input_precision=PREC)
            ddz = tl.dot(tl.trans(X1), dz1, input_precision=PREC) + C_L[:, None] * KG1 + Cm_L[:, None] * KM1
            dC_L += tl.sum(KG1 * dz, axis=1)
            dCm_L += tl.sum(KM1 * dz, axis=1)
            dK += tl.dot(dz * C_L[:, None], tl.trans(gw1), input_precision=PREC) \
                + tl.dot(dz * Cm_L[:, None], tl.trans(gm1), input_precision=PREC)
            # dz = (e U2ᵀ) ⊙ σ'(Z), Hd = σ(Z)
            dg1 = ddz * dg
            de += tl.dot(dg1, U2, input_precision=PREC)
            dU2 = tl.dot(tl.trans(dg1), e, input_precision=PREC)
            tl.store(dZs + zs + fc[None, :], ddz * g1 * _gelu2(Z) + dHd * dg, mask=fm[None, :])
            # the end state's scalars
            sAL += tl.sum(gw1 * w1, axis=0) + tl.sum(gw2 * w2, axis=1)
            scL += tl.sum(gw1 * mm1, axis=0) + tl.sum(gw2 * mm2, axis=1)
            sNL += tl.sum(gm1 * mm1, axis=0) + tl.sum(gm2 * mm2, axis=1)
            # the start state's gradients (the anchor's f-side in pass D); the final anchor's gradient moves to the
            # last mini-batch's start weights when they are its anchor
            ga1 = tl.load(GA1 + p1, mask=m1 & lastmb & fresh, other=0.0)
            ga2 = tl.load(GA2 + p2, mask=m2 & lastmb & fresh, other=0.0)
            tl.store(GA1 + p1, tl.zeros_like(ga1), mask=m1 & lastmb & fresh)
            tl.store(GA2 + p2, tl.zeros_like(ga2), mask=m2 & lastmb & fresh)
            tl.store(GW1 + p1, A_L * gw1 + tl.dot(tl.trans(x), Adz1, input_precision=PREC) + ga1, mask=m1)
            tl.store(GM1 + p1, c_L * gw1 + N_L * gm1 + tl.dot(tl.trans(x), cdz1, input_precision=PREC), mask=m1)
            tl.store(GW2 + p2, A_L * gw2 + tl.dot(tl.trans(h), Ado, input_precision=PREC) + ga2
                     + tl.where(fresh, dU2, 0.0), mask=m2)
            tl.store(GM2 + p2, c_L * gw2 + N_L * gm2 + tl.dot(tl.trans(h), cdo, input_precision=PREC), mask=m2)
            if HAS_A:
                tl.store(GA2 + p2, tl.load(GA2 + p2, mask=m2 & carried, other=0.0) + dU2, mask=m2 & carried)
        tl.debug_barrier()  # the scratch and the gradients' stores before pass D reads them
        de += C_L[:, None] * HG2 + Cm_L[:, None] * HM2
        dC_L += tl.sum(HG2 * e, axis=1)
        dCm_L += tl.sum(HM2 * e, axis=1)
        dC += D1 * S1
        dS1 = D1 * C
        dX += tl.dot(dS1, kk, input_precision=PREC)
        dK += tl.dot(tl.trans(dS1), x, input_precision=PREC)
        df = tl.where(mv, de, 0.0)  # e = f − V
        # pass D: f = Hd U2, Hd = σ(Z), Z = K U1 — the anchor's gradient (the start weights', or the carried one's)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
            if KEEP >= 2:
                Hd, dg = _gelu(_kept_tile(kt, slot, zr, fc, fm, F, BT, 0))
            else:
                Hd, dg = _gelu(tl.dot(kk, U1, input_precision=PREC))
            dZ = tl.load(dZs + zs + fc[None, :], mask=fm[None, :], other=0.0) \
                + tl.dot(df, tl.trans(U2), input_precision=PREC) * dg
            dU1 = tl.dot(tl.trans(kk), dZ, input_precision=PREC)
            dU2 = tl.dot(tl.trans(Hd), df, input_precision=PREC)
            dK += tl.dot(dZ, tl.trans(U1), input_precision=PREC)
            tl.store(GW1 + p1, tl.load(GW1 + p1, mask=m1 & fresh, other=0.0) + dU1, mask=m1 & fresh)
            tl.store(GW2 + p2, tl.load(GW2 + p2, mask=m2 & fresh, other=0.0) + dU2, mask=m2 & fresh)
            if HAS_A:
                tl.store(GA1 + p1, tl.load(GA1 + p1, mask=m1 & carried, other=0.0) + dU1, mask=m1 & carried)
                tl.store(GA2 + p2, tl.load(GA2 + p2, mask=m2 & carried, other=0.0) + dU2, mask=m2 & carried)
        dlg, dbt, dnv = _coefficients_back(lg, eta, nn, valid, dAt, dct, dC, tl.sum(sAL, axis=0),
                                           tl.sum(sNL, axis=0), tl.sum(scL, axis=0), dC_L, dCm_L, BT, PREC)
        # per value head: the glue sums dq, dk over grouped heads
        hk = (row[:, None] * H + i_h) * DK + ck[None, :]
        mk = valid[:, None] & ckm[None, :]
        tl.store(dq + hk, (dX * scale).to(dq.dtype.element_ty), mask=mk)
        tl.store(dk + hk, dK.to(dk.dtype.element_ty), mask=mk)
        tl.store(dv + (row[:, None] * H + i_h) * DV + cv[None, :], (-df).to(dv.dtype.element_ty), mask=mv)
        gate = row * H + i_h
        tl.store(dg_ptr + gate, dlg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.store(dbeta + gate, dbt.to(dbeta.dtype.element_ty), mask=valid)
        tl.store(dnu + gate, dnv.to(dnu.dtype.element_ty), mask=valid)


class _Titans(torch.autograd.Function):
    """Forward: `_fwd_kernel`; backward: `_bwd_kernel`. q, k [B, T, H_q, K], v [B, T, H, V], g, beta, nu [B, T, H],
    the state W1, W2, M1, M2 and the anchor A1, A2 ([R, H, K, F] / [R, H, F, V], fp32; the anchor is the weights
    themselves when offset is 0), then scale, offset, save (keep every mini-batch's start state for a backward), cu
    (int32 [N+1] on the device, or None), the `ttt._Plan` and the kernels' constexprs. Returns (o [B, T, H, V] in v's
    dtype, the end W1, W2, M1, M2 and the last mini-batch's anchor A1, A2, fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, scale, offset, save, cu, plan, geo):
        B, T = q.shape[:2]
        R, H = W1.shape[:2]
        f32 = dict(dtype=torch.float32, device=q.device)
        o = empty_output(B, T, H, v.shape[-1], dtype=v.dtype, device=q.device)
        outs = [empty_output(*t.shape, **f32) for t in (W1, W2, M1, M2, A1, A2)]
        n = max(plan.slots, 1)
        slots = [empty_output(n, *t.shape[1:], **f32) for t in (W1, W2, M1, M2)] if save else [o] * 4
        # util.LAUNCH "titans_single_bwd" KEEP: what the forward keeps for the backward beside the start states
        # (`kernels.variants.titans_single_backward`: the branch that names it)
        keep = titans_single_backward(table()).keep if save else 0
        BT, DV, F = geo["BT"], geo["DV"], A1.shape[-1]
        kept = [empty_output(n, H, 3, BT, DV, **f32) if keep >= 1 else o,  # e, h W2_s, h M2_s
                empty_output(n, H, BT, BT, **f32) if keep >= 1 else o,  # h Hdᵀ
                empty_output(n, H, 5, BT, F, **f32) if keep >= 2 else o]  # Z, e U2ᵀ, z1, X W1_s, X M1_s
        seq = (cu if cu is not None else o, plan.first if plan.first is not None else o)
        _fwd_kernel[(R * H,)](q, k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, o, *outs, *slots, *kept, *seq, scale, T,
                              offset, plan.NS, **geo, HAS_A=offset > 0, SAVE=save, IS_VARLEN=cu is not None, KEEP=keep,
                              **launch("titans_single_fwd"))
        if save:
            ctx.save_for_backward(q, k, v, g, beta, nu, A1, A2, *slots, *(t for t in kept if t is not o),
                                  *(t for t in seq if t is not o))
        ctx.geo, ctx.scale, ctx.offset, ctx.plan, ctx.varlen = geo, scale, offset, plan, cu is not None
        ctx.keep = keep
        return (o, *outs)

    @staticmethod
    def backward(ctx, do, *gouts):
        q, k, v, g, beta, nu, A1, A2, *rest = ctx.saved_tensors
        nk = (0, 2, 3)[ctx.keep]
        slots, kept, seq = rest[:4], rest[4:4 + nk], rest[4 + nk:]
        B, T, Hq, K = q.shape
        H, V = v.shape[2:]
        R = ctx.plan.R
        f32 = dict(dtype=torch.float32, device=q.device)
        shapes = [(R, H, K, A1.shape[-1]), (R, H, A1.shape[-1], V)] * 3

        def grad_in(t, shape):  # a fresh fp32 buffer: the kernel rewrites it in place
            return torch.zeros(shape, **f32) if t is None else t.to(torch.float32, copy=True).contiguous()

        do = torch.zeros(B, T, H, V, **f32) if do is None else do.contiguous()
        G = [grad_in(t, shape) for t, shape in zip(gouts, shapes)]  # W1, W2, M1, M2, then the anchor's A1, A2
        dq, dk = (empty_output(B, T, H, K, **f32) for _ in range(2))
        dv = empty_output(B, T, H, V, **f32)
        dg, dbeta, dnu = (empty_output(B, T, H, **f32) for _ in range(3))
        dZs = torch.empty(R * H, ctx.geo["BT"], A1.shape[-1], **f32)  # each program's [b, F] scratch
        seq = seq if seq else (dq, dq)
        kept = [*kept, *[dq] * (3 - len(kept))]
        _bwd_kernel[(R * H,)](q, k, v, g, beta, nu, A1, A2, *slots, do, *G, dq, dk, dv, dg, dbeta, dnu, dZs, *kept,
                              *seq, ctx.scale, T, ctx.offset, ctx.plan.NS, **ctx.geo, HAS_A=ctx.offset > 0,
                              IS_VARLEN=ctx.varlen, KEEP=ctx.keep, **launch("titans_single_bwd"))
        if Hq != H:  # grouped heads: the value heads of one q/k head summed
            dq = dq.view(B, T, Hq, H // Hq, K).sum(3)
            dk = dk.view(B, T, Hq, H // Hq, K).sum(3)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                dnu.to(nu.dtype), *G, None, None, None, None, None, None)
