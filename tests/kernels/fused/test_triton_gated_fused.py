"""The gated-linear class's fused pipeline (fastweights/kernels/triton/fused/gated_fused.py, selected by
`GatedPipeline("fused")`: no or scalar decay — linear attention, RetNet, Mamba2) against its torch twins
(`chunkwise.gated.chunk_gated`, `chunkwise.gated_bwd`), the staged pipeline and the float64 recurrence.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 at tiny shapes, in
fp32 against float64; the same checks at realistic shapes are marked `cuda`. Kernel outputs are NaN-poisoned
(tests/conftest.py). Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from fastweights.chunkwise import chunk_gated
from fastweights.chunkwise.gated_bwd import chunk_gated_bwd
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.inputs import InputError
from fastweights.kernels.pipelines import GatedPipeline, gated_fused_serves
from fastweights.kernels.triton import gated as gated_mod
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.fused import gated_fused
from fastweights.kernels.triton.gated import chunk_gated_triton
from tests.kernels.helpers import (
    DEV,
    check,
    compile_keys,
    each_sequence_alone,
    force_gated_pipeline,
    grads,
    rel,
    spy_launches,
    to_dev,
)
from tests.kernels.test_triton_gated import _inputs, _recurrent, _triton
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, EXACT_F64, F32, TRITON_LOW_REL

pytestmark = pytest.mark.triton

GATES = ["none", "scalar", "diagonal"]
KERNELS = ("_fwd_kernel", "_bwd_states_kernel", "_bwd_chunk_kernel")


@pytest.fixture
def fused(monkeypatch):
    """The fused pipeline for the test's calls where it serves them (the default may be either)."""
    force_gated_pipeline(monkeypatch, "fused")


@pytest.fixture
def launched(monkeypatch):
    """The names of the fused kernels launched (their `run` spied)."""
    return spy_launches(monkeypatch, gated_fused, KERNELS)


# ---------------------------------------------------------------------------- the backward's torch twin
@pytest.mark.parametrize("gate", ["none", "scalar", "diagonal"])
def test_backward_twin_is_autograd(gate, gen):
    """chunkwise.gated_bwd (the stages the fused backward mirrors) equals autograd through chunk_gated in
    float64: every gradient, the final state's gradient given, varlen with an empty and a length-1 sequence."""
    lengths = [7, 0, 20, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = {key: val.double().requires_grad_(True) for key, val in _inputs(gate, gen, B=1, T=sum(lengths), H=2, K=6,
                                                                         V=5, N=len(lengths), g_scale=3.0).items()}
    o, S = chunk_gated(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], scale=0.4, initial_state=x["S0"],
                       output_final_state=True, chunk_size=16, cu_seqlens=cu)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(S.shape, generator=gen, dtype=S.dtype)
    want = dict(zip(x, torch.autograd.grad((o * do).sum() + (S * dht).sum(), list(x.values()))))
    got = chunk_gated_bwd(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], scale=0.4, initial_state=x["S0"],
                          do=do, dht=dht, chunk_size=16, cu_seqlens=cu)
    for name in want:
        assert rel(got["initial_state" if name == "S0" else name], want[name]) < EXACT_F64, name


