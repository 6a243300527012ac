"""fastweights.kernels.triton.memories.omega_features (φ(x) @ W and φ(x)ᵀ @ R with OmegaNet's degree-2 features
built in registers) against torch's products on formed features, and OmegaNet's kernel-trick form
(`chunkwise.omega`) with those kernels for its K'-wide products against the same form on torch (fp32: outputs,
final state, every gradient; a chained call whose first segment's window reaches the carried pairs, which run on
torch).

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA (the kernels on the GPU: `pytest -m triton`
there). Fresh random inputs every run."""

from __future__ import annotations

import pytest
import torch

import fastweights as fw
from fastweights import FeatureMap, Memory, Objective, Optimizer, Recipe, Retention
from fastweights.chunkwise import omega
from fastweights.features import apply_feature_map, feature_vjp
from fastweights.kernels.triton.memories.omega_features import (
    feature_mm,
    feature_table,
    feature_tmm,
    feature_vjp_kernel,
)
from fastweights.state import state_tensors
from tests.kernels.helpers import DEV, rel
from tests.tolerances import CHUNK_F32_REL, F32

pytestmark = pytest.mark.triton

MAPS = [FeatureMap(kind=k, degree=p, homogeneous=h) for k in ("polynomial", "taylor") for p in (1, 2)
        for h in (False, True)]


@pytest.mark.parametrize("fm", MAPS, ids=str)
def test_feature_table_is_the_feature_map(fm):
    K = 7
    x = torch.randn(2, 5, K, dtype=torch.float64)
    a, b, w = feature_table(fm, K)
    xt = torch.cat([torch.ones_like(x[..., :1]), x], dim=-1)
    got = xt[..., a.long()] * xt[..., b.long()] * w.double()
    assert rel(got, apply_feature_map(fm, x)) < F32


@pytest.mark.parametrize("n, K, V", [(19, 8, 5), (35, 16, 16), (70, 6, 33)])
@pytest.mark.parametrize("fm", MAPS[:3], ids=str)
def test_products_equal_torch_on_formed_features(fm, n, K, V):
    M = 3
    x = torch.randn(M, n, K, device=DEV)
    phi = apply_feature_map(fm, x)
    w, r = torch.randn(M, phi.shape[-1], V, device=DEV), torch.randn(M, n, V, device=DEV)
    assert rel(feature_mm(fm, x, w), phi @ w) < F32
    assert rel(feature_tmm(fm, x, r), phi.transpose(1, 2) @ r) < F32


@pytest.mark.parametrize("fm", MAPS, ids=str)
def test_vjp_kernel_equals_the_feature_gradient(fm):
    x = torch.randn(3, 35, 9, device=DEV)
    g = torch.randn(3, 35, fm.out_dim(9), device=DEV)
    assert rel(feature_vjp_kernel(fm, x, g), feature_vjp(fm, x, g)) < F32


def _run(inputs, state, cut, model="omeganet"):
    """fw.chunk(model) over [0, cut) then [cut, T) from the first call's state: (o, final state, gradients)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    a = {k: v[:, :cut] for k, v in leaves.items()}
    b = {k: v[:, cut:] for k, v in leaves.items()}
    o1, s1 = fw.chunk(model, initial_state=state, output_final_state=True, check_values=False, **a)
    o2, s2 = fw.chunk(model, initial_state=s1, output_final_state=True, check_values=False, **b)
    o = torch.cat([o1, o2], 1)
    g = torch.Generator().manual_seed(0)
    loss = (o * torch.randn(o.shape, generator=g).to(o.device)).sum()
    for t in state_tensors(s2):
        loss = loss + (t * torch.randn(t.shape, generator=g).to(t.device)).sum()
    return o.detach(), s2, torch.autograd.grad(loss, list(leaves.values()))


L2 = Recipe(name="l2-like", memory=Memory(kind="linear"), feature_map=FeatureMap(kind="polynomial", degree=2),
            objective=Objective(kind="l2"), optimizer=Optimizer(kind="gd", minibatch=4),
            retention=Retention(kind="scalar", decay_first=False))


@pytest.mark.parametrize("model, T, cut", [("omeganet", 37, 15), (L2, 11, 6)], ids=["omeganet", "l2 b4"])
def test_omega_form_with_the_kernels_equals_it_on_torch(model, T, cut):
    """OmegaNet cut at offset 15: the second call's first segments read carried pairs (torch); the l2 recipe (c 1)
    cut at offset 2: the second call's first segment continues a mini-batch from the carried anchor by the kernels."""
    inputs = fw.example_inputs(model, batch_size=2, seq_len=T, num_heads=2, head_dim=8, device=DEV)
    state = inputs.pop("initial_state", None)
    old = omega.kernel_trick(True, min_elements=0)
    try:
        want = _run(inputs, state, cut, model)
        omega.feature_products(feature_mm, feature_tmm, feature_vjp_kernel)
        got = _run(inputs, state, cut, model)
    finally:
        omega.feature_products()
        omega.kernel_trick(**old)
    assert rel(got[0], want[0]) < CHUNK_F32_REL
    for a, b in zip(state_tensors(got[1]), state_tensors(want[1])):
        assert rel(a, b) < CHUNK_F32_REL
    for a, b in zip(got[2], want[2]):
        assert rel(a, b) < CHUNK_F32_REL


def test_feature_products_takes_both_or_neither():
    with pytest.raises(ValueError):
        omega.feature_products(feature_mm)
    with pytest.raises(ValueError):
        feature_table(FeatureMap(kind="polynomial", degree=3), 4)
    with pytest.raises(ValueError):
        feature_vjp_kernel(FeatureMap(kind="polynomial", degree=3), torch.zeros(1, 1, 2), torch.zeros(1, 1, 20))
