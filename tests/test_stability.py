"""fastweights.stability: the step bound raises, naming beta, where an inner step can amplify the memory;
it is sufficient (a run within it stays bounded), tight for rank-1 steps, never trips on the library's
own example inputs; and no call returns nan/inf from finite inputs without a DivergenceError."""

import pytest
import torch

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention, zoo
from fastweights.inputs import InputError, example_inputs, validate
from fastweights.stability import SLACK, DivergenceError, check_step_bound, step_bound_applies
from fastweights.state import MemoryState
from tests.tolerances import STEP_BOUND_NORM_F64


def _split(x):
    x = dict(x)
    return x.pop("q"), x.pop("k"), x.pop("v"), x


def test_omeganet_with_a_users_beta_raises_naming_beta():
    """The issue's case: OmegaNet with β ∈ (0, 1) returned nan (T = 1024) or 1e16 (T = 256) without a word."""
    x = example_inputs("omeganet", seq_len=64, seed=0)
    x["beta"] = torch.rand_like(x["beta"])
    q, k, v, rest = _split(x)
    for form in ("recurrent", "chunk"):
        with pytest.raises(DivergenceError, match=r"beta is too large for omeganet.*mini-batch of b=16.*β ≤ 0.0052"):
            getattr(fw, form)("omeganet", q, k, v, **rest)
    assert issubclass(DivergenceError, InputError)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "kda", "deltaproduct"])
def test_delta_rule_on_long_keys_raises(name):
    """β ∈ (0, 1) passes the old β ≤ 2 check, but with ‖k‖ = 3 the step I − βkkᵀ has eigenvalues down to −8."""
    x = example_inputs(name, seq_len=16, seed=0, dtype=torch.float64)
    x["k"] = 3 * x["k"]
    q, k, v, rest = _split(x)
    with pytest.raises(DivergenceError, match=r"β·‖k‖² = .* exceeds 2 at batch \d, token \d+"):
        fw.recurrent(name, q, k, v, **rest)


def test_comba_bound_is_one_plus_the_retention():
    """Decay after the step: α·I − βkpᵀ has the eigenvalue α − β p·k ≥ −1 iff β p·k ≤ 1 + α. (The
    bound itself; a call of one token — one step, which cannot diverge — runs past it.)"""
    x = example_inputs("comba", batch_size=1, seq_len=1, num_heads=1, seed=0, dtype=torch.float64)
    x["p"] = x["k"].clone()
    x["g"] = torch.full_like(x["g"], -0.5)  # α = e^-0.5
    q, k, v, rest = _split(x)
    r = zoo.get("comba")
    limit = 1 + torch.tensor(-0.5).exp().item()
    below, above = ({**rest, "beta": torch.full_like(rest["beta"], limit * f)} for f in (0.999, 1.01))
    check_step_bound(r, validate(r, q, k, v, below), k, below)
    with pytest.raises(DivergenceError, match=r"β·p·k = 1.6\d* exceeds 1 \+ α = 1.60"):
        check_step_bound(r, validate(r, q, k, v, above), k, above)
    o, S = fw.recurrent(r, q, k, v, output_final_state=True, **above)
    o_raw, S_raw = fw.recurrent(r, q, k, v, output_final_state=True, check_values=False, **above)
    assert torch.equal(o, o_raw) and torch.equal(S, S_raw)


def _minibatch_recipe(**opt):
    return Recipe(name="mb", memory=Memory(kind="linear"), objective=Objective(kind="omega", window=3),
                  optimizer=Optimizer(kind="gd", minibatch=4, **opt),
                  retention=Retention(kind="none" if opt else "scalar", decay_first=bool(opt)))


@pytest.mark.parametrize("model", ["deltanet", "gated_deltanet", "kda", "comba", "deltaproduct", "omeganet",
                                   "minibatch", "minibatch_average"])