# ---------------------------------------------------------------------------- the kernels vs the torch twins
@pytest.mark.parametrize("gate,span", [(gate, "fast") for gate in GATES] + [("diagonal", "exact")])
def test_kernels_match_twins(gate, span, gen, monkeypatch):
    """Each kernel against its twin stage, fp32, chunk 32, grouped heads H_q = 1 | H = 2, strong decay (g_scale
    3), varlen with an empty and a length-1 sequence: the forward (o, the entering states h, the final state;
    and its states-only run), the reverse pass (dS_{n+1} of every chunk, dS_0) and the chunk kernel (dq, dk,
    dv, dg, dβ, fed the twin's states). The diagonal decay through both of its paths: the tensor-core one
    through the chunk's reference (SPAN 60: this decay spans less) and the exact elementwise one (SPAN 0)."""
    monkeypatch.setattr(gated_fused, "SPAN", 60.0 if span == "fast" else 0.0)
    lengths = [9, 0, 40, 1, 20] if span == "fast" else [9, 0, 35, 1]
    T, C, H, K, V = sum(lengths), 32, 2, (12 if span == "fast" else 8), 10
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(gate, gen, B=1, T=T, H=H, Hq=1, K=K, V=V, N=len(lengths), g_scale=1.0 if span == "fast" else 3.0)
    do = torch.randn(1, T, H, V, generator=gen)
    dht = torch.randn(len(lengths), H, K, V, generator=gen)
    L = make_layout(1, T, H, 1, K, V, C, cu.to(DEV), DEV)
    lay = torch_layout(1, T, C, cu)
    d = to_dev(x)
    g = d.get("g")
    o, h, ht = gated_fused.forward(d["q"], d["k"], d["v"], g, d["beta"], d["S0"], 0.4, L, store_states=True,
                                   output_final_state=True)
    _, h2, ht2 = gated_fused.forward(d["q"], d["k"], d["v"], g, d["beta"], d["S0"], 0.4, L, write_o=False,
                                     store_states=True, output_final_state=True)
    dh, dh0 = gated_fused.states_bwd(d["q"], g, do.to(DEV), dht.to(DEV), 0.4, L, need_dh0=True)
    # the twins, on the expanded heads
    xe = {key: (val.repeat_interleave(2, 2) if key in ("q", "k") else val) for key, val in x.items()}
    o_want, S_want = chunk_gated(xe["q"], xe["k"], xe["v"], g=xe.get("g"), beta=xe["beta"], scale=0.4,
                                 initial_state=xe["S0"], output_final_state=True, chunk_size=C, cu_seqlens=cu)
    tw = chunk_gated_bwd(xe["q"], xe["k"], xe["v"], g=xe.get("g"), beta=xe["beta"], scale=0.4, initial_state=xe["S0"],
                         do=do, dht=dht, chunk_size=C, cu_seqlens=cu)
    used = torch.cat([torch.arange(n0, n1) for n0, n1 in lay.ranges])  # the chunk slots sequences use
    assert rel(o, o_want) < F32 and rel(ht, S_want) < F32
    assert rel(h[0, used].transpose(0, 1), tw["entering"][0]) < F32
    assert torch.equal(h[0, used], h2[0, used]) and torch.equal(ht, ht2)  # the states-only run: bit for bit
    assert rel(dh[0, used].transpose(0, 1), tw["dleaving"][0]) < F32
    assert rel(dh0, tw["dS0"]) < F32
    # the chunk kernel from the twin's states (h, dh laid out per chunk slot as the kernels' arrays)
    h_in = torch.zeros_like(h)
    dh_in = torch.zeros_like(dh)
    h_in[0, used] = tw["entering"][0].transpose(0, 1).to(h_in)
    dh_in[0, used] = tw["dleaving"][0].transpose(0, 1).to(dh_in)
    dq, dk, dv, dg, dbeta = gated_fused.chunk_bwd(d["q"], d["k"], d["v"], g, d["beta"], h_in, dh_in, do.to(DEV), 0.4,
                                                  L)
    assert rel(dq.sum(2, keepdim=True), tw["q"].sum(2, keepdim=True)) < F32  # per value head, summed by the glue
    assert rel(dk.sum(2, keepdim=True), tw["k"].sum(2, keepdim=True)) < F32
    assert rel(dv, tw["v"]) < F32 and rel(dbeta, tw["beta"]) < F32
    if gate != "none":
        assert rel(dg, tw["g"]) < F32


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen, fused, launched):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64 recurrence, T
    around a multiple of the chunk (16) and a single token; the fused kernels ran (and no other)."""
    x = _inputs(gate, gen, B=2, T=T, H=1)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}")
    assert launched == list(KERNELS[:1] * 2 + KERNELS[1:])  # forward; recompute, reverse pass, chunk kernel


def test_diagonal_decay_beyond_the_span(gen, fused):
    """GLA with a decay of up to ≈ 200 nats inside a chunk of 16 (g_scale 40: far beyond SPAN, so every chunk
    takes the exact path, and far beyond e^{±88}): outputs, final state, every gradient against the float64
    recurrence, T = 37 — finite and exact where a single reference would overflow."""
    x = _inputs("diagonal", gen, B=1, T=37, H=1, g_scale=40.0)
    seed = secrets.randbits(31)
    want = grads(_recurrent("diagonal"), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, "g_scale 40")


@pytest.mark.parametrize("gate", GATES)
def test_chunk_64_grouped(gate, gen, fused):
    """The GPU's chunk 64, T = 130, grouped heads H_q = 1 | H = 2 (q/k gradients summed over the group)."""
    x = _inputs(gate, gen, B=1, T=130, H=2, Hq=1, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent_grouped(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, CHUNK_F32_REL, "C=64")


def _recurrent_grouped(gate):
    rec = _recurrent(gate)

    def run(x, **kw):
        rep = x["v"].shape[2] // x["q"].shape[2]
        return rec({**x, "q": x["q"].repeat_interleave(rep, 2), "k": x["k"].repeat_interleave(rep, 2)}, **kw)
    return run


@pytest.mark.parametrize("gate", GATES)
def test_varlen(gate, gen, fused):
    """Packed sequences (an empty and a length-1 one among them) equal each sequence alone (the recurrence):
    outputs, each final state, every gradient."""
    lengths = [7, 0, 33, 1, 16]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=1, N=len(lengths))
    seed = secrets.randbits(31)
    want = grads(each_sequence_alone(_recurrent(gate), cu), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, cu_seqlens=cu), want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_chained_states(gate, gen, fused):
    """[0, t) then [t, T) from the carried state equals one run (t not on a chunk boundary)."""
    d = to_dev(_inputs(gate, gen, B=2, T=45, H=1))
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


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs(gate, gen, fused):
    """bf16 q, k, v, β, g, S0: o and every gradient in bf16, within TRITON_LOW_REL of the fp32 torch chunk
    form on the same rounded values (the interpreter emulates the bf16 products: util.mm)."""
    x = _inputs(gate, gen, B=1, T=50, H=1, K=16, V=16, dtype=torch.bfloat16)
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_gated(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                           initial_state=xd["S0"], output_final_state=True, chunk_size=16)

    got = grads(_triton, x, seed)
    assert got[0].dtype == torch.bfloat16 and all(got[2][name].dtype == torch.bfloat16 for name in got[2])
    check(got, grads(torch_run, x, seed), TRITON_LOW_REL[torch.bfloat16], "bf16")


