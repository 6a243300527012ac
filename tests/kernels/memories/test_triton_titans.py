"""kernels.triton.memories.titans (Titans' inner mini-batch loop, forward and backward kernels) against its torch
twin `titans_torch` (chunkwise.minibatch, float64, differentiated by autograd) and the float64 recurrence
(reference.recurrent through `fw.recurrent`): outputs, final weights, momentum and anchor, and every gradient — q, k,
v, the retention, step and momentum gates, the initial weights, momentum and anchor; lengths that are no multiple of
the mini-batch, a carried mini-batch (offset > 0), chained calls, varlen (an empty and a length-1 sequence), grouped
heads, unequal and padded head dims, several hidden tiles (and a partial one), fp32, bf16 and fp16 inputs. Then the
dispatch row ("generic", "chunk", "triton") that serves Titans with its kernels.

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes (K, V ≤ 20, F = 4K, T ≤ 41); kernel outputs
are NaN-poisoned (tests/conftest.py). Fresh random inputs every run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.dispatch import DISPATCH, Target
from fastweights.inputs import InputError
from fastweights.kernels.rows import titans_kernel_serves, triton_generic_supports
from fastweights.kernels.triton.common.limits import titans_pipeline
from fastweights.kernels.triton.common.util import LAUNCH
from fastweights.kernels.triton.memories.titans import hidden_tile, titans_triton
from fastweights.state import MemoryState
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV, rel
from tests.kernels.memories.layers import layer_on_kernels_equals_torch, row_call
from tests.kernels.memories.twins import titans_torch
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, TITANS_LAYER_F32_REL, TITANS_LOW_REL

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def one_program(monkeypatch, request):
    """These tests hold the split pipeline's one-program kernels (`_state_kernel`, `_bwd_kernel`): the launch table's
    auto rule would give their small grids to the sliced kernels (tests/kernels/memories/test_triton_titans_sliced.py
    holds those). A test of the pipeline "single recomputed" runs with util.LAUNCH "titans_single_bwd" KEEP 0
    (`RECOMPUTED`; the default, KEEP 2, is the pipeline "single")."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 0)
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("pipeline") == RECOMPUTED:
        monkeypatch.setitem(LAUNCH["titans_single_bwd"], "KEEP", 0)

SCALE = 0.7
STATE = ("W1", "W2")
MOMENTUM = ("M1", "M2")
ANCHOR = ("A1", "A2")
SEQ = ("q", "k", "v", "g", "beta", "nu")
NAMES = SEQ + STATE + MOMENTUM + ANCHOR


