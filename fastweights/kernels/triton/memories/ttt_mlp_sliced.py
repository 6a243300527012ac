"""TTT-MLP's kernels with the hidden width sliced over programs (issue 36, D 128): a launch option of `ttt_mlp.py`
(util.LAUNCH["ttt_mlp_sliced"]: ON = 2 by default, on where sequences × heads ≤ MAX_BH, `kernels.variants.ttt_mlp`;
BWD = 1 slices the backward too, 0 keeps `ttt_mlp._bwd_kernel`, which reads the same stored anchors), the contract
of `ttt_mlp._TTTMLP`.

Why (docs/kernel_notes.md, "TTT-MLP and Titans at head dim 128"): at D 128, F 512 the one program per (sequence,
head) of `ttt_mlp.py` streams the [128, 512] weights in 32 hidden tiles of 16 and runs ≈ 1,300 small dependent
tl.dots a mini-batch (10 a tile forward, 31 backward), 256 mini-batches in a row, on B·H programs (32 at the LM's B 4,
H 8, for 132 SMs). Larger tiles spill (sm_90: BF 32 664 B, BF 64 4.6 KB forward). Across the hidden width the
recurrence needs per mini-batch one sum forward, f = Σ_F σ(K A1 + a1) A2 + a2 [b, D], and two backward (f's again —
stored —, and ∂/∂e's Σ_F terms); everything else is per hidden unit or [b, D]. The reads (the queries' outputs and
their gradients) need the anchors only. So:

- `_step_kernel`, grid (R·H, NP), one launch a mini-batch (`sliced_forward`: NS + 1): program (sequence·head, p) owns
  hidden slice p (TPS tiles of BF). Step 0 (PRO) stores the initial anchor's slice into mini-batch 0's slot and writes
  its partial f, σ(K_0 A1 + a1) A2 over the slice, [b, D]. Step j + 1 reads the NP partials of mini-batch j (a fixed
  order: deterministic), adds a2, forms e (every program the same, in registers), then per tile: Z1 = K A1 + a1,
  dz1 = (e A2ᵀ) ⊙ σ'(Z1), P1 = −Kᵀ(η dz1), p1, P2 = −Hᵀ(η e) (+ the carried sums in the call's first mini-batch), the
  next anchor A + P / b into slot j + 1 — or, in the sequence's last mini-batch, the anchor and end sums out — and
  the next mini-batch's partial f from the new tile (6 dots a tile). Program 0 writes f (for the read and the
  backward) and a2 + p2 / b. The partials are double-buffered by parity: a launch reads one buffer, writes the other.
- `_read_kernel`, grid (anchor slots, H): every mini-batch's read in parallel from its stored anchor and f
  (`ttt_mlp._fwd_kernel`'s pass 2 without the end sums; 6 dots a tile over all tiles).
- backward (`sliced_backward`): `_bwd_pre_kernel` and `_bwd_pre2_kernel`, grid (slots, H), parallel — the read
  recomputed and every gradient the anchor gradients' chain does not enter (`_bwd_kernel`'s pass B and pass C's
  read terms): dq whole, dk's and dη's read parts, dz2, the read's ∂/∂e, and per hidden unit the read's dz1r,
  −M1ᵀ dz1r, dS2ᵀ h and h ([b, F] each, stored: 4·b·F·4 B a mini-batch); then for each mini-batch from the last,
  `_bwd_chain_kernel` PART 0 (pass C's chain terms over the slice: the end sums' gradients, 10 dots a tile, the
  slice's ∂/∂e partial) and PART 1 (∂/∂e summed, e's LayerNorm backward to ∂/∂f, pass D: 5 dots a tile). The anchor
  gradients of each slice accumulate in place in dA0, a2's in a parity buffer, dk's and dη's chain parts per slice.

Per mini-batch the chain is then (6 + 15)·TPS dots (168 at NP 4, F 512, BF 16) and 3 launches, against ≈ 1,312 in one
program (LAUNCH ZS 1: Z1 = K A1 + a1 stored by the steps, b·F·4 B a mini-batch, and read back by the next step and
the chain instead of recomputed: (5 + 13)·TPS); the steps' grid is R·H·NP (128 at the LM's B 4, H 8, NP 4). The
costs: 3·NS + 4 launches a call with ≈ 30–40 arguments each (host time eagerly, ≈ 10–30 µs a launch; a CUDA graph
replays them), the partials re-read from L2,
the anchors of every mini-batch (4(2DF + F + D) B: 514 KiB at D 128) kept by a no-grad call too (freed after its
read), f (b·D·4 B a mini-batch), the backward's [b, F] tiles (128 KiB a mini-batch at D 128: 2 GiB at B 4, T 4096,
H 16) and per-slice dk (NP·B·T·H·D·4 B). No barrier and no cross-program wait: each launch's programs are
independent, so the interpreter runs them as the GPU does. Untimed: the GPU commands are in docs/kernel_notes.md.

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
from .mlp_tiles import _gelu, _gelu2, _hidden, _target_errors, _tile, _tile_read
from .ttt import _ln, _ln_back, _rows, _sequence, _slot, _tokens

Tensor = torch.Tensor

__all__ = ["sliced_forward", "sliced_backward", "slices"]


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
                 fpart, fs, z1s, A1o, a1o, A2o, a2o, P1o, p1o, P2o, p2o, cu, slots, j, T, off, NS, RH,
                 H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr,
                 BF: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, TPS: tl.constexpr, EPS: tl.constexpr,
                 PREC: tl.constexpr, PRO: tl.constexpr, ZS: tl.constexpr, HAS_P: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    # PRO: step 0 (mini-batch 0's anchor slice into its slot, its partial f); else mini-batch j's update and the
    # partial f of mini-batch j + 1. fpart [2, NP, R·H, BT, BD]: the partials by mini-batch parity; fs [slots, H,
    # BT, BD]: f (the memory's output at the anchor, before its LayerNorm) of every mini-batch; ZS: Z1 = K A1 + a1
    # of every mini-batch stored (z1s [slots, H, BT, F]) when the partial f forms it, read back instead of recomputed.
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
            if ZS:
                Z1 = tl.dot(kk, A1, input_precision=PREC) + a1[None, :]
                tl.store(z1s + base * (BT * F) + r[:, None] * F + fc[None, :], Z1, mask=fm[None, :] & some)
                Hh, _ = _gelu(Z1)
                fp += tl.dot(Hh, A2, input_precision=PREC)
            else:
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
            tl.store(fs + cur * (BT * BD) + rd, f, mask=(rd >= 0) & lead)
            ee = e * eta[:, None]
            fp = tl.zeros([BT, BD], dtype=tl.float32)
            for t in range(0, TPS):
                fc, fm, o1, o2, wm1, wm2 = _hidden((p * TPS + t) * BF, c, cm, D, F, BF)
                A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
                if ZS:
                    Z1 = tl.load(z1s + cur * (BT * F) + r[:, None] * F + fc[None, :], mask=fm[None, :], other=0.0)
                else:
                    Z1 = tl.dot(kk, A1, input_precision=PREC) + a1[None, :]
                Hh, dg = _gelu(Z1)
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
                    if ZS:
                        Z1 = tl.dot(k2, A1, input_precision=PREC) + a1[None, :]
                        tl.store(z1s + nxt * (BT * F) + r[:, None] * F + fc[None, :], Z1, mask=fm[None, :])
                        Hn, _ = _gelu(Z1)
                        fp += tl.dot(Hn, A2, input_precision=PREC)
                    else:
                        fp += _partial_f(k2, A1, a1, A2, PREC)
            tl.store(fpart + ((((j + 1) % 2) * NP + p) * RH + i_bh) * (BT * BD) + rd, fp, mask=(rd >= 0) & more)
            p2 = -tl.sum(ee, axis=0)
            if HAS_P:
                p2 += tl.load(p2_0 + i_bh * D + c, mask=cm & first, other=0.0)
            tl.store(a2o + i_bh * D + c, a2, mask=cm & last & lead)
            tl.store(p2o + i_bh * D + c, p2, mask=cm & last & lead)
            tl.store(ckb2 + nxt * D + c, a2 + p2 / BT, mask=cm & more & lead)


@triton.jit
def _read_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P1_0, p1_0, P2_0, p2_0, ck1, ckb1, ck2, ckb2, fs, o, cu, slots,
                 seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                 BD: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                 HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The read of one mini-batch (anchor slot) of one value head, grid (slots, H): o = x + γ ⊙ LN(z2) + β_ln from its
    stored anchor and f (`ttt_mlp._fwd_kernel`'s pass 2 without the end sums)."""
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
    f = tl.load(fs + cur * (BT * BD) + r[:, None] * BD + c[None, :])
    n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
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
                   steps: int, geo: dict, zs: bool | None = None, NP: int | None = None):
    """The forward of `ttt_mlp._TTTMLP` on the sliced kernels: (o [B, T, H, D] in v's dtype, [A1, a1, A2, a2, P1, p1,
    P2, p2] of each sequence's last mini-batch (fp32, [R, H, ·]), [ck1, ckb1, ck2, ckb2]: every mini-batch's anchor,
    [slots, H, ·] fp32 — what `ttt_mlp._bwd_kernel` reads). steps: the most mini-batches of one sequence (plan.NS
    without varlen); geo: `ttt_mlp`'s constexprs. Slices: util.LAUNCH["ttt_mlp_sliced"]["NP"] (`slices`), the steps'
    hidden tile its "BF" (0: geo's); zs, NP: every mini-batch's Z1 stored, the most programs a (sequence, head) (None:
    the table's "ZS", "NP"; the glue passes its `kernels.variants.ttt_mlp` answer)."""
    B, T = q.shape[:2]
    R, H, D, F = A1.shape
    BT, BD = geo["BT"], geo["BD"]
    BF = tile("ttt_mlp_sliced", "BF") or geo["BF"]  # the steps' hidden tile (the read keeps the glue's)
    NPmax = tile("ttt_mlp_sliced", "NP") if NP is None else NP
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
    fs = empty_output(slots, H, BT, BD, **f32)
    zs = bool(tile("ttt_mlp_sliced", "ZS")) if zs is None else bool(zs)
    z1s = empty_output(slots, H, BT, F, **f32) if zs else fs  # every mini-batch's Z1 (ZS), else unused
    seq = (cu if cu is not None else o, plan.first if plan.first is not None else o)
    common = dict(geo, BF=BF, NP=NP, TPS=TPS, ZS=zs, HAS_P=offset > 0, IS_VARLEN=cu is not None)
    args = (k, v, beta, lnw, lnb, A1, a1, A2, a2, P1, p1, P2, p2, *ck, fpart, fs, z1s, *outs, *seq)
    kw = launch("ttt_mlp_sliced")
    for j in range(-1, steps):  # step 0 (PRO), then mini-batch j's update
        _step_kernel[(R * H, NP)](*args, max(j, 0), T, offset, plan.NS, R * H, **common, PRO=j < 0, **kw)
    if plan.slots:
        rd = (cu, plan.first, plan.seq_of) if cu is not None else (o, o, o)
        _read_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *ck, fs, o, *rd, scale, T, offset,
                                      plan.NS, **geo, HAS_P=offset > 0, IS_VARLEN=cu is not None,
                                      **launch("ttt_mlp_sliced_read"))
    return o, outs, ck, fs, (z1s if zs else None)


