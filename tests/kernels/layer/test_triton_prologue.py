"""fastweights.kernels.triton.layer.prologue (the delta layer's fused L2 norm, β and Mamba-style gate)
against the float64 composition of the layer's own ops: `layers.norm.l2norm`, `layers.gates.BetaGate`
and `layers.gates.MambaDecay` (their projections set to the identity, so they compute exactly the
formulas the kernel fuses), and `chunkwise.common.chunk_cumsum` for the cumsum.

Marked `triton`: under TRITON_INTERPRET=1 on a machine without CUDA; outputs are NaN-poisoned, so a
row or head the kernel forgets to write fails. Fresh random inputs every run; the seed is printed.
"""

from __future__ import annotations

import itertools
import secrets

import pytest
import torch

from fastweights.chunkwise import common as twin
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.inputs import InputError
from fastweights.kernels.triton.layer.prologue import delta_prologue
from fastweights.layers.gates import BetaGate, MambaDecay
from fastweights.layers.norm import l2norm
from tests.kernels.helpers import DEV, projection, rel
from tests.tolerances import PROLOGUE_F32_REL, PROLOGUE_LOW_REL, PROLOGUE_SUM_F32_REL

pytestmark = pytest.mark.triton

NAMES = ("q", "k", "b", "a", "A_log", "dt_bias")



def _inputs(gen, gate, *, B=2, T=37, Hq=1, H=2, K=12, Ka=12, dtype=torch.float32):
    """q, k [B, T, H_q, K], b [B, T, H], a [B, T, H(, K_a)], A_log [H], dt_bias [H(·K_a)], float64
    rounded to `dtype` (the parameters stay fp32). a spans softplus's tails (|a| up to ~25); the rows
    of q have norms from 1e-4·√K to √K, so Σ q² meets eps (the convention of eps matters)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    row_scale = 10.0 ** (-4 * torch.rand(B, T, Hq, 1, generator=gen, dtype=torch.float64))
    x = {"q": rnd(B, T, Hq, K) * row_scale, "k": 3.0 * rnd(B, T, Hq, K), "b": 2.0 * rnd(B, T, H)}
    if gate is not None:
        x["a"] = 6.0 * rnd(*((B, T, H) if gate == "mamba" else (B, T, H, Ka)))
        x["A_log"] = torch.log(torch.rand(H, generator=gen, dtype=torch.float64) * 15 + 1)
        x["dt_bias"] = rnd(H if gate == "mamba" else H * Ka)
    x = {n: v.to(dtype if n in ("q", "k", "b", "a") else torch.float32) for n, v in x.items()}
    return {n: v.double().to(v.dtype) for n, v in x.items()}


def _reference(x, *, gate, l2=True, beta_max=1.0, chunk_size=None, cu=None):
    """(q̂, k̂, β, g or G) by the layer's modules in float64; absent inputs give None."""
    out = {}
    if "q" in x:
        out["q"] = l2norm(x["q"]) if l2 else x["q"]
    if "k" in x:
        out["k"] = l2norm(x["k"]) if l2 else x["k"]
    if "b" in x:
        H = x["b"].shape[2]
        bg = BetaGate(H, H, scale=beta_max).double().to(x["b"].device)
        with torch.no_grad():
            bg.proj.weight.copy_(torch.eye(H))
        out["b"] = bg(x["b"])
    if gate is not None:
        a = x["a"]
        B, T, H = a.shape[:3]
        C = a.shape[3] if gate == "kda" else 1
        dec = MambaDecay(H * C, H, channels=C, rank=H * C).double().to(a.device)
        with torch.no_grad():
            for lin in ([dec.proj] if C == 1 else list(dec.proj)):
                lin.weight.copy_(torch.eye(H * C))
            dec.A_log.copy_(x["A_log"] if "A_log" in x else torch.zeros(H))
            dec.dt_bias.copy_(x["dt_bias"].reshape(-1) if "dt_bias" in x else torch.zeros(H * C))
        g, _ = dec(a.reshape(B, T, H * C))
        out["_g_elem"] = g  # g = −e^{A_log}·softplus(a + dt_bias), element by element, before any cumsum
        if chunk_size is not None:
            lay = torch_layout(B, T, chunk_size, cu, device=g.device)
            g = lay.from_chunks(twin.chunk_cumsum(lay.to_chunks(g)))
        out["g"] = g
        out["_params"] = (dec.A_log, dec.dt_bias)
    return out