def _inputs(gen, *, B=1, T=37, Hq=1, H=2, K=16, V=16, step=0.25):
    """Float64 inputs as Titans' layer makes them (unit q, k; retention a = e^g ∈ (0.8, 1), step β ∈ (0, step),
    momentum decay ν ∈ (0.5, 1)), a random state, momentum and anchor (hidden width F = 4K). (β up to 0.5 made the
    memory diverge: at T 41, |o| > 1e3 in 14 of 150 draws of the float64 recurrence, up to 1.7e6 — fp16 outputs
    overflowed in CI —, and within 100–170 tokens always; at 0.25, |o| ≤ 1.55 in all 150. Long sequences take
    step=0.05.)"""
    Fh = 4 * K

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def uni(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    x = {"q": F.normalize(rnd(B, T, Hq, K), dim=-1), "k": F.normalize(rnd(B, T, Hq, K), dim=-1),
         "v": rnd(B, T, H, V), "g": torch.log(0.8 + 0.2 * uni(B, T, H)), "beta": step * uni(B, T, H),
         "nu": 0.5 + 0.5 * uni(B, T, H)}
    for names, s in ((STATE, 1.0), (MOMENTUM, 0.1), (ANCHOR, 1.0)):
        x.update(zip(names, (s * rnd(B, H, K, Fh) / K ** 0.5, s * rnd(B, H, Fh, V) / Fh ** 0.5)))
    return x


def _state(x, offset):
    return dict(weights=tuple(x[n] for n in STATE), momentum=tuple(x[n] for n in MOMENTUM),
                anchor=tuple(x[n] for n in ANCHOR) if offset else None, offset=offset)


def _kernel(x, offset, b=16, tile=32, cu_seqlens=None, pipeline=None):
    """The kernels on fp32 copies of x's gates and state (q, k, v as given), hidden tiles of 32 unless `tile` says
    otherwise (None: the glue's own, `hidden_tile`); `pipeline` "single" or "split" (None: the glue's choice,
    `limits.titans_pipeline`)."""
    st = _state({n: val.float() for n, val in x.items()}, offset)
    return titans_triton(x["q"], x["k"], x["v"], *(x[n].float() for n in ("g", "beta", "nu")), scale=SCALE,
                         minibatch=b, tile=tile, cu_seqlens=cu_seqlens,
                         pipeline="single" if pipeline == RECOMPUTED else pipeline, **st)


#: The single pipeline with util.LAUNCH "titans_single_bwd" KEEP 0: its backward recomputes what the default (KEEP 2)
#: has its forward keep — e, the read's sums and its [b, F] tiles (the fixture `one_program` sets it)
RECOMPUTED = "single recomputed"
#: Both of Titans' kernel pipelines: one sequential program per (sequence, head) each way, and the split one; and the
#: single one's KEEP 0 variant
PIPELINES = ("single", "split", RECOMPUTED)


def _twin(x, offset, b=16):
    return titans_torch(*(x[n] for n in SEQ), scale=SCALE, minibatch=b, **_state(x, offset))


def _recurrence(x, offset):
    """The float64 per-token recurrence of Titans (`fw.recurrent`, b = 16) on the same contract."""
    G = x["v"].shape[2] // x["q"].shape[2]
    o, final = fw.recurrent("titans", x["q"].repeat_interleave(G, 2), x["k"].repeat_interleave(G, 2), x["v"],
                            scale=SCALE, g=x["g"], beta=x["beta"], nu=x["nu"],
                            initial_state=MemoryState(**_state(x, offset)), output_final_state=True)
    return o, final.weights, final.momentum, final.anchor, final.offset


def _fp32(x):
    return {name: val.float() for name, val in x.items()}


def _run(fn, x, offset, seed, dtype=None):
    """(outputs [o, end W1, W2, M1, M2, anchor W1, W2], final offset, {name: gradient}) of `fn(leaves, offset)` on x
    (q, k, v cast to `dtype`; every tensor moved to DEV) under a random float64 projection of every output drawn from
    `seed`; the anchor is an input only with offset > 0."""
    leaves = {}
    for name, val in x.items():
        val = val.to(dtype) if dtype is not None and name in ("q", "k", "v") else val
        leaves[name] = val.to(DEV).requires_grad_(True)
    o, weights, momentum, anchor, off = fn(leaves, offset)
    outs = [o, *weights, *momentum, *anchor]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
    used = [n for n in NAMES if offset or n not in ANCHOR]
    grads = torch.autograd.grad(loss, [leaves[n] for n in used])
    return [t.detach().double().cpu() for t in outs], off, {n: t.double().cpu() for n, t in zip(used, grads)}


def _agree(got, want, tol):
    """got, want: `_run`'s — every tensor within `tol` (relative), the offsets equal."""
    (o1, off1, g1), (o2, off2, g2) = got, want
    assert off1 == off2
    assert len(o1) == len(o2) == 7
    for name, a, b in zip(("o", "W1_T", "W2_T", "M1_T", "M2_T", "anchor W1", "anchor W2"), o1, o2):
        assert a.shape == b.shape and rel(a, b) < tol, f"{name}: {rel(a, b):.3g}"
    assert set(g1) == set(g2)
    for name in g2:
        assert rel(g1[name], g2[name]) < tol, f"d{name}: {rel(g1[name], g2[name]):.3g}"


def _seed(gen):
    return int(torch.randint(0, 2**31, (), generator=gen))


@pytest.mark.parametrize("T, offset, Hq, tile", [(37, 0, 1, 32), (23, 5, 2, 32), (16, 0, 2, None), (3, 9, 1, 32),
                                                (11, 5, 1, 16)])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_the_kernel_equals_the_twin_and_the_recurrence(gen, T, offset, Hq, tile, pipeline):
    """fp32 kernels against float64: T = 37 and 23 (no multiple of 16), T = 16 (one whole mini-batch), T = 3 inside a
    carried mini-batch (offset 9: the call ends mid-batch), T = 11 completing a carried one (offset 5: the call ends on
    the mini-batch's end); grouped heads (H_q = 1, H = 2) and plain ones; the hidden dim F = 64 in two tiles, four, or
    the glue's own (one). Outputs, final state and every gradient."""
    x = _inputs(gen, T=T, Hq=Hq)
    seed = _seed(gen)
    got = _run(lambda leaves, off: _kernel(leaves, off, tile=tile, pipeline=pipeline), _fp32(x), offset, seed)
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, _run(_recurrence, x, offset, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("T, offset, Hq", [(37, 0, 1), (23, 5, 2)])
def test_the_split_with_the_read_terms_in_the_pre_pass(monkeypatch, gen, T, offset, Hq):
    """The split pipeline's READ_TERMS launch option (util.LAUNCH "titans_bwd": the pre-pass writes the start state
    gradient's read terms, the reverse pass adds them) against the float64 twin and the default's result."""
    from fastweights.kernels.triton.common import util

    x = _inputs(gen, T=T, Hq=Hq)
    seed = _seed(gen)
    base = _run(lambda leaves, off: _kernel(leaves, off, pipeline="split"), _fp32(x), offset, seed)
    monkeypatch.setitem(util.LAUNCH, "titans_bwd", {**util.LAUNCH["titans_bwd"], "READ_TERMS": 1})
    got = _run(lambda leaves, off: _kernel(leaves, off, pipeline="split"), _fp32(x), offset, seed)
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, base, CHUNK_F32_REL)


@pytest.mark.parametrize("T, offset, Hq", [(37, 0, 1), (23, 5, 2)])
def test_the_single_backward_from_the_forward_s_sums(monkeypatch, gen, T, offset, Hq):
    """The single pipeline's KEEP 1 (util.LAUNCH "titans_single_bwd": the forward keeps e and the read's sums, the
    backward skips its passes A and B) against the float64 twin and the default's (KEEP 2) result; KEEP 0 is the
    pipeline "single recomputed" of the other tests."""
    x = _inputs(gen, T=T, Hq=Hq)
    seed = _seed(gen)
    base = _run(lambda leaves, off: _kernel(leaves, off, pipeline="single"), _fp32(x), offset, seed)
    monkeypatch.setitem(LAUNCH["titans_single_bwd"], "KEEP", 1)
    got = _run(lambda leaves, off: _kernel(leaves, off, pipeline="single"), _fp32(x), offset, seed)
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, base, CHUNK_F32_REL)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_unequal_padded_head_dims_a_partial_hidden_tile_and_a_longer_mini_batch(monkeypatch, gen, pipeline):
    """K = 20 (padded to a 32-wide tile), V = 12 (padded to 16), F = 80 in tiles of 32 (the last one partial),
    b = 32 with a carried mini-batch of 7 tokens, grouped heads; without gradients (no_grad) the forward (its state
    pass and readout; the single pipeline's one kernel without saving start states) returns the same."""
    from fastweights.kernels.triton.memories import titans as mod
    from fastweights.kernels.triton.memories import titans_single as one

    calls = []
    for kernel in (mod._state_kernel, mod._readout_kernel, mod._bwd_read_kernel, mod._bwd_kernel, one._fwd_kernel,
                   one._bwd_kernel):
        real = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _real=real, _k=kernel, **kw: calls.append(_k) or _real(*a, **kw))
    x = _inputs(gen, T=41, Hq=1, H=2, K=20, V=12)
    seed = _seed(gen)
    got = _run(lambda leaves, off: _kernel(leaves, off, b=32, pipeline=pipeline), _fp32(x), 7, seed)
    _agree(got, _run(lambda leaves, off: _twin(leaves, off, b=32), x, 7, seed), CHUNK_F32_REL)
    with torch.no_grad():
        o, weights, momentum, anchor, _ = _kernel({n: t.to(DEV) for n, t in _fp32(x).items()}, 7, b=32,
                                                  pipeline=pipeline)
    fwd = [mod._state_kernel, mod._readout_kernel] if pipeline == "split" else [one._fwd_kernel]
    bwd = [mod._bwd_read_kernel, mod._bwd_kernel] if pipeline == "split" else [one._bwd_kernel]
    assert calls == fwd + bwd + fwd
    for a, b in zip((o, *weights, *momentum, *anchor), got[0]):
        assert torch.equal(a.double().cpu(), b)


