"""kernels.triton.memories.ttt_mlp (TTT-MLP's inner mini-batch loop, forward and backward kernels) against its
torch twin `ttt_mlp_torch` (chunkwise.minibatch, float64) and the float64 recurrence (reference.recurrent through
`fw.recurrent`): outputs, final weights and anchor, and every gradient — q, k, v, the inner learning rates β, the
LayerNorm's γ and β_ln, the initial weights (W1, b1, W2, b2) and anchor; lengths that are no multiple of the
mini-batch, a carried mini-batch (offset > 0), chained calls, varlen, grouped heads, several hidden tiles (and a partial
one), fp32, bf16 and fp16 inputs. Then the dispatch row ("generic", "chunk", "triton") that serves TTT-Linear and
TTT-MLP with their kernels.

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes (D = 16 and 20, F = 4D, T ≤ 41); kernel
outputs are NaN-poisoned (tests/conftest.py). Fresh random inputs every run; the seed is printed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.dispatch import DISPATCH, Target
from fastweights.inputs import InputError
from fastweights.kernels.rows import triton_generic_supports, ttt_mlp_kernel_serves
from fastweights.kernels.triton.common.util import LAUNCH
from fastweights.kernels.triton.memories.ttt_mlp import ttt_mlp_triton
from fastweights.state import MemoryState
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV, rel
from tests.kernels.memories.layers import layer_on_kernels_equals_torch, row_call
from tests.kernels.memories.twins import ttt_mlp_torch
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, TTT_LAYER_F32_REL, TTT_LOW_REL

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def one_program(monkeypatch):
    """These tests hold the one-program kernels (`_fwd_kernel`, `_bwd_kernel`): the launch table's auto rule would give
    their small grids to the sliced kernels (tests/kernels/memories/test_triton_ttt_mlp_sliced.py holds those)."""
    monkeypatch.setitem(LAUNCH["ttt_mlp_sliced"], "ON", 0)

SCALE = 0.7
STATE = ("W1", "b1", "W2", "b2")
ANCHOR = ("A1", "a1", "A2", "a2")
NAMES = ("q", "k", "v", "beta", "lnw", "lnb") + STATE + ANCHOR
SEQ = ("q", "k", "v", "beta")


def _inputs(gen, *, B=1, T=37, Hq=1, H=2, D=16):
    """Float64 inputs as TTT-MLP's layer makes them (unit q, k; β ∈ (0, 0.1)), a random state and anchor
    (hidden width F = 4D)."""
    Fh = 4 * D

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": F.normalize(rnd(B, T, Hq, D), dim=-1), "k": F.normalize(rnd(B, T, Hq, D), dim=-1),
         "v": rnd(B, T, H, D), "beta": 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64),
         "lnw": 1 + 0.1 * rnd(H, D), "lnb": 0.1 * rnd(H, D)}
    for names in (STATE, ANCHOR):
        x.update(zip(names, (rnd(B, H, D, Fh) / D ** 0.5, 0.1 * rnd(B, H, 1, Fh), rnd(B, H, Fh, D) / Fh ** 0.5,
                             0.1 * rnd(B, H, 1, D))))
    return x


def _state(x, offset):
    return dict(weights=tuple(x[n] for n in STATE), anchor=tuple(x[n] for n in ANCHOR) if offset else None,
                offset=offset)


def _kernel(x, offset, b=16, tile=32):
    """The kernels with hidden tiles of 32 (F = 64 at D = 16: two tiles) unless `tile` says otherwise (None: the
    glue's own, `hidden_tile`)."""
    return ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=SCALE, minibatch=b, tile=tile,
                          **_state(x, offset))


def _twin(x, offset, b=16):
    return ttt_mlp_torch(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=SCALE, minibatch=b,
                         **_state(x, offset))


