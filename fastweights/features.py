"""Feature maps φ applied to queries and keys (axis 'feature map' of a Recipe).

identity, elu1 (elu(x) + 1), relu: elementwise, K → K.
polynomial (degree p ≤ 3): φ(x)·φ(y) = Σ_{i=0..p} (x·y)^i.
taylor     (degree p ≤ 3): φ(x)·φ(y) = Σ_{i=0..p} (x·y)^i / i!  (Taylor expansion of exp(x·y)).
The degree-2 block keeps only the K(K+1)/2 unique monomials x_a x_b (a ≤ b), weighted √2 off
the diagonal, so the feature dimension is C(K + 2, 2) for p = 2 (ATLAS' [x^β]_{|β|≤p}).
homogeneous=True keeps only the degree-p block: φ(x)·φ(y) = (x·y)^p (K(K+1)/2 features for
p = 2), without the constant and lower-order terms that every key shares.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .recipe import FeatureMap

__all__ = ["apply_feature_map", "feature_dot", "feature_kernel", "feature_vjp", "has_feature_kernel"]


def _triangle(K: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, weight) of the K(K+1)/2 monomials x_a x_b, a ≤ b (row-major over the upper triangle), weight √2
    off the diagonal, 1 on it (x's dtype and device)."""
    rows, cols = torch.triu_indices(K, K, device=x.device)
    weight = torch.full(rows.shape, math.sqrt(2.0), dtype=x.dtype, device=x.device)
    weight[rows == cols] = 1.0
    return rows, cols, weight


class _SecondOrder(torch.autograd.Function):
    """φ₂(x) = w ⊙ x[rows] ⊙ x[cols] [..., K(K+1)/2], keeping only x [..., K] for the backward, which reads each
    [.., K, K] once: the gradient g scattered into the upper triangle of G [.., K, K] (indices that never repeat),
    then dx = G x + Gᵀ x (a diagonal monomial x_a² takes 2 g_aa x_a from the two products). The autograd path it
    replaces — the outer product x xᵀ, then the triangle — wrote and read [.., K, K] about four times forward and back
    (≈ 20 of OmegaNet's 59 ms of kernels a step on an H200, r4s13 call 3). Differentiable twice (its backward is torch
    ops); not used under torch.func transforms (the autograd path there, the same values)."""

    @staticmethod
    def forward(ctx, x, rows, cols, weight):
        ctx.save_for_backward(x, rows, cols, weight)
        x2 = x.reshape(-1, x.shape[-1])  # the gathers on a 2-d view: along the last dim of a 3-d tensor the CPU's
        # index_select ran 3–70× slower (0.29–8 ms against 0.1 for [8, 19, 64] -> 2,080, r4s14 helper omega-fast)
        return (x2.index_select(1, rows) * x2.index_select(1, cols) * weight).view(*x.shape[:-1], rows.numel())

    @staticmethod
    def backward(ctx, g):
        x, rows, cols, weight = ctx.saved_tensors
        K = x.shape[-1]
        g2 = g.reshape(-1, g.shape[-1])
        G = g2.new_zeros(g2.shape[0], K * K).index_copy(1, rows * K + cols, g2 * weight).view(-1, K, K)
        xc = x.reshape(-1, K, 1).to(G.dtype)  # [n, K, 1]
        return (G @ xc + G.transpose(-1, -2) @ xc).view(x.shape), None, None, None


def _second_order(x: torch.Tensor) -> torch.Tensor:
    """Unique monomials of degree 2 with φ₂(x)·φ₂(y) = (x·y)²: [..., K] -> [..., K(K+1)/2]."""
    K = x.shape[-1]
    rows, cols, weight = _triangle(K, x)
    if torch._C._functorch.peek_interpreter_stack() is None:  # (chunkwise.common.under_functorch: not here)
        return _SecondOrder.apply(x, rows, cols, weight)
    # under a torch.func transform: the outer product, then its upper triangle (autograd keeps x and the indices,
    # not gathered [..., K(K+1)/2] copies); the triangle by `index_select` on the flattened [..., K·K] product, not
    # by advanced indexing `[..., rows, cols]`, whose backward is an accumulating index_put that CUDA sorts the
    # indices for (64 of OmegaNet's 135 ms a step on an H200, r4s13 call 1)
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2)  # [..., K·K]
    return torch.index_select(outer, -1, rows * K + cols) * weight


