"""fastweights.kernels.triton.memories.ttt (TTT-Linear's inner mini-batch loop, forward and backward kernels) against
its torch twin `ttt_linear_torch` (chunkwise.minibatch, float64) and the float64 recurrence
(reference.recurrent through `fw.recurrent`): outputs, final weights and anchor, and every gradient — q, k,
v, the inner learning rates β, the LayerNorm's γ and β_ln, the initial weights and anchor; lengths that are
no multiple of the mini-batch, a carried mini-batch (offset > 0), chained calls, grouped heads, fp32, bf16
and fp16 inputs. The split launches alone: the state pass's per-mini-batch anchors against the twin's weights, the
readout and the backward's pre-pass on random anchors against the primal-form readout twin (`ttt_linear_readout_torch`).
Then the dispatch row ("generic", "chunk", "triton") that serves TTT-Linear with them.

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes (D = 16 and 20, T ≤ 41); kernel
outputs are NaN-poisoned (tests/conftest.py). Fresh random inputs every run; the seed is printed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.dispatch import DISPATCH, Target
from fastweights.inputs import InputError
from fastweights.kernels.rows import triton_generic_supports
from fastweights.kernels.triton.common.util import LAUNCH
from fastweights.kernels.triton.memories.ttt import ttt_linear_triton
from fastweights.state import MemoryState
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV, rel
from tests.kernels.memories.layers import layer_on_kernels_equals_torch, row_call
from tests.kernels.memories.twins import ttt_linear_torch
from tests.tolerances import BF16_CAST_REL, CHUNK_F32_REL, CHUNK_LONG_F32_REL, F32, TTT_LAYER_F32_REL, TTT_LOW_REL

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def one_program(monkeypatch):
    """These tests hold the one-program sequential passes (`_state_kernel`, `_bwd_kernel`): the launch table's auto
    rule would give their small grids to the sliced ones (tests/kernels/memories/test_triton_ttt_linear_sliced.py
    holds those)."""
    monkeypatch.setitem(LAUNCH["ttt_linear_sliced"], "ON", 0)


SCALE = 0.7
NAMES = ("q", "k", "v", "beta", "lnw", "lnb", "W", "b", "A", "a")


def _inputs(gen, *, B=1, T=37, Hq=1, H=2, D=16):
    """Float64 inputs as TTT-Linear's layer makes them (unit q, k; β ∈ (0, 0.1)), a random state and anchor."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {"q": F.normalize(rnd(B, T, Hq, D), dim=-1), "k": F.normalize(rnd(B, T, Hq, D), dim=-1),
            "v": rnd(B, T, H, D), "beta": 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64),
            "lnw": 1 + 0.1 * rnd(H, D), "lnb": 0.1 * rnd(H, D), "W": rnd(B, H, D, D) / D ** 0.5,
            "b": 0.1 * rnd(B, H, 1, D), "A": rnd(B, H, D, D) / D ** 0.5, "a": 0.1 * rnd(B, H, 1, D)}


def _kernel(x, offset, b=16):
    return ttt_linear_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=SCALE,
                             weights=(x["W"], x["b"]), anchor=(x["A"], x["a"]) if offset else None, offset=offset,
                             minibatch=b)


def _twin(x, offset, b=16):
    return ttt_linear_torch(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=SCALE,
                            weights=(x["W"], x["b"]), anchor=(x["A"], x["a"]) if offset else None, offset=offset,
                            minibatch=b)


def _recurrence(x, offset, b=16):
    """The float64 per-token recurrence of TTT-Linear (`fw.recurrent`) on the same contract (b = 16)."""
    assert b == 16
    G = x["v"].shape[2] // x["q"].shape[2]
    st = MemoryState(weights=(x["W"], x["b"]), anchor=(x["A"], x["a"]) if offset else None, offset=offset)
    o, final = fw.recurrent("ttt_linear", x["q"].repeat_interleave(G, 2), x["k"].repeat_interleave(G, 2), x["v"],
                            scale=SCALE, beta=x["beta"], ln_weight=x["lnw"], ln_bias=x["lnb"], initial_state=st,
                            output_final_state=True)
    return o, final.weights, final.anchor, final.offset