@pytest.mark.parametrize("gate", GATES)
def test_fused_equals_staged(gate, gen, monkeypatch):
    """The fused and the staged pipelines agree to fp32 rounding (outputs, gradients), with β = None, no
    initial state and no final state (the paths without them)."""
    x = _inputs(gate, gen, B=1, T=40, H=1)
    x.pop("beta")
    x.pop("S0")
    seed = secrets.randbits(31)

    def run(d, pipeline):
        d = to_dev(d)
        o, _ = chunk_gated_triton(d["q"], d["k"], d["v"], g=d.get("g"), scale=None, chunk_size=16,
                                  pipeline=GatedPipeline(pipeline))
        return o, torch.zeros(1), None

    got = grads(lambda d: run(d, "fused")[:2], x, seed)
    want = grads(lambda d: run(d, "staged")[:2], x, seed)
    check(got, want, F32)


def test_kept_states(gen, fused, monkeypatch):
    """recompute_states=False: the forward writes h for the backward (one more tensor kept, h's size) and the
    backward does not run the states-only forward — gradients bitwise those of the recompute."""
    x = _inputs("scalar", gen, B=2, T=37, H=1)
    seed = secrets.randbits(31)
    out = {}
    for recompute in (True, False):
        force_gated_pipeline(monkeypatch, "fused", recompute_states=recompute)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t, lambda t: t):
            out[recompute] = grads(_triton, x, seed)
        out[recompute, "kept"] = sorted(t.numel() for t in kept)
    for a, b in zip(out[True][2].values(), out[False][2].values()):
        assert torch.equal(a, b)
    gone = list(out[False, "kept"])
    for n in out[True, "kept"]:
        gone.remove(n)
    assert gone == [2 * 3 * 1 * 12 * 10]  # h [B, NT, H, K, V]


