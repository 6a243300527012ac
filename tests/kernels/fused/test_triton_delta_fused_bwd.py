"""The delta class's fused backward (fastweights/kernels/triton/fused/delta_fused_bwd.py, selected by
`DeltaPipeline(backward="fused")`) against its torch twin (fastweights/chunkwise/delta_bwd.py, itself checked against
autograd in float64), the staged backward and the float64 recurrence: every gradient (q, k, v, g, β, S0), odd
lengths, varlen with empty and length-1 sequences, grouped heads, chained states, bf16, both forwards (and the
T-form forward, `LAUNCH["delta_prepass"]["WU"] = 0`), the routing of what it does not take to the staged
backward, and no recompile as the varlen packing changes.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 at tiny shapes;
the same checks at realistic shapes are marked `cuda`. Kernel outputs are NaN-poisoned (tests/conftest.py).
Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from fastweights.chunkwise import chunk_delta
from fastweights.chunkwise import common as twin
from fastweights.chunkwise.delta import block_unit_lower_inverse, delta_decays, delta_transitions, wy_representation
from fastweights.chunkwise.delta_bwd import delta_chunk_grads, delta_states_bwd
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.kernels.pipelines import FUSED_CHECKED_HEAD_DIMS_CUDA, DeltaPipeline, delta_pipeline
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.fused import delta_fused_bwd
from fastweights.kernels.triton.fused.delta_fused import fused_forward
from fastweights.kernels.triton.fused.delta_fused_bwd import fused_backward, recompute_states, value_block
from tests.kernels.fused.test_triton_delta_fused import _KEYS_BODY
from tests.kernels.helpers import (
    DEV,
    check,
    compile_keys,
    delta_bf16_agrees,
    delta_summand_scales,
    each_sequence_alone,
    force_delta_pipeline,
    grads,
    rel,
    spy_launches,
    to_dev,
)
from tests.kernels.helpers import delta_inputs as _inputs
from tests.kernels.helpers import delta_triton as _triton
from tests.kernels.test_triton_delta import _recurrent
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, F32, TRITON_DELTA_LOW_REL

pytestmark = pytest.mark.triton

GATES = ["none", "scalar"]
KERNELS = ("_states_kernel", "_reverse_kernel", "_grads_kernel")


@pytest.fixture
def fused(monkeypatch):
    """The fused forward and backward for the test's calls, where they take the call (the defaults may be
    either)."""
    force_delta_pipeline(monkeypatch, forward="fused", backward="fused")


@pytest.fixture
def launched(monkeypatch):
    """The names of the fused backward's kernels launched (their `run` spied)."""
    return spy_launches(monkeypatch, delta_fused_bwd, KERNELS)


def _staged_bwd(x, **kw):
    """The fused forward and the staged backward."""
    return _triton(x, pipeline=DeltaPipeline("fused", "staged"), **kw)


# ---------------------------------------------------------------------------- the kernels vs the torch twins
@pytest.mark.parametrize("gate, C, aqk, br, rowsums", [("none", 64, 0, 0, 0), ("scalar", 16, 1, 0, 0),
                                                       ("scalar", 64, 0, 16, 0), ("none", 32, 1, 16, 0),
                                                       ("scalar", 16, 0, 0, 1), ("none", 64, 1, 0, 1)])
