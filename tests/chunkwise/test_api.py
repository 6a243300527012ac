"""fastweights.chunk(model, ...) for every zoo model of the gated-linear and delta classes against
fastweights.recurrent: float64 < 1e-9 (outputs, final states, gradients w.r.t. every input and the
initial state), fp32 relative < 1e-5, odd lengths, chunk sizes 16/32/64, varlen packing through
the API (normalizer state included), chaining; and every zoo model either has a chunk form or
says why not."""

import pytest
import torch

import fastweights as fw
from fastweights import zoo
from fastweights.state import state_map
from tests.helpers import flat_state, make_case, max_err, run_with_grads
from tests.tolerances import CHUNK_F32_REL, CHUNK_F64

LINEAR = [n for n in zoo.names() if fw.recipe_class(zoo.get(n)) in ("gated_linear", "delta")]


def _with_backends(names, dtype):
    """(model, backend) for every backend this machine has for the model's chunk form at `dtype`
    on the CPU ("compile" apart: its one-time compile per shape is tested once, below)."""
    return [(n, b) for n in names for b in fw.backends(n, device="cpu", dtype=dtype) if b != "compile"]


def test_linear_classes_cover_the_published_models():
    assert set(LINEAR) == {"linear_attention", "retnet", "mamba2", "gla", "deltanet", "gated_deltanet", "comba",
                           "deltaproduct", "kda"}


@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (70, 32), (64, 64)])
@pytest.mark.parametrize("name,backend", _with_backends(LINEAR, torch.float64))
def test_chunk_equals_recurrent_float64(name, backend, T, C):
    inputs, state = make_case(name, T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, name, inputs, state, chunk_size=C, backend=backend)
    assert o2.dtype == torch.float64
    assert (o1 - o2).abs().max().item() < CHUNK_F64
    assert max_err(s1, s2) < CHUNK_F64
    assert len(g1) == len(g2) >= 4  # q, k, v, state and the model's gates
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() < CHUNK_F64


@pytest.mark.parametrize("name,backend", _with_backends(LINEAR, torch.float32))
def test_chunk_fp32_relative_error(name, backend):
    inputs, state = make_case(name, T=100, K=16, V=16)
    o1, s1 = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    lo = {k: x.detach().float() for k, x in inputs.items()}
    s32 = state.float() if isinstance(state, torch.Tensor) else state_map(state, lambda x: x.detach().float())
    o2, s2 = fw.chunk(name, initial_state=s32, output_final_state=True, backend=backend, **lo)
    assert o2.dtype == torch.float32
    scale = o1.abs().max().item()
    assert (o2.double() - o1).abs().max().item() < CHUNK_F32_REL * scale
    for a, b in zip(flat_state(s1), flat_state(s2)):
        assert (b.double() - a).abs().max().item() < CHUNK_F32_REL * a.abs().max().item()


def _pack(inputs_list):
    """Concatenate per-sequence inputs (B = 1 each) along T; cu_seqlens of the boundaries."""
    keys = [k for k in inputs_list[0] if k != "lamb"]
    packed = {k: torch.cat([x[k] for x in inputs_list], dim=1) for k in keys}
    lengths = [x["q"].shape[1] for x in inputs_list]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return packed, cu


@pytest.mark.parametrize("name,backend", _with_backends(LINEAR, torch.float64))
def test_varlen_equals_each_sequence_alone(name, backend):
    lengths = [5, 1, 33, 16]
    cases = [make_case(name, T=T, B=1) for T in lengths]
    inputs_list = [{k: x.detach() for k, x in c[0].items()} for c in cases]
    states = [state_map(c[1], torch.Tensor.detach) if not isinstance(c[1], torch.Tensor) else c[1].detach()
              for c in cases]
    packed, cu = _pack(inputs_list)
    if isinstance(states[0], torch.Tensor):
        s0 = torch.cat(states, 0)  # [N, H, K, V]
    else:
        s0 = fw.MemoryState(weights=(torch.cat([s.weights[0] for s in states], 0),),
                            normalizer=torch.cat([s.normalizer for s in states], 0))
    o, s = fw.chunk(name, initial_state=s0, output_final_state=True, cu_seqlens=cu, chunk_size=16, backend=backend,
                    **packed)
    outs, finals = [], []
    for x, st in zip(inputs_list, states):
        oi, si = fw.recurrent(name, initial_state=st, output_final_state=True, **x)
        outs.append(oi)
        finals.append(si)
    assert (o - torch.cat(outs, 1)).abs().max().item() < CHUNK_F64
    for n, si in enumerate(finals):
        row = s[n:n + 1] if isinstance(s, torch.Tensor) else state_map(s, lambda x, n=n: x[n:n + 1])
        assert max_err(row, si) < CHUNK_F64


