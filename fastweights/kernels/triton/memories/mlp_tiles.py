"""The hidden-tile helpers of TTT-MLP's kernels (`ttt_mlp.py`, `ttt_mlp_sliced.py`): GELU's tanh form and its
derivatives, a hidden tile's offsets and weights, the inner target's errors at the anchor, and one tile of the read's
layer-1 side (the maths: `ttt_mlp`'s module doc). Shapes: BT tokens of a mini-batch, BD the padded head dim D, BF the
hidden tile of the hidden width F."""

from __future__ import annotations

import triton
import triton.language as tl

from .ttt import _ln, _ln_back

_C0 = tl.constexpr(0.7978845608028654)  # sqrt(2 / π) (a constexpr: a jit function reads only those globals)
_A3 = tl.constexpr(0.044715)


@triton.jit
def _gelu(z):
    """(σ(z), σ'(z)) of GELU's tanh form, elementwise (tanh(u) as 1 − 2 / (e^{2u} + 1), u clamped to ±15, where
    tanh is ±1 in fp32 and the exp stays finite)."""
    du = _C0 * (1.0 + 3.0 * _A3 * z * z)
    u = tl.minimum(tl.maximum(_C0 * (z + _A3 * z * z * z), -15.0), 15.0)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du


@triton.jit
def _gelu2(z):
    """σ''(z) of GELU's tanh form: (1 − t²)(u' + z (u'' − 2 t u'²) / 2), u = c (z + a z³), t = tanh(u)."""
    du = _C0 * (1.0 + 3.0 * _A3 * z * z)
    u = tl.minimum(tl.maximum(_C0 * (z + _A3 * z * z * z), -15.0), 15.0)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    return (1.0 - t * t) * (du + 0.5 * z * (6.0 * _A3 * _C0 * z - 2.0 * t * du * du))


@triton.jit
def _hidden(f0, c, cm, D: tl.constexpr, F: tl.constexpr, BF: tl.constexpr):
    """Hidden tile f0's indices fc [BF], mask fm, and within one slot the offsets o1 [BD, BF] of W1's tile (of
    anything shaped [.., D, F]) and o2 [BF, BD] of W2's (of anything [.., F, D]) with their masks m1, m2."""
    fc = f0 + tl.arange(0, BF)
    fm = fc < F
    return fc, fm, c[:, None] * F + fc[None, :], fc[:, None] * D + c[None, :], cm[:, None] & fm[None, :], \
        fm[:, None] & cm[None, :]


@triton.jit
def _tile(W1, b1, W2, sl, fc, o1, o2, m1, m2, fm, D: tl.constexpr, F: tl.constexpr):
    """(W1 [BD, BF], b1 [BF], W2 [BF, BD]) of one hidden tile (`_hidden`) in slot sl; 0 outside the masks."""
    A1 = tl.load(W1 + sl * (D * F) + o1, mask=m1, other=0.0)
    a1 = tl.load(b1 + sl * F + fc, mask=fm, other=0.0)
    A2 = tl.load(W2 + sl * (F * D) + o2, mask=m2, other=0.0)
    return A1, a1, A2


@triton.jit
def _target_errors(f, kk, vv, lnw, lnb, cm, D: tl.constexpr, EPS: tl.constexpr):
    """From f [BT, BD] (the memory's output before its LayerNorm): (n, 1/σ, dy, u, e) as `ttt._errors`."""
    n, inv = _ln(f, cm, D, EPS)
    dy = tl.where(cm[None, :], kk + lnb[None, :] - vv, 0.0) + lnw[None, :] * n
    u = lnw[None, :] * dy
    return n, inv, dy, u, _ln_back(n, inv, u, cm, D)


@triton.jit
def _tile_read(x, kk, e, M1, ipos, A1, a1, A2, P1_0, p1_0, i_bh, first, fc, o1, m1, fm, D: tl.constexpr,
               F: tl.constexpr, PREC: tl.constexpr, HAS_P: tl.constexpr):
    """One hidden tile of the layer-1 side at the anchor: (Z1, H, σ'(Z1), e A2ᵀ, dz1, z1, h, σ'(z1), P1_0 tile,
    p1_0 tile), the [BT, BF] ones and the carried sums ([BD, BF], [BF]; 0 unless HAS_P and the first
    mini-batch)."""
    Z1 = tl.dot(kk, A1, input_precision=PREC) + a1[None, :]
    Hh, dg = _gelu(Z1)
    g1 = tl.dot(e, tl.trans(A2), input_precision=PREC)
    dz1 = g1 * dg
    z1 = tl.dot(x, A1, input_precision=PREC) + a1[None, :] - tl.dot(M1, dz1, input_precision=PREC)
    P1 = tl.zeros_like(A1)
    p1 = tl.zeros_like(a1)
    if HAS_P:  # the carried sums enter the first mini-batch only
        P1 = tl.load(P1_0 + i_bh * (D * F) + o1, mask=m1 & first, other=0.0)
        p1 = tl.load(p1_0 + i_bh * F + fc, mask=fm & first, other=0.0)
        z1 += (tl.dot(x, P1, input_precision=PREC) + p1[None, :]) / ipos[:, None]
    h, dh = _gelu(z1)
    return Z1, Hh, dg, g1, dz1, z1, h, dh, P1, p1
