"""kernels.triton.memories.ttt_linear_sliced (TTT-Linear's sequential passes with the value columns sliced over
programs, one launch a mini-batch each way; util.LAUNCH["ttt_linear_sliced"]["ON"]: 3 by default — sliced where
sequences × heads ≤ MAX_BH while the call is captured into a CUDA graph (eager they measured slower) —, 2 where
sequences × heads ≤ MAX_BH) against the torch twin `ttt_linear_torch` (chunkwise.minibatch, float64), the float64
recurrence and the one-program kernels: outputs, final weights and anchor, and every gradient — q, k, v, the inner
learning rates β, γ, β_ln, the initial weights and anchor; lengths that are no multiple of the mini-batch, a carried
mini-batch, chained calls, varlen with an empty and a length-1 sequence, grouped heads, a padded head dim with a partial
slice, one slice and several, more slices asked for than 16-wide columns allow, fp32, bf16 and fp16 inputs; the reverse
pass sliced or not (BWD).

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes (D = 16, 20, 32 and 64, T ≤ 41); kernel
outputs are NaN-poisoned (tests/conftest.py). Fresh random inputs every run; the seed is printed."""

from __future__ import annotations

import pytest
import torch

import fastweights as fw
from fastweights.kernels import variants as V
from fastweights.kernels.triton.common.util import LAUNCH
from fastweights.kernels.triton.memories import ttt as mod
from fastweights.kernels.triton.memories import ttt_linear_sliced as sliced
from tests.kernels.helpers import rel
from tests.kernels.memories import test_triton_ttt as one
from tests.kernels.memories.test_triton_ttt import _agree, _fp32, _inputs, _kernel, _recurrence, _run, _twin
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, TTT_LOW_REL

pytestmark = pytest.mark.triton


def _seed(gen):
    return int(torch.randint(0, 2**31, (), generator=gen))


class Launches(list):
    """The forward's step launches [(PRO, grid)]; `.chain`: the backward's chain launches (s of each, in order)."""

    def __init__(self):
        super().__init__()
        self.chain = []


