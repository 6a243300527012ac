"""The delta class's fused forward (fastweights/kernels/triton/fused/delta_fused.py, selected by
`DeltaPipeline(forward="fused")`) and its split forward (fused/delta_split.py, `DeltaPipeline(forward="split")`: the
tests taking the `form` fixture run both) against its torch twins (fastweights/chunkwise/delta.py, common.py), the
staged forward and the float64 recurrence; the backward is the staged one, fed by the fused forward.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 at tiny
shapes, in fp32 against float64; the same checks at realistic shapes are marked `cuda`. Kernel outputs
are NaN-poisoned (tests/conftest.py). Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from fastweights.chunkwise import chunk_delta
from fastweights.inputs import InputError
from fastweights.kernels.pipelines import DeltaPipeline
from fastweights.kernels.triton import delta as delta_mod
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.fused import delta_fused, delta_fused_bwd, delta_split
from fastweights.kernels.triton.fused.delta_fused import (
    FUSED_MAX_HEAD_DIM_CUDA,
    fused_forward,
    fused_programs,
    value_block,
)
from fastweights.kernels.triton.fused.delta_split import split_forward
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
    to_dev,
)
from tests.kernels.helpers import delta_inputs as _inputs
from tests.kernels.helpers import delta_triton as _triton
from tests.kernels.test_triton_delta import GATES, _recurrent, _Stages
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, F32, TRITON_DELTA_LOW_REL

pytestmark = pytest.mark.triton


@pytest.fixture
def fused(monkeypatch):
    """The fused forward for the test's calls (the default may be either; the backward the rule's)."""
    force_delta_pipeline(monkeypatch, forward="fused")


#: The fused forwards: one kernel walks the chunks and writes o ("fused"), or the states alone and a chunk-parallel
#: kernel o ("split")
FORMS = ["fused", "split"]


@pytest.fixture(params=FORMS)
def form(request, monkeypatch):
    """Each fused forward in turn for the test's calls (as `fused`); its name."""
    force_delta_pipeline(monkeypatch, forward=request.param)
    return request.param


#: The kernels each form launches, by gate ("none", "scalar": the backward's states kernel; "diagonal": the sequential
#: kernel with OUTPUT 0)
LAUNCHED = {("fused", gate): ["_prepass_kernel", "_fused_fwd_kernel"] for gate in GATES} | {
    ("split", gate): ["_prepass_kernel", "_fused_fwd_kernel" if gate == "diagonal" else "_states_kernel",
                      "_output_kernel"] for gate in GATES}


@pytest.fixture
def launched(monkeypatch):
    """The names of the fused forwards' kernels launched (their `run` spied)."""
    seen = []
    for mod, name in ((delta_fused, "_prepass_kernel"), (delta_fused, "_fused_fwd_kernel"),
                      (delta_fused_bwd, "_states_kernel"), (delta_split, "_output_kernel")):
        kernel = getattr(mod, name)

        def spy(*args, _run=kernel.run, _name=name, **kw):
            seen.append(_name)
            return _run(*args, **kw)

        monkeypatch.setattr(kernel, "run", spy)
    return seen


# ---------------------------------------------------------------------------- the kernels vs the torch twins
# (KDA's pre-pass reads P from the scores kernel, slow under the interpreter: its doubling code is the one the
# other gates run at every level, so it is checked at the fewest and the most levels)
@pytest.mark.parametrize("gate, C", [(gate, C) for gate in GATES for C in (16, 32, 64, 128)
                                     if gate != "diagonal" or C in (16, 128)])
def test_kernels_match_twins(gate, C, gen):
    """The pre-pass (the in-register inverse T at 1, 2, 4 and 8 diagonal blocks: 0 to 3 doubling levels, W,
    U') and the sequential kernel (the entering states h, the new values U, o, the final state) against
    the torch twins, varlen with an empty and a length-1 sequence, grouped heads H_q = 1 | H = 2, strong
    decay (g_scale 3). (The staged forward is held to the same twins by test_triton_delta.py and to the fused
    one by test_fused_equals_staged: it is not run here.)"""
    fused_forward_matches_twins(gate, gen, C)


