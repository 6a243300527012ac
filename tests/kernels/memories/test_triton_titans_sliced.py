"""kernels.triton.memories.titans_sliced (Titans' split pipeline with the hidden width sliced over programs: one step
launch a mini-batch forward, one chain launch a mini-batch backward; util.LAUNCH["titans_sliced"]["ON"], by default
where sequences × heads ≤ 64) against the torch twin `titans_torch` (chunkwise.minibatch, float64), the float64
recurrence and the one-program split kernels: outputs, final weights, momentum and anchor, and every gradient — q, k,
v, the retention, step and momentum gates, the initial weights, momentum and anchor; lengths that are no multiple of
the mini-batch, a carried mini-batch, chained calls, varlen with an empty and a length-1 sequence, grouped heads,
padded head dims with a partial hidden tile, slices of one and several tiles and more slices asked for than there are
tiles.

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes (K, V ≤ 20, F = 4K, T ≤ 41); kernel outputs
are NaN-poisoned (tests/conftest.py). Fresh random inputs every run."""

from __future__ import annotations

import pytest
import torch

from fastweights.kernels.triton.common.util import LAUNCH
from fastweights.kernels.triton.memories import titans as mod
from fastweights.kernels.triton.memories import titans_sliced as sliced
from tests.kernels.helpers import DEV
from tests.kernels.memories.test_triton_titans import (
    ANCHOR,
    MOMENTUM,
    SEQ,
    STATE,
    _agree,
    _each_sequence_alone,
    _fp32,
    _inputs,
    _kernel,
    _recurrence,
    _run,
    _seed,
    _twin,
)
from tests.tolerances import CHUNK_F32_REL, TITANS_LOW_REL

pytestmark = pytest.mark.triton


class Launches(list):
    """The forward's step launches [(PRO, grid)]; `.chain`: the backward's chain launches [grid] (or "one-program":
    `titans._bwd_kernel`'s)."""

    def __init__(self):
        super().__init__()
        self.chain = []


@pytest.fixture
def steps(monkeypatch):
    """The sliced kernels on (NP and BWD from each test), their launches counted, and the one-program reverse pass's;
    the one-program state pass must not run."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 1)
    seen = Launches()
    real = sliced._step_kernel.run
    monkeypatch.setattr(sliced._step_kernel, "run",
                        lambda *a, **kw: seen.append((kw["PRO"], kw["grid"])) or real(*a, **kw))
    chain = sliced._chain_kernel.run
    monkeypatch.setattr(sliced._chain_kernel, "run", lambda *a, **kw: seen.chain.append(kw["grid"]) or chain(*a, **kw))
    monkeypatch.setattr(mod._state_kernel, "run", lambda *a, **kw: pytest.fail("the one-program state pass ran"))
    one = mod._bwd_kernel.run
    monkeypatch.setattr(mod._bwd_kernel, "run", lambda *a, **kw: seen.chain.append("one-program") or one(*a, **kw))
    return seen


def _split(leaves, off, **kw):
    return _kernel(leaves, off, pipeline="split", **kw)


def test_the_slices_and_the_rule(monkeypatch):
    """(programs, tiles each): every program owns ≥ 1 tile; NP beyond the tiles is cut to them. ON: 2 (the default)
    sliced where sequences × heads ≤ MAX_BH (64, as TTT-MLP's), 0 never, 1 always, anything else refused."""
    assert sliced.slices(512, 16, 4) == (4, 8)
    assert sliced.slices(64, 16, 3) == (2, 2)
    assert sliced.slices(80, 32, 2) == (2, 2)  # tiles 32, 32, 16 (partial): 2 + 1
    assert sliced.slices(64, 64, 4) == (1, 1)
    assert (LAUNCH["titans_sliced"]["ON"], LAUNCH["titans_sliced"]["MAX_BH"]) == (2, 64)
    assert sliced.sliced_on(4, 16) and sliced.sliced_on(4, 8) and not sliced.sliced_on(64, 2)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 0)
    assert not sliced.sliced_on(1, 1)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 1)
    assert sliced.sliced_on(64, 2)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 4)
    with pytest.raises(ValueError, match="titans_sliced"):
        sliced.sliced_on(1, 1)


@pytest.mark.parametrize("T, offset, Hq, tile, NP, bwd", [(37, 0, 1, 16, 4, 1), (23, 5, 2, 16, 3, 1),
                                                         (16, 0, 2, 32, 4, 1), (3, 9, 1, 16, 2, 1),
                                                         (11, 5, 1, 64, 1, 1), (37, 0, 1, 16, 4, 0),
                                                         (23, 5, 2, 16, 3, 0)])