# ---------------------------------------------------------------------------- routing and the grid
def test_routing(gen, monkeypatch, launched):
    """GatedPipeline("fused") runs the fused kernels for every gate kind; on a GPU it serves K, V ≤
    GATED_FUSED_MAX_HEAD_DIM_CUDA only (`gated_fused_serves`; beyond, the fused forward refuses and asking for it
    raises); "staged" never runs the fused ones; anything else raises. The default (the rule): staged."""
    d = to_dev(_inputs("diagonal", gen, B=1, T=20, H=1))
    fused = GatedPipeline("fused")
    chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"], scale=None, chunk_size=16, pipeline=fused)
    assert launched == ["_fwd_kernel"]
    launched.clear()
    chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"][..., 0], scale=None, chunk_size=16, pipeline=fused)
    assert launched == ["_fwd_kernel"]
    launched.clear()
    chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"][..., 0], scale=None, chunk_size=16)
    assert launched == []
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert all(gated_fused_serves("cuda", 128, 128, gate=kind, dtype=f32) for kind in ("none", "scalar", "diagonal"))
    assert not gated_fused_serves("cuda", 256, 128, gate="diagonal", dtype=f32)
    # 16-bit inputs with no or a scalar decay: wrong outputs on an H200 (r4s7 call 4), refused on a GPU
    assert gated_fused_serves("cuda", 128, 128, gate="diagonal", dtype=bf16)
    assert not any(gated_fused_serves("cuda", 64, 64, gate=kind, dtype=dt) for kind in ("none", "scalar")
                   for dt in (bf16, f16))
    assert gated_fused_serves("cpu", 256, 256, gate="scalar", dtype=bf16)
    monkeypatch.setattr(gated_mod, "gated_fused_serves", lambda device_type, K, V, gate, dtype: False)
    with pytest.raises(InputError, match="fused gated-linear pipeline does not serve K=12, V=10, diagonal decay"):
        chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"], scale=None, chunk_size=16, pipeline=fused)
    if torch.cuda.is_available():
        x = to_dev(_inputs("scalar", gen, B=1, T=20, H=1, K=256, V=256))
        L = make_layout(1, 20, 1, 1, 256, 256, 64, None, DEV)
        with pytest.raises(InputError, match="K, V ≤"):
            gated_fused.forward(x["q"], x["k"], x["v"], x["g"], None, None, 0.1, L)
    launched.clear()
    chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"][..., 0], scale=None, chunk_size=16,
                       pipeline=GatedPipeline("staged"))
    assert launched == []
    with pytest.raises(ValueError, match="pipeline must be one of"):
        GatedPipeline("fast")
    with pytest.raises(InputError, match="pipeline must be a kernels.pipelines.GatedPipeline"):
        chunk_gated_triton(d["q"], d["k"], d["v"], g=d["g"][..., 0], scale=None, chunk_size=16, pipeline="fused")


