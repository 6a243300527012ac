"""fastweights.kernels.triton.layer.conv (the short causal depthwise conv + bias + SiLU with its tail)
against its torch twin `layers.conv.ShortConv.forward`, run in float64 (on the test device) on the same values (x, the
tail, the weight and the bias rounded to x's dtype, as the kernel rounds them): y, the new tail and
the gradients of x, the tail, the weight and the bias, of a random projection of y and the new tail.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA; outputs are NaN-poisoned, so a
row or channel the kernel forgets to write fails. Fresh random inputs every run; the seed is printed.
"""

from __future__ import annotations

import functools
import itertools
import secrets

import pytest
import torch

from fastweights.inputs import InputError
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.layer import conv as conv_k
from fastweights.kernels.triton.layer.conv import short_conv
from fastweights.layers.conv import ShortConv
from tests.kernels.helpers import DEV, projection, rel
from tests.tolerances import CONV_F32_REL, CONV_LOW_REL

pytestmark = pytest.mark.triton



def _inputs(gen, *, B=2, T=65, C=20, W=4, dtype=torch.float32, tail=True, pos=True, bias=True,
            tail_dtype=None):
    """x [B, T, C], tail [B, W − 1, C] (None without), weight [C, 1, W] and bias [C] fp32, positions
    [B, T] int64 (documents of 1..6 tokens, so every tap reach occurs; None without)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"x": rnd(B, T, C).to(dtype), "weight": (rnd(C, 1, W) / W ** 0.5).float()}
    if tail:
        x["tail"] = rnd(B, W - 1, C).to(tail_dtype or dtype)
    if bias:
        x["bias"] = rnd(C).float()
    if pos:
        p = torch.zeros(B, T, dtype=torch.int64)
        for b in range(B):
            t = 0
            while t < T:
                n = int(torch.randint(1, 7, (1,), generator=gen))
                p[b, t:t + n] = torch.arange(min(n, T - t)) + (3 if t == 0 and b == 0 else 0)  # row 0 continues
                t += n
        x["positions"] = p
    return x


def _compare(x, tol, activation="silu", view=None, one_pass=True):
    """The kernel against the float64 twin; `view` (x's leaf -> the kernel's x, e.g. a slice of a wider
    tensor built around x) changes only how x reaches the kernel; `one_pass`: the kernel's one_pass_backward."""
    seed = secrets.randbits(62)
    names = [n for n in ("x", "tail", "weight", "bias") if n in x]
    # the kernel
    leaves = {n: v.to(DEV).requires_grad_(True) for n, v in x.items() if n in names}
    pos = x["positions"].to(DEV) if "positions" in x else None
    xin = view(leaves["x"]) if view is not None else leaves["x"]
    y, nt = short_conv(xin, leaves["weight"], leaves.get("bias"), leaves.get("tail"), pos, activation,
                       one_pass_backward=one_pass)
    assert y.dtype == nt.dtype == x["x"].dtype and y.shape == x["x"].shape
    got = torch.autograd.grad(projection((y, nt), seed), [leaves[n] for n in names])
    for n, gr in zip(names, got):
        assert gr.dtype == x[n].dtype and gr.shape == x[n].shape, n
    # the torch twin in float64 on the rounded values
    dt = x["x"].dtype
    W = x["weight"].shape[-1]
    conv = ShortConv(x["x"].shape[-1], W, bias="bias" in x, activation=activation).double().to(DEV)
    ref = {n: (v.to(dt) if n != "x" else v).double().to(DEV).requires_grad_(True) for n, v in x.items()
           if n in names}
    with torch.no_grad():
        conv.conv.weight.copy_(ref["weight"])
        if "bias" in x:
            conv.conv.bias.copy_(ref["bias"])
    y_r, nt_r = conv(ref["x"], ref.get("tail"), pos)  # fp64: the torch row (the Triton one takes no fp64)
    params = {"weight": conv.conv.weight, "bias": conv.conv.bias}
    want = torch.autograd.grad(projection((y_r, nt_r), seed), [params.get(n, ref.get(n)) for n in names])
    assert rel(y, y_r) < tol and (nt_r.numel() == 0 or rel(nt, nt_r) < tol)
    for n, a, b in zip(names, got, want):
        if b.numel():
            assert rel(a, b) < tol, f"d{n}"


def test_conv_every_option(gen):
    """fp32, T = 1, 3, 65 (row blocks of 64: a masked second block; T < W − 1: the new tail reaches
    back into the old one), each with every option on, every option off, and two mixes of tail,
    positions, bias and SiLU."""
    mixes = [(True, True, True, "silu"), (False, False, False, None), (True, False, True, None),
             (False, True, False, "silu")]
    for T, (tail, pos, bias, act) in itertools.product([1, 3, 65], mixes):
        _compare(_inputs(gen, T=T, tail=tail, pos=pos, bias=bias), CONV_F32_REL, activation=act)