@pytest.mark.parametrize("gate, C", [(gate, C) for gate in GATES for C in (16, 64, 128)
                                     if gate != "diagonal" or C == 16])
def test_split_kernels_match_twins(gate, C, gen):
    """`test_kernels_match_twins` on the split forward: its states pass (the backward's states kernel at C ≤ 64 with
    no or a scalar decay; the sequential kernel with OUTPUT 0 for KDA and C 128) and its output kernel."""
    fused_forward_matches_twins(gate, gen, C, form="split")


def fused_forward_matches_twins(gate, gen, C, form="fused") -> None:
    """`test_kernels_match_twins`' check on the fused forward (or the split one: `form`) as the launch table now says
    (the inverse-form tests run it under each LAUNCH["delta_prepass"]["INV"])."""
    s = _Stages(gate, gen, C, staged=False)
    t = s.twins()
    d, L, lay = s.d, s.L, s.lay
    args = (d["q"], d["k"], d["v"], d.get("g"), d["beta"], d["S0"], 0.4, L)
    if form == "fused":
        o, Ti, h, u, ht = fused_forward(*args, output_final_state=True, store_states=True, store_T=True)
    else:
        o, Ti, h, u, ht = split_forward(*args, output_final_state=True, store_T=True)
    assert rel(Ti, lay.from_chunks(t["T"])) < F32
    assert rel(h[0, s.used].transpose(0, 1), t["entering"][0]) < F32
    assert rel(ht, t["final"]) < F32
    assert rel(u, lay.from_chunks(t["U1"] - t["W"] @ t["entering"])) < F32
    assert rel(o, t["o"]) < F32  # (W, U' are internal to the fused forward: checked through U and o)


def test_inverse_is_exact_for_strong_coupling(gen):
    """T (I + L) = I to fp32 rounding where the products of the doubling grow: β up to 1.5, keys drawn close
    together (|k_i · k_j| near 1), chunk 64, no decay."""
    x = _inputs("none", gen, T=64, K=8, V=8)
    x["k"] = torch.nn.functional.normalize(x["k"] * 0.2 + 1.0, dim=-1)
    L = make_layout(1, 64, 1, 1, 8, 8, 64, None, DEV)
    d = to_dev(x)
    _, Ti, _, _, _ = fused_forward(d["q"], d["k"], d["v"], None, d["beta"], None, 0.4, L, output_final_state=False,
                                   store_states=False, store_T=True)
    k = x["k"][0, :, 0].double()
    Lm = torch.tril(x["beta"][0, :, 0, None].double() * (k @ k.T), -1)
    eye = torch.eye(64, dtype=torch.float64)
    Tw = Ti[0, :, 0].double().cpu()
    # backward-stable bound: a few fp32 roundings of |T| |I + L| per entry
    assert ((Tw @ (eye + Lm)) - eye).abs().max() < F32 * (Tw.abs() @ (eye + Lm).abs()).max()


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen, form, launched):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64 recurrence,
    T around a multiple of the chunk (16), a single token in two batch rows; the form's kernels ran (the backward:
    staged, the rule's for fp32)."""
    x = _inputs(gate, gen, B=2 if T == 1 else 1, T=T, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}", scales=delta_summand_scales(x, seed, want))
    assert launched == LAUNCHED[form, gate]


@pytest.mark.parametrize("gate", GATES)
def test_chunk_64_grouped(gate, gen, form):
    """The GPU's chunk 64 (four blocks in the inverse), T = 130, grouped heads H_q = 1 | H = 2."""
    x = _inputs(gate, gen, T=130, H=2, Hq=1, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, CHUNK_F32_REL, "C=64")


