"""Mesa's chunk form: exact solve equals `recurrent`; CG converges to it and reports the residual."""

import pytest
import torch

import fastweights as fw
from fastweights.chunkwise.mesa import mesa_chunk
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import CHUNK_F64, MESA_BF16, MESA_CG_F64, MESA_CG_RESIDUAL


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 17, 100])
def test_exact_chunk_equals_recurrent(T, chunk_size):
    inputs, state = make_case("mesanet", T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, "mesanet", inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, "mesanet", inputs, state, chunk_size=chunk_size, mesa_solve="exact")
    assert (o1 - o2).abs().max().item() < CHUNK_F64
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() < CHUNK_F64


def test_cg_converges_to_the_exact_solve():
    inputs, state = make_case("mesanet", T=50, K=6)
    o1, _ = fw.recurrent("mesanet", initial_state=state, **inputs)
    o2, _ = fw.chunk("mesanet", initial_state=state, chunk_size=16, **inputs)  # 30 CG steps ≥ K
    assert (o1 - o2).abs().max().item() < MESA_CG_F64


def test_cg_residual_is_reported_and_falls_with_steps():
    B, T, H, K = 1, 40, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, generator=gen) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    z = dict(H0=torch.zeros(B, H, K, K, dtype=torch.float64), G0=torch.zeros(B, H, K, K, dtype=torch.float64))
    args = dict(scale=1.0, g=None, beta=torch.ones(B, T, H, dtype=torch.float64),
                lamb=torch.full((H, K), 0.25, dtype=torch.float64), **z)
    res = [mesa_chunk(q, k, v, cg_steps=n, **args)[3].item() for n in (1, 4, 16)]
    assert res[0] > res[1] > res[2]
    assert res[2] < MESA_CG_RESIDUAL


def test_bf16_inputs_stay_finite_and_close():
    inputs, state = make_case("mesanet", T=64, with_state=False, dtype=torch.float32)
    o32, _ = fw.chunk("mesanet", **inputs)
    low = {k: (v.bfloat16() if k in ("q", "k", "v") else v) for k, v in inputs.items()}
    o16, _ = fw.chunk("mesanet", **low)
    assert o16.dtype == torch.bfloat16 and torch.isfinite(o16).all()
    assert (o16.float() - o32).abs().max() < MESA_BF16 * (1 + o32.abs().max())
