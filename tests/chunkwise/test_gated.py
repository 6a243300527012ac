"""fastweights.chunkwise.chunk_gated (gated-linear class) against the exact per-token recurrence.

The reference is `fastweights.recurrent` on a plain linear memory with the dot objective
(S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ). Inputs are fresh random each run; the seed is
printed (pytest shows it on failure). The bf16 numerics run at T = 4,096 and 65,536.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.chunkwise import chunk_gated
from tests.chunkwise.helpers import assert_varlen_equals_each_sequence_alone
from tests.tolerances import (
    CHUNK_F32_REL,
    CHUNK_F64,
    CHUNK_LONG_F32_REL,
    CHUNK_LOW_REL,
)

GATES = ["none", "scalar", "diagonal"]
CHUNKS = [16, 32, 64]
LONG_T = [4096, 65536]  # the length; ~35 s of the suite on 2 cores


def _recipe(gate: str) -> Recipe:
    return Recipe(name=f"gated_linear_{gate}", memory=Memory(kind="linear"), objective=Objective(kind="dot"),
                  optimizer=Optimizer(kind="gd"), retention=Retention(kind=gate))


@pytest.fixture
def gen():
    seed = torch.seed() % 2**62
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _inputs(gate, gen, *, B=2, T=17, H=2, K=8, V=5, dtype=torch.float64, g_scale=1.0, state=True):
    """q, k, v, beta, g (None, [B, T, H] or [B, T, H, K]) and S0, as float64 leaves."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(B, T, H, K), "k": F.normalize(rnd(B, T, H, K), dim=-1), "v": rnd(B, T, H, V),
         "beta": torch.rand(B, T, H, generator=gen, dtype=torch.float64)}
    if gate != "none":
        shape = (B, T, H, K) if gate == "diagonal" else (B, T, H)
        x["g"] = g_scale * F.logsigmoid(rnd(*shape) + 1.0)
    x["S0"] = 0.3 * rnd(B, H, K, V) if state else None
    return {key: (val.to(dtype) if val is not None and key != "g" else val) for key, val in x.items()}


def _leaves(x):
    return {key: val.detach().clone().requires_grad_(True) for key, val in x.items() if val is not None}


def _run(form, gate, x, *, scale=0.4, **kw):
    """(o, S_T) of `form` ('chunk' or 'recurrent') on the inputs x (a dict of leaves)."""
    extra = {"g": x["g"]} if "g" in x else {}
    if form == "recurrent":
        return fw.recurrent(_recipe(gate), x["q"], x["k"], x["v"], scale=scale, beta=x["beta"],
                            initial_state=x.get("S0"), output_final_state=True, **extra)
    return chunk_gated(x["q"], x["k"], x["v"], beta=x["beta"], scale=scale, initial_state=x.get("S0"),
                       output_final_state=True, **extra, **kw)


def _with_grads(form, gate, x, seed=0, **kw):
    """Outputs, final state, and the gradient of a random projection of both w.r.t. every input."""
    x = _leaves(x)
    o, S = _run(form, gate, x, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (S.double() * torch.randn(S.shape, generator=g, dtype=torch.float64)).sum()
    names = list(x)
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    return o.detach(), S.detach(), dict(zip(names, grads))


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("T", [1, 17, 100])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence_float64(gate, T, gen):
    x = _inputs(gate, gen, T=T)
    o1, s1, g1 = _with_grads("recurrent", gate, x)
    for C in CHUNKS:
        o2, s2, g2 = _with_grads("chunk", gate, x, chunk_size=C)
        assert o2.dtype == torch.float64 and s2.dtype == torch.float64
        assert _abs(o2, o1) < CHUNK_F64, C
        assert _abs(s2, s1) < CHUNK_F64, C
        for name in g1:
            assert _abs(g2[name], g1[name]) < CHUNK_F64, (C, name)


@pytest.mark.parametrize("gate", GATES)
def test_fp32_relative_error(gate, gen):
    x = _inputs(gate, gen, T=100, K=16, V=16)
    o1, s1, g1 = _with_grads("recurrent", gate, x)
    x32 = {key: (val.float() if val is not None else None) for key, val in x.items()}
    o2, s2, g2 = _with_grads("chunk", gate, x32)
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert _rel(o2, o1) < CHUNK_F32_REL
    assert _rel(s2, s1) < CHUNK_F32_REL
    for name in g1:
        assert _rel(g2[name], g1[name]) < CHUNK_F32_REL, name


@pytest.mark.parametrize("gate", GATES)
def test_no_initial_state_and_no_beta(gate, gen):
    x = _inputs(gate, gen, T=40, state=False)
    extra = {"g": x["g"]} if "g" in x else {}
    o1, s1 = fw.recurrent(_recipe(gate), x["q"], x["k"], x["v"], scale=None, output_final_state=True, **extra)
    o2, s2 = chunk_gated(x["q"], x["k"], x["v"], scale=None, output_final_state=True, chunk_size=16, **extra)
    assert _abs(o2, o1) < CHUNK_F64 and _abs(s2, s1) < CHUNK_F64
    o3, none = chunk_gated(x["q"], x["k"], x["v"], scale=None, chunk_size=16, **extra)
    assert none is None and torch.equal(o3, o2)


# ---------------------------------------------------------------------------- varlen and chaining
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("gate", GATES)
def test_varlen_equals_each_sequence_alone(gate, C, gen):
    lengths = [7, 0, 64, 33, 1]
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=T, state=False)
    x["S0"] = 0.3 * torch.randn(len(lengths), 2, 8, 5, generator=gen, dtype=torch.float64)
    o, S, grads = _with_grads("chunk", gate, x, chunk_size=C, cu_seqlens=cu)
    assert o.shape == x["v"].shape and S.shape == x["S0"].shape
    assert_varlen_equals_each_sequence_alone(lambda form, part, **kw: _run(form, gate, part, **kw), x, cu, C, o, S,
                                             grads)


