"""TTT-Linear's sequential passes with the value columns sliced over programs (issue 36, D 128): a launch option of
`ttt.py` (util.LAUNCH["ttt_linear_sliced"]: ON 0 by default — 3× slower than the one-program passes at B 4, T 4096, H
16, D 128 on an H200, r4s14 —; ON 2 slices where sequences × heads ≤ MAX_BH, `kernels.variants.ttt_linear`; BWD 1 slices
the reverse pass too, 0 keeps `ttt._bwd_kernel`, which reads the same stored anchors), the contract of `ttt._TTTLinear`.
The parallel kernels (`ttt._readout_kernel`, `ttt._bwd_read_kernel`) are unchanged and read the anchors these passes
store.

Why (docs/kernel_notes.md, "TTT-Linear sliced"): `ttt._state_kernel` and `ttt._bwd_kernel` run one program per
(sequence, head) — 64 programs on 132 SMs at the LM's B 4, H 16 — each walking T/b = 256 mini-batches with [D, D]
products in a row. The memory W [K, V] is a linear map: column v of f = k A + a needs column v of A only, and the
update A ← A − kᵀ(η e)/b is column-wise too. What couples the V columns is the LayerNorm over V of the inner
prediction (mean, variance and, in its backward, mean(u), mean(u ⊙ n)) — per-row sums over V. So NP programs a
(sequence, head) each own VS = BD / NP value columns, and exchange per-row partial sums once a mini-batch each way
through a small global buffer, at a launch boundary (no barrier and no cross-program wait: each launch's programs
are independent, so the interpreter runs them as the GPU does).

Forward (`sliced_state_pass`): `_step_kernel`, grid (R·H, NP), NS + 1 launches. Step 0 (PRO) stores the slice of the
initial anchor into mini-batch 0's slot, forms f_0 = k_0 A + a on it (into `fs`, slot-major) and its partial row sums.
Step j reads mini-batch j's NP partials (a fixed order: deterministic) — the LayerNorm's row statistics and mean(u),
mean(u ⊙ n) follow from seven per-row sums a slice (about the slice's own mean: no E[f²] − μ² cancellation) — so no
second exchange is needed for e; program 0 stores the statistics (μ, 1/σ, mean u, mean u ⊙ n: `st`, 16 B a row) for the
reverse pass. Then e on the slice, the end sums −kᵀ(η e) (+ P_0 in a continued call's first mini-batch), the next
anchor into slot j + 1 — or in the sequence's last mini-batch the anchor and end sums out — and f_{j+1} and its
partials from the new anchor slice. 2 dots a mini-batch on the chain, [K, b] × [b, VS] and [b, K] × [K, VS].

Backward (`sliced_reverse`): after `ttt._bwd_read_kernel` (unchanged), `_chain_kernel`, grid (R·H, NP), NS + 1
launches from the last mini-batch: launch s finishes mini-batch s + 1 (its de's row sums from the partials, LayerNorm's
backward to df, gA += xᵀ dz + kᵀ df and ga on the slice, dk's df Aᵀ part, dv, dγ, dβ_ln) and starts mini-batch s (G =
the next anchor's gradient over b, or dPout in the last; e from the stored f and statistics; de = the pre-pass's − η
(k G + g_p); dk's −(η e) Gᵀ and dη's parts; P_0's gradient in a continued call's first; de's eight per-row partial
sums). 5 dots a mini-batch on the slice (k G, (η e) Gᵀ, xᵀ dz, kᵀ df, df Aᵀ) and no k A: f is stored. dk's and dη's
chain parts per slice (NP·B·T·H·D fp32), summed by the glue; dk's ddy term is −dv (the glue subtracts it).

SYNC 1 (util.LAUNCH["ttt_linear_sliced"], off by default; GPU only): each pass one persistent launch instead
(`_step_sync_kernel`, `_chain_sync_kernel`, grid (NP, R·H)), the same steps in a loop, the NP programs of a head
meeting at `_group_barrier` (a global-memory count: release add, acquire spin, one thread) between them. The
interpreter runs one program at a time, so there it is refused; untested until a GPU runs its cuda tests.

Dots per mini-batch on the sequential chain (b 16, D 128; counts, not times): one program forward 2 of [D, D] width
(k A, kᵀ(η e): 4bD² = 1.05 MFLOP), sliced 2 of [D, VS] (4bD·VS: 0.26 MFLOP at NP 4); backward 6 ([D, D]: 12bD² =
3.15 MFLOP), sliced 5 ([D, VS]: 10bD·VS = 0.66 MFLOP at NP 4), each launch's slice of A or G [D, VS] read from L2
(16 KB fp32 at NP 4). The costs: 2·(NS + 1) launches a fwd+bwd (257 each way at T 4096; ≈ 25–35 arguments each: host
time eagerly, a CUDA graph replays them), f and the statistics of every mini-batch stored (b·D·4 + 16b B: 8.2 KB at
D 128; 129 MiB at B 4, T 4096, H 16) and per-slice dk. Untimed: the GPU command is in docs/kernel_notes.md.

Shapes: `ttt._TTTLinear`'s — q, k [B, T, H_q, D], v [B, T, H, D], beta [B, T, H], lnw, lnb [H, D], A0, P0 [R, H, D, D],
a0, p0 [R, H, D] (fp32); the anchor slots ckA [slots, H, D, D], cka [slots, H, D]; fs [slots, H, b, D]; st [slots, H, b,
4].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.interpreter import interpreting
from ..common.util import launch, tile
from .ttt_rows import _rows, _sequence, _tokens

Tensor = torch.Tensor

__all__ = ["sliced_state_pass", "sliced_reverse", "slices"]

#: Per-row partial sums a slice writes each way (the forward's seven and the backward's eight, padded to one width).
NSUM = 8


def slices(BD: int, NP: int) -> tuple[int, int]:
    """(programs per (sequence, head), value columns each) for a head-dim tile BD over at most NP programs: every
    slice at least 16 columns wide (tl.dot's smallest tile), NP a power of two."""
    np_ = 1
    while np_ * 2 <= max(1, NP) and BD // (np_ * 2) >= 16:
        np_ *= 2
    return np_, BD // np_


@triton.jit
def _cols(ptr, row, valid, i_hh, HH: tl.constexpr, D: tl.constexpr, cs, sm):
    """The value-column slice cs of the token rows (fp32, 0 outside the sequence or D): [BT, VS]."""
    return tl.load(ptr + (row[:, None] * HH + i_hh) * D + cs[None, :], mask=valid[:, None] & sm[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _psum(mom, par, q, i, i_bh, RH, r, NP: tl.constexpr, BT: tl.constexpr):
    """The address of partial sum i of slice q, parity par: mom [2, NP, NSUM, R·H, BT]."""
    return mom + (((par * NP + q) * 8 + i) * RH + i_bh) * BT + r


@triton.jit
def _fwd_partials(mom, par, p, i_bh, RH, f, ks, vs, lnw_s, lnb_s, sm, D: tl.constexpr, BT: tl.constexpr,
                  VS: tl.constexpr, NP: tl.constexpr):
    """Slice p's per-row sums of f [BT, VS] about the slice's own mean m_p (d = f − m_p): Σf, Σd², Σγ²d, Σγ²d², Σγ²,
    Σγc d, Σγc with c = k + β_ln − v; into parity par."""
    r = tl.arange(0, BT)
    cnt = tl.minimum(tl.maximum(D - p * VS, 0), VS).to(tl.float32)
    s1 = tl.sum(tl.where(sm[None, :], f, 0.0), axis=1)
    d = tl.where(sm[None, :], f - (s1 / tl.maximum(cnt, 1.0))[:, None], 0.0)
    g2 = lnw_s * lnw_s
    gc = tl.where(sm[None, :], lnw_s[None, :] * (ks + lnb_s[None, :] - vs), 0.0)
    tl.store(_psum(mom, par, p, 0, i_bh, RH, r, NP, BT), s1)
    tl.store(_psum(mom, par, p, 1, i_bh, RH, r, NP, BT), tl.sum(d * d, axis=1))
    tl.store(_psum(mom, par, p, 2, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * d, axis=1))
    tl.store(_psum(mom, par, p, 3, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * d * d, axis=1))
    tl.store(_psum(mom, par, p, 4, i_bh, RH, r, NP, BT), tl.zeros([BT], dtype=tl.float32) + tl.sum(g2, axis=0))
    tl.store(_psum(mom, par, p, 5, i_bh, RH, r, NP, BT), tl.sum(gc * d, axis=1))
    tl.store(_psum(mom, par, p, 6, i_bh, RH, r, NP, BT), tl.sum(gc, axis=1))


@triton.jit
def _fwd_stats(mom, par, i_bh, RH, D: tl.constexpr, BT: tl.constexpr, VS: tl.constexpr, NP: tl.constexpr,
               EPS: tl.constexpr):
    """(μ, 1/σ, mean(u), mean(u ⊙ n)) [BT] of f's rows over the D columns from the NP slices' partials (in order):
    u = γ ⊙ (c + γ ⊙ n), n = (f − μ)/σ, so Σu = Σγc + Σγ²(f − μ)/σ and Σu n = Σγc(f − μ)/σ + Σγ²(f − μ)²/σ²."""
    r = tl.arange(0, BT)
    s1 = tl.zeros([BT], dtype=tl.float32)
    for q in tl.static_range(NP):
        s1 += tl.load(_psum(mom, par, q, 0, i_bh, RH, r, NP, BT))
    mu = s1 / D
    var = tl.zeros([BT], dtype=tl.float32)
    g2f = tl.zeros([BT], dtype=tl.float32)
    g2ff = tl.zeros([BT], dtype=tl.float32)
    gcf = tl.zeros([BT], dtype=tl.float32)
    gcs = tl.zeros([BT], dtype=tl.float32)
    for q in tl.static_range(NP):
        cnt = tl.minimum(tl.maximum(tl.full([BT], D - q * VS, tl.int32), 0), VS).to(tl.float32)
        dl = tl.load(_psum(mom, par, q, 0, i_bh, RH, r, NP, BT)) / tl.maximum(cnt, 1.0) - mu  # m_q − μ
        sg2d = tl.load(_psum(mom, par, q, 2, i_bh, RH, r, NP, BT))
        sg2 = tl.load(_psum(mom, par, q, 4, i_bh, RH, r, NP, BT))
        sgc = tl.load(_psum(mom, par, q, 6, i_bh, RH, r, NP, BT))
        var += tl.load(_psum(mom, par, q, 1, i_bh, RH, r, NP, BT)) + cnt * dl * dl
        g2f += sg2d + dl * sg2
        g2ff += tl.load(_psum(mom, par, q, 3, i_bh, RH, r, NP, BT)) + 2.0 * dl * sg2d + dl * dl * sg2
        gcf += tl.load(_psum(mom, par, q, 5, i_bh, RH, r, NP, BT)) + dl * sgc
        gcs += sgc
    inv = 1.0 / tl.sqrt(var / D + EPS)
    return mu, inv, (gcs + inv * g2f) / D, (inv * gcf + inv * inv * g2ff) / D


@triton.jit
def _slice_errors(f, ks, vs, lnw_s, lnb_s, sm, mu, inv, m1u, m2u):
    """(n, dy, u, e) [BT, VS] on the slice from f's row statistics: e = (u − mean u − n mean(u n))/σ."""
    n = tl.where(sm[None, :], (f - mu[:, None]) * inv[:, None], 0.0)
    dy = tl.where(sm[None, :], ks + lnb_s[None, :] - vs, 0.0) + lnw_s[None, :] * n
    u = lnw_s[None, :] * dy
    e = tl.where(sm[None, :], inv[:, None] * (u - m1u[:, None] - n * m2u[:, None]), 0.0)
    return n, dy, u, e


@triton.jit
def _load_stats(st, cur, r, BT: tl.constexpr):
    base = (cur * BT + r) * 4
    return tl.load(st + base), tl.load(st + base + 1), tl.load(st + base + 2), tl.load(st + base + 3)


@triton.jit
def _fwd_step(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout, cu, slots,
              i_bh, p, j, T, off, NS, RH, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
              BT: tl.constexpr, VS: tl.constexpr, NP: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
              PRO: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One step of the forward's state pass on value slice p of (sequence, head) i_bh: PRO — mini-batch 0's anchor
    slice into its slot, f_0 and its partials (an empty sequence: the carried state out); else mini-batch j's update
    from its partials and the next mini-batch's f and partials (see the module doc)."""
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    cs = p * VS + tl.arange(0, VS)
    sm = cs < D
    wm = cm[:, None] & sm[None, :]
    wo = c[:, None] * D + cs[None, :]  # the slice's columns of a [D, D] state
    fo = r[:, None] * D + cs[None, :]  # the slice's columns of a [BT, D] row block
    lnw_s = tl.load(lnw_ptr + i_h * D + cs, mask=sm, other=0.0).to(tl.float32)
    lnb_s = tl.load(lnb_ptr + i_h * D + cs, mask=sm, other=0.0).to(tl.float32)
    i_hq = i_h // (H // HQ)
    if PRO:
        some = ns > 0
        empty = ns == 0  # no mini-batch (varlen's empty sequence, nothing carried): the state as it was
        base = slot0 * H + i_h
        A = tl.load(A0 + i_bh * D * D + wo, mask=wm, other=0.0)
        a = tl.load(a0 + i_bh * D + cs, mask=sm, other=0.0)
        tl.store(ckA + base * D * D + wo, A, mask=wm & some)
        tl.store(cka + base * D + cs, a, mask=sm & some)
        tl.store(Aout + i_bh * D * D + wo, A, mask=wm & empty)
        tl.store(aout + i_bh * D + cs, a, mask=sm & empty)
        tl.store(Pout + i_bh * D * D + wo, tl.load(P0 + i_bh * D * D + wo, mask=wm & empty, other=0.0),
                 mask=wm & empty)
        tl.store(pout + i_bh * D + cs, tl.load(p0 + i_bh * D + cs, mask=sm & empty, other=0.0), mask=sm & empty)
        kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, 0, Tn, off, H, HQ, D, BD, BT)
        f = tl.dot(kk, A, input_precision=PREC) + a[None, :]
        tl.store(fs + base * BT * D + fo, f, mask=sm[None, :] & some)
        ks = _cols(k, row, valid, i_hq, HQ, D, cs, sm)
        vs = _cols(v, row, valid, i_h, H, D, cs, sm)
        _fwd_partials(mom, 0, p, i_bh, RH, f, ks, vs, lnw_s, lnb_s, sm, D, BT, VS, NP)
    else:
        if j < ns:
            cur = (slot0 + j) * H + i_h
            nxt = cur + H
            first = j == 0
            last = j == ns - 1
            more = j < ns - 1
            A = tl.load(ckA + cur * D * D + wo, mask=wm, other=0.0)
            a = tl.load(cka + cur * D + cs, mask=sm, other=0.0)
            f = tl.load(fs + cur * BT * D + fo, mask=sm[None, :], other=0.0)
            kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, j, Tn, off, H, HQ, D, BD, BT)
            ks = _cols(k, row, valid, i_hq, HQ, D, cs, sm)
            vs = _cols(v, row, valid, i_h, H, D, cs, sm)
            mu, inv, m1u, m2u = _fwd_stats(mom, j % 2, i_bh, RH, D, BT, VS, NP, EPS)
            so = (cur * BT + r) * 4
            lead = (r >= 0) & (p == 0)
            tl.store(st + so, mu, mask=lead)
            tl.store(st + so + 1, inv, mask=lead)
            tl.store(st + so + 2, m1u, mask=lead)
            tl.store(st + so + 3, m2u, mask=lead)
            n, dy, u, e = _slice_errors(f, ks, vs, lnw_s, lnb_s, sm, mu, inv, m1u, m2u)
            ee = e * eta[:, None]
            Pend = -tl.dot(tl.trans(kk), ee, input_precision=PREC)  # [BD, VS]
            pend = -tl.sum(ee, axis=0)
            if HAS_P:  # the carried sums enter the call's first mini-batch only
                Pend += tl.load(P0 + i_bh * D * D + wo, mask=wm & first, other=0.0)
                pend += tl.load(p0 + i_bh * D + cs, mask=sm & first, other=0.0)
            # the sequence's last mini-batch: its anchor and end sums out (the glue forms A + P / i)
            tl.store(Aout + i_bh * D * D + wo, A, mask=wm & last)
            tl.store(aout + i_bh * D + cs, a, mask=sm & last)
            tl.store(Pout + i_bh * D * D + wo, Pend, mask=wm & last)
            tl.store(pout + i_bh * D + cs, pend, mask=sm & last)
            if more:  # else the next anchor A + P_end / b, its f and f's partials
                A = A + Pend * (1.0 / BT)
                a = a + pend * (1.0 / BT)
                tl.store(ckA + nxt * D * D + wo, A, mask=wm)
                tl.store(cka + nxt * D + cs, a, mask=sm)
                k2, v2, eta2, row2, valid2, m2, qk2 = _tokens(k, v, beta, bos, i_h, j + 1, Tn, off, H, HQ, D, BD, BT)
                f2 = tl.dot(k2, A, input_precision=PREC) + a[None, :]
                tl.store(fs + nxt * BT * D + fo, f2, mask=sm[None, :])
                ks2 = _cols(k, row2, valid2, i_hq, HQ, D, cs, sm)
                vs2 = _cols(v, row2, valid2, i_h, H, D, cs, sm)
                _fwd_partials(mom, (j + 1) % 2, p, i_bh, RH, f2, ks2, vs2, lnw_s, lnb_s, sm, D, BT, VS, NP)


@triton.jit
def _chain_step(q, k, v, beta, lnw_ptr, lnb_ptr, P0, ckA, fs, st, dzs, des, mom, dPout, dpout, dA0, da0, dkp, detap,
                dv, glnw, glnb, dP0, dp0, cu, slots, i_bh, p, s, scale, T, off, NS, RH, BTH, H: tl.constexpr,
                HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VS: tl.constexpr,
                NP: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One step of the reverse pass on value slice p of (sequence, head) i_bh: mini-batch s + 1 finished (its de's row
    sums from the partials: LayerNorm's backward to df, gA += xᵀ dz + kᵀ df, ga, dk's df Aᵀ, dv, dγ, dβ_ln), then
    mini-batch s started (de = the pre-pass's − η (k G + g_p), dk's and dη's parts through G, P_0's gradient, de's
    partials). The anchor gradients (dA0, da0) of the slice are accumulated in place (seeded with dAout's, daout's)."""
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    c = tl.arange(0, BD)
    r = tl.arange(0, BT)
    cm = c < D
    cs = p * VS + tl.arange(0, VS)
    sm = cs < D
    wm = cm[:, None] & sm[None, :]
    wo = c[:, None] * D + cs[None, :]
    fo = r[:, None] * D + cs[None, :]
    ipos = (r + 1).to(tl.float32)
    i_hq = i_h // (H // HQ)
    lnw_s = tl.load(lnw_ptr + i_h * D + cs, mask=sm, other=0.0).to(tl.float32)
    lnb_s = tl.load(lnb_ptr + i_h * D + cs, mask=sm, other=0.0).to(tl.float32)
    gA = tl.load(dA0 + i_bh * D * D + wo, mask=wm, other=0.0)  # the gradient of the anchor after the finish
    ga = tl.load(da0 + i_bh * D + cs, mask=sm, other=0.0)
    t = s + 1
    if t < ns:  # finish mini-batch t
        cur = (slot0 + t) * H + i_h
        x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, t, Tn, off, scale, H, HQ, D, BD, BT)
        ks = _cols(k, row, valid, i_hq, HQ, D, cs, sm)
        vs = _cols(v, row, valid, i_h, H, D, cs, sm)
        f = tl.load(fs + cur * BT * D + fo, mask=sm[None, :], other=0.0)
        mu, inv, m1u, m2u = _load_stats(st, cur, r, BT)
        n, dy, u, e = _slice_errors(f, ks, vs, lnw_s, lnb_s, sm, mu, inv, m1u, m2u)
        de = tl.load(des + cur * BT * D + fo, mask=sm[None, :], other=0.0)  # the whole de (the start's)
        sde_e = tl.zeros([BT], dtype=tl.float32)
        sde = tl.zeros([BT], dtype=tl.float32)
        sde_n = tl.zeros([BT], dtype=tl.float32)
        sg2de = tl.zeros([BT], dtype=tl.float32)
        sg2de_n = tl.zeros([BT], dtype=tl.float32)
        sg2n = tl.zeros([BT], dtype=tl.float32)
        sg2n2 = tl.zeros([BT], dtype=tl.float32)
        sg2 = tl.zeros([BT], dtype=tl.float32)
        for qq in tl.static_range(NP):  # the partials in a fixed order
            sde_e += tl.load(_psum(mom, t % 2, qq, 0, i_bh, RH, r, NP, BT))
            sde += tl.load(_psum(mom, t % 2, qq, 1, i_bh, RH, r, NP, BT))
            sde_n += tl.load(_psum(mom, t % 2, qq, 2, i_bh, RH, r, NP, BT))
            sg2de += tl.load(_psum(mom, t % 2, qq, 3, i_bh, RH, r, NP, BT))
            sg2de_n += tl.load(_psum(mom, t % 2, qq, 4, i_bh, RH, r, NP, BT))
            sg2n += tl.load(_psum(mom, t % 2, qq, 5, i_bh, RH, r, NP, BT))
            sg2n2 += tl.load(_psum(mom, t % 2, qq, 6, i_bh, RH, r, NP, BT))
            sg2 += tl.load(_psum(mom, t % 2, qq, 7, i_bh, RH, r, NP, BT))
        # e = s (u − mean(u) − n mean(u ⊙ n)),  u = γ ⊙ dy,  dy = k + β_ln − v + γ ⊙ n,  (n, s) = LN(f)
        dinv = sde_e / inv
        m1 = sde / D
        m2 = sde_n / D
        du = tl.where(sm[None, :], inv[:, None] * (de - m1[:, None] - n * m2[:, None]), 0.0)
        dn = tl.where(sm[None, :], -inv[:, None] * (de * m2u[:, None] + m2[:, None] * u), 0.0)
        ddy = lnw_s[None, :] * du
        gw = tl.load(glnw + i_bh * D + cs, mask=sm, other=0.0)
        gb = tl.load(glnb + i_bh * D + cs, mask=sm, other=0.0)
        tl.store(glnw + i_bh * D + cs, gw + tl.sum(du * dy + ddy * n, axis=0), mask=sm)
        tl.store(glnb + i_bh * D + cs, gb + tl.sum(ddy, axis=0), mask=sm)
        dn += lnw_s[None, :] * ddy
        # mean(dn), mean(dn ⊙ n) over the D columns from the row sums: Σγ² du = (Σγ²de − m1 Σγ² − m2 Σγ²n)/σ, …
        mdn = (-inv * (m2u * sde + m2 * D * m1u) + inv * (sg2de - m1 * sg2 - m2 * sg2n)) / D
        mdnn = (-inv * (m2u * sde_n + m2 * D * m2u) + inv * (sg2de_n - m1 * sg2n - m2 * sg2n2)) / D
        df = tl.where(sm[None, :], inv[:, None] * (dn - mdn[:, None] - n * mdnn[:, None]), 0.0)
        df -= (dinv * inv * inv / D)[:, None] * n
        dz = tl.load(dzs + cur * BT * D + fo, mask=sm[None, :], other=0.0)
        gA = tl.dot(tl.trans(x), dz, acc=gA, input_precision=PREC)
        gA = tl.dot(tl.trans(kk), df, acc=gA, input_precision=PREC)
        ga += tl.sum(dz, axis=0) + tl.sum(df, axis=0)
        tl.store(dA0 + i_bh * D * D + wo, gA, mask=wm)
        tl.store(da0 + i_bh * D + cs, ga, mask=sm)
        A = tl.load(ckA + cur * D * D + wo, mask=wm, other=0.0)
        hv = (row[:, None] * H + i_h) * D + c[None, :]
        kp = dkp + p * BTH * D + hv  # this slice's part of dk (the start's, then df Aᵀ)
        tl.store(kp, tl.load(kp, mask=m, other=0.0) + tl.dot(df, tl.trans(A), input_precision=PREC), mask=m)
        tl.store(dv + (row[:, None] * H + i_h) * D + cs[None, :], -ddy, mask=valid[:, None] & sm[None, :])
    if s >= 0:
        if s < ns:  # start mini-batch s
            cur = (slot0 + s) * H + i_h
            first = s == 0
            last = s == ns - 1
            # its end sums' gradient: dPout in the sequence's last mini-batch, else the next anchor's over b
            G = tl.where(last, tl.load(dPout + i_bh * D * D + wo, mask=wm & last, other=0.0), gA * (1.0 / BT))
            gpo = tl.where(last, tl.load(dpout + i_bh * D + cs, mask=sm & last, other=0.0), ga * (1.0 / BT))
            x, kk, vv, eta, row, valid, m = _rows(q, k, v, beta, bos, i_h, s, Tn, off, scale, H, HQ, D, BD, BT)
            ks = _cols(k, row, valid, i_hq, HQ, D, cs, sm)
            vs = _cols(v, row, valid, i_h, H, D, cs, sm)
            f = tl.load(fs + cur * BT * D + fo, mask=sm[None, :], other=0.0)
            mu, inv, m1u, m2u = _load_stats(st, cur, r, BT)
            n, dy, u, e = _slice_errors(f, ks, vs, lnw_s, lnb_s, sm, mu, inv, m1u, m2u)
            kg = tl.dot(kk, G, input_precision=PREC) + gpo[None, :]
            de = tl.load(des + cur * BT * D + fo, mask=sm[None, :], other=0.0) - eta[:, None] * kg
            tl.store(des + cur * BT * D + fo, de, mask=sm[None, :])
            hv = (row[:, None] * H + i_h) * D + c[None, :]
            tl.store(dkp + p * BTH * D + hv, -tl.dot(e * eta[:, None], tl.trans(G), input_precision=PREC), mask=m)
            tl.store(detap + p * BTH + row * H + i_h, -tl.sum(e * kg, axis=1), mask=valid)
            if HAS_P:  # the carried sums' gradient: the first mini-batch's end sums' (and its read's)
                if first:
                    dzi = tl.load(dzs + cur * BT * D + fo, mask=sm[None, :], other=0.0) / ipos[:, None]
                    tl.store(dP0 + i_bh * D * D + wo, G + tl.dot(tl.trans(x), dzi, input_precision=PREC), mask=wm)
                    tl.store(dp0 + i_bh * D + cs, gpo + tl.sum(dzi, axis=0), mask=sm)
            g2 = lnw_s * lnw_s
            par = s % 2
            tl.store(_psum(mom, par, p, 0, i_bh, RH, r, NP, BT), tl.sum(de * e, axis=1))
            tl.store(_psum(mom, par, p, 1, i_bh, RH, r, NP, BT), tl.sum(de, axis=1))
            tl.store(_psum(mom, par, p, 2, i_bh, RH, r, NP, BT), tl.sum(de * n, axis=1))
            tl.store(_psum(mom, par, p, 3, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * de, axis=1))
            tl.store(_psum(mom, par, p, 4, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * de * n, axis=1))
            tl.store(_psum(mom, par, p, 5, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * n, axis=1))
            tl.store(_psum(mom, par, p, 6, i_bh, RH, r, NP, BT), tl.sum(g2[None, :] * n * n, axis=1))
            tl.store(_psum(mom, par, p, 7, i_bh, RH, r, NP, BT), tl.zeros([BT], dtype=tl.float32) + tl.sum(g2, axis=0))


@triton.jit
def _group_barrier(flags, i_bh, target):
    """Wait until the NP programs of (sequence, head) i_bh have all arrived here `target` / NP times (flags[i_bh]: an
    int32 count, zeroed by the glue): every program's stores before it are seen by every program's loads after it.
    GPU only (the interpreter runs one program at a time: it would wait for ever); the programs of a group must be
    resident together (the persistent launches' grid puts them side by side: (NP, R·H))."""
    tl.debug_barrier()  # the whole program's stores before the release
    tl.atomic_add(flags + i_bh, 1, sem="release", scope="gpu")
    while tl.atomic_add(flags + i_bh, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit(do_not_specialize=["j"])
def _step_kernel(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout, cu,
                 slots, j, T, off, NS, RH, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BT: tl.constexpr, VS: tl.constexpr, NP: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                 PRO: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One launch of the forward's state pass, grid (R·H, NP): `_fwd_step` j (PRO: step 0) on slice program_id(1)."""
    _fwd_step(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout, cu, slots,
              tl.program_id(0).to(tl.int64), tl.program_id(1), j, T, off, NS, RH, H, HQ, D, BD, BT, VS, NP, EPS, PREC,
              PRO, HAS_P, IS_VARLEN)


@triton.jit(do_not_specialize=["steps"])
def _step_sync_kernel(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout,
                      cu, slots, flags, steps, T, off, NS, RH, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                      BD: tl.constexpr, BT: tl.constexpr, VS: tl.constexpr, NP: tl.constexpr, EPS: tl.constexpr,
                      PREC: tl.constexpr, HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The forward's state pass in one launch (SYNC 1, GPU only), grid (NP, R·H): step 0, then every mini-batch's
    step, the group meeting at `_group_barrier` between them instead of at a launch boundary."""
    i_bh = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0)
    _fwd_step(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout, cu, slots,
              i_bh, p, 0, T, off, NS, RH, H, HQ, D, BD, BT, VS, NP, EPS, PREC, True, HAS_P, IS_VARLEN)
    for j in range(0, steps):
        _group_barrier(flags, i_bh, (j + 1) * NP)
        _fwd_step(k, v, beta, lnw_ptr, lnb_ptr, A0, a0, P0, p0, ckA, cka, fs, st, mom, Aout, aout, Pout, pout, cu,
                  slots, i_bh, p, j, T, off, NS, RH, H, HQ, D, BD, BT, VS, NP, EPS, PREC, False, HAS_P, IS_VARLEN)


@triton.jit(do_not_specialize=["s"])
def _chain_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, ckA, fs, st, dzs, des, mom, dPout, dpout, dA0, da0, dkp,
                  detap, dv, glnw, glnb, dP0, dp0, cu, slots, s, scale, T, off, NS, RH, BTH, H: tl.constexpr,
                  HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, VS: tl.constexpr,
                  NP: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    """One launch of the reverse pass, grid (R·H, NP): `_chain_step` s on slice program_id(1)."""
    _chain_step(q, k, v, beta, lnw_ptr, lnb_ptr, P0, ckA, fs, st, dzs, des, mom, dPout, dpout, dA0, da0, dkp, detap,
                dv, glnw, glnb, dP0, dp0, cu, slots, tl.program_id(0).to(tl.int64), tl.program_id(1), s, scale, T,
                off, NS, RH, BTH, H, HQ, D, BD, BT, VS, NP, EPS, PREC, HAS_P, IS_VARLEN)


@triton.jit(do_not_specialize=["steps"])
def _chain_sync_kernel(q, k, v, beta, lnw_ptr, lnb_ptr, P0, ckA, fs, st, dzs, des, mom, dPout, dpout, dA0, da0, dkp,
                       detap, dv, glnw, glnb, dP0, dp0, cu, slots, flags, steps, scale, T, off, NS, RH, BTH,
                       H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                       VS: tl.constexpr, NP: tl.constexpr, EPS: tl.constexpr, PREC: tl.constexpr,
                       HAS_P: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The reverse pass in one launch (SYNC 1, GPU only), grid (NP, R·H): the steps s = steps − 1 … −1, the group
    meeting at `_group_barrier` between them."""
    i_bh = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0)
    for i in range(0, steps + 1):
        if i > 0:
            _group_barrier(flags, i_bh, i * NP)
        _chain_step(q, k, v, beta, lnw_ptr, lnb_ptr, P0, ckA, fs, st, dzs, des, mom, dPout, dpout, dA0, da0, dkp,
                    detap, dv, glnw, glnb, dP0, dp0, cu, slots, i_bh, p, steps - 1 - i, scale, T, off, NS, RH, BTH,
                    H, HQ, D, BD, BT, VS, NP, EPS, PREC, HAS_P, IS_VARLEN)


def _sync(NP: int) -> bool:
    """Whether the sliced passes run as one persistent launch each way (util.LAUNCH["ttt_linear_sliced"]["SYNC"] 1,
    with NP > 1; never under the interpreter, which runs one program at a time)."""
    if not tile("ttt_linear_sliced", "SYNC") or NP == 1:
        return False
    if interpreting():
        raise InputError('LAUNCH["ttt_linear_sliced"]["SYNC"] 1 needs a GPU (its programs wait for each other)')
    return True


def sliced_state_pass(k, v, beta, lnw, lnb, A0, a0, P0, p0, *, T: int, offset: int, cu, plan, steps: int, geo: dict,
                      NP: int):
    """The forward's state pass on NP value slices (`_step_kernel`, steps + 1 launches): (ckA [slots, H, D, D], cka
    [slots, H, D] — every mini-batch's anchor, as `ttt._state_pass` stores them —, A, a, P, p of each sequence's last
    mini-batch [R, H, D, D] / [R, H, D], fs [slots, H, b, D] and st [slots, H, b, 4]: every mini-batch's f and its
    row statistics, for `sliced_reverse`), fp32. steps: the most mini-batches of one sequence."""
    R, H, D, BD, BT = plan.R, geo["H"], geo["D"], geo["BD"], geo["BT"]
    NP, VS = slices(BD, NP)
    f32 = dict(dtype=torch.float32, device=k.device)
    n = max(plan.slots, 1)
    ckA, cka = empty_output(n, H, D, D, **f32), empty_output(n, H, D, **f32)
    fs, st = empty_output(n, H, BT, D, **f32), empty_output(n, H, BT, 4, **f32)
    mom = empty_output(2, NP, 8, R * H, BT, **f32)
    outs = [empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32),
            empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)]
    seq = (cu, plan.first) if cu is not None else (ckA, ckA)
    args = (k, v, beta, lnw, lnb, A0, a0, P0, p0, ckA, cka, fs, st, mom, *outs, *seq)
    cfg = dict(geo, VS=VS, NP=NP, HAS_P=offset > 0, **launch("ttt_linear_sliced"))
    if _sync(NP):  # one persistent launch, the groups meeting at a global-memory count each mini-batch
        flags = torch.zeros(R * H, dtype=torch.int32, device=k.device)
        _step_sync_kernel[(NP, R * H)](*args, flags, steps, T, offset, plan.NS, R * H, **cfg)
        return ckA, cka, *outs, fs, st
    for j in range(-1, steps):
        _step_kernel[(R * H, NP)](*args, max(j, 0), T, offset, plan.NS, R * H, **cfg, PRO=j < 0)
    return ckA, cka, *outs, fs, st


def sliced_reverse(q, k, v, beta, lnw, lnb, P0, ckA, fs, st, dzs, des, dk, dbeta, gs, *, scale: float, T: int,
                   offset: int, cu, first, plan, steps: int, geo: dict, NP: int):
    """The backward's reverse pass on NP value slices after `ttt._bwd_read` (`_chain_kernel`, steps + 1 launches from
    the last mini-batch): dk, dbeta are the pre-pass's parts (fp32 [B, T, H, D] / [B, T, H], per value head), des its
    part of de (overwritten with the whole de), gs the outputs' gradients (dAout, daout, dPout, dpout). Returns (dk,
    dv, dbeta — the whole, per value head —, dA0, da0, dP0, dp0 — None, None without an offset —, dlnw, dlnb [R, H, D]:
    the chain's parts)."""
    B = q.shape[0]
    R, H, D, BD, BT = plan.R, geo["H"], geo["D"], geo["BD"], geo["BT"]
    NP, VS = slices(BD, NP)
    f32 = dict(dtype=torch.float32, device=q.device)
    has_p = offset > 0
    dv = empty_output(B, T, H, D, **f32)
    dA0, da0 = gs[0].clone(), gs[1].clone()  # accumulated in place by the slices
    dP0, dp0 = (empty_output(R, H, D, D, **f32), empty_output(R, H, D, **f32)) if has_p else (dA0, da0)
    glnw, glnb = torch.zeros(R, H, D, **f32), torch.zeros(R, H, D, **f32)
    dkp = empty_output(NP, B * T * H * D, **f32)
    detap = empty_output(NP, B * T * H, **f32)
    mom = empty_output(2, NP, 8, R * H, BT, **f32)
    seq = (cu, first) if cu is not None else (dk, dk)
    args = (q, k, v, beta, lnw, lnb, P0, ckA, fs, st, dzs, des, mom, gs[2], gs[3], dA0, da0, dkp, detap, dv, glnw,
            glnb, dP0, dp0, *seq)
    cfg = dict(geo, VS=VS, NP=NP, HAS_P=has_p, **launch("ttt_linear_sliced_bwd"))
    if _sync(NP):  # one persistent launch
        flags = torch.zeros(R * H, dtype=torch.int32, device=q.device)
        _chain_sync_kernel[(NP, R * H)](*args, flags, steps, scale, T, offset, plan.NS, R * H, B * T * H, **cfg)
    else:
        for s in range(steps - 1, -2, -1):
            _chain_kernel[(R * H, NP)](*args, s, scale, T, offset, plan.NS, R * H, B * T * H, **cfg)
    if plan.slots:
        dk = dk + dkp.sum(0).view(B, T, H, D) - dv  # dk's ddy term is −dv
        dbeta = dbeta + detap.sum(0).view(B, T, H)
    return dk, dv, dbeta, dA0, da0, *((dP0, dp0) if has_p else (None, None)), glnw, glnb
