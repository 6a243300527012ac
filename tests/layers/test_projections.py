"""MemoryMixer's projections of x as one matmul (`MemoryMixer._project`): the same layer as separate
Linears — outputs, dx and every parameter gradient (each projection weight's own), in float64 and
under CPU bf16 autocast — with an unchanged state_dict, and under autocast x cast to bf16 and kept for
the backward once instead of once per projection."""

from __future__ import annotations

import pytest
import torch

from fastweights.layers import MemoryMixer
from tests.tolerances import JOINT_PROJ_BF16_REL, JOINT_PROJ_F64_REL

MODELS = ["gated_deltanet", "kda", "deltaproduct", "mamba2", "comba", "deltanet", "gla", "titans"]


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _run(layer, x, joint: bool, autocast: bool):
    """(y, dx, {parameter: grad}) with the joint matmul (joint) or the separate Linears."""
    keep = layer.joint_projections
    if not joint:
        layer.joint_projections = ()  # `_project` then calls q/k/v_proj and the gates and g_proj their own Linears
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, _ = layer(x)
        g = torch.Generator().manual_seed(3)
        (y.float() * torch.randn(y.shape, generator=g)).sum().backward()
    finally:
        layer.joint_projections = keep
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype,autocast,tol", [(torch.float64, False, JOINT_PROJ_F64_REL),
                                                (torch.float32, True, JOINT_PROJ_BF16_REL)])
def test_joint_projection_equals_separate(name, dtype, autocast, tol):
    layer = MemoryMixer(48, name, 2, head_dim=16).to(dtype)
    assert {key for key, _ in layer.joint_projections} >= {"q", "k", "v"}
    keys = set(layer.state_dict())
    assert all(f"{path}.weight" in keys for _, path in layer.joint_projections)  # the separate parameters, as before
    x = torch.randn(2, 9, 48, dtype=dtype)
    y1, dx1, g1 = _run(layer, x, True, autocast)
    y2, dx2, g2 = _run(layer, x, False, autocast)
    assert rel(y1, y2) < tol
    assert rel(dx1, dx2) < tol
    assert set(g1) == set(g2) == {n for n, _ in layer.named_parameters()}
    for n in g2:
        assert rel(g1[n], g2[n]) < tol, n


def test_softmax_side_keeps_separate_projections():
    assert MemoryMixer(48, "softmax_attention", 2, head_dim=16).joint_projections == ()


@pytest.mark.parametrize("joint", [True, False])
def test_x_cast_and_kept_once_under_autocast(joint):
    """Gated DeltaNet reads x with six projections (q, k, v, a, b, gate): one bf16 copy of x kept."""
    layer = MemoryMixer(48, "gated_deltanet", 2, head_dim=16)
    x = torch.randn(2, 9, 48, requires_grad=True) * 1.0  # not a leaf, as in an LM (autocast caches a leaf's casts)
    kept = {}

    def pack(t):
        if t.shape[-1] == x.shape[-1] and t.numel() == x.numel() and t.dtype == torch.bfloat16:  # x, maybe 2-D
            kept[t.untyped_storage().data_ptr()] = t
        return t

    keep = layer.joint_projections
    if not joint:
        layer.joint_projections = ()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    finally:
        layer.joint_projections = keep
    assert len(kept) == (1 if joint else 6)


@pytest.mark.parametrize("name,heads", [("gated_deltanet", 6), ("gated_deltanet", 3), ("kda", 5), ("deltaproduct", 3)])
def test_joint_output_rows_are_16_byte_aligned(name, heads):
    """The joint matmul's output row stride is a multiple of 8 elements (ΣN_i padded with zero rows of the weight):
    an unaligned stride (the gpu-125m preset's ΣN = 4620) sent cuBLAS to kernels 10–30× slower on an H100/H200.
    The views keep their widths, and the padding adds no parameter."""
    layer = MemoryMixer(48, name, heads, head_dim=16)
    sizes = {key: layer.get_submodule(path).out_features for key, path in layer.joint_projections}
    assert sum(sizes.values()) % 8 != 0 or heads == 3  # the shapes above include unaligned sums
    n_params = sum(p.numel() for p in layer.parameters())
    out = layer._project(torch.randn(2, 5, 48))
    for key, y in out.items():
        assert y.shape == (2, 5, sizes[key])
        assert y.stride(1) % 8 == 0, (key, y.stride())
    assert sum(p.numel() for p in layer.parameters()) == n_params
