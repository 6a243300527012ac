"""TTT-MLP's forward with the hidden width sliced over programs (issue 36, D 128): a launch option of
`ttt_mlp.py` (util.LAUNCH["ttt_mlp_sliced"], ON = 0 by default), the same contract as its `_fwd_kernel` — the
backward (`ttt_mlp._bwd_kernel`) reads the anchors this forward stores, unchanged.

Why (docs/kernel_notes.md, "TTT-MLP and Titans at head dim 128"): at D 128, F 512 the one program per (sequence, head)
of `ttt_mlp._fwd_kernel` streams the [128, 512] weights in 32 hidden tiles of 16 and runs ≈ 10 dependent tl.dots a
tile — ≈ 320 a mini-batch, 256 mini-batches in a row, on B·H programs (32 at the LM's B 4, H 8, for 132 SMs). Larger
tiles spill (sm_90: BF 32 664 B, BF 64 4.6 KB forward). What the recurrence needs per mini-batch across the hidden
width is one sum, f = Σ_F σ(K A1 + a1) A2 + a2 [b, D]; everything else is per hidden unit (dz1, the end sums
P1, p1, P2 of the hidden slice) or [b, D] (e, p2). So:

- `_step_kernel`, grid (R·H, NP), one launch per mini-batch (`sliced_forward` issues NS + 1 of them): program
  (sequence·head, p) owns hidden slice p (TPS tiles of BF). Step 0 (PRO) stores the initial anchor's slice into
  mini-batch 0's slot and writes its partial f, σ(K_0 A1 + a1) A2 over its slice, [b, D]. Step j + 1 reads the NP
  partials of mini-batch j (a fixed order: deterministic), adds a2, forms e (each program the same, in registers),
  then per tile of its slice: Z1 = K A1 + a1, dz1 = (e A2ᵀ) ⊙ σ'(Z1), P1 = −Kᵀ(η dz1), p1, P2 = −Hᵀ(η e) (+ the
  carried sums in the call's first mini-batch), the next anchor A + P / b into slot j + 1 — or, in the sequence's
  last mini-batch, the anchor and end sums out — and the next mini-batch's partial f from the new tile (6 dots a
  tile, TPS tiles). Program p = 0 writes e (for the readout) and the [D] bias a2 + p2 / b. The partials are
  double-buffered by mini-batch parity: a launch reads one buffer and writes the other.
- `_read_kernel`, grid (anchor slots, H): every mini-batch's read in parallel from its stored anchor and e — the
  `_fwd_kernel`'s pass 2 without its stores (6 dots a tile over all tiles; z2 and h Hᵀ summed over F there).

Per mini-batch the sequential path is then 6·TPS dots (48 at NP 4, F 512, BF 16) and one launch, against ≈ 320 in one
program; the grid of the steps is R·H·NP (128 at the LM's B 4, H 8, NP 4). The cost: NS + 2 launches a call each
with ≈ 30 arguments (host time, ≈ 10–30 µs each eagerly; a CUDA graph replays them), the partial f's (2·NP·b·D·4 B a
(sequence, head): 64 KiB at NP 4, D 128) re-read from L2, and — as TTT-Linear's split — the anchors of every
mini-batch (4(2DF + F + D) B: 514 KiB at D 128) kept by a no-grad call too (freed after its readout), plus e
(b·D·4 B a mini-batch). No barrier and no cross-program wait: each launch's programs are independent, so the
interpreter runs them as the GPU does. Untimed: the lead's GPU commands are in docs/kernel_notes.md.

Shapes: q, k [B, T, H_q, D], v [B, T, H, D], beta [B, T, H], lnw, lnb [H, D]; the anchor A1 [R, H, D, F], a1
[R, H, F], A2 [R, H, F, D], a2 [R, H, D] and the carried sums P1, p1, P2, p2 (same; fp32) — `ttt_mlp._TTTMLP`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.util import launch, tile
from .mlp_tiles import _gelu, _hidden, _target_errors, _tile, _tile_read
from .ttt import _ln, _rows, _sequence, _slot, _tokens

Tensor = torch.Tensor

__all__ = ["sliced_forward", "slices"]


def slices(F: int, BF: int, NP: int) -> tuple[int, int]:
    """(programs per (sequence, head), hidden tiles per program) for hidden width F in tiles of BF over at most NP
    programs: every program owns at least one tile."""
    tiles = -(-F // BF)
    per = -(-tiles // max(1, min(NP, tiles)))
    return -(-tiles // per), per


@triton.jit
def _partial_f(kk, A1, a1, A2, PREC: tl.constexpr):
    """σ(K A1 + a1) A2 of one hidden tile [BT, BD]."""
    Hh, _ = _gelu(tl.dot(kk, A1, input_precision=PREC) + a1[None, :])
    return tl.dot(Hh, A2, input_precision=PREC)


@triton.jit(do_not_specialize=["j"])
def _step_kernel(k, v, beta, lnw_ptr, lnb_ptr, W1_0, b1_0, W2_0, b2_0, P1_0, p1_0, P2_0, p2_0, ck1, ckb1, ck2, ckb2,
                 fpart, es, A1o, a1o, A2o, a2o, P1o, p1o, P2o, p2o, cu, slots, j, T, off, NS, RH,
                 H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr,
                 BF: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, TPS: tl.constexpr, EPS: tl.constexpr,
                 PREC: tl.constexpr, PRO: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    # PRO: step 0 (mini-batch 0's anchor slice into its slot, its partial f); else mini-batch j's update and the
    # partial f of mini-batch j + 1. fpart [2, NP, R·H, BT, BD]: the partials by mini-batch parity; es [slots, H,
    # BT, BD]: e of every mini-batch.
    i_bh = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    rd = r[:, None] * BD + c[None, :]  # a [BT, BD] tile of fpart / es
    lead = p == 0  # the program that writes the [D]- and [BT, BD]-sized results
    if PRO:
        some = ns > 0
        empty = ns == 0  # no mini-batch (varlen's empty sequence, nothing carried): the state as it was
        base = slot0 * H + i_h
        kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, 0, Tn, off, H, HQ, D, BD, BT)
        fp = tl.zeros([BT, BD], dtype=tl.float32)
        for t in range(0, TPS):
            fc, fm, o1, o2, wm1, wm2 = _hidden((p * TPS + t) * BF, c, cm, D, F, BF)
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
            fp += _partial_f(kk, A1, a1, A2, PREC)
        tl.store(fpart + (p * RH + i_bh) * (BT * BD) + rd, fp, mask=(rd >= 0) & some)
        a2 = tl.load(b2_0 + i_bh * D + c, mask=cm, other=0.0)
        tl.store(ckb2 + base * D + c, a2, mask=cm & some & lead)
        tl.store(a2o + i_bh * D + c, a2, mask=cm & empty & lead)
        p20 = tl.load(p2_0 + i_bh * D + c, mask=cm & empty, other=0.0)
        tl.store(p2o + i_bh * D + c, p20, mask=cm & empty & lead)
    else:
        if j < ns:
            cur = (slot0 + j) * H + i_h
            nxt = cur + H
            first = j == 0
            last = j == ns - 1
            more = j < ns - 1
            lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
            lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
            kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, j, Tn, off, H, HQ, D, BD, BT)
            k2, v2, eta2, row2, valid2, m2, qk2 = _tokens(k, v, beta, bos, i_h, j + 1, Tn, off, H, HQ, D, BD, BT)
            a2 = tl.load(ckb2 + cur * D + c, mask=cm, other=0.0)
            f = tl.zeros([BT, BD], dtype=tl.float32) + a2[None, :]
            par = (j % 2) * NP
            for pq in range(0, NP):  # the partials in a fixed order
                f += tl.load(fpart + ((par + pq) * RH + i_bh) * (BT * BD) + rd)
            n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
            tl.store(es + cur * (BT * BD) + rd, e, mask=(rd >= 0) & lead)
            ee = e * eta[:, None]
            fp = tl.zeros([BT, BD], dtype=tl.float32)
            for t in range(0, TPS):
                fc, fm, o1, o2, wm1, wm2 = _hidden((p * TPS + t) * BF, c, cm, D, F, BF)
                A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
                Hh, dg = _gelu(tl.dot(kk, A1, input_precision=PREC) + a1[None, :])
                dze = tl.dot(e, tl.trans(A2), input_precision=PREC) * dg * eta[:, None]
                P1 = -tl.dot(tl.trans(kk), dze, input_precision=PREC)
                p1 = -tl.sum(dze, axis=0)
                P2 = -tl.dot(tl.trans(Hh), ee, input_precision=PREC)
                if HAS_P:  # the carried sums enter the call's first mini-batch only
                    P1 += tl.load(P1_0 + i_bh * (D * F) + o1, mask=wm1 & first, other=0.0)
                    p1 += tl.load(p1_0 + i_bh * F + fc, mask=fm & first, other=0.0)
                    P2 += tl.load(P2_0 + i_bh * (F * D) + o2, mask=wm2 & first, other=0.0)
                # the sequence's last mini-batch: its anchor and end sums out; else the next anchor A + P / b
                tl.store(A1o + i_bh * (D * F) + o1, A1, mask=wm1 & last)
                tl.store(a1o + i_bh * F + fc, a1, mask=fm & last)
                tl.store(A2o + i_bh * (F * D) + o2, A2, mask=wm2 & last)
                tl.store(P1o + i_bh * (D * F) + o1, P1, mask=wm1 & last)
                tl.store(p1o + i_bh * F + fc, p1, mask=fm & last)
                tl.store(P2o + i_bh * (F * D) + o2, P2, mask=wm2 & last)
                A1 = A1 + P1 / BT
                a1 = a1 + p1 / BT
                A2 = A2 + P2 / BT
                tl.store(ck1 + nxt * (D * F) + o1, A1, mask=wm1 & more)
                tl.store(ckb1 + nxt * F + fc, a1, mask=fm & more)
                tl.store(ck2 + nxt * (F * D) + o2, A2, mask=wm2 & more)
                if more:
                    fp += _partial_f(k2, A1, a1, A2, PREC)
            tl.store(fpart + ((((j + 1) % 2) * NP + p) * RH + i_bh) * (BT * BD) + rd, fp, mask=(rd >= 0) & more)
            p2 = -tl.sum(ee, axis=0)
            if HAS_P:
                p2 += tl.load(p2_0 + i_bh * D + c, mask=cm & first, other=0.0)
            tl.store(a2o + i_bh * D + c, a2, mask=cm & last & lead)
            tl.store(p2o + i_bh * D + c, p2, mask=cm & last & lead)
            tl.store(ckb2 + nxt * D + c, a2 + p2 / BT, mask=cm & more & lead)


@triton.jit
def _read_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P1_0, p1_0, P2_0, p2_0, ck1, ckb1, ck2, ckb2, es, o, cu, slots,
                 seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                 BD: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                 HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The read of one mini-batch (anchor slot) of one value head, grid (slots, H): o = x + γ ⊙ LN(z2) + β_ln from its
    stored anchor and e (`ttt_mlp._fwd_kernel`'s pass 2 without the end sums)."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    i_bh = i_b.to(tl.int64) * H + i_h  # the carried sums' row
    cur = i_slot.to(tl.int64) * H + i_h
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    first = s == 0
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)
    tri = r[:, None] >= r[None, :]
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    e = tl.load(es + cur * (BT * BD) + r[:, None] * BD + c[None, :])
    M1 = tl.where(tri, (tl.dot(x, tl.trans(kk), input_precision=PREC) + 1.0) * eta[None, :] / ipos[:, None], 0.0)
    z2 = tl.zeros([BT, BD], dtype=tl.float32)
    S2 = tl.zeros([BT, BT], dtype=tl.float32)
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
        A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
        Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1 = _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh, first,
                                                            fc, o1, wm1, fm, D, F, PREC, HAS_P)
        z2 += tl.dot(h, A2, input_precision=PREC)
        S2 += tl.dot(h, tl.trans(Hh), input_precision=PREC)
        if HAS_P:
            P2 = tl.load(P2_0 + i_bh * (F * D) + o2, mask=wm2 & first, other=0.0)
            z2 += tl.dot(h, P2, input_precision=PREC) / ipos[:, None]
    z2 += tl.load(ckb2 + cur * D + c, mask=cm, other=0.0)[None, :]
    if HAS_P:
        z2 += tl.load(p2_0 + i_bh * D + c, mask=cm & first, other=0.0)[None, :] / ipos[:, None]
    M2 = tl.where(tri, (S2 + 1.0) * eta[None, :] / ipos[:, None], 0.0)
    z2 -= tl.dot(M2, e, input_precision=PREC)
    nz, _ = _ln(z2, cm, D, EPS)
    out = x + lnw[None, :] * nz + lnb[None, :]
    tl.store(o + (row[:, None] * H + i_h) * D + c[None, :], out.to(o.dtype.element_ty), mask=m)


def sliced_forward(q, k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, *, scale: float, offset: int, cu, plan,
                   steps: int, geo: dict):
    """The forward of `ttt_mlp._TTTMLP` on the sliced kernels: (o [B, T, H, D] in v's dtype, [A1, a1, A2, a2, P1, p1,
    P2, p2] of each sequence's last mini-batch (fp32, [R, H, ·]), [ck1, ckb1, ck2, ckb2]: every mini-batch's anchor,
    [slots, H, ·] fp32 — what `ttt_mlp._bwd_kernel` reads). steps: the most mini-batches of one sequence (plan.NS
    without varlen); geo: `ttt_mlp`'s constexprs. Slices: util.LAUNCH["ttt_mlp_sliced"]["NP"] (`slices`), the steps'
    hidden tile its "BF" (0: geo's)."""
    B, T = q.shape[:2]
    R, H, D, F = A1.shape
    BT, BD = geo["BT"], geo["BD"]
    BF = tile("ttt_mlp_sliced", "BF") or geo["BF"]  # the steps' hidden tile (the read keeps the glue's)
    NPmax = tile("ttt_mlp_sliced", "NP")
    if BF < 16 or BF & (BF - 1) or NPmax < 1:
        raise InputError(f"util.LAUNCH['ttt_mlp_sliced'] takes BF 0 or a power of two ≥ 16 and NP ≥ 1, got BF {BF}, "
                         f"NP {NPmax}")
    NP, TPS = slices(F, BF, NPmax)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = empty_output(B, T, H, D, dtype=v.dtype, device=q.device)
    slots = max(plan.slots, 1)
    ck = [empty_output(slots, H, D, F, **f32), empty_output(slots, H, F, **f32),
          empty_output(slots, H, F, D, **f32), empty_output(slots, H, D, **f32)]
    outs = [empty_output(*t.shape, **f32) for t in (A1, a1, A2, a2, P1, p1, P2, p2)]
    fpart = empty_output(2, NP, R * H, BT, BD, **f32)
    es = empty_output(slots, H, BT, BD, **f32)
    seq = (cu if cu is not None else o, plan.first if plan.first is not None else o)
    common = dict(geo, BF=BF, NP=NP, TPS=TPS, HAS_P=offset > 0, IS_VARLEN=cu is not None)
    args = (k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, *ck, fpart, es, *outs, *seq)
    for j in range(-1, steps):  # step 0 (PRO), then mini-batch j's update
        _step_kernel[(R * H, NP)](*args, max(j, 0), T, offset, plan.NS, R * H, **common, PRO=j < 0,
                                  **launch("ttt_mlp_sliced"))
    if plan.slots:
        rd = (cu, plan.first, plan.seq_of) if cu is not None else (o, o, o)
        _read_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *ck, es, o, *rd, scale, T, offset,
                                      plan.NS, **geo, HAS_P=offset > 0, IS_VARLEN=cu is not None,
                                      **launch("ttt_mlp_sliced_read"))
    return o, outs, ck