@pytest.fixture
def steps(monkeypatch):
    """The sliced passes on (NP from each test), their launches counted; the one-program passes must not run."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    seen = Launches()
    real, chain = sliced._step_kernel.run, sliced._chain_kernel.run
    monkeypatch.setattr(sliced._step_kernel, "run",
                        lambda *a, **kw: seen.append((kw["PRO"], tuple(kw["grid"]))) or real(*a, **kw))
    monkeypatch.setattr(sliced._chain_kernel, "run", lambda *a, **kw: seen.chain.append(a[-7]) or chain(*a, **kw))
    monkeypatch.setattr(mod._state_kernel, "run", lambda *a, **kw: pytest.fail("the one-program state pass ran"))
    monkeypatch.setattr(mod._bwd_kernel, "run", lambda *a, **kw: pytest.fail("the one-program reverse pass ran"))
    monkeypatch.setattr(mod._bwd_carry_kernel, "run", lambda *a, **kw: pytest.fail("the one-program reverse pass ran"))
    monkeypatch.setattr(mod._bwd_chain_kernel, "run", lambda *a, **kw: pytest.fail("the one-program reverse pass ran"))
    return seen


def test_the_slices():
    """(programs, columns each): powers of two, every slice ≥ 16 columns; NP beyond that is cut."""
    assert sliced.slices(128, 4) == (4, 32)
    assert sliced.slices(128, 8) == (8, 16)
    assert sliced.slices(128, 16) == (8, 16)
    assert sliced.slices(128, 3) == (2, 64)
    assert sliced.slices(64, 8) == (4, 16)
    assert sliced.slices(32, 2) == (2, 16)
    assert sliced.slices(16, 4) == (1, 16)
    assert sliced.slices(128, 1) == (1, 128)
    assert sliced.slices(128, 0) == (1, 128)


def test_the_rule_that_picks_the_sliced_kernels(monkeypatch):
    """ON 3 (the default: sliced only where sequences × heads ≤ MAX_BH, 32, and the call is being captured into a CUDA
    graph — eager, the per-mini-batch launches lose, util.LAUNCH's note); ON 0 never; ON 2: sliced when sequences ×
    heads ≤ MAX_BH; 1 always; the name the variant gives, conditional where a fact is unknown; another ON refused."""
    assert (LAUNCH["ttt_linear_sliced"]["ON"], LAUNCH["ttt_linear_sliced"]["MAX_BH"]) == (3, 32)
    assert V.ttt_linear(4, 8, LAUNCH, captured=True).sliced and V.ttt_linear(1, 1, LAUNCH, captured=True).sliced
    assert not V.ttt_linear(4, 8, LAUNCH, captured=False).sliced and not V.ttt_linear(4, 16, LAUNCH, True).sliced
    assert str(V.ttt_linear(4, 8, LAUNCH, captured=True).variant) == "TTT-Linear: sliced NP 4"
    assert str(V.ttt_linear(4, 8, LAUNCH, captured=False).variant) == "TTT-Linear: one program"
    assert str(V.ttt_linear(4, 16, LAUNCH).variant) == "TTT-Linear: one program"  # above MAX_BH: capture or not
    for unknown in (V.ttt_linear(4, 8, LAUNCH), V.ttt_linear(None, 8, LAUNCH, captured=True)):
        assert str(unknown.variant) == \
            "TTT-Linear: sliced NP 4 where sequences × heads ≤ 32 in a CUDA graph, else one program"
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 0)
    assert not V.ttt_linear(1, 1, LAUNCH, captured=True).sliced and str(V.ttt_linear(None, 4, LAUNCH).variant) == \
        "TTT-Linear: one program"
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 2)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "MAX_BH", 64)
    assert V.ttt_linear(4, 16, LAUNCH).sliced and V.ttt_linear(1, 1, LAUNCH, captured=False).sliced
    assert not V.ttt_linear(64, 2, LAUNCH).sliced and not V.ttt_linear(5, 13, LAUNCH).sliced
    assert str(V.ttt_linear(4, 16, LAUNCH).variant) == "TTT-Linear: sliced NP 4"
    assert str(V.ttt_linear(64, 4, LAUNCH).variant) == "TTT-Linear: one program"
    assert str(V.ttt_linear(None, 4, LAUNCH).variant) == \
        "TTT-Linear: sliced NP 4 where sequences × heads ≤ 64, else one program"
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "BWD", 0)
    assert str(V.ttt_linear(1, 1, LAUNCH).variant) == "TTT-Linear: sliced NP 4 forward, one-program backward"
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    assert V.ttt_linear(64, 4, LAUNCH).sliced
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 4)
    with pytest.raises(ValueError, match="ttt_linear_sliced"):
        V.ttt_linear(1, 1, LAUNCH)


#: TTT-Linear's reverse-pass variant under the default table (POST 2, DIRECT 1)
BACKWARD = "TTT-Linear backward: chain only, dk's products after (G bf16 with bf16 inputs); dtypes in the kernels"


def test_the_pipeline_names_the_variant(monkeypatch):
    """`fw.pipeline(..., variants=True)` of TTT-Linear on the Triton row names the default's rule (the one-program
    passes above MAX_BH; below it conditional on a CUDA graph's capture, which the query does not know), and under
    ON 2 the sliced passes' rule: conditional without the call's sequences × heads, else what it picks."""
    ttt = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, variants=True)
    bwd = BACKWARD  # the reverse pass's variant after the passes' (`variants.ttt_linear_backward`)
    assert fw.pipeline("ttt_linear", **ttt, batch_size=4, num_heads=16)[2] == ("TTT-Linear: one program", bwd)
    assert fw.pipeline("ttt_linear", **ttt, batch_size=4, num_heads=8)[2] == (
        "TTT-Linear: sliced NP 4 where sequences × heads ≤ 32 in a CUDA graph, else one program", bwd)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 2)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "MAX_BH", 64)
    assert fw.pipeline("ttt_linear", **ttt) == ("triton", "TTT-Linear kernels (tf32)", (
        "TTT-Linear: sliced NP 4 where sequences × heads ≤ 64, else one program", bwd))
    assert fw.pipeline("ttt_linear", **ttt, batch_size=4, num_heads=16)[2] == (
        "TTT-Linear: sliced NP 4", "TTT-Linear backward: sliced reverse pass; dtypes in the kernels")
    assert fw.pipeline("ttt_linear", **ttt, batch_size=64, num_heads=2)[2] == ("TTT-Linear: one program", bwd)


def test_the_default_runs_what_the_rule_picks(monkeypatch, gen):
    """The auto rule (ON 2) on a call: with MAX_BH 2, B 1 × H 2 runs the sliced passes forward and backward and
    B 3 × H 2 the one-program ones, each held to the float64 twin (outputs, final state, every gradient)."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 2)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "MAX_BH", 2)
    ran = []
    for kern, name in ((sliced._step_kernel, "sliced"), (sliced._chain_kernel, "sliced_bwd"),
                       (mod._state_kernel, "one"), (mod._bwd_chain_kernel, "one_bwd")):
        monkeypatch.setattr(kern, "run", (lambda real, n: lambda *a, **kw: ran.append(n) or real(*a, **kw))(
            kern.run, name))
    for B, want in ((1, {"sliced", "sliced_bwd"}), (3, {"one", "one_bwd"})):
        ran.clear()
        x = _inputs(gen, B=B, T=19, Hq=2)
        seed = _seed(gen)
        got = _run(_kernel, _fp32(x), 0, seed)
        assert set(ran) == want, (B, ran)
        _agree(got, _run(_twin, x, 0, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("T, offset, Hq, D, NP", [(37, 0, 1, 32, 2), (41, 5, 2, 64, 4), (16, 0, 2, 32, 4),
                                                  (3, 9, 1, 16, 4), (11, 5, 1, 64, 2), (29, 0, 1, 64, 1)])
def test_sliced_passes_equal_the_twin_and_the_recurrence(monkeypatch, steps, gen, T, offset, Hq, D, NP):
    """fp32 against float64: T = 37 and 41 (no multiple of 16), 16 (one whole mini-batch), 3 inside a carried
    mini-batch (offset 9: the call ends mid-batch), 11 completing a carried one (offset 5); D 32 over 2 slices, D 64
    over 4 and 2, D 32 with 4 asked (2: 16 columns each), D 16 (1 slice), one slice of 64. The launches: step 0, then
    one a mini-batch forward; one a mini-batch and a last one backward (s from the last mini-batch down to −1)."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", NP)
    x = _inputs(gen, T=T, Hq=Hq, D=D)
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), offset, seed)
    ns = -(-(offset + T) // 16)
    programs = sliced.slices(D, NP)[0]
    assert steps == [(True, (2, programs))] + [(False, (2, programs))] * ns
    assert steps.chain == list(range(ns - 1, -2, -1))
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, _run(_recurrence, x, offset, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("bwd", [0, 1])
def test_sliced_passes_equal_the_one_program_passes(monkeypatch, gen, bwd):
    """The same call (B 2, grouped heads, offset 5, T 41, D 32) on the one-program passes and on the sliced forward
    with (BWD 1) or without (BWD 0: the one-program reverse pass, reading the same anchors) the sliced reverse pass:
    outputs, final state and every gradient within fp32's rounding of each other."""
    x = _fp32(_inputs(gen, B=2, T=41, Hq=1, D=32))
    seed = _seed(gen)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 0)
    want = _run(_kernel, x, 5, seed)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", 2)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "BWD", bwd)
    ran = []
    real = mod._bwd_chain_kernel.run  # (the one-program reverse pass: POST 2, the default)
    monkeypatch.setattr(mod._bwd_chain_kernel, "run", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    monkeypatch.setattr(mod._state_kernel, "run", lambda *a, **kw: pytest.fail("the one-program state pass ran"))
    _agree(_run(_kernel, x, 5, seed), want, CHUNK_F32_REL)
    assert ran == ([] if bwd else [1])


def test_a_padded_head_dim_a_partial_slice_a_longer_mini_batch_and_no_grad(monkeypatch, steps, gen):
    """D = 20 (a 32-wide tile in 2 slices of 16: the second holds 4 real columns, and the LayerNorm's row sums must
    see only the D real ones), b = 32, offset 7; without gradients the forward returns the same."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", 2)
    x = _inputs(gen, T=41, Hq=2, D=20)
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), 7, seed, b=32)
    _agree(got, _run(_twin, x, 7, seed, b=32), CHUNK_F32_REL)
    assert steps[0] == (True, (2, 2))
    with torch.no_grad():
        o, weights, anchor, _ = _kernel(_fp32(x), 7, b=32)
    for a, b in zip((o, *weights, *anchor), got[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(monkeypatch, steps, gen, dtype):
    """bf16 / fp16 q, k, v against the float64 twin on the same rounded values (D 32 in 2 slices)."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", 2)
    x = _inputs(gen, T=37, Hq=1, D=32)
    x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), 5, seed, dtype=dtype)
    assert got[0][0].dtype == dtype
    _agree(got, _run(_twin, x, 5, seed), TTT_LOW_REL[dtype])