def _grads_ref(x, seed, **kw):
    """Outputs and gradients of a random projection of every output, float64 reference (on DEV), and the size of
    the summands of the two gradients that are sums over B·T(·K_a) (`_summand_scales`)."""
    leaves = {n: v.to(DEV).double().requires_grad_(True) for n, v in x.items()}
    out = _reference(leaves, **kw)
    params = out.pop("_params", None)
    g_elem = out.pop("_g_elem", None)
    loss = projection(out.values(), seed)
    wrt = [leaves[n] for n in ("q", "k", "b", "a") if n in leaves]
    if params is not None:
        wrt += [p for n, p in zip(("A_log", "dt_bias"), params) if n in leaves]
    names = [n for n in ("q", "k", "b", "a") if n in leaves] + [n for n in ("A_log", "dt_bias") if n in leaves
                                                                and params is not None]
    grads = torch.autograd.grad(loss, wrt + ([g_elem] if g_elem is not None else []))
    gs = dict(zip(names, grads[:len(names)]))
    scales = {} if g_elem is None else _summand_scales(g_elem.detach(), grads[-1], gs, names)
    return {n: v.detach() for n, v in out.items()}, gs, scales


def _summand_scales(g, dg, gs, names):
    """{"A_log": [H], "dt_bias": [H·K_a]}: Σ |summand| of dA_log and d dt_bias, float64. Each is a sum over
    B·T(·K_a) of per-element terms: ∂g/∂A_log = g, so dA_log = Σ dg·g; a and dt_bias enter only as a + dt_bias, so
    d dt_bias = Σ da. Those terms have random signs and cancel (|g| reaches e^{A_log}·25 ≈ 400): the kernel's fp32
    sum rounds relative to the terms, not to what is left of them, as dβ's in tests/kernels/helpers.py."""
    out = {}
    if "A_log" in names:
        out["A_log"] = (dg * g).abs().sum(dim=(0, 1) if g.dim() == 3 else (0, 1, 3))
    if "dt_bias" in names:
        out["dt_bias"] = gs["a"].abs().sum(dim=(0, 1)).reshape(-1)
    return out


def _grads_kernel(x, seed, *, gate, l2=True, beta_max=1.0, chunk_size=None, cu=None):
    leaves = {n: v.to(DEV).requires_grad_(True) for n, v in x.items()}
    q, k, beta, g = delta_prologue(leaves.get("q"), leaves.get("k"), leaves.get("b"), leaves.get("a"),
                                   leaves.get("A_log"), leaves.get("dt_bias"), l2norm=l2, beta_max=beta_max,
                                   gate=gate, chunk_size=chunk_size,
                                   cu_seqlens=None if cu is None else cu.to(DEV))
    out = {n: v for n, v in zip(("q", "k", "b", "g"), (q, k, beta, g)) if v is not None}
    assert set(out) == {n for n in ("q", "k", "b") if n in x} | ({"g"} if gate is not None else set())
    if "b" in out:
        assert out["b"].dtype == torch.float32
    if "g" in out:
        assert out["g"].dtype == torch.float32 and out["g"].shape == x["a"].shape
    for n in ("q", "k"):
        if n in out:
            assert out[n].dtype == x[n].dtype and out[n].shape == x[n].shape
    gs = torch.autograd.grad(projection(out.values(), seed), list(leaves.values()))
    for n, gr in zip(leaves, gs):
        assert gr.dtype == x[n].dtype and gr.shape == x[n].shape, n
    return {n: v.detach() for n, v in out.items()}, dict(zip(leaves, gs))


def _compare(x, tol, *, sums=PROLOGUE_SUM_F32_REL, **kw):
    """Every output and gradient within `tol` of the float64 reference's, relative to its largest entry; dA_log and
    d dt_bias, sums over B·T(·K_a) whose terms cancel, within `sums` of their summands' size (`_summand_scales`)
    (the kernel sums them in fp32 whatever the inputs' dtype) — or, with sums=None, as the others (the realistic
    cuda test: 16K tokens a sum, its fp32 rounding relative to the summands not measured there)."""
    seed = secrets.randbits(62)
    out, gr = _grads_kernel(x, seed, **kw)
    out_ref, gr_ref, scales = _grads_ref(x, seed, **kw)
    assert set(out) == set(out_ref) and set(gr) == set(gr_ref)
    for n in out_ref:  # rel compares on the CPU
        assert rel(out[n], out_ref[n]) < tol, f"output {n} {kw}"
    for n in gr_ref:
        of, t = (scales[n], sums) if n in scales and sums is not None else (None, tol)
        err = rel(gr[n], gr_ref[n], of)
        assert err < t, f"d{n} {kw}: {err:.3g} ≥ {t:g}" + (" of its summands' size" if of is not None else "")