def test_value_block_from_the_shapes_alone(monkeypatch):
    """BV halves from 64 while B·H·⌈V/BV⌉ (H·⌈V/BV⌉ with varlen) is under PROGRAMS = 132, down to MIN_BV (32 by
    default: BV 16, the H100's fault regime, only as a launch choice), ≤ 32 for K > 128, never above the V tile;
    with varlen never from the number of sequences or T."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "gated_fused_fwd": dict(util.LAUNCH["gated_fused_fwd"])})
    util.LAUNCH["gated_fused_fwd"].update(BV=64, PROGRAMS=132)
    assert util.LAUNCH["gated_fused_fwd"]["MIN_BV"] == 32

    def lay(B, T, H, K, V, cu=None):
        return make_layout(B, T, H, H, K, V, 64, cu, "cpu")

    vb = gated_fused.value_block
    assert vb(lay(4, 4096, 16, 128, 128)) == 32  # 64 rows: 128 programs at BV 64 < 132 → 256 at BV 32
    assert vb(lay(8, 4096, 16, 128, 128)) == 64
    assert vb(lay(1, 32768, 16, 128, 128)) == 32  # 16 rows: 64 programs at BV 32 (the floor)
    assert vb(lay(1, 4096, 4, 256, 256)) == 32  # K > 128: at most 32 (the d256 check's shape)
    assert vb(lay(1, 100, 2, 16, 16)) == 16  # a V tile of 16: narrower than the floor
    for cu in ([0, 5, 100], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100], [0, 100]):
        L = lay(1, 100, 16, 128, 128, torch.tensor(cu))
        assert vb(L) == 32
        assert gated_fused.fused_programs(L) == {"sequential": (len(cu) - 1) * 16 * 4, "chunk": L.NT * 16, "BV": 32}
    util.LAUNCH["gated_fused_fwd"]["MIN_BV"] = 16  # the rule before call 3's faults
    assert vb(lay(1, 32768, 16, 128, 128)) == 16 and vb(lay(1, 4096, 4, 256, 256)) == 16
    assert vb(lay(4, 4096, 16, 128, 128)) == 32


@pytest.mark.variants
def test_bv16_regime_of_the_fault(gen, fused, monkeypatch):
    """The launch regime of the H100's illegal memory access (B1 T32768 H16 D128, Mamba2: BV 16, eight V blocks per
    head, one sequence, hundreds of chunks), at the interpreter's size: MIN_BV 16 (the old rule's BV 16 at 16 rows:
    H = 2, PROGRAMS 32), K = V = 128, T = 4·64 + 37 (five chunks, the last partial), bf16 inputs, scalar decay and
    β as Mamba2 calls it, β prefetched as the launch table says (test_beta_prefetch_is_a_launch_choice holds the other
    choice bitwise equal) — outputs, final state and every gradient against the fp32 torch chunk form; the sequential
    grid is 8 V blocks × 2 heads."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "gated_fused_fwd": dict(util.LAUNCH["gated_fused_fwd"])})
    util.LAUNCH["gated_fused_fwd"].update(MIN_BV=16, PROGRAMS=32)
    L = make_layout(1, 293, 2, 2, 128, 128, 64, None, "cpu")
    assert gated_fused.fused_programs(L) == {"sequential": 16, "chunk": 10, "BV": 16}
    x = _inputs("scalar", gen, B=1, T=293, H=2, K=128, V=128, dtype=torch.bfloat16)
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_gated(xd["q"], xd["k"], xd["v"], g=xd["g"], beta=xd["beta"], scale=0.4, initial_state=xd["S0"],
                           output_final_state=True, chunk_size=64)

    want = grads(torch_run, x, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, TRITON_LOW_REL[torch.bfloat16], "BV 16")


@pytest.mark.variants
@pytest.mark.parametrize("gate", GATES)
def test_beta_prefetch_is_a_launch_choice(gate, gen, fused, monkeypatch):
    """LAUNCH["gated_fused_fwd"]["PREFETCH"] 1 (β of the next chunk loaded during this one) against 0: bitwise the
    same outputs, final states and gradients — varlen with an empty and a length-1 sequence, partial last chunks."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "gated_fused_fwd": dict(util.LAUNCH["gated_fused_fwd"])})
    lengths = [7, 0, 40, 1, 23]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=2, N=len(lengths))
    seed = secrets.randbits(31)
    out = {}
    for prefetch in (0, 1):
        util.LAUNCH["gated_fused_fwd"]["PREFETCH"] = prefetch
        out[prefetch] = grads(_triton, x, seed, cu_seqlens=cu)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    for name in out[0][2]:
        assert torch.equal(out[0][2][name], out[1][2][name]), name


def test_value_blocks_are_launch_choices(gen, fused, monkeypatch):
    """BV 16 vs 64 of the sequential kernels and of the chunk kernel at V = 40 (three partial V blocks vs one):
    the same outputs, final state and gradients to fp32 rounding."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, **{n: dict(util.LAUNCH[n]) for n in
                                                           ("gated_fused_fwd", "gated_fused_bwd_chunk")}})
    x = _inputs("scalar", gen, B=1, T=37, H=1, K=8, V=40)
    seed = secrets.randbits(31)
    out = {}
    for bv in (16, 64):
        util.LAUNCH["gated_fused_fwd"].update(BV=bv, PROGRAMS=1)
        util.LAUNCH["gated_fused_bwd_chunk"].update(BV=bv)
        out[bv] = grads(_triton, x, seed)
    check(out[16], out[64], F32)