def test_chained_calls_equal_one_call(steps, gen):
    """The one-program tests' chain (21 + 20 tokens, the second call continuing the first's mini-batch at offset 5)
    on the sliced passes (D 16: one slice of the 4 asked — the exchange still runs through the buffer)."""
    one.test_chained_calls_equal_one_call(gen)
    assert steps and steps.chain


def test_chained_calls_with_two_slices(monkeypatch, steps, gen):
    """The same chain at D 32 over 2 slices."""
    x = _inputs(gen, T=41, Hq=1, D=32)
    seed = _seed(gen)

    def chained(leaves, offset, b):
        first = {n: (v[:, :21] if n in ("q", "k", "v", "beta") else v) for n, v in leaves.items()}
        o1, w1, a1, off1 = _kernel(first, offset, b)
        second = {n: (v[:, 21:] if n in ("q", "k", "v", "beta") else v) for n, v in leaves.items()}
        second.update(W=w1[0], b=w1[1], A=a1[0], a=a1[1])
        o2, w2, a2, off2 = _kernel(second, off1, b)
        return torch.cat([o1, o2], dim=1), w2, a2, off2

    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", 2)
    _agree(_run(chained, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)
    assert steps[0][1] == (2, 2)


@pytest.mark.parametrize("offset", [0, 5])
def test_varlen_equals_each_sequence_alone(steps, gen, offset):
    """The one-program tests' varlen case (5 packed sequences: an empty one, a length-1 one, one of exactly 16, one
    past a mini-batch; offsets 0 and 5) on the sliced passes: every sequence's own number of mini-batches, the
    launches as many as the longest's."""
    one.test_varlen_equals_each_sequence_alone(gen, offset)
    ns = -(-(offset + 37) // 16)
    assert len(steps) == ns + 1 and steps.chain == list(range(ns - 1, -2, -1))


@pytest.mark.parametrize("offset", [0, 5])
def test_varlen_with_two_slices(monkeypatch, steps, gen, offset):
    """Varlen at D 32 over 2 slices (the one-program case's sequences, grouped heads H_q 1 → H 2)."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", 2)
    one.varlen_agrees(gen, offset, D=32)


def test_the_persistent_launch_needs_a_gpu(monkeypatch, gen):
    """SYNC 1 (one persistent launch a pass, the slices meeting at a global-memory count) is refused under the
    interpreter, which runs one program at a time (they would wait for ever); with one slice it is the plain
    launches."""
    from fastweights.inputs import InputError

    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "SYNC", 1)
    x = _fp32(_inputs(gen, T=19, Hq=1, D=32))
    with pytest.raises(InputError, match="SYNC"):
        _kernel(x, 0)
    x = _inputs(gen, T=19, Hq=1, D=16)  # one slice of 16 columns: nothing to wait for
    seed = _seed(gen)
    _agree(_run(_kernel, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("NP", [2, 4, 8])
@pytest.mark.parametrize("size", [(2, 300, 2, 64, 0), (1, 1000, 3, 128, 7), (4, 515, 2, 32, 11),
                                  (4, 4096, 16, 128, 0)], ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
def test_cuda_persistent_launches(monkeypatch, gen, size, NP):
    """On the GPU: SYNC 1 (each pass one persistent launch) against the float64 twin, bf16 inputs, and at B 4, T 4096,
    H 16, D 128 (the LM shape: 64 × NP programs, every group resident) too. A hang here is a barrier that never
    completes: run under `timeout`. (Not run yet: written for the GPU session's `pytest -m cuda`.)"""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", NP)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "SYNC", 1)
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, D=D)
    x.update({n: x[n].to(torch.bfloat16).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), offset, seed, dtype=torch.bfloat16)
    _agree(got, _run(_twin, x, offset, seed), TTT_LOW_REL[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("NP", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(2, 300, 2, 64, 0), (1, 1000, 3, 128, 7), (4, 515, 2, 32, 11)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
def test_cuda_realistic(monkeypatch, gen, size, dtype, NP):
    """On the GPU: the sliced passes against the float64 twin at realistic shapes (the one-program tests' sizes),
    outputs, final state and every gradient. (Not run yet: written for the GPU session's `pytest -m cuda`.)"""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "NP", NP)
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, D=D)
    if dtype != torch.float32:
        x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), offset, seed, dtype=dtype)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TTT_LOW_REL[dtype]
    _agree(got, _run(_twin, x, offset, seed), tol)


def test_the_ttt_linear_row_names_the_passes_that_ran(monkeypatch, gen):
    """A MemoryMixer("ttt_linear") on the Triton row (the fake CUDA table, the kernels under the interpreter), ON 2 and
    MAX_BH 2: at batch 1 × 2 heads the sliced passes run both ways and the record, the repr and `fw.pipeline` for the
    same facts say "sliced NP 4"; at batch 2 the one-program passes run and all three say "one program"."""
    from fastweights.layers.mixer import MemoryMixer
    from tests.fake_cuda import FakeCuda
    from tests.kernels.test_variants import _spied

    FakeCuda(monkeypatch, kernels=True).install()
    ran = _spied(monkeypatch, {"sliced": sliced._step_kernel, "sliced backward": sliced._chain_kernel,
                               "one program": mod._state_kernel, "one-program backward": mod._bwd_chain_kernel})
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 2)
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "MAX_BH", 2)
    torch.manual_seed(0)
    layer = MemoryMixer(32, "ttt_linear", 2, head_dim=16, backend="triton", layer_ops="torch")
    sliced_bwd = "TTT-Linear backward: sliced reverse pass; dtypes in the kernels"  # (CARRY: the one-program pass's)
    for B, want, name, bwd in ((1, {"sliced", "sliced backward"}, "TTT-Linear: sliced NP 4", sliced_bwd),
                               (2, {"one program", "one-program backward"}, "TTT-Linear: one program", BACKWARD)):
        ran.clear()
        y, _ = layer(torch.randn(B, 5, 32, generator=gen))
        y.sum().backward()
        assert set(ran) == want, (B, ran)
        assert layer.variants["chunk"] == (name, bwd)
        assert name in repr(layer) and bwd in repr(layer)
        assert fw.pipeline("ttt_linear", device="cuda", dtype=torch.float32, head_dim=16, variants=True,
                           batch_size=B, num_heads=2)[2] == (name, bwd)


