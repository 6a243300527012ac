"""The short causal depthwise convolution of the layers (`layers.conv.ShortConv`) in Triton: one
pass forward, two backward; taps, bias and SiLU fused, the carried tail read and the new tail written.

With xp = cat(tail, x) along time ([B, W − 1 + T, C]; xp_s = tail_s for s < W − 1, else
x_{s−W+1}) and the tap reach ρ_{t,i} = [p_t ≥ W − 1 − i] (1 without `positions`; always 1 for
the last tap i = W − 1, the token itself):

    pre_t = Σ_{i<W} w_{c,i} xp_{t+i} ρ_{t,i} + b_c,   y_t = SiLU(pre_t) (or pre_t)   [B, T, C]
    new tail = xp_{T..T+W−2}                                                       [B, W − 1, C]

Backward (pre recomputed from x and the tail; nothing but the inputs is saved), with
dpre_t = dy_t · SiLU'(pre_t), SiLU'(u) = σ(u)(1 + u(1 − σ(u))):

    dxp_s = Σ_i dpre_{s−i} w_i ρ_{s−i,i}  (0 ≤ s − i < T)  + dnew_tail_{s−T}  (s ≥ T)
    dx = dxp_{W−1..}, dtail = dxp_{..W−2},  dw_{c,i} = Σ_{b,t} dpre_t xp_{t+i} ρ_{t,i},  db_c = Σ_{b,t} dpre_t

Arithmetic in fp32; x, the tail, w and b are first rounded to x's dtype (the torch twin computes in
x's dtype). x may be a view whose channels are contiguous but whose rows are not (a slice of a
wider projection [B, T, C' > C]): its batch and row strides go into the kernels; y, dx and the
tails are contiguous.

Forward `_conv_fwd`, grid (blocks of BT rows, blocks of BC channels, B): W shifted tile loads of x
(W − 1 of them hit the cache) per output tile.

Backward: by default in one pass (below: `_conv_bwd_fused`); with `short_conv(..., one_pass_backward=False)` in two
kernels, each O(W) per element (the W shifted copies of dpre that dx needs come from memory):

    `_conv_bwd_dpre`, grid (runs of NBLK·BT rows, blocks of BC channels, B): per block of rows t,
        pre from W tap loads, dpre once (one sigmoid), written to a scratch [B, T, C] (x's dtype,
        fp32 with `dpre_fp32`), and dw_i += Σ_t dpre_t xp_{t+i} ρ_{t,i} (the W taps reloaded, cache
        hits), db += Σ_t dpre_t, summed in registers over the program's NBLK blocks; one partial
        row per program (B·⌈T/(NBLK·BT)⌉ rows, summed by torch; deterministic, no atomics).
    `_conv_bwd_dx`, grid (blocks of DX_BT xp rows, blocks of DX_BC channels, B): dxp_s from W
        shifted dpre loads (W − 1 hit the cache), plus the new tail's gradient; dx and dtail written.

DRAM bytes per element (e = x's element size, d = the scratch's): the floor is read x, dy and write
dx = 3e; these kernels move x + dy + d (first) + d + dx (second) = 3e + 2d: 5e with the scratch in
x's dtype (bf16: 10 B vs 6 B, 1.7× the floor; at B = 4, T = 4,096, C = 2,048: 336 MB, ~115 µs at
3 TB/s), 7e in fp32 (bf16 x: 14 B). Per element: 2W + 1 tile loads and one exp in the first kernel,
W in the second (the old single kernel: W² + W loads and W exps).

The one-pass backward (`one_pass_backward=True`, the default; `_conv_bwd_fused`): each block recomputes dpre on
its BT rows, the first W − 1 of them a halo owned by the previous block, and shifts dpre along the rows
with `tl.gather` (Triton's register shuffle) to form dx: DRAM bytes x + dy + dx (the floor), W
tap loads plus (W − 1)/BT recomputed halo rows per element. On the H100 it is the faster of the two
(190 vs 394 µs at B = 4, T = 4,096, C = 1,024, bf16) but still ≈ 6× the byte floor (the launch settings below).
With DW_ACC (the default since the H200 sweep of r4s9: W ≤ 4) dw's products are summed elementwise per tap over
the program's blocks and reduced over the rows once, not once per block: 127 µs at C = 1,024, 232 at 2,048 (the
per-block reductions, cross-warp through shared memory, were a third of the kernel).

The joint launch (`short_conv_joint`, issue 32): a layer's q, k and v convs (one width, activation and bias-ness) as
NSEG = 3 segments of one conv over the joint C = C_q + C_k + C_v channels: x [B, T, C] is the q|k|v column range of
the joint projection [B, T, R] (row stride R, read in place), the weights [C, W], biases [C] and tails [B, W − 1, C]
are the three concatenated (W + 1 values a channel, plus the tails: cheap), and every channel block belongs to one
segment (`_segment`: each segment starts a new block; ALIGN = gcd(C_s, 16) keeps the offsets' divisibility for
vectorized access). Outputs: y_q [B, T, C_q], y_k, y_v, each contiguous (the kernel picks the segment's pointer), so
the consumers (the prologue's L2 norm, the delta kernels, recompute by `conv_source` of one segment alone) see what
they saw; the backward reads dy_q, dy_k, dy_v in place and writes dx of all C channels — with grad_in_base, as the
q|k|v columns of a fresh [B, T, R] buffer that the projection's split (`kernels.split_into_grad_buffer`) completes in
place with the a, b, z (and padding) columns: the old wiring's cat of dY (read and write all R columns: 12,360 bytes
a token a layer at the preset) becomes a copy of the R − C other columns (3,136 bytes at R = 3,088, C = 2,304, bf16).
DRAM bytes per element of the conv itself: as the per-conv path (x + dy + dx in the backward, x + y forward); one
launch each way instead of three, 3× the programs per launch (waves: 960 → 2,880 backward programs at B = 8,
T = 2,048, BC 32, NBLK 8).

The row-streaming backward (`_conv_bwd_rows`, LAUNCH["conv_bwd_rows"]["ON"], on by default; W ≤ 4; per conv and
joint): a program of RUN xp rows × BC channels walks its rows one at a time (W − 1 halo rows first), carrying the
W − 1 previous xp rows and the W partial dxp rows in registers, dw and db per channel in registers: [BC] vectors
only (sm_90: 96 registers against the one-pass kernel's 255). DRAM bytes x + dy + dx plus (W − 1)/RUN halo rows.
The preset's LM step, graphed on an H200, 43.4 → 42.1 ms at 8×2048 with it (RUN 128; r4s12 call 2); W > 4 and
`one_pass_backward=False` keep the block kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import GRAD_BUFFER, empty_output
from ...variants import conv_backward
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import MAX_CONV_WIDTH
from ..common.util import launch, table, tile

Tensor = torch.Tensor

__all__ = ["short_conv", "short_conv_joint", "MAX_CONV_WIDTH", "conv_source", "conv_recompute", "conv_release"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Launch settings: util.LAUNCH's "conv_fwd", "conv_bwd_fused" (the one-pass backward), "conv_bwd_dpre" and
#: "conv_bwd_dx" (the two-kernel backward). Chosen from ptxas's register counts for sm_90 (compiled on a CPU
#: machine), bf16, W = 4: the dpre kernel holds the W tap tiles and their addresses across a block (64 × 64 tiles:
#: 255 registers; 8 × 128: 80, no spills), the dx kernel 56 (16 × 128); the one-pass backward reads x, dy and dx
#: only (the byte floor, plus the (W − 1)/BT halo), the shift by `tl.gather` (lowered through shared memory and
#: warp shuffles): 128 registers at 32 × 32 (237 at 32 × 64). The one-pass backward is the default since the H100
#: sweep (`scripts/bench_conv.py --sweep`, B=4, T=4096, W=4, bf16): at BT 64 190 µs (C=1024) / 345 µs (C=2048),
#: the two kernels at their defaults 394 / 746 µs, their best 236 / 448 µs (BT 16, NBLK 8) — all still 6× over the
#: byte floor (30 / 60 µs).


@triton.jit
def _xp(x, tail, i_b, s, cols, mc, T, C, sxb, sxt, XDT: tl.constexpr, W1: tl.constexpr, HAS_TAIL: tl.constexpr):
    """xp[i_b, s, cols] as fp32 (0 outside [0, W − 1 + T)), rounded to x's dtype: [BT, BC].
    x [B, T, C] with strides (sxb, sxt, 1); the tail [B, W − 1, C] contiguous."""
    in_x = (s >= W1) & (s < T + W1)
    v = tl.load(x + i_b * sxb + (s - W1)[:, None] * sxt + cols[None, :], mask=in_x[:, None] & mc[None, :],
                other=0.0).to(tl.float32)
    if HAS_TAIL:
        in_t = (s >= 0) & (s < W1)
        vt = tl.load(tail + (i_b * W1 + s)[:, None] * C + cols[None, :], mask=in_t[:, None] & mc[None, :],
                     other=0.0).to(XDT).to(tl.float32)
        v = tl.where(in_t[:, None], vt, v)
    return v


@triton.jit
def _tap(x, tail, w, i_b, t, p, cols, mc, T, C, sxb, sxt, i: tl.constexpr, XDT: tl.constexpr, W: tl.constexpr,
         HAS_TAIL: tl.constexpr, HAS_POS: tl.constexpr):
    """(xp_{t+i} ρ_{t,i} [BT, BC], w_i [BC]) of tap i at output rows t (positions p)."""
    v = _xp(x, tail, i_b, t + i, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)
    if HAS_POS and i < W - 1:
        v = tl.where((p >= W - 1 - i)[:, None], v, 0.0)
    wi = tl.load(w + cols * W + i, mask=mc, other=0.0).to(XDT).to(tl.float32)
    return v, wi


@triton.jit
def _pre(x, tail, w, bias, i_b, t, p, cols, mc, T, C, sxb, sxt, XDT: tl.constexpr, W: tl.constexpr,
         BT: tl.constexpr, BC: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr,
         HAS_POS: tl.constexpr):
    """pre at rows t [BT] × cols [BC] (positions p [BT])."""
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for i in tl.static_range(W):
        v, wi = _tap(x, tail, w, i_b, t, p, cols, mc, T, C, sxb, sxt, i, XDT, W, HAS_TAIL, HAS_POS)
        acc += v * wi[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mc, other=0.0).to(XDT).to(tl.float32)[None, :]
    return acc


@triton.jit
def _positions(pos, i_b, t, T, HAS_POS: tl.constexpr):
    """p_t [BT] (0 outside [0, T) and without positions)."""
    p = tl.zeros_like(t)
    if HAS_POS:
        p = tl.load(pos + i_b * T + t, mask=(t >= 0) & (t < T), other=0)
    return p


@triton.jit
def _segment(i_c, y0, y1, y2, C0, C1, C2, BC: tl.constexpr, NSEG: tl.constexpr, ALIGN: tl.constexpr):
    """Channel block i_c of the joint range of NSEG ≤ 3 segments (widths C0, C1, C2; each starts a new block):
    (its segment's tensor among y0, y1, y2, the segment's width Cs, its first joint channel, the block's index inside
    the segment). NSEG = 1: (y0, C0, 0, i_c). ALIGN: a divisor of every C_s (≤ 16), told to the compiler so
    that the loads and stores at the segment's offset and row stride stay vectorized as at NSEG = 1."""
    yp = y0
    cs = C0 + 0 * i_c
    off = 0 * i_c
    blk = i_c
    if NSEG > 1:
        n0 = tl.cdiv(C0, BC)
        n1 = tl.cdiv(C1, BC)
        if i_c >= n0 + n1:
            yp = y2
        elif i_c >= n0:
            yp = y1
        in1 = (i_c >= n0) & (i_c < n0 + n1)
        in2 = i_c >= n0 + n1
        blk = i_c - tl.where(in2, n0 + n1, tl.where(in1, n0, 0))
        cs = tl.where(in2, C2, tl.where(in1, C1, C0))
        off = tl.where(in2, C0 + C1, tl.where(in1, C0, 0))
        if ALIGN > 1:
            cs = tl.multiple_of(cs, ALIGN)
            off = tl.multiple_of(off, ALIGN)
    return yp, cs, off, blk


