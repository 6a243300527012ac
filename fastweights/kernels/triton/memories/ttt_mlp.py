"""TTT-MLP's inner mini-batch loop (`chunkwise.minibatch` for the recipe `ttt_mlp`) in one Triton program per
(sequence, value head), each way: the design of `ttt.py` (TTT-Linear's kernels) for a two-layer memory.

The memory (Sun et al. 2024): a 2-layer MLP inside TTT's residual LayerNorm over the value dim D (K = V = D),
hidden width F (4D in the zoo), σ = GELU (tanh form):

    f(x) = σ(x W1 + b1) W2 + b2,   M(x) = x + γ ⊙ LN(f(x)) + β_ln     (W1 [D, F], b1 [F], W2 [F, D], b2 [D])

inner loss ½‖M(k) − v‖², mini-batches of b tokens aligned to the sequence start, TTT's averaged gd: every
gradient of a mini-batch at its anchor θ₀ = (A1, a1, A2, a2), and each weight at the i-th token is
θ₀ + P_i / i with P_i = P_0 − Σ_{j ≤ i} η_j ∇ℓ_j(θ₀) (P_0 = o (θ_s − θ₀) for the o tokens of a mini-batch
consumed before the call, else 0), as for TTT-Linear. At the anchor, per token (rows [b, ·] of a mini-batch):

    Z1 = K A1 + a1,  H = σ(Z1),  f = H A2 + a2                          [b, F], [b, F], [b, D]
    n = LN(f),  dy = (K + β_ln − V) + γ ⊙ n,  e = LN'(γ ⊙ dy)           ∂ℓ/∂f (as TTT-Linear's e)   [b, D]
    dz1 = (e A2ᵀ) ⊙ σ'(Z1)                                             ∂ℓ/∂Z1                       [b, F]
    ∇_{W2} = Hᵀ e,  ∇_{b2} = Σ e,  ∇_{W1} = Kᵀ dz1,  ∇_{b1} = Σ dz1

and the read at the queries x = scale·q, layer by layer in the dual form (no per-token weight is formed):

    z1 = x A1 + a1 + (x P1_0 + p1_0) / i − M1 dz1,   M1_tj = [j ≤ t] η_j (x_t · k_j + 1) / i_t,   h = σ(z1)
    z2 = h A2 + a2 + (h P2_0 + p2_0) / i − M2 e,     M2_tj = [j ≤ t] η_j (h_t · H_j + 1) / i_t
    o  = x + γ ⊙ LN(z2) + β_ln

The end sums P1 = P1_0 − Kᵀ (η ⊙ dz1), p1 = p1_0 − Σ η dz1, P2 = P2_0 − Hᵀ (η ⊙ e), p2 = p2_0 − Σ η e; the next
anchor is θ₀ + P / b.

Where the weights live. W1 and W2 are D·F fp32 each (64 KiB each at D = 64, F = 256): too large for one
program's registers. They stay in a per-program global scratch (L2-resident: 2·D·F·4 bytes per (sequence,
head)), and every pass over the hidden dim streams them in tiles of BF hidden units ([D, BF] of W1, [BF, D] of
W2). The scratch IS the anchor store of the backward: with SAVE (a backward is wanted) mini-batch s reads its
anchor from slot s and writes the next anchor into slot s + 1 (one slot per mini-batch: 4(2DF + F + D) bytes
per mini-batch, ≈ 32D²/b bytes a token at F = 4D); without it, one slot per (sequence, head), rolled in place
(a tile is written only after it is read, and each value written depends on the one read at its place, so no
thread overwrites a value another has yet to read). Other threads read what one wrote only in a later pass or
mini-batch: a `tl.debug_barrier` (bar.sync: the CTA's global writes before it are visible after it) separates
them, and the launch keeps num_stages = 1 (no software pipelining, whose prefetches could run ahead of the
barrier). The per-token work that needs the whole hidden dim — f and h_t · H_j (sums over F) — is accumulated
over the tiles; everything [b, D] or [b, b] stays in registers.

Forward (`_fwd_kernel`), per mini-batch: pass 1 over the tiles accumulates f; e from f in registers; pass 2
over the tiles forms dz1, the read z1, h, accumulates z2 and h Hᵀ, and writes the next anchor's tile
(A + P / b) — or, in the call's last mini-batch, its anchor and end sums (the glue forms the final weights
A + P / i). Backward (`_bwd_kernel`), the mini-batches in reverse from their stored anchors: pass A (f, e),
pass B (the read: z2, its LayerNorm), pass C (the read's and the end sums' gradients, tile by tile; the part of
∂/∂Z1 it can finish goes to a [b, F] scratch), then e's LayerNorm backward gives ∂/∂f, and pass D finishes
∂/∂Z1 and the gradients of W1, b1, W2 and k. The anchor gradients are accumulated in place in the dA0 outputs
(the glue seeds them with the final anchor's gradient); an end sum's gradient is the next anchor's over b, as
in `ttt.py`. dq, dk of grouped heads are written per value head and summed by the glue; dγ, dβ_ln as partials
[R, H, D] summed by the glue.

FLOPs and bytes per token (b tokens a mini-batch, a multiply-add counted as 2 FLOPs; F = 4D in the zoo; the
O(bD) and O(b²D) terms left out):
- forward: pass 1 K A1, H A2 (4DF); pass 2 K A1 again, e A2ᵀ, x A1, h A2, the end sums Kᵀ(η dz1), Hᵀ(η e)
  (12DF) and M1 dz1, h Hᵀ (4bF): 16DF + 4bF = 64D² + 16bD, 279 kFLOP at D = 64, b = 16 (of which 2DF recompute
  pass 1's Z1 rather than keep [b, F] of it).
- backward: passes A (4DF) and B (8DF + 4bF) recompute the forward's read, pass C 26DF + 10bF, pass D 10DF:
  48DF + 14bF = 192D² + 56bD, 843 kFLOP at D = 64, b = 16.
- on-chip traffic (the weights' scratch, L2-resident): per mini-batch the forward reads W1, W2 twice and writes
  them once (3 · 8DF bytes: 24DF/b = 96D²/b bytes a token, 24 KiB at D = 64, b = 16); the backward reads them
  4× and reads and writes their gradients' accumulators twice each (8 · 8DF: 256D²/b bytes a token, 64 KiB), plus
  the [b, F] scratch once each way (8F bytes a token).
- HBM: q, k, v, β in and o out (4D + 1 elements a token; dq, dk, dv, dβ likewise in the backward), and the
  anchors saved for the backward: 4(2DF + F + D)/b ≈ 32D²/b bytes a token written by the forward and read by the
  backward (8 KiB at D = 64, b = 16).
The tl.dot products are fp32 ("ieee": FMAs, no tensor cores), and one program walks its sequence's T/b
mini-batches in order: B·H programs in all (128 at B 64, H 2), so the GPU's parallelism is B·H, not B·H·T/b.

Limits: D ≤ MAX_TTT_DIM (padded to a power of two ≥ 16), F any width (tiles masked), b ∈ TTT_MINIBATCHES;
varlen (`cu_seqlens`) as `ttt.py` takes it: one program per (sequence, head), each sequence's mini-batches from
its own start, its anchors at its own slots; the dispatch row does not pass it (a MemoryState carries one offset).
fp32 operands; tl.dot at the call's `precision` (limits.DOT_PRECISIONS; by default
`limits.loop_precision("TTT-MLP", q.dtype)`: "ieee" for fp32 and fp16 inputs, "tf32" for bf16). Launch settings:
util.LAUNCH's "ttt_mlp_fwd", "ttt_mlp_bwd" (num_stages stays 1: the loops re-read a scratch the previous pass wrote,
which a pipelined prefetch could read early); the hidden tile: `hidden_tile`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import ttt_mlp as ttt_mlp_variant
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import TTT_MLP_PRECISION, loop_precision
from ..common.util import capturing, check_precision, launch, pow2, table
from .mlp_tiles import _gelu, _gelu2, _hidden, _target_errors, _tile, _tile_read
from .ttt import LN_EPS, _last_counts, _ln, _ln_back, _plan, _rows, _sequence, check_ttt_call

Tensor = torch.Tensor

__all__ = ["ttt_mlp_triton", "hidden_tile", "PRECISION"]

#: The kernels' default tl.dot input precision for fp32 and fp16 inputs (bf16: limits.LOOP_BF16_PRECISION; the
#: `precision` argument; limits.DOT_PRECISIONS; why: limits).
PRECISION = TTT_MLP_PRECISION

#: The most fp32 values of one [D, BF] weight tile (the hidden tile BF = this / pow2(D), within [16, pow2(F)]).
TILE_ELEMENTS = 2048


def hidden_tile(D: int, F: int) -> int:
    """The hidden dim's tile BF of the kernels for head dim D and hidden width F (a power of two ≥ 16)."""
    return max(16, min(pow2(F), TILE_ELEMENTS // pow2(D)))


@triton.jit
def _pass_f(kk, ck1, ckb1, ck2, ckb2, cur, c, cm, D: tl.constexpr, F: tl.constexpr, BT: tl.constexpr,
            BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr):
    """f = σ(K A1 + a1) A2 + a2 [BT, BD] at the anchor in slot cur, over the hidden tiles."""
    f = tl.zeros([BT, BD], dtype=tl.float32)
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
        A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
        Hh, _ = _gelu(tl.dot(kk, A1, input_precision=PREC) + a1[None, :])
        f += tl.dot(Hh, A2, input_precision=PREC)
    return f + tl.load(ckb2 + cur * D + c, mask=cm, other=0.0)[None, :]


@triton.jit
def _fwd_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, W1_0, b1_0, W2_0, b2_0, P1_0, p1_0, P2_0, p2_0, o,
                ck1, ckb1, ck2, ckb2, A1o, a1o, A2o, a2o, P1o, p1o, P2o, p2o, cu, slots, scale, T, off, NS,
                H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr,
                BF: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, SAVE: tl.constexpr,
                HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H  # i_b: the sequence (batch row, or cu_seqlens's)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    base = i_bh  # the anchor slot of the first mini-batch (slot index · H + head): one per (b, h) without SAVE
    if SAVE:
        base = slot0 * H + i_h  # one per mini-batch
    some = ns > 0
    empty = ns == 0  # a sequence of no mini-batch (varlen's empty one, no carried mini-batch): the state as it was
    # the initial anchor into the first slot
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
        A1, a1, A2 = _tile(W1_0, b1_0, W2_0, i_bh, fc, o1, o2, wm1, wm2, fm, D, F)
        tl.store(ck1 + base * (D * F) + o1, A1, mask=wm1 & some)
        tl.store(ckb1 + base * F + fc, a1, mask=fm & some)
        tl.store(ck2 + base * (F * D) + o2, A2, mask=wm2 & some)
        tl.store(A1o + i_bh * (D * F) + o1, A1, mask=wm1 & empty)
        tl.store(a1o + i_bh * F + fc, a1, mask=fm & empty)
        tl.store(A2o + i_bh * (F * D) + o2, A2, mask=wm2 & empty)
        P1, p1, P2 = _tile(P1_0, p1_0, P2_0, i_bh, fc, o1, o2, wm1 & empty, wm2 & empty, fm & empty, D, F)
        tl.store(P1o + i_bh * (D * F) + o1, P1, mask=wm1 & empty)
        tl.store(p1o + i_bh * F + fc, p1, mask=fm & empty)
        tl.store(P2o + i_bh * (F * D) + o2, P2, mask=wm2 & empty)
    a2 = tl.load(b2_0 + i_bh * D + c, mask=cm, other=0.0)
    tl.store(ckb2 + base * D + c, a2, mask=cm & some)
    tl.store(a2o + i_bh * D + c, a2, mask=cm & empty)
    tl.store(p2o + i_bh * D + c, tl.load(p2_0 + i_bh * D + c, mask=cm & empty, other=0.0), mask=cm & empty)
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)  # i: 1-based position in the mini-batch
    tri = r[:, None] >= r[None, :]
    for s in range(0, ns):
        tl.debug_barrier()  # the previous mini-batch's (or the copy's) stores before this one's loads
        cur = base
        nxt = base
        if SAVE:
            cur = base + s * H
            nxt = cur + H
        first = s == 0
        last = s == ns - 1
        more = s < ns - 1
        x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
        f = _pass_f(kk, ck1, ckb1, ck2, ckb2, cur, c, cm, D, F, BT, BD, BF, PREC)
        n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
        M1 = tl.where(tri, (tl.dot(x, tl.trans(kk), input_precision=PREC) + 1.0) * eta[None, :] / ipos[:, None], 0.0)
        ee = e * eta[:, None]
        z2 = tl.zeros([BT, BD], dtype=tl.float32)
        S2 = tl.zeros([BT, BT], dtype=tl.float32)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
            A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
            Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1 = _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh,
                                                                first, fc, o1, wm1, fm, D, F, PREC, HAS_P)
            z2 += tl.dot(h, A2, input_precision=PREC)
            S2 += tl.dot(h, tl.trans(Hh), input_precision=PREC)
            P2 = tl.zeros_like(A2)
            if HAS_P:
                P2 = tl.load(P2_0 + i_bh * (F * D) + o2, mask=wm2 & first, other=0.0)
                z2 += tl.dot(h, P2, input_precision=PREC) / ipos[:, None]
            dze = dz1 * eta[:, None]
            P1 = P1 - tl.dot(tl.trans(kk), dze, input_precision=PREC)
            p1 = p1 - tl.sum(dze, axis=0)
            P2 = P2 - tl.dot(tl.trans(Hh), ee, input_precision=PREC)
            # the call's last mini-batch: its anchor and end sums out; else the next anchor A + P / b
            tl.store(A1o + i_bh * (D * F) + o1, A1, mask=wm1 & last)
            tl.store(a1o + i_bh * F + fc, a1, mask=fm & last)
            tl.store(A2o + i_bh * (F * D) + o2, A2, mask=wm2 & last)
            tl.store(P1o + i_bh * (D * F) + o1, P1, mask=wm1 & last)
            tl.store(p1o + i_bh * F + fc, p1, mask=fm & last)
            tl.store(P2o + i_bh * (F * D) + o2, P2, mask=wm2 & last)
            tl.store(ck1 + nxt * (D * F) + o1, A1 + P1 / BT, mask=wm1 & more)
            tl.store(ckb1 + nxt * F + fc, a1 + p1 / BT, mask=fm & more)
            tl.store(ck2 + nxt * (F * D) + o2, A2 + P2 / BT, mask=wm2 & more)
        a2 = tl.load(ckb2 + cur * D + c, mask=cm, other=0.0)
        p2 = -tl.sum(ee, axis=0)
        z2 += a2[None, :]
        if HAS_P:
            p20 = tl.load(p2_0 + i_bh * D + c, mask=cm & first, other=0.0)
            z2 += p20[None, :] / ipos[:, None]
            p2 += p20
        M2 = tl.where(tri, (S2 + 1.0) * eta[None, :] / ipos[:, None], 0.0)
        z2 -= tl.dot(M2, e, input_precision=PREC)
        nz, _ = _ln(z2, cm, D, EPS)
        out = x + lnw[None, :] * nz + lnb[None, :]
        tl.store(o + (row[:, None] * H + i_h) * D + c[None, :], out.to(o.dtype.element_ty), mask=m)
        tl.store(a2o + i_bh * D + c, a2, mask=cm & last)
        tl.store(p2o + i_bh * D + c, p2, mask=cm & last)
        tl.store(ckb2 + nxt * D + c, a2 + p2 / BT, mask=cm & more)