def test_kernels_match_twins(gate, C, aqk, br, rowsums, gen, monkeypatch):
    """recompute_states (h, U) and fused_backward (dq, dk, dv, dβ, dg, dS_0) against the torch twins in float64 on
    the same T, dO and final-state gradient: varlen with an empty and a length-1 sequence, grouped heads
    H_q = 1 | H = 2, strong decay (g_scale 3), chunk 16 (one sequence spans 5 chunks), 32 and 64; Aqk recomputed in
    the reverse kernel (AQK 0) or handed over by the recompute (AQK 1); the gradient kernel one program a chunk
    (br 0) or each chunk's rows over C / 16 programs (br 16: `_grads_rows_kernel`, the chunks of 6, 9 and 1 rows
    with empty row blocks); the one-program kernel's rowsums against Q Kᵀ, K Qᵀ, K Kᵀ or against dq's and dk's own
    products (rowsums 1: LAUNCH["delta_fused_grads"]["ROWSUMS"])."""
    monkeypatch.setattr(util, "LAUNCH", {key: dict(val) for key, val in util.LAUNCH.items()})
    util.LAUNCH["delta_fused_rev"]["AQK"] = aqk
    util.LAUNCH["delta_fused_grads_rows"].update(ON=int(br > 0), BR=br or 16)
    util.LAUNCH["delta_fused_grads"]["ROWSUMS"] = rowsums
    lengths = [9, 0, 70, 1]
    T, H = sum(lengths), 2
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(gate, gen, T=T, H=H, Hq=1, K=12, V=10, N=len(lengths), g_scale=3.0)
    do = torch.randn(1, T, H, 10, generator=gen, dtype=torch.float64)
    dht = torch.randn(x["S0"].shape, generator=gen, dtype=torch.float64)
    d = to_dev(x)
    L = make_layout(1, T, H, 1, 12, 10, C, cu.to(DEV), DEV)
    assert delta_fused_bwd.grads_rows(L) == br
    _, Ti, _, _, _ = fused_forward(d["q"], d["k"], d["v"], d.get("g"), d["beta"], d["S0"], 0.4, L,
                                   output_final_state=False, store_states=False, store_T=True)
    h, u, A = recompute_states(d["q"], d["k"], d["v"], d.get("g"), d["beta"], Ti, d["S0"], 0.4, L)
    assert (A is not None) == bool(aqk)
    got = fused_backward(d["q"], d["k"], d["v"], d.get("g"), d["beta"], Ti, h, u, do.float().to(DEV),
                         dht.float().to(DEV), 0.4, L, need_dh0=True, A=A)
    # the twins, float64, q and k repeated per value head
    lay = torch_layout(1, T, C, cu)
    xd = {key: val.double() for key, val in x.items()}
    qc, kc = (lay.to_chunks(xd[key].repeat_interleave(H, 2)) for key in ("q", "k"))
    vc, bc = lay.to_chunks(xd["v"]), lay.to_chunks(xd["beta"])
    G = twin.chunk_cumsum(lay.to_chunks(xd["g"])) if gate == "scalar" else None
    q_dec, r_dec, k_dec, a = delta_decays(qc * 0.4, kc, kc, G, G, gate)
    Tw = block_unit_lower_inverse(twin.decayed_scores(kc, kc, G, G, strict=True) * bc[..., None])
    U1, W = wy_representation(Tw, vc, r_dec, bc)
    entering, _ = twin.pass_states(lay, xd["S0"], *delta_transitions(a, k_dec, W, U1))
    U = U1 - W @ entering
    used = torch.cat([torch.arange(n0, n1) for n0, n1 in lay.ranges])  # the chunk slots in use
    assert rel(h[0, used].transpose(0, 1), entering[0]) < F32
    assert rel(u, lay.from_chunks(U)) < F32
    doc = lay.to_chunks(do)
    dh, dS0, Y, dv, dbv = delta_states_bwd(lay, qc, kc, vc, bc, G, Tw, doc, dht, 0.4)
    dq, dk, dbeta, dg = delta_chunk_grads(qc, kc, bc, G, entering, dh, U, Y, doc, dbv, 0.4)
    fold = lambda t: lay.from_chunks(t).unflatten(2, (1, H)).sum(3)  # noqa: E731  (the group's sum)
    want = (fold(dq), fold(dk), lay.from_chunks(dv), None if G is None else lay.from_chunks(dg),
            lay.from_chunks(dbeta), dS0)
    for name, a_, b_ in zip(("dq", "dk", "dv", "dg", "dbeta", "dS0"), got, want):
        if b_ is None:
            assert a_ is None, name
        else:
            assert rel(a_, b_) < F32, name


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 63, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen, fused, launched):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64 recurrence, T
    around a multiple of the chunk (16), a single token in two batch rows (dβ relative to its summands' size,
    `delta_summand_scales`: there a token's two terms may cancel); the fused backward's kernels ran."""
    x = _inputs(gate, gen, B=2 if T == 1 else 1, T=T, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}", scales=delta_summand_scales(x, seed, want))
    assert launched == list(KERNELS)


@pytest.mark.parametrize("gate", ["scalar"])
def test_varlen_grouped(gate, gen, fused):
    """Packed sequences (an empty and a length-1 one among them), grouped heads H_q = 1 | H = 2, chunk 64: equal
    to each sequence alone (the recurrence): outputs, each final state, every gradient."""
    lengths = [7, 0, 70, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=2, Hq=1, K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    xd = {key: val.double() for key, val in x.items()}
    xd["q"], xd["k"] = xd["q"].repeat_interleave(2, 2), xd["k"].repeat_interleave(2, 2)
    o, S, want = grads(each_sequence_alone(_recurrent(gate), cu), xd, seed)
    want = {key: (val.unflatten(2, (1, 2)).sum(3) if key in ("q", "k") else val) for key, val in want.items()}
    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu), (o, S, want), CHUNK_F32_REL)


def _chained(d, chunk_size):
    """The kernels on [0, 19) then [19, 37) from d's state S0, the first part's final state carried:
    (o [B, 37, H, V], final state)."""
    kw = dict(scale=0.4, output_final_state=True, chunk_size=chunk_size)
    parts = [{key: val[:, a:b] for key, val in d.items() if key != "S0"} for a, b in ((0, 19), (19, 37))]
    o1, S1 = chunk_delta_triton(**{k_: parts[0][k_] for k_ in ("q", "k", "v")}, g=parts[0].get("g"),
                                beta=parts[0]["beta"], initial_state=d["S0"], **kw)
    o2, S2 = chunk_delta_triton(**{k_: parts[1][k_] for k_ in ("q", "k", "v")}, g=parts[1].get("g"),
                                beta=parts[1]["beta"], initial_state=S1, **kw)
    return torch.cat([o1, o2], dim=1), S2


@pytest.mark.parametrize("gate", ["scalar"])
def test_chained_states(gate, gen, fused):
    """[0, t) then [t, T) from the carried state equals one run, gradients included (the final state's gradient
    flows into the first part's backward; t not on a chunk boundary)."""
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)

    check(grads(lambda d: _chained(to_dev(d), 16), x, seed), grads(_triton, x, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs(gate, gen, fused):
    """bf16 q, k, v, β, g, S0: o and every gradient in bf16, within TRITON_DELTA_LOW_REL of the fp32 torch chunk
    form on the same rounded values (the interpreter emulates the bf16 products: util.mm)."""
    delta_bf16_agrees(gate, gen)


@pytest.mark.parametrize("gate, forward", [("none", "staged"), ("scalar", "fused")])
def test_fused_equals_staged(gate, forward, gen, monkeypatch):
    """The fused and the staged backward agree to fp32 rounding after either forward, grouped heads, β = None
    (dβ not asked for) and no initial state, chunk 32 over T = 50."""
    x = _inputs(gate, gen, B=2, T=50, H=2, Hq=1, K=8, V=8)
    x.pop("S0")
    x.pop("beta")
    seed = secrets.randbits(31)

    def run(d, bwd):
        d = to_dev(d)
        return chunk_delta_triton(d["q"], d["k"], d["v"], g=d.get("g"), scale=None, output_final_state=True,
                                  chunk_size=32, pipeline=DeltaPipeline(forward, bwd))

    out = {}
    for bwd in ("staged", "fused"):
        out[bwd] = grads(lambda d, bwd=bwd: run(d, bwd), x, seed)
    check(out["fused"], out["staged"], F32)


@pytest.mark.parametrize("gate", ["scalar"])
def test_kept_states_and_t_form_forward(gate, gen, fused, monkeypatch):
    """The backward on the states the forward kept (recompute_states=False), and the T-form forward (the
    pre-pass writes only T, LAUNCH["delta_prepass"]["WU"] = 0, each of the two), equal the default to fp32
    rounding: outputs, final states, every gradient."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "delta_prepass": dict(util.LAUNCH["delta_prepass"])})
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)
    base = grads(_triton, x, seed)
    for recompute, wu in ((False, 1), (True, 0), (False, 0)):
        force_delta_pipeline(monkeypatch, forward="fused", backward="fused", recompute_states=recompute)
        util.LAUNCH["delta_prepass"]["WU"] = wu
        check(grads(_triton, x, seed), base, F32, f"recompute {recompute}, WU {wu}")


@pytest.mark.variants
@pytest.mark.parametrize("gate", ["scalar"])
def test_value_blocks_are_launch_choices(gate, gen, fused, monkeypatch):
    """The sequential kernels' BV (16 vs 64 at V = 40: three partial value blocks vs one, so 3 vs 1 dβ parts), the
    gradient kernel's V tile (16 vs 64) and where Aqk comes from in the reverse kernel (handed over by the recompute,
    each chunk's by one of three programs, vs recomputed): the same gradients."""
    monkeypatch.setattr(util, "LAUNCH", {key: dict(val) for key, val in util.LAUNCH.items()})
    x = _inputs(gate, gen, T=37, K=8, V=40)
    seed = secrets.randbits(31)
    out = {}
    for bv, aqk in ((16, 1), (64, 0)):
        for site in ("delta_fused_rec", "delta_fused_rev"):
            util.LAUNCH[site].update(BV=bv, PROGRAMS=1)
        util.LAUNCH["delta_fused_rev"]["AQK"] = aqk
        util.LAUNCH["delta_fused_grads"]["BV"] = bv
        out[bv] = grads(_triton, x, seed)
    check(out[16], out[64], F32)


def test_value_block_from_the_shapes_alone(monkeypatch):
    """The backward's sequential grids (value_block): BV halves from 64 while B·H·⌈V/BV⌉ (H·⌈V/BV⌉ with varlen) is
    under PROGRAMS = 132, down to 16; with varlen never from the packing."""
    monkeypatch.setattr(util, "LAUNCH", {key: dict(val) for key, val in util.LAUNCH.items()})

    def lay(B, T, H, V, cu=None):
        return make_layout(B, T, H, H, 128, V, 64, cu, "cpu")

    assert value_block(lay(4, 4096, 16, 128), "delta_fused_rev") == 32  # 64 rows: 128 programs at 64 → 256 at 32
    assert value_block(lay(1, 32768, 32, 128), "delta_fused_rev") == 16
    assert value_block(lay(8, 4096, 16, 128), "delta_fused_rec") == 64
    for cu in ([0, 5, 100], [0, 1, 2, 3, 100]):
        assert value_block(lay(1, 100, 16, 128, torch.tensor(cu)), "delta_fused_rev") == 16


# ---------------------------------------------------------------------------- the gradient kernel's rows over programs
ROWS_KERNELS = ("_states_kernel", "_reverse_kernel", "_grads_rows_kernel")


@pytest.fixture
def rows(monkeypatch):
    """The gradient kernel with each chunk's rows over C / 16 programs (LAUNCH["delta_fused_grads_rows"]: ON 1, BR
    16) for the test's calls."""
    monkeypatch.setattr(util, "LAUNCH", {key: dict(val) for key, val in util.LAUNCH.items()})
    util.LAUNCH["delta_fused_grads_rows"].update(ON=1, BR=16)


@pytest.mark.parametrize("T, C", [(1, 32), (31, 32), (33, 32), (70, 64)])
@pytest.mark.parametrize("gate", GATES)
def test_rows_match_recurrence(gate, T, C, gen, fused, rows, monkeypatch):
    """With the rows over programs: outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the
    float64 recurrence (T around the chunk, a last chunk whose later row blocks are empty), and equal to the
    one-program kernel to fp32 rounding; `_grads_rows_kernel` ran, `_grads_kernel` not."""
    launched = spy_launches(monkeypatch, delta_fused_bwd, ROWS_KERNELS + ("_grads_kernel",))
    x = _inputs(gate, gen, B=2, T=T, K=8, V=8)
    seed = secrets.randbits(31)
    got = grads(_triton, x, seed, chunk_size=C)
    assert launched == list(ROWS_KERNELS)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(got, want, CHUNK_F32_REL, f"T={T}", scales=delta_summand_scales(x, seed, want))
    util.LAUNCH["delta_fused_grads_rows"]["ON"] = 0
    check(got, grads(_triton, x, seed, chunk_size=C), F32, "vs one program a chunk")


@pytest.mark.parametrize("gate", GATES)
def test_rowsums_match_recurrence(gate, gen, fused, monkeypatch):
    """The one-program kernel with ROWSUMS 1 (no Q Kᵀ, K Qᵀ, K Kᵀ products): every gradient in fp32 against the
    float64 recurrence (T 33, chunk 16, two batch rows), and equal to ROWSUMS 0 to fp32 rounding."""
    monkeypatch.setattr(util, "LAUNCH", {key: dict(val) for key, val in util.LAUNCH.items()})
    x = _inputs(gate, gen, B=2, T=33, K=8, V=8)
    seed = secrets.randbits(31)
    base = grads(_triton, x, seed)
    util.LAUNCH["delta_fused_grads"]["ROWSUMS"] = 1
    got = grads(_triton, x, seed)
    check(got, grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed), CHUNK_F32_REL)
    check(got, base, F32, "vs ROWSUMS 0")


@pytest.mark.parametrize("gate", GATES)
def test_rows_varlen_grouped(gate, gen, fused, rows):
    """With the rows over programs: packed sequences (an empty and a length-1 one among them; chunks of 1, 6, 7, 9
    rows: row blocks without a real row), grouped heads H_q = 1 | H = 2, chunk 64: equal to each sequence alone
    (the recurrence): outputs, each final state, every gradient."""
    lengths = [7, 0, 70, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=2, Hq=1, K=8, V=8, N=len(lengths), g_scale=3.0)
    seed = secrets.randbits(31)
    xd = {key: val.double() for key, val in x.items()}
    xd["q"], xd["k"] = xd["q"].repeat_interleave(2, 2), xd["k"].repeat_interleave(2, 2)
    o, S, want = grads(each_sequence_alone(_recurrent(gate), cu), xd, seed)
    want = {key: (val.unflatten(2, (1, 2)).sum(3) if key in ("q", "k") else val) for key, val in want.items()}
    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu), (o, S, want), CHUNK_F32_REL)


