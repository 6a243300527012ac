"""fastweights.kernels.triton.decode.fused_recurrent_step against fastweights.recurrent: T = 1 and
a short T, gated-linear and delta classes (decay first and after), no/scalar/diagonal decay,
grouped heads, an fp32 and a bf16 state pool addressed by state_indices with −1 padding rows.
Marked `triton` (interpreter on CPU tensors without CUDA; NaN-poisoned outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.kernels.triton.decode import fused_recurrent_step
from tests.kernels.helpers import DEV, rel
from tests.tolerances import CHUNK_F32_REL, CHUNK_LOW_REL

pytestmark = pytest.mark.triton



def _recipe(cls: str, gate: str, decay_first: bool) -> Recipe:
    obj = Objective(kind="dot" if cls == "gated" else "l2")
    return Recipe(name=f"{cls}_{gate}", memory=Memory(kind="linear"), objective=obj, optimizer=Optimizer(kind="gd"),
                  retention=Retention(kind=gate, decay_first=decay_first))




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
    assert rel(o[live], o_want) < CHUNK_F32_REL
    assert torch.equal(o[~live].cpu(), torch.zeros_like(o[~live].cpu()))  # padding rows: zero output
    assert rel(state[idx[live]], S_want) < CHUNK_F32_REL
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
    assert rel(o, o_want) < CHUNK_F32_REL
    assert rel(state, S_want) < CHUNK_LOW_REL[torch.bfloat16]


# ---------------------------------------------------------------------------- the recurrent dispatch rows
@pytest.mark.parametrize("model", ["gla", "mamba2", "retnet", "gated_deltanet", "deltanet", "kda"])
def test_recurrent_row_matches_torch_backend(model, gen):
    """The recurrent triton row's fn on a validated Call (a T-token run of the step kernel on a copy
    of the state; grouped heads; constant retention → per-head log γ) gives the torch row's outputs
    and final state, leaves the caller's state untouched, and its backward (the torch recurrence
    recomputed) gives the torch row's gradients of every input and of the initial state. Called
    directly because its predicate asks for CUDA."""
    from fastweights.dispatch import DISPATCH, Call
    from fastweights.inputs import validate

    recipe = fw.zoo.get(model)
    cls = fw.recipe_class(recipe)
    x = fw.example_inputs(model, batch_size=2, seq_len=7, num_heads=2, head_dim=16, generator=gen)
    x.pop("initial_state", None)
    S0 = 0.3 * torch.randn(2, 2, 16, 16, generator=gen)

    def run(backend, device):
        leaves = {key: val.detach().to(device).requires_grad_(True) for key, val in x.items()}
        s0 = S0.to(device).requires_grad_(True)
        rest = {key: val for key, val in leaves.items() if key not in ("q", "k", "v")}
        call = Call(recipe=recipe, q=leaves["q"], k=leaves["k"], v=leaves["v"], inputs=rest,
                    shapes=validate(recipe, leaves["q"], leaves["k"], leaves["v"], rest), scale=0.25,
                    initial_state=s0, output_final_state=True)
        o, S = DISPATCH[(cls, "recurrent", backend)].fn(call)
        w = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=w).to(device)).sum() + \
            (S * torch.randn(S.shape, generator=w).to(device)).sum()
        grads = torch.autograd.grad(loss, [*leaves.values(), s0])
        assert torch.equal(s0.detach().cpu(), S0)  # the caller's state is not modified
        return o.detach(), S.detach(), grads

    o1, S1, g1 = run("triton", DEV)
    o2, S2, g2 = run("torch", "cpu")
    assert rel(o1, o2) < CHUNK_F32_REL and rel(S1, S2) < CHUNK_F32_REL
    for a, b in zip(g1, g2):
        assert rel(a, b) < CHUNK_F32_REL


def test_recurrent_row_predicate():
    from fastweights.dispatch import DISPATCH, Target

    sup = DISPATCH[("delta", "recurrent", "triton")].supports
    assert sup(fw.zoo.get("gated_deltanet"), Target.of("cuda", torch.bfloat16, 128, 128)) is None
    assert "probe" in sup(fw.zoo.get("comba"), Target.of("cuda", torch.bfloat16, 128, 128))
    assert "micro-steps" in sup(fw.zoo.get("deltaproduct"), Target.of("cuda", torch.bfloat16, 128, 128))
    assert "CUDA" in sup(fw.zoo.get("kda"), Target.of("cpu", torch.float32, 64, 64))