@triton.jit
def _bwd_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P1_0, p1_0, P2_0, p2_0, ck1, ckb1, ck2, ckb2, do,
                dP1o, dp1o, dP2o, dp2o, gA1, ga1, gA2, ga2_ptr, dq, dk, dv, dbeta, dlnw, dlnb,
                dP1_0, dp1_0, dP2_0, dp2_0, dZs, cu, slots, scale, T, off, NS, H: tl.constexpr,
                HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
                BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    # gA1, ga1, gA2, ga2 [R, H, ·]: the anchor's gradient, seeded with the last anchor's, accumulated in place
    # (dA0 at the end); dZs [R·H, BT, F]: this program's scratch of ∂/∂Z1 between passes C and D
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    # (a sequence of no mini-batch has no carried one either, offset 0: nothing to do but the seeded dA0)
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)
    tri = r[:, None] >= r[None, :]
    glnw = tl.zeros([BD], dtype=tl.float32)
    glnb = tl.zeros([BD], dtype=tl.float32)
    ga2 = tl.load(ga2_ptr + i_bh * D + c, mask=cm, other=0.0)  # b2's anchor gradient: in registers
    zs = i_bh * (BT * F) + r[:, None] * F  # + fc[None, :]: the scratch rows
    for si in range(0, ns):
        tl.debug_barrier()  # the previous (later) mini-batch's accumulator stores before this one's loads
        s = ns - 1 - si
        cur = (slot0 + s) * H + i_h
        first = s == 0
        lastmb = si == 0  # the call's last mini-batch: its end sums' gradients are the outputs'
        x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
        # pass A: the anchor's errors
        f = _pass_f(kk, ck1, ckb1, ck2, ckb2, cur, c, cm, D, F, BT, BD, BF, PREC)
        n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
        S1 = tl.dot(x, tl.trans(kk), input_precision=PREC) + 1.0
        M1 = tl.where(tri, S1 * eta[None, :] / ipos[:, None], 0.0)
        ee = e * eta[:, None]
        # pass B: the read's second layer
        z2 = tl.zeros([BT, BD], dtype=tl.float32)
        S2 = tl.zeros([BT, BT], dtype=tl.float32)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
            A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
            Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1 = _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh,
                                                                first, fc, o1, wm1, fm, D, F, PREC, HAS_P)
            z2 += tl.dot(h, A2, input_precision=PREC)
            S2 += tl.dot(h, tl.trans(Hh), input_precision=PREC)
            if HAS_P:
                P2 = tl.load(P2_0 + i_bh * (F * D) + o2, mask=fm[:, None] & cm[None, :] & first, other=0.0)
                z2 += tl.dot(h, P2, input_precision=PREC) / ipos[:, None]
        a2 = tl.load(ckb2 + cur * D + c, mask=cm, other=0.0)
        z2 += a2[None, :]
        if HAS_P:
            p20 = tl.load(p2_0 + i_bh * D + c, mask=cm & first, other=0.0)
            z2 += p20[None, :] / ipos[:, None]
        S2 += 1.0
        M2 = tl.where(tri, S2 * eta[None, :] / ipos[:, None], 0.0)
        z2 -= tl.dot(M2, e, input_precision=PREC)
        nz, invz = _ln(z2, cm, D, EPS)
        # o = x + γ ⊙ LN(z2) + β_ln
        hv = (row[:, None] * H + i_h) * D + c[None, :]
        dO = tl.load(do + hv, mask=m, other=0.0).to(tl.float32)
        glnw += tl.sum(dO * nz, axis=0)
        glnb += tl.sum(dO, axis=0)
        dz2 = _ln_back(nz, invz, lnw[None, :] * dO, cm, D)
        dx = dO
        # z2 = h A2 + a2 + (h P2 + p2) / i − M2 e: the [BT, BT] and [BT, BD] parts
        dM2 = -tl.dot(dz2, tl.trans(e), input_precision=PREC)
        de = -tl.dot(tl.trans(M2), dz2, input_precision=PREC)
        dS2 = tl.where(tri, dM2 * eta[None, :] / ipos[:, None], 0.0)
        deta = tl.sum(tl.where(tri, dM2 * S2 / ipos[:, None], 0.0), axis=0)
        # p2_end = p2 − Σ η e: its gradient (the outputs' in the last mini-batch, else the next anchor's / b)
        gp2e = tl.load(dp2o + i_bh * D + c, mask=cm & lastmb, other=0.0)
        gp2e = tl.where(lastmb, gp2e, ga2 / BT)
        if HAS_P:
            tl.store(dp2_0 + i_bh * D + c, gp2e + tl.sum(dz2 / ipos[:, None], axis=0), mask=cm & first)
        ga2 += tl.sum(dz2, axis=0)
        HG = tl.zeros([BT, BD], dtype=tl.float32)  # H gP2_end
        dM1 = tl.zeros([BT, BT], dtype=tl.float32)
        de_w = tl.zeros([BT, BD], dtype=tl.float32)  # Σ over tiles of ∂(e A2ᵀ) A2
        dkk = tl.zeros([BT, BD], dtype=tl.float32)
        # pass C: per hidden tile, the read's gradients and the end sums'
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
            A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
            Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1 = _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh,
                                                                first, fc, o1, wm1, fm, D, F, PREC, HAS_P)
            GA1, Ga1, GA2 = _tile(gA1, ga1, gA2, i_bh, fc, o1, o2, wm1, wm2, fm, D, F)
            OP1, Op1, OP2 = _tile(dP1o, dp1o, dP2o, i_bh, fc, o1, o2, wm1 & lastmb, wm2 & lastmb, fm & lastmb,
                                  D, F)
            gP1e = tl.where(lastmb, OP1, GA1 / BT)
            gp1e = tl.where(lastmb, Op1, Ga1 / BT)
            gP2e = tl.where(lastmb, OP2, GA2 / BT)
            # z2's read through h: dh = dz2 A2ᵀ + (dz2 / i) P2ᵀ + dS2 H
            dhh = tl.dot(dz2, tl.trans(A2), input_precision=PREC) + tl.dot(dS2, Hh, input_precision=PREC)
            GA2 += tl.dot(tl.trans(h), dz2, input_precision=PREC)
            if HAS_P:
                P2 = tl.load(P2_0 + i_bh * (F * D) + o2, mask=wm2 & first, other=0.0)
                dz2i = dz2 / ipos[:, None]
                dhh += tl.dot(dz2i, tl.trans(P2), input_precision=PREC)
                gP2 = gP2e + tl.dot(tl.trans(h), dz2i, input_precision=PREC)
                tl.store(dP2_0 + i_bh * (F * D) + o2, gP2, mask=wm2 & first)
            # H: through h_t · H_j and P2_end = P2 − Hᵀ (η e)
            dH = tl.dot(tl.trans(dS2), h, input_precision=PREC) - tl.dot(ee, tl.trans(gP2e), input_precision=PREC)
            HG += tl.dot(Hh, gP2e, input_precision=PREC)
            # z1 = x A1 + a1 + (x P1 + p1) / i − M1 dz1
            dz1r = dhh * dh
            dx += tl.dot(dz1r, tl.trans(A1), input_precision=PREC)
            GA1 += tl.dot(tl.trans(x), dz1r, input_precision=PREC)
            Ga1 += tl.sum(dz1r, axis=0)
            if HAS_P:
                dz1ri = dz1r / ipos[:, None]
                dx += tl.dot(dz1ri, tl.trans(P1), input_precision=PREC)
                gP1 = gP1e + tl.dot(tl.trans(x), dz1ri, input_precision=PREC)
                tl.store(dP1_0 + i_bh * (D * F) + o1, gP1, mask=wm1 & first)
                tl.store(dp1_0 + i_bh * F + fc, gp1e + tl.sum(dz1ri, axis=0), mask=fm & first)
            dM1 -= tl.dot(dz1r, tl.trans(dz1), input_precision=PREC)
            # P1_end = P1 − Kᵀ (η dz1), p1_end = p1 − Σ η dz1
            kg = tl.dot(kk, gP1e, input_precision=PREC) + gp1e[None, :]
            ddz1 = -tl.dot(tl.trans(M1), dz1r, input_precision=PREC) - eta[:, None] * kg
            dkk -= tl.dot(dz1 * eta[:, None], tl.trans(gP1e), input_precision=PREC)
            deta -= tl.sum(dz1 * kg, axis=1)
            # dz1 = (e A2ᵀ) ⊙ σ'(Z1), H = σ(Z1): ∂/∂Z1 but for f's term (pass D)
            dg1 = ddz1 * dg
            de_w += tl.dot(dg1, A2, input_precision=PREC)
            GA2 += tl.dot(tl.trans(dg1), e, input_precision=PREC)
            tl.store(dZs + zs + fc[None, :], ddz1 * g1 * _gelu2(Z1) + dH * dg, mask=fm[None, :])
            tl.store(gA1 + i_bh * (D * F) + o1, GA1, mask=wm1)
            tl.store(ga1 + i_bh * F + fc, Ga1, mask=fm)
            tl.store(gA2 + i_bh * (F * D) + o2, GA2, mask=wm2)
        tl.debug_barrier()  # the scratch and the accumulators before pass D reads them
        # e's other uses: the read (−M2ᵀ dz2, above), e A2ᵀ, P2_end and p2_end
        kg2 = HG + gp2e[None, :]
        de += de_w - eta[:, None] * kg2
        deta -= tl.sum(e * kg2, axis=1)
        # M1's scores x_t · k_j + 1
        dS1 = tl.where(tri, dM1 * eta[None, :] / ipos[:, None], 0.0)
        deta += tl.sum(tl.where(tri, dM1 * S1 / ipos[:, None], 0.0), axis=0)
        dx += tl.dot(dS1, kk, input_precision=PREC)
        dkk += tl.dot(tl.trans(dS1), x, input_precision=PREC)
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
        ga2 += tl.sum(df, axis=0)
        # pass D: f = H A2 + a2, H = σ(Z1), Z1 = K A1 + a1
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
            A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
            Hh, dg = _gelu(tl.dot(kk, A1, input_precision=PREC) + a1[None, :])
            GA1, Ga1, GA2 = _tile(gA1, ga1, gA2, i_bh, fc, o1, o2, wm1, wm2, fm, D, F)
            dZ1 = tl.load(dZs + zs + fc[None, :], mask=fm[None, :], other=0.0)
            dZ1 += tl.dot(df, tl.trans(A2), input_precision=PREC) * dg
            GA2 += tl.dot(tl.trans(Hh), df, input_precision=PREC)
            GA1 += tl.dot(tl.trans(kk), dZ1, input_precision=PREC)
            Ga1 += tl.sum(dZ1, axis=0)
            dkk += tl.dot(dZ1, tl.trans(A1), input_precision=PREC)
            tl.store(gA1 + i_bh * (D * F) + o1, GA1, mask=wm1)
            tl.store(ga1 + i_bh * F + fc, Ga1, mask=fm)
            tl.store(gA2 + i_bh * (F * D) + o2, GA2, mask=wm2)
        # per value head: the glue sums dq, dk over grouped heads
        tl.store(dq + hv, (dx * scale).to(dq.dtype.element_ty), mask=m)
        tl.store(dk + hv, dkk.to(dk.dtype.element_ty), mask=m)
        tl.store(dv + hv, (-ddy).to(dv.dtype.element_ty), mask=m)
        tl.store(dbeta + row * H + i_h, deta.to(dbeta.dtype.element_ty), mask=valid)
    tl.store(ga2_ptr + i_bh * D + c, ga2, mask=cm)
    tl.store(dlnw + i_bh * D + c, glnw, mask=cm)
    tl.store(dlnb + i_bh * D + c, glnb, mask=cm)