def test_sliced_equals_the_twin_and_the_recurrence(monkeypatch, steps, gen, T, offset, Hq, tile, NP, bwd):
    """fp32 against float64: T = 37 and 23 (no multiple of 16), 16 (one whole mini-batch), 3 inside a carried
    mini-batch (offset 9: the call ends mid-batch), 11 completing a carried one (offset 5); grouped heads and plain
    ones; F = 64 in tiles of 16 over 4 programs (one tile each), over 3 asked (2 of 2 tiles), in tiles of 32 over 4
    asked (2 of 1), one tile over 1. The step launches: one for step 0, then one a mini-batch, each over (R·H,
    programs); the chain's likewise (BWD 1). Outputs, final state and every gradient (BWD 0: the one-program reverse
    pass on the sliced forward's start states)."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", NP)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "BWD", bwd)
    x = _inputs(gen, T=T, Hq=Hq)
    seed = _seed(gen)
    got = _run(lambda leaves, off: _split(leaves, off, tile=tile), _fp32(x), offset, seed)
    ns = -(-(offset + T) // 16)
    programs = sliced.slices(64, tile, NP)[0]
    assert steps == [(True, (2, programs))] + [(False, (2, programs))] * ns
    assert steps.chain == ([(2, programs)] * (ns + 1) if bwd else ["one-program"])
    _agree(got, _run(_twin, x, offset, seed), CHUNK_F32_REL)
    _agree(got, _run(_recurrence, x, offset, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("read_terms, fuse", [(0, 1), (1, 0)])
def test_sliced_equals_the_one_program_kernels(monkeypatch, gen, read_terms, fuse):
    """The same call (B 2, grouped heads, offset 5, T 41) on the one-program split kernels and on the sliced ones,
    with and without the pre-pass's read terms (util.LAUNCH "titans_bwd" READ_TERMS), the chain in one launch a
    mini-batch or two (util.LAUNCH "titans_sliced_bwd" FUSE): outputs, final state and every gradient within fp32's
    rounding of each other (the sums over the hidden tiles are ordered otherwise)."""
    monkeypatch.setitem(LAUNCH["titans_bwd"], "READ_TERMS", read_terms)
    monkeypatch.setitem(LAUNCH["titans_sliced_bwd"], "FUSE", fuse)
    x = _fp32(_inputs(gen, B=2, T=41, Hq=1))
    seed = _seed(gen)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 0)
    one = _run(lambda leaves, off: _split(leaves, off, tile=16), x, 5, seed)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 2)
    for kernel in (mod._state_kernel, mod._bwd_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, **kw: pytest.fail("a one-program sequential pass ran"))
    chain, real = [], sliced._chain_kernel.run
    monkeypatch.setattr(sliced._chain_kernel, "run",
                        lambda *a, **kw: chain.append((kw["DO_D"], kw["DO_C"])) or real(*a, **kw))
    _agree(_run(lambda leaves, off: _split(leaves, off, tile=16), x, 5, seed), one, CHUNK_F32_REL)
    ns = -(-(5 + 41) // 16)
    if fuse:
        assert chain == [(True, True)] * (ns + 1)
    else:  # pass D of mini-batch j (none in the first), then pass C of j − 1 (none in the last)
        assert chain == [(False, True)] + [(True, False), (False, True)] * (ns - 1) + [(True, False)]


def test_padded_head_dims_a_partial_hidden_tile_and_a_longer_mini_batch(monkeypatch, steps, gen):
    """K = 20 (padded to 32), V = 12 (padded to 16), F = 80 in tiles of 32 (the last one partial) over 2 programs
    (the second owns the partial tile and one past F), b = 32 with a carried mini-batch of 7 tokens, grouped heads;
    without gradients the forward returns the same."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 2)
    x = _inputs(gen, T=41, Hq=1, H=2, K=20, V=12)
    seed = _seed(gen)
    got = _run(lambda leaves, off: _split(leaves, off, b=32), _fp32(x), 7, seed)
    _agree(got, _run(lambda leaves, off: _twin(leaves, off, b=32), x, 7, seed), CHUNK_F32_REL)
    with torch.no_grad():
        o, weights, momentum, anchor, _ = _split({n: t.to(DEV) for n, t in _fp32(x).items()}, 7, b=32)
    for a, b in zip((o, *weights, *momentum, *anchor), got[0]):
        assert torch.equal(a.double().cpu(), b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(monkeypatch, steps, gen, dtype):
    """bf16 / fp16 q, k, v (the gates and the state fp32) against the float64 twin on the same rounded values."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 2)
    x = _inputs(gen, T=37, Hq=1)
    x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(lambda leaves, off: _split(leaves, off, tile=16), _fp32(x), 5, seed, dtype=dtype)
    _agree(got, _run(_twin, x, 5, seed), TITANS_LOW_REL[dtype])


def test_chained_calls_equal_one_call(monkeypatch, steps, gen):
    """T = 41 as 21 + 20 tokens (the second call continues the mini-batch the first left at 5 tokens), the state
    passed between the calls: outputs, final state and every gradient of the chain equal the twin's one call."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 3)
    x = _inputs(gen, T=41, Hq=1)
    seed = _seed(gen)

    def chained(leaves, offset):
        first = {n: (val[:, :21] if n in SEQ else val) for n, val in leaves.items()}
        o1, w1, m1, a1, off1 = _split(first, offset, tile=16)
        assert off1 == 5
        second = {n: (val[:, 21:] if n in SEQ else val) for n, val in leaves.items()}
        second.update({**dict(zip(STATE, w1)), **dict(zip(MOMENTUM, m1)), **dict(zip(ANCHOR, a1))})
        o2, w2, m2, a2, off2 = _split(second, off1, tile=16)
        return torch.cat([o1, o2], dim=1), w2, m2, a2, off2

    _agree(_run(chained, _fp32(x), 0, seed), _run(_twin, x, 0, seed), CHUNK_F32_REL)


@pytest.mark.parametrize("offset", [0, 5])
def test_varlen_equals_each_sequence_alone(monkeypatch, steps, gen, offset):
    """cu_seqlens packing 4 sequences (an empty one, a length-1 one, one past a mini-batch), one head, each with its
    own state row: equals the twin on each sequence alone — outputs, each final state, every gradient. The steps run
    the longest sequence's mini-batches (the others idle in the later launches)."""
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 2)
    lengths = [9, 0, 20, 1]
    cu = torch.tensor([0] + lengths).cumsum(0)
    N, T = len(lengths), sum(lengths)
    x = _inputs(gen, B=1, T=T, Hq=1, H=1)
    x.update({n: _inputs(gen, B=N, T=1, Hq=1, H=1)[n] for n in STATE + MOMENTUM + ANCHOR})
    seed = _seed(gen)

    got = _run(lambda leaves, off: _split(leaves, off, tile=16, cu_seqlens=cu.to(DEV)), _fp32(x), offset, seed)
    assert got[1] == [(offset + n) % 16 for n in lengths]
    assert len(steps) == 1 + -(-(offset + 20) // 16)
    _agree(got, _run(lambda leaves, off: _each_sequence_alone(leaves, off, cu), x, offset, seed), CHUNK_F32_REL)


@pytest.mark.variants  # (7.5 s under the interpreter alone, ≈ 20 s beside other work: F = 512)
def test_the_lm_head_dim(monkeypatch, steps, gen):
    """K = V = 128, F = 512 (the LM's head) in the glue's hidden tiles of 16 over the default NP (4 programs of 8
    tiles), T 14 after an offset of 3 (two mini-batches): outputs, final state and every gradient against the
    float64 twin."""
    x = _inputs(gen, B=1, T=14, Hq=1, H=1, K=128, V=128)
    seed = _seed(gen)
    got = _run(lambda leaves, off: _split(leaves, off, tile=None), _fp32(x), 3, seed)
    assert steps[0][1] == (1, 4) and steps.chain[0] == (1, 4)
    _agree(got, _run(_twin, x, 3, seed), CHUNK_F32_REL)


def test_a_titans_layer_on_the_sliced_kernels_equals_it_on_torch(monkeypatch, steps, gen):
    """A MemoryMixer("titans") on the Triton row (the fake CUDA table on the CPU; head dim 16 with the launch table's
    titans_single_fwd MAX_DIM lowered so the split pipeline runs, sliced over 2 programs) against the same layer
    on the torch row: output and every parameter gradient."""
    from tests.kernels.memories.layers import layer_on_kernels_equals_torch
    from tests.tolerances import TITANS_LAYER_F32_REL

    monkeypatch.setitem(LAUNCH["titans_single_fwd"], "MAX_DIM", 8)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", 2)
    layer_on_kernels_equals_torch(monkeypatch, gen, "titans", mod._Titans, TITANS_LAYER_F32_REL)
    assert steps and steps.chain and "one-program" not in steps.chain


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(2, 300, 2, 64, 7), (2, 300, 2, 128, 5), (1, 200, 3, 128, 0)],
                         ids=lambda s: "B{}-T{}-H{}-D{}-off{}".format(*s))