def _run(fn, x, offset, seed, dtype=None, b=16):
    """(outputs [o, W_T, b_T, anchor W, anchor b], final offset, {name: gradient}) of `fn` on x (cast to
    `dtype` for q, k, v, moved to DEV) under a random float64 projection of every output drawn from `seed`."""
    leaves = {}
    for name, val in x.items():
        val = val.to(dtype) if dtype is not None and name in ("q", "k", "v") else val
        leaves[name] = val.to(DEV).requires_grad_(True)
    o, (W, bias), (A, a), off = fn(leaves, offset, b)
    outs = [o, W, bias, A, a]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
    used = [n for n in NAMES if offset or n not in ("A", "a")]
    grads = torch.autograd.grad(loss, [leaves[n] for n in used])
    return [t.detach() for t in outs], off, dict(zip(used, grads))


def _agree(got, want, tol):
    (o1, off1, g1), (o2, off2, g2) = got, want
    assert off1 == off2
    for name, a, b in zip(("o", "W_T", "b_T", "anchor W", "anchor b"), o1, o2):
        assert rel(a, b) < tol, f"{name}: {rel(a, b):.3g}"
    assert set(g1) == set(g2)
    for name in g2:
        assert rel(g1[name], g2[name]) < tol, f"d{name}: {rel(g1[name], g2[name]):.3g}"


def _fp32(x):
    return {name: val.float() for name, val in x.items()}


@pytest.mark.parametrize("T, offset, Hq", [(37, 0, 1), (41, 5, 2), (16, 0, 2), (3, 9, 1), (11, 5, 1)])
def test_kernels_equal_the_twin_and_the_recurrence(gen, T, offset, Hq):
    """fp32 kernels against float64: T = 37 and 41 (no multiple of 16), T = 16 (one whole mini-batch), T = 3 inside a
    carried mini-batch (offset 9: the call ends mid-batch), T = 11 completing a carried one (offset 5: the call ends
    on the mini-batch's end); grouped heads (H_q = 1, H = 2) and plain ones."""
    x = _inputs(gen, T=T, Hq=Hq)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    got = _run(_kernel, _fp32(x), offset, seed)
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, _run(_recurrence, x, offset, seed), CHUNK_F32_REL)