@pytest.mark.parametrize("gate", ["scalar"])
def test_rows_chained_states(gate, gen, fused, rows):
    """With the rows over programs: [0, 19) then [19, 37) from the carried state equals one run, gradients included
    (chunk 32: each part one chunk, its second row block partly real)."""
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)

    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(lambda d: _chained(to_dev(d), 32), x, seed), want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_rows_bf16_inputs(gate, gen, fused, rows):
    """With the rows over programs, bf16 inputs (chunk 32, T 45): o and every gradient in bf16 within
    TRITON_DELTA_LOW_REL of the fp32 torch chunk form on the same rounded values."""
    delta_bf16_agrees(gate, gen, T=45, chunk_size=32)


# ---------------------------------------------------------------------------- what runs where
def test_routing(gen, fused, launched, monkeypatch):
    """KDA (diagonal gate), Comba (probe key, decay after), K > 128 and a chunk of 128 run the staged backward
    (no fused kernel launched) and still match the fused forward's gradients' reference; DeltaProduct (its
    micro-steps interleaved) runs the fused one. The pipeline's fields are checked."""
    seed = secrets.randbits(31)
    _triton(_inputs("diagonal", gen, T=20, K=8, V=8))
    _triton(_inputs("scalar", gen, T=20, K=8, V=8, probe=True), decay_first=False)
    assert launched == []
    x = _inputs("scalar", gen, T=130, K=8, V=8)
    _triton(x, chunk_size=128)
    assert launched == []
    assert not delta_fused_bwd.supports(None, make_layout(1, 10, 1, 1, 256, 64, 64, None, "cpu"))
    x = _inputs("scalar", gen, T=21, K=8, V=8, n=2)
    check(grads(_triton, x, seed), grads(_staged_bwd, x, seed), F32)
    assert launched[:3] == list(KERNELS)
    with pytest.raises(ValueError, match="backward must be one of"):
        _triton(_inputs("none", gen, T=5, K=8, V=8), pipeline=DeltaPipeline("fused", "fast"))


