"""fastweights.chunkwise.chunk_delta (delta class, WY/UT transform) against the exact per-token recurrence.

The reference is `fastweights.recurrent` on the matching recipe: DeltaNet (no decay), Gated
DeltaNet (scalar), KDA (diagonal), Comba (error read at the undecayed state, probe key p), and
DeltaProduct (n Householder micro-steps per token), plus a few recipes no paper has (diagonal
Comba, Comba without a probe, a probe with decay_first, DeltaProduct with n = 3 and a diagonal
gate, without gate, or decaying after the micro-steps' error read). Inputs are fresh random each
run; the seed is printed (pytest shows it on failure). The bf16 numerics run at T = 4,096
and 65,536.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.chunkwise import chunk_delta
from tests.chunkwise.helpers import assert_varlen_equals_each_sequence_alone
from tests.tolerances import CHUNK_F32_REL, CHUNK_F64, CHUNK_LOW_REL, UNIT_LOWER_INVERSE_F64

CHUNKS = [16, 32, 64]
LONG_T = [4096, 65536]  # the length; ~35 s of the suite on 2 cores


def _custom(name, gate, *, decay_first=True, probe=False, n=1) -> Recipe:
    return Recipe(name=name, memory=Memory(kind="linear"), objective=Objective(kind="l2", probe=probe),
                  optimizer=Optimizer(kind="gd", householder_steps=n),
                  retention=Retention(kind=gate, decay_first=decay_first))


@dataclass(frozen=True)
class Case:
    recipe: object  # zoo name or Recipe (the reference)
    gate: str  # "none", "scalar" or "diagonal"
    decay_first: bool = True
    probe: bool = False
    n: int = 1  # Householder micro-steps per token


CASES = {
    "deltanet": Case("deltanet", "none"),
    "gated_deltanet": Case("gated_deltanet", "scalar"),
    "kda": Case("kda", "diagonal"),
    "comba": Case("comba", "scalar", decay_first=False, probe=True),
    "comba_diagonal": Case(_custom("comba_diagonal", "diagonal", decay_first=False, probe=True), "diagonal",
                           decay_first=False, probe=True),
    "comba_no_probe": Case(_custom("comba_no_probe", "scalar", decay_first=False), "scalar", decay_first=False),
    "gated_deltanet_probe": Case(_custom("gdn_probe", "scalar", probe=True), "scalar", probe=True),
    "deltaproduct": Case("deltaproduct", "scalar", n=2),
    "deltaproduct3_diagonal": Case(_custom("dp3_diag", "diagonal", n=3), "diagonal", n=3),
    "deltaproduct_no_gate": Case(_custom("dp_none", "none", n=2), "none", n=2),
    "deltaproduct_decay_after": Case(_custom("dp_after", "scalar", decay_first=False, n=2), "scalar",
                                     decay_first=False, n=2),
}
MAIN = ["deltanet", "gated_deltanet", "kda", "comba", "deltaproduct"]


@pytest.fixture
def gen():
    seed = torch.seed() % 2**62
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _inputs(case: Case, gen, *, B=2, T=17, H=2, K=8, V=5, dtype=torch.float64, state=True):
    """q, k, v, beta, g, p and S0 (float64, unit keys, β ∈ (0, 1.5)) cast to dtype (g stays float64)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kv = (B, T, case.n, H) if case.n > 1 else (B, T, H)
    x = {"q": rnd(B, T, H, K), "k": F.normalize(rnd(*kv, K), dim=-1), "v": rnd(*kv, V),
         "beta": 1.5 * torch.rand(*kv, generator=gen, dtype=torch.float64)}
    if case.gate != "none":
        x["g"] = F.logsigmoid(rnd(*((B, T, H, K) if case.gate == "diagonal" else (B, T, H))) + 1.0)
    if case.probe:
        x["p"] = F.normalize(rnd(B, T, H, K), dim=-1)
    if state:
        x["S0"] = 0.3 * rnd(B, H, K, V)
    return {key: (val.to(dtype) if key != "g" else val) for key, val in x.items()}


def _run(form, case: Case, x, *, scale=0.4, **kw):
    """(o, S_T) of `form` ('chunk' or 'recurrent') on the inputs x."""
    extra = {key: x[key] for key in ("g", "p") if key in x}
    if form == "recurrent":  # β ∈ (0, 1.5) with the decay after can leave the step bound (α − β < −1): the
        # reference must still agree, so its value checks (fastweights.stability) are off
        return fw.recurrent(case.recipe, x["q"], x["k"], x["v"], scale=scale, beta=x["beta"],
                            initial_state=x.get("S0"), output_final_state=True, check_values=False, **extra)
    return chunk_delta(x["q"], x["k"], x["v"], beta=x["beta"], decay_first=case.decay_first, scale=scale,
                       initial_state=x.get("S0"), output_final_state=True, **extra, **kw)


