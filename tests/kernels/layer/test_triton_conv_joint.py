"""fastweights.kernels.triton.layer.conv.short_conv_joint (the q, k, v convs of a layer in one launch each way:
the adjacent column ranges of one input, read in place) against `short_conv` on each column range — bitwise: the
same arithmetic per element and the same partial sums of dw, db — and against the float64 torch twin
(`layers.conv.ShortConv` on the rounded values, tests/tolerances.py bounds): the outputs, the new tails and the
gradients of the input (one [B, T, Σ C_s] tensor), the tails, the weights and the biases.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA; outputs are NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastweights.inputs import InputError
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.layer.conv import conv_source, short_conv, short_conv_joint
from fastweights.layers.conv import ShortConv
from tests.kernels.helpers import DEV, rel
from tests.tolerances import CONV_F32_REL, CONV_LOW_REL

pytestmark = pytest.mark.triton

SIZES = (20, 12, 9)  # three segments, none a multiple of the blocks: every segment ends in a masked block


def _inputs(gen, *, B=2, T=37, sizes=SIZES, W=4, dtype=torch.float32, tail=True, pos=True, bias=True):
    """Y [B, T, Σ C_s + 3] (x is its first Σ C_s columns: a row stride wider than x), weights [C_s, 1, W] and
    biases [C_s] fp32, tails [B, W − 1, C_s] in x's dtype, positions [B, T] (documents of 1..6 tokens); all on DEV."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = {"Y": rnd(B, T, sum(sizes) + 3).to(DEV, dtype),
           "weights": [(rnd(c, 1, W) / W ** 0.5).to(DEV, torch.float32) for c in sizes],
           "biases": [rnd(c).to(DEV, torch.float32) for c in sizes] if bias else None,
           "tails": [rnd(B, W - 1, c).to(DEV, dtype) for c in sizes] if tail else None, "positions": None}
    if pos:
        p = torch.zeros(B, T, dtype=torch.int64)
        for b in range(B):
            t = 0
            while t < T:
                n = int(torch.randint(1, 7, (1,), generator=gen))
                p[b, t:t + n] = torch.arange(min(n, T - t)) + (3 if t == 0 and b == 0 else 0)
                t += n
        out["positions"] = p.to(DEV)
    return out


def _run(inp, *, joint: bool, one_pass: bool = True, activation="silu", seed=7):
    """(outputs y_s, new tails, dY, dweights, dbiases, dtails) of a random projection of the outputs and tails."""
    sizes = tuple(w.shape[0] for w in inp["weights"])
    leaf = lambda t: t.to(DEV).clone().requires_grad_(True)  # noqa: E731
    Y = leaf(inp["Y"])
    ws = [leaf(w) for w in inp["weights"]]
    bs = [leaf(b) for b in inp["biases"]] if inp["biases"] is not None else None
    ts = [leaf(t) for t in inp["tails"]] if inp["tails"] is not None else None
    x = Y[..., :sum(sizes)]
    if joint:
        ys, nts = short_conv_joint(x, ws, bs, ts, inp["positions"], activation, one_pass_backward=one_pass)
    else:
        ys, nts, o = [], [], 0
        for i, c in enumerate(sizes):
            y, nt = short_conv(x[..., o:o + c], ws[i], bs[i] if bs else None, ts[i] if ts else None,
                               inp["positions"], activation, one_pass_backward=one_pass)
            ys.append(y)
            nts.append(nt)
            o += c
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in ys + nts)
    loss.backward()
    grads = [Y.grad] + [w.grad for w in ws] + ([b.grad for b in bs] if bs else []) + ([t.grad for t in ts] if ts
                                                                                       else [])
    return [t.detach() for t in ys], [t.detach() for t in nts], grads


def _equal(a, b, what):
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.shape == v.shape and u.dtype == v.dtype, (what, i)
        assert not torch.isnan(u).any(), (what, i)
        assert torch.equal(u, v), (what, i, (u.double() - v.double()).abs().max().item())


