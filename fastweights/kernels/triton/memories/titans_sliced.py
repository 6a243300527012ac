"""Titans' split-pipeline kernels with the hidden width sliced over programs (issue 36, D 128): a launch option of
`titans.py` (util.LAUNCH["titans_sliced"]: ON 0 by default; BWD 1 slices the reverse pass too, 0 keeps
`titans._bwd_kernel`, which reads the same stored start states), the contract of `titans._Titans`.

Why (docs/kernel_notes.md, "Titans sliced"): the split pipeline's sequential kernels (`titans._state_kernel`,
`titans._bwd_kernel`) walk a sequence's T/b mini-batches in one program per (sequence, head), streaming the [K, F]
and [F, V] weights and momenta (and their gradients) in hidden tiles — at D 128, F 512 32 tiles of 16, ≈ 8 dependent
tl.dots a tile forward and 21 backward, B·H programs for 132 SMs. Across the hidden width the recurrence (the maths:
`titans.py`'s module doc) couples only through

- forward: f = Σ_F σ(K U1) U2 [b, V] at the anchor, then e = f − V; every tile's end state (W1, M1, W2, M2) follows
  from e, the gates' coefficients (the same in every program) and the tile's own Z, dz;
- reverse: ē = Σ_F (ḡ1 U2 + C_L Hd W̄2_e + Cm_L Hd M̄2_e) + the read's term [b, V], then f̄ = ē feeds pass D; the
  gates' gradients (Ā_L = ⟨W̄_e, W_s⟩, c̄_L, N̄_L, C̄_L, Cm̄_L: sums over F) feed no later mini-batch, and dk is an
  output.

So NP programs a (sequence, head), each owning TPS hidden tiles of BF (`slices`), exchange [b, V] partials once a
mini-batch each way, through a small global buffer, at a launch boundary (no barrier, no cross-program wait: each
launch's programs are independent, so the interpreter runs them as the GPU does):

- `_step_kernel`, grid (R·H, NP), one launch a mini-batch (`sliced_forward`: NS + 1). Step 0 (PRO) copies the
  slice's initial state into mini-batch 0's slot and writes its partial f, σ(K_0 U1) U2 over the slice (U the carried
  anchor with offset > 0, else the initial weights). Step j reads mini-batch j's NP partials (a fixed order:
  deterministic), forms e (every program the same, in registers; program 0 stores it), then per tile: Z, dz, the
  tile's end state — into slot j + 1, the next mini-batch's start state, or in the sequence's last mini-batch into
  the final state (and its anchor out) — and the next mini-batch's partial f from the new W1, W2 (8 dots a tile).
  The partials are double-buffered by parity: a launch reads one buffer, writes the other.
- the read, `titans._readout_kernel`, unchanged: it reads the same slots and e.
- backward (`sliced_backward`): `titans._bwd_read_kernel` (parallel, unchanged), then one launch a mini-batch from
  the last (`_chain_kernel`, grid (R·H, NP), NS + 1 launches): launch j runs pass D of mini-batch j (its ē summed
  from the partials launch j + 1 wrote: f̄, Ū into the start weights' gradient or the carried anchor's, dk's part,
  dv by program 0) and then, on the same slice, pass C of mini-batch j − 1 (its end state's gradients are the start
  gradients pass D just completed): the start state's gradients over the end's, ∂/∂Z but f̄'s term into a [b, F]
  scratch, and the slice's partials of ē [b, V] (parity-buffered) and of the gates' sums over F (C̄_L, Cm̄_L [b],
  Ā_L, c̄_L, N̄_L: per slot and slice, `gpart`). Then `_gates_kernel`, grid (slots, H), parallel: the partials summed
  in a fixed order, the gates' backward (`titans_single._coefficients_back`) with the pre-pass's Ā, c̄, C̄. dk's
  chain part per slice (NP·B·T·H·K fp32), summed by the host with the pre-pass's.

Per mini-batch the chain is then 8·TPS dots forward (64 at NP 4, F 512, BF 16; against 8·32 = 256 in one program)
and 21·TPS backward, one launch each way (the single-program chain: 21 · 32 = 672). The costs: NS + 1 launches each
way with ≈ 30–50 arguments (host time eagerly; a CUDA graph replays them), the partials re-read from L2 (NP·b·V·4 B
a mini-batch and head), per-slice dk. Untimed: the GPU commands are in docs/kernel_notes.md.

Shapes: `titans._Titans`'s — k [B, T, H_q, K], v [B, T, H, V], g, beta, nu [B, T, H]; the state W1, M1 [R, H, K, F],
W2, M2 [R, H, F, V] and the anchor A1, A2 (same; fp32); the start-state slots sw1, sm1 [slots, H, K, F], sw2, sm2
[slots, H, F, V] and es [slots, H, b, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import titans as titans_variant
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.util import launch, table, tile
from .titans_single import (  # (not `titans`, whose glue imports this module)
    _anchor,
    _coefficients,
    _coefficients_back,
    _gelu,
    _gelu2,
    _hidden,
    _keys,
    _rows,
    _rows_e,
    _state_tiles,
)
from .ttt import _sequence, _slot

Tensor = torch.Tensor

__all__ = ["sliced_forward", "sliced_backward", "slices", "sliced_on"]


def slices(F: int, BF: int, NP: int) -> tuple[int, int]:
    """(programs per (sequence, head), hidden tiles per program) for hidden width F in tiles of BF over at most NP
    programs: every program owns at least one tile."""
    tiles = -(-F // BF)
    per = -(-tiles // max(1, min(NP, tiles)))
    return -(-tiles // per), per


def sliced_on(R: int, H: int, captured: bool | None = None) -> bool:
    """Whether Titans' split pipeline runs its sequential passes sliced for R sequences × H heads
    (util.LAUNCH["titans_sliced"]["ON"]: 0 never, 1 always, 2 where R·H ≤ MAX_BH, 3 that while `captured` into a CUDA
    graph; `kernels.variants.titans`, which names it)."""
    return titans_variant(R, H, table(), captured).sliced


def _settings(geo: dict) -> tuple[int, int, int]:
    """(BF, NP, TPS): the sliced kernels' hidden tile (util.LAUNCH["titans_sliced"]["BF"], 0: geo's BF — the glue's
    site "titans_fwd" tile) and `slices` at its NP."""
    BF = tile("titans_sliced", "BF") or geo["BF"]
    NPmax = tile("titans_sliced", "NP")
    if BF < 16 or BF & (BF - 1) or NPmax < 1:
        raise InputError(f"util.LAUNCH['titans_sliced'] takes BF 0 or a power of two ≥ 16 and NP ≥ 1, got BF {BF}, "
                         f"NP {NPmax}")
    NP, TPS = slices(geo["F"], BF, NPmax)
    return BF, NP, TPS


@triton.jit
def _partial_f(kk, U1, U2, PREC: tl.constexpr):
    """σ(K U1) U2 of one hidden tile [BT, BDV]."""
    Hd, _ = _gelu(tl.dot(kk, U1, input_precision=PREC))
    return tl.dot(Hd, U2, input_precision=PREC)


@triton.jit(do_not_specialize=["j", "NS"])
def _step_kernel(k, v, g, beta, nu, W1_0, W2_0, M1_0, M2_0, A1_0, A2_0, W1, W2, M1, M2, A1o, A2o,
                 sw1, sw2, sm1, sm2, es, fpart, cu, slots, j, T, off, NS, RH, H: tl.constexpr, HQ: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                 BF: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, TPS: tl.constexpr, PREC: tl.constexpr,
                 PRO: tl.constexpr, HAS_A: tl.constexpr, IS_VARLEN: tl.constexpr):
    # PRO: step 0 (mini-batch 0's start state into its slot, its partial f); else mini-batch j's update and the
    # partial f of mini-batch j + 1. fpart [2, NP, R·H, BT, BDV]: the partials by mini-batch parity. W1, W2, M1, M2,
    # A1o, A2o [R·H, ·]: the final state and anchor, written in each sequence's last mini-batch (or, for a sequence
    # of no mini-batch, by PRO: the initial ones); sw1, sw2, sm1, sm2 [slots·H, ·]: every mini-batch's start state,
    # es [slots·H, BT, DV]: its e at the anchor — what `titans._readout_kernel` and the backward read.
    i_bh = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    rv = r[:, None] * BDV + cv[None, :]  # a [BT, BDV] tile of fpart
    full = rv >= 0
    lead = p == 0  # the program that writes e
    if PRO:
        some = ns > 0
        empty = ns == 0  # no mini-batch (varlen's empty sequence, nothing carried): the state as it was
        base = slot0 * H + i_h
        kk, vv, lg, eta, nn, row, valid, mv = _keys(k, v, g, beta, nu, bos, i_h, 0, Tn, off, H, HQ, DK, DV, BDK,
                                                    BDV, BT)
        fp = tl.zeros([BT, BDV], dtype=tl.float32)
        for t in range(0, TPS):
            fc, fm, o1, o2, m1, m2 = _hidden((p * TPS + t) * BF, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(W1_0, W2_0, M1_0, M2_0, i_bh, o1, o2, m1, m2, DK, DV, F)
            tl.store(sw1 + base * (DK * F) + o1, w1, mask=m1 & some)
            tl.store(sm1 + base * (DK * F) + o1, mm1, mask=m1 & some)
            tl.store(sw2 + base * (F * DV) + o2, w2, mask=m2 & some)
            tl.store(sm2 + base * (F * DV) + o2, mm2, mask=m2 & some)
            tl.store(W1 + p1, w1, mask=m1 & empty)
            tl.store(M1 + p1, mm1, mask=m1 & empty)
            tl.store(W2 + p2, w2, mask=m2 & empty)
            tl.store(M2 + p2, mm2, mask=m2 & empty)
            tl.store(A1o + p1, tl.load(A1_0 + p1, mask=m1 & empty, other=0.0), mask=m1 & empty)
            tl.store(A2o + p2, tl.load(A2_0 + p2, mask=m2 & empty, other=0.0), mask=m2 & empty)
            if HAS_A:  # the carried anchor is mini-batch 0's
                fp += _partial_f(kk, tl.load(A1_0 + p1, mask=m1, other=0.0), tl.load(A2_0 + p2, mask=m2, other=0.0),
                                 PREC)
            else:
                fp += _partial_f(kk, w1, w2, PREC)
        tl.store(fpart + (p * RH + i_bh) * (BT * BDV) + rv, fp, mask=full & some)
    else:
        if j < ns:
            cur = (slot0 + j) * H + i_h
            nxt = cur + H
            last = j == ns - 1
            more = j < ns - 1
            kk, vv, lg, eta, nn, row, valid, mv = _keys(k, v, g, beta, nu, bos, i_h, j, Tn, off, H, HQ, DK, DV, BDK,
                                                        BDV, BT)
            k2, v2, lg2, eta2, nn2, row2, valid2, mv2 = _keys(k, v, g, beta, nu, bos, i_h, j + 1, Tn, off, H, HQ, DK,
                                                              DV, BDK, BDV, BT)
            At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
            f = tl.zeros([BT, BDV], dtype=tl.float32)
            par = (j % 2) * NP
            for pq in range(0, NP):  # the partials in a fixed order
                f += tl.load(fpart + ((par + pq) * RH + i_bh) * (BT * BDV) + rv)
            e = tl.where(mv, f - vv, 0.0)
            tl.store(es + cur * (BT * DV) + r[:, None] * DV + cv[None, :], e, mask=cvm[None, :] & lead)
            kT = tl.trans(kk)
            fp = tl.zeros([BT, BDV], dtype=tl.float32)
            for t in range(0, TPS):
                fc, fm, o1, o2, m1, m2 = _hidden((p * TPS + t) * BF, ck, ckm, cv, cvm, DK, DV, F, BF)
                p1 = i_bh * (DK * F) + o1
                p2 = i_bh * (F * DV) + o2
                w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, cur, o1, o2, m1, m2, DK, DV, F)
                U1, U2 = w1, w2
                if HAS_A:
                    if j == 0:  # the carried anchor (a branch, as `titans_single._anchor`'s)
                        U1 = tl.load(A1_0 + p1, mask=m1, other=0.0)
                        U2 = tl.load(A2_0 + p2, mask=m2, other=0.0)
                Hd, dg = _gelu(tl.dot(kk, U1, input_precision=PREC))
                dz = tl.dot(e, tl.trans(U2), input_precision=PREC) * dg
                # the sequence's last mini-batch: its anchor out
                tl.store(A1o + p1, U1, mask=m1 & last)
                tl.store(A2o + p2, U2, mask=m2 & last)
                # (the coefficients scale the [BT, BF] tiles, not e: no [BT, BDV] copies held through the loop)
                w1 = A_L * w1 + c_L * mm1 + tl.dot(kT, dz * C_L[:, None], input_precision=PREC)
                mm1 = N_L * mm1 + tl.dot(kT, dz * Cm_L[:, None], input_precision=PREC)
                w2 = A_L * w2 + c_L * mm2 + tl.dot(tl.trans(Hd * C_L[:, None]), e, input_precision=PREC)
                mm2 = N_L * mm2 + tl.dot(tl.trans(Hd * Cm_L[:, None]), e, input_precision=PREC)
                # the end state: the next mini-batch's start, or the final state
                tl.store(sw1 + nxt * (DK * F) + o1, w1, mask=m1 & more)
                tl.store(sm1 + nxt * (DK * F) + o1, mm1, mask=m1 & more)
                tl.store(sw2 + nxt * (F * DV) + o2, w2, mask=m2 & more)
                tl.store(sm2 + nxt * (F * DV) + o2, mm2, mask=m2 & more)
                tl.store(W1 + p1, w1, mask=m1 & last)
                tl.store(M1 + p1, mm1, mask=m1 & last)
                tl.store(W2 + p2, w2, mask=m2 & last)
                tl.store(M2 + p2, mm2, mask=m2 & last)
                if more:  # the next mini-batch's anchor is its start weights
                    fp += _partial_f(k2, w1, w2, PREC)
            tl.store(fpart + ((((j + 1) % 2) * NP + p) * RH + i_bh) * (BT * BDV) + rv, fp, mask=full & more)


def sliced_forward(k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, *, offset: int, cu, plan, steps: int, geo: dict):
    """The state pass of `titans._Titans` on the sliced kernels (NS + 1 launches of `_step_kernel`): (the final W1, W2,
    M1, M2 and the last mini-batch's anchor A1, A2, fp32 [R, H, ·]; the start-state slots sw1, sw2, sm1, sm2
    [slots, H, ·] and es [slots, H, BT, V], fp32 — `titans._state_kernel`'s outputs). steps: the most mini-batches of
    one sequence (plan.NS without varlen); geo: `titans`'s constexprs with BF the "titans_fwd" site's hidden tile."""
    R, H = W1.shape[:2]
    BT, DV = geo["BT"], geo["DV"]
    BF, NP, TPS = _settings(geo)
    f32 = dict(dtype=torch.float32, device=k.device)
    outs = [empty_output(*t.shape, **f32) for t in (W1, W2, M1, M2, A1, A2)]
    n = max(plan.slots, 1)
    slots = [empty_output(n, *t.shape[1:], **f32) for t in (W1, W2, M1, M2)]
    es = empty_output(n, H, BT, DV, **f32)
    fpart = empty_output(2, NP, R * H, BT, geo["BDV"], **f32)
    seq = (cu if cu is not None else es, plan.first if plan.first is not None else es)
    const = dict(geo, BF=BF, NP=NP, TPS=TPS, HAS_A=offset > 0, IS_VARLEN=cu is not None, **launch("titans_sliced"))
    args = (k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, *outs, *slots, es, fpart, *seq)
    for j in range(-1, steps):  # step 0 (PRO), then mini-batch j's update
        _step_kernel[(R * H, NP)](*args, max(j, 0), k.shape[1], offset, plan.NS, R * H, **const, PRO=j < 0)
    return outs, slots, es


# ---------------------------------------------------------------------------------------------------- the backward
@triton.jit(do_not_specialize=["j", "NS"])
def _chain_kernel(q, k, v, g, beta, nu, A1_0, A2_0, sw1, sw2, sm1, sm2, es, do, GW1, GW2, GM1, GM2, GA1, GA2,
                  dkp, dv, dZs, zr, hr, z1s, hs, R1, RM1, R2, RM2, des, Qp, gpart, cu, slots, j, scale, T, off, NS,
                  RH, SH, BTH, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
                  NP: tl.constexpr, TPS: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr,
                  IS_VARLEN: tl.constexpr, RT: tl.constexpr, DO_D: tl.constexpr, DO_C: tl.constexpr):
    # Launch j of the reverse chain on hidden slice p, grid (R·H, NP), after `titans._bwd_read_kernel`: pass D of
    # mini-batch j (its ē: the pre-pass's read term plus the NP partials launch j + 1 wrote), then pass C of
    # mini-batch j − 1 (`titans._bwd_kernel`'s passes, over the slice's tiles). GW1, GW2, GM1, GM2 [R·H, ·]: seeded
    # with the final state's gradients, rewritten in place to each mini-batch's start state's (the slice's columns
    # only); GA1, GA2: seeded with the final anchor's gradient, as `_bwd_kernel`'s. dZs [2, R·H, BT, F]: ∂/∂Z but its
    # f̄ term, by mini-batch parity; Qp [2, NP, R·H, BT, BDV]: the slices' partials of ē by parity; gpart [NP,
    # slots·H, 3, BT]: per slot and slice the gates' sums over F (C̄_L, Cm̄_L, then Ā_L, c̄_L, N̄_L in the first 3
    # places); dkp [NP, B·T·H·K]: the slice's part of dk (the chain's: pass C's then pass D's); dv by program 0.
    i_bh = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    rv = r[:, None] * BDV + cv[None, :]  # a [BT, BDV] tile of Qp
    lead = p == 0
    zrow = i_bh * (BT * F) + r[:, None] * F  # + parity·R·H·BT·F + fc: the program's dZ scratch rows
    if DO_D & (j < ns):  # pass D of mini-batch j: f = Hd U2, Hd = σ(Z), Z = K U1 — the anchor's gradient
        s = j
        slot = (slot0 + s) * H + i_h
        carried = s < 0
        if HAS_A:
            carried = s == 0
        fresh = carried == 0
        kk, vv, lg, eta, nn, row, valid, mv = _keys(k, v, g, beta, nu, bos, i_h, s, Tn, off, H, HQ, DK, DV, BDK,
                                                    BDV, BT)
        de = tl.load(des + slot * (BT * DV) + r[:, None] * DV + cv[None, :], mask=cvm[None, :], other=0.0)
        par = (s % 2) * NP
        for pq in range(0, NP):  # the partials in a fixed order
            de += tl.load(Qp + ((par + pq) * RH + i_bh) * (BT * BDV) + rv)
        df = tl.where(mv, de, 0.0)  # e = f − V
        dK = tl.zeros([BT, BDK], dtype=tl.float32)
        zs = (s % 2).to(tl.int64) * RH * (BT * F) + zrow
        for t in range(0, TPS):
            fc, fm, o1, o2, m1, m2 = _hidden((p * TPS + t) * BF, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
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
        kp = dkp + p.to(tl.int64) * BTH * DK + (row[:, None] * H + i_h) * DK + ck[None, :]  # the slice's part of dk
        mk = valid[:, None] & ckm[None, :]
        tl.store(kp, tl.load(kp, mask=mk, other=0.0) + dK, mask=mk)
        tl.store(dv + (row[:, None] * H + i_h) * DV + cv[None, :], (-df).to(dv.dtype.element_ty), mask=mv & lead)
    if DO_D & DO_C:
        tl.debug_barrier()  # pass D's gradient stores before pass C's loads
    if DO_C & (j >= 1) & (j <= ns):  # pass C of mini-batch j − 1
        s = j - 1
        slot = (slot0 + s) * H + i_h
        carried = s < 0
        if HAS_A:
            carried = s == 0
        fresh = carried == 0
        lastmb = s == ns - 1
        x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK,
                                                       DV, BDK, BDV, BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        e = _rows_e(es, slot, BT, DV, BDV)
        dO = tl.load(do + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        # (the coefficients A, c, C_L, Cm_L scale the [BT, BF] tiles below, not x, ō, e: fewer [BT, BD] values held
        # through the loop)
        de = tl.zeros([BT, BDV], dtype=tl.float32)  # the slice's Σ_F dg1 U2
        dK = tl.zeros([BT, BDK], dtype=tl.float32)
        HG2 = tl.zeros([BT, BDV], dtype=tl.float32)  # the slice's Hd GW2_e
        HM2 = tl.zeros([BT, BDV], dtype=tl.float32)  # the slice's Hd GM2_e
        dC_L = tl.zeros([BT], dtype=tl.float32)
        dCm_L = tl.zeros([BT], dtype=tl.float32)
        # per hidden unit, summed after the loop: dA_L, dc_L, dN_L — layer 1's (sums over K) and layer 2's (over V)
        # apart, each in its tile's own layout (one [BF] accumulator for both layers made sm_90's ptxas give up on
        # the kernel: 32 registers and ≈ 10 KB of spills at 8 warps)
        sAL = tl.zeros([BF], dtype=tl.float32)
        scL = tl.zeros([BF], dtype=tl.float32)
        sNL = tl.zeros([BF], dtype=tl.float32)
        tAL = tl.zeros([BF], dtype=tl.float32)
        tcL = tl.zeros([BF], dtype=tl.float32)
        tNL = tl.zeros([BF], dtype=tl.float32)
        ss = slot * (BT * F) + r[:, None] * F  # the pre-pass's scratch rows of this slot
        zs = (s % 2).to(tl.int64) * RH * (BT * F) + zrow
        for t in range(0, TPS):
            fc, fm, o1, o2, m1, m2 = _hidden((p * TPS + t) * BF, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
            gw1, gm1, gw2, gm2 = _state_tiles(GW1, GW2, GM1, GM2, i_bh, o1, o2, m1, m2, DK, DV, F)
            Z = tl.dot(kk, U1, input_precision=PREC)
            Hd, dg = _gelu(Z)
            g1 = tl.dot(e, tl.trans(U2), input_precision=PREC)
            dz = g1 * dg
            fs = ss + fc[None, :]
            # dz's uses: the read (the pre-pass's), W1_e and M1_e
            KG1 = tl.dot(kk, gw1, input_precision=PREC)
            KM1 = tl.dot(kk, gm1, input_precision=PREC)
            ddz = tl.load(zr + fs, mask=fm[None, :], other=0.0) + C_L[:, None] * KG1 + Cm_L[:, None] * KM1
            dC_L += tl.sum(KG1 * dz, axis=1)
            dCm_L += tl.sum(KM1 * dz, axis=1)
            dK += tl.dot(dz * C_L[:, None], tl.trans(gw1), input_precision=PREC) \
                + tl.dot(dz * Cm_L[:, None], tl.trans(gm1), input_precision=PREC)
            # Hd's uses but f's: the read (the pre-pass's), W2_e and M2_e
            dHd = tl.load(hr + fs, mask=fm[None, :], other=0.0) \
                + C_L[:, None] * tl.dot(e, tl.trans(gw2), input_precision=PREC) \
                + Cm_L[:, None] * tl.dot(e, tl.trans(gm2), input_precision=PREC)
            HG2 += tl.dot(Hd, gw2, input_precision=PREC)
            HM2 += tl.dot(Hd, gm2, input_precision=PREC)
            # dz = (e U2ᵀ) ⊙ σ'(Z), Hd = σ(Z)
            dg1 = ddz * dg
            de += tl.dot(dg1, U2, input_precision=PREC)
            dU2 = tl.dot(tl.trans(dg1), e, input_precision=PREC)
            tl.store(dZs + zs + fc[None, :], ddz * g1 * _gelu2(Z) + dHd * dg, mask=fm[None, :])
            # the end state's scalars
            sAL += tl.sum(gw1 * w1, axis=0)
            scL += tl.sum(gw1 * mm1, axis=0)
            sNL += tl.sum(gm1 * mm1, axis=0)
            tAL += tl.sum(gw2 * w2, axis=1)
            tcL += tl.sum(gw2 * mm2, axis=1)
            tNL += tl.sum(gm2 * mm2, axis=1)
            # the start state's gradients (the read's terms from the pre-pass; the anchor's f-side in pass D of the
            # next launch); the final anchor's gradient moves to the last mini-batch's start weights when they are
            # its anchor
            if RT:  # the pre-pass's read terms
                r1 = tl.load(R1 + slot * (DK * F) + o1, mask=m1, other=0.0)
                rm1 = tl.load(RM1 + slot * (DK * F) + o1, mask=m1, other=0.0)
                r2 = tl.load(R2 + slot * (F * DV) + o2, mask=m2, other=0.0)
                rm2 = tl.load(RM2 + slot * (F * DV) + o2, mask=m2, other=0.0)
            else:
                dz1 = tl.load(z1s + fs, mask=fm[None, :], other=0.0)
                h = tl.load(hs + fs, mask=fm[None, :], other=0.0)
                xT = tl.trans(x)
                r1 = tl.dot(xT, At[:, None] * dz1, input_precision=PREC)
                rm1 = tl.dot(xT, ct[:, None] * dz1, input_precision=PREC)
                r2 = tl.dot(tl.trans(At[:, None] * h), dO, input_precision=PREC)
                rm2 = tl.dot(tl.trans(ct[:, None] * h), dO, input_precision=PREC)
            ga1 = tl.load(GA1 + p1, mask=m1 & lastmb & fresh, other=0.0)
            ga2 = tl.load(GA2 + p2, mask=m2 & lastmb & fresh, other=0.0)
            tl.store(GA1 + p1, tl.zeros_like(ga1), mask=m1 & lastmb & fresh)
            tl.store(GA2 + p2, tl.zeros_like(ga2), mask=m2 & lastmb & fresh)
            tl.store(GW1 + p1, A_L * gw1 + r1 + ga1, mask=m1)
            tl.store(GM1 + p1, c_L * gw1 + N_L * gm1 + rm1, mask=m1)
            tl.store(GW2 + p2, A_L * gw2 + r2 + ga2 + tl.where(fresh, dU2, 0.0), mask=m2)
            tl.store(GM2 + p2, c_L * gw2 + N_L * gm2 + rm2, mask=m2)
            if HAS_A:
                tl.store(GA2 + p2, tl.load(GA2 + p2, mask=m2 & carried, other=0.0) + dU2, mask=m2 & carried)
        de += C_L[:, None] * HG2 + Cm_L[:, None] * HM2
        dC_L += tl.sum(HG2 * e, axis=1)
        dCm_L += tl.sum(HM2 * e, axis=1)
        tl.store(Qp + ((((s % 2) * NP) + p) * RH + i_bh) * (BT * BDV) + rv, de)
        gp = gpart + (p * SH + slot) * (3 * BT) + r
        tl.store(gp, dC_L)
        tl.store(gp + BT, dCm_L)
        dA_L = tl.sum(sAL, axis=0) + tl.sum(tAL, axis=0)
        dc_L = tl.sum(scL, axis=0) + tl.sum(tcL, axis=0)
        dN_L = tl.sum(sNL, axis=0) + tl.sum(tNL, axis=0)
        sums = tl.where(r == 0, dA_L, tl.where(r == 1, dc_L, tl.where(r == 2, dN_L, 0.0)))
        tl.store(gp + 2 * BT, sums)
        mk = valid[:, None] & ckm[None, :]
        tl.store(dkp + p.to(tl.int64) * BTH * DK + (row[:, None] * H + i_h) * DK + ck[None, :], dK, mask=mk)


@triton.jit(do_not_specialize=["NS"])
def _gates_kernel(g, beta, nu, dAs, dcs, dCs, gpart, dg_ptr, dbeta, dnu, cu, slots, seq_of, T, off, NS, SH,
                  H: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The gates' backward of one mini-batch of one value head, grid (anchor slots, H), after the chain: the slices'
    partials of C̄_L, Cm̄_L, Ā_L, c̄_L, N̄_L summed in a fixed order, with the pre-pass's Ā, c̄ [BT] and C̄ [BT, BT]
    through `titans_single._coefficients_back` to d log a, dβ, dν [BT]."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    slot = i_slot.to(tl.int64) * H + i_h
    r = tl.arange(0, BT)
    t = s * BT + r - off
    valid = (t >= 0) & (t < Tn)
    gate = (bos + tl.where(valid, t, 0)) * H + i_h
    lg = tl.load(g + gate, mask=valid, other=0.0).to(tl.float32)
    eta = tl.load(beta + gate, mask=valid, other=0.0).to(tl.float32)
    nn = tl.load(nu + gate, mask=valid, other=1.0).to(tl.float32)
    dC_L = tl.zeros([BT], dtype=tl.float32)
    dCm_L = tl.zeros([BT], dtype=tl.float32)
    sums = tl.zeros([BT], dtype=tl.float32)
    for pq in range(0, NP):  # the partials in a fixed order
        gp = gpart + (pq * SH + slot) * (3 * BT) + r
        dC_L += tl.load(gp)
        dCm_L += tl.load(gp + BT)
        sums += tl.load(gp + 2 * BT)
    dA_L = tl.sum(tl.where(r == 0, sums, 0.0), axis=0)
    dc_L = tl.sum(tl.where(r == 1, sums, 0.0), axis=0)
    dN_L = tl.sum(tl.where(r == 2, sums, 0.0), axis=0)
    dAt = tl.load(dAs + slot * BT + r)
    dct = tl.load(dcs + slot * BT + r)
    dC = tl.load(dCs + slot * (BT * BT) + r[:, None] * BT + r[None, :])
    dlg, dbt, dnv = _coefficients_back(lg, eta, nn, valid, dAt, dct, dC, dA_L, dN_L, dc_L, dC_L, dCm_L, BT, PREC)
    tl.store(dg_ptr + gate, dlg.to(dg_ptr.dtype.element_ty), mask=valid)
    tl.store(dbeta + gate, dbt.to(dbeta.dtype.element_ty), mask=valid)
    tl.store(dnu + gate, dnv.to(dnu.dtype.element_ty), mask=valid)


def sliced_backward(q, k, v, g, beta, nu, A1, A2, slots, es, do, G, dk, dv, dg, dbeta, dnu, reads, des, dAs, dcs,
                    dCs, *, scale: float, offset: int, cu, plan, steps: int, geo: dict, RT: bool):
    """`titans._bwd_kernel`'s work sliced, after `titans._bwd_read_kernel`: NS + 1 launches of `_chain_kernel` from
    the last mini-batch down, then `_gates_kernel` over the slots. Arguments as `_bwd_kernel`'s: G the six state and
    anchor gradients ([R, H, ·] fp32, rewritten in place to the initial state's and the carried anchor's); dk [B, T,
    H, K] fp32 holding the pre-pass's part (the chain's slices added here); dv, dg, dbeta, dnu written; reads the
    pre-pass's eight [slots, H, ·] scratches (zr, hr, z1s, hs, R1, RM1, R2, RM2 — `_bwd_kernel`'s); des, dAs, dcs,
    dCs its per-slot terms of ē and the coefficients' gradients."""
    B, T, _, K = q.shape
    R, H = G[0].shape[:2]
    BT, F = geo["BT"], geo["F"]
    BF, NP, TPS = _settings(geo)
    f32 = dict(dtype=torch.float32, device=q.device)
    n = max(plan.slots, 1)
    dZs = empty_output(2, R * H, BT, F, **f32)
    Qp = empty_output(2, NP, R * H, BT, geo["BDV"], **f32)
    gpart = empty_output(NP, n * H, 3, BT, **f32)
    dkp = torch.zeros(NP, B * T * H * K, **f32)
    seq = (cu, plan.first) if cu is not None else (dk, dk)
    const = dict(geo, BF=BF, NP=NP, TPS=TPS, HAS_A=offset > 0, IS_VARLEN=cu is not None, RT=RT,
                 **launch("titans_sliced_bwd"))
    args = (q, k, v, g, beta, nu, A1, A2, *slots, es, do, *G, dkp, dv, dZs, *reads, des, Qp, gpart, *seq)
    rest = (scale, T, offset, plan.NS, R * H, n * H, B * T * H)
    fuse = tile("titans_sliced_bwd", "FUSE")
    for j in range(steps, -1, -1):  # pass D of mini-batch j (none in the first launch), pass C of j − 1
        if fuse:  # one launch
            _chain_kernel[(R * H, NP)](*args, j, *rest, **const, DO_D=True, DO_C=True)
            continue
        if j < steps:
            _chain_kernel[(R * H, NP)](*args, j, *rest, **const, DO_D=True, DO_C=False)
        if j > 0:
            _chain_kernel[(R * H, NP)](*args, j, *rest, **const, DO_D=False, DO_C=True)
    if plan.slots:
        pseq = (cu, plan.first, plan.seq_of) if cu is not None else (dk, dk, dk)
        _gates_kernel[(plan.slots, H)](g, beta, nu, dAs, dcs, dCs, gpart, dg, dbeta, dnu, *pseq, T, offset, plan.NS,
                                       n * H, H=H, BT=BT, NP=NP, PREC=geo["PREC"], IS_VARLEN=cu is not None,
                                       **launch("titans_sliced_gates"))
    dk += dkp.sum(0).view(dk.shape)
