"""Products with degree-2 polynomial features that never write the features to memory (OmegaNet's
`chunkwise.omega`; issue 36). A first piece, not routed: nothing here ran on a GPU.

φ(x) for the polynomial / Taylor maps of degree ≤ 2 (`features.apply_feature_map`) is, feature by feature,
φ_f(x) = w_f · x̃[a_f] · x̃[b_f] with x̃ = [1, x] [K + 1]: the constant (a = b = 0, w = 1), the linear terms (a = 0,
b = i + 1, w = 1) and the upper triangle's monomials (a = r + 1, b = c + 1, w = √2 off the diagonal, 1 on it, times
1/√2 for Taylor) — `feature_table`. A program builds each [BN, BF] tile of φ in registers from two gathered loads of
x̃'s rows (cached: K + 1 floats a row) and feeds it to tl.dot:

    feature_mm(x, w)    φ(x) @ w      x [M, n, K], w [M, K', V] -> [M, n, V]      grid (M, n / BN, V / BV)
    feature_tmm(x, r)   φ(x)ᵀ @ r     x [M, n, K], r [M, n, V] -> [M, K', V]      grid (M, K' / BF, V / BV)
    feature_vjp_kernel(x, g)   ∂(Σ g·φ(x))/∂x   x [M, n, K], g [M, n, K'] -> [M, n, K]   grid (M, n / BN)

(the last reads g once — per row the symmetric S[a, b] = w g_(min, max) (2w on the diagonal) gathered a row a at a
time, g_x[a] = Σ_b S[a, b] x_b, plus the linear block — where `features.feature_vjp` writes a zero-filled [K, K] per
row, scatters into it and reads it twice)

— the forward's products of `omega._Segment` (the start reads and errors, the end state) and the backward's state
gradients, without the [M, n, K'] tiles the torch form writes and reads (about six passes of them a feature map).
fp32 operands, tl.dot at `precision` ("ieee": fp32 FMAs, as torch's fp32 bmm without TF32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ....recipe import FeatureMap
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)

Tensor = torch.Tensor

__all__ = ["feature_table", "feature_mm", "feature_tmm", "feature_vjp_kernel"]


def feature_table(fm: FeatureMap, K: int, device=None) -> tuple[Tensor, Tensor, Tensor]:
    """(a, b, w) [K'] each with φ_f(x) = w_f x̃[a_f] x̃[b_f], x̃ = [1, x], for the polynomial and Taylor maps of
    degree 1 or 2 (homogeneous or not), in `features.apply_feature_map`'s order."""
    if fm.kind not in ("polynomial", "taylor") or fm.degree > 2:
        raise ValueError(f"feature_table takes polynomial / Taylor maps of degree ≤ 2, got {fm}")
    a, b, w = [], [], []
    if not fm.homogeneous or fm.degree == 0:
        a.append(0), b.append(0), w.append(1.0)
    if not fm.homogeneous or fm.degree == 1:
        a += [0] * K
        b += list(range(1, K + 1))
        w += [1.0] * K
    if fm.degree == 2:
        scale = 1.0 if fm.kind == "polynomial" else 1.0 / math.sqrt(2.0)
        rows, cols = torch.triu_indices(K, K)
        a += (rows + 1).tolist()
        b += (cols + 1).tolist()
        w += [scale * (1.0 if r == c else math.sqrt(2.0)) for r, c in zip(rows.tolist(), cols.tolist())]
    return (torch.tensor(a, dtype=torch.int32, device=device), torch.tensor(b, dtype=torch.int32, device=device),
            torch.tensor(w, dtype=torch.float32, device=device))


def _ones_first(x: Tensor) -> Tensor:
    """x̃ = [1, x] [M, n, K + 1], fp32 contiguous."""
    x = x.float()
    return torch.cat([torch.ones_like(x[..., :1]), x], dim=-1).contiguous()


@triton.jit
def _phi_tile(xt, row0, n, K1, fa, fb, fw, f0, KP, BN: tl.constexpr, BF: tl.constexpr):
    """The [BN, BF] tile of φ at rows row0 … and features f0 … of one batch entry (zeros outside)."""
    rows = row0 + tl.arange(0, BN)
    f = f0 + tl.arange(0, BF)
    fm = f < KP
    ia = tl.load(fa + f, mask=fm, other=0)
    ib = tl.load(fb + f, mask=fm, other=0)
    wf = tl.load(fw + f, mask=fm, other=0.0)
    m = (rows[:, None] < n) & fm[None, :]
    xa = tl.load(xt + rows[:, None] * K1 + ia[None, :], mask=m, other=0.0)
    xb = tl.load(xt + rows[:, None] * K1 + ib[None, :], mask=m, other=0.0)
    return xa * xb * wf[None, :]


@triton.jit
def _mm_kernel(xt, w, out, fa, fb, fw, n, K1, KP, V, BN: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
               PRECISION: tl.constexpr):
    b, pn, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    xt += b * n * K1
    w += b * KP * V
    out += b * n * V
    v = pv * BV + tl.arange(0, BV)
    acc = tl.zeros((BN, BV), dtype=tl.float32)
    for f0 in range(0, KP, BF):
        phi = _phi_tile(xt, pn * BN, n, K1, fa, fb, fw, f0, KP, BN, BF)
        f = f0 + tl.arange(0, BF)
        wt = tl.load(w + f[:, None] * V + v[None, :], mask=(f[:, None] < KP) & (v[None, :] < V), other=0.0)
        acc += tl.dot(phi, wt, input_precision=PRECISION)
    rows = pn * BN + tl.arange(0, BN)
    tl.store(out + rows[:, None] * V + v[None, :], acc, mask=(rows[:, None] < n) & (v[None, :] < V))


@triton.jit
def _tmm_kernel(xt, r, out, fa, fb, fw, n, K1, KP, V, BN: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
                PRECISION: tl.constexpr):
    b, pf, pv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    xt += b * n * K1
    r += b * n * V
    out += b * KP * V
    v = pv * BV + tl.arange(0, BV)
    acc = tl.zeros((BF, BV), dtype=tl.float32)
    for n0 in range(0, n, BN):
        phi = _phi_tile(xt, n0, n, K1, fa, fb, fw, pf * BF, KP, BN, BF)
        rows = n0 + tl.arange(0, BN)
        rt = tl.load(r + rows[:, None] * V + v[None, :], mask=(rows[:, None] < n) & (v[None, :] < V), other=0.0)
        acc += tl.dot(tl.trans(phi), rt, input_precision=PRECISION)
    f = pf * BF + tl.arange(0, BF)
    tl.store(out + f[:, None] * V + v[None, :], acc, mask=(f[:, None] < KP) & (v[None, :] < V))


def _blocks(n: int, V: int) -> tuple[int, int, int]:
    BN = max(16, min(64, triton.next_power_of_2(n)))
    BV = max(16, min(64, triton.next_power_of_2(V)))
    return BN, 32, BV


def feature_mm(fm: FeatureMap, x: Tensor, w: Tensor, precision: str = "ieee") -> Tensor:
    """φ(x) @ w without φ in memory: x [M, n, K], w [M, K', V] -> [M, n, V] (fp32)."""
    M, n, K = x.shape
    KP, V = w.shape[-2:]
    fa, fb, fw = feature_table(fm, K, x.device)
    if fa.numel() != KP:
        raise ValueError(f"w has {KP} feature rows, φ of K = {K} has {fa.numel()}")
    xt, w = _ones_first(x), w.float().contiguous()
    out = torch.empty(M, n, V, dtype=torch.float32, device=x.device)
    BN, BF, BV = _blocks(n, V)
    _mm_kernel[(M, triton.cdiv(n, BN), triton.cdiv(V, BV))](xt, w, out, fa, fb, fw, n, K + 1, KP, V, BN=BN, BF=BF,
                                                            BV=BV, PRECISION=precision)
    return out


def feature_tmm(fm: FeatureMap, x: Tensor, r: Tensor, precision: str = "ieee") -> Tensor:
    """φ(x)ᵀ @ r without φ in memory: x [M, n, K], r [M, n, V] -> [M, K', V] (fp32)."""
    M, n, K = x.shape
    V = r.shape[-1]
    fa, fb, fw = feature_table(fm, K, x.device)
    KP = fa.numel()
    xt, r = _ones_first(x), r.float().contiguous()
    out = torch.empty(M, KP, V, dtype=torch.float32, device=x.device)
    BN, BF, BV = _blocks(n, V)
    _tmm_kernel[(M, triton.cdiv(KP, BF), triton.cdiv(V, BV))](xt, r, out, fa, fb, fw, n, K + 1, KP, V, BN=BN, BF=BF,
                                                             BV=BV, PRECISION=precision)
    return out


def _vjp_table(fm: FeatureMap, K: int, device=None) -> tuple[Tensor, Tensor, int]:
    """(idx [K, K] int32: the feature index of x_min(a,b) x_max(a,b); sw [K, K]: its weight, doubled on the diagonal;
    the linear block's first column or −1) for a degree-2 map; degree 1: idx unused (zeros), sw zeros."""
    lin = -1 if fm.homogeneous and fm.degree == 2 else (0 if fm.homogeneous else 1)
    idx = torch.zeros(K, K, dtype=torch.int32)
    sw = torch.zeros(K, K, dtype=torch.float32)
    if fm.degree == 2:
        start = 0 if fm.homogeneous else 1 + K
        scale = 1.0 if fm.kind == "polynomial" else 1.0 / math.sqrt(2.0)
        rows, cols = torch.triu_indices(K, K)
        f = start + torch.arange(rows.numel(), dtype=torch.int32)
        idx[rows, cols] = f
        idx[cols, rows] = f
        sw[rows, cols] = scale * math.sqrt(2.0)
        sw[cols, rows] = scale * math.sqrt(2.0)
        d = torch.arange(K)
        sw[d, d] = 2.0 * scale
    return idx.to(device), sw.to(device), lin


@triton.jit
def _vjp_kernel(x, g, out, idx, sw, n, K, KP, LIN, BN: tl.constexpr, BK: tl.constexpr, QUAD: tl.constexpr):
    b, pn = tl.program_id(0), tl.program_id(1)
    x += b * n * K
    g += b * n * KP
    out += b * n * K
    rows = pn * BN + tl.arange(0, BN)
    j = tl.arange(0, BK)
    m = (rows[:, None] < n) & (j[None, :] < K)
    xt = tl.load(x + rows[:, None] * K + j[None, :], mask=m, other=0.0)  # [BN, BK]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if LIN >= 0:
        acc += tl.load(g + rows[:, None] * KP + LIN + j[None, :], mask=m, other=0.0)
    if QUAD:
        for a in range(0, K):
            ia = tl.load(idx + a * K + j, mask=j < K, other=0)
            wa = tl.load(sw + a * K + j, mask=j < K, other=0.0)
            s = tl.load(g + rows[:, None] * KP + ia[None, :], mask=m, other=0.0) * wa[None, :]  # S[:, a, :]
            ga = tl.sum(s * xt, axis=1)  # [BN]
            acc += tl.where(j[None, :] == a, ga[:, None], 0.0)
    tl.store(out + rows[:, None] * K + j[None, :], acc, mask=m)


def feature_vjp_kernel(fm: FeatureMap, x: Tensor, g: Tensor) -> Tensor:
    """∂(Σ g·φ(x))/∂x without a [K, K] a row in memory: x [M, n, K], g [M, n, K'] -> [M, n, K] (fp32; degree ≤ 2)."""
    if fm.kind not in ("polynomial", "taylor") or fm.degree > 2:
        raise ValueError(f"feature_vjp_kernel takes polynomial / Taylor maps of degree ≤ 2, got {fm}")
    M, n, K = x.shape
    KP = g.shape[-1]
    idx, sw, lin = _vjp_table(fm, K, x.device)
    x, g = x.float().contiguous(), g.float().contiguous()
    out = torch.empty(M, n, K, dtype=torch.float32, device=x.device)
    BN, BK = max(16, min(32, triton.next_power_of_2(n))), max(16, triton.next_power_of_2(K))
    _vjp_kernel[(M, triton.cdiv(n, BN))](x, g, out, idx, sw, n, K, KP, lin, BN=BN, BK=BK, QUAD=fm.degree == 2)
    return out