def _twin(inp, activation="silu", seed=7):
    """The float64 torch twin per segment on the values the kernel sees (each rounded to x's dtype)."""
    dt = inp["Y"].dtype
    sizes = tuple(w.shape[0] for w in inp["weights"])
    W = inp["weights"][0].shape[-1]
    Y = inp["Y"].double().to(DEV).requires_grad_(True)
    ys, nts, convs, tails, o = [], [], [], [], 0
    for i, c in enumerate(sizes):
        conv = ShortConv(c, W, bias=inp["biases"] is not None, activation=activation).double().to(DEV)
        with torch.no_grad():
            conv.conv.weight.copy_(inp["weights"][i].to(dt).double())
            if inp["biases"] is not None:
                conv.conv.bias.copy_(inp["biases"][i].to(dt).double())
        t = inp["tails"][i].double().to(DEV).requires_grad_(True) if inp["tails"] is not None else None
        y, nt = conv(Y[..., o:o + c], t, inp["positions"])
        ys.append(y)
        nts.append(nt)
        convs.append(conv)
        tails.append(t)
        o += c
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in ys + nts)
    loss.backward()
    grads = [Y.grad] + [c.conv.weight.grad for c in convs] + ([c.conv.bias.grad for c in convs]
                                                              if inp["biases"] is not None else [])
    grads += [t.grad for t in tails] if inp["tails"] is not None else []
    return ys, nts, grads


@pytest.fixture
def small_blocks(monkeypatch):
    """16-channel blocks (SIZES: segments of 2, 1 and 1 blocks, each ending masked) and 16-row blocks, 3 a program
    (T = 37: several programs, the last partial) in every conv kernel; the row-streaming backward off (its own
    tests below), so the one-pass case is the block kernel's."""
    table = {"conv_fwd": dict(BT=16, BC=16), "conv_bwd_dpre": dict(BT=8, BC=16, NBLK=3),
             "conv_bwd_dx": dict(BT=16, BC=32), "conv_bwd_fused": dict(BT=16, BC=16, NBLK=3),
             "conv_bwd_rows": dict(ON=0)}
    for site, keys in table.items():
        for key, val in keys.items():
            monkeypatch.setitem(util.LAUNCH[site], key, val)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "two_kernels"])
