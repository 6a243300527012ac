"""Feature maps: each kernel identity φ(x)·φ(y) the docs state, and the declared dimensions."""

import math

import pytest
import torch

from fastweights import FeatureMap, RecipeError
from fastweights.features import apply_feature_map, feature_dot, feature_kernel, feature_vjp, has_feature_kernel
from tests.tolerances import FEATURE_KERNEL_F64


@pytest.mark.parametrize("degree", [1, 2, 3])
@pytest.mark.parametrize("kind", ["polynomial", "taylor"])
@pytest.mark.parametrize("homogeneous", [False, True])
def test_kernel_identities_and_dimensions(kind, degree, homogeneous):
    K = 5
    x, y = torch.randn(2, 7, K, dtype=torch.float64)
    fm = FeatureMap(kind=kind, degree=degree, homogeneous=homogeneous)
    fx, fy = apply_feature_map(fm, x), apply_feature_map(fm, y)
    assert fx.shape[-1] == fm.out_dim(K)
    d = (x * y).sum(-1)
    coef = (lambda i: 1.0) if kind == "polynomial" else (lambda i: 1.0 / math.factorial(i))
    powers = [degree] if homogeneous else range(degree + 1)
    expected = sum(coef(i) * d ** i for i in powers)
    assert torch.allclose((fx * fy).sum(-1), expected, rtol=FEATURE_KERNEL_F64, atol=FEATURE_KERNEL_F64)


def test_homogeneous_only_for_polynomial_maps():
    with pytest.raises(RecipeError, match="homogeneous"):
        FeatureMap(kind="elu1", homogeneous=True)
    assert FeatureMap(kind="polynomial", degree=2, homogeneous=True).out_dim(64) == 64 * 65 // 2


@pytest.mark.parametrize("fm", [FeatureMap(kind=k) for k in ("identity", "elu1", "relu")]
                         + [FeatureMap(kind=k, degree=p, homogeneous=h) for k in ("polynomial", "taylor")
                            for p in (1, 2, 3) for h in (False, True)], ids=str)
def test_feature_dot_is_the_dot_of_the_features(fm):
    """feature_dot(fm, x, y) = φ(x)·φ(y) without expanding the features (the step bound reads it)."""
    x, y = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    want = (apply_feature_map(fm, x) * apply_feature_map(fm, y)).sum(-1)
    assert torch.allclose(feature_dot(fm, x, y), want, rtol=FEATURE_KERNEL_F64, atol=FEATURE_KERNEL_F64)


def test_second_order_features_keep_only_their_input_for_the_backward():
    """Degree-2 features (OmegaNet's, ATLAS's) keep x [.., K] and the indices for the backward, not gathered
    [.., K(K+1)/2] copies: what autograd saves is below the features' own bytes; and their gradient is that of the
    monomials x_i x_j (float64)."""
    K = 16
    x = torch.randn(64, K, dtype=torch.float64, requires_grad=True)
    fm = FeatureMap(kind="polynomial", degree=2, homogeneous=True)
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f = apply_feature_map(fm, x)
    assert sum(seen.values()) < f.numel() * f.element_size()
    rows, cols = torch.triu_indices(K, K)
    w = torch.full(rows.shape, math.sqrt(2.0), dtype=torch.float64)
    w[rows == cols] = 1.0
    g = torch.randn_like(f)
    (a,) = torch.autograd.grad(f, x, g)
    (b,) = torch.autograd.grad(x[:, rows] * x[:, cols] * w, x, g)
    assert (a - b).abs().max().item() < FEATURE_KERNEL_F64 * (1 + b.abs().max().item())


def test_second_order_features_take_no_accumulating_scatter_in_the_backward():
    """The degree-2 block is one autograd node (`features._SecondOrder`), no advanced indexing: the latter's backward
    — an accumulating index_put that CUDA sorts the indices for — took 64 of OmegaNet's 135 ms a step on an H200
    (r4s13 call 1). Walks the graph of the polynomial features."""
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    seen, todo = {}, [apply_feature_map(FeatureMap(kind="polynomial", degree=2), x).grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:  # (the node objects kept as keys: an id could be reused)
            seen[fn] = fn.name()
            todo.extend(nxt for nxt, _ in fn.next_functions)
    names = set(seen.values())
    assert "_SecondOrderBackward" in names and "IndexBackward0" not in names, sorted(names)


def test_second_order_backward_twice_and_under_vmap():
    """The degree-2 block's own backward against float64 finite differences, once and twice (gradcheck,
    gradgradcheck); under torch.func.vmap (the lab's stacked runs) the autograd path gives the same features and
    gradients as the Function per sample."""
    from fastweights.features import _second_order

    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_second_order, (x,))
    assert torch.autograd.gradgradcheck(_second_order, (x,))
    g = torch.randn(2, 3, 15, dtype=torch.float64)

    def vjp(xi, gi):
        return torch.func.vjp(_second_order, xi)[1](gi)[0]

    got = torch.func.vmap(vjp)(x.detach(), g)
    want = torch.autograd.grad(_second_order(x), x, g)[0]
    assert torch.equal(torch.func.vmap(_second_order)(x.detach()), _second_order(x).detach())
    assert (got - want).abs().max().item() < FEATURE_KERNEL_F64 * (1 + want.abs().max().item())


def test_feature_kernel_is_the_dot_of_the_features_from_the_dot_products():
    """feature_kernel(fm, x·y) = φ(x)·φ(y) for the kernel maps (a matrix of dot products at once: the kernel trick's
    pair scores, `chunkwise.omega`); the elementwise maps have none."""
    x, y = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    for fm in [FeatureMap(kind=k, degree=p, homogeneous=h) for k in ("polynomial", "taylor") for p in (1, 2, 3)
               for h in (False, True)]:
        assert has_feature_kernel(fm)
        want = apply_feature_map(fm, x) @ apply_feature_map(fm, y).transpose(-1, -2)
        got = feature_kernel(fm, x @ y.transpose(-1, -2))
        assert torch.allclose(got, want, rtol=FEATURE_KERNEL_F64, atol=FEATURE_KERNEL_F64)
    for kind in ("identity", "elu1", "relu"):
        assert not has_feature_kernel(FeatureMap(kind=kind))
        with pytest.raises(ValueError):
            feature_kernel(FeatureMap(kind=kind), x @ y.transpose(-1, -2))


@pytest.mark.parametrize("fm", [FeatureMap(kind=k, degree=p, homogeneous=h) for k in ("polynomial", "taylor")
                                for p in (1, 2, 3) for h in (False, True)] + [FeatureMap(kind="elu1")], ids=str)
def test_feature_vjp_is_the_gradient_of_the_features(fm):
    """feature_vjp(fm, x, g) = ∂(Σ g·φ(x))/∂x without forming φ (degree ≤ 2 by the blocks; else autograd)."""
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    phi = apply_feature_map(fm, x)
    g = torch.randn_like(phi)
    want, = torch.autograd.grad(phi, x, g)
    assert torch.allclose(feature_vjp(fm, x.detach(), g), want, rtol=FEATURE_KERNEL_F64, atol=FEATURE_KERNEL_F64)