def _recurrence(x, offset, b=16):
    """The float64 per-token recurrence of TTT-MLP (`fw.recurrent`) on the same contract (b = 16)."""
    assert b == 16
    G = x["v"].shape[2] // x["q"].shape[2]
    o, final = fw.recurrent("ttt_mlp", x["q"].repeat_interleave(G, 2), x["k"].repeat_interleave(G, 2), x["v"],
                            scale=SCALE, beta=x["beta"], ln_weight=x["lnw"], ln_bias=x["lnb"],
                            initial_state=MemoryState(**_state(x, offset)), output_final_state=True)
    return o, final.weights, final.anchor, final.offset


def _run(fn, x, offset, seed, dtype=None, b=16):
    """(outputs [o, the 4 end weights, the 4 anchor tensors], final offset, {name: gradient}) of `fn` on x (cast to
    `dtype` for q, k, v, moved to DEV) under a random float64 projection of every output drawn from `seed`."""
    leaves = {}
    for name, val in x.items():
        val = val.to(dtype) if dtype is not None and name in ("q", "k", "v") else val
        leaves[name] = val.to(DEV).requires_grad_(True)
    o, weights, anchor, off = fn(leaves, offset, b)
    outs = [o, *weights, *anchor]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
    used = [n for n in NAMES if offset or n not in ANCHOR]
    grads = torch.autograd.grad(loss, [leaves[n] for n in used])
    return [t.detach() for t in outs], off, dict(zip(used, grads))


def _agree(got, want, tol):
    (o1, off1, g1), (o2, off2, g2) = got, want
    assert off1 == off2
    assert len(o1) == len(o2) == 9
    for name, a, b in zip(("o",) + tuple(n + "_T" for n in STATE) + tuple("anchor " + n for n in STATE), o1, o2):
        assert rel(a, b) < tol, f"{name}: {rel(a, b):.3g}"
    assert set(g1) == set(g2)
    for name in g2:
        assert rel(g1[name], g2[name]) < tol, f"d{name}: {rel(g1[name], g2[name]):.3g}"


def _fp32(x):
    return {name: val.float() for name, val in x.items()}


def _seed(gen):
    return int(torch.randint(0, 2**31, (), generator=gen))


@pytest.mark.parametrize("T, offset, Hq, tile", [(37, 0, 1, 32), (41, 5, 2, 32), (16, 0, 2, None), (3, 9, 1, 32),
                                                (11, 5, 1, 16)])
def test_kernels_equal_the_twin_and_the_recurrence(gen, T, offset, Hq, tile):
    """fp32 kernels against float64: T = 37 and 41 (no multiple of 16), T = 16 (one whole mini-batch), T = 3 inside a
    carried mini-batch (offset 9: the call ends mid-batch), T = 11 completing a carried one (offset 5: the call ends
    on the mini-batch's end); grouped heads (H_q = 1, H = 2) and plain ones; the hidden dim F = 64 in two tiles,
    four, or the glue's own (one)."""
    x = _inputs(gen, T=T, Hq=Hq)
    seed = _seed(gen)
    got = _run(lambda leaves, off, b: _kernel(leaves, off, b, tile=tile), _fp32(x), offset, seed)
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, _run(_recurrence, x, offset, seed), CHUNK_F32_REL)


def test_a_padded_head_dim_a_partial_hidden_tile_and_a_longer_mini_batch(monkeypatch, gen):
    """D = 20 (padded to a 32-wide tile: the LayerNorms must see only the D real columns), F = 80 in tiles of 32 (the
    last one partial) and b = 32; without gradients (no_grad) the forward keeps no anchors (one slot rolled in place)
    and returns the same."""
    from fastweights.kernels.triton.memories import ttt_mlp as mod

    saves = []
    real = mod._fwd_kernel.run
    monkeypatch.setattr(mod._fwd_kernel, "run", lambda *a, **kw: saves.append(kw["SAVE"]) or real(*a, **kw))
    x = _inputs(gen, T=41, Hq=2, D=20)
    seed = _seed(gen)

    def kernel(leaves, offset, b):
        return _kernel(leaves, offset, b, tile=32)

    got = _run(kernel, _fp32(x), 7, seed, b=32)
    _agree(got, _run(_twin, x, 7, seed, b=32), CHUNK_F32_REL)
    with torch.no_grad():
        o, weights, anchor, _ = kernel(_fp32(x), 7, 32)
    assert saves == [True, False]
    for a, b in zip((o, *weights, *anchor), got[0]):
        assert torch.equal(a, b)