def test_conv_widths_and_channel_blocks(gen):
    """W = 1 (no tail), 2, 3 and 8 (the widest served); C = 70 (two channel blocks, the second masked)."""
    for W in (1, 2, 3, 8):
        _compare(_inputs(gen, T=21, W=W, C=70 if W == 3 else 12), CONV_F32_REL)


@pytest.fixture
def small_blocks(monkeypatch):
    """Launch settings small enough for the tests' lengths to span several blocks and programs: the
    dpre kernel's 8-row blocks, 3 per program (24 rows: T = 50 has 3 programs, the last with a partial
    block and a block past T), 16 channels per block; the dx kernel's 16 rows × 32 channels; the
    one-pass backward's 16-row blocks (13 rows owned at W = 4, 3 blocks per program: T = 50 has 2
    programs, the second partial), 16 channels; the row-streaming backward off (a test turns it on), 8-row runs
    of 16 channels."""
    table = {"conv_fwd": dict(BT=16, BC=16), "conv_bwd_dpre": dict(BT=8, BC=16, NBLK=3),
             "conv_bwd_dx": dict(BT=16, BC=32), "conv_bwd_fused": dict(BT=16, BC=16, NBLK=3),
             "conv_bwd_rows": dict(ON=0, RUN=8, BC=16)}
    for site, keys in table.items():
        for key, val in keys.items():
            monkeypatch.setitem(util.LAUNCH[site], key, val)


@pytest.mark.variants
@pytest.mark.parametrize("fused,dw_acc,rows", [(False, 0, 0), (True, 0, 0), (True, 1, 0), (True, 0, 1)],
                         ids=["two_kernels", "one_pass", "one_pass_dw_acc", "rows"])
def test_conv_blocks_programs_and_tails(small_blocks, fused, dw_acc, rows, gen, monkeypatch):
    """Small blocks (`small_blocks`) with C = 20 (a masked second channel block): T = 1, 2 (T < W − 1:
    the new tail reaches into the old one; every option on and every option off), 23 (a partial third
    block) and 50 (three programs of 3 blocks, the last partial; those two also with two mixes of tail,
    positions, bias and SiLU); bf16 x at T = 50, W = 3 with the dpre scratch in bf16 and in fp32.
    Both backwards: the two kernels and the one-pass (`one_pass_backward`, also at W = 8 and with a
    sliced x); the one-pass one with dw summed per block and with dw's products summed over the program's blocks
    (LAUNCH["conv_bwd_fused"]["DW_ACC"]; W ≤ 4 takes it, W = 8 the per-block sums); and the row-streaming one-pass
    backward (LAUNCH["conv_bwd_rows"]["ON"], 8-row runs of 16 channels: T = 50 has 7 programs; W = 8 falls back to
    the block one-pass)."""
    monkeypatch.setitem(util.LAUNCH["conv_bwd_fused"], "DW_ACC", dw_acc)
    monkeypatch.setitem(util.LAUNCH["conv_bwd_rows"], "ON", rows)
    _cmp = functools.partial(_compare, one_pass=fused)
    if fused:
        for W in (1, 2, 8):
            _cmp(_inputs(gen, T=23, W=W), CONV_F32_REL)
        xw = lambda x: torch.cat([x, x], dim=-1)[..., :x.shape[-1]]  # noqa: E731
        _cmp(_inputs(gen, T=23), CONV_F32_REL, view=xw)
    mixes = [(True, True, True, "silu"), (False, False, False, None), (True, False, True, None),
             (False, True, False, "silu")]
    for T in (1, 2, 23, 50):
        for tail, pos, bias, act in mixes[:2] if T < 8 or (fused and T < 50) else mixes:
            _cmp(_inputs(gen, T=T, tail=tail, pos=pos, bias=bias), CONV_F32_REL, activation=act)
    for dpre_fp32 in (False,) if fused else (False, True):
        monkeypatch.setitem(util.LAUNCH["conv_bwd_dpre"], "DPRE_FP32", int(dpre_fp32))
        _cmp(_inputs(gen, T=50, W=3, dtype=torch.bfloat16), CONV_LOW_REL[torch.bfloat16])