def test_within_the_bound_the_memory_never_grows(model):
    """Sufficiency, in float64: with v = 0 every step is S ↦ (α·I − M)S, so within the bound the state's norm
    never grows, even with every key the same (the worst case: the bound is then tight). β is set to the
    largest value the bound lets through (found by bisection on `check_step_bound` itself)."""
    recipe = {"minibatch": _minibatch_recipe(), "minibatch_average": _minibatch_recipe(minibatch_average=True)}.get(
        model, model)
    r = zoo.resolve(recipe)
    T = 48
    x = example_inputs(r, seq_len=T, num_heads=1, head_dim=4, seed=3, dtype=torch.float64)
    q, k, v, rest = _split(x)
    k = k[:, :1].expand_as(k).contiguous()  # one key for every token: M's trace is its largest eigenvalue
    if "p" in rest:
        rest["p"] = k.clone()
    v = torch.zeros_like(v)
    S0 = fw.init_state(r, 2, 1, 4, 4, dtype=torch.float64)
    S0 = torch.randn_like(S0) if isinstance(S0, torch.Tensor) else S0
    if isinstance(S0, MemoryState):
        S0 = MemoryState(weights=(torch.randn_like(S0.weights[0]),))

    def passes(scale):
        inputs = {**rest, "beta": scale * torch.ones_like(rest["beta"])}
        try:
            check_step_bound(r, validate(r, q, k, v, inputs), k, inputs, S0)
            return True
        except InputError:  # the step bound, or β ≤ 2 itself for the delta rule
            return False

    lo, hi = 0.0, 4.0
    assert not passes(hi)
    for _ in range(30):
        lo, hi = ((lo + hi) / 2, hi) if passes((lo + hi) / 2) else (lo, (lo + hi) / 2)
    beta = torch.full_like(rest["beta"], lo / (1 + SLACK))  # the bound itself, without the check's slack
    _, S = fw.recurrent(r, q, k, v, initial_state=S0, output_final_state=True, **{**rest, "beta": beta})
    w0 = S0.weights[0] if isinstance(S0, MemoryState) else S0
    w = S.weights[0] if isinstance(S, MemoryState) else S
    assert w.norm() <= w0.norm() * (1 + STEP_BOUND_NORM_F64)
    # just past the bound, with aligned keys, the step amplifies: the bound is tight for rank-1 steps
    if model == "deltanet":
        _, S = fw.recurrent(r, q, k, v, initial_state=S0, output_final_state=True, check_values=False,
                            **{**rest, "beta": beta * 1.1})
        assert S.norm() > 1.5 * w0.norm()  # 1.2^48 along k


@pytest.mark.parametrize("name", zoo.names())
def test_example_inputs_never_trip_the_bound(name):
    """The library's own inputs, in every form, chained across a call boundary inside a mini-batch."""
    x = example_inputs(name, seq_len=37, num_heads=2, head_dim=4, seed=11, dtype=torch.float64)
    q, k, v, rest = _split(x)
    state = rest.pop("initial_state", None)
    per_head = ("lamb", "ln_weight", "ln_bias")

    def part(sl):
        return {n: (t if n in per_head else t[:, sl]) for n, t in rest.items()}

    for form in fw.forms(name):
        fn = getattr(fw, form)
        _, s = fn(name, q[:, :21], k[:, :21], v[:, :21], initial_state=state, output_final_state=True,
                  **part(slice(0, 21)))
        o, _ = fn(name, q[:, 21:], k[:, 21:], v[:, 21:], initial_state=s, **part(slice(21, None)))
        assert torch.isfinite(o).all()


def test_bound_counts_the_initial_window_and_offset():
    """A chained OmegaNet call starts inside a mini-batch with a window from the last call: both count."""
    x = example_inputs("omeganet", batch_size=1, seq_len=6, num_heads=1, head_dim=3, seed=0, dtype=torch.float64)
    q, k, v, rest = _split(x)
    r = zoo.get("omeganet")
    _, s = fw.recurrent(r, q, k, v, output_final_state=True, **rest)
    assert s.offset == 6 and s.window_k.shape[1] == 3
    shapes = validate(r, q, k, v, rest)
    big = {**rest, "beta": torch.full_like(rest["beta"], 0.02)}
    check_step_bound(r, shapes, k, big)  # fresh: 6 tokens × 0.02 × Σ_window(≤ 4 × 3) stays below 1 + α
    s_heavy = MemoryState(weights=s.weights, anchor=s.anchor, offset=s.offset, window_k=s.window_k * 30,
                          window_v=s.window_v, window_gamma=torch.ones_like(s.window_gamma))
    with pytest.raises(DivergenceError, match="mini-batch of b=16 tokens from token 0"):
        check_step_bound(r, shapes, k, big, s_heavy)