@pytest.mark.parametrize("NP", [2, 4, 8])
def test_cuda_realistic(monkeypatch, gen, size, dtype, NP):
    """On the GPU: the sliced kernels (the glue's hidden tile, NP programs a head, the shipped warps) against the
    float64 twin at realistic shapes, outputs, final state and every gradient; bf16 inputs against the twin on the
    same rounded values. (r4s13 call 5: the first 10 cases passed on an H200 before the call's bound.)"""
    from tests.tolerances import CHUNK_LONG_F32_REL

    monkeypatch.setitem(LAUNCH["titans_sliced"], "ON", 1)
    monkeypatch.setitem(LAUNCH["titans_sliced"], "NP", NP)
    B, T, H, D, offset = size
    x = _inputs(gen, B=B, T=T, Hq=H, H=H, K=D, V=D, step=0.05)  # (β ≤ 0.5 diverges over these lengths: _inputs)
    if dtype != torch.float32:
        x.update({n: x[n].to(dtype).double() for n in ("q", "k", "v")})
    seed = _seed(gen)
    got = _run(lambda leaves, off: _split(leaves, off, tile=None), _fp32(x), offset, seed, dtype=dtype)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TITANS_LOW_REL[dtype]
    want = _run(_twin, x, offset, seed)
    assert torch.isfinite(want[0][0]).all()
    _agree(got, want, tol)