def _with_grads(form, case, x, seed=0, **kw):
    """Outputs, final state, and the gradient of a random projection of both w.r.t. every input."""
    x = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = _run(form, case, x, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (S.double() * torch.randn(S.shape, generator=g, dtype=torch.float64)).sum()
    names = list(x)
    return o.detach(), S.detach(), dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("T", [1, 17, 100])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_recurrence_float64(name, T, gen):
    case = CASES[name]
    x = _inputs(case, gen, T=T)
    o1, s1, g1 = _with_grads("recurrent", case, x)
    for C in CHUNKS:
        o2, s2, g2 = _with_grads("chunk", case, x, chunk_size=C)
        assert o2.dtype == torch.float64 and s2.dtype == torch.float64
        assert _abs(o2, o1) < CHUNK_F64, C
        assert _abs(s2, s1) < CHUNK_F64, C
        for key in g1:
            assert _abs(g2[key], g1[key]) < CHUNK_F64, (C, key)


@pytest.mark.parametrize("name", MAIN + ["comba_diagonal"])
def test_fp32_relative_error(name, gen):
    case = CASES[name]
    x = _inputs(case, gen, T=100, K=16, V=16)
    o1, s1, g1 = _with_grads("recurrent", case, x)
    o2, s2, g2 = _with_grads("chunk", case, {key: val.float() for key, val in x.items()})
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert _rel(o2, o1) < CHUNK_F32_REL
    assert _rel(s2, s1) < CHUNK_F32_REL
    for key in g1:
        assert _rel(g2[key], g1[key]) < CHUNK_F32_REL, key


def test_defaults_beta_one_zero_state_default_scale(gen):
    case = CASES["gated_deltanet"]
    x = _inputs(case, gen, T=30, state=False)
    o1, s1 = fw.recurrent("gated_deltanet", x["q"], x["k"], x["v"], g=x["g"], output_final_state=True)
    o2, s2 = chunk_delta(x["q"], x["k"], x["v"], beta=None, g=x["g"], scale=None, output_final_state=True,
                         chunk_size=16)
    assert _abs(o2, o1) < CHUNK_F64 and _abs(s2, s1) < CHUNK_F64
    _, none = chunk_delta(x["q"], x["k"], x["v"], beta=None, g=x["g"], scale=None)
    assert none is None


# ---------------------------------------------------------------------------- varlen and chaining
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("name", MAIN + ["deltaproduct3_diagonal"])
def test_varlen_equals_each_sequence_alone(name, C, gen):
    case = CASES[name]
    lengths = [7, 0, 64, 33, 1]
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(case, gen, B=1, T=T, state=False)
    x["S0"] = 0.3 * torch.randn(len(lengths), 2, 8, 5, generator=gen, dtype=torch.float64)
    o, S, grads = _with_grads("chunk", case, x, chunk_size=C, cu_seqlens=cu)
    assert o.shape == x["q"].shape[:3] + (5,) and S.shape == x["S0"].shape
    assert_varlen_equals_each_sequence_alone(lambda form, part, **kw: _run(form, case, part, **kw), x, cu, C, o, S,
                                             grads)


@pytest.mark.parametrize("name", MAIN)
def test_chaining_from_the_carried_state(name, gen):
    case = CASES[name]
    x = _inputs(case, gen, T=90)
    o, S = _run("chunk", case, x, chunk_size=32)
    for t in (37, 64):
        first = {key: (val[:, :t] if key != "S0" else val) for key, val in x.items()}
        second = {key: val[:, t:] for key, val in x.items() if key != "S0"}
        o1, s1 = _run("chunk", case, first, chunk_size=32)
        second["S0"] = s1
        o2, s2 = _run("chunk", case, second, chunk_size=32)
        assert _abs(torch.cat([o1, o2], 1), o) < CHUNK_F64 and _abs(s2, S) < CHUNK_F64


def test_chunk_size_not_dividing_into_sub_chunks(gen):
    """Any chunk size works (here 24 and 7: sub-chunks of 12 and 7 rows for the diagonal gate)."""
    case = CASES["kda"]
    x = _inputs(case, gen, T=50)
    o1, s1 = _run("recurrent", case, x)
    for C in (24, 7):
        o2, s2 = _run("chunk", case, x, chunk_size=C)
        assert _abs(o2, o1) < CHUNK_F64 and _abs(s2, s1) < CHUNK_F64


# ---------------------------------------------------------------------------- dtypes and numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "comba", "deltaproduct"])
def test_low_precision_inputs(name, dtype, gen):
    case = CASES[name]
    x = _inputs(case, gen, T=70, K=16, V=16)
    o_ref, s_ref = _run("chunk", case, x)
    xl = {key: (val.to(dtype) if key in ("q", "k", "v", "beta", "p") else val) for key, val in x.items()}
    o, S = _run("chunk", case, xl)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    tol = CHUNK_LOW_REL.get(dtype, CHUNK_F32_REL)
    assert _rel(o, o_ref) < tol and _rel(S, s_ref) < tol


def _long_gates(kind, shape, gen):
    """Log-gates (fp32) for the long-sequence numerics: g ≈ −5 per token, or long runs of g = 0."""
    if kind == "none":
        return None
    g = (-5.0 + 0.5 * torch.randn(*shape, generator=gen)).clamp(max=0.0)
    if kind == "zero_runs":  # ~1000 tokens without any decay, then ~1000 of strong decay, …
        T = shape[1]
        on = ((torch.arange(T) // 1000) % 2 == 0).view(1, T, *([1] * (len(shape) - 2)))
        g = torch.where(on, 0.0, g)
    return g


@pytest.mark.parametrize("T", LONG_T)
@pytest.mark.parametrize("name,kind", [("gated_deltanet", "strong"), ("kda", "strong"), ("deltanet", "none"),
                                       ("gated_deltanet", "zero_runs"), ("kda", "zero_runs"),
                                       ("comba", "strong"), ("deltaproduct", "strong")])
def test_long_bf16_numerics(name, kind, T, gen):
    case = CASES[name]
    B, H, K, V = 1, 2, 32, 32
    kv = (B, T, case.n, H) if case.n > 1 else (B, T, H)
    x = {"q": torch.randn(B, T, H, K, generator=gen), "k": F.normalize(torch.randn(*kv, K, generator=gen), dim=-1),
         "v": torch.randn(*kv, V, generator=gen), "beta": torch.rand(*kv, generator=gen)}
    if case.probe:
        x["p"] = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    if case.gate != "none":
        x["g"] = _long_gates(kind, (B, T, H, K) if case.gate == "diagonal" else (B, T, H), gen)
    with torch.no_grad():
        o32, s32 = _run("chunk", case, x, scale=K ** -0.5)
        low = {key: (val.bfloat16() if key != "g" else val) for key, val in x.items()}
        o16, s16 = _run("chunk", case, low, scale=K ** -0.5)
        assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
        assert torch.isfinite(o16).all() and torch.isfinite(s16).all()
        assert _rel(o16, o32) < CHUNK_LOW_REL[torch.bfloat16] and _rel(s16, s32) < CHUNK_LOW_REL[torch.bfloat16]
        # fp32 is itself accurate: against the float64 chunk form on the same inputs
        o64, s64 = _run("chunk", case, {key: val.double() for key, val in x.items()}, scale=K ** -0.5)
        assert _rel(o32, o64) < CHUNK_F32_REL and _rel(s32, s64) < CHUNK_F32_REL


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "comba_diagonal"])
def test_extreme_decay_stays_finite_with_gradients(name, gen):
    """g ≈ −50 per token (e^{−50·64} is far below fp32's range): finite, and exact where it matters."""
    case = CASES[name]
    x = _inputs(case, gen, T=100, K=16, V=16)
    x["g"] = -50.0 + torch.rand(x["g"].shape, generator=gen, dtype=torch.float64)
    o1, s1, g1 = _with_grads("recurrent", case, x)
    o2, s2, g2 = _with_grads("chunk", case, {key: val.float() for key, val in x.items()})
    for val in [o2, s2, *g2.values()]:
        assert torch.isfinite(val).all()
    assert _rel(o2, o1) < CHUNK_F32_REL and _rel(s2, s1) < CHUNK_F32_REL
    for key in ("q", "k", "v", "beta", "S0"):
        assert _rel(g2[key], g1[key]) < CHUNK_F32_REL, key


# ---------------------------------------------------------------------------- errors
def test_bad_shapes_are_named():
    q = torch.randn(1, 8, 2, 4)
    v = torch.randn(1, 8, 2, 3)
    b = torch.rand(1, 8, 2)
    with pytest.raises(ValueError, match="g must have shape"):
        chunk_delta(q, q, v, beta=b, g=torch.zeros(1, 8, 2, 3), scale=1.0)
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_delta(q, q, v, beta=torch.ones(1, 8), scale=1.0)
    with pytest.raises(ValueError, match="p must have shape"):
        chunk_delta(q, q, v, beta=b, p=torch.zeros(1, 8, 2, 5), decay_first=False, scale=1.0)
    with pytest.raises(ValueError, match="v must have shape"):
        chunk_delta(q, q.unsqueeze(2), v, beta=b, scale=1.0)
    with pytest.raises(ValueError, match="not defined with Householder"):
        chunk_delta(q, q.unsqueeze(2), v.unsqueeze(2), beta=b.unsqueeze(2), p=q, scale=1.0)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        chunk_delta(q, q, v, beta=b, scale=1.0, initial_state=torch.zeros(1, 2, 3, 4))


@pytest.mark.parametrize("C", [1, 5, 9, 16])
def test_unit_lower_inverses_and_their_gradients(C):
    from fastweights.chunkwise.delta import block_unit_lower_inverse, solve_unit_lower_inverse

    L = torch.randn(3, C, C, dtype=torch.float64) * 0.3
    A = torch.eye(C, dtype=torch.float64) + torch.tril(L, -1)
    for inverse in (block_unit_lower_inverse, solve_unit_lower_inverse):
        T = inverse(L)
        assert (T @ A - torch.eye(C, dtype=torch.float64)).abs().max().item() < UNIT_LOWER_INVERSE_F64
        assert torch.autograd.gradcheck(inverse, (L.clone().requires_grad_(True),))


def test_unit_lower_inverses_run_under_vmap_and_grad():
    """The torch backend takes the "solve" inverse on CUDA, and a stacked lab run (`lab.stack`) vmaps the training
    step there: both inverses' per-sample gradients under torch.func equal their one-at-a-time gradients (a
    Function without `setup_context` was refused, so every stacked gated DeltaNet cell trained alone on the GPU)."""
    from fastweights.chunkwise.delta import block_unit_lower_inverse, solve_unit_lower_inverse

    L = torch.randn(4, 3, 6, 6, dtype=torch.float64) * 0.3  # 4 stacked variants of [3, C, C]
    W = torch.randn(3, 6, 6, dtype=torch.float64)
    for inverse in (block_unit_lower_inverse, solve_unit_lower_inverse):
        def loss(x, inverse=inverse):
            return (inverse(x) * W).sum()

        got = torch.func.vmap(torch.func.grad(loss))(L)
        want = torch.stack([torch.autograd.grad(loss(x), x)[0] for x in L.clone().requires_grad_(True).unbind(0)])
        assert (got - want).abs().max().item() <= UNIT_LOWER_INVERSE_F64, inverse.__name__


def test_every_autograd_function_of_the_torch_paths_is_in_torch_funcs_form():
    """A stacked lab run vmaps the torch paths (`lab.stack`): every autograd.Function of `fastweights.chunkwise` has
    `setup_context` (torch.func refuses the old `forward(ctx, ...)` form), but for those `lab.stack` names or never
    stacks: MesaNet's CG solve and its TF32 region (MesaNet does not stack; the region differentiates its own graph
    with torch.autograd.grad, which torch.func cannot trace), the diagonal scores (a functional form runs under
    torch.func) and OmegaNet's kernel-trick segment (`omega._Segment`: `omega.applies` is False under a torch.func
    transform, so the mini-batch form runs there; tests/chunkwise/test_omega.py holds that)."""
    import importlib
    import inspect
    import pkgutil

    import fastweights.chunkwise as cw

    found = []
    for info in pkgutil.iter_modules(cw.__path__):
        mod = importlib.import_module(f"{cw.__name__}.{info.name}")
        found += [obj for obj in vars(mod).values() if inspect.isclass(obj) and obj.__module__ == mod.__name__
                  and issubclass(obj, torch.autograd.Function)]
    assert len(found) >= 4
    old_form = sorted(f.__qualname__ for f in found if f.setup_context is torch.autograd.Function.setup_context)
    assert old_form == ["_CGSolve", "_DiagonalScores", "_Segment", "_TF32Region"], old_form
