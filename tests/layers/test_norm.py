"""Norms and RoPE: the formulas, the gated norm's two orders, RoPE's relative-position property."""

import pytest
import torch

from fastweights.layers import GatedRMSNorm, RMSNorm, apply_rope, l2norm
from tests.tolerances import ROPE_RELATIVE_F64


def test_l2norm_and_rmsnorm():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert torch.allclose(l2norm(x), x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt())
    n = RMSNorm(8, eps=1e-5).double()
    n.weight.data = torch.randn(8, dtype=torch.float64)
    assert torch.allclose(n(x), x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * n.weight)


def test_gated_rmsnorm_orders_and_groups():
    o, z = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64)
    rms = lambda t: t / (t.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    a = GatedRMSNorm(4, activation="swish").double()
    ref = rms(o.view(2, 3, 3, 4)).view(2, 3, 12) * torch.nn.functional.silu(z)
    assert torch.allclose(a(o, z), ref)
    b = GatedRMSNorm(12, activation="sigmoid", norm_before_gate=False).double()
    assert torch.allclose(b(o, z), rms(o * torch.sigmoid(z)))
    assert torch.allclose(a(o), rms(o.view(2, 3, 3, 4)).view(2, 3, 12))


def test_rope_depends_on_relative_position_only():
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    s = [(apply_rope(q, p + 5) * apply_rope(k, p)).sum().item() for p in (0, 3, 40)]
    assert max(s) - min(s) < ROPE_RELATIVE_F64
    assert torch.allclose(apply_rope(q, 0), q)
    assert torch.allclose(apply_rope(q, 7, period=4), apply_rope(q, 3))
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)  # norms are kept
    assert torch.allclose(apply_rope(x, 11).norm(dim=-1), x.norm(dim=-1))


def test_norm_flags_are_bools():
    with pytest.raises(TypeError, match="^affine must be a bool"):
        RMSNorm(8, affine="no")
    with pytest.raises(TypeError, match="^norm_before_gate must be a bool"):
        GatedRMSNorm(8, norm_before_gate="False")
