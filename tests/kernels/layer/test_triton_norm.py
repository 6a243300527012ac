"""fastweights.kernels.triton.layer.norm (the gated output RMSNorm) against its torch twin
`layers.norm.GatedRMSNorm`, run in float64 (on the test device) on the same values: y and the gradients of o, z and the
weight, of a random projection of y — both orders (norm-then-gate, gate-then-norm), swish and
sigmoid gates, no gate, a group of one head or of the whole width.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA; outputs are NaN-poisoned, so a
row the kernel forgets to write fails. Fresh random inputs every run; the seed is printed.
"""

from __future__ import annotations

import itertools
import secrets

import pytest
import torch

from fastweights.inputs import InputError
from fastweights.kernels.triton.layer.norm import gated_rms_norm
from fastweights.layers.norm import GatedRMSNorm
from tests.kernels.helpers import DEV, projection, rel
from tests.tolerances import NORM_F32_REL, NORM_LOW_REL

pytestmark = pytest.mark.triton



def _inputs(gen, *, B=2, T=5, C=48, G=16, dtype=torch.float32, gate=True, z_dtype=None):
    """o, z [B, T, C] (z None without a gate), weight [G] fp32; row scales from 1e-3 to 1 (eps matters)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    scale = 10.0 ** (-3 * torch.rand(B, T, C // G, 1, generator=gen, dtype=torch.float64))
    x = {"o": (rnd(B, T, C // G, G) * scale).reshape(B, T, C).to(dtype), "weight": (1 + 0.5 * rnd(G)).float()}
    if gate:
        x["z"] = (2 * rnd(B, T, C)).to(z_dtype or dtype)
    return x


def _compare(x, tol, *, activation="swish", norm_before_gate=True, eps=1e-5):
    seed = secrets.randbits(62)
    names = [n for n in ("o", "z", "weight") if n in x]
    leaves = {n: x[n].to(DEV).requires_grad_(True) for n in names}
    y = gated_rms_norm(leaves["o"], leaves.get("z"), leaves["weight"], eps=eps, activation=activation,
                       norm_before_gate=norm_before_gate)
    assert y.dtype == x["o"].dtype and y.shape == x["o"].shape
    got = torch.autograd.grad(projection((y,), seed), [leaves[n] for n in names])
    for n, gr in zip(names, got):
        assert gr.dtype == x[n].dtype and gr.shape == x[n].shape, n
    norm = GatedRMSNorm(x["weight"].numel(), eps=eps, activation=activation,
                        norm_before_gate=norm_before_gate).double().to(DEV)
    ref = {n: x[n].double().to(DEV).requires_grad_(True) for n in ("o", "z") if n in x}  # fp64: the torch ops
    with torch.no_grad():
        norm.weight.copy_(x["weight"])
    y_r = norm(ref["o"], ref.get("z"))
    want = torch.autograd.grad(projection((y_r,), seed),
                               [ref["o"]] + ([ref["z"]] if "z" in ref else []) + [norm.weight])
    assert rel(y, y_r) < tol, "y"
    for n, a, b in zip(names, got, want):
        assert rel(a, b) < tol, f"d{n}"


def test_norm_every_option(gen):
    """fp32, odd T: both orders × swish / sigmoid, no gate; a group of one head (G = 16 of C = 48), of
    the whole width (G = C = 48: a masked tile of 64), and G = 24 (two groups, masked)."""
    for T, nbg, act, G in itertools.product([1, 3], [True, False], ["swish", "sigmoid"], [16, 48]):
        _compare(_inputs(gen, T=T, G=G), NORM_F32_REL, activation=act, norm_before_gate=nbg)
    for nbg in (True, False):
        _compare(_inputs(gen, T=3, G=16, gate=False), NORM_F32_REL, norm_before_gate=nbg)
    _compare(_inputs(gen, T=65, G=24), NORM_F32_REL, activation="sigmoid", norm_before_gate=False)


def test_norm_backward_program_loop(gen):
    """More row blocks than the backward's programs: each program sums dw over several blocks."""
    from fastweights.kernels.triton.layer import norm as mod

    before = mod._BWD_PROGRAMS
    mod._BWD_PROGRAMS = 3
    try:
        _compare(_inputs(gen, B=1, T=37, C=256, G=128), NORM_F32_REL)  # 74 rows of 128, 32 per block: 3 blocks
        _compare(_inputs(gen, B=1, T=41, C=64, G=16), NORM_F32_REL, norm_before_gate=False)  # 164 rows, 1 block
    finally:
        mod._BWD_PROGRAMS = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_reads_a_column_view_of_z_in_place(dtype, gen):
    """z a column view of a wider [B, T, N] tensor (the gated DeltaNet layer's gate: columns of its joint
    projection) is read in place (rows of C at stride N; no copy): against the fp64 twin, and bitwise the result
    and gradients of its contiguous copy, both orders; a view whose rows are not one stride apart (the first T of
    T + 1 tokens of each sequence) is copied and gives the same too."""
    from fastweights.kernels.triton.layer.norm import _rows_of

    for T, nbg in ((2, True), (7, False)):
        x = {n: t.to(DEV) for n, t in _inputs(gen, T=T, C=48, G=16, dtype=dtype).items()}
        wide = torch.randn(2, T, 48 + 21, generator=gen).to(DEV, dtype)
        wide[..., 5:53] = x["z"]
        view = wide[..., 5:53]
        assert _rows_of(view) is view
        _compare({**x, "z": view}, NORM_F32_REL if dtype == torch.float32 else NORM_LOW_REL[dtype],
                 norm_before_gate=nbg)
        head = torch.randn(2, T + 1, 48, generator=gen).to(DEV, dtype)[:, :T]  # rows not one stride apart
        assert _rows_of(head) is not head and _rows_of(head).is_contiguous()
        for z in (view, head):
            outs = []
            for zz in (z, z.contiguous()):
                leaves = [x["o"].clone().requires_grad_(True), zz.detach().requires_grad_(True),
                          x["weight"].clone().requires_grad_(True)]
                y = gated_rms_norm(*leaves, norm_before_gate=nbg)
                outs.append((y, *torch.autograd.grad(projection((y,), 7), leaves)))
            for a, b in zip(*outs):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_low_precision(dtype, gen):
    """bf16/fp16 o and z (fp32 statistics), both orders; and fp32 o with a bf16/fp16 gate."""
    for nbg in (True, False):
        _compare(_inputs(gen, T=9, dtype=dtype), NORM_LOW_REL[dtype], norm_before_gate=nbg)
    _compare(_inputs(gen, T=3, z_dtype=dtype), NORM_LOW_REL[dtype], activation="sigmoid")