@triton.jit
def _conv_fwd(x, tail, w, bias, pos, y, y1, y2, new_tail, T, C, C0, C1, C2, sxb, sxt, XDT: tl.constexpr,
              W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_TAIL: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr, NSEG: tl.constexpr,
              ALIGN: tl.constexpr):
    """y of the segment owning channel block i_c (`_segment`: y, y1, y2 [B, T, Cs] contiguous), the joint new
    tail [B, W − 1, C]; x, the tail, w and bias span the joint C = C0 + C1 + C2 channels."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    yp, Cs, off, blk = _segment(i_c, y, y1, y2, C0, C1, C2, BC, NSEG, ALIGN)
    lc = blk * BC + tl.arange(0, BC)
    mc = lc < Cs
    cols = off + lc
    t = i_t * BT + tl.arange(0, BT).to(tl.int64)
    p = _positions(pos, i_b, t, T, HAS_POS)
    acc = _pre(x, tail, w, bias, i_b, t, p, cols, mc, T, C, sxb, sxt, XDT, W, BT, BC, HAS_TAIL, HAS_BIAS, HAS_POS)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(yp + (i_b * T + t)[:, None] * Cs + lc[None, :], acc.to(y.dtype.element_ty),
             mask=(t < T)[:, None] & mc[None, :])
    if W > 1:
        if i_t == 0:  # new tail = xp rows T .. T + W − 2
            j = tl.arange(0, BW).to(tl.int64)
            v = _xp(x, tail, i_b, T + j, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)
            tl.store(new_tail + (i_b * (W - 1) + j)[:, None] * C + cols[None, :], v.to(new_tail.dtype.element_ty),
                     mask=(j < W - 1)[:, None] & mc[None, :])


@triton.jit
def _dpre_rows(x, tail, w, bias, pos, dy, i_b, t, mt, cols, lc, Cs, mc, T, C, sxb, sxt, XDT: tl.constexpr,
               W: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_POS: tl.constexpr, SILU: tl.constexpr):
    """(the positions p_t, dpre_t = dy_t · SILU'(pre_t) [BT, BC] fp32, 0 outside the rows mt) at rows t,
    pre recomputed from its W taps — both backwards' first step. dy: the segment's [B, T, Cs] (channels lc)."""
    p = _positions(pos, i_b, t, T, HAS_POS)
    pre = _pre(x, tail, w, bias, i_b, t, p, cols, mc, T, C, sxb, sxt, XDT, W, BT, BC, HAS_TAIL, HAS_BIAS, HAS_POS)
    g = tl.load(dy + (i_b * T + t)[:, None] * Cs + lc[None, :], mask=mt[:, None] & mc[None, :],
                other=0.0).to(tl.float32)
    if SILU:
        sg = 1.0 / (1.0 + tl.exp(-pre))
        g = g * sg * (1.0 + pre * (1.0 - sg))
    return p, tl.where(mt[:, None], g, 0.0)


@triton.jit
def _conv_bwd_dpre(x, tail, w, bias, pos, dy, dy1, dy2, dpre, dw_part, db_part, T, C, C0, C1, C2, sxb, sxt,
                   XDT: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   NBLK: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                   SILU: tl.constexpr, NSEG: tl.constexpr, ALIGN: tl.constexpr):
    """dpre [B, T, C] (contiguous, dpre's dtype) of output rows [i_r·NBLK·BT, +NBLK·BT) ∩ [0, T), and
    this program's partial sums dw_part[i_b·NR + i_r, cols, :W], db_part[i_b·NR + i_r, cols]."""
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NR = tl.num_programs(0)
    dyp, Cs, off, blk = _segment(i_c, dy, dy1, dy2, C0, C1, C2, BC, NSEG, ALIGN)
    lc = blk * BC + tl.arange(0, BC)
    mc = lc < Cs
    cols = off + lc
    j = tl.arange(0, BW)
    dw_acc = tl.zeros((BW, BC), dtype=tl.float32)  # [taps, channels]: the reduced rows' layout
    db_acc = tl.zeros((BC,), dtype=tl.float32)
    t0 = i_r * (NBLK * BT)
    for k in range(NBLK):
        ts = t0 + k * BT
        if ts < T:  # the program's blocks that start before T
            t = ts + tl.arange(0, BT).to(tl.int64)
            mt = t < T
            p, g = _dpre_rows(x, tail, w, bias, pos, dyp, i_b, t, mt, cols, lc, Cs, mc, T, C, sxb, sxt, XDT, W, BT, BC,
                              HAS_TAIL, HAS_BIAS, HAS_POS, SILU)
            tl.store(dpre + (i_b * T + t)[:, None] * C + cols[None, :], g.to(dpre.dtype.element_ty),
                     mask=mt[:, None] & mc[None, :])
            if HAS_BIAS:
                db_acc += tl.sum(g, axis=0)
            for i in tl.static_range(W):  # the taps again (cache hits): dw_i += Σ_t g_t xp_{t+i} ρ_{t,i}
                v, _ = _tap(x, tail, w, i_b, t, p, cols, mc, T, C, sxb, sxt, i, XDT, W, HAS_TAIL, HAS_POS)
                dw_acc += tl.where((j == i)[:, None], tl.sum(g * v, axis=0)[None, :], 0.0)
    part = i_b * NR + i_r
    tl.store(dw_part + (part * C + cols)[None, :] * W + j[:, None], dw_acc, mask=(j < W)[:, None] & mc[None, :])
    if HAS_BIAS:
        tl.store(db_part + part * C + cols, db_acc, mask=mc)


@triton.jit
def _conv_bwd_fused(x, tail, w, bias, pos, dy, dy1, dy2, dnt, dx, dtail, dw_part, db_part, T, C, C0, C1, C2,
                    sxb, sxt, sdb, sdt, XDT: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr,
                    NBLK: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr,
                    SILU: tl.constexpr, HAS_DNT: tl.constexpr, DTAIL: tl.constexpr, DW_ACC: tl.constexpr,
                    NSEG: tl.constexpr, ALIGN: tl.constexpr):
    """The whole backward in one pass (`one_pass_backward`): block k of program i_r owns the BO = BT − W + 1
    xp rows and dpre rows [u0, u0 + BO), u0 = (i_r·NBLK + k)·BO; it computes dpre at rows t = u0 − W + 1 + r
    (r < BT: the W − 1 rows before u0 recomputed as a halo), dxp at its own rows as Σ_i dpre_{s−i} w_i ρ
    with the shift a `tl.gather` along the rows, and sums dw, db over its own dpre rows. DW_ACC (W ≤ 4): the
    products dpre_t xp_{t+i} ρ are summed elementwise into one [BT, BC] tile per tap over the program's NBLK
    blocks and reduced over the rows once at the end (one cross-warp reduction per tap a program instead of one
    per tap and block)."""
    BO: tl.constexpr = BT - (W - 1)
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NR = tl.num_programs(0)
    dyp, Cs, off, blk = _segment(i_c, dy, dy1, dy2, C0, C1, C2, BC, NSEG, ALIGN)
    lc = blk * BC + tl.arange(0, BC)
    mc = lc < Cs
    cols = off + lc
    j = tl.arange(0, BW)
    r = tl.arange(0, BT)
    dw_acc = tl.zeros((BW, BC), dtype=tl.float32)
    db_acc = tl.zeros((BC,), dtype=tl.float32)
    a0 = tl.zeros((BT, BC), dtype=tl.float32)  # DW_ACC: tap i's elementwise sums (W ≤ 4)
    a1 = tl.zeros((BT, BC), dtype=tl.float32)
    a2 = tl.zeros((BT, BC), dtype=tl.float32)
    a3 = tl.zeros((BT, BC), dtype=tl.float32)
    for k in range(NBLK):
        u0 = (i_r * NBLK + k) * BO
        if u0 < T + W - 1:  # the program's blocks that start inside xp
            t = u0 - (W - 1) + r.to(tl.int64)  # dpre rows of the block, and (the same numbers) its xp rows s
            mt = (t >= 0) & (t < T)
            own = r >= W - 1
            p, g = _dpre_rows(x, tail, w, bias, pos, dyp, i_b, t, mt, cols, lc, Cs, mc, T, C, sxb, sxt, XDT, W, BT, BC,
                              HAS_TAIL, HAS_BIAS, HAS_POS, SILU)
            go = tl.where(own[:, None], g, 0.0)
            if HAS_BIAS:
                db_acc += tl.sum(go, axis=0)
            dxp = tl.zeros((BT, BC), dtype=tl.float32)
            for i in tl.static_range(W):
                v, wi = _tap(x, tail, w, i_b, t, p, cols, mc, T, C, sxb, sxt, i, XDT, W, HAS_TAIL, HAS_POS)
                if DW_ACC:
                    if i == 0:
                        a0 += go * v
                    elif i == 1:
                        a1 += go * v
                    elif i == 2:
                        a2 += go * v
                    else:
                        a3 += go * v
                else:
                    dw_acc += tl.where((j == i)[:, None], tl.sum(go * v, axis=0)[None, :], 0.0)
                gi = g * wi[None, :]
                if HAS_POS and i < W - 1:
                    gi = tl.where((p >= W - 1 - i)[:, None], gi, 0.0)
                if i == 0:
                    dxp += gi
                else:  # row r takes row r − i (rows r < i: clamped, not owned)
                    src = tl.maximum(r - i, 0)
                    dxp += tl.gather(gi, tl.broadcast_to(src[:, None], (BT, BC)), 0)
            if HAS_DNT:
                if W > 1:
                    m_n = (t >= T) & (t < T + W - 1)
                    dxp += tl.load(dnt + (i_b * (W - 1) + t - T)[:, None] * C + cols[None, :],
                                   mask=m_n[:, None] & mc[None, :], other=0.0).to(tl.float32)
            in_x = own & (t >= W - 1) & (t < T + W - 1)
            tl.store(dx + i_b * sdb + (t - (W - 1))[:, None] * sdt + cols[None, :], dxp.to(dx.dtype.element_ty),
                     mask=in_x[:, None] & mc[None, :])
            if DTAIL:
                in_t = own & (t >= 0) & (t < W - 1)
                tl.store(dtail + (i_b * (W - 1) + t)[:, None] * C + cols[None, :], dxp.to(dtail.dtype.element_ty),
                         mask=in_t[:, None] & mc[None, :])
    if DW_ACC:
        dw_acc = tl.where((j == 0)[:, None], tl.sum(a0, axis=0)[None, :], 0.0)
        if W > 1:
            dw_acc += tl.where((j == 1)[:, None], tl.sum(a1, axis=0)[None, :], 0.0)
        if W > 2:
            dw_acc += tl.where((j == 2)[:, None], tl.sum(a2, axis=0)[None, :], 0.0)
        if W > 3:
            dw_acc += tl.where((j == 3)[:, None], tl.sum(a3, axis=0)[None, :], 0.0)
    part = i_b * NR + i_r
    tl.store(dw_part + (part * C + cols)[None, :] * W + j[:, None], dw_acc, mask=(j < W)[:, None] & mc[None, :])
    if HAS_BIAS:
        tl.store(db_part + part * C + cols, db_acc, mask=mc)


@triton.jit
def _xp_row(x, tail, i_b, s, cols, mc, T, C, sxb, sxt, XDT: tl.constexpr, W1: tl.constexpr, HAS_TAIL: tl.constexpr):
    """xp[i_b, s, cols] of one row s (a scalar) as fp32 [BC] (0 outside [0, W − 1 + T)), rounded to x's dtype."""
    in_x = (s >= W1) & (s < T + W1)
    v = tl.load(x + i_b * sxb + (s - W1) * sxt + cols, mask=mc & in_x, other=0.0).to(tl.float32)
    if HAS_TAIL:
        in_t = (s >= 0) & (s < W1)
        vt = tl.load(tail + (i_b * W1 + s) * C + cols, mask=mc & in_t, other=0.0).to(XDT).to(tl.float32)
        v = tl.where(in_t, vt, v)
    return v


@triton.jit
def _conv_bwd_rows(x, tail, w, bias, pos, dy, dy1, dy2, dnt, dx, dtail, dw_part, db_part, T, C, C0, C1, C2,
                   sxb, sxt, sdb, sdt, XDT: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, RUN: tl.constexpr,
                   HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, SILU: tl.constexpr,
                   HAS_DNT: tl.constexpr, DTAIL: tl.constexpr, NSEG: tl.constexpr, ALIGN: tl.constexpr):
    """The one-pass backward streamed along the rows (W ≤ 4; LAUNCH["conv_bwd_rows"]["ON"]): program i_r owns the xp
    rows and dpre rows [a, a + RUN) ∩ [0, T + W − 1), a = i_r·RUN, of BC channels and walks them one row at a time
    from a − W + 1 (the W − 1 halo rows: dpre recomputed, nothing stored), carrying in registers the W − 1 previous xp
    rows (pre_t needs xp_{t..t+W−1}: one new row loaded a step) and the W partial sums of dxp_{t..t+W−1} (dpre_t adds
    dpre_t w_i ρ_{t,i} to row t + i; row t is then complete and stored); dw_i, db summed per channel in registers.
    Every tensor is a [BC] vector (BC / (32·num_warps) values a thread): no [BT, BC] tiles, no shuffles."""
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NR = tl.num_programs(0)
    dyp, Cs, off, blk = _segment(i_c, dy, dy1, dy2, C0, C1, C2, BC, NSEG, ALIGN)
    lc = blk * BC + tl.arange(0, BC)
    mc = lc < Cs
    cols = off + lc
    w0 = tl.load(w + cols * W, mask=mc, other=0.0).to(XDT).to(tl.float32)
    w1 = w0 * 0.0
    w2 = w0 * 0.0
    w3 = w0 * 0.0
    if W > 1:
        w1 = tl.load(w + cols * W + 1, mask=mc, other=0.0).to(XDT).to(tl.float32)
    if W > 2:
        w2 = tl.load(w + cols * W + 2, mask=mc, other=0.0).to(XDT).to(tl.float32)
    if W > 3:
        w3 = tl.load(w + cols * W + 3, mask=mc, other=0.0).to(XDT).to(tl.float32)
    bb = w0 * 0.0
    if HAS_BIAS:
        bb = tl.load(bias + cols, mask=mc, other=0.0).to(XDT).to(tl.float32)
    a = i_r.to(tl.int64) * RUN
    e = tl.minimum(a + RUN, T + W - 1)
    t0 = a - (W - 1)
    # the window xp_{t}, xp_{t+1}, xp_{t+2} before the first step (rows ≥ W − 1 of it unused at smaller W)
    c0 = _xp_row(x, tail, i_b, t0, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)
    c1 = c0 * 0.0
    c2 = c0 * 0.0
    if W > 2:
        c1 = _xp_row(x, tail, i_b, t0 + 1, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)
    if W > 3:
        c2 = _xp_row(x, tail, i_b, t0 + 2, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)
    acc0 = w0 * 0.0  # dxp rows t, t + 1, t + 2, t + 3 (partial)
    acc1 = w0 * 0.0
    acc2 = w0 * 0.0
    acc3 = w0 * 0.0
    dw0 = w0 * 0.0
    dw1 = w0 * 0.0
    dw2 = w0 * 0.0
    dw3 = w0 * 0.0
    db = w0 * 0.0
    for t in range(t0, e):
        xn = _xp_row(x, tail, i_b, t + W - 1, cols, mc, T, C, sxb, sxt, XDT, W - 1, HAS_TAIL)  # xp_{t+W−1}
        if W == 1:
            v0 = xn
        else:
            v0 = c0
        v1 = c1
        v2 = c2
        if W == 2:
            v1 = xn
        if W == 3:
            v2 = xn
        v3 = xn
        valid = (t >= 0) & (t < T)
        p = 0
        if HAS_POS:
            p = tl.load(pos + i_b * T + t, mask=valid, other=0)
        # ρ_{t,i} = [p_t ≥ W − 1 − i] (the last tap always)
        r0 = (W - 1 == 0) | (p >= W - 1) | (not HAS_POS)
        r1 = (W - 1 == 1) | (p >= W - 2) | (not HAS_POS)
        r2 = (W - 1 == 2) | (p >= W - 3) | (not HAS_POS)
        u0 = tl.where(r0, v0, 0.0)
        u1 = tl.where(r1, v1, 0.0)
        u2 = tl.where(r2, v2, 0.0)
        pre = bb + w0 * u0
        if W > 1:
            pre += w1 * u1
        if W > 2:
            pre += w2 * u2
        if W > 3:
            pre += w3 * v3
        g = tl.load(dyp + (i_b * T + t) * Cs + lc, mask=mc & valid, other=0.0).to(tl.float32)
        if SILU:
            sg = 1.0 / (1.0 + tl.exp(-pre))
            g = g * sg * (1.0 + pre * (1.0 - sg))
        g = tl.where(valid, g, 0.0)
        own = t >= a
        go = tl.where(own, g, 0.0)
        db += go
        dw0 += go * u0
        acc0 += tl.where(r0, g * w0, 0.0)
        if W > 1:
            dw1 += go * u1
            acc1 += tl.where(r1, g * w1, 0.0)
        if W > 2:
            dw2 += go * u2
            acc2 += tl.where(r2, g * w2, 0.0)
        if W > 3:
            dw3 += go * v3
            acc3 += g * w3
        dxp = acc0
        if HAS_DNT:
            if W > 1:
                m_n = (t >= T) & (t < T + W - 1)
                dxp += tl.load(dnt + (i_b * (W - 1) + t - T) * C + cols, mask=mc & m_n, other=0.0).to(tl.float32)
        in_x = own & (t >= W - 1) & (t < T + W - 1)
        tl.store(dx + i_b * sdb + (t - (W - 1)) * sdt + cols, dxp.to(dx.dtype.element_ty), mask=mc & in_x)
        if DTAIL:
            in_t = own & (t >= 0) & (t < W - 1)
            tl.store(dtail + (i_b * (W - 1) + t) * C + cols, dxp.to(dtail.dtype.element_ty), mask=mc & in_t)
        acc0 = acc1
        acc1 = acc2
        acc2 = acc3
        acc3 = w0 * 0.0
        c0 = c1
        c1 = c2
        if W == 2:
            c0 = xn
        if W == 3:
            c1 = xn
        if W == 4:
            c2 = xn
    part = i_b * NR + i_r
    tl.store(dw_part + (part * C + cols) * W, dw0, mask=mc)
    if W > 1:
        tl.store(dw_part + (part * C + cols) * W + 1, dw1, mask=mc)
    if W > 2:
        tl.store(dw_part + (part * C + cols) * W + 2, dw2, mask=mc)
    if W > 3:
        tl.store(dw_part + (part * C + cols) * W + 3, dw3, mask=mc)
    if HAS_BIAS:
        tl.store(db_part + part * C + cols, db, mask=mc)


@triton.jit
def _conv_bwd_dx(dpre, w, pos, dnt, dx, dtail, T, C, sdb, sdt, XDT: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, HAS_POS: tl.constexpr, HAS_DNT: tl.constexpr, DTAIL: tl.constexpr):
    """dxp at xp rows s = [i_s·BT, +BT) from W shifted dpre tiles: dx rows s − W + 1 (strides sdb, sdt, 1), dtail
    rows s."""
    i_s, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols = i_c * BC + tl.arange(0, BC)
    mc = cols < C
    s = i_s * BT + tl.arange(0, BT).to(tl.int64)  # rows of xp
    dxp = tl.zeros((BT, BC), dtype=tl.float32)
    for i in tl.static_range(W):  # tap i of output rows t = s − i
        t = s - i
        mt = (t >= 0) & (t < T)
        g = tl.load(dpre + (i_b * T + t)[:, None] * C + cols[None, :], mask=mt[:, None] & mc[None, :],
                    other=0.0).to(tl.float32)
        if HAS_POS and i < W - 1:
            p = _positions(pos, i_b, t, T, HAS_POS)
            g = tl.where((p >= W - 1 - i)[:, None], g, 0.0)
        wi = tl.load(w + cols * W + i, mask=mc, other=0.0).to(XDT).to(tl.float32)
        dxp += g * wi[None, :]
    if HAS_DNT:
        if W > 1:
            m_n = (s >= T) & (s < T + W - 1)
            dxp += tl.load(dnt + (i_b * (W - 1) + s - T)[:, None] * C + cols[None, :], mask=m_n[:, None] & mc[None, :],
                           other=0.0).to(tl.float32)
    in_x = (s >= W - 1) & (s < T + W - 1)
    tl.store(dx + i_b * sdb + (s - (W - 1))[:, None] * sdt + cols[None, :], dxp.to(dx.dtype.element_ty),
             mask=in_x[:, None] & mc[None, :])
    if DTAIL:
        in_t = (s >= 0) & (s < W - 1)
        tl.store(dtail + (i_b * (W - 1) + s)[:, None] * C + cols[None, :], dxp.to(dtail.dtype.element_ty),
                 mask=in_t[:, None] & mc[None, :])


def _tl_dtype(dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _rows_view(x: Tensor) -> Tensor:
    """x itself when its channels are contiguous (any batch and row strides), else a contiguous copy."""
    return x if x.stride(2) == 1 or x.shape[2] <= 1 else x.contiguous()


def _align(sizes: tuple[int, ...]) -> int:
    """The kernels' ALIGN: gcd(C_s..., 16) of several segments (1 for one: its width is an argument, specialized)."""
    return math.gcd(16, *sizes) if len(sizes) > 1 else 1


def _seg_args(ts: list, sizes: tuple[int, ...]) -> tuple:
    """(t0, t1, t2, C0, C1, C2): the segments' tensors and widths as the kernels take them (unused ones: t0, 0)."""
    ts = list(ts) + [ts[0]] * (3 - len(ts))
    cs = list(sizes) + [0] * (3 - len(sizes))
    return (*ts, *cs)


def _conv_forward(x, tail, weight, bias, positions, silu, sizes):
    """([y_s [B, T, C_s] for each segment], joint new tail [B, W − 1, C]) — x, tail, weight, bias span C = Σ C_s."""
    B, T, C = x.shape
    W = weight.shape[-1]
    dummy = x.new_zeros(1)
    ys = [empty_output(B, T, c, dtype=x.dtype, device=x.device) for c in sizes]
    new_tail = empty_output(B, W - 1, C, dtype=x.dtype, device=x.device)
    has_tail = tail is not None and W > 1
    if B * T * C > 0:
        BT, BC = tile("conv_fwd", "BT"), tile("conv_fwd", "BC")
        grid = (triton.cdiv(T, BT), sum(triton.cdiv(c, BC) for c in sizes), B)
        _conv_fwd[grid](x, tail if has_tail else dummy, weight, bias if bias is not None else dummy,
                        positions if positions is not None else dummy, *_seg_args(ys, sizes)[:3],
                        new_tail if W > 1 else dummy, T, C, *_seg_args(ys, sizes)[3:],
                        x.stride(0), x.stride(1), XDT=_tl_dtype(x.dtype), W=W,
                        BW=triton.next_power_of_2(max(W - 1, 1)), BT=BT, BC=BC,
                        HAS_TAIL=has_tail, HAS_BIAS=bias is not None, HAS_POS=positions is not None, SILU=silu,
                        NSEG=len(sizes), ALIGN=_align(sizes), **launch("conv_fwd"))
    elif W > 1 and B * C > 0:  # T = 0: the tail carries over
        new_tail.copy_(tail if tail is not None else torch.zeros_like(new_tail))
    return ys, new_tail


def _conv_backward(x, tail, weight, bias, positions, silu, one_pass, sizes, dys, dnt, need, into=None):
    """(dx [B, T, C] — ONE buffer over the joint channels —, dtail [B, W − 1, C] or None, dw, db) from the
    segments' output gradients dys (each [B, T, C_s] or None) and the joint new tail's dnt (or None).
    into = (R, c0): dx is the column view [..., c0:c0 + C] of a fresh [B, T, R] buffer marked GRAD_BUFFER (the
    gradient of the wider tensor x is a column view of: `split_into_grad_buffer`'s backward fills the other columns
    in place instead of a cat)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    dummy = x.new_zeros(1)
    has_tail = tail is not None and W > 1
    if into is not None:
        R, c0 = into
        full = empty_output(B, T, R, dtype=x.dtype, device=x.device)
        setattr(full, GRAD_BUFFER, True)
        dx = full[..., c0:c0 + C]
    else:
        dx = empty_output(B, T, C, dtype=x.dtype, device=x.device)
    want_dtail = tail is not None and need[1]
    dtail = empty_output(*tail.shape, dtype=tail.dtype, device=x.device) if want_dtail else None
    # the variant (`kernels.variants.conv_backward`: the rows, the block one-pass or the two kernels), the one branch
    # that picks the kernel below and names it (`fastweights.layer_op_pipeline`, a ShortConv's repr)
    chosen = conv_backward(W, table(), one_pass=bool(one_pass))
    fused = chosen.kind != "two kernels" and T > 0
    rows = fused and chosen.kind == "rows"  # the row-streaming one-pass backward
    site = "conv_bwd_fused" if fused else "conv_bwd_dpre"
    BT, BC, NBLK = (tile(site, key) for key in ("BT", "BC", "NBLK"))
    if rows:  # programs of RUN xp rows × RBC channels
        RUN, BC = chosen.run, tile("conv_bwd_rows", "BC")
        NR = triton.cdiv(T + W - 1, RUN)
    elif fused:  # programs of NBLK blocks owning FBT − W + 1 xp rows each
        FBT = max(BT, triton.next_power_of_2(2 * W))
        NR = triton.cdiv(triton.cdiv(T + W - 1, FBT - (W - 1)), NBLK)
    else:
        NR = triton.cdiv(T, NBLK * BT)  # output rows per dpre program
    dw_part = empty_output(B * NR, C, W, dtype=torch.float32, device=x.device)
    db_part = empty_output(B * NR, C, dtype=torch.float32, device=x.device) if bias is not None else None
    has_dnt = dnt is not None and W > 1
    NC = sum(triton.cdiv(c, BC) for c in sizes)  # channel blocks: each segment starts a new one
    if B * C > 0 and T > 0:
        dys = [torch.zeros(B, T, c, dtype=x.dtype, device=x.device) if d is None else d.contiguous()
               for d, c in zip(dys, sizes)]
        seg = _seg_args(dys, sizes)
    if B * C > 0 and T > 0 and rows:
        _conv_bwd_rows[(NR, NC, B)](
            x, tail if has_tail else dummy, weight, bias if bias is not None else dummy,
            positions if positions is not None else dummy, *seg[:3], dnt.contiguous() if has_dnt else dummy, dx,
            dtail if (want_dtail and W > 1) else dummy, dw_part, db_part if db_part is not None else dummy,
            T, C, *seg[3:], x.stride(0), x.stride(1), dx.stride(0), dx.stride(1), XDT=_tl_dtype(x.dtype), W=W,
            BC=BC, RUN=RUN, HAS_TAIL=has_tail, HAS_BIAS=bias is not None, HAS_POS=positions is not None, SILU=silu,
            HAS_DNT=has_dnt, DTAIL=want_dtail and W > 1, NSEG=len(sizes), ALIGN=_align(sizes),
            **launch("conv_bwd_rows"))
    elif B * C > 0 and T > 0 and fused:
        _conv_bwd_fused[(NR, NC, B)](
            x, tail if has_tail else dummy, weight, bias if bias is not None else dummy,
            positions if positions is not None else dummy, *seg[:3], dnt.contiguous() if has_dnt else dummy, dx,
            dtail if (want_dtail and W > 1) else dummy, dw_part, db_part if db_part is not None else dummy,
            T, C, *seg[3:], x.stride(0), x.stride(1), dx.stride(0), dx.stride(1), XDT=_tl_dtype(x.dtype), W=W,
            BW=triton.next_power_of_2(W),
            BT=FBT, BC=BC, NBLK=NBLK, HAS_TAIL=has_tail, HAS_BIAS=bias is not None,
            HAS_POS=positions is not None, SILU=silu, HAS_DNT=has_dnt, DTAIL=want_dtail and W > 1,
            DW_ACC=chosen.dw_acc, NSEG=len(sizes), ALIGN=_align(sizes),
            **launch("conv_bwd_fused"))
    elif B * C > 0 and T > 0:
        fp32 = chosen.dpre_fp32
        dpre = empty_output(B, T, C, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
        _conv_bwd_dpre[(NR, NC, B)](
            x, tail if has_tail else dummy, weight, bias if bias is not None else dummy,
            positions if positions is not None else dummy, *seg[:3], dpre, dw_part,
            db_part if db_part is not None else dummy, T, C, *seg[3:], x.stride(0), x.stride(1),
            XDT=_tl_dtype(x.dtype), W=W, BW=triton.next_power_of_2(W), BT=BT, BC=BC, NBLK=NBLK,
            HAS_TAIL=has_tail, HAS_BIAS=bias is not None, HAS_POS=positions is not None, SILU=silu,
            NSEG=len(sizes), ALIGN=_align(sizes), **launch("conv_bwd_dpre"))
        DBT, DBC = tile("conv_bwd_dx", "BT"), tile("conv_bwd_dx", "BC")
        _conv_bwd_dx[(triton.cdiv(T + W - 1, DBT), triton.cdiv(C, DBC), B)](
            dpre, weight, positions if positions is not None else dummy,
            dnt.contiguous() if has_dnt else dummy, dx, dtail if (want_dtail and W > 1) else dummy, T, C,
            dx.stride(0), dx.stride(1), XDT=_tl_dtype(x.dtype), W=W, BT=DBT, BC=DBC, HAS_POS=positions is not None,
            HAS_DNT=has_dnt, DTAIL=want_dtail and W > 1, **launch("conv_bwd_dx"))
    else:  # nothing to convolve: only zeros (and T = 0's tail passing through)
        dx.zero_()
        dw_part.zero_()
        if db_part is not None:
            db_part.zero_()
        if dtail is not None:
            dtail.copy_(dnt if dnt is not None else torch.zeros_like(dtail))
    dw = dw_part.sum(0).reshape(weight.shape).to(weight.dtype) if need[2] else None
    db = db_part.sum(0).to(bias.dtype) if bias is not None and need[3] else None
    return (dx if need[0] else None), dtail, dw, db


class ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tail, weight, bias, positions, silu, one_pass=True):
        (y,), new_tail = _conv_forward(x, tail, weight, bias, positions, silu, (x.shape[2],))
        ctx.save_for_backward(x, tail, weight, bias, positions)
        ctx.silu, ctx.one_pass = silu, one_pass
        return y, new_tail

    @staticmethod
    def backward(ctx, dy, dnt):
        x, tail, weight, bias, positions = ctx.saved_tensors
        grads = _conv_backward(x, tail, weight, bias, positions, ctx.silu, ctx.one_pass, (x.shape[2],), [dy], dnt,
                               ctx.needs_input_grad)
        return (*grads, None, None, None)


class JointConvFn(torch.autograd.Function):
    """The convs of NSEG ≤ 3 adjacent channel ranges of one input in one launch each way: x [B, T, C] (C = Σ C_s;
    e.g. the q|k|v columns of the joint projection, read in place), the joint tail, weight [C, W] and bias ->
    (y_0 [B, T, C_0], …, joint new tail [B, W − 1, C]); the backward writes dx into one [B, T, C] buffer."""

    @staticmethod
    def forward(ctx, x, tail, weight, bias, positions, silu, one_pass, sizes, grad_in_base=False):
        ys, new_tail = _conv_forward(x, tail, weight, bias, positions, silu, sizes)
        ctx.save_for_backward(x, tail, weight, bias, positions)
        ctx.silu, ctx.one_pass, ctx.sizes = silu, one_pass, sizes
        ctx.into = _column_view_of(x) if grad_in_base else None
        ctx.set_materialize_grads(False)  # an unused output's (the new tail's) gradient: None, not a zero fill
        return (*ys, new_tail)

    @staticmethod
    def backward(ctx, *grads):
        x, tail, weight, bias, positions = ctx.saved_tensors
        dx, dtail, dw, db = _conv_backward(x, tail, weight, bias, positions, ctx.silu, ctx.one_pass, ctx.sizes,
                                           list(grads[:-1]), grads[-1], ctx.needs_input_grad, ctx.into)
        return dx, dtail, dw, db, None, None, None, None, None


def _column_view_of(x: Tensor) -> tuple[int, int] | None:
    """(R, c0) when x [B, T, C] is the column range [c0, c0 + C) of a contiguous [B, T, R] tensor (its _base), else
    None."""
    base = x._base
    if base is None or base.dim() != 3 or not base.is_contiguous() or tuple(base.shape[:2]) != tuple(x.shape[:2]):
        return None
    B, T, R = base.shape
    c0 = x.storage_offset() - base.storage_offset()
    if x.stride() != (T * R, R, 1) or not 0 <= c0 <= R - x.shape[2]:
        return None
    return R, c0


def short_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, tail: Tensor | None = None,
               positions: Tensor | None = None, activation: str | None = "silu", *, recompute_outputs: bool = True,
               one_pass_backward: bool = True) -> tuple[Tensor, Tensor]:
    """(y [B, T, C], new tail [B, W − 1, C], both in x's dtype) of `ShortConv` (see the module doc).

    x [B, T, C] fp32/bf16/fp16 (channels contiguous, any batch and row strides, e.g. a slice
    [..., a:a + C] of a wider projection: read in place; other layouts are copied); weight [C, 1, W]
    (nn.Conv1d's depthwise weight, W ≤ MAX_CONV_WIDTH) or [C, W]; bias [C] or None; tail
    [B, W − 1, C] or None (zeros); positions [B, T] integer (each token's position inside its
    document) or None; activation "silu" or None. Differentiable in x, tail, weight and bias.

    recompute_outputs: the output carries what recomputes it (`conv_source`): an op downstream that would keep the
    output for its backward (the delta prologue's raw q, k; the delta memory op's v) keeps that instead — the conv's
    own inputs, which its backward keeps anyway — and recomputes the output, bitwise (the same kernel on the same
    inputs), in its backward. False: every consumer keeps its own copy of the output (A/B of memory and time).
    one_pass_backward: the backward in one kernel (`_conv_bwd_fused`, the faster on the H100), else the two kernels
    (dpre into a scratch, then dx)."""
    short_conv_checks(x, weight, bias, tail, positions, activation)
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    args = (_rows_view(x), c(tail), weight.contiguous(), c(bias), c(positions), activation == "silu",
            bool(one_pass_backward))
    y, new_tail = ShortConvFn.apply(*args)
    if recompute_outputs and y.requires_grad:  # (no backward to come: nothing to recompute, nothing kept alive)
        y._conv_source = _ConvSource(args, y)
    return y, new_tail


def short_conv_checks(x, weight, bias, tail, positions, activation) -> None:
    """`short_conv`'s argument checks (InputError)."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.dtype not in _DTYPES:
        raise InputError(f"x must be a 3-D [B, T, C] fp32/bf16/fp16 tensor, got "
                         f"{f'{list(x.shape)} {x.dtype}' if isinstance(x, Tensor) else type(x).__name__}")
    B, T, C = x.shape
    if not isinstance(weight, Tensor) or weight.dim() not in (2, 3) or weight.shape[0] != C \
            or (weight.dim() == 3 and weight.shape[1] != 1):
        raise InputError(f"weight must be [C, 1, W] or [C, W] with C = {C}, got "
                         f"{list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    W = weight.shape[-1]
    if not 1 <= W <= MAX_CONV_WIDTH:
        raise InputError(f"the kernel width W must be 1..{MAX_CONV_WIDTH}, got {W}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (C,)):
        raise InputError(f"bias must be [C] = {[C]} or None, got {list(bias.shape)}")
    if tail is not None and (not isinstance(tail, Tensor) or tuple(tail.shape) != (B, W - 1, C)):
        raise InputError(f"tail must be [B, W − 1, C] = {[B, W - 1, C]} or None, got {list(tail.shape)}")
    if positions is not None and (not isinstance(positions, Tensor) or tuple(positions.shape) != (B, T)
                                  or positions.is_floating_point() or positions.is_complex()):
        got = f"{list(positions.shape)} {positions.dtype}" if isinstance(positions, Tensor) else repr(positions)
        raise InputError(f"positions must be an integer [B, T] = {[B, T]} tensor or None, got {got}")
    if activation not in ("silu", None):
        raise InputError(f"activation must be 'silu' or None, got {activation!r}")
    given = [t for t in (x, weight, bias, tail, positions) if t is not None]
    if any(t.device != x.device for t in given):
        raise InputError(f"x, weight, bias, tail and positions must be on one device, got "
                         f"{[str(t.device) for t in given]}")


def short_conv_joint(x: Tensor, weights: list[Tensor], biases: list[Tensor] | None = None,
                     tails: list[Tensor] | None = None, positions: Tensor | None = None,
                     activation: str | None = "silu", *, recompute_outputs: bool = True,
                     one_pass_backward: bool = True, grad_in_base: bool = False
                     ) -> tuple[list[Tensor], list[Tensor]]:
    """`short_conv` of NSEG ≤ 3 adjacent channel ranges of x in one launch each way (`JointConvFn`):
    ([y_s [B, T, C_s]], [new tail_s [B, W − 1, C_s]]), each equal bitwise to `short_conv` of x[..., range_s] with
    weights[s], biases[s], tails[s].

    x [B, T, C] (C = Σ C_s; channels contiguous, any batch and row strides: e.g. the q|k|v columns of the joint
    projection, read in place); weights: NSEG tensors [C_s, 1, W] or [C_s, W] of one width W; biases: NSEG [C_s]
    or None; tails: NSEG [B, W − 1, C_s] or None (zeros); positions [B, T] or None. The outputs y_s are
    separate contiguous tensors (as `short_conv`'s); the backward reads their gradients in place and writes dx as
    one [B, T, C] tensor (x's gradient: no cat of three), dw, db and dtail of the concatenated [C, W], [C],
    [B, W − 1, C] (split back by autograd: W + 1 values a channel). DRAM bytes per element as `short_conv`'s.
    recompute_outputs: each y_s carries what recomputes it alone (`conv_source`: the single conv on x's columns
    range_s, bitwise the same values), so a consumer recomputing q does not recompute k and v.
    grad_in_base: where x is a column view of a contiguous [B, T, R] tensor (e.g. a piece of
    `split_into_grad_buffer`), dx is written as that column view of a fresh marked [B, T, R] buffer, which the split's
    backward completes in place (no cat)."""
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= 3:
        raise InputError(f"weights must be a list of 1..3 tensors, got {type(weights).__name__}")
    n = len(weights)
    for name, lst in (("biases", biases), ("tails", tails)):
        if lst is not None and (not isinstance(lst, (list, tuple)) or len(lst) != n
                                or any(t is None for t in lst)):
            raise InputError(f"{name} must be None or a list of {n} tensors")
    sizes = tuple(int(w.shape[0]) for w in weights)
    Ws = {int(w.shape[-1]) for w in weights}
    if len(Ws) != 1 or not isinstance(x, Tensor) or x.dim() != 3 or x.shape[2] != sum(sizes):
        raise InputError(f"x [B, T, Σ C_s = {sum(sizes)}] and weights of one width, got x "
                         f"{list(getattr(x, 'shape', []))}, widths {sorted(Ws)}")
    W = Ws.pop()
    B, T, C = x.shape
    offs = [sum(sizes[:i]) for i in range(n)]
    # every piece checked as `short_conv` checks it (shapes, dtypes, devices, width)
    for i in range(n):
        short_conv_checks(x[..., offs[i]:offs[i] + sizes[i]], weights[i], biases[i] if biases else None,
                          tails[i] if tails else None, positions, activation)
    weight = torch.cat([w.reshape(c, W) for w, c in zip(weights, sizes)])  # [C, W]
    bias = torch.cat(list(biases)) if biases is not None else None  # [C]
    tail = torch.cat([t.contiguous() for t in tails], dim=-1) if tails is not None and W > 1 else None
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    xv, pos, silu = _rows_view(x), c(positions), activation == "silu"
    out = JointConvFn.apply(xv, tail, weight, bias, pos, silu, bool(one_pass_backward), sizes, bool(grad_in_base))
    ys, new_tail = list(out[:-1]), out[-1]
    if W > 1:
        new_tails = list(new_tail.split(list(sizes), dim=-1))
    else:
        new_tails = [new_tail.new_empty(B, 0, cs) for cs in sizes]
    if recompute_outputs:
        for i, y in enumerate(ys):
            if y.requires_grad:
                args = (_rows_view(xv[..., offs[i]:offs[i] + sizes[i]]), c(tails[i]) if tails is not None else None,
                        weight[offs[i]:offs[i] + sizes[i]], c(biases[i]) if biases is not None else None, pos, silu,
                        bool(one_pass_backward))
                y._conv_source = _ConvSource(args, y)
    return ys, new_tails


class _ConvSource:
    """What recomputes a conv output bitwise: the call's arguments (the conv's backward keeps them anyway) and the
    versions of every tensor among them and of the output, so that an in-place change since makes it invalid.

    Holders: each `conv_source` call (a Function's forward keeping the source instead of the output) holds it once,
    and its backward either recomputes (`conv_recompute`) or lets go (`conv_release`) once. While holders remain,
    the output recomputed for one is kept for the next, so an output two backwards read is recomputed by one conv
    launch, not two: q and k in the gated DeltaNet layer, read by the memory op's backward (to recompute q̂, k̂) and
    then by the prologue's (its L2 norm's gradient) — 24 of the preset's 72 conv launches a step (r4s12 call 2).
    The last holder takes the kept tensor and drops it; a holder that never comes back leaves it kept until the
    graph, which owns the source, is freed."""

    __slots__ = ("args", "versions", "holders", "kept")

    def __init__(self, args: tuple, y: Tensor):
        self.args = args
        self.versions = self._versions(y)
        self.holders = 0
        self.kept = None  # (the recomputed output, its version when kept)

    def _versions(self, y: Tensor) -> tuple:
        return tuple(t._version for t in self.args if isinstance(t, Tensor)) + (y._version,)

    def valid(self, y: Tensor) -> bool:
        return self._versions(y) == self.versions

    def recompute(self) -> Tensor:
        with torch.no_grad():
            return ShortConvFn.apply(*self.args)[0]

    def take(self) -> Tensor:
        """The output again for one holder: the kept one when another holder recomputed it (and nothing wrote
        to it since), else recomputed — and kept while other holders remain."""
        self.holders -= 1
        kept, self.kept = self.kept, None
        y = kept[0] if kept is not None and kept[0]._version == kept[1] else self.recompute()
        if self.holders > 0:
            self.kept = (y, y._version)
        return y

    def release(self) -> None:
        self.holders -= 1
        if self.holders <= 0:
            self.kept = None


def conv_source(t: Tensor | None):
    """(source, size, stride, offset) when t is, unmodified, a `short_conv` output or a view of one — what
    `conv_recompute` makes t again from — else None. A source returned is held: the caller's backward must
    `conv_recompute` or `conv_release` it once (`_ConvSource`)."""
    if not isinstance(t, Tensor):
        return None
    base = t if t._base is None else t._base
    src = getattr(base, "_conv_source", None)
    if src is None or not src.valid(base):
        return None
    src.holders += 1
    return src, tuple(t.size()), tuple(t.stride()), t.storage_offset()


def conv_recompute(source) -> Tensor:
    """t again, bitwise, from `conv_source(t)`: the conv's forward kernel on the same inputs, viewed as t was (one
    launch for all the holders of one output: `_ConvSource.take`)."""
    src, size, stride, offset = source
    return src.take().as_strided(size, stride, offset)


def conv_release(source) -> None:
    """A holder of `conv_source(t)` that will not recompute t lets go of it (no-op for None)."""
    if source is not None:
        source[0].release()
