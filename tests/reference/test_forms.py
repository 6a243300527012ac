"""recurrent == parallel for every recipe that has both (float64, < 1e-10): outputs, final
states, gradients (w.r.t. every input and the initial state), odd lengths, chaining."""

import pytest
import torch

import fastweights as fw
from fastweights import zoo
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import EXACT_F64, RECURRENT_F32

PARALLEL = [n for n in zoo.names() if "parallel" in fw.forms(n)]
ALL = zoo.names()


@pytest.mark.parametrize("T", [1, 7, 20])
@pytest.mark.parametrize("name", PARALLEL)
def test_recurrent_equals_parallel(name, T):
    inputs, state = make_case(name, T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    o2, s2, g2 = run_with_grads(fw.parallel, name, inputs, state)
    assert (o1 - o2).abs().max().item() < EXACT_F64
    assert max_err(s1, s2) < EXACT_F64
    assert len(g1) == len(g2) > 3
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() < EXACT_F64


@pytest.mark.parametrize("name", PARALLEL)
def test_parallel_without_initial_state_equals_recurrent(name):
    inputs, _ = make_case(name, T=11, with_state=False)
    o1, s1 = fw.recurrent(name, output_final_state=True, **inputs)
    o2, s2 = fw.parallel(name, output_final_state=True, **inputs)
    assert (o1 - o2).abs().max().item() < EXACT_F64
    assert max_err(s1, s2) < EXACT_F64


def _split(inputs, t, name):
    """Inputs of [0, t) and [t, T) (time is dim 1 of every per-token input)."""
    first, second = {}, {}
    for key, x in inputs.items():
        if key == "lamb":
            first[key] = second[key] = x
        else:
            first[key], second[key] = x[:, :t], x[:, t:]
    return first, second


@pytest.mark.parametrize("name", ALL)
def test_chaining_recurrent(name):
    """Running [0, t) then [t, T) from the carried state equals one run (t inside a mini-batch too)."""
    T, t = 21, 9
    inputs, state = make_case(name, T=T)
    o, s = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    a, b = _split(inputs, t, name)
    o1, s1 = fw.recurrent(name, initial_state=state, output_final_state=True, **a)
    o2, s2 = fw.recurrent(name, initial_state=s1, output_final_state=True, **b)
    assert (torch.cat([o1, o2], 1) - o).abs().max().item() < EXACT_F64
    assert max_err(s2, s) < EXACT_F64


@pytest.mark.parametrize("name", PARALLEL)
def test_chaining_parallel(name):
    T, t = 15, 6
    inputs, state = make_case(name, T=T)
    o, s = fw.parallel(name, initial_state=state, output_final_state=True, **inputs)
    a, b = _split(inputs, t, name)
    o1, s1 = fw.parallel(name, initial_state=state, output_final_state=True, **a)
    o2, s2 = fw.parallel(name, initial_state=s1, output_final_state=True, **b)
    assert (torch.cat([o1, o2], 1) - o).abs().max().item() < EXACT_F64
    assert max_err(s2, s) < EXACT_F64


@pytest.mark.parametrize("name", ALL)
def test_recurrent_runs_in_low_precision(name):
    """bf16/fp32 inputs: outputs in the input dtype, state in fp32, close to the float64 run."""
    inputs, state = make_case(name, T=6, with_state=False)
    inputs = {k: v.detach() for k, v in inputs.items()}
    if isinstance(state, fw.MemoryState):
        state = fw.state.state_map(state, lambda x: x.detach())
    o64, _ = fw.recurrent(name, initial_state=state, **inputs)
    low = {k: (v.float() if k == "g" else v.to(torch.float32)) for k, v in inputs.items()}
    st32 = fw.state.state_map(state, lambda x: x.float()) if state is not None else None
    o32, s32 = fw.recurrent(name, initial_state=st32, output_final_state=True, **low)
    assert o32.dtype == torch.float32
    assert (o32.double() - o64).abs().max().item() < RECURRENT_F32 * (1 + o64.abs().max().item())