def test_a_padded_head_dim_and_a_longer_mini_batch(monkeypatch, gen):
    """D = 20 (padded to a 32-wide tile: the LayerNorms must see only the D real columns) and b = 32, the readout
    reading the anchor in 16-row blocks (util.LAUNCH's BK: two blocks, the second partly padding); without gradients
    (no_grad) the same two launches (the state pass, then the readout over every mini-batch and head) return the
    same."""
    import copy

    from fastweights.kernels.triton.common import util
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    monkeypatch.setattr(util, "LAUNCH", copy.deepcopy(util.LAUNCH))
    util.LAUNCH["ttt_linear_readout"]["BK"] = 16
    grids = []
    for kern in (ttt_mod._state_kernel, ttt_mod._readout_kernel):
        real = kern.run
        monkeypatch.setattr(kern, "run", lambda *a, _r=real, _n=kern.__name__, **kw: grids.append(
            (_n, tuple(kw["grid"]), kw.get("BK"))) or _r(*a, **kw))
    x = _inputs(gen, T=41, Hq=2, D=20)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    got = _run(_kernel, _fp32(x), 7, seed, b=32)
    _agree(got, _run(_twin, x, 7, seed, b=32), CHUNK_F32_REL)
    with torch.no_grad():
        o, weights, anchor, _ = _kernel(_fp32(x), 7, b=32)
    # (7 + 41 tokens: 2 mini-batches of 32; H = 2)
    launches = [("_state_kernel", (2,), None), ("_readout_kernel", (2, 2), 16)]
    assert grids == launches * 2
    for a, b in zip((o, *weights, *anchor), got[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(gen, dtype, monkeypatch):
    """bf16 / fp16 q, k, v (β, the LayerNorm's affine and the state fp32, as a layer passes them) against the
    float64 twin on the same rounded values: the kernels compute in fp32 and round o and dq, dk, dv to `dtype`;
    tl.dot's default precision follows the inputs (bf16: one TF32 product; fp16: tf32x3, `limits.loop_precision`)."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    precisions, apply = [], ttt_mod._TTTLinear.apply
    monkeypatch.setattr(ttt_mod._TTTLinear, "apply", lambda *a: precisions.append(a[-1]) or apply(*a))
    x = _inputs(gen, T=37, Hq=1)
    x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    got = _run(_kernel, _fp32(x), 5, seed, dtype=dtype)
    assert got[0][0].dtype == dtype
    assert precisions == ["tf32" if dtype == torch.bfloat16 else "tf32x3"]
    _agree(got, _run(_twin, x, 5, seed), TTT_LOW_REL[dtype])


def test_chained_calls_equal_one_call(gen):
    """T = 41 as 21 + 20 tokens (the second call continues the mini-batch the first left at 5 tokens), the state
    passed between the calls: outputs, final state and every gradient of the chain equal one call's."""
    x = _inputs(gen, T=41, Hq=1)
    seed = int(torch.randint(0, 2**31, (), generator=gen))

    def chained(leaves, offset, b):
        first = {n: (v[:, :21] if n in ("q", "k", "v", "beta") else v) for n, v in leaves.items()}
        o1, w1, a1, off1 = _kernel(first, offset, b)
        assert off1 == 5
        second = {n: (v[:, 21:] if n in ("q", "k", "v", "beta") else v) for n, v in leaves.items()}
        second.update(W=w1[0], b=w1[1], A=a1[0], a=a1[1])
        o2, w2, a2, off2 = _kernel(second, off1, b)
        return torch.cat([o1, o2], dim=1), w2, a2, off2

    _agree(_run(chained, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("offset", [0, 5])
def test_varlen_equals_each_sequence_alone(gen, offset):
    """cu_seqlens packing 5 sequences (an empty one, a length-1 one, one of exactly 16, one past a mini-batch):
    each with its own state row and mini-batches from its own start equals the twin on that sequence alone —
    outputs, each final state, every gradient; the final offsets are each sequence's. (The kernels serve varlen; the
    dispatch row does not yet: a MemoryState carries one offset, and the torch row refuses it.)"""
    varlen_agrees(gen, offset)


def varlen_agrees(gen, offset, D=None):
    """`test_varlen_equals_each_sequence_alone`'s check at head dim D (None: `_inputs`' default) on the kernels the
    launch table picks now (the sliced passes' test runs it at D 32 over 2 slices)."""
    lengths = [9, 0, 37, 1, 16]
    cu = torch.tensor([0] + lengths).cumsum(0)
    N, T = len(lengths), sum(lengths)
    kw = {} if D is None else {"D": D}
    x = _inputs(gen, B=1, T=T, Hq=1, **kw)
    x.update({n: _inputs(gen, B=N, T=1, Hq=1, **kw)[n] for n in ("W", "b", "A", "a")})  # a state row a sequence
    seed = int(torch.randint(0, 2**31, (), generator=gen))

    def packed(leaves, off, b):
        return ttt_linear_triton(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lnw"], leaves["lnb"],
                                 scale=SCALE, weights=(leaves["W"], leaves["b"]),
                                 anchor=(leaves["A"], leaves["a"]) if off else None, offset=off, minibatch=b,
                                 cu_seqlens=cu.to(DEV))

    def alone(leaves, off, b):
        outs, parts = [], []
        for i, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            one = {n: (val[:, s0:s1] if n in ("q", "k", "v", "beta") else val[i:i + 1] if n in "WbAa" else val)
                   for n, val in leaves.items()}
            if s1 == s0:  # no token: the state as it was (with no carried mini-batch its anchor is its weights)
                outs.append(one["v"])
                parts.append(((one["W"], one["b"]), (one["A"], one["a"]) if off else (one["W"], one["b"]), off))
                continue
            o, w, a, o_off = _twin(one, off, b)
            outs.append(o)
            parts.append((w, a, o_off))
        cat = [torch.cat(t, dim=0) for t in zip(*[(w[0], w[1], a[0], a[1]) for w, a, _ in parts])]
        return torch.cat(outs, dim=1), (cat[0], cat[1]), (cat[2], cat[3]), [p[2] for p in parts]

    got = _run(packed, _fp32(x), offset, seed)
    assert got[1] == [(offset + n) % 16 for n in lengths]
    _agree(got, _run(alone, x, offset, seed), CHUNK_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(2, 300, 2, 64, 0), (1, 1000, 3, 128, 7), (4, 515, 2, 32, 11)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
def test_cuda_realistic(gen, size, dtype):
    """On the GPU (Hopper + Triton 3.6 is where miscompiles hide): the kernels against the float64 twin at
    realistic shapes, outputs, final state and every gradient; bf16 inputs against the twin on the same rounded
    values. (Not run yet: written for the GPU session's `pytest -m cuda`.)"""
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, D=D)
    if dtype != torch.float32:
        x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    got = _run(_kernel, _fp32(x), offset, seed, dtype=dtype)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TTT_LOW_REL[dtype]
    _agree(got, _run(_twin, x, offset, seed), tol)


def _split_inputs(gen, offset):
    """Float64 inputs (B 2, T 37, grouped heads H_q 1 → H 2, D 16, b 16) with a carried mini-batch's sums (P_0, p_0
    as the glue forms them; zero without an offset), and the forward's plan and constexprs, fp32 tensors."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    x = _inputs(gen, B=2, T=37, Hq=1)
    P0 = offset * (x["W"] - x["A"]) if offset else torch.zeros_like(x["W"])
    p0 = (offset * (x["b"] - x["a"]) if offset else torch.zeros_like(x["b"])).squeeze(2)
    f = {n: val.float().contiguous().to(DEV) for n, val in x.items()}
    plan = ttt_mod._plan(2, 37, offset, 16, None, DEV)
    geo = ttt_mod._geo(f["q"], f["v"], 16, None, ttt_mod.PRECISION)
    return x, P0, p0, f, plan, geo


@pytest.mark.parametrize("offset", [0, 5])
def test_the_readout_alone_equals_its_twin_on_random_anchors(gen, offset):
    """`_readout` (the forward's parallel kernel) on random anchors — one per mini-batch, no recurrence between them —
    against the primal-form twin (each token's own weights A + P_i / i, e by autograd): every mini-batch is read
    from its own stored anchor alone, the carried sums (offset 5) enter only the first."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod
    from tests.kernels.memories.twins import ttt_linear_readout_torch

    x, P0, p0, f, plan, geo = _split_inputs(gen, offset)
    NS, H, D = plan.NS, 2, 16
    A = torch.randn(2, NS, H, D, D, generator=gen, dtype=torch.float64) / D ** 0.5
    a = 0.1 * torch.randn(2, NS, H, D, generator=gen, dtype=torch.float64)
    ckA, cka = (t.float().reshape(-1, *t.shape[2:]).contiguous().to(DEV) for t in (A, a))  # slot b·NS + s
    o = ttt_mod._readout(f["q"], f["k"], f["v"], f["beta"], f["lnw"], f["lnb"], P0.float().to(DEV),
                         p0.float().to(DEV), ckA, cka, scale=SCALE, T=37, offset=offset, cu=None, plan=plan, geo=geo)
    want = ttt_linear_readout_torch(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], (A, a), (P0, p0),
                                    scale=SCALE, offset=offset, minibatch=16)
    assert rel(o, want) < CHUNK_F32_REL


@pytest.mark.parametrize("offset", [0, 5])
def test_the_backward_pre_pass_alone_gives_dq(gen, offset):
    """`_bwd_read` (the backward's parallel pre-pass) on random anchors gives the whole dq — the queries enter only
    the readout — equal to the gradient of the primal-form readout twin under a random do, grouped heads summed; the
    carried sums (offset 5) enter the first mini-batch's."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod
    from tests.kernels.memories.twins import ttt_linear_readout_torch

    x, P0, p0, f, plan, geo = _split_inputs(gen, offset)
    NS, H, D = plan.NS, 2, 16
    A = torch.randn(2, NS, H, D, D, generator=gen, dtype=torch.float64) / D ** 0.5
    a = 0.1 * torch.randn(2, NS, H, D, generator=gen, dtype=torch.float64)
    do = torch.randn(2, 37, H, D, generator=gen, dtype=torch.float64)
    ckA, cka = (t.float().reshape(-1, *t.shape[2:]).contiguous().to(DEV) for t in (A, a))
    dq = ttt_mod._bwd_read(f["q"], f["k"], f["v"], f["beta"], f["lnw"], f["lnb"], P0.float().to(DEV),
                           p0.float().to(DEV), ckA, cka, do.float().to(DEV), scale=SCALE, T=37, offset=offset,
                           cu=None, plan=plan, geo=geo)[0]
    q = x["q"].clone().requires_grad_(True)
    o = ttt_linear_readout_torch(q, x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], (A, a), (P0, p0), scale=SCALE,
                                 offset=offset, minibatch=16)
    want, = torch.autograd.grad((o * do).sum(), q)
    assert rel(dq.sum(2, keepdim=True), want) < CHUNK_F32_REL


@pytest.mark.parametrize("offset", [0, 5])
def test_the_state_pass_stores_every_mini_batch_anchor(gen, offset):
    """`_state_pass` (the forward's sequential kernel) stores mini-batch s's anchor in slot b·NS + s: the first the
    initial anchor, each later one the twin's weights after the tokens before it (a call ending on that mini-batch's
    start); its end outputs (A, a, P, p) give the twin's final weights A + P / i."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    x, P0, p0, f, plan, geo = _split_inputs(gen, offset)
    A0, a0 = (f["A"], f["a"]) if offset else (f["W"], f["b"])
    ckA, cka, A, a, P, p = ttt_mod._state_pass(f["k"], f["v"], f["beta"], f["lnw"], f["lnb"], A0, a0.squeeze(2),
                                               P0.float().to(DEV), p0.float().to(DEV), T=37, offset=offset, cu=None,
                                               plan=plan, geo=geo)
    ckA, cka = ckA.view(2, plan.NS, 2, 16, 16), cka.view(2, plan.NS, 2, 16)
    assert rel(ckA[:, 0], A0) < CHUNK_F32_REL and rel(cka[:, 0], a0.squeeze(2)) < CHUNK_F32_REL
    for s in range(1, plan.NS):
        n = 16 * s - offset  # the tokens before mini-batch s
        part = {name: (val[:, :n] if name in ("q", "k", "v", "beta") else val) for name, val in x.items()}
        _, (W, bias), _, off = _twin(part, offset)
        assert off == 0
        assert rel(ckA[:, s], W) < CHUNK_F32_REL, s
        assert rel(cka[:, s], bias.squeeze(2)) < CHUNK_F32_REL, s
    _, (W, bias), _, _ = _twin(x, offset)
    last = (offset + 37) - 16 * (plan.NS - 1)
    assert rel(A + P / last, W) < CHUNK_F32_REL and rel(a + p / last, bias.squeeze(2)) < CHUNK_F32_REL


def test_the_kernels_refuse_what_they_do_not_take(gen):
    x = _fp32(_inputs(gen, T=5, Hq=1))
    with pytest.raises(InputError, match="mini-batch b in"):
        _kernel(x, 0, b=8)
    with pytest.raises(InputError, match="offset > 0 needs the anchor"):
        ttt_linear_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0, weights=(x["W"], x["b"]),
                          offset=3)
    with pytest.raises(InputError, match="ln_weight"):
        ttt_linear_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"][:1], x["lnb"], scale=1.0,
                          weights=(x["W"], x["b"]))
    big = torch.zeros(1, 2, 1, 130)
    with pytest.raises(InputError, match="head dims D ≤ 128"):
        ttt_linear_triton(big, big, big, torch.zeros(1, 2, 1), torch.ones(1, 130), torch.zeros(1, 130), scale=1.0,
                          weights=(torch.zeros(1, 1, 130, 130), torch.zeros(1, 1, 1, 130)))


# ---------------------------------------------------------------------------- the dispatch row
def test_the_generic_row_serves_ttt_linear_on_cuda_and_refuses_the_rest():
    cuda = Target.of("cuda", torch.bfloat16, 64, 64)
    recipe = fw.zoo.get("ttt_linear")
    assert triton_generic_supports(recipe, cuda) is None
    assert fw.pipeline("ttt_linear", device="cuda", dtype=torch.bfloat16, head_dim=64) == (
        "triton", "TTT-Linear kernels (tf32)")  # bf16 inputs: one TF32 product per dot (limits.loop_precision)
    wider = (torch.float32, torch.float16)
    assert [fw.pipeline("ttt_linear", device="cuda", dtype=dt, head_dim=64)[1] for dt in wider] \
        == ["TTT-Linear kernels (tf32x3)"] * 2
    assert fw.pipeline("atlas", device="cuda", dtype=torch.float32, head_dim=8)[1].startswith("Newton–Schulz")
    assert "head dims ≤ 128" in triton_generic_supports(recipe, Target.of("cuda", torch.bfloat16, 256, 256))
    assert "TTT-Linear" in triton_generic_supports(fw.zoo.get("omeganet"), cuda)  # another loop: the torch row
    assert "CUDA" in triton_generic_supports(recipe, Target.of("cpu", torch.float32, 64, 64))
    assert "float64" in triton_generic_supports(recipe, Target.of("cuda", torch.float64, 64, 64))
    import dataclasses

    b8 = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, minibatch=8))
    assert "mini-batch b in" in triton_generic_supports(b8, cuda)
    from fastweights.kernels import rows

    with rows.pinned("generic", precision="tf32x3"):  # the row's kernels at that tl.dot precision
        assert fw.pipeline("ttt_linear", device="cuda", dtype=torch.bfloat16, head_dim=64)[1] == \
            "TTT-Linear kernels (tf32x3)"
        atlas = fw.pipeline("atlas", device="cuda", dtype=torch.float32, head_dim=8)
        assert atlas[1] == "Newton–Schulz kernel (tf32x3)"


def test_fw_chunk_takes_the_kernels_through_the_row(monkeypatch, gen):
    """fw.chunk("ttt_linear") on a (fake, on the CPU) CUDA device routes to the Triton row ("auto" and by name),
    which runs the kernels: output, final state and every gradient (the LayerNorm's affine and the initial state's
    tensors included) equal the torch row's in float64; varlen is refused as the torch row refuses it."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    calls = []
    real = ttt_mod._TTTLinear.apply
    monkeypatch.setattr(ttt_mod._TTTLinear, "apply", lambda *a: calls.append(1) or real(*a))
    fake = FakeCuda(monkeypatch, kernels=True).install() if DEV == "cpu" else None
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    results = {}
    for backend, dtype, device in (("torch", torch.float64, "cpu"), ("triton", torch.float32, DEV),
                                   ("auto", torch.float32, DEV)):
        inp = fw.example_inputs("ttt_linear", batch_size=2, seq_len=23, num_heads=2, head_dim=16, dtype=dtype,
                                device=device, seed=seed, requires_grad=True)
        st = inp["initial_state"]
        inp["initial_state"] = MemoryState(weights=tuple(w.requires_grad_(True) for w in st.weights))
        leaves = [val for key, val in inp.items() if key != "initial_state"] + list(inp["initial_state"].weights)
        o, final = fw.chunk("ttt_linear", backend=backend, output_final_state=True, **inp)
        assert final.offset == 23 % 16
        outs = [o, *final.weights, *final.anchor]
        g = torch.Generator().manual_seed(seed)
        loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
        results[backend] = ([t.detach() for t in outs], torch.autograd.grad(loss, leaves))
    assert len(calls) == 2  # "triton" and "auto" ran the kernels
    if fake is not None:
        assert ("generic", "chunk", "triton") in fake.calls
    ref_outs, ref_grads = results["torch"]
    for backend in ("triton", "auto"):
        outs, grads = results[backend]
        for a, b in zip(outs + list(grads), ref_outs + list(ref_grads)):
            assert rel(a, b) < CHUNK_F32_REL
    inp = fw.example_inputs("ttt_linear", batch_size=1, seq_len=8, num_heads=2, head_dim=16, device=DEV)
    bare = {key: val for key, val in inp.items() if key not in ("beta", "ln_weight", "ln_bias")}  # the defaults
    o1, s1 = fw.chunk("ttt_linear", backend="triton", output_final_state=True, **bare)
    o2, s2 = DISPATCH[("generic", "chunk", "torch")].fn(row_call("ttt_linear", bare))
    assert rel(o1, o2) < CHUNK_F32_REL and rel(s1.weights[0], s2.weights[0]) < CHUNK_F32_REL
    with pytest.raises(fw.FormNotAvailable, match="cu_seqlens"):
        row = DISPATCH[("generic", "chunk", "triton")]
        row.fn(row_call("ttt_linear", inp), cu_seqlens=torch.tensor([0, 3, 8], device=DEV))


def test_a_ttt_linear_layer_on_the_kernels_equals_it_on_torch(monkeypatch, gen):
    """A MemoryMixer("ttt_linear") whose memory runs on the Triton row (the fake CUDA table on the CPU) against the
    same layer on the torch row: output and every parameter gradient (its initial memory, the inner learning rate's
    projection, the LayerNorm's affine) — the tensors a layer hands the row (expanded states, parameters)."""
    from fastweights.kernels.triton.memories import ttt as mod

    layer_on_kernels_equals_torch(monkeypatch, gen, "ttt_linear", mod._TTTLinear, TTT_LAYER_F32_REL)


def test_last_counts_is_a_number_when_every_sequence_ends_alike():
    """The glue divides the end sums by each sequence's last mini-batch count: a Python number when they agree
    (no host-to-device copy: a CUDA graph can capture the call — TTT-MLP's copy failed the lab's capture on the
    H100), a [R, 1, 1, 1] tensor for varlen sequences that end differently."""
    from fastweights.kernels.triton.memories.ttt import _last_counts, _plan

    same = _last_counts(_plan(3, 37, 0, 16, None, "cpu"), 4, "cpu")
    assert isinstance(same, float) and same == 5.0
    mixed = _last_counts(_plan(0, 0, 0, 16, [0, 20, 53], "cpu"), 4, "cpu")
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (2, 1, 1, 1) and mixed.flatten().tolist() == [4.0, 1.0]



@pytest.fixture(params=[(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 1), (1, 1, 2)],
                ids=["in-memory", "carry", "direct", "post", "post-g-dtype"])
def bwd_variant(request, monkeypatch):
    """The backward's launch-table variants other than the default (util.LAUNCH "ttt_linear_bwd" CARRY 1, DIRECT 1,
    POST 0 since r4s15, which every other test runs): CARRY 0 — the reverse pass accumulating the anchor's gradient in
    memory (`_bwd_kernel`; 1: carried in registers, `_bwd_carry_kernel`); DIRECT 0 — do cast to fp32, dq and dv cast
    back by the glue (1: read and written in the inputs' dtypes by the kernels); POST 1 — the pre-pass storing
    f = k A + a (`_bwd_read_f_kernel`), the chain-only reverse pass (`_bwd_chain_kernel`) storing each mini-batch's
    b·G (fp32) and df, dk's other products in parallel after (`_bwd_post_kernel`); POST 2 — b·G stored in bf16 for
    bf16 inputs. Yields (the kernels that must run, the backward kernels that ran)."""
    from fastweights.kernels.triton.memories import ttt as ttt_mod

    carry, direct, post = request.param
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "CARRY", carry)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "DIRECT", direct)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "POST", post)
    ran = []
    for kern in (ttt_mod._bwd_kernel, ttt_mod._bwd_carry_kernel, ttt_mod._bwd_chain_kernel, ttt_mod._bwd_post_kernel,
                 ttt_mod._bwd_read_kernel, ttt_mod._bwd_read_f_kernel):
        monkeypatch.setattr(kern, "run", lambda *a, _r=kern.run, _n=kern.__name__, **kw: ran.append(_n) or _r(*a, **kw))
    if post:
        want = {"_bwd_read_f_kernel", "_bwd_chain_kernel", "_bwd_post_kernel"}
    else:
        want = {"_bwd_read_kernel", "_bwd_carry_kernel" if carry else "_bwd_kernel"}
    return want, ran