def test_auto_rule(gen, monkeypatch):
    """The rule (`kernels.pipelines.delta_pipeline`, the glue's default): bf16 with no or a scalar decay runs the
    fused forward and the fused backward; KDA the staged forward (its fused one lost on the H100) and the staged
    backward; fp32 inputs (not timed on the GPU) the staged ones."""
    from fastweights.kernels.triton.fused import delta_fused

    seen = []
    for mod, name in ((delta_fused, "_prepass_kernel"), (delta_fused_bwd, "_grads_kernel")):
        kernel = getattr(mod, name)

        def spy(*args, _run=kernel.run, _name=name, **kw):
            seen.append(_name)
            return _run(*args, **kw)

        monkeypatch.setattr(kernel, "run", spy)
    fused = ["_prepass_kernel", "_grads_kernel"]
    for gate, dtype, want in (("none", torch.bfloat16, fused), ("scalar", torch.bfloat16, fused),
                              ("diagonal", torch.bfloat16, []), ("scalar", torch.float32, [])):
        seen.clear()
        grads(_triton, _inputs(gate, gen, T=20, K=16, V=16, dtype=dtype), 1)
        assert seen == want, (gate, dtype)


def test_auto_on_a_gpu_only_at_the_checked_head_dims():
    """On a GPU "auto" takes the fused kernels only at head dims an H100 call has checked (K = V = 128 so far);
    the others stay staged until one does. (The predicate, with a stand-in CUDA tensor: no GPU needed.)"""

    def rule(K, V):
        return delta_pipeline(gate="scalar", probe=False, decay_first=True, device_type="cuda",
                              dtype=torch.bfloat16, K=K, V=V, C=64)

    assert rule(128, 128) == DeltaPipeline("fused", "fused")
    assert rule(128, 256) == DeltaPipeline("staged", "fused")  # the LM preset's value heads; V > the fused forward's
    for K, V in ((64, 64), (256, 128), (16, 16)):
        assert (rule(K, V).forward, rule(K, V).backward) == ("staged", "staged"), (K, V)