@pytest.mark.parametrize("name", ["gated_deltanet", "linear_attention", "kda"])
def test_chaining_through_the_carried_state(name):
    inputs, state = make_case(name, T=45)
    inputs = {k: x.detach() for k, x in inputs.items()}
    o, s = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    a = {k: x[:, :19] for k, x in inputs.items()}
    b = {k: x[:, 19:] for k, x in inputs.items()}
    o1, s1 = fw.chunk(name, initial_state=state, output_final_state=True, chunk_size=16, **a)
    o2, s2 = fw.chunk(name, initial_state=s1, output_final_state=True, chunk_size=16, **b)
    assert (torch.cat([o1, o2], 1) - o).abs().max().item() < CHUNK_F64
    assert max_err(s2, s) < CHUNK_F64


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_model_has_a_chunk_form_or_a_reason(name):
    x = fw.example_inputs(name, seq_len=5)
    if "chunk" in fw.forms(name):
        o, _ = fw.chunk(name, **x)
        assert o.shape == x["v"].shape[:2] + o.shape[2:] and torch.isfinite(o).all()
    else:
        with pytest.raises(fw.FormNotAvailable, match="available forms: recurrent, parallel"):
            fw.chunk(name, **x)


def test_bad_cu_seqlens_are_named():
    x = fw.example_inputs("gated_deltanet", batch_size=1, seq_len=10)
    for cu, msg in [(torch.tensor([0, 4, 9]), "end at T=10"), (torch.tensor([0.0, 10.0]), "integer"),
                    (torch.tensor([0, 6, 4, 10]), "non-decreasing")]:
        with pytest.raises(fw.InputError, match=msg):
            fw.chunk("gated_deltanet", cu_seqlens=cu, **x)
    x2 = fw.example_inputs("gated_deltanet", batch_size=2, seq_len=10)
    with pytest.raises(fw.InputError, match="batch must be 1"):
        fw.chunk("gated_deltanet", cu_seqlens=torch.tensor([0, 10]), **x2)
    with pytest.raises(fw.InputError, match=r"initial_state must have shape \[2, "):
        fw.chunk("gated_deltanet", cu_seqlens=torch.tensor([0, 3, 10]),
                 initial_state=torch.zeros(1, 2, 8, 8), **x)


@pytest.mark.parametrize("check_values", [True, False])
def test_cu_seqlens_on_the_meta_device_is_named(check_values):
    """Its boundaries are read on the host whatever check_values says: it was torch's raw NotImplementedError
    'Cannot copy out of meta tensor; no data!'."""
    x = fw.example_inputs("gated_deltanet", batch_size=1, seq_len=10)
    with pytest.raises(fw.InputError, match=r"^cu_seqlens is on the meta device .*give it on cpu or cuda \(its "
                                            r"boundaries are read on the host"):
        fw.chunk("gated_deltanet", cu_seqlens=torch.tensor([0, 4, 10], device="meta"), check_values=check_values, **x)


def test_compile_backend_matches_eager():
    inputs, state = make_case("gated_deltanet", T=20)
    inputs = {k: x.detach() for k, x in inputs.items()}
    o1, s1 = fw.chunk("gated_deltanet", initial_state=state.detach(), output_final_state=True, chunk_size=8,
                      **inputs)
    o2, s2 = fw.chunk("gated_deltanet", initial_state=state.detach(), output_final_state=True, chunk_size=8,
                      backend="compile", **inputs)
    assert (o1 - o2).abs().max().item() < CHUNK_F64 and (s1 - s2).abs().max().item() < CHUNK_F64
    with pytest.raises(fw.InputError, match="backend='compile' serves"):
        fw.chunk("mesanet", backend="compile", **fw.example_inputs("mesanet", seq_len=4))


@pytest.mark.parametrize("name", ["gated_deltanet", "gla", "deltaproduct", "mesanet", "linear_attention"])
def test_chunk_size_beyond_the_sequence_is_the_sequence_chunk(name):
    """chunk_size ≫ T (4096 and 2**40 at T = 20) computes exactly what the smallest power of two
    ≥ T does (bit for bit, outputs and final state), in about the time of a short call: before the
    layout bounded the chunk, 4096 took seconds and 2**40 tried to allocate terabytes."""
    import time

    inputs, state = make_case(name, T=20, dtype=torch.float32)
    n = zoo.get(name).optimizer.householder_steps
    o32, s32 = fw.chunk(name, initial_state=state, output_final_state=True, chunk_size=32 * n, **inputs)
    for chunk_size in (4096, 2**40):
        t0 = time.perf_counter()
        o, s = fw.chunk(name, initial_state=state, output_final_state=True, chunk_size=chunk_size, **inputs)
        assert time.perf_counter() - t0 < 2.0, f"chunk_size={chunk_size} at T=20 took too long"
        assert torch.equal(o, o32)
        assert max_err(s, s32) == 0.0