def _ran_only(bwd_variant):
    want, ran = bwd_variant
    assert ran and set(ran) == want


@pytest.mark.parametrize("T, offset, Hq", [(37, 0, 1), (41, 5, 2), (3, 9, 1), (11, 5, 1)])
def test_the_backward_variants_equal_float64(bwd_variant, gen, T, offset, Hq):
    """Each variant against the float64 twin and recurrence (outputs, final states, every gradient: q, k, v, β, γ,
    β_ln, the initial weights and anchor): odd lengths, a carried mini-batch (P_0's gradient), grouped heads."""
    test_kernels_equal_the_twin_and_the_recurrence(gen, T, offset, Hq)
    _ran_only(bwd_variant)


def test_the_backward_variants_chained_varlen_padded_and_bf16(bwd_variant, gen, monkeypatch):
    """Each variant on the other cases of this file: chained calls, varlen (an empty and a length-1 sequence, with and
    without a carried mini-batch), D 20 padded with b 32, bf16 inputs (one TF32 product a dot)."""
    test_chained_calls_equal_one_call(gen)
    varlen_agrees(gen, 0)
    varlen_agrees(gen, 5)
    test_a_padded_head_dim_and_a_longer_mini_batch(monkeypatch, gen)
    test_low_precision_inputs(gen, torch.bfloat16, monkeypatch)
    _ran_only(bwd_variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 5])
