"""fastweights.chunkwise.delta_bwd (the delta rule's chunk backward in closed form: the torch twin of the fused
Triton backward) against autograd through the torch chunk form `chunk_delta`, float64: every gradient (q, k,
v, g, β, the initial state) for no and a scalar decay, odd lengths, chunk sizes 16 and 64, varlen with an empty
and a length-1 sequence. Inputs are fresh random each run; the seed is printed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights.chunkwise import chunk_delta
from fastweights.chunkwise import common as twin
from fastweights.chunkwise.delta import block_unit_lower_inverse, delta_decays, delta_transitions, wy_representation
from fastweights.chunkwise.delta_bwd import delta_chunk_grads, delta_states_bwd
from fastweights.chunkwise.varlen import make_layout
from tests.tolerances import CHUNK_F64


@pytest.fixture
def gen():
    seed = torch.seed() % 2**62
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _inputs(gate, gen, *, T, N=1, H=2, K=8, V=5):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(1 if N > 1 else 2, T, H, K), "v": None, "beta": None}
    B = x["q"].shape[0]
    x["k"] = F.normalize(rnd(B, T, H, K), dim=-1)
    x["v"] = rnd(B, T, H, V)
    x["beta"] = 1.5 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    x["S0"] = 0.3 * rnd(N if N > 1 else B, H, K, V)
    if gate == "scalar":
        x["g"] = 2.0 * F.logsigmoid(rnd(B, T, H) + 1.0)
    return x


def _autograd(x, dO, dST, C, cu, scale):
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = chunk_delta(leaves["q"], leaves["k"], leaves["v"], beta=leaves["beta"], g=leaves.get("g"), scale=scale,
                       initial_state=leaves["S0"], output_final_state=True, chunk_size=C, cu_seqlens=cu)
    loss = (o * dO).sum() + (S * dST).sum()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _closed_form(x, dO, dST, C, cu, scale):
    """The forward twins for T, the entering states and U; then the two backward twins."""
    lay = make_layout(x["q"].shape[0], x["q"].shape[1], C, cu)
    qc, kc, vc, bc = (lay.to_chunks(x[key]) for key in ("q", "k", "v", "beta"))
    kind = "scalar" if "g" in x else "none"
    G = twin.chunk_cumsum(lay.to_chunks(x["g"])) if "g" in x else None
    q_dec, r_dec, k_dec, a = delta_decays(qc * scale, kc, kc, G, G, kind)
    Tinv = block_unit_lower_inverse(twin.decayed_scores(kc, kc, G, G, strict=True) * bc[..., None])
    U1, W = wy_representation(Tinv, vc, r_dec, bc)
    entering, _ = twin.pass_states(lay, x["S0"], *delta_transitions(a, k_dec, W, U1))
    U = U1 - W @ entering
    doc = lay.to_chunks(dO)
    dh, dS0, Y, dv, dbv = delta_states_bwd(lay, qc, kc, vc, bc, G, Tinv, doc, dST, scale)
    dq, dk, dbeta, dg = delta_chunk_grads(qc, kc, bc, G, entering, dh, U, Y, doc, dbv, scale)
    out = {"q": dq, "k": dk, "v": dv, "beta": dbeta, "g": dg}
    out = {key: lay.from_chunks(val) for key, val in out.items() if val is not None}
    out["S0"] = dS0
    return out


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("T", [1, 17, 100])
@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_closed_form_equals_autograd(gate, T, C, gen):
    x = _inputs(gate, gen, T=T)
    dO = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dST = torch.randn(x["S0"].shape, generator=gen, dtype=torch.float64)
    want = _autograd(x, dO, dST, C, None, 0.4)
    got = _closed_form(x, dO, dST, C, None, 0.4)
    assert set(got) == set(want)
    for key in want:
        assert (got[key] - want[key]).abs().max() < CHUNK_F64 * (1 + want[key].abs().max()), key


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_closed_form_varlen(gate, gen):
    """Packed sequences with an empty and a length-1 one, chunk 16: each restarts from its own state."""
    lengths = [7, 0, 40, 1, 18]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(gate, gen, T=sum(lengths), N=len(lengths))
    dO = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dST = torch.randn(x["S0"].shape, generator=gen, dtype=torch.float64)
    want = _autograd(x, dO, dST, 16, cu, 0.3)
    got = _closed_form(x, dO, dST, 16, cu, 0.3)
    for key in want:
        assert (got[key] - want[key]).abs().max() < CHUNK_F64 * (1 + want[key].abs().max()), key
    assert torch.equal(got["S0"][1], dST[1])  # the empty sequence passes its state's gradient through
