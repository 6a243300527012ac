"""The inner mini-batch chunk form equals `recurrent` with the same mini-batch size."""

import pytest
import torch

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import CHUNK_F64

MINIBATCH = ["ttt_linear", "ttt_mlp", "titans", "omeganet", "atlas"]


def _close(a, b, tol):
    return (a - b).abs().max().item() < tol * (1 + b.abs().max().item())


@pytest.mark.parametrize("T", [1, 16, 37])
@pytest.mark.parametrize("name", MINIBATCH)
def test_chunk_equals_recurrent(name, T):
    inputs, state = make_case(name, T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state)
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert _close(b, a, CHUNK_F64)


@pytest.mark.parametrize("name", ["titans", "atlas"])
def test_chunk_chains_from_the_middle_of_a_minibatch(name):
    inputs, state = make_case(name, T=40)
    o, s = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    a = {k: v[:, :21] for k, v in inputs.items()}
    b = {k: v[:, 21:] for k, v in inputs.items()}
    o1, s1 = fw.chunk(name, initial_state=state, output_final_state=True, **a)
    assert s1.offset == 21 % 16
    o2, s2 = fw.chunk(name, initial_state=s1, output_final_state=True, **b)
    assert _close(torch.cat([o1, o2], 1), o, CHUNK_F64)
    assert max_err(s2, s) < CHUNK_F64


@pytest.mark.parametrize("kind", ["gd", "momentum", "muon"])
@pytest.mark.parametrize("objective", ["dot", "l2"])
def test_any_minibatch_recipe(kind, objective):
    rec = Recipe(name="mb", memory=Memory(kind="mlp", depth=2, expansion=2, activation="silu"),
                 objective=Objective(kind=objective), optimizer=Optimizer(kind=kind, minibatch=5),
                 retention=Retention(kind="scalar", decay_first=False))
    inputs, state = make_case(rec, T=23)
    o1, s1 = fw.recurrent(rec, initial_state=state, output_final_state=True, **inputs)
    o2, s2 = fw.chunk(rec, initial_state=state, output_final_state=True, **inputs)
    assert _close(o2, o1, CHUNK_F64)
    assert max_err(s1, s2) < CHUNK_F64


def test_per_token_memories_have_no_chunk_form():
    rec = Recipe(memory=Memory(kind="mlp"), optimizer=Optimizer(kind="momentum"),
                 retention=Retention(kind="scalar", decay_first=False))
    assert fw.forms(rec) == ["recurrent"]
    inputs, state = make_case(rec, T=4)
    with pytest.raises(fw.FormNotAvailable, match="minibatch"):
        fw.chunk(rec, initial_state=state, **inputs)