@pytest.mark.parametrize("gate", GATES)
def test_varlen(gate, gen, form):
    """Packed sequences (an empty and a length-1 one among them) equal each sequence alone (the recurrence):
    outputs, each final state, every gradient."""
    lengths = [7, 0, 20, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    want = grads(each_sequence_alone(_recurrent(gate), cu), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, cu_seqlens=cu), want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_chained_states(gate, gen, form):
    """[0, t) then [t, T) from the carried state equals one run (t not on a chunk boundary)."""
    d = to_dev(_inputs(gate, gen, B=2, T=37, K=8, V=8))
    kw = dict(scale=0.4, output_final_state=True, chunk_size=16)

    def run(a, b, S0):
        part = {key: val[:, a:b] for key, val in d.items() if key != "S0"}
        return chunk_delta_triton(part["q"], part["k"], part["v"], g=part.get("g"), beta=part["beta"],
                                  initial_state=S0, **kw)

    o, S = run(0, 37, d["S0"])
    o1, S1 = run(0, 19, d["S0"])
    o2, S2 = run(19, 37, S1)
    assert rel(torch.cat([o1, o2], dim=1), o) < CHUNK_F32_REL
    assert rel(S2, S) < CHUNK_F32_REL


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs(gate, gen, form):
    """bf16 q, k, v, β, g, S0: o and every gradient in bf16, within TRITON_DELTA_LOW_REL of the fp32 torch
    chunk form on the same rounded values (the interpreter emulates the bf16 products: util.mm)."""
    delta_bf16_agrees(gate, gen)


@pytest.mark.parametrize("gate", GATES)
def test_fused_equals_staged(gate, gen, monkeypatch):
    """The fused and the split forward agree with the staged one to fp32 rounding (outputs, final states), with
    β = None and no initial state."""
    d = to_dev(_inputs(gate, gen, B=2, T=50, H=2, K=8, V=8))
    out = {}
    for fwd in ("staged", *FORMS):
        out[fwd] = chunk_delta_triton(d["q"], d["k"], d["v"], g=d.get("g"), scale=None, output_final_state=True,
                                      chunk_size=16, pipeline=DeltaPipeline(fwd, "staged"))
    for fwd in FORMS:
        assert rel(out[fwd][0], out["staged"][0]) < F32 and rel(out[fwd][1], out["staged"][1]) < F32, fwd


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_deltaproduct_runs_fused_and_comba_staged(gate, gen, fused, launched):
    """DeltaProduct with the decay first (n = 2 micro-steps interleaved) runs the fused forward and equals
    the staged one (checked against its recurrence in test_triton_delta_variants.py) to fp32 rounding;
    Comba (probe key, decay after) runs staged."""
    x = _inputs(gate, gen, T=21, K=8, V=8, n=2)
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed), grads(_staged, x, seed), F32)
    assert launched[:2] == ["_prepass_kernel", "_fused_fwd_kernel"]
    launched.clear()
    _triton(_inputs("scalar", gen, T=21, K=8, V=8, probe=True), decay_first=False)
    assert launched == []


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_the_launch_switch_runs_the_split_forward(gate, gen, monkeypatch, launched):
    """util.LAUNCH["delta_split_out"]["ON"] 1 with no pipeline argument: the glue's rule runs the split forward
    (its output kernel launched) where it runs the fused one — bitwise the call pinned to DeltaPipeline("split",
    "fused"): outputs, final state, every gradient; ON 0 (the default) runs the fused forward."""
    x = _inputs(gate, gen, B=2, T=37, H=2, K=16, V=16, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    monkeypatch.setitem(util.LAUNCH["delta_split_out"], "ON", 1)
    got = grads(_triton, x, seed)
    assert "_output_kernel" in launched, launched
    want = grads(_triton, x, seed, pipeline=DeltaPipeline("split", "fused"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in want[2])
    monkeypatch.setitem(util.LAUNCH["delta_split_out"], "ON", 0)
    launched.clear()
    _triton(x)
    assert launched == ["_prepass_kernel", "_fused_fwd_kernel"], launched


def _staged(x, **kw):
    """The staged pipeline on fp32 inputs (what the rule picks for them)."""
    return _triton(x, pipeline=DeltaPipeline("staged", "staged"), **kw)


@pytest.mark.parametrize("gate", GATES)
def test_kept_states(gate, gen, form, monkeypatch):
    """recompute_states=False: the fused forward writes h, U and S_T for the backward (the split one writes h and U
    anyway), which reuses them
    (three more tensors kept, of h's, U's and S_T's sizes) — gradients equal to recomputing them to fp32
    rounding (the staged recompute rounds differently from the fused kernels)."""
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)
    out = {}
    for recompute in (True, False):
        force_delta_pipeline(monkeypatch, forward=form, recompute_states=recompute)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t, lambda t: t):
            out[recompute] = grads(_triton, x, seed)
        out[recompute, "kept"] = sorted(t.numel() for t in kept)
    check(out[False], out[True], F32)
    B, T, H, K, V, NT = 2, 37, 1, 8, 8, 3
    gone = list(out[False, "kept"])
    for n in out[True, "kept"]:
        gone.remove(n)
    assert sorted(gone) == sorted([B * NT * H * K * V, B * T * H * V, B * H * K * V])


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_split_states_feed_the_fused_backward(gate, gen):
    """The split forward with the fused backward, the states kept (recompute_states=False: the backward reads the h, U
    the forward wrote and runs no recompute) and recomputed: every gradient against the float64 recurrence and the
    two equal to fp32 rounding; varlen with an empty and a length-1 sequence, grouped heads, an initial state."""
    lengths = [7, 0, 20, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=2, Hq=1, K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    out = {keep: grads(_triton, x, seed, cu_seqlens=cu, pipeline=DeltaPipeline("split", "fused", not keep))
           for keep in (False, True)}
    check(out[True], out[False], F32)
    want = grads(each_sequence_alone(_recurrent(gate), cu), {key: val.double() for key, val in x.items()}, seed)
    check(out[True], want, CHUNK_F32_REL)


def test_no_grad_keeps_no_inverse(gen, fused, monkeypatch):
    """Without a gradient to compute the pre-pass does not write T (store_T False); with one it does."""
    calls = []
    real = delta_fused.fused_forward

    def spy(*a, **kw):
        calls.append(kw["store_T"])
        return real(*a, **kw)

    monkeypatch.setattr(delta_mod, "fused_forward", spy)
    d = to_dev(_inputs("scalar", gen, T=20, K=8, V=8))
    with torch.no_grad():
        o1, _ = chunk_delta_triton(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], scale=None, chunk_size=16)
    v = d["v"].clone().requires_grad_(True)
    o2, _ = chunk_delta_triton(d["q"], d["k"], v, g=d["g"], beta=d["beta"], scale=None, chunk_size=16)
    assert calls == [False, True] and torch.equal(o1, o2.detach())