def sliced_on(R: int, H: int, captured: bool | None = None) -> bool:
    """Whether a call over R sequences and H heads runs the sliced kernels (`ttt_mlp_sliced.py`):
    util.LAUNCH["ttt_mlp_sliced"]["ON"] 1 always, 0 never, 2 when the one-program grid R·H is at most its MAX_BH (the
    measured crossing, in the table's comment), 3 that while `captured` into a CUDA graph. A pure function of the
    call's facts and the launch table (`kernels.variants.ttt_mlp`, which names it)."""
    return ttt_mlp_variant(R, H, table(), captured).sliced


class _TTTMLP(torch.autograd.Function):
    """Forward: `_fwd_kernel` (or, where `sliced_on(R, H)`, `ttt_mlp_sliced.sliced_forward`: the
    hidden width sliced over programs, the same outputs and stored anchors); backward: `_bwd_kernel`. q, k [B, T, H_q,
    D], v [B, T, H, D], beta [B, T, H], lnw, lnb [H, D], the anchor A1 [R, H, D, F], a1 [R, H, F], A2 [R, H, F, D], a2
    [R, H, D] and the carried sums P1, p1, P2, p2 (same shapes; fp32) of each of the R sequences, then scale, offset,
    save (keep the anchors for a backward), cu (int32 [N+1] on the device, or None), the `ttt._Plan`, steps (the most
    mini-batches of one sequence) and the kernels' constexprs. Returns
    (o [B, T, H, D] in v's dtype, A1, a1, A2, a2, P1, p1, P2, p2 of each sequence's last mini-batch, fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, scale, offset, save, cu, plan, steps,
                geo):
        B, T = q.shape[:2]
        R, H, D, F = A1.shape
        f32 = dict(dtype=torch.float32, device=q.device)
        seq = (cu if cu is not None else q, plan.first if plan.first is not None else q)
        # the variant (`kernels.variants.ttt_mlp`): the one branch that picks the kernels and names them
        chosen = ttt_mlp_variant(R, H, table(), captured=capturing(q))
        sliced = chosen.sliced
        if sliced:  # the hidden width sliced over programs, one launch a mini-batch
            from .ttt_mlp_sliced import sliced_forward

            o, outs, ck, fs, z1s = sliced_forward(q, k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, scale=scale,
                                                  offset=offset, cu=cu, plan=plan, steps=steps, geo=geo, zs=chosen.zs,
                                                  NP=chosen.NP)
        else:
            fs = z1s = None
            o = empty_output(B, T, H, D, dtype=v.dtype, device=q.device)
            slots = max(plan.slots, 1) if save else R  # the anchors: one per mini-batch, or one rolled in place
            ck = [empty_output(slots, H, D, F, **f32), empty_output(slots, H, F, **f32),
                  empty_output(slots, H, F, D, **f32), empty_output(slots, H, D, **f32)]
            outs = [empty_output(*t.shape, **f32) for t in (A1, a1, A2, a2, P1, p1, P2, p2)]
            _fwd_kernel[(R * H,)](q, k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, o, *ck, *outs, *seq, scale,
                                  T, offset, plan.NS, **geo, SAVE=save, HAS_P=offset > 0, IS_VARLEN=cu is not None,
                                  **launch("ttt_mlp_fwd"))
        ctx.sliced = sliced and chosen.backward == "sliced"  # the sliced backward
        ctx.np = chosen.NP
        ctx.zs = ctx.sliced and z1s is not None  # the forward's Z1 kept for the sliced backward
        ctx.save_for_backward(q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *ck, *([fs] if ctx.sliced else []),
                              *([z1s] if ctx.zs else []), *(t for t in seq if t is not q))
        ctx.geo, ctx.scale, ctx.offset, ctx.plan, ctx.varlen = geo, scale, offset, plan, cu is not None
        ctx.steps = steps
        return (o, *outs)

    @staticmethod
    def backward(ctx, do, *gouts):
        q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *rest = ctx.saved_tensors
        ck, seq = rest[:4], rest[4 + ctx.sliced + ctx.zs:]
        B, T, Hq, D = q.shape
        H = v.shape[2]
        R = ctx.plan.R
        f32 = dict(dtype=torch.float32, device=q.device)
        shapes = [ck[0].shape[1:], ck[1].shape[1:], ck[2].shape[1:], ck[3].shape[1:]] * 2

        def grad_in(g, *shape):
            return torch.zeros(*shape, **f32) if g is None else g.float().contiguous()

        do = grad_in(do, B, T, H, D)
        g = [grad_in(t, R, *shape) for t, shape in zip(gouts, shapes)]
        acc = [t.clone() for t in g[:4]]  # the anchor's gradient, accumulated in place by the kernel: dA0
        has_p = ctx.offset > 0  # else P0 = 0 is no input of the state: no gradient
        dP0 = [empty_output(R, *shape, **f32) for shape in shapes[4:]] if has_p else acc
        if ctx.sliced:  # the hidden width sliced over programs, two launches a mini-batch
            from .ttt_mlp_sliced import sliced_backward

            dq, dk, dv, dbeta, dlnw, dlnb = sliced_backward(
                q, k, v, beta, lnw, lnb, P1, p1, P2, p2, ck, rest[4], rest[5] if ctx.zs else None, do, g, acc, dP0,
                scale=ctx.scale,
                offset=ctx.offset, cu=seq[0] if ctx.varlen else None, plan=ctx.plan, steps=ctx.steps, geo=ctx.geo,
                NP=ctx.np)
            dlnw, dlnb = dlnw[None], dlnb[None]
        else:
            dq, dk, dv = (empty_output(B, T, H, D, **f32) for _ in range(3))
            dbeta = empty_output(B, T, H, **f32)
            dlnw, dlnb = empty_output(R, H, D, **f32), empty_output(R, H, D, **f32)
            dZs = torch.empty(R * H, ctx.geo["BT"], shapes[0][-1], **f32)  # each program's [b, F] scratch
            seq = seq if seq else (dq, dq)
            _bwd_kernel[(R * H,)](q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *ck, do, *g[4:], *acc, dq, dk, dv, dbeta,
                                  dlnw, dlnb, *dP0, dZs, *seq, ctx.scale, T, ctx.offset, ctx.plan.NS, **ctx.geo,
                                  HAS_P=has_p, IS_VARLEN=ctx.varlen, **launch("ttt_mlp_bwd"))
        if Hq != H:  # grouped heads: the value heads of one q/k head summed
            dq = dq.view(B, T, Hq, H // Hq, D).sum(3)
            dk = dk.view(B, T, Hq, H // Hq, D).sum(3)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbeta.to(beta.dtype), dlnw.sum(0).to(lnw.dtype),
                dlnb.sum(0).to(lnb.dtype), *acc, *(dP0 if has_p else (None,) * 4), None, None, None, None, None,
                None, None)


def _check(q, k, v, beta, ln_weight, ln_bias, weights, anchor, offset: int, minibatch: int, cu_seqlens):
    """(the hidden width F, the boundaries of cu_seqlens as a list or None), or InputError naming the argument
    the kernels cannot take (shapes and dtypes; cu_seqlens's values)."""
    from ....inputs import check_tensor

    H, D, cu, R = check_ttt_call("TTT-MLP", q, k, v, beta, ln_weight, ln_bias, offset, minibatch, cu_seqlens)
    F = None
    for name, four in (("weights", weights), ("anchor", anchor)):
        if four is None and name == "anchor":
            continue
        if not isinstance(four, (tuple, list)) or len(four) != 4 or not isinstance(four[0], Tensor) \
                or four[0].dim() != 4:
            raise InputError(f"{name} must be 4 tensors (W1 [R, H, D, F], b1 [R, H, 1, F], W2 [R, H, F, D], "
                             f"b2 [R, H, 1, D]), R = {R} sequences")
        F = four[0].shape[-1] if F is None else F
        for i, shape in enumerate(((R, H, D, F), (R, H, 1, F), (R, H, F, D), (R, H, 1, D))):
            check_tensor(f"{name}[{i}]", four[i], shape, values=False)
    if offset and anchor is None:
        raise InputError("offset > 0 needs the anchor (the weights the mini-batch started from)")
    return F, cu


def _squeezed(four):
    """(W1, b1, W2, b2) with the biases' singleton dim dropped ([R, H, 1, ·] → [R, H, ·]), contiguous."""
    return [(t.squeeze(2) if i % 2 else t).contiguous() for i, t in enumerate(four)]


def _unsqueezed(four):
    return tuple(t.unsqueeze(2) if i % 2 else t for i, t in enumerate(four))


def ttt_mlp_triton(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                   minibatch: int = 16, cu_seqlens=None, tile: int | None = None, precision: str | None = None):
    """TTT-MLP's chunk form on the kernels (see the module doc); differentiable in every tensor.

    q, k: [B, T, H_q, D]; v: [B, T, H, D] (H_q | H: value head h reads q/k head h // (H / H_q)), one dtype of
    fp32/bf16/fp16; beta [B, T, H] (the inner learning rates η); ln_weight, ln_bias [H, D] (γ, β_ln); weights
    (W1 [R, H, D, F], b1 [R, H, 1, F], W2 [R, H, F, D], b2 [R, H, 1, D]) the memory's state, one row per sequence
    (R = B, or N with cu_seqlens: int [N+1] packing N sequences along T with B = 1, each with its own state and
    mini-batches aligned to its own start, every one continuing its carried mini-batch by `offset` tokens); anchor
    (same) the weights the carried mini-batch started from, needed when offset > 0 (tokens of it consumed before
    the call); minibatch b; tile: the hidden dim's tile BF (a power of two ≥ 16; None: `hidden_tile`). Returns
    (o [B, T, H, D] in v's dtype, end weights, anchor of the last mini-batch — 4 fp32 tensors each, R rows — and
    the offset after the call; with cu_seqlens, a list: each sequence's): `chunkwise.minibatch`'s final
    MemoryState fields. precision: tl.dot's input precision (limits.DOT_PRECISIONS; None: `limits.loop_precision` for
    q's dtype)."""
    precision = check_precision(loop_precision("TTT-MLP", q.dtype) if precision is None else precision)
    F, cu = _check(q, k, v, beta, ln_weight, ln_bias, weights, anchor, offset, minibatch, cu_seqlens)
    B, T, Hq, D = q.shape
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 16 or tile & (tile - 1)):
        raise InputError(f"tile must be a power of two ≥ 16, got {tile!r}")
    W = [w.float() for w in weights]
    if offset:
        A = [w.float() for w in anchor]
        P = [offset * (w - a) for w, a in zip(W, A)]  # what the consumed tokens added, times their count
    else:
        A, P = W, [torch.zeros_like(w) for w in W]
    plan = _plan(B, T, offset, minibatch, cu, q.device)
    geo = dict(H=v.shape[2], HQ=Hq, D=D, F=F, BD=pow2(D), BF=tile or hidden_tile(D, F), BT=minibatch, EPS=LN_EPS,
               PREC=precision)
    args = [t.contiguous() for t in (q, k, v, beta, ln_weight, ln_bias)] + _squeezed(A) + _squeezed(P)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in args)  # else no anchor is kept for a backward
    cu_dev = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    steps = plan.NS if cu is None else max((-(-(offset + e - s) // minibatch) for s, e in zip(cu[:-1], cu[1:])),
                                           default=0)  # the most mini-batches of one sequence
    o, *state = _TTTMLP.apply(*args, float(scale), offset, save, cu_dev, plan, steps, geo)
    anchor_out, sums = _unsqueezed(state[:4]), _unsqueezed(state[4:])
    end = tuple(a + p / _last_counts(plan, a.dim(), q.device) for a, p in zip(anchor_out, sums))
    if cu is None:
        off = (offset + T) % minibatch
    else:
        off = [(offset + e - s) % minibatch for s, e in zip(cu[:-1], cu[1:])]
    return o, end, anchor_out, off