@pytest.fixture
def triton_rows(monkeypatch):
    """The Triton rows serve CPU calls too (`tests/fake_cuda.py`), running their kernels."""
    from tests.fake_cuda import FakeCuda

    return FakeCuda(monkeypatch, kernels=True).install()


def test_norm_layer_routes_on_the_rule(gen, triton_rows):
    """GatedRMSNorm takes the Triton row where the rule says ("auto" on a GPU) and equals its torch ops
    (backend="torch")."""
    norm = GatedRMSNorm(16, activation="sigmoid").to(DEV)
    o, z = torch.randn(2, 3, 32, generator=gen).to(DEV), torch.randn(2, 3, 32, generator=gen).to(DEV)
    y = norm(o, z)
    norm.backend = "torch"
    y_t = norm(o, z)
    assert y.grad_fn is not None and type(y.grad_fn).__name__.startswith("GatedRMSNormFn")
    assert norm.routes == {"norm": ("torch", DEV)} and triton_rows.take() == [("layer", "norm", "triton"),
                                                                             ("layer", "norm", "torch")]
    assert rel(y, y_t) < NORM_F32_REL
    GatedRMSNorm(16, activation="gelu_tanh").to(DEV)(o, z)
    assert triton_rows.take() == [("layer", "norm", "torch")]  # the kernel gates by swish or sigmoid only


def test_rmsnorm_layer_routes_on_the_rule(gen, triton_rows):
    """The block RMSNorm (weight, no gate, one group of `dim`) takes the same kernel where the rule
    says and equals its torch ops, output and the gradients of x and the weight; without a weight
    (affine=False) too, the kernel's weight then ones."""
    from fastweights.layers.norm import RMSNorm

    norm = RMSNorm(48).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, 5, 48, generator=gen).to(DEV)
    out = {}
    for on in (True, False):
        xl = x.clone().requires_grad_(True)
        norm.backend = "triton" if on else "torch"
        y = norm(xl)
        if on:
            assert type(y.grad_fn).__name__.startswith("GatedRMSNormFn")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
        out[on] = (y, *torch.autograd.grad(y, (xl, norm.weight), dy))
    for a, b in zip(out[True], out[False]):
        assert rel(a, b) < NORM_F32_REL
    plain = RMSNorm(48, affine=False).to(DEV)
    y = plain(x)
    assert plain.routes == {"norm": ("triton", DEV)}
    plain.backend = "torch"
    assert rel(y, plain(x)) < NORM_F32_REL


def test_norm_bad_input_names_the_argument(gen):
    x = _inputs(gen)
    with pytest.raises(InputError, match="^o must"):
        gated_rms_norm(x["o"].double(), x["z"], x["weight"])
    with pytest.raises(InputError, match="group size"):
        gated_rms_norm(x["o"], x["z"], torch.ones(20))
    with pytest.raises(InputError, match="^z must"):
        gated_rms_norm(x["o"], x["z"][:, :1], x["weight"])
    with pytest.raises(InputError, match="^activation"):
        gated_rms_norm(x["o"], x["z"], x["weight"], activation="gelu_tanh")
    with pytest.raises(InputError, match="^weight must"):
        gated_rms_norm(x["o"], x["z"], x["weight"][None])


@pytest.mark.cuda
@pytest.mark.parametrize("G", [128, 2048])
def test_norm_realistic_cuda(G, gen):
    """The benchmark's shape: o, z [4, 4,096, 16 heads × 128] bf16, a group of one head (GDN) or of the
    whole width (Mamba2's "all"), both orders."""
    for nbg in (True, False):
        _compare(_inputs(gen, B=4, T=4096, C=2048, G=G, dtype=torch.bfloat16), NORM_LOW_REL[torch.bfloat16],
                 norm_before_gate=nbg)