def test_the_hidden_tile():
    """The glue's hidden tile BF: [max(K, V), BF] weight tiles of at most TILE_ELEMENTS fp32 values, 16 ≤ BF ≤
    pow2(F)."""
    assert [hidden_tile(D, D, 4 * D) for D in (16, 20, 32, 64, 128)] == [64, 64, 64, 32, 16]
    assert hidden_tile(16, 128, 64) == 16 and hidden_tile(16, 16, 16) == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_low_precision_inputs(gen, dtype, monkeypatch, pipeline):
    """bf16 / fp16 q, k, v (the gates and the state fp32, as a layer passes them) against the float64 twin on the same
    rounded values: the kernels compute in fp32 and round o, dq, dk, dv to `dtype`; tl.dot's default precision follows
    the loop kernels' rule (`limits.loop_precision`: ieee for Titans at every dtype)."""
    from fastweights.kernels.triton.memories import titans, titans_single

    fn = (titans if pipeline == "split" else titans_single)._Titans
    precisions, apply = [], fn.apply
    monkeypatch.setattr(fn, "apply", lambda *a: precisions.append(a[-1]["PREC"]) or apply(*a))
    x = _inputs(gen, T=37, Hq=1)
    x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    dtypes = []

    def kernel(leaves, off):
        out = _kernel(leaves, off, pipeline=pipeline)
        dtypes.append(out[0].dtype)
        return out

    got = _run(kernel, _fp32(x), 5, seed, dtype=dtype)
    assert dtypes == [dtype]
    assert precisions == ["ieee"]
    _agree(got, _run(_twin, x, 5, seed), TITANS_LOW_REL[dtype])


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_chained_calls_equal_one_call(gen, pipeline):
    """T = 41 as 21 + 20 tokens (the second call continues the mini-batch the first left at 5 tokens), the state —
    weights, momentum, anchor, offset — passed between the calls: outputs, final state and every gradient of the chain
    equal one call's."""
    x = _inputs(gen, T=41, Hq=1)
    seed = _seed(gen)

    def chained(leaves, offset):
        first = {n: (val[:, :21] if n in SEQ else val) for n, val in leaves.items()}
        o1, w1, m1, a1, off1 = _kernel(first, offset, pipeline=pipeline)
        assert off1 == 5
        second = {n: (val[:, 21:] if n in SEQ else val) for n, val in leaves.items()}
        second.update({**dict(zip(STATE, w1)), **dict(zip(MOMENTUM, m1)), **dict(zip(ANCHOR, a1))})
        o2, w2, m2, a2, off2 = _kernel(second, off1, pipeline=pipeline)
        return torch.cat([o1, o2], dim=1), w2, m2, a2, off2

    _agree(_run(chained, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)


def _each_sequence_alone(leaves, off, cu):
    """The twin on each sequence of the packing `cu` alone (its own state row, mini-batches from its own start),
    outputs concatenated and final states stacked as the varlen kernels return them; an empty sequence keeps its state
    (with no carried mini-batch its anchor is its weights)."""
    outs, parts = [], []
    for i, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = {n: (val[:, s0:s1] if n in SEQ else val[i:i + 1]) for n, val in leaves.items()}
        if s1 == s0:
            outs.append(one["v"])
            st = _state(one, off)
            parts.append((st["weights"], st["momentum"], st["anchor"] if off else st["weights"], off))
            continue
        o, w, m, a, o_off = _twin(one, off)
        outs.append(o)
        parts.append((w, m, a, o_off))
    cat = [tuple(torch.cat(t, dim=0) for t in zip(*[p[i] for p in parts])) for i in range(3)]
    return torch.cat(outs, dim=1), *cat, [p[3] for p in parts]


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_varlen_equals_each_sequence_alone(gen, offset, pipeline):
    """cu_seqlens packing 4 sequences (an empty one, a length-1 one, one past a mini-batch), one head: each
    with its own state row and mini-batches from its own start equals the twin on that sequence alone — outputs, each
    final state, every gradient; the final offsets are each sequence's. (The dispatch row does not pass varlen: a
    MemoryState carries one offset, and the torch row refuses it.)"""
    lengths = [9, 0, 20, 1]
    cu = torch.tensor([0] + lengths).cumsum(0)
    N, T = len(lengths), sum(lengths)
    x = _inputs(gen, B=1, T=T, Hq=1, H=1)
    x.update({n: _inputs(gen, B=N, T=1, Hq=1, H=1)[n] for n in STATE + MOMENTUM + ANCHOR})  # one state row per sequence
    seed = _seed(gen)

    got = _run(lambda leaves, off: _kernel(leaves, off, cu_seqlens=cu.to(DEV), pipeline=pipeline), _fp32(x), offset,
               seed)
    assert got[1] == [(offset + n) % 16 for n in lengths]
    _agree(got, _run(lambda leaves, off: _each_sequence_alone(leaves, off, cu), x, offset, seed), CHUNK_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(4, 512, 2, 64, 0), (2, 300, 2, 64, 7), (1, 200, 3, 32, 11), (2, 300, 2, 128, 5)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_cuda_realistic(gen, size, dtype, pipeline):
    """On the GPU: the kernels (their own hidden tile) against the float64 twin at realistic shapes, outputs, final
    state and every gradient; bf16 inputs against the twin on the same rounded values. (Not run yet: written for the
    GPU session's `pytest -m cuda`.)"""
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, K=D, V=D, step=0.05)  # (β ≤ 0.5 diverges over these lengths: _inputs)
    if dtype != torch.float32:
        x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(lambda leaves, off: _kernel(leaves, off, tile=None, pipeline=pipeline), _fp32(x), offset, seed,
               dtype=dtype)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TITANS_LOW_REL[dtype]
    want = _run(_twin, x, offset, seed)
    assert torch.isfinite(want[0][0]).all()  # a memory that stayed bounded: a comparison, not NaN against NaN
    _agree(got, want, tol)


def test_the_kernel_refuses_what_it_does_not_take(gen):
    x = _fp32(_inputs(gen, T=5, Hq=1))
    with pytest.raises(InputError, match="mini-batch b in"):
        _kernel(x, 0, b=8)
    with pytest.raises(InputError, match="offset > 0 needs the anchor"):
        titans_triton(*(x[n] for n in SEQ), scale=1.0, weights=(x["W1"], x["W2"]), momentum=(x["M1"], x["M2"]),
                      offset=3)
    with pytest.raises(InputError, match="nu"):
        titans_triton(*(x[n] for n in SEQ[:5]), x["nu"][:, :2], scale=1.0, weights=(x["W1"], x["W2"]),
                      momentum=(x["M1"], x["M2"]))
    with pytest.raises(InputError, match="momentum must be 2 tensors"):
        titans_triton(*(x[n] for n in SEQ), scale=1.0, weights=(x["W1"], x["W2"]), momentum=(x["M1"],))
    with pytest.raises(InputError, match=r"momentum\[1\]"):
        titans_triton(*(x[n] for n in SEQ), scale=1.0, weights=(x["W1"], x["W2"]),
                      momentum=(x["M1"], x["M2"][:, :, :8]))
    with pytest.raises(InputError, match="cu_seqlens must start at 0 and end at T=5"):
        titans_triton(*(x[n] for n in SEQ), scale=1.0, weights=(x["W1"], x["W2"]), momentum=(x["M1"], x["M2"]),
                      cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(InputError, match="tile must be a power of two"):
        _kernel(x, 0, tile=24)
    with pytest.raises(InputError, match="pipeline must be"):
        _kernel(x, 0, pipeline="fused")
    big = torch.zeros(1, 2, 1, 130)
    gate = torch.zeros(1, 2, 1)
    with pytest.raises(InputError, match="head dims ≤ 128, got K=130"):
        titans_triton(big, big, big, gate, gate, gate, scale=1.0,
                      weights=(torch.zeros(1, 1, 130, 4), torch.zeros(1, 1, 4, 130)),
                      momentum=(torch.zeros(1, 1, 130, 4), torch.zeros(1, 1, 4, 130)))


# ---------------------------------------------------------------------------- the dispatch row
def test_the_generic_row_serves_titans_on_cuda_and_refuses_other_shapes():
    cuda = Target.of("cuda", torch.bfloat16, 64, 64)
    recipe = fw.zoo.get("titans")
    assert titans_kernel_serves(recipe) is None and triton_generic_supports(recipe, cuda) is None
    # ieee for every dtype (limits.LOOP_BF16_KERNELS: at tf32 its state drifted on an H200)
    assert [fw.pipeline("titans", device="cuda", dtype=dt, head_dim=64)[1] for dt in (torch.float32, torch.bfloat16,
                                                                                      torch.float16)] \
        == ["Titans kernels (ieee)"] * 3
    # the row's reach (limits.TITANS_MAX_DIM); above 64 the split pipeline (limits.titans_pipeline), named so
    assert fw.pipeline("titans", device="cuda", dtype=torch.bfloat16, head_dim=128)[1] == "Titans kernels (ieee, split)"
    assert "Titans kernels take head dims ≤ 128, got K=256" in triton_generic_supports(
        recipe, Target.of("cuda", torch.bfloat16, 256, 256))
    assert fw.pipeline("titans", device="cuda", dtype=torch.bfloat16, head_dim=256)[0] == "torch"
    assert [titans_pipeline(d, d, LAUNCH) for d in (16, 64, 65, 128)] == ["single", "single", "split", "split"]
    mem, opt = recipe.memory, recipe.optimizer
    others = {"GELU, erf form": dataclasses.replace(recipe, memory=dataclasses.replace(mem, activation="gelu_tanh")),
              "without inner biases": dataclasses.replace(recipe, memory=dataclasses.replace(mem, bias=True)),
              "2-layer": dataclasses.replace(recipe, memory=dataclasses.replace(mem, depth=3)),
              "momentum optimizer": dataclasses.replace(recipe, optimizer=dataclasses.replace(opt, kind="gd")),
              "scalar retention": dataclasses.replace(recipe, retention=dataclasses.replace(recipe.retention,
                                                                                             kind="none")),
              "mini-batch b in": dataclasses.replace(recipe, optimizer=dataclasses.replace(opt, minibatch=8))}
    for why, other in others.items():
        assert why in titans_kernel_serves(other), why
    b8 = triton_generic_supports(others["mini-batch b in"], cuda)  # the torch row: none of the loop kernels serve it
    assert "TTT-Linear" in b8 and "TTT-MLP" in b8 and "Titans kernel takes a mini-batch" in b8
    from fastweights.kernels import rows

    with rows.pinned("generic", precision="tf32x3"):  # the row's kernels at that tl.dot precision
        assert fw.pipeline("titans", device="cuda", dtype=torch.bfloat16, head_dim=64)[1] == "Titans kernels (tf32x3)"
        assert fw.pipeline("titans", device="cuda", dtype=torch.bfloat16, head_dim=128)[1] \
            == "Titans kernels (tf32x3, split)"


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_fw_chunk_takes_the_kernels_through_the_row(monkeypatch, gen, pipeline):
    """fw.chunk("titans") on a (fake, on the CPU) CUDA device routes to the Triton row ("auto" and by name), which
    runs the kernels — a call under no_grad the forward alone, one whose inputs need gradients the backward too:
    output, final state and every gradient (the gates' included) equal the torch row's in float64; varlen is refused as
    the torch row refuses it. Head dim 16: the single pipeline, or the split one with the launch table's
    titans_single_fwd MAX_DIM lowered under it (the interpreter at D 128 is slow)."""
    from fastweights.kernels.triton.memories import titans as mod
    from fastweights.kernels.triton.memories import titans_single as one

    if pipeline == "split":
        monkeypatch.setitem(LAUNCH["titans_single_fwd"], "MAX_DIM", 8)
    fwd = [mod._state_kernel, mod._readout_kernel] if pipeline == "split" else [one._fwd_kernel]
    bwd = [mod._bwd_read_kernel, mod._bwd_kernel] if pipeline == "split" else [one._bwd_kernel]
    assert fw.pipeline("titans", device="cuda", dtype=torch.float32, head_dim=16)[1] \
        == "Titans kernels (ieee" + (", split)" if pipeline == "split" else ")")
    calls = []
    for kernel in fwd + bwd:
        real = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _real=real, _k=kernel, **kw: calls.append(_k) or _real(*a, **kw))
    fake = FakeCuda(monkeypatch, kernels=True).install() if DEV == "cpu" else None
    seed = int(torch.randint(0, 2**31, (), generator=gen))

    def run(backend, dtype, device, grad):
        inp = fw.example_inputs("titans", batch_size=2, seq_len=23, num_heads=2, head_dim=16, dtype=dtype,
                                device=device, seed=seed, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            o, final = fw.chunk("titans", backend=backend, output_final_state=True, **inp)
        assert final.offset == 23 % 16
        outs = [o, *final.weights, *final.momentum, *final.anchor]
        if not grad:
            return outs, []
        leaves = [val for key, val in inp.items() if key != "initial_state"]
        g = torch.Generator().manual_seed(seed)
        loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
        return [t.detach() for t in outs], list(torch.autograd.grad(loss, leaves))

    for grad in (False, True):
        ref_outs, ref_grads = run("torch", torch.float64, "cpu", grad)
        for backend in ("triton", "auto"):
            before = len(calls)
            outs, grads = run(backend, torch.float32, DEV, grad)
            assert calls[before:] == fwd + bwd * grad, (backend, grad)
            assert len(outs) == len(ref_outs) == 7 and len(grads) == len(ref_grads)
            for a, b in zip(outs + grads, ref_outs + ref_grads):
                assert rel(a.double().cpu(), b) < CHUNK_F32_REL
    if fake is not None:
        assert ("generic", "chunk", "triton") in fake.calls
    inp = fw.example_inputs("titans", batch_size=1, seq_len=8, num_heads=2, head_dim=16, device=DEV)
    with pytest.raises(fw.FormNotAvailable, match="cu_seqlens"):
        row = DISPATCH[("generic", "chunk", "triton")]
        row.fn(row_call("titans", inp), cu_seqlens=torch.tensor([0, 3, 8], device=DEV))


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_titans_layer_on_the_kernels_equals_it_on_torch(monkeypatch, gen, pipeline):
    """A MemoryMixer("titans") whose memory runs on the Triton row (the fake CUDA table on the CPU) against the same
    layer on the torch row: output and every parameter gradient (its initial memory, the gates' projections) — the
    tensors a layer hands the row (expanded states, gates from its projections). Head dim 16: the single pipeline, or
    the split one with the launch table's titans_single_fwd MAX_DIM lowered under it."""
    from fastweights.kernels.triton.memories import titans, titans_single

    if pipeline == "split":
        monkeypatch.setitem(LAUNCH["titans_single_fwd"], "MAX_DIM", 8)
    fn = (titans if pipeline == "split" else titans_single)._Titans
    layer_on_kernels_equals_torch(monkeypatch, gen, "titans", fn, TITANS_LAYER_F32_REL)