def test_the_hidden_tile():
    """The glue's hidden tile BF: [D, BF] weight tiles of at most TILE_ELEMENTS fp32 values, 16 ≤ BF ≤ pow2(F)."""
    from fastweights.kernels.triton.memories.ttt_mlp import hidden_tile

    assert [hidden_tile(D, 4 * D) for D in (16, 20, 32, 64, 128)] == [64, 64, 64, 32, 16]
    assert hidden_tile(16, 16) == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(gen, dtype, monkeypatch):
    """bf16 / fp16 q, k, v (β, the LayerNorm's affine and the state fp32, as a layer passes them) against the
    float64 twin on the same rounded values: the kernels compute in fp32 and round o and dq, dk, dv to `dtype`;
    tl.dot's default precision follows the inputs (bf16: one TF32 product; fp16: ieee, `limits.loop_precision`)."""
    from fastweights.kernels.triton.memories import ttt_mlp as mlp_mod

    precisions, apply = [], mlp_mod._TTTMLP.apply
    monkeypatch.setattr(mlp_mod._TTTMLP, "apply", lambda *a: precisions.append(a[-1]["PREC"]) or apply(*a))
    x = _inputs(gen, T=37, Hq=1)
    x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(_kernel, _fp32(x), 5, seed, dtype=dtype)
    assert got[0][0].dtype == dtype
    assert precisions == ["tf32" if dtype == torch.bfloat16 else "ieee"]
    _agree(got, _run(_twin, x, 5, seed), TTT_LOW_REL[dtype])


def _chained(leaves, offset, b):
    """The kernels on tokens [0, 21) then [21, T) (the first call leaves a mini-batch at 5 tokens), the state and
    anchor passed between the calls: (o, final weights, anchor, offset) as one call returns them."""
    first = {n: (v[:, :21] if n in SEQ else v) for n, v in leaves.items()}
    o1, w1, a1, off1 = _kernel(first, offset, b)
    assert off1 == 5
    second = {n: (v[:, 21:] if n in SEQ else v) for n, v in leaves.items()}
    second.update(zip(STATE, w1))
    second.update(zip(ANCHOR, a1))
    o2, w2, a2, off2 = _kernel(second, off1, b)
    return torch.cat([o1, o2], dim=1), w2, a2, off2