@pytest.mark.parametrize("gate", GATES)
def test_chaining_from_the_carried_state(gate, gen):
    x = _inputs(gate, gen, T=90)
    o, S = _run("chunk", gate, x, chunk_size=32)
    for t in (37, 64):
        first = {key: (val[:, :t] if key != "S0" else val) for key, val in x.items()}
        second = {key: val[:, t:] for key, val in x.items() if key != "S0"}
        o1, s1 = _run("chunk", gate, first, chunk_size=32)
        second["S0"] = s1
        o2, s2 = _run("chunk", gate, second, chunk_size=32)
        assert _abs(torch.cat([o1, o2], 1), o) < CHUNK_F64 and _abs(s2, S) < CHUNK_F64


# ---------------------------------------------------------------------------- dtypes and numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", GATES)
def test_low_precision_inputs(gate, dtype, gen):
    x = _inputs(gate, gen, T=70, K=16, V=16)
    o_ref, s_ref = _run("chunk", gate, x)
    xl = {key: (val.to(dtype) if key in ("q", "k", "v", "beta") else val) for key, val in x.items()}
    o, S = _run("chunk", gate, xl)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    tol = CHUNK_LOW_REL.get(dtype, CHUNK_F32_REL)
    assert _rel(o, o_ref) < tol and _rel(S, s_ref) < tol


def _long_gates(case, B, T, H, K, gen):
    """Log-gates for the long-sequence numerics cases (fp32)."""
    if case == "none":
        return None
    shape = (B, T, H, K) if case.endswith("diagonal") else (B, T, H)
    if case.startswith("strong"):  # g ≈ −5 per token
        return (-5.0 + 0.5 * torch.randn(*shape, generator=gen)).clamp(max=0.0)
    # long runs of g = 0 (no decay at all for ~1000 tokens) between stretches of strong decay
    g = (-5.0 + 0.5 * torch.randn(*shape, generator=gen)).clamp(max=0.0)
    t = torch.arange(T)
    return torch.where(((t // 1000) % 2 == 0).view(1, T, *([1] * (len(shape) - 2))), 0.0, g)


@pytest.mark.parametrize("T", LONG_T)
@pytest.mark.parametrize("case", ["strong_scalar", "strong_diagonal", "none", "zero_runs_scalar",
                                  "zero_runs_diagonal"])
def test_long_bf16_numerics(case, T, gen):
    B, H, K, V = 1, 2, 32, 32
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = _long_gates(case, B, T, H, K, gen)
    with torch.no_grad():
        o32, s32 = chunk_gated(q, k, v, g=g, scale=K ** -0.5, output_final_state=True)
        o16, s16 = chunk_gated(q.bfloat16(), k.bfloat16(), v.bfloat16(), g=g, scale=K ** -0.5,
                               output_final_state=True)
        assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
        assert torch.isfinite(o16).all() and torch.isfinite(s16).all()
        assert _rel(o16, o32) < CHUNK_LOW_REL[torch.bfloat16] and _rel(s16, s32) < CHUNK_LOW_REL[torch.bfloat16]
        # fp32 is itself accurate: against the float64 chunk form on the same inputs
        o64, s64 = chunk_gated(q.double(), k.double(), v.double(), g=None if g is None else g.double(),
                               scale=K ** -0.5, output_final_state=True)
        assert _rel(o32, o64) < CHUNK_LONG_F32_REL and _rel(s32, s64) < CHUNK_LONG_F32_REL


@pytest.mark.parametrize("gate", ["scalar", "diagonal"])
def test_extreme_decay_stays_finite_with_gradients(gate, gen):
    """g ≈ −50 per token (e^{−50·64} is far below fp32's range): still finite, still exact."""
    x = _inputs(gate, gen, T=100, K=16, V=16)
    x["g"] = x["g"] * 0 - 50.0 + torch.rand(x["g"].shape, generator=gen, dtype=torch.float64)
    o1, s1, g1 = _with_grads("recurrent", gate, x)
    x32 = {key: val.float() for key, val in x.items()}
    o2, s2, g2 = _with_grads("chunk", gate, x32)
    for val in [o2, s2, *g2.values()]:
        assert torch.isfinite(val).all()
    assert _rel(o2, o1) < CHUNK_F32_REL and _rel(s2, s1) < CHUNK_F32_REL
    for name in ("q", "k", "v", "beta", "S0"):
        assert _rel(g2[name], g1[name]) < CHUNK_F32_REL, name


# ---------------------------------------------------------------------------- errors and wiring
def test_bad_shapes_are_named():
    q = torch.randn(1, 8, 2, 4)
    v = torch.randn(1, 8, 2, 3)
    with pytest.raises(ValueError, match="g must have shape"):
        chunk_gated(q, q, v, g=torch.zeros(1, 8, 3), scale=1.0)
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_gated(q, q, v, beta=torch.ones(1, 8), scale=1.0)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        chunk_gated(q, q, v, scale=1.0, initial_state=torch.zeros(2, 2, 4, 3))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T"):
        chunk_gated(q, q, v, scale=1.0, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="batch must be 1"):
        chunk_gated(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), scale=1.0,
                    cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated(q, q, v, scale=1.0, chunk_size=0)