@pytest.mark.parametrize("gate", ["mamba", "kda"])
def test_prologue_matches_layer_ops(gate, gen):
    """Every output and every gradient, fp32 inputs, grouped heads (H_q = 1, H = 2, so the program
    of head 1 has no q/k row), T odd, K = 12 (a masked tile), K_a = 40 (two column blocks of the
    "kda" gate, the second masked), β up to 2 (negative eigenvalues)."""
    x = _inputs(gen, gate, Ka=40)
    _compare(x, PROLOGUE_F32_REL, gate=gate, beta_max=2.0)
    # g element by element (softplus's negative tail, down to e^-25, keeps its relative precision)
    g = delta_prologue(None, None, None, x["a"].to(DEV), x["A_log"].to(DEV), x["dt_bias"].to(DEV), gate=gate)[3]
    want = _reference({n: v.double() for n, v in x.items()}, gate=gate)["g"]
    assert ((g.double().cpu() - want).abs() / want.abs()).max().item() < PROLOGUE_F32_REL


def test_prologue_each_option(gen):
    """Each input switched off in turn (None: its output absent; A_log None: A = 1; dt_bias None:
    no bias; l2norm=False: q, k passed through), every output and gradient, both gates."""
    for gate, drop, l2 in itertools.product(["mamba", "kda", None], [(), ("q",), ("k", "b"), ("A_log",),
                                                                     ("dt_bias",), ("q", "k", "b")], [True, False]):
        if gate is None and drop in (("A_log",), ("dt_bias",), ("q", "k", "b")):
            continue  # nothing new, or nothing at all to compute
        x = {n: v for n, v in _inputs(gen, gate, B=1, T=21, Hq=2, H=2, K=8, Ka=8).items() if n not in drop}
        _compare(x, PROLOGUE_F32_REL, gate=gate, l2=l2)


@pytest.mark.parametrize("gate", ["mamba", "kda"])
def test_prologue_cumsum(gate, gen):
    """chunk_size given: G is the chunk-local cumsum, against chunkwise.common.chunk_cumsum on the
    chunked reference g, and every gradient through it: a padded batch (T = 37, two partial chunks
    at chunk 16) and varlen with an empty and a length-1 sequence."""
    x = _inputs(gen, gate, B=2, T=37, H=3, Hq=3, K=8, Ka=8)
    _compare(x, PROLOGUE_F32_REL, gate=gate, chunk_size=16)
    lengths = [9, 0, 40, 1, 20]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _inputs(gen, gate, B=1, T=sum(lengths), H=2, Hq=1, K=8, Ka=8)
    _compare(x, PROLOGUE_F32_REL, gate=gate, chunk_size=16, cu=cu)
    _compare(x, PROLOGUE_F32_REL, gate=gate, chunk_size=32, cu=cu)


def _column_views(x, gen):
    """x with b and a replaced by column views of one wider [B, T, N] tensor (the layer's joint projection:
    [junk | b | a | junk], rows N apart), the same values."""
    B, T = x["b"].shape[:2]
    widths = [x["b"][0, 0].numel(), x["a"][0, 0].numel()]
    wide = torch.randn(B, T, 3 + sum(widths) + 5, generator=gen, dtype=torch.float64).to(x["b"].dtype)
    wide[..., 3:3 + widths[0]] = x["b"]
    wide[..., 3 + widths[0]:3 + sum(widths)] = x["a"].reshape(B, T, -1)
    b = wide[..., 3:3 + widths[0]]
    a = wide[..., 3 + widths[0]:3 + sum(widths)].view(x["a"].shape)
    assert not b.is_contiguous() and not a.is_contiguous()
    return {**x, "b": b, "a": a}