def test_chained_calls_equal_one_call(gen):
    """T = 41 as 21 + 20 tokens (the second call continues the mini-batch the first left at 5 tokens), the state
    passed between the calls: outputs, final state and every gradient of the chain equal one call's."""
    x = _inputs(gen, T=41, Hq=1)
    seed = _seed(gen)

    _agree(_run(_chained, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)


def _each_sequence_alone(cu):
    """The varlen tests' reference: (leaves, offset, b) -> the twin run on each sequence of the packing `cu` alone
    (its own state row, its mini-batches from its own start), as the packed call returns them: (o, final weights,
    anchors, final offsets)."""
    def alone(leaves, off, b):
        outs, parts = [], []
        for i, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            one = {n: (val[:, s0:s1] if n in SEQ else val[i:i + 1] if n in STATE + ANCHOR else val)
                   for n, val in leaves.items()}
            if s1 == s0:  # no token: the state as it was (with no carried mini-batch its anchor is its weights)
                outs.append(one["v"])
                w = tuple(one[n] for n in STATE)
                parts.append((w, tuple(one[n] for n in ANCHOR) if off else w, off))
                continue
            o, w, a, o_off = _twin(one, off, b)
            outs.append(o)
            parts.append((w, a, o_off))
        weights = tuple(torch.cat(t, dim=0) for t in zip(*[w for w, _, _ in parts]))
        anchor = tuple(torch.cat(t, dim=0) for t in zip(*[a for _, a, _ in parts]))
        return torch.cat(outs, dim=1), weights, anchor, [p[2] for p in parts]

    return alone


@pytest.mark.parametrize("offset", [0, 5])
def test_varlen_equals_each_sequence_alone(gen, offset):
    """cu_seqlens packing 5 sequences (an empty one, a length-1 one, one of exactly 16, one past a mini-batch):
    each with its own state row and mini-batches from its own start equals the twin on that sequence alone —
    outputs, each final state, every gradient; the final offsets are each sequence's. (The kernels serve varlen; the
    dispatch row does not yet: a MemoryState carries one offset, and the torch row refuses it.)"""
    lengths = [9, 0, 20, 1, 16]
    cu = torch.tensor([0] + lengths).cumsum(0)
    N, T = len(lengths), sum(lengths)
    x = _inputs(gen, B=1, T=T, Hq=1)
    x.update({n: _inputs(gen, B=N, T=1, Hq=1)[n] for n in STATE + ANCHOR})  # one state row per sequence
    seed = _seed(gen)

    def packed(leaves, off, b):
        return ttt_mlp_triton(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lnw"], leaves["lnb"],
                              scale=SCALE, minibatch=b, cu_seqlens=cu.to(DEV), **_state(leaves, off))

    got = _run(packed, _fp32(x), offset, seed)
    assert got[1] == [(offset + n) % 16 for n in lengths]
    _agree(got, _run(_each_sequence_alone(cu), x, offset, seed), CHUNK_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(4, 512, 2, 64, 0), (2, 300, 2, 64, 7), (1, 200, 3, 32, 11)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
def test_cuda_realistic(gen, size, dtype):
    """On the GPU: the kernels (their own hidden tile) against the float64 twin at realistic shapes, outputs, final
    state and every gradient; bf16 inputs against the twin on the same rounded values. (Not run yet: written for
    the GPU session's `pytest -m cuda`.)"""
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, D=D)
    if dtype != torch.float32:
        x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(lambda leaves, off, b: _kernel(leaves, off, b, tile=None), _fp32(x), offset, seed, dtype=dtype)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TTT_LOW_REL[dtype]
    _agree(got, _run(_twin, x, offset, seed), tol)


def test_the_kernels_refuse_what_they_do_not_take(gen):
    x = _fp32(_inputs(gen, T=5, Hq=1))
    with pytest.raises(InputError, match="mini-batch b in"):
        _kernel(x, 0, b=8)
    with pytest.raises(InputError, match="offset > 0 needs the anchor"):
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0,
                       weights=tuple(x[n] for n in STATE), offset=3)
    with pytest.raises(InputError, match="ln_weight"):
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"][:1], x["lnb"], scale=1.0,
                       weights=tuple(x[n] for n in STATE))
    with pytest.raises(InputError, match="weights must be 4 tensors"):
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0, weights=(x["W1"], x["b1"]))
    with pytest.raises(InputError, match=r"weights\[2\]"):
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0,
                       weights=(x["W1"], x["b1"], x["W2"][:, :, :8], x["b2"]))
    with pytest.raises(InputError, match="cu_seqlens must start at 0 and end at T=5"):
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0,
                       weights=tuple(x[n] for n in STATE), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(InputError, match=r"weights\[0\]"):  # cu_seqlens of 2 sequences: 2 state rows
        ttt_mlp_triton(x["q"], x["k"], x["v"], x["beta"], x["lnw"], x["lnb"], scale=1.0,
                       weights=tuple(x[n] for n in STATE), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(InputError, match="tile must be a power of two"):
        _kernel(x, 0, tile=24)
    big = torch.zeros(1, 2, 1, 130)
    with pytest.raises(InputError, match="head dims D ≤ 128"):
        ttt_mlp_triton(big, big, big, torch.zeros(1, 2, 1), torch.ones(1, 130), torch.zeros(1, 130), scale=1.0,
                       weights=(torch.zeros(1, 1, 130, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 4, 130),
                                torch.zeros(1, 1, 1, 130)))


# ---------------------------------------------------------------------------- the dispatch row
def test_the_generic_row_serves_ttt_mlp_on_cuda_and_refuses_the_rest():
    import dataclasses

    cuda = Target.of("cuda", torch.bfloat16, 64, 64)
    recipe = fw.zoo.get("ttt_mlp")
    assert ttt_mlp_kernel_serves(recipe) is None and triton_generic_supports(recipe, cuda) is None
    # tl.dot's precision follows the inputs (limits.loop_precision): bf16 one TF32 product, fp32 and fp16 the kernel's
    assert fw.pipeline("ttt_mlp", device="cuda", dtype=torch.bfloat16, head_dim=64) == (
        "triton", "TTT-MLP kernels (tf32)")
    assert [fw.pipeline("ttt_mlp", device="cuda", dtype=dt, head_dim=64)[1] for dt in (torch.float32, torch.float16)] \
        == ["TTT-MLP kernels (ieee)"] * 2
    assert fw.pipeline("ttt_linear", device="cuda", dtype=torch.bfloat16, head_dim=64)[1] == \
        "TTT-Linear kernels (tf32)"
    assert "TTT-MLP kernels take head dims ≤ 128" in triton_generic_supports(recipe, Target.of("cuda", torch.bfloat16,
                                                                                              256, 256))
    assert "CUDA" in triton_generic_supports(recipe, Target.of("cpu", torch.float32, 64, 64))
    mem = recipe.memory
    for other in (dataclasses.replace(mem, activation="gelu"), dataclasses.replace(mem, depth=3),
                  dataclasses.replace(mem, residual_ln=False)):
        why = ttt_mlp_kernel_serves(dataclasses.replace(recipe, memory=other))
        assert "2-layer MLP memory (GELU, tanh form)" in why
    b8 = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, minibatch=8))
    assert "TTT-MLP kernels take a mini-batch b in" in triton_generic_supports(b8, cuda)
    b2 = dataclasses.replace(fw.zoo.get("titans"), memory=dataclasses.replace(mem, residual_ln=False))
    other = triton_generic_supports(b2, cuda)  # an MLP memory with biases in Titans' loop: the torch row
    assert "TTT-Linear" in other and "TTT-MLP" in other and "Titans" in other
    from fastweights.kernels import rows

    with rows.pinned("generic", precision="tf32x3"):  # the row's kernels at that tl.dot precision
        assert fw.pipeline("ttt_mlp", device="cuda", dtype=torch.bfloat16, head_dim=64)[1] == \
            "TTT-MLP kernels (tf32x3)"