def test_joint_equals_per_conv_bitwise(small_blocks, gen, one_pass):
    """Every option on and off, T = 1 (T < W − 1: the new tails reach into the old ones), 2 and 37 (odd, several
    programs), W = 1, 3, 4, fp32 and bf16: the joint launch equals the three `short_conv` calls bitwise (the
    two-kernel backward: T 37 fp32 every mix, and T 1 and a bf16 case)."""
    mixes = [(True, True, True, "silu"), (False, False, False, None), (True, False, True, None),
             (False, True, False, "silu")]
    cases = [(T, 4, torch.float32, m) for T, m in itertools.product([1, 2, 37], mixes)]
    cases += [(37, W, torch.bfloat16, mixes[0]) for W in (1, 3, 4)] + [(37, 4, torch.bfloat16, mixes[1])]
    if not one_pass:  # the two-kernel backward (no longer the LM's): every mix at T 37, and T 1 (tails into tails)
        cases = [c for c in cases if c[0] == 37 and c[2] == torch.float32] + [cases[0], cases[-1]]
    for T, W, dtype, (tail, pos, bias, act) in cases:
        inp = _inputs(gen, T=T, W=W, dtype=dtype, tail=tail and W > 1, pos=pos, bias=bias)
        a = _run(inp, joint=True, one_pass=one_pass, activation=act)
        b = _run(inp, joint=False, one_pass=one_pass, activation=act)
        for what, u, v in zip(("y", "new tail", "grads"), a, b):
            _equal(u, v, (what, T, W, dtype, tail, pos, bias, act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_equals_f64_twin(gen, dtype):
    """At the default launch settings (segments of one block each, 64-channel blocks), T = 65 (a masked second row
    block): outputs, tails and every gradient within the conv's bounds of the float64 twin."""
    tol = CONV_F32_REL if dtype == torch.float32 else CONV_LOW_REL[dtype]
    inp = _inputs(gen, T=65, dtype=dtype, sizes=(20, 70, 9))
    ys, nts, grads = _run(inp, joint=True)
    ys_r, nts_r, grads_r = _twin(inp)
    for u, v in zip(ys + nts + grads, ys_r + nts_r + grads_r, strict=True):
        assert u.shape == v.shape and rel(u, v) < tol


def test_joint_outputs_recompute_alone(gen):
    """Each output carries what recomputes it alone (`conv_source`): the single conv on its columns, bitwise."""
    from fastweights.kernels.triton.layer.conv import conv_recompute

    inp = _inputs(gen, T=19)
    Y = inp["Y"].to(DEV).requires_grad_(True)
    ys, _ = short_conv_joint(Y[..., :sum(SIZES)], inp["weights"], inp["biases"], inp["tails"], inp["positions"])
    for y, c in zip(ys, SIZES):
        src = conv_source(y.view(2, 19, -1))
        assert src is not None and src[0].args[0].shape[-1] == c
        assert torch.equal(conv_recompute(src), y)


def test_joint_errors():
    x = torch.randn(1, 3, 8)
    with pytest.raises(InputError, match="weights must be a list"):
        short_conv_joint(x, [])
    with pytest.raises(InputError, match="one width"):
        short_conv_joint(x, [torch.randn(4, 1, 4), torch.randn(4, 1, 3)])
    with pytest.raises(InputError, match="tails must be None or a list"):
        short_conv_joint(x, [torch.randn(4, 1, 4), torch.randn(4, 1, 4)], tails=[torch.zeros(1, 3, 4)])


@pytest.mark.parametrize("pad_unused", [False, True])
def test_dx_into_the_split_buffer(gen, pad_unused):
    """`short_conv_joint(..., grad_in_base=True)` after `split_into_grad_buffer` (the mixer's wiring): dY is the
    conv's own dx buffer completed in place (no cat), bitwise the plain split's cat — with the last piece's gradient
    absent (None: its columns zeroed, as the padding's) or present (copied), NaN-poisoned buffer included."""
    from fastweights.kernels import GRAD_BUFFER, split_into_grad_buffer

    inp = _inputs(gen, T=23)
    sizes = [sum(SIZES), 2, 1]
    dys = [torch.randn(2, 23, n, generator=gen).to(DEV) for n in sizes[1:]]

    def run(in_place):
        Y = inp["Y"].to(DEV).requires_grad_(True)
        ws = [w.to(DEV).requires_grad_(True) for w in inp["weights"]]
        parts = split_into_grad_buffer(Y, sizes) if in_place else Y.split(sizes, dim=-1)
        ys, _ = short_conv_joint(parts[0], ws, None, inp["tails"], inp["positions"], grad_in_base=in_place)
        outs = ys + list(parts[1:2 if pad_unused else 3])
        g = torch.Generator().manual_seed(3)
        loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(DEV)).sum() for o in outs)
        loss = loss + sum((p * d).sum() for p, d in zip(parts[1:2 if pad_unused else 3], dys))
        return torch.autograd.grad(loss, [Y] + ws)

    got, want = run(True), run(False)
    assert getattr(got[0], GRAD_BUFFER, None) is False  # the conv's buffer, used (the flag cleared)
    _equal(got, want, "dY, dw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shipped_rows_backward(gen, dtype):
    """At the shipped launch table (the row-streaming backward on, its runs and channel blocks as shipped): T spans
    several runs, the last partial, and a segment crosses a channel block — outputs, tails and every gradient
    within the conv's bounds of the float64 twin, y, tails and dY bitwise the per-conv calls. On a GPU at the LM's
    widths (three 768-channel convs, T 2,100), in the interpreter at 300 tokens of (20, 270, 9)."""
    assert util.LAUNCH["conv_bwd_rows"]["ON"] == 1
    run, bc = util.LAUNCH["conv_bwd_rows"]["RUN"], util.LAUNCH["conv_bwd_rows"]["BC"]
    T, sizes = (2100, (768, 768, 768)) if str(DEV).startswith("cuda") else (300, (20, 270, 9))
    assert T > 2 * run and max(sizes) > bc
    tol = CONV_F32_REL if dtype == torch.float32 else CONV_LOW_REL[dtype]
    inp = _inputs(gen, T=T, dtype=dtype, sizes=sizes)
    ys, nts, grads = _run(inp, joint=True)
    ys_r, nts_r, grads_r = _twin(inp)
    for i, (u, v) in enumerate(zip(ys + nts + grads, ys_r + nts_r + grads_r, strict=True)):
        assert not torch.isnan(u).any(), i
        assert u.shape == v.shape and rel(u, v) < tol, (i, rel(u, v))
    per = _run(inp, joint=False)
    n_wb = 3 * 2  # dw, db: summed over the programs' partial rows in another order by torch
    for name, u, v in zip(("y", "new tail", "dY, dtails"), (ys, nts, grads[:1] + grads[1 + n_wb:]),
                          (per[0], per[1], per[2][:1] + per[2][1 + n_wb:])):
        _equal(u, v, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_backward_equals_f64_twin(gen, monkeypatch, dtype):
    """The row-streaming one-pass backward (LAUNCH["conv_bwd_rows"]["ON"] = 1; 8-row runs, so T = 37 has 5 programs
    and every halo crosses a program boundary; 16-channel blocks) on the joint launch: T = 1, 2 (T < W − 1), 37,
    W = 1..4, every option on and off, within the conv's bounds of the float64 twin — outputs, tails, dY, dw, db,
    dtails; and y, the tails, dY and dtails equal to the per-conv calls on the same path bitwise (dw, db: the same
    per-program partial sums, but torch's sum over the programs ran in another order here, 1 ulp off). bf16: three
    of the cases (the interpreter's time)."""
    monkeypatch.setitem(util.LAUNCH["conv_bwd_rows"], "ON", 1)
    monkeypatch.setitem(util.LAUNCH["conv_bwd_rows"], "RUN", 8)
    monkeypatch.setitem(util.LAUNCH["conv_bwd_rows"], "BC", 16)
    tol = CONV_F32_REL if dtype == torch.float32 else CONV_LOW_REL[dtype]
    mixes = [(True, True, True, "silu"), (False, False, False, None), (True, True, False, "silu")]
    cases = [(T, 4, m) for T, m in itertools.product([1, 2, 37], mixes)] + [(37, W, mixes[0]) for W in (1, 2, 3)]
    if dtype != torch.float32:  # bf16: the loads' and stores' casts (the cases' paths: fp32's, above)
        cases = [(2, 4, mixes[1]), (37, 4, mixes[0]), (37, 2, mixes[0])]
    for T, W, (tail, pos, bias, act) in cases:
        inp = _inputs(gen, T=T, W=W, dtype=dtype, tail=tail and W > 1, pos=pos, bias=bias)
        ys, nts, grads = _run(inp, joint=True, activation=act)
        ys_r, nts_r, grads_r = _twin(inp, activation=act)
        what = (T, W, tail, pos, bias, act)
        for i, (u, v) in enumerate(zip(ys + nts + grads, ys_r + nts_r + grads_r, strict=True)):
            assert not torch.isnan(u).any(), (what, i)
            assert u.shape == v.shape and (v.numel() == 0 or rel(u, v) < tol), (what, i, rel(u, v))
        per = _run(inp, joint=False, activation=act)
        n_wb = 3 * (2 if bias else 1)  # dw, db: torch's sum of the programs' partial rows, whose order may follow C
        for name, u, v in zip(("y", "new tail", "dY, dtails"), (ys, nts, grads[:1] + grads[1 + n_wb:]),
                              (per[0], per[1], per[2][:1] + per[2][1 + n_wb:])):
            _equal(u, v, (name, what))