def test_pipeline_argument_is_checked(gen):
    """A pipeline that is not a DeltaPipeline, or fused kernels asked for a call they do not take, raise naming the
    argument (nothing falls back silently)."""
    d = to_dev(_inputs("scalar", gen, T=20, K=8, V=8))
    with pytest.raises(InputError, match="pipeline must be a kernels.pipelines.DeltaPipeline"):
        chunk_delta_triton(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], scale=None, chunk_size=16,
                           pipeline="fused")
    p = to_dev(_inputs("scalar", gen, T=20, K=8, V=8, probe=True))
    with pytest.raises(InputError, match="pipeline.forward='fused' takes the decay first"):
        chunk_delta_triton(p["q"], p["k"], p["v"], g=p["g"], beta=p["beta"], p=p["p"], decay_first=False, scale=None,
                           chunk_size=16, pipeline=DeltaPipeline("fused", "staged"))
    diag = to_dev(_inputs("diagonal", gen, T=20, K=8, V=8))
    with pytest.raises(InputError, match="pipeline.backward='fused' takes"):
        chunk_delta_triton(diag["q"], diag["k"], diag["v"], g=diag["g"], beta=diag["beta"], scale=None,
                           chunk_size=16, pipeline=DeltaPipeline("staged", "fused"))


# ---------------------------------------------------------------------------- the grid from the shapes
def test_value_block_from_the_shapes_alone(monkeypatch):
    """BV halves from 64 while B·H·⌈V/BV⌉ (H·⌈V/BV⌉ with varlen) is under PROGRAMS = 132, down to 16, ≤ 32 for
    K > 128; with varlen it never depends on the number of sequences or T; fused_programs reports the grids."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "delta_fused_fwd": dict(util.LAUNCH["delta_fused_fwd"])})
    util.LAUNCH["delta_fused_fwd"].update(BV=64, PROGRAMS=132)

    def lay(B, T, H, K, V, cu=None):
        return make_layout(B, T, H, H, K, V, 64, cu, "cpu")

    assert value_block(lay(4, 4096, 16, 128, 128)) == 32  # 64 rows: 128 programs at BV 64 < 132 → 256 at BV 32
    assert value_block(lay(8, 4096, 16, 128, 128)) == 64  # 128 rows × 2 = 256
    assert value_block(lay(1, 32768, 32, 128, 128)) == 16  # 32 rows: 256 programs at BV 16
    assert value_block(lay(64, 100, 16, 256, 256)) == 32  # K > 128: at most 32
    assert value_block(lay(1, 100, 2, 16, 16)) == 16  # V = 16
    for cu in ([0, 5, 100], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100], [0, 100]):
        L = lay(1, 100, 16, 128, 128, torch.tensor(cu))
        assert value_block(L) == 16  # 16 heads: 128 programs at BV 128/... → 16, whatever the packing
        p = fused_programs(L)
        assert p == {"prepass": L.NT * 16, "sequential": (len(cu) - 1) * 16 * 8, "BV": 16}
    util.LAUNCH["delta_fused_fwd"].update(PROGRAMS=1)
    assert value_block(lay(1, 32768, 32, 128, 128)) == 64


@pytest.mark.variants
@pytest.mark.parametrize("gate", ["scalar", "diagonal"])
def test_value_block_is_a_pure_launch_choice(gate, gen, fused, monkeypatch):
    """BV 16 vs 64 at V = 40 (three partial V blocks vs one): the same outputs, final state and gradients."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "delta_fused_fwd": dict(util.LAUNCH["delta_fused_fwd"])})
    x = _inputs(gate, gen, T=37, K=8, V=40)
    seed = secrets.randbits(31)
    out = {}
    for bv in (16, 64):
        util.LAUNCH["delta_fused_fwd"].update(BV=bv, PROGRAMS=1)
        out[bv] = grads(_triton, x, seed)
    check(out[16], out[64], F32)