# ---------------------------------------------------------------------------- no recompile as the packing changes
@pytest.mark.variants
@pytest.mark.parametrize("gate", ["scalar"])
def test_varlen_packings_compile_once(gate):
    """20 varlen batches of different packings (test_triton_delta_fused's script, with the fused backward) ask
    Triton for no compile key after the first batch; the fused backward's kernels are among those keyed."""
    body = _KEYS_BODY.replace('BACKWARD = "staged" if gate == "diagonal" else "fused"', 'BACKWARD = "fused"')
    assert body != _KEYS_BODY
    out = compile_keys(body, gate, "bfloat16", "fused")
    counts = out["counts"]
    assert set(KERNELS) <= set(out["kernels"])
    assert counts[0] > 0 and counts == [counts[0]] * 20, counts


# ---------------------------------------------------------------------------- realistic shapes (GPU)
CUDA_SIZES = [(2, 1024, 4, 4, 64), (4, 4096, 16, 16, 128), (3, 1000, 8, 4, 128), (1, 8192, 32, 16, 128),
              (1, 4096, 4, 4, 256)]


def _torch_run(xd, *, chunk_size=64, cu_seqlens=None):
    xd = {key: val.float() for key, val in xd.items()}
    rep = xd["v"].shape[2] // xd["q"].shape[2]
    return chunk_delta(xd["q"].repeat_interleave(rep, 2), xd["k"].repeat_interleave(rep, 2), xd["v"], g=xd.get("g"),
                       beta=xd["beta"], scale=0.4, initial_state=xd["S0"], output_final_state=True,
                       chunk_size=chunk_size, cu_seqlens=cu_seqlens, inverse="solve")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", CUDA_SIZES, ids=lambda s: "B{}-T{}-H{}-Hq{}-D{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_realistic(gate, size, dtype, gen, monkeypatch):
    """On the GPU (Hopper + Triton 3.6), the default forward ("auto": fused for bf16, staged for fp32) and the fused
    backward against the fp32 torch chunk form: outputs, final states, every gradient (K = V = 256: routed to the
    staged forward and backward)."""
    force_delta_pipeline(monkeypatch, backward="fused")
    B, T, H, Hq, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed), tol, f"{size} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("size", [(4, 2048, 8, 8, 128, 256), (1, 5000, 8, 8, 128, 256), (2, 1000, 8, 4, 128, 256)],
                         ids=lambda s: "B{}-T{}-H{}-Hq{}-K{}-V{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