@pytest.mark.parametrize("gate", ["mamba", "kda"])
def test_prologue_reads_column_views_in_place(gate, gen):
    """b and a column views of a wider tensor (rows at its stride, as `MemoryMixer` passes them): read in place
    (no copy), every output and gradient against float64 and bitwise those of contiguous copies; with the
    cumsum and varlen sequences too (an empty and a length-1 one)."""
    from fastweights.kernels.triton.layer.prologue import _rows

    lengths = [9, 0, 20, 1]
    cu = torch.tensor([0] + lengths).cumsum(0)
    for x, kw in ((_inputs(gen, gate, T=21, Ka=8), {}),
                  (_inputs(gen, gate, B=1, T=sum(lengths), K=8, Ka=8), dict(chunk_size=16, cu=cu))):
        v = _column_views(x, gen)
        assert _rows(v["b"]) is v["b"] and _rows(v["a"]) is v["a"]
        _compare(v, PROLOGUE_F32_REL, gate=gate, **kw)
        seed = secrets.randbits(62)
        got, want = (_grads_kernel(y, seed, gate=gate, **kw) for y in (v, {n: t.contiguous() for n, t in v.items()}))
        for part_got, part_want in zip(got, want):
            assert all(torch.equal(part_got[n], part_want[n]) for n in part_want)
    t = torch.randn(2, 5, 8, generator=gen)[:, :4, :3]  # rows of a batch not one stride apart: copied
    assert _rows(t).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prologue_low_precision(dtype, gen):
    """bf16/fp16 q, k, b, a (fp32 parameters): the kernel computes in fp32 and rounds q̂, k̂ and the
    gradients to the input dtype, against float64 on the same rounded values."""
    for gate in ("mamba", "kda"):
        _compare(_inputs(gen, gate, dtype=dtype), PROLOGUE_LOW_REL[dtype], gate=gate, beta_max=2.0, chunk_size=16)


def test_prologue_no_tokens(gen):
    """T = 0: empty outputs of the right shapes, zero parameter gradients."""
    x = {n: v.to(DEV).requires_grad_(True) for n, v in _inputs(gen, "kda", T=0).items()}
    q, k, beta, g = delta_prologue(x["q"], x["k"], x["b"], x["a"], x["A_log"], x["dt_bias"], gate="kda",
                                   chunk_size=16)
    assert q.shape == x["q"].shape and beta.shape == x["b"].shape and g.shape == x["a"].shape
    (g.sum() + q.sum()).backward()
    assert bool((x["A_log"].grad == 0).all()) and bool((x["dt_bias"].grad == 0).all())


def test_prologue_bad_input_names_the_argument(gen):
    x = _inputs(gen, "mamba")
    with pytest.raises(InputError, match="gate"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], gate="gla")
    with pytest.raises(InputError, match="needs a"):
        delta_prologue(x["q"], x["k"], x["b"], None, gate="mamba")
    with pytest.raises(InputError, match="gate=None"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], gate=None)
    with pytest.raises(InputError, match="^a must be 4-D"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], gate="kda")
    with pytest.raises(InputError, match="^b must have"):
        delta_prologue(x["q"], x["k"], x["b"][:, :5], x["a"], gate="mamba")
    with pytest.raises(InputError, match="^dt_bias"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], x["A_log"], torch.zeros(5), gate="mamba")
    with pytest.raises(InputError, match="chunk_size"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], gate="mamba", chunk_size=24)
    with pytest.raises(InputError, match="cu_seqlens"):
        delta_prologue(x["q"], x["k"], x["b"], x["a"], gate="mamba", cu_seqlens=torch.tensor([0, 37]))
    with pytest.raises(InputError, match="^q must be fp32"):
        delta_prologue(x["q"].double(), x["k"], x["b"], x["a"], gate="mamba")


@pytest.mark.cuda
@pytest.mark.parametrize("gate", ["mamba", "kda"])
def test_prologue_realistic_cuda(gate, gen):
    """The benchmark's shape, B = 4, T = 4,096, H = 16, K = 128, bf16, with the cumsum at chunk 64
    and grouped heads (H_q = 8): every output and gradient against float64 on the same values."""
    x = _inputs(gen, gate, B=4, T=4096, Hq=8, H=16, K=128, Ka=128, dtype=torch.bfloat16)
    _compare(x, PROLOGUE_LOW_REL[torch.bfloat16], sums=None, gate=gate, chunk_size=64)
