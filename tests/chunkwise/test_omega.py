"""OmegaNet's mini-batch form by the kernel trick (`chunkwise.omega`) equals the recurrence and the mini-batch form on
expanded features (float64: outputs, final states, every gradient incl. the gates and the initial state)."""

import pytest
import torch

import fastweights as fw
from fastweights import FeatureMap, Memory, Objective, Optimizer, Recipe, Retention
from fastweights.chunkwise import minibatch, omega
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import CHUNK_F64

SHIPPED = dict(omega._TRICK)  # the switch as the package ships it, before any test moves it


@pytest.fixture(autouse=True)
def every_width():
    """The kernel trick's form, on, at every state width (its default routes only K'·V ≥ 2¹⁷ there), then the
    shipped switch again."""
    omega.kernel_trick(True, min_elements=0)
    yield
    omega.kernel_trick(SHIPPED["on"], min_elements=SHIPPED["min_elements"])


def test_the_kernel_trick_is_opt_in():
    """Shipped off (slower on the GPU: `omega._TRICK`'s note): fw.chunk runs OmegaNet on the mini-batch form."""
    assert SHIPPED == {"on": False, "min_elements": 1 << 17}


def _close(a, b, tol):
    return (a - b).abs().max().item() < tol * (1 + b.abs().max().item())


_POLY2 = FeatureMap(kind="polynomial", degree=2)


def _omega_like(fm=_POLY2, window=4, b=16, retention="scalar"):
    return Recipe(name="omega-like", memory=Memory(kind="linear"), feature_map=fm,
                  objective=Objective(kind="omega" if window > 1 else "l2", window=window),
                  optimizer=Optimizer(kind="gd", minibatch=b),
                  retention=Retention(kind=retention, decay_first=False))


RECIPES = {
    "omeganet": "omeganet",
    "taylor": _omega_like(FeatureMap(kind="taylor", degree=2)),
    "homogeneous": _omega_like(FeatureMap(kind="polynomial", degree=2, homogeneous=True)),
    "degree 3, c 3, b 5": _omega_like(FeatureMap(kind="polynomial", degree=3), window=3, b=5),
    "l2 (c 1), no retention": _omega_like(window=1, b=4, retention="none"),
}


def _expanded(fn, *args):
    old = omega.kernel_trick(False)
    try:
        return fn(*args)
    finally:
        omega.kernel_trick(**old)


def _same(a, b):
    (o1, s1, g1), (o2, s2, g2) = a, b
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64
    assert len(g1) == len(g2)
    for x, y in zip(g1, g2):
        assert _close(y, x, CHUNK_F64)


def _chained(cuts):
    """fw.chunk over the pieces of the sequence cut at `cuts`, each from the last one's final state."""
    def run(model, initial_state, output_final_state, **inp):
        per_token = ("q", "k", "v", "g", "beta", "gamma")
        bounds = [0, *cuts, inp["q"].shape[1]]
        outs, st = [], initial_state
        for a, e in zip(bounds[:-1], bounds[1:]):
            o, st = fw.chunk(model, initial_state=st, output_final_state=True,
                             **{k: (v[:, a:e] if k in per_token else v) for k, v in inp.items()})
            outs.append(o)
        return torch.cat(outs, 1), st
    return run


@pytest.mark.parametrize("T", [1, 2, 16, 37])
@pytest.mark.parametrize("name", list(RECIPES))
def test_kernel_trick_equals_recurrent_and_the_expanded_form(name, T):
    """From a random state (its window keys random features, not φ of any key): the kernel trick's form, the
    recurrence and the mini-batch form on φ(q), φ(k) agree in float64 (T 1 and 2: every window pair but the last
    from the state)."""
    rec = RECIPES[name]
    assert omega.applies(fw.zoo.resolve(rec) if isinstance(rec, str) else rec)
    inputs, state = make_case(rec, T=T)
    got = run_with_grads(fw.chunk, rec, inputs, state)
    _same(run_with_grads(fw.recurrent, rec, inputs, state), got)
    _same(_expanded(run_with_grads, fw.chunk, rec, inputs, state), got)


@pytest.mark.parametrize("cuts", [[21], [15], [14, 15, 17], [1, 2, 3, 33]])
def test_kernel_trick_chains_from_the_middle_of_a_minibatch(cuts):
    """Calls chained through their final states (offset 15: a first segment of one token, so the next segment's
    window still reaches two carried pairs; pieces of 1–3 tokens) equal one run of the recurrence."""
    inputs, state = make_case("omeganet", T=40)
    _same(run_with_grads(fw.recurrent, "omeganet", inputs, state),
          run_with_grads(_chained(cuts), "omeganet", inputs, state))