@pytest.mark.cuda
def test_cuda_graph_capture_runs_the_sliced_passes(monkeypatch, gen):
    """The default rule (ON 3) on the GPU: at B 2 × H 2 (≤ MAX_BH) an eager forward runs the one-program state pass
    and a forward captured into a CUDA graph the sliced one; the graph's replay, on new inputs copied into its static
    ones, equals the eager forward on those inputs (bf16 q, k, v; o and the final weights and anchor, within TTT_LOW_REL
    of each other: the two passes sum in other orders)."""
    assert LAUNCH["ttt_linear_sliced"]["ON"] == 3
    ran = []
    for name, kern in (("sliced", sliced._step_kernel), ("one program", mod._state_kernel)):
        monkeypatch.setattr(kern, "run", (lambda real, n: lambda *a, **kw: ran.append(n) or real(*a, **kw))(
            kern.run, name))

    def inputs():
        x = _fp32(_inputs(gen, B=2, T=300, Hq=2, H=2, D=64))
        return {n: (val.to(torch.bfloat16) if n in ("q", "k", "v") else val).cuda() for n, val in x.items()}

    static = inputs()
    with torch.no_grad():
        _kernel(static, 0)  # the warm-up (compiles) on the capturing stream's side, as torch.cuda.graphs asks
        torch.cuda.synchronize()
        assert set(ran) == {"one program"}
        ran.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (as training.graphed.capture)
            o, (W, bias), (A, a), _ = _kernel(static, 0)
        assert ran and set(ran) == {"sliced"}, ran
        fresh = inputs()
        for n in static:
            static[n].copy_(fresh[n])
        graph.replay()
        torch.cuda.synchronize()
        want = _kernel(fresh, 0)
    for name, got, ref in zip(("o", "W_T", "b_T", "anchor W", "anchor b"), (o, W, bias, A, a),
                              (want[0], *want[1], *want[2])):
        assert rel(got, ref) < TTT_LOW_REL[torch.bfloat16], f"{name}: {rel(got, ref):.3g}"