@pytest.mark.variants
@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_aqk_in_the_prepass_is_a_launch_choice(gate, gen, fused, monkeypatch):
    """LAUNCH["delta_prepass"]["AQK"] = 1 (the pre-pass writes Aqk, the sequential kernel reads it) against
    0 (recomputed in the sequential loop): the same outputs, final states and gradients, varlen with an
    empty and a length-1 sequence."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "delta_prepass": dict(util.LAUNCH["delta_prepass"])})
    lengths = [7, 0, 20, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    out = {}
    for aqk in (0, 1):
        util.LAUNCH["delta_prepass"]["AQK"] = aqk
        out[aqk] = grads(_triton, x, seed, cu_seqlens=cu)
    check(out[1], out[0], F32)


#: The fused forward's numeric launch options: (launch site, key) — each 0/1, each held to the other setting and to
#: float64 (interpreter) and, on the GPU, to the fp32 torch form in bf16
NUMERIC_OPTIONS = [("delta_fused_fwd", "RAW_QK"), ("delta_prepass", "RAW_KV"), ("delta_prepass", "INV_TF32")]


@pytest.mark.variants
@pytest.mark.parametrize("site, key", NUMERIC_OPTIONS)
@pytest.mark.parametrize("gate", GATES)
def test_numeric_launch_options(gate, site, key, gen, fused, monkeypatch):
    """RAW_QK (q, k to the tensor cores as stored; the scale and decays on the [C, C] and [C, BV] sides), RAW_KV (W, U'
    from T's columns scaled by β e^G and k, v as stored) and INV_TF32 (the inverse's products at one TF32 product; the
    interpreter computes them exactly) at 1 against 0 and against the float64 recurrence: outputs, final states and
    every gradient, varlen with an empty and a length-1 sequence, grouped heads, an initial state (the diagonal decay
    ignores the first two)."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, site: dict(util.LAUNCH[site])})
    lengths = [7, 0, 20, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=2, Hq=1, K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    out = {}
    for raw in (0, 1):
        util.LAUNCH[site][key] = raw
        out[raw] = grads(_triton, x, seed, cu_seqlens=cu)
    check(out[1], out[0], F32)
    want = grads(each_sequence_alone(_recurrent(gate), cu), {key: val.double() for key, val in x.items()}, seed)
    check(out[1], want, CHUNK_F32_REL)


# ---------------------------------------------------------------------------- no recompile as the packing changes
_KEYS_BODY = r"""from fastweights.kernels.pipelines import DeltaPipeline
from fastweights.kernels.triton.delta import chunk_delta_triton

gate, dtype = sys.argv[2], getattr(torch, sys.argv[3])
BACKWARD = "staged" if gate == "diagonal" else "fused"  # the rule's, for bf16 on the CPU
PIPE = DeltaPipeline(sys.argv[4], BACKWARD)  # the forward: "fused" or "split"
gen = torch.Generator().manual_seed(0)
counts = []
for i in range(20):
    lengths, T, cu = packing(gen, i, 300)
    H, Hq, K, V = 4, 2, 64, 64
    q = torch.randn(1, T, Hq, K).to(dtype).requires_grad_(True)
    k = torch.randn(1, T, Hq, K).to(dtype).requires_grad_(True)
    v = torch.randn(1, T, H, V).to(dtype).requires_grad_(True)
    g = None if gate == "none" else torch.randn(1, T, H, *((K,) if gate == "diagonal" else ())).requires_grad_(True)
    beta = torch.rand(1, T, H).requires_grad_(True)
    S0 = torch.randn(len(lengths), H, K, V).requires_grad_(True)
    o, S = chunk_delta_triton(q, k, v, g=g, beta=beta, scale=None, initial_state=S0, output_final_state=True,
                              chunk_size=64, cu_seqlens=cu, pipeline=PIPE)
    (o.float().sum() + S.sum()).backward()
    counts.append(len(keys))
report(counts)
"""


@pytest.mark.variants
@pytest.mark.parametrize("name", FORMS)
@pytest.mark.parametrize("gate", GATES)
def test_varlen_packings_compile_once(gate, name):
    """20 varlen batches of different packings (numbers of sequences, lengths, T = 1, T a multiple of 16 or
    not) ask Triton for no compile key after the first batch, forward (fused or split) and backward. Under the
    interpreter nothing compiles, so this runs in a subprocess without it: a stand-in driver reports an
    sm_90 target, and Triton's `jit_cache_hook` records each launch's compile key (the dict key of
    `kernel.device_caches[device][0]`, from the specialization of every argument) and skips the compile."""
    out = compile_keys(_KEYS_BODY, gate, "bfloat16", name)
    counts = out["counts"]
    assert set(LAUNCHED[name, gate]) <= set(out["kernels"])
    assert counts[0] > 0 and counts == [counts[0]] * 20, counts


# ---------------------------------------------------------------------------- realistic shapes (GPU)
CUDA_SIZES = [(2, 1024, 4, 4, 64), (4, 4096, 16, 16, 128), (3, 1000, 8, 4, 128), (1, 4096, 4, 4, 256),
              (1, 8192, 32, 16, 128)]


def _torch_run(xd, *, chunk_size=64, cu_seqlens=None):
    xd = {key: val.float() for key, val in xd.items()}
    rep = xd["v"].shape[2] // xd["q"].shape[2]
    return chunk_delta(xd["q"].repeat_interleave(rep, 2), xd["k"].repeat_interleave(rep, 2), xd["v"], g=xd.get("g"),
                       beta=xd["beta"], scale=0.4, initial_state=xd["S0"], output_final_state=True,
                       chunk_size=chunk_size, cu_seqlens=cu_seqlens, inverse="solve")


#: The realistic cases of each fused forward on the GPU: every size for the default's "fused"; the opt-in "split" at
#: the LM's shape and the odd, grouped one (its kernels' other paths run in the interpreter cases and the other cuda
#: tests: the realistic rows are GiB-sized, and the suite's time is theirs)
CUDA_REALISTIC = [("fused", size) for size in CUDA_SIZES] + [("split", size) for size in CUDA_SIZES[1:3]]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, size", CUDA_REALISTIC, ids=lambda s: s if isinstance(s, str) else
                         "B{}-T{}-H{}-Hq{}-D{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_realistic(gate, name, size, dtype, gen, monkeypatch):
    """On the GPU (Hopper + Triton 3.6: where miscompiles hide), each fused forward (fused, split) and the rule's
    backward against the fp32 torch chunk form: outputs, final states, every gradient."""
    force_delta_pipeline(monkeypatch, forward=name)
    B, T, H, Hq, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)
    if D > FUSED_MAX_HEAD_DIM_CUDA:  # an illegal memory access on the H100 at D = 256: refused, not run
        with pytest.raises(InputError, match=f"takes K, V ≤ {FUSED_MAX_HEAD_DIM_CUDA} on a GPU"):
            grads(_triton, x, seed, chunk_size=64)
        return
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed), tol, f"{size} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_cuda_split_value_dim_256(gate, dtype, gen):
    """The split forward at K 128, V 256 (the LM preset's gated DeltaNet: the fused forward refuses V > 128 on a GPU,
    the split one's states kernel takes it) with the rule's backward (fused for bf16), grouped varlen with an empty
    and a length-1 sequence, against the fp32 torch chunk form."""
    lengths = [1000, 0, 1, 2047, 63]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=8, Hq=4, K=128, V=256, N=len(lengths), dtype=dtype)
    seed = secrets.randbits(31)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    pipe = DeltaPipeline("split", "fused" if dtype == torch.bfloat16 else "staged")  # the rule's backward
    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu, pipeline=pipe),
          grads(lambda d: _torch_run(d, cu_seqlens=cu.to(DEV)), to_dev(x), seed), tol, f"V=256 {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("size", CUDA_SIZES[:3], ids=lambda s: "B{}-T{}-H{}-Hq{}-D{}".format(*s))