# ---------------------------------------------------------------------------------------------------- the backward
@triton.jit
def _bwd_pre_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P1_0, p1_0, P2_0, p2_0, ck1, ckb1, ck2, ckb2, fs, do,
                    dbeta, dz2s, dS2s, ders, glnw, glnb, cu, slots, seq_of, scale, T, off, NS, H: tl.constexpr,
                    HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
                    BT: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr,
                    IS_VARLEN: tl.constexpr):
    """The backward's parallel pre-pass, first half, grid (slots, H): of one mini-batch's gradients, what the anchor
    gradients' chain does not enter and needs no hidden tile's gradient — `ttt_mlp._bwd_kernel`'s pass B: the read
    recomputed, then dz2, the read's ∂/∂e and dS2 (dz2s, ders [slots, H, BT, BD], dS2s [slots, H, BT, BT]), dη's
    part through M2 (dbeta), the read's dγ, dβ_ln ([slots, H, D]). `_bwd_pre2_kernel` does the rest."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    i_bh = i_b.to(tl.int64) * H + i_h
    cur = i_slot.to(tl.int64) * H + i_h
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    rd = r[:, None] * BD + c[None, :]
    first = s == 0
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)
    tri = r[:, None] >= r[None, :]
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    f = tl.load(fs + cur * (BT * BD) + rd)
    n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
    S1 = tl.dot(x, tl.trans(kk), input_precision=PREC) + 1.0
    M1 = tl.where(tri, S1 * eta[None, :] / ipos[:, None], 0.0)
    # pass B: the read's second layer
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
    S2 += 1.0
    M2 = tl.where(tri, S2 * eta[None, :] / ipos[:, None], 0.0)
    z2 -= tl.dot(M2, e, input_precision=PREC)
    nz, invz = _ln(z2, cm, D, EPS)
    hv = (row[:, None] * H + i_h) * D + c[None, :]
    dO = tl.load(do + hv, mask=m, other=0.0).to(tl.float32)
    tl.store(glnw + cur * D + c, tl.sum(dO * nz, axis=0), mask=cm)
    tl.store(glnb + cur * D + c, tl.sum(dO, axis=0), mask=cm)
    dz2 = _ln_back(nz, invz, lnw[None, :] * dO, cm, D)
    dM2 = -tl.dot(dz2, tl.trans(e), input_precision=PREC)
    tl.store(dz2s + cur * (BT * BD) + rd, dz2)
    tl.store(ders + cur * (BT * BD) + rd, -tl.dot(tl.trans(M2), dz2, input_precision=PREC))
    dS2 = tl.where(tri, dM2 * eta[None, :] / ipos[:, None], 0.0)
    tl.store(dS2s + cur * (BT * BT) + r[:, None] * BT + r[None, :], dS2)
    tl.store(dbeta + row * H + i_h, tl.sum(tl.where(tri, dM2 * S2 / ipos[:, None], 0.0), axis=0), mask=valid)


@triton.jit
def _bwd_pre2_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P1_0, p1_0, P2_0, ck1, ckb1, ck2, fs, do, dq, dk, dbeta, dz2s,
                     dS2s, tiles, cu, slots, seq_of, scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr,
                     D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
                     EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The pre-pass's second half, grid (slots, H): from `_bwd_pre_kernel`'s dz2 and dS2 of the slot, pass C's read
    terms per hidden tile (the four [BT, F] tiles), then dq whole, dk's read part, dη's added to the first half's."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    i_bh = i_b.to(tl.int64) * H + i_h
    cur = i_slot.to(tl.int64) * H + i_h
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    rd = r[:, None] * BD + c[None, :]
    first = s == 0
    lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
    ipos = (r + 1).to(tl.float32)
    tri = r[:, None] >= r[None, :]
    x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
    f = tl.load(fs + cur * (BT * BD) + rd)
    n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
    S1 = tl.dot(x, tl.trans(kk), input_precision=PREC) + 1.0
    M1 = tl.where(tri, S1 * eta[None, :] / ipos[:, None], 0.0)
    dz2 = tl.load(dz2s + cur * (BT * BD) + rd)
    dS2 = tl.load(dS2s + cur * (BT * BT) + r[:, None] * BT + r[None, :])
    hv = (row[:, None] * H + i_h) * D + c[None, :]
    dx = tl.load(do + hv, mask=m, other=0.0).to(tl.float32)
    dM1 = tl.zeros([BT, BT], dtype=tl.float32)
    tb = cur * (4 * BT * F) + r[:, None] * F  # + j·BT·F + fc: the four [BT, F] tiles of this slot
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, wm1, wm2 = _hidden(f0, c, cm, D, F, BF)
        A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
        Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1 = _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh, first,
                                                            fc, o1, wm1, fm, D, F, PREC, HAS_P)
        dhh = tl.dot(dz2, tl.trans(A2), input_precision=PREC) + tl.dot(dS2, Hh, input_precision=PREC)
        if HAS_P:
            P2 = tl.load(P2_0 + i_bh * (F * D) + o2, mask=wm2 & first, other=0.0)
            dhh += tl.dot(dz2 / ipos[:, None], tl.trans(P2), input_precision=PREC)
        dz1r = dhh * dh
        dx += tl.dot(dz1r, tl.trans(A1), input_precision=PREC)
        if HAS_P:
            dx += tl.dot(dz1r / ipos[:, None], tl.trans(P1), input_precision=PREC)
        dM1 -= tl.dot(dz1r, tl.trans(dz1), input_precision=PREC)
        tm = fm[None, :] & (r[:, None] >= 0)
        tl.store(tiles + tb + fc[None, :], dz1r, mask=tm)
        tl.store(tiles + tb + BT * F + fc[None, :], -tl.dot(tl.trans(M1), dz1r, input_precision=PREC), mask=tm)
        tl.store(tiles + tb + 2 * BT * F + fc[None, :], tl.dot(tl.trans(dS2), h, input_precision=PREC), mask=tm)
        tl.store(tiles + tb + 3 * BT * F + fc[None, :], h, mask=tm)
    # M1's scores x_t · k_j + 1
    dS1 = tl.where(tri, dM1 * eta[None, :] / ipos[:, None], 0.0)
    deta = tl.sum(tl.where(tri, dM1 * S1 / ipos[:, None], 0.0), axis=0)
    dx += tl.dot(dS1, kk, input_precision=PREC)
    tl.store(dq + hv, dx * scale, mask=m)
    tl.store(dk + hv, tl.dot(tl.trans(dS1), x, input_precision=PREC), mask=m)
    tl.store(dbeta + row * H + i_h, tl.load(dbeta + row * H + i_h, mask=valid, other=0.0) + deta, mask=valid)


@triton.jit(do_not_specialize=["s"])
def _bwd_chain_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, ck1, ckb1, ck2, ckb2, fs, z1s, dz2s, ders, tiles,
                      dP1o, dp1o, dP2o, dp2o, gA1, ga1, gA2, G2, Qp, dZs, dkp, detap, dv, glnw, glnb,
                      dP1_0, dp1_0, dP2_0, dp2_0, cu, slots, s, scale, T, off, NS, RH, BTH,
                      H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, F: tl.constexpr, BD: tl.constexpr,
                      BF: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, TPS: tl.constexpr, EPS: tl.constexpr,
                      PREC: tl.constexpr, PART: tl.constexpr, ZS: tl.constexpr, HAS_P: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """One mini-batch s of the anchor gradients' reverse chain on hidden slice p, grid (R·H, NP): PART 0 — pass C's
    chain terms per tile (the end sums' gradients, σ(Z1)'s, dz1's), ∂/∂Z1 but f's term into dZs, and the slice's
    partial of ∂/∂e into Qp; PART 1 — ∂/∂e summed over the slices, e's LayerNorm backward to ∂/∂f, pass D per tile.
    The anchor gradients (gA1, ga1, gA2) of the slice are accumulated in place; a2's in G2 [2, R·H, BD] by mini-batch
    parity (s reads G2[s % 2], writes G2[(s + 1) % 2]); dk's and dη's chain parts per slice (dkp [NP, B·T·H·D], detap
    [NP, B·T·H]); dv, dγ's and dβ_ln's chain parts by program 0."""
    i_bh = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    if s < ns:
        c = tl.arange(0, BD)
        r = tl.arange(0, BT)
        cm = c < D
        rd = r[:, None] * BD + c[None, :]
        ones = r[:, None] >= 0
        lead = p == 0
        cur = (slot0 + s) * H + i_h
        first = s == 0
        lastmb = s == ns - 1
        lnw = tl.load(lnw_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
        lnb = tl.load(lnb_ptr + i_h * D + c, mask=cm, other=0.0).to(tl.float32)
        ipos = (r + 1).to(tl.float32)
        x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
        f = tl.load(fs + cur * (BT * BD) + rd)
        n, inv, dy, u, e = _target_errors(f, kk, vv, lnw, lnb, cm, D, EPS)
        ee = e * eta[:, None]
        dz2 = tl.load(dz2s + cur * (BT * BD) + rd)
        ga2 = tl.load(G2 + ((s % 2) * RH + i_bh) * BD + c)  # a2's anchor gradient after mini-batch s + 1
        gp2e = tl.load(dp2o + i_bh * D + c, mask=cm & lastmb, other=0.0)
        gp2e = tl.where(lastmb, gp2e, ga2 / BT)
        hv = (row[:, None] * H + i_h) * D + c[None, :]
        kp = dkp + p * BTH * D + hv  # this slice's part of dk
        ep = detap + p * BTH + row * H + i_h
        tb = cur * (4 * BT * F) + r[:, None] * F
        if PART == 0:
            Q = tl.zeros([BT, BD], dtype=tl.float32)  # the slice's Σ_F (dg1 A2 − η ⊙ H gP2_end)
            dkk = tl.zeros([BT, BD], dtype=tl.float32)
            deta = tl.zeros([BT], dtype=tl.float32)
            for t in range(0, TPS):
                fc, fm, o1, o2, wm1, wm2 = _hidden((p * TPS + t) * BF, c, cm, D, F, BF)
                tm = fm[None, :] & ones
                if ZS:  # Z1 as the forward formed it (no A1 needed here)
                    A2 = tl.load(ck2 + cur * (F * D) + o2, mask=wm2, other=0.0)
                    Z1 = tl.load(z1s + cur * (BT * F) + r[:, None] * F + fc[None, :], mask=tm, other=0.0)
                else:
                    A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
                    Z1 = tl.dot(kk, A1, input_precision=PREC) + a1[None, :]
                Hh, dg = _gelu(Z1)
                g1 = tl.dot(e, tl.trans(A2), input_precision=PREC)
                dz1 = g1 * dg
                GA1, Ga1, GA2 = _tile(gA1, ga1, gA2, i_bh, fc, o1, o2, wm1, wm2, fm, D, F)
                OP1, Op1, OP2 = _tile(dP1o, dp1o, dP2o, i_bh, fc, o1, o2, wm1 & lastmb, wm2 & lastmb, fm & lastmb,
                                      D, F)
                gP1e = tl.where(lastmb, OP1, GA1 / BT)
                gp1e = tl.where(lastmb, Op1, Ga1 / BT)
                gP2e = tl.where(lastmb, OP2, GA2 / BT)
                dz1r = tl.load(tiles + tb + fc[None, :], mask=tm, other=0.0)
                ddz1 = tl.load(tiles + tb + BT * F + fc[None, :], mask=tm, other=0.0)
                dH = tl.load(tiles + tb + 2 * BT * F + fc[None, :], mask=tm, other=0.0)
                h = tl.load(tiles + tb + 3 * BT * F + fc[None, :], mask=tm, other=0.0)
                GA2 += tl.dot(tl.trans(h), dz2, input_precision=PREC)
                if HAS_P:
                    gP2 = gP2e + tl.dot(tl.trans(h), dz2 / ipos[:, None], input_precision=PREC)
                    tl.store(dP2_0 + i_bh * (F * D) + o2, gP2, mask=wm2 & first)
                dH -= tl.dot(ee, tl.trans(gP2e), input_precision=PREC)
                HG = tl.dot(Hh, gP2e, input_precision=PREC)
                Q -= eta[:, None] * HG
                deta -= tl.sum(e * HG, axis=1)
                GA1 += tl.dot(tl.trans(x), dz1r, input_precision=PREC)
                Ga1 += tl.sum(dz1r, axis=0)
                if HAS_P:
                    dz1ri = dz1r / ipos[:, None]
                    gP1 = gP1e + tl.dot(tl.trans(x), dz1ri, input_precision=PREC)
                    tl.store(dP1_0 + i_bh * (D * F) + o1, gP1, mask=wm1 & first)
                    tl.store(dp1_0 + i_bh * F + fc, gp1e + tl.sum(dz1ri, axis=0), mask=fm & first)
                kg = tl.dot(kk, gP1e, input_precision=PREC) + gp1e[None, :]
                ddz1 -= eta[:, None] * kg
                dkk -= tl.dot(dz1 * eta[:, None], tl.trans(gP1e), input_precision=PREC)
                deta -= tl.sum(dz1 * kg, axis=1)
                dg1 = ddz1 * dg
                Q += tl.dot(dg1, A2, input_precision=PREC)
                GA2 += tl.dot(tl.trans(dg1), e, input_precision=PREC)
                tl.store(dZs + i_bh * (BT * F) + r[:, None] * F + fc[None, :], ddz1 * g1 * _gelu2(Z1) + dH * dg,
                         mask=tm)
                tl.store(gA1 + i_bh * (D * F) + o1, GA1, mask=wm1)
                tl.store(ga1 + i_bh * F + fc, Ga1, mask=fm)
                tl.store(gA2 + i_bh * (F * D) + o2, GA2, mask=wm2)
            tl.store(Qp + (p * RH + i_bh) * (BT * BD) + rd, Q)
            tl.store(kp, dkk, mask=m)
            tl.store(ep, deta, mask=valid)
            if HAS_P:
                tl.store(dp2_0 + i_bh * D + c, gp2e + tl.sum(dz2 / ipos[:, None], axis=0), mask=cm & first & lead)
        else:
            # e's gradient: the read's (−M2ᵀ dz2), the slices' (e A2ᵀ, P2_end), p2_end's
            de = tl.load(ders + cur * (BT * BD) + rd) - eta[:, None] * gp2e[None, :]
            for pq in range(0, NP):  # the partials in a fixed order
                de += tl.load(Qp + (pq * RH + i_bh) * (BT * BD) + rd)
            deta = -tl.sum(e * gp2e[None, :], axis=1)
            # e = s (u − mean(u) − n mean(u ⊙ n)),  u = γ ⊙ dy,  dy = k + β_ln − v + γ ⊙ n,  (n, s) = LN(f)
            dinv = tl.sum(de * e, axis=1) / inv
            du = _ln_back(n, inv, de, cm, D)
            mu_un = tl.sum(u * n, axis=1) / D
            mg_n = tl.sum(de * n, axis=1) / D
            dn = tl.where(cm[None, :], -inv[:, None] * (de * mu_un[:, None] + mg_n[:, None] * u), 0.0)
            ddy = lnw[None, :] * du
            dn += lnw[None, :] * ddy
            df = _ln_back(n, inv, dn, cm, D) - (dinv * inv * inv / D)[:, None] * n
            dkk = tl.load(kp, mask=m, other=0.0) + tl.where(lead, ddy, 0.0)
            tl.store(glnw + cur * D + c, tl.sum(du * dy + ddy * n, axis=0), mask=cm & lead)
            tl.store(glnb + cur * D + c, tl.sum(ddy, axis=0), mask=cm & lead)
            tl.store(dv + hv, -ddy, mask=m & lead)
            tl.store(ep, tl.load(ep, mask=valid, other=0.0) + deta, mask=valid & lead)
            tl.store(G2 + (((s + 1) % 2) * RH + i_bh) * BD + c, ga2 + tl.sum(dz2, axis=0) + tl.sum(df, axis=0),
                     mask=lead & (c >= 0))
            # pass D: f = H A2 + a2, H = σ(Z1), Z1 = K A1 + a1
            for t in range(0, TPS):
                fc, fm, o1, o2, wm1, wm2 = _hidden((p * TPS + t) * BF, c, cm, D, F, BF)
                A1, a1, A2 = _tile(ck1, ckb1, ck2, cur, fc, o1, o2, wm1, wm2, fm, D, F)
                if ZS:
                    Z1 = tl.load(z1s + cur * (BT * F) + r[:, None] * F + fc[None, :], mask=fm[None, :] & ones,
                                 other=0.0)
                else:
                    Z1 = tl.dot(kk, A1, input_precision=PREC) + a1[None, :]
                Hh, dg = _gelu(Z1)
                GA1, Ga1, GA2 = _tile(gA1, ga1, gA2, i_bh, fc, o1, o2, wm1, wm2, fm, D, F)
                dZ1 = tl.load(dZs + i_bh * (BT * F) + r[:, None] * F + fc[None, :], mask=fm[None, :] & ones, other=0.0)
                dZ1 += tl.dot(df, tl.trans(A2), input_precision=PREC) * dg
                GA2 += tl.dot(tl.trans(Hh), df, input_precision=PREC)
                GA1 += tl.dot(tl.trans(kk), dZ1, input_precision=PREC)
                Ga1 += tl.sum(dZ1, axis=0)
                dkk += tl.dot(dZ1, tl.trans(A1), input_precision=PREC)
                tl.store(gA1 + i_bh * (D * F) + o1, GA1, mask=wm1)
                tl.store(ga1 + i_bh * F + fc, Ga1, mask=fm)
                tl.store(gA2 + i_bh * (F * D) + o2, GA2, mask=wm2)
            tl.store(kp, dkk, mask=m)


def sliced_backward(q, k, v, beta, lnw, lnb, P1, p1, P2, p2, ck, fs, z1s, do, g, acc, dP0, *, scale: float,
                    offset: int, cu, plan, steps: int, geo: dict, NP: int | None = None):
    """The backward of `ttt_mlp._TTTMLP` after `sliced_forward`: the parallel pre-pass, then 2 launches a mini-batch
    (`_bwd_chain_kernel` PART 0 and 1) from the last down. do [B, T, H, D] fp32; g: the outputs' gradients (the 4
    anchor and 4 end-sum tensors, [R, H, ·] fp32); acc: the anchor gradients, seeded with g's first four and
    accumulated in place (dA0 at the end); dP0: the carried sums' gradients (written when offset > 0, else acc).
    Returns (dq, dk, dv [B, T, H, D] fp32 per value head, dbeta [B, T, H], dlnw, dlnb [H, D])."""
    B, T, Hq, D = q.shape
    H = v.shape[2]
    R, F = plan.R, ck[0].shape[-1]
    BT, BD = geo["BT"], geo["BD"]
    BF = tile("ttt_mlp_sliced", "BF") or geo["BF"]
    NP, TPS = slices(F, BF, tile("ttt_mlp_sliced", "NP") if NP is None else NP)
    f32 = dict(dtype=torch.float32, device=q.device)
    slots = max(plan.slots, 1)
    dq, dk, dv = (empty_output(B, T, H, D, **f32) for _ in range(3))
    dbeta = empty_output(B, T, H, **f32)
    dz2s, ders = empty_output(slots, H, BT, BD, **f32), empty_output(slots, H, BT, BD, **f32)
    dS2s = empty_output(slots, H, BT, BT, **f32)
    tiles = empty_output(slots, H, 4, BT, F, **f32)
    glnw, glnb = (torch.zeros(2, slots, H, D, **f32) for _ in range(2))  # the read's, the chain's
    has_p, varlen = offset > 0, cu is not None
    if plan.slots:
        rd = (cu, plan.first, plan.seq_of) if varlen else (dq, dq, dq)
        _bwd_pre_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P1, p1, P2, p2, *ck, fs, do, dbeta, dz2s, dS2s,
                                         ders, glnw[0], glnb[0], *rd, scale, T, offset, plan.NS, **geo,
                                         HAS_P=has_p, IS_VARLEN=varlen, **launch("ttt_mlp_sliced_read"))
        _bwd_pre2_kernel[(plan.slots, H)](q, k, v, beta, lnw, lnb, P1, p1, P2, *ck[:3], fs, do, dq, dk, dbeta, dz2s,
                                          dS2s, tiles, *rd, scale, T, offset, plan.NS, **geo, HAS_P=has_p,
                                          IS_VARLEN=varlen, **launch("ttt_mlp_sliced_bwd_pre"))
    G2 = torch.zeros(2, R * H, BD, **f32)
    G2[:, :, :D] = acc[3].reshape(1, R * H, D)  # a2's seed in both parities (each sequence starts at its own)
    Qp = empty_output(NP, R * H, BT, BD, **f32)
    dZs = empty_output(R * H, BT, F, **f32)
    dkp = torch.zeros(NP, B * T * H * D, **f32)
    detap = torch.zeros(NP, B * T * H, **f32)
    seq = (cu, plan.first) if varlen else (dq, dq)
    geo_s = dict(geo, BF=BF, NP=NP, TPS=TPS, ZS=z1s is not None, HAS_P=has_p, IS_VARLEN=varlen,
                 **launch("ttt_mlp_sliced"))
    z1 = fs if z1s is None else z1s
    args = (q, k, v, beta, lnw, lnb, *ck, fs, z1, dz2s, ders, tiles, *g[4:], *acc[:3], G2, Qp, dZs, dkp, detap, dv,
            glnw[1], glnb[1], *dP0, *seq)
    for s in range(steps - 1, -1, -1):
        for part in (0, 1):
            _bwd_chain_kernel[(R * H, NP)](*args, s, scale, T, offset, plan.NS, R * H, B * T * H, **geo_s, PART=part)
    acc[3].copy_(G2[1, :, :D].reshape(acc[3].shape))
    dk = dk + dkp.sum(0).view(B, T, H, D)
    dbeta = dbeta + detap.sum(0).view(B, T, H)
    return dq, dk, dv, dbeta, glnw.sum((0, 1)), glnb.sum((0, 1))