@pytest.mark.variants
@pytest.mark.parametrize("gate", GATES)
def test_scores_kernel_is_a_launch_choice(gate, gen, fused, monkeypatch):
    """LAUNCH["gated_fused_fwd"]["AQK"] = 1 (the scores once per chunk by `_scores_kernel`, read by the forward)
    against 0 (recomputed per V block): the same outputs, final states and gradients, varlen with an empty and a
    length-1 sequence, three V blocks; the scores kernel ran."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "gated_fused_fwd": dict(util.LAUNCH["gated_fused_fwd"])})
    util.LAUNCH["gated_fused_fwd"].update(BV=16, PROGRAMS=1)
    lengths = [7, 0, 30, 1]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=1, K=8, V=40, N=len(lengths))
    seed = secrets.randbits(31)
    out, seen = {}, []
    run = gated_fused._scores_kernel.run
    monkeypatch.setattr(gated_fused._scores_kernel, "run", lambda *a, **kw: seen.append(1) or run(*a, **kw))
    for aqk in (0, 1):
        util.LAUNCH["gated_fused_fwd"]["AQK"] = aqk
        out[aqk] = grads(_triton, x, seed, cu_seqlens=cu)
    check(out[1], out[0], F32)
    assert seen == [1]


# ---------------------------------------------------------------------------- no recompile as the packing changes
_KEYS_BODY = r"""from fastweights.kernels.pipelines import GatedPipeline
from fastweights.kernels.triton.gated import chunk_gated_triton