def test_fw_chunk_takes_the_kernels_through_the_row(monkeypatch, gen):
    """fw.chunk("ttt_mlp") on a (fake, on the CPU) CUDA device routes to the Triton row ("auto" and by name), which
    runs the kernels: output, final state and every gradient (the LayerNorm's affine and the initial state's tensors
    included) equal the torch row's in float64; varlen is refused as the torch row refuses it."""
    from fastweights.kernels.triton.memories import ttt_mlp as mod

    calls = []
    real = mod._TTTMLP.apply
    monkeypatch.setattr(mod._TTTMLP, "apply", lambda *a: calls.append(1) or real(*a))
    fake = FakeCuda(monkeypatch, kernels=True).install() if DEV == "cpu" else None
    seed = _seed(gen)
    results = {}
    for backend, dtype, device in (("torch", torch.float64, "cpu"), ("triton", torch.float32, DEV),
                                   ("auto", torch.float32, DEV)):
        inp = fw.example_inputs("ttt_mlp", batch_size=2, seq_len=23, num_heads=2, head_dim=16, dtype=dtype,
                                device=device, seed=seed, requires_grad=True)
        st = inp["initial_state"]
        inp["initial_state"] = MemoryState(weights=tuple(w.detach().requires_grad_(True) for w in st.weights))
        leaves = [val for key, val in inp.items() if key != "initial_state"] + list(inp["initial_state"].weights)
        o, final = fw.chunk("ttt_mlp", backend=backend, output_final_state=True, **inp)
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
        assert len(outs) + len(grads) == len(ref_outs) + len(ref_grads)
        for a, b in zip(outs + list(grads), ref_outs + list(ref_grads)):
            assert rel(a, b) < CHUNK_F32_REL
    inp = fw.example_inputs("ttt_mlp", batch_size=1, seq_len=8, num_heads=2, head_dim=16, device=DEV)
    bare = {key: val for key, val in inp.items() if key not in ("beta", "ln_weight", "ln_bias")}  # the defaults
    o1, s1 = fw.chunk("ttt_mlp", backend="triton", output_final_state=True, **bare)
    o2, s2 = DISPATCH[("generic", "chunk", "torch")].fn(row_call("ttt_mlp", bare))
    assert rel(o1, o2) < CHUNK_F32_REL
    for a, b in zip(s1.weights, s2.weights):
        assert rel(a, b) < CHUNK_F32_REL
    with pytest.raises(fw.FormNotAvailable, match="cu_seqlens"):
        row = DISPATCH[("generic", "chunk", "triton")]
        row.fn(row_call("ttt_mlp", inp), cu_seqlens=torch.tensor([0, 3, 8], device=DEV))