def test_cuda_head_dims(gate, size, dtype, gen, launched):
    """The head dims "auto" fuses beyond K = V = 128 (FUSED_CHECKED_HEAD_DIMS_CUDA: the LM preset's K 128, V 256),
    as "auto" runs them on the GPU (the fused backward's kernels launched), against the fp32 torch chunk form:
    outputs, final states, every gradient."""
    B, T, H, Hq, K, V = size
    assert (K, V) in FUSED_CHECKED_HEAD_DIMS_CUDA
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=K, V=V, dtype=dtype)
    seed = secrets.randbits(31)
    ours = grads(_triton, x, seed, chunk_size=64)
    assert set(launched) == set(KERNELS), launched
    check(ours, grads(_torch_run, to_dev(x), seed), TRITON_DELTA_LOW_REL[dtype], f"{size} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_grouped_varlen(gate, gen, fused):
    """Varlen with an empty and a length-1 sequence, 16 value heads over 4 q/k heads, fp32."""
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=16, Hq=4, K=128, V=128, N=len(lengths))
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu),
          grads(lambda d: _torch_run(d, cu_seqlens=cu.to(DEV)), to_dev(x), seed), CHUNK_LONG_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_long_bf16(gate, gen, fused):
    """T = 65,536 in bf16 (one sequence, 4 heads of 128): forward and every gradient."""
    x = _inputs(gate, gen, T=65536, H=4, K=128, V=128, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed),
          TRITON_DELTA_LOW_REL[torch.bfloat16], "T=65536")