dtype = getattr(torch, sys.argv[3])
gen = torch.Generator().manual_seed(0)
counts = []
for i in range(60):  # 20 packings of each gate kind
    gate = ("none", "scalar", "diagonal")[i // 20]
    lengths, T, cu = packing(gen, i % 20, 200)
    H, Hq, K, V = 2, 1, 32, 32
    q = torch.randn(1, T, Hq, K).to(dtype).requires_grad_(True)
    k = torch.randn(1, T, Hq, K).to(dtype).requires_grad_(True)
    v = torch.randn(1, T, H, V).to(dtype).requires_grad_(True)
    g = None if gate == "none" else (-torch.rand(1, T, H, *((K,) if gate == "diagonal" else ()))).requires_grad_(True)
    beta = torch.rand(1, T, H).requires_grad_(True)
    S0 = torch.randn(len(lengths), H, K, V).requires_grad_(True)
    o, S = chunk_gated_triton(q, k, v, g=g, beta=beta, scale=None, initial_state=S0, output_final_state=True,
                              chunk_size=64, cu_seqlens=cu, pipeline=GatedPipeline("fused"))
    (o.float().sum() + S.sum()).backward()
    counts.append(len(keys))
report(counts)
"""


@pytest.mark.variants
def test_varlen_packings_compile_once():
    """20 varlen batches of different packings (numbers of sequences, lengths, T = 1, T a multiple of 16 or
    not) ask Triton for no compile key after the first batch, forward and backward — for no decay, a scalar and
    a diagonal one. Under the interpreter nothing compiles, so this runs in a subprocess without it: a stand-in
    driver reports an sm_90 target, and Triton's `jit_cache_hook` records each launch's compile key and skips
    the compile."""
    out = compile_keys(_KEYS_BODY, "none", "bfloat16")
    counts = out["counts"]
    assert set(KERNELS) <= set(out["kernels"])
    assert counts[0] > 0 and counts[:20] == [counts[0]] * 20, counts  # no decay
    assert counts[20] > counts[0] and counts[20:40] == [counts[20]] * 20, counts  # scalar decay
    assert counts[40] > counts[20] and counts[40:] == [counts[40]] * 20, counts  # diagonal decay


# ---------------------------------------------------------------------------- realistic shapes (GPU)
CUDA_SIZES = [(2, 1024, 4, 4, 64), (4, 4096, 16, 16, 128), (3, 1000, 8, 4, 128), (1, 4096, 4, 4, 256),
              (1, 8192, 16, 16, 128)]


def _torch_run(xd, *, chunk_size=64, cu_seqlens=None):
    xd = {key: val.float() for key, val in xd.items()}
    rep = xd["v"].shape[2] // xd["q"].shape[2]
    return chunk_gated(xd["q"].repeat_interleave(rep, 2), xd["k"].repeat_interleave(rep, 2), xd["v"], g=xd.get("g"),
                       beta=xd["beta"], scale=0.4, initial_state=xd["S0"], output_final_state=True,
                       chunk_size=chunk_size, cu_seqlens=cu_seqlens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", CUDA_SIZES, ids=lambda s: "B{}-T{}-H{}-Hq{}-D{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_realistic(gate, size, dtype, gen, fused, launched):
    """On the GPU (Hopper + Triton 3.6: where miscompiles hide), the fused pipeline against the fp32 torch chunk
    form: outputs, final states, every gradient. Where `gated_fused_serves` refuses (K = V = 256; bf16 with no or a
    scalar decay) the call routes to the staged pipeline (checked the same) and asking for the fused one raises."""
    B, T, H, Hq, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_LOW_REL[dtype]
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed), tol, f"{size} {dtype}")
    serves = gated_fused_serves("cuda", D, D, gate=gate, dtype=dtype)
    assert bool(launched) == serves
    if not serves:
        with pytest.raises(InputError, match="fused gated-linear pipeline does not serve"):
            d = to_dev(x)
            chunk_gated_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], scale=0.4, chunk_size=64,
                               pipeline=GatedPipeline("fused"))


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_grouped_varlen(gate, gen, fused):
    """Varlen with an empty and a length-1 sequence, 16 value heads over 4 q/k heads, fp32."""
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, B=1, T=sum(lengths), H=16, Hq=4, K=128, V=128, N=len(lengths))
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu),
          grads(lambda d: _torch_run(d, cu_seqlens=cu.to(DEV)), to_dev(x), seed), CHUNK_LONG_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_long_bf16(gate, gen, fused):
    """T = 65,536 in bf16 (one sequence, 4 heads of 128): forward and every gradient (no and scalar decay route to
    the staged pipeline: `gated_fused_serves`)."""
    x = _inputs(gate, gen, B=1, T=65536, H=4, K=128, V=128, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed), TRITON_LOW_REL[torch.bfloat16],
          "T=65536")


@pytest.mark.cuda
def test_cuda_varlen_no_recompile(gen, fused):
    """20 packings, forward and backward: no fused kernel compiles after the first packing."""
    def compiled():
        return sum(len(c[0]) for name in KERNELS for c in getattr(gated_fused, name).device_caches.values())

    counts = []
    for i in range(20):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        lengths = torch.randint(0, 3000, (n,), generator=gen).tolist()
        lengths = [1] if i == 2 else ([64, 128] if i == 1 else lengths)
        T = max(1, sum(lengths))
        lengths[-1] += T - sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        # (diagonal: bf16 with no or a scalar decay is refused on a GPU, `gated_fused_serves`)
        x = _inputs("diagonal", gen, B=1, T=T, H=8, Hq=4, K=128, V=128, N=len(lengths), dtype=torch.bfloat16)
        grads(_triton, x, 1, chunk_size=64, cu_seqlens=cu)
        counts.append(compiled())
    assert counts[0] > 0 and counts == [counts[0]] * 20, counts


@pytest.mark.cuda
def test_cuda_graph_capture_varlen(gen, fused):
    """A varlen call (forward and backward) captured in a CUDA graph — no host sync inside — and replayed:
    bitwise the eager outputs and gradients. (Diagonal decay: with a scalar one, bf16 is refused on a GPU — this test
    hit an illegal memory access there on an H200, r4s7 call 4.)"""
    lengths = [300, 0, 1, 700, 23]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
    x = to_dev(_inputs("diagonal", gen, B=1, T=sum(lengths), H=4, Hq=2, K=64, V=64, N=len(lengths),
                       dtype=torch.bfloat16))
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    do = torch.randn(x["v"].shape, device="cuda").to(torch.bfloat16)

    def step():
        o, S = chunk_gated_triton(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"],
                                  scale=0.4, initial_state=leaves["S0"], output_final_state=True, chunk_size=64,
                                  cu_seqlens=cu)
        torch.autograd.backward([o, S], [do, torch.ones_like(S)])
        return o, S

    eager = [t.detach().clone() for t in step()]
    eager_g = {key: val.grad.detach().clone() for key, val in leaves.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for val in leaves.values():
                val.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    for val in leaves.values():
        val.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    for key in leaves:
        assert torch.equal(leaves[key].grad, eager_g[key]), key