def test_omeganet_with_one_inner_mini_batch_runs_past_the_bound():
    """The reference OmegaNet's own test inputs: inner mini-batch b ≥ T (one step), window 4, β ∈ (0, 1),
    a random initial state. The trace bound fails (it is sufficient, not necessary), but one step cannot
    diverge: the call runs and returns exactly what check_values=False returns."""
    import dataclasses

    from tests.helpers import random_state

    base = zoo.get("omeganet")
    r = dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, minibatch=64))
    assert r.objective.window == 4
    x = example_inputs(r, batch_size=2, seq_len=48, num_heads=2, head_dim=8, dtype=torch.float64)
    x["beta"] = torch.rand_like(x["beta"])
    q, k, v, rest = _split(x)
    state = random_state(r, 2, 2, 8, 8, torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    with pytest.raises(DivergenceError, match="beta is too large for omeganet"):
        check_step_bound(r, validate(r, q, k, v, rest), k, rest, state)
    for form in ("recurrent", "chunk"):
        fn = getattr(fw, form)
        o, S = fn(r, q, k, v, initial_state=state, output_final_state=True, **rest)
        o_raw, S_raw = fn(r, q, k, v, initial_state=state, output_final_state=True, check_values=False, **rest)
        assert torch.equal(o, o_raw) and all(torch.equal(a, b) for a, b in zip(S.weights, S_raw.weights))


def test_a_run_that_grows_step_after_step_is_refused_with_what_to_do():
    """OmegaNet at its own b = 16 with β ∈ (0, 1) over 128 tokens (8 inner steps): the memory grows far past
    what any non-amplifying run reaches; refused, naming beta, the growth and how to proceed."""
    x = example_inputs("omeganet", seq_len=128)
    x["beta"] = torch.rand_like(x["beta"])
    q, k, v, rest = _split(x)
    _, S = fw.recurrent("omeganet", q, k, v, output_final_state=True, check_values=False, **rest)
    assert S.weights[0].norm() > 1e6  # it does diverge
    for form in ("recurrent", "chunk"):
        with pytest.raises(DivergenceError, match=r"^beta is too large for omeganet.*this run diverged: the final "
                                                  r"state's norm reaches .*×.*β ≤ 0.0052.*check_values=False"):
            getattr(fw, form)("omeganet", q, k, v, output_final_state=True, **rest)
        with pytest.raises(DivergenceError, match=r"this run diverged: an output's norm reaches"):
            getattr(fw, form)("omeganet", q, k, v, **rest)


def test_bound_covers_exactly_the_linear_gd_steps():
    covered = {n for n in zoo.names() if step_bound_applies(zoo.get(n))}
    assert covered == {"deltanet", "gated_deltanet", "comba", "deltaproduct", "kda", "omeganet"}


def test_trained_memory_divergence_is_named_after_the_call():
    """Titans (MLP memory, momentum) has no bound to check up front: its nan output (β ∈ (0, 1)) is caught."""
    x = example_inputs("titans", seq_len=64, seed=0)
    x["beta"] = torch.rand_like(x["beta"])
    q, k, v, rest = _split(x)
    with pytest.raises(DivergenceError, match=r"fastweights.chunk\('titans'\) produced a non-finite output at "
                                              r"\[b, t, h, v\] = \[\d+, \d+, \d+, \d+\].*lower beta"):
        fw.chunk("titans", q, k, v, **rest)
    o, _ = fw.chunk("titans", q, k, v, check_values=False, **rest)  # the raw result, as asked
    assert not torch.isfinite(o).all()


def test_overflow_of_huge_values_is_named():
    """Finite inputs whose products overflow fp32 (|v| = 1e30 through the dot product)."""
    x = example_inputs("gla", seq_len=8, seed=0)
    x["v"] = x["v"] * 1e30
    x["q"] = x["q"] * 1e10
    q, k, v, rest = _split(x)
    with pytest.raises(DivergenceError, match="overflowed torch.float32"):
        fw.recurrent("gla", q, k, v, **rest)