@pytest.mark.variants
def test_conv_strided_input(small_blocks, gen):
    """x a channel slice of a wider tensor (the q part of a fused [B, T, Cq + Ck + Cv] projection, and
    a middle part): read in place through its strides (not copied), every gradient as for a contiguous
    x; a channel-strided x (a transpose) is copied and right too. fp32 and bf16, T = 23 and 50."""
    def wide(left, right, above=0):
        """x -> the slice [:, above:, left:left + C] of cat(rows above, cat(left, x, right)): x's values
        with channels contiguous, rows C + left + right apart (and a batch stride not B·T·row)."""
        def view(x):
            B, T, C = x.shape
            rnd = lambda t, c: torch.randn(B, t, c, generator=gen).to(x.dtype).to(x.device)  # noqa: E731
            big = torch.cat([rnd(T, left), x, rnd(T, right)], dim=-1)
            big = torch.cat([rnd(above, big.shape[-1]), big], dim=1)
            xs = big[:, above:, left:left + C]
            assert not xs.is_contiguous() and conv_k._rows_view(xs) is xs
            return xs
        return view

    def channel_strided(x):
        xs = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, channels not contiguous
        assert xs.stride(2) != 1 and conv_k._rows_view(xs).is_contiguous()
        return xs

    for T, view in [(23, wide(0, 37)), (50, wide(11, 5, above=3)), (23, channel_strided)]:
        _compare(_inputs(gen, T=T), CONV_F32_REL, view=view)
        _compare(_inputs(gen, T=T, dtype=torch.bfloat16, tail=False, pos=False, bias=False),
                 CONV_LOW_REL[torch.bfloat16], view=view)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv_low_precision(dtype, gen):
    """bf16/fp16 x and tail (fp32 weight and bias, rounded to x's dtype as the torch twin does), and a
    bf16/fp16 x with an fp32 tail (a state kept in the parameters' dtype)."""
    _compare(_inputs(gen, T=65, dtype=dtype), CONV_LOW_REL[dtype])
    _compare(_inputs(gen, T=3, dtype=dtype, tail_dtype=torch.float32), CONV_LOW_REL[dtype])


def test_conv_layer_continues_across_calls(gen, monkeypatch):
    """Through ShortConv on its Triton row (backend="triton"; CPU tensors: `tests/fake_cuda.py`): a
    sequence in pieces (prefill, then token by token, carrying the tail) equals one call."""
    from tests.fake_cuda import FakeCuda

    fake = FakeCuda(monkeypatch, kernels=True).install()
    conv = ShortConv(12, 4, bias=True, backend="triton").to(DEV)
    x = torch.randn(2, 9, 12, generator=gen).to(DEV)
    y, tail = conv(x)
    y1, t1 = conv(x[:, :5])
    parts = [y1]
    for t in range(5, 9):
        yt, t1 = conv(x[:, t:t + 1], t1)
        parts.append(yt)
    assert set(fake.take()) == {("layer", "conv", "triton")}
    assert rel(torch.cat(parts, 1), y) < CONV_F32_REL and rel(t1, tail) < CONV_F32_REL


def test_conv_bad_input_names_the_argument(gen):
    x = _inputs(gen, T=5)
    with pytest.raises(InputError, match="^x must"):
        short_conv(x["x"].double(), x["weight"])
    with pytest.raises(InputError, match="^weight must"):
        short_conv(x["x"], x["weight"][:3])
    with pytest.raises(InputError, match="W must be"):
        short_conv(x["x"], torch.zeros(20, 1, 9))
    with pytest.raises(InputError, match="^tail must"):
        short_conv(x["x"], x["weight"], tail=x["tail"][:, :1])
    with pytest.raises(InputError, match="^positions must"):
        short_conv(x["x"], x["weight"], positions=x["positions"].float())
    with pytest.raises(InputError, match="^activation"):
        short_conv(x["x"], x["weight"], activation="relu")


@pytest.mark.cuda
def test_conv_realistic_cuda(gen):
    """The benchmark's shape: B = 4, T = 4,096, C = 2,048, W = 4, bf16, with a tail, positions and bias."""
    _compare(_inputs(gen, B=4, T=4096, C=2048, dtype=torch.bfloat16), CONV_LOW_REL[torch.bfloat16])


@pytest.mark.cuda
def test_conv_realistic_sliced_cuda(gen):
    """The LM's q conv: x the first 1,024 channels of a [4, 4,096, 4,096] fused projection, bf16, no
    tail, positions or bias; and the same in fp32 with them."""
    def sliced(x):
        B, T, C = x.shape
        xs = torch.cat([x, torch.randn(B, T, 3 * C, generator=gen).to(x)], dim=-1)[..., :C]
        assert conv_k._rows_view(xs) is xs
        return xs

    _compare(_inputs(gen, B=4, T=4096, C=1024, dtype=torch.bfloat16, tail=False, pos=False, bias=False),
             CONV_LOW_REL[torch.bfloat16], view=sliced)
    _compare(_inputs(gen, B=4, T=4096, C=1024), CONV_F32_REL, view=sliced)