def test_the_row_matches_the_official_dual_form(monkeypatch, gen):
    """fw.chunk("ttt_mlp") through the Triton row (the fake CUDA table on the CPU: the kernels) against the
    official TTT-MLP's mini-batch dual form (tests/reference/test_ttt.py's `official_dual`, float64), the held-out
    reference the torch row matches: output and final weights, D = 8 (padded to 16), T = 37."""
    from tests.reference.test_ttt import official_dual

    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    H, T, D = 2, 37, 8

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(H, T, D), rnd(H, T, D), rnd(H, T, D)
    lr = torch.rand(H, T, generator=gen, dtype=torch.float64)
    gam, bet = 1 + 0.3 * rnd(H, 1, D), 0.3 * rnd(H, 1, D)
    weights = [rnd(H, D, 4 * D) / D ** 0.5, 0.3 * rnd(H, 1, 4 * D), rnd(H, 4 * D, D) / (4 * D) ** 0.5,
               0.3 * rnd(H, 1, D)]
    ref, ref_w = official_dual(q, k, v, lr, weights, gam, bet, 16, True)

    def to_fw(x):  # [H, T, D] -> [1, T, H, D], fp32 on DEV
        return x.transpose(0, 1)[None].float().to(DEV)

    state = MemoryState(weights=tuple(w[None].float().to(DEV) for w in weights))
    o, st = fw.chunk("ttt_mlp", to_fw(q), to_fw(k), to_fw(v), backend="triton", beta=lr.T[None].float().to(DEV),
                     initial_state=state, ln_weight=gam[:, 0].float().to(DEV), ln_bias=bet[:, 0].float().to(DEV),
                     output_final_state=True)
    assert rel(o[0].transpose(0, 1), ref) < CHUNK_F32_REL
    for a, b in zip(st.weights, ref_w):
        assert rel(a[0], b) < CHUNK_F32_REL


def test_a_ttt_mlp_layer_on_the_kernels_equals_it_on_torch(monkeypatch, gen):
    """A MemoryMixer("ttt_mlp") whose memory runs on the Triton row (the fake CUDA table on the CPU) against the same
    layer on the torch row: output and every parameter gradient (its initial memory, the inner learning rate's
    projection, the LayerNorm's affine) — the tensors a layer hands the row (expanded states, parameters)."""
    from fastweights.kernels.triton.memories import ttt_mlp as mod

    layer_on_kernels_equals_torch(monkeypatch, gen, "ttt_mlp", mod._TTTMLP, TTT_LAYER_F32_REL)