def _third_order(x: torch.Tensor) -> torch.Tensor:
    """Full tensor power x⊗x⊗x flattened: [..., K] -> [..., K³], with φ₃(x)·φ₃(y) = (x·y)³."""
    K = x.shape[-1]
    outer = x[..., :, None, None] * x[..., None, :, None] * x[..., None, None, :]
    return outer.reshape(*x.shape[:-1], K ** 3)  # [..., K³]


def apply_feature_map(fm: FeatureMap, x: torch.Tensor) -> torch.Tensor:
    """φ(x) along the last dimension: [..., K] -> [..., fm.out_dim(K)]."""
    kind = fm.kind
    if kind in ("identity", "exp"):
        return x
    if kind == "elu1":
        return F.elu(x) + 1.0
    if kind == "relu":
        return F.relu(x)
    blocks = [torch.ones_like(x[..., :1]), x]
    weights = [1.0, 1.0]
    if fm.degree >= 2:
        blocks.append(_second_order(x))
        weights.append(1.0 if kind == "polynomial" else 1.0 / math.sqrt(2.0))
    if fm.degree >= 3:
        blocks.append(_third_order(x))
        weights.append(1.0 if kind == "polynomial" else 1.0 / math.sqrt(6.0))
    if fm.homogeneous:  # only the top-degree block: φ(x)·φ(y) = (x·y)^p (times 1/p! for taylor)
        blocks, weights = blocks[-1:], weights[-1:]
    return torch.cat([b if w == 1.0 else b * w for b, w in zip(blocks, weights)], dim=-1)  # (× 1: no copy)


def feature_dot(fm: FeatureMap, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """φ(x)·φ(y) along the last dimension without expanding the polynomial features:
    [..., K], [..., K] -> [...]. Polynomial: Σ_{i≤p} (x·y)^i; Taylor: Σ_{i≤p} (x·y)^i / i!
    (homogeneous: the degree-p term only); elementwise maps: the dot product of the mapped rows."""
    if fm.kind not in ("polynomial", "taylor"):
        return (apply_feature_map(fm, x) * apply_feature_map(fm, y)).sum(-1)
    return feature_kernel(fm, (x * y).sum(-1))


def has_feature_kernel(fm: FeatureMap) -> bool:
    """Whether φ(x)·φ(y) is a function of x·y alone (`feature_kernel`): the polynomial and Taylor maps."""
    return fm.kind in ("polynomial", "taylor")


def feature_kernel(fm: FeatureMap, s: torch.Tensor) -> torch.Tensor:
    """φ(x)·φ(y) from s = x·y for the polynomial and Taylor maps (the kernel trick): [...] -> [...],
    Σ_{i≤p} c_i s^i with c_i = 1 (polynomial) or 1/i! (taylor); homogeneous: the degree-p term only."""
    if not has_feature_kernel(fm):
        raise ValueError(f"feature map {fm.kind!r} has no kernel of x·y alone")
    coef = [1.0 if fm.kind == "polynomial" else 1.0 / math.factorial(i) for i in range(fm.degree + 1)]
    if fm.homogeneous:
        return coef[-1] * s ** fm.degree
    return sum(c * s ** i for i, c in enumerate(coef))


def feature_vjp(fm: FeatureMap, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient in x of Σ g·φ(x) without forming φ(x): x [..., K], g [..., K'] -> [..., K]. The polynomial and
    Taylor maps of degree ≤ 2 by their blocks (the linear block's g itself; the degree-2 block's as `_SecondOrder`'s
    backward: g scattered into the upper triangle of a [K, K] per row, then (G + Gᵀ) x); any other map by autograd."""
    K = x.shape[-1]
    if fm.kind not in ("polynomial", "taylor") or fm.degree > 2:
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            return torch.autograd.grad(apply_feature_map(fm, xd), xd, g)[0]
    out = None
    at = 0 if fm.homogeneous and fm.degree > 0 else 1  # the constant's column
    if fm.degree >= 1 and not (fm.homogeneous and fm.degree == 2):
        out = g[..., at:at + K]
        at += K
    if fm.degree == 2:
        rows, cols, weight = _triangle(K, x)
        if fm.kind == "taylor":
            weight = weight / math.sqrt(2.0)
        g2 = g[..., at:].reshape(-1, rows.numel())
        G = g2.new_zeros(g2.shape[0], K * K).index_copy(1, rows * K + cols, g2 * weight).view(-1, K, K)
        xc = x.reshape(-1, K, 1).to(G.dtype)
        quad = (G @ xc + G.transpose(-1, -2) @ xc).view(x.shape)
        out = quad if out is None else out + quad
    return out
