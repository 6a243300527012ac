"""fastweights.kernels.triton (gated-linear chunk pipeline) against its torch twins and the exact
recurrence.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1
(tests/kernels/conftest.py) at tiny shapes, computing in fp32 and compared relative to the
float64 recurrence; the same checks at realistic shapes are marked `cuda` (`pytest -m cuda`).
Kernel outputs are NaN-poisoned (tests/conftest.py), so an element a kernel forgets to write fails.
Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights import Memory, Objective, Optimizer, Recipe, Retention
from fastweights.chunkwise import chunk_gated
from fastweights.chunkwise import common as twin
from fastweights.chunkwise.gated import gated_transitions, gated_writes
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.dispatch import DISPATCH, Target
from fastweights.inputs import InputError
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.gated import chunk_gated_triton
from fastweights.kernels.triton.stages.cumsum import chunk_cumsum
from fastweights.kernels.triton.stages.output import chunk_outputs
from fastweights.kernels.triton.stages.scores import decayed_scores
from fastweights.kernels.triton.stages.states import pass_states_fwd
from tests.kernels.helpers import DEV, check, chunk_rows_agree, each_sequence_alone, grads, rel, to_dev
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, F32, TRITON_LOW_REL

pytestmark = pytest.mark.triton

GATES = ["none", "scalar", "diagonal"]



def _recipe(gate: str) -> Recipe:
    return Recipe(name=f"gated_linear_{gate}", memory=Memory(kind="linear"), objective=Objective(kind="dot"),
                  optimizer=Optimizer(kind="gd"), retention=Retention(kind=gate))


def _inputs(gate, gen, *, B=2, T=37, H=2, Hq=None, K=12, V=10, N=None, g_scale=1.0, dtype=torch.float32):
    """q, k [B, T, H_q, K], v [B, T, H, V], β [B, T, H], g (none/scalar/diagonal) and S0 [N or B, H, K, V]."""
    Hq = H if Hq is None else Hq

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(B, T, Hq, K), "k": F.normalize(rnd(B, T, Hq, K), dim=-1), "v": rnd(B, T, H, V),
         "beta": torch.rand(B, T, H, generator=gen, dtype=torch.float64), "S0": 0.3 * rnd(N or B, H, K, V)}
    if gate != "none":
        x["g"] = g_scale * F.logsigmoid(rnd(*((B, T, H) if gate == "scalar" else (B, T, H, K))) + 1.0)
    return {key: val.to(dtype) for key, val in x.items()}






def _triton(x, *, scale=0.4, chunk_size=16, cu_seqlens=None):
    d = {key: val.to(DEV) for key, val in x.items()}
    return chunk_gated_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], scale=scale,
                              initial_state=d["S0"], output_final_state=True, chunk_size=chunk_size,
                              cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEV))


def _recurrent(gate):
    def run(x, *, scale=0.4):
        extra = {"g": x["g"]} if "g" in x else {}
        return fw.recurrent(_recipe(gate), x["q"], x["k"], x["v"], scale=scale, beta=x["beta"],
                            initial_state=x["S0"], output_final_state=True, **extra)
    return run






# ---------------------------------------------------------------------------- stages vs torch twins
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("gate", ["scalar", "diagonal"])
def test_cumsum_stage(gate, varlen, gen):
    lengths = [5, 0, 16, 1, 15]
    B, T = (1, sum(lengths)) if varlen else (2, 37)
    cu = torch.tensor([0] + lengths).cumsum(0) if varlen else None
    g = _inputs(gate, gen, B=B, T=T)["g"]
    L = make_layout(B, T, 2, 2, 12, 10, 16, None if cu is None else cu.to(DEV), DEV)
    lay = torch_layout(B, T, 16, cu)
    want = lay.from_chunks(twin.chunk_cumsum(lay.to_chunks(g)))
    assert rel(chunk_cumsum(g.to(DEV), L), want) < F32
    want_rev = lay.from_chunks(lay.to_chunks(g).flip(3).cumsum(3).flip(3))
    assert rel(chunk_cumsum(g.to(DEV), L, reverse=True), want_rev) < F32


@pytest.mark.parametrize("gate", GATES)
def test_scores_states_outputs_stages(gate, gen):
    """decayed_scores, pass_states and chunk_outputs against chunkwise/common.py and gated.py, at
    chunk 32 (two 16-row sub-blocks), grouped heads (H_q = 1, H = 2), strong decay (exponents
    down to ~−100 inside a chunk), varlen with an empty and a length-1 sequence."""
    lengths = [9, 0, 40, 1, 20]
    T, C, H, K, V = sum(lengths), 32, 2, 12, 10
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(gate, gen, B=1, T=T, H=H, Hq=1, N=len(lengths), g_scale=3.0)
    L = make_layout(1, T, H, 1, K, V, C, cu.to(DEV), DEV)
    lay = torch_layout(1, T, C, cu)
    d = to_dev(x)
    G = chunk_cumsum(d["g"], L) if gate != "none" else None
    A = decayed_scores(d["q"], d["k"], G, d["beta"], 0.4, L)
    h, ht = pass_states_fwd(d["k"], d["v"], G, d["beta"], d["S0"], L, output_final_state=True)
    o = chunk_outputs(d["q"], d["v"], G, A, h, 0.4, L)
    # the torch twins on the expanded heads
    qc = lay.to_chunks(x["q"].repeat_interleave(2, 2) * 0.4)
    kc = lay.to_chunks(x["k"].repeat_interleave(2, 2)) * lay.to_chunks(x["beta"]).unsqueeze(-1)
    vc = lay.to_chunks(x["v"])
    Gt = twin.chunk_cumsum(lay.to_chunks(x["g"])) if gate != "none" else None
    A_want = twin.decayed_scores(qc, kc, Gt, Gt, strict=False)
    kind = {"none": "none", "scalar": "scalar", "diagonal": "diagonal"}[gate]
    q_dec, k_dec, a = gated_transitions(qc, kc, Gt, kind)
    entering, final = twin.pass_states(lay, x["S0"], a, gated_writes(k_dec, vc))
    o_want = twin.chunk_outputs(lay, A_want @ vc, q_dec, entering, torch.float32)
    assert rel(A, lay.from_chunks(A_want)) < F32
    used = torch.cat([torch.arange(n0, n1) for n0, n1 in lay.ranges])  # the chunk slots sequences use
    assert rel(h[0, used].transpose(0, 1), entering[0]) < F32
    assert rel(ht, final) < F32
    assert rel(o, o_want) < F32


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64
    recurrence, relative; T around a multiple of the chunk (16) and a single token."""
    x = _inputs(gate, gen, B=2, T=T, H=1)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}")