def test_kernel_trick_under_checkpoint_chain():
    """`minibatch.checkpoint_chain(k)` recomputes the kernel trick's blocks too: the same numbers."""
    inputs, state = make_case("omeganet", T=45)
    want = run_with_grads(fw.recurrent, "omeganet", inputs, state)
    minibatch.checkpoint_chain(2)
    try:
        got = run_with_grads(fw.chunk, "omeganet", inputs, state)
    finally:
        minibatch.checkpoint_chain(0)
    _same(want, got)


def test_routing(monkeypatch):
    """With `kernel_trick(True)`, fw.chunk runs OmegaNet by the kernel trick, and not after `kernel_trick(False)`;
    ATLAS (muon, MLP) and TTT-Linear (bias, residual LN, averaged gd) never."""
    calls = []
    real = omega.omega_chunk
    monkeypatch.setattr(omega, "omega_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs, state = make_case("omeganet", T=5)
    fw.chunk("omeganet", initial_state=state, **inputs)
    assert calls == [1]
    _expanded(lambda: fw.chunk("omeganet", initial_state=state, **inputs))
    assert calls == [1]
    omega.kernel_trick(True)  # the default width: K 4 (K' 15 × V 3) stays on the expanded form, K 64 does not
    fw.chunk("omeganet", initial_state=state, **inputs)
    assert calls == [1]
    Kf = fw.zoo.resolve("omeganet").feature_map.out_dim(64)
    assert omega.wide(Kf, 64) and not omega.wide(fw.zoo.resolve("omeganet").feature_map.out_dim(32), 32)
    assert not any(omega.applies(fw.zoo.resolve(n)) for n in ("atlas", "ttt_linear", "titans", "deltanet"))
    for bad in (1, "yes", None):
        with pytest.raises((TypeError, ValueError)):
            omega.kernel_trick(bad)
    with pytest.raises((TypeError, ValueError)):
        omega.kernel_trick(True, min_elements=-1)
    assert omega.applies(fw.zoo.resolve("omeganet"))


def test_kernel_trick_keeps_no_per_token_features():
    """What autograd keeps: no [.., K'] features a token — the only tensors with the feature dimension K' are the
    segments' [K', V] start states and the carried window's c − 1 rows (K 16: K' 153)."""
    K = 16
    inputs, state = make_case("omeganet", T=64, B=1, H=1, K=K, V=K, dtype=torch.float32)
    Kf = fw.zoo.resolve("omeganet").feature_map.out_dim(K)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fw.chunk("omeganet", initial_state=state, check_values=False, **inputs)
    wide = [s for s in shapes if Kf in s]
    assert wide and all(s[-2:] == (Kf, K) or (s[-1] == Kf and s[-2] <= 3) for s in wide), wide


def test_kernel_trick_under_autocast_computes_as_without():
    """A forward under a bf16 autocast runs with autocast off (its backward's products would mix bf16 and fp32): the
    same outputs, final state and gradients as without autocast, bitwise (fp32, CPU autocast; the backward outside
    it, as on CUDA, where autograd's thread has no autocast)."""
    inputs, state = make_case("omeganet", T=37, K=8, V=8, dtype=torch.float32)
    want = run_with_grads(fw.chunk, "omeganet", inputs, state)

    def under_autocast(*args, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fw.chunk(*args, **kw)

    o, s, g = run_with_grads(under_autocast, "omeganet", inputs, state)
    assert torch.equal(o, want[0]) and max_err(s, want[1]) == 0
    assert all(torch.equal(a, b) for a, b in zip(g, want[2]))


def test_a_torch_func_transform_takes_the_minibatch_form():
    """Under torch.func (a stacked lab run vmaps the torch paths) `applies` is False — `_Segment` is an autograd
    Function of the old `forward(ctx, ...)` form, which torch.func refuses — and True again outside it."""
    seen = []

    def f(x):
        seen.append(omega.applies(fw.zoo.resolve("omeganet")))
        return x * 2

    torch.func.vmap(f)(torch.zeros(2, 3))
    assert seen == [False]
    assert omega.applies(fw.zoo.resolve("omeganet"))
