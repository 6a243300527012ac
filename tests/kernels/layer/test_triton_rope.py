"""fastweights.kernels.triton.layer.rope (the rotary embedding, one pass each way) against its torch twin
`torch_layer_ops.rope`: with fp32 x against the twin in fp32 (the same angles, fp32(p)·θ) and in float64 (the exact
rotation; the fp32 angle's rounding bounds that gap), with bf16 / fp16 x against the fp32 twin on the same rounded
values; y and the gradient of x of a random projection of y; positions per token, a period, an offset start, an
odd half (D 24: a masked tile), a strided x. Then the layer: a softmax-attention and a RetNet mixer take the Triton
row where the rule says and equal their torch layer ops.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA; outputs NaN-poisoned (a token, head or column
the kernel forgets to write fails). Fresh random inputs every run.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.inputs import InputError
from fastweights.kernels.triton.layer.rope import rope
from fastweights.torch_layer_ops import rope as rope_torch
from tests.kernels.helpers import DEV, rel
from tests.tolerances import ROPE_F32_REL, ROPE_F64_REL, ROPE_LAYER_F32_REL, ROPE_LOW_REL

pytestmark = pytest.mark.triton


def _positions(gen, B: int, T: int) -> torch.Tensor:
    """[B, T] int64: documents of 1..40 tokens (positions restarting at 0), row 0 starting at 17."""
    p = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        t = 0
        while t < T:
            n = int(torch.randint(1, 41, (1,), generator=gen))
            p[b, t:t + n] = torch.arange(min(n, T - t)) + (17 if t == 0 and b == 0 else 0)
            t += n
    return p


def _run(fn, x, dy, **kw):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, **kw)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y, dx


def _check(gen, x, *, start=0, period=None, positions=None, base=10000.0, dtype=torch.float32):
    """The kernel on x (dtype) against the fp32 twin on the same rounded values (and, fp32, the float64 twin)."""
    xd = x.to(dtype).to(DEV)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    kw = dict(start=start, base=base, period=period, positions=None if positions is None else positions.to(DEV))
    from fastweights.kernels import poisoned_outputs

    with poisoned_outputs():
        y, dx = _run(rope, xd, dy.to(DEV), **kw)
    assert y.dtype == dtype and y.is_contiguous() and dx.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    y32, dx32 = _run(rope_torch, xd.float(), dy.float().to(DEV), **kw)
    tol = ROPE_F32_REL if dtype == torch.float32 else ROPE_LOW_REL[dtype]
    assert rel(y, y32) < tol and rel(dx, dx32) < tol, (rel(y, y32), rel(dx, dx32))
    if dtype == torch.float32:
        y64, dx64 = _run(rope_torch, xd.double(), dy.to(DEV), **kw)
        assert rel(y, y64) < ROPE_F64_REL and rel(dx, dx64) < ROPE_F64_REL, (rel(y, y64), rel(dx, dx64))


def test_rope_offsets_positions_and_periods(gen):
    """A contiguous x [2, 37, 3, 24] (half 12 in a tile of 16) at start 0 and 5, with per-token positions, with a
    period of 16 (TTT's) and both, and base 500; D 128 at T 300 with positions."""
    x = torch.randn(2, 37, 3, 24, generator=gen)
    for start in (0, 5):
        _check(gen, x, start=start)
    pos = _positions(gen, 2, 37)
    _check(gen, x, positions=pos)
    _check(gen, x, start=3, period=16)
    _check(gen, x, positions=pos, period=16, base=500.0)
    _check(gen, torch.randn(1, 300, 2, 128, generator=gen), positions=_positions(gen, 1, 300))


def test_rope_strided_input_and_one_token(gen):
    """x a view [B, T, H, D] of a wider projection (its H and T strides not D's multiples of H), a transposed view
    (copied: its last dim not contiguous), one token at a decoding position."""
    wide = torch.randn(2, 9, 3, 40, generator=gen)
    _check(gen, wide[..., 8:32])
    _check(gen, torch.randn(2, 3, 9, 16, generator=gen).transpose(1, 2))
    _check(gen, torch.randn(4, 1, 2, 32, generator=gen), start=1234)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_low_precision(dtype, gen):
    """bf16 / fp16 x (fp32 inside, y and dx rounded to x's dtype)."""
    _check(gen, torch.randn(2, 37, 3, 24, generator=gen), positions=_positions(gen, 2, 37), dtype=dtype)


def test_rope_refuses_what_it_cannot_rotate(gen):
    """An odd head dim, a wrong rank, float64, positions of another shape: InputError naming the argument."""
    with pytest.raises(InputError, match="even head dimension"):
        rope(torch.randn(1, 2, 1, 5).to(DEV), 0)
    with pytest.raises(InputError, match=r"x must be \[B, T, H, D\]"):
        rope(torch.randn(2, 8).to(DEV), 0)
    with pytest.raises(InputError, match="fp32, bf16 or fp16"):
        rope(torch.randn(1, 2, 1, 4, dtype=torch.float64).to(DEV), 0)
    with pytest.raises(InputError, match="positions must be"):
        rope(torch.randn(1, 2, 1, 4).to(DEV), 0, positions=torch.zeros(1, 3, dtype=torch.long).to(DEV))


@pytest.fixture
def triton_rows(monkeypatch):
    """The Triton rows serve CPU calls too (`tests/fake_cuda.py`), running their kernels."""
    from tests.fake_cuda import FakeCuda

    return FakeCuda(monkeypatch, kernels=True).install()


@pytest.mark.parametrize("model", ["softmax_attention", "retnet"])
def test_rope_in_the_layer_routes_on_the_rule(model, gen, triton_rows):
    """A mixer with RoPE takes the Triton "rope" row where the rule says (layer_ops "auto" on a GPU) and equals the
    same weights on the torch layer ops: outputs and every parameter gradient, packed documents included."""
    from fastweights.layers import MemoryMixer
    from fastweights.layers.segments import Segments

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    ref = MemoryMixer(32, model, 2, head_dim=16, backend="torch", layer_ops="torch").to(DEV)
    layer = MemoryMixer(32, model, 2, head_dim=16, backend="torch").to(DEV)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 21, 32, generator=gen).to(DEV)
    pos = _positions(gen, 2, 21).to(DEV)
    for seg in (None, Segments.build(2, 21, position_ids=pos, device=DEV)):
        outs = []
        for m in (layer, ref):
            m.zero_grad()
            y = m(x, segments=seg)[0]
            y.square().sum().backward()
            outs.append((y, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
        (y, g), (y_t, g_t) = outs
        assert rel(y, y_t) < ROPE_LAYER_F32_REL
        assert g.keys() == g_t.keys() and all(rel(g[n], g_t[n]) < ROPE_LAYER_F32_REL for n in g)
    assert layer.routes.get("rope", (None,))[0] == "triton" and ref.routes.get("rope", (None,))[0] == "torch"
    assert ("layer", "rope", "triton") in triton_rows.take()
