"""The short conv's outputs recomputed in the backward of the ops that read them (`short_conv(...,
recompute_outputs=True)`, the default): the delta prologue keeps what recomputes its raw q, k and the delta memory
op what recomputes v — the conv's own inputs, which the conv keeps anyway — instead of copies of the outputs. The
gradients must be bitwise those of the ops keeping the outputs, no output of a conv may be among the tensors
autograd keeps, and an output changed in place after the conv (its version moved) must be kept, not recomputed
from stale inputs. CPU tensors under the interpreter: conv → prologue (L2 norm, β, Mamba gate) → the delta op, as a
gated DeltaNet layer chains them."""

from __future__ import annotations

import pytest
import torch

from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.layer import conv as conv_mod
from fastweights.kernels.triton.layer.conv import conv_source, short_conv
from fastweights.kernels.triton.layer.prologue import delta_prologue
from tests.kernels.helpers import DEV

pytestmark = pytest.mark.triton

# on a GPU, head dims ≥ 64: below, bf16 delta kernels run on fp32 casts of q, k, v
# (`pipelines.LOW_PRECISION_MIN_HEAD_DIM_CUDA`), which the memory op then keeps instead of the conv outputs (r4s10
# call 6)
B, T, H, W = 2, 37, 2, 4
K, V = (16, 32) if DEV == "cpu" else (64, 64)


def _leaves(gen, dtype):
    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEV, dtype).requires_grad_(True)

    return dict(xq=r(B, T, H * K), xk=r(B, T, H * K), xv=r(B, T, H * V), wq=r(H * K, 1, W, scale=0.5),
                wk=r(H * K, 1, W, scale=0.5), wv=r(H * V, 1, W, scale=0.5), b=r(B, T, H), a=r(B, T, H),
                A_log=r(H, scale=0.1), dt_bias=r(H, scale=0.1))


def _layer(x, inplace_v=False, recompute=True):
    """conv(q, k, v) → prologue → delta rule, as MemoryMixer chains them: o and the final state (`recompute`: the
    convs' recompute_outputs)."""
    q, _ = short_conv(x["xq"], x["wq"], recompute_outputs=recompute)
    k, _ = short_conv(x["xk"], x["wk"], recompute_outputs=recompute)
    v, _ = short_conv(x["xv"], x["wv"], recompute_outputs=recompute)
    if inplace_v:
        v = v.view(B, T, H, V).mul_(1.0)  # the same values, a new version: the conv's inputs no longer stand for it
    q, k, beta, g = delta_prologue(q.view(B, T, H, K), k.view(B, T, H, K), x["b"], x["a"], x["A_log"],
                                   x["dt_bias"])
    return chunk_delta_triton(q, k, v.view(B, T, H, V), g=g, beta=beta, scale=K ** -0.5, output_final_state=True,
                              chunk_size=16)


def _grads(x, seed, **kw):
    o, S = _layer(x, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(DEV)).sum() + (S * S).sum()
    return [o.detach(), S.detach()] + list(torch.autograd.grad(loss, list(x.values())))


@pytest.mark.variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_conv_outputs_give_the_same_gradients_bitwise(dtype, gen):
    x = _leaves(gen, dtype)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    got = _grads(x, seed, recompute=True)
    want = _grads(x, seed, recompute=False)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def _kept_conv_outputs(x, **kw):
    """The storages of the three conv outputs, and those of every tensor autograd keeps for the layer's backward."""
    outs, kept = [], set()
    real = conv_mod.ShortConvFn.apply

    def spy(*args):
        y, tail = real(*args)
        if torch.is_grad_enabled():
            outs.append(y.untyped_storage().data_ptr())
        return y, tail

    def pack(t):
        kept.add(t.untyped_storage().data_ptr())
        return t

    conv_mod.ShortConvFn.apply = spy
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, S = _layer(x, **kw)
    finally:
        conv_mod.ShortConvFn.apply = real
    return outs, kept, (o, S)


@pytest.mark.variants
def test_no_conv_output_is_kept(gen):
    outs, kept, _ = _kept_conv_outputs(_leaves(gen, torch.bfloat16))
    assert len(outs) == 3 and not set(outs) & kept
    # the check can fail: off, the consumers keep them
    outs, kept, _ = _kept_conv_outputs(_leaves(gen, torch.bfloat16), recompute=False)
    assert set(outs) <= kept


def test_an_output_changed_in_place_is_kept_not_recomputed(gen):
    x = _leaves(gen, torch.float32)
    outs, kept, _ = _kept_conv_outputs(x, inplace_v=True)
    assert outs[2] in kept and not {outs[0], outs[1]} & kept  # v (changed) kept; q, k still recomputed
    y, _ = short_conv(x["xv"], x["wv"])
    assert conv_source(y) is not None and conv_source(y.view(B, T, H, V)) is not None
    y.detach().add_(0.0)  # an in-place change through another view moves the shared version
    assert conv_source(y) is None


def test_each_output_is_recomputed_once_for_all_its_readers(gen, monkeypatch):
    """q and k are read in the backward by the memory op (to recompute q̂, k̂) and by the prologue (its L2 norm's
    gradient): one conv launch each, not two (`_ConvSource.take`), and nothing kept once the last reader is done.
    The gradients stay bitwise (the test above)."""
    made, sources = [], []
    real_recompute, real_init = conv_mod._ConvSource.recompute, conv_mod._ConvSource.__init__

    def init(self, *args):
        real_init(self, *args)
        sources.append(self)

    monkeypatch.setattr(conv_mod._ConvSource, "__init__", init)
    monkeypatch.setattr(conv_mod._ConvSource, "recompute", lambda self: made.append(self) or real_recompute(self))
    x = _leaves(gen, torch.float32)
    o, S = _layer(x)
    assert len(sources) == 3 and [s.holders for s in sources] == [2, 2, 1]  # q, k: prologue and memory op; v
    torch.autograd.grad((o.sum() + S.sum()), list(x.values()))
    assert len(made) == 3 and {id(s) for s in made} == {id(s) for s in sources}
    assert all(s.holders == 0 and s.kept is None for s in sources)


def test_a_holder_that_does_not_recompute_lets_go(gen):
    """Two holders, one recomputes (the output kept for the other), the other releases: nothing kept; a kept output
    written in place since is recomputed, not handed on."""
    x = _leaves(gen, torch.float32)
    y, _ = short_conv(x["xq"], x["wq"])
    a, b = conv_source(y), conv_source(y)
    first = conv_mod.conv_recompute(a)
    assert torch.equal(first, y) and a[0].kept is not None
    conv_mod.conv_release(b)
    assert a[0].kept is None and a[0].holders == 0
    a, b = conv_source(y), conv_source(y)
    first = conv_mod.conv_recompute(a)
    first.add_(1.0)  # the kept tensor changed: the next holder gets a fresh recompute
    second = conv_mod.conv_recompute(b)
    assert torch.equal(second, y) and second.data_ptr() != first.data_ptr()