def test_the_backward_variants_equal_the_default(gen, monkeypatch, offset, dtype):
    """CARRY 1 with DIRECT 1 (the default) gives CARRY 0 with DIRECT 0's outputs and gradients bitwise under the
    interpreter: the same products in the same order, the 1/b of G folded into k and η e (exact: b is a power of two).
    With bf16 inputs dq and dv are rounded to bf16 in the kernels instead of by the glue: to nearest on the GPU, as
    torch does (equal there), by truncation under the interpreter — one bf16 ulp apart at most (BF16_CAST_REL)."""
    assert (LAUNCH["ttt_linear_bwd"]["CARRY"], LAUNCH["ttt_linear_bwd"]["DIRECT"]) == (1, 1)
    x = _fp32(_inputs(gen, B=2, T=41, Hq=1))
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    got = _run(_kernel, x, offset, seed, dtype=dtype)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "CARRY", 0)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "DIRECT", 0)
    want = _run(_kernel, x, offset, seed, dtype=dtype)
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b)
    for name in want[2]:
        assert got[2][name].dtype == want[2][name].dtype, name
        if dtype == torch.bfloat16 and name in ("q", "v"):
            assert rel(got[2][name], want[2][name]) <= BF16_CAST_REL, name
        else:
            assert torch.equal(got[2][name], want[2][name]), name