@pytest.mark.parametrize("gate", ["none", "scalar"])
@pytest.mark.parametrize("site, key", NUMERIC_OPTIONS)
@pytest.mark.parametrize("raw", [0, 1])
def test_cuda_numeric_launch_options_bf16(gate, size, site, key, raw, gen, fused, monkeypatch):
    """Both settings of each numeric launch option on the GPU in bf16 against the fp32 torch chunk form (RAW_QK 1 the
    default since r4s10 call 2)."""
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, site: dict(util.LAUNCH[site])})
    util.LAUNCH[site][key] = raw
    B, T, H, Hq, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=D, V=D, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed),
          TRITON_DELTA_LOW_REL[torch.bfloat16], f"{size} {key} {raw}")


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
def test_cuda_grouped_varlen(gate, gen, form):
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


@pytest.mark.cuda
def test_cuda_varlen_no_recompile(gen, fused):
    """20 packings, fused forward and backward: no kernel of the call compiles after the first (the
    compiled-kernel dicts of every launched kernel keep their size)."""
    import importlib

    def compiled():
        n = 0
        for path in list(util.KERNEL_FN.values()):
            mod, fn = path.rsplit(".", 1)
            kernel = getattr(importlib.import_module(f"fastweights.kernels.triton.{mod}"), fn)
            n += sum(len(c[0]) for c in kernel.device_caches.values())
        return n

    counts = []
    for i in range(20):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        lengths = torch.randint(0, 3000, (n,), generator=gen).tolist()
        lengths = [1] if i == 2 else ([64, 128] if i == 1 else lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        T = max(1, sum(lengths))
        cu[-1] = T
        x = _inputs("scalar", gen, T=T, H=8, Hq=4, K=128, V=128, N=len(lengths), dtype=torch.bfloat16)
        grads(_triton, x, 1, chunk_size=64, cu_seqlens=cu)
        counts.append(compiled())
    assert counts == [counts[0]] * 20, counts


@pytest.mark.cuda
def test_cuda_graph_capture_varlen(gen, form):
    """A varlen call (fused or split forward, the rule's backward) captured in a CUDA graph — no host sync inside — and
    replayed: bitwise the eager outputs and gradients."""
    lengths = [300, 0, 1, 700, 23]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
    x = to_dev(_inputs("scalar", gen, T=sum(lengths), H=4, Hq=2, K=64, V=64, N=len(lengths), dtype=torch.bfloat16))
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    do = torch.randn(x["v"].shape, device="cuda").to(torch.bfloat16)

    def step():
        o, S = chunk_delta_triton(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"],
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