@pytest.mark.variants
@pytest.mark.parametrize("gate", GATES)
def test_long_chunk_64(gate, gen):
    """T = 4·64 + 37 at the GPU's chunk size 64 (four 16-row sub-blocks per chunk, five chunks, the last
    partial), against the float64 recurrence: outputs, final state, every gradient."""
    x = _inputs(gate, gen, B=1, T=293, H=1)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, CHUNK_F32_REL, "T=293")


@pytest.mark.parametrize("gate", GATES)
def test_chunk_32_and_grouped_heads(gate, gen):
    """Chunk 32 (sub-blocks against earlier/later sub-blocks) and grouped heads H_q = 1 | H = 2: the
    q/k gradients sum over the group."""
    x = _inputs(gate, gen, B=1, T=50, H=2, Hq=1, g_scale=3.0)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=32), want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_varlen(gate, gen):
    """Packed sequences (with an empty and a length-1 one, and trailing empty ones as `Segments.build(max_documents=)`
    pads cu_seqlens) equal each sequence run alone by the recurrence: outputs, the final state of each (an empty
    sequence's: its initial state), and every gradient."""
    lengths = [7, 0, 33, 1, 16, 0, 0]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=1, N=len(lengths))
    seed = secrets.randbits(31)
    got = grads(_triton, x, seed, cu_seqlens=cu)
    rec = _recurrent(gate)

    alone = each_sequence_alone(rec, cu)

    want = grads(alone, {key: val.double() for key, val in x.items()}, seed)
    check(got, want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_chained_states(gate, gen):
    """Running [0, t) then [t, T) from the carried state equals one run (t not on a chunk boundary)."""
    x = _inputs(gate, gen, B=2, T=45, H=1)
    d = to_dev(x)
    kw = dict(scale=0.4, output_final_state=True, chunk_size=16)

    def run(a, b, S0):
        part = {key: val[:, a:b] for key, val in d.items() if key != "S0"}
        return chunk_gated_triton(part["q"], part["k"], part["v"], g=part.get("g"), beta=part["beta"],
                                  initial_state=S0, **kw)

    o, S = run(0, 45, d["S0"])
    o1, S1 = run(0, 21, d["S0"])
    o2, S2 = run(21, 45, S1)
    assert rel(torch.cat([o1, o2], dim=1), o) < CHUNK_F32_REL
    assert rel(S2, S) < CHUNK_F32_REL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", GATES)
def test_low_precision_inputs(gate, dtype, gen):
    """bf16/fp16 q, k, v, β, g, S0: o and every gradient come back in the input dtype, within
    TRITON_LOW_REL of the fp32 torch chunk form on the same rounded values. (Under the interpreter
    the bf16/fp16 tensor-core products are emulated by rounding the operands: util.mm.)"""
    x = _inputs(gate, gen, B=1, T=50, H=1, K=16, V=16, dtype=dtype)
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_gated(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                           initial_state=xd["S0"], output_final_state=True, chunk_size=16)

    got = grads(_triton, x, seed)
    assert got[0].dtype == dtype and all(got[2][name].dtype == dtype for name in got[2])
    check(got, grads(torch_run, x, seed), TRITON_LOW_REL[dtype], str(dtype))


def test_no_beta_no_state_no_final(gen):
    x = to_dev(_inputs("diagonal", gen, B=1, T=20, H=1))
    o, S = chunk_gated_triton(x["q"], x["k"], x["v"], g=x["g"], scale=None, chunk_size=16)
    o_want, _ = chunk_gated(x["q"].cpu(), x["k"].cpu(), x["v"].cpu(), g=x["g"].cpu(), scale=None, chunk_size=16)
    assert S is None and rel(o, o_want) < CHUNK_F32_REL


def test_chunk_size_beyond_the_sequence_is_the_sequence_chunk(gen):
    """chunk_size 4096 (and 2**40) at T = 20 runs the chunks of 64 (the Triton layout's floor, the power of
    two ≥ max(T, 64)), bit for bit: the kernels never get a block of 4096 rows."""
    x = _inputs("scalar", gen, B=1, T=20, H=2)
    o64, S64 = _triton(x, chunk_size=64)
    for chunk_size in (4096, 2**40):
        o, S = _triton(x, chunk_size=chunk_size)
        assert torch.equal(o, o64) and torch.equal(S, S64)


def test_bad_arguments(gen):
    x = to_dev(_inputs("scalar", gen, B=1, T=20, H=2))
    with pytest.raises(InputError, match="chunk_size"):
        chunk_gated_triton(x["q"], x["k"], x["v"], g=x["g"], scale=None, chunk_size=24)
    with pytest.raises(InputError, match="dtype"):
        chunk_gated_triton(x["q"].double(), x["k"].double(), x["v"].double(), scale=None)
    with pytest.raises(InputError, match="initial_state"):
        chunk_gated_triton(x["q"], x["k"], x["v"], scale=None, initial_state=x["S0"][:, :1])


# ---------------------------------------------------------------------------- the dispatch row
@pytest.mark.parametrize("model", ["gla", "mamba2", "retnet"])
def test_dispatch_row_matches_torch_backend(model, gen):
    """The triton row's fn on a validated Call (constant retention → per-head log γ, β defaults)
    gives the torch row's results; called directly because its predicate asks for CUDA."""
    chunk_rows_agree(model, gen, CHUNK_F32_REL)


def test_dispatch_predicate():
    sup = DISPATCH[("gated_linear", "chunk", "triton")].supports
    gla = fw.zoo.get("gla")
    assert sup(gla, Target.of("cuda", torch.bfloat16, 128, 128)) is None
    assert "CUDA" in sup(gla, Target.of("cpu", torch.float32, 64, 64))
    assert "float64" in sup(gla, Target.of("cuda", torch.float64, 64, 64))
    assert "256" in sup(gla, Target.of("cuda", torch.float32, 512, 64))
    assert "normalizer" in sup(fw.zoo.get("linear_attention"), Target.of("cuda", torch.float32, 64, 64)) or \
        "feature map" in sup(fw.zoo.get("linear_attention"), Target.of("cuda", torch.float32, 64, 64))
    assert "triton" in fw.backends("gla", device="cuda", dtype=torch.bfloat16, head_dim=128, head_v_dim=128)
    assert "triton" not in fw.backends("gla")


# ---------------------------------------------------------------------------- realistic shapes (GPU)
CUDA_SIZES = [(2, 1024, 4, 64), (4, 4096, 16, 128), (3, 1000, 8, 128), (1, 4096, 4, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", CUDA_SIZES, ids=lambda s: "B{}-T{}-H{}-D{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_realistic(gate, size, dtype, gen):
    """On the GPU (Hopper + Triton 3.6 is where miscompiles hide): the kernels against the fp32
    torch chunk form at realistic shapes, outputs, final states and every gradient; bf16 inputs
    against the fp32 torch result on the same rounded values."""
    B, T, H, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_gated(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                           initial_state=xd["S0"], output_final_state=True, chunk_size=64)

    want = grads(torch_run, to_dev(x), seed)
    got = grads(_triton, x, seed, chunk_size=64)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_LOW_REL[dtype]
    check(got, want, tol, f"{size} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_varlen_realistic(gate, gen):
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=8, K=128, V=128, N=len(lengths))
    seed = secrets.randbits(31)

    def torch_run(xd):
        return chunk_gated(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                           initial_state=xd["S0"], output_final_state=True, chunk_size=64, cu_seqlens=cu.to(DEV))

    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu), grads(torch_run, to_dev(x), seed),
           CHUNK_LONG_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_varlen_graph_capture(gate, gen):
    """A varlen forward is captured in a CUDA graph (the chunk index is built on the device, no host
    synchronization) and its replay on new values equals an eager call."""
    lengths = [300, 0, 1, 64, 191]
    cu = (torch.tensor([0] + lengths).cumsum(0).to(torch.int32)).to(DEV)
    x = to_dev(_inputs(gate, gen, B=1, T=sum(lengths), H=4, K=64, V=64, N=len(lengths), dtype=torch.bfloat16))

    def run():
        return chunk_gated_triton(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], scale=0.4,
                                  initial_state=x["S0"], output_final_state=True, chunk_size=64, cu_seqlens=cu)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, S_graph = run()
    fresh = to_dev(_inputs(gate, gen, B=1, T=sum(lengths), H=4, K=64, V=64, N=len(lengths), dtype=torch.bfloat16))
    for key in x:
        x[key].copy_(fresh[key])
    graph.replay()
    o, S = run()
    assert torch.equal(o_graph, o) and torch.equal(S_graph, S)


def test_auto_picks_triton_on_cuda_only():
    """"auto" resolves to the Triton rows for a CUDA target they serve, and to torch elsewhere."""
    from fastweights.dispatch import resolve_backend

    bf16 = Target.of("cuda", torch.bfloat16, 128, 128)
    assert resolve_backend(fw.zoo.get("gla"), "chunk", "auto", bf16) == "triton"
    assert resolve_backend(fw.zoo.get("gated_deltanet"), "recurrent", "auto", bf16) == "triton"
    assert resolve_backend(fw.zoo.get("gated_deltanet"), "chunk", "auto", bf16) == "triton"  # the delta chunk row
    assert resolve_backend(fw.zoo.get("comba"), "chunk", "auto", bf16) == "triton"  # probe key, decay after
    assert resolve_backend(fw.zoo.get("deltaproduct"), "chunk", "auto", bf16) == "triton"  # micro-steps
    assert resolve_backend(fw.zoo.get("gla"), "chunk", "auto", Target.of("cpu", torch.bfloat16, 128, 128)) == "torch"
    assert resolve_backend(fw.zoo.get("comba"), "recurrent", "auto", bf16) == "torch"