@pytest.mark.parametrize("offset", [0, 5])
def test_the_chain_only_backward_equals_the_default(gen, monkeypatch, offset):
    """POST 1 (the chain-only reverse pass and dk's two other products after it) against POST 0's reverse pass,
    fp32 inputs: the forward untouched and every gradient but dk bitwise (at D 16 the pre-pass forms f = k A + a in
    one BK block, as the reverse pass's one product), dk within fp32 roundings (its terms added in another order);
    POST 2 (the default) stores b·G in bf16 for bf16 inputs only: with these, bitwise POST 1."""
    assert LAUNCH["ttt_linear_bwd"]["POST"] == 2
    x = _fp32(_inputs(gen, B=2, T=41, Hq=1))
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "POST", 0)
    want = _run(_kernel, x, offset, seed)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "POST", 1)
    got = _run(_kernel, x, offset, seed)
    monkeypatch.setitem(LAUNCH["ttt_linear_bwd"], "POST", 2)
    got2 = _run(_kernel, x, offset, seed)
    for a, b, c in zip(got[0], want[0], got2[0]):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert rel(got[2][name], want[2][name]) < F32 if name == "k" else torch.equal(got[2][name], want[2][name]), name
        assert torch.equal(got[2][name], got2[2][name]), name


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(2, 300, 2, 64, 0), (1, 1000, 3, 128, 7)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
def test_cuda_backward_variants(bwd_variant, gen, size, dtype):
    """On the GPU: each variant against the float64 twin at realistic shapes (`test_cuda_realistic`'s check)."""
    test_cuda_realistic(gen, size, dtype)
    _ran_only(bwd_variant)
