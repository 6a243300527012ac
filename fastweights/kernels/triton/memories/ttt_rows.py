"""The mini-batch rows every TTT kernel reads (`ttt.py`'s, `ttt_linear_sliced.py`'s, TTT-MLP's): one mini-batch's
key-side token rows, with the queries, and where a sequence's rows and anchor slots lie. Its own module so that the
sliced kernels (imported by `ttt.py`'s glue) take them without importing `ttt.py` back.

Shapes: k, q [B, T, H_q, D], v [B, T, H, D], beta [B, T, H]; tiles [BT, BD] (BT the mini-batch b, BD D's power of
two)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list[str] = []


@triton.jit
def _tokens(k, v, beta, bos, i_h, s, T, off, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BT: tl.constexpr):
    """Mini-batch s's key-side rows of the sequence at row bos of T tokens (position r of the mini-batch is its token
    s·b + r − off): k, v [BT, BD] (fp32, 0 outside the sequence), η [BT] (0 outside), the token rows' offsets, their
    validity, the [BT, BD] mask and the q/k element offsets."""
    r = tl.arange(0, BT)
    c = tl.arange(0, BD)
    cm = c < D
    t = s * BT + r - off
    valid = (t >= 0) & (t < T)
    row = bos + tl.where(valid, t, 0)
    i_hq = i_h // (H // HQ)
    m = valid[:, None] & cm[None, :]
    qk_off = (row[:, None] * HQ + i_hq) * D + c[None, :]
    hv_off = (row[:, None] * H + i_h) * D + c[None, :]
    kk = tl.load(k + qk_off, mask=m, other=0.0).to(tl.float32)
    vv = tl.load(v + hv_off, mask=m, other=0.0).to(tl.float32)
    eta = tl.load(beta + row * H + i_h, mask=valid, other=0.0).to(tl.float32)
    return kk, vv, eta, row, valid, m, qk_off


@triton.jit
def _rows(q, k, v, beta, bos, i_h, s, T, off, scale, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
          BD: tl.constexpr, BT: tl.constexpr):
    """Mini-batch s's rows (`_tokens`) with the queries: x = scale·q, k, v [BT, BD] (fp32, 0 outside the sequence),
    η [BT] (0 outside), the token rows' offsets and validity."""
    kk, vv, eta, row, valid, m, qk_off = _tokens(k, v, beta, bos, i_h, s, T, off, H, HQ, D, BD, BT)
    x = tl.load(q + qk_off, mask=m, other=0.0).to(tl.float32) * scale
    return x, kk, vv, eta, row, valid, m


@triton.jit
def _sequence(i_b, T, off, NS, cu, slots, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first row, tokens, mini-batches, first anchor slot) of sequence (batch row) i_b."""
    if IS_VARLEN:
        bos = tl.load(cu + i_b).to(tl.int64)
        n = (tl.load(cu + i_b + 1).to(tl.int64) - bos).to(tl.int32)
        ns = (off + n + BT - 1) // BT
        slot0 = tl.load(slots + i_b).to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        n = T
        ns = NS
        slot0 = i_b.to(tl.int64) * NS
    return bos, n, ns, slot0
