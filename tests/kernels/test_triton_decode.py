"""fastweights.kernels.triton.decode.fused_recurrent_step against fastweights.recurrent: T = 1 and
a short T, gated-linear and delta classes (decay first and after), no/scalar/diagonal decay,
grouped heads, an fp32 and a bf16 state pool addressed by state_indices with −1 padding rows.
Marked `triton` (interpreter on CPU tensors without CUDA; NaN-poisoned outputs)."""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.kernels.triton.decode import fused_recurrent_step
from tests.tolerances import CHUNK_F32_REL, CHUNK_LOW_REL

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen():
    seed = secrets.randbits(62)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _recipe(cls: str, gate: str, decay_first: bool) -> Recipe:
    obj = Objective(kind="dot" if cls == "gated" else "l2")
    return Recipe(name=f"{cls}_{gate}", memory=Memory(kind="linear"), objective=obj, optimizer=Optimizer(kind="gd"),
                  retention=Retention(kind=gate, decay_first=decay_first))


def _rel(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().cpu().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("gate", ["none", "scalar", "diagonal"])
@pytest.mark.parametrize("cls,decay_first", [("gated", True), ("delta", True), ("delta", False)])
def test_step_matches_recurrence(cls, decay_first, gate, T, gen):
    B, H, Hq, K, V, slots = 3, 2, 1, 12, 10, 5
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(B, T, Hq, K), F.normalize(rnd(B, T, Hq, K), dim=-1), rnd(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen)
    g = None if gate == "none" else F.logsigmoid(rnd(*((B, T, H) if gate == "scalar" else (B, T, H, K))) + 1.0)
    pool = 0.3 * rnd(slots, H, K, V)
    idx = torch.tensor([3, -1, 0])
    live = idx >= 0
    recipe = _recipe(cls, gate, decay_first)
    extra = {"g": g[live].double()} if g is not None else {}
    o_want, S_want = fw.recurrent(recipe, q[live].double(), k[live].double(), v[live].double(), scale=0.4,
                                  beta=beta[live].double(), initial_state=pool[idx[live]].double(),
                                  output_final_state=True, **extra)
    state = pool.clone().to(DEV)
    d = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    o = fused_recurrent_step(d(q), d(k), d(v), state, g=d(g), beta=d(beta), scale=0.4, delta=cls == "delta",
                             decay_first=decay_first, state_indices=d(idx))
    assert _rel(o[live], o_want) < CHUNK_F32_REL
    assert torch.equal(o[~live].cpu(), torch.zeros_like(o[~live].cpu()))  # padding rows: zero output
    assert _rel(state[idx[live]], S_want) < CHUNK_F32_REL
    untouched = torch.tensor([s not in idx.tolist() for s in range(slots)])
    assert torch.equal(state[untouched].cpu(), pool[untouched])  # other slots (and padding) untouched


def test_bf16_state_pool(gen):
    """A bf16 state pool: read and written in bf16, arithmetic in fp32 (one rounding per call)."""
    B, H, K, V = 2, 2, 16, 16
    q, k, v = (torch.randn(B, 1, H, K, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, 1, H, generator=gen))
    pool = (0.3 * torch.randn(B, H, K, V, generator=gen)).to(torch.bfloat16)
    o_want, S_want = fw.recurrent(_recipe("gated", "scalar", True), q.double(), k.double(), v.double(), scale=0.4,
                                  g=g.double(), initial_state=pool.double(), output_final_state=True)
    state = pool.clone().to(DEV)
    o = fused_recurrent_step(q.to(DEV), k.to(DEV), v.to(DEV), state, g=g.to(DEV), scale=0.4)
    assert state.dtype == torch.bfloat16
    assert _rel(o, o_want) < CHUNK_F32_REL
    assert _rel(state, S_want) < CHUNK_LOW_REL[torch.bfloat16]
