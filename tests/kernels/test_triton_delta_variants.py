"""fastweights.kernels.triton's delta-class pipeline on Comba (decay after, probe key p: the read
key's scores RKᵀ and W with the exclusive cumsum R_i = G_{i−1}) and DeltaProduct (n micro-steps per
token, interleaved to length T·n): the new stage paths against their torch twins, and the whole —
outputs, final states and every gradient (q, k, v, p, g, β, S0) — against the float64 recurrence.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 at tiny
shapes, fp32 against float64; the realistic-shape checks are marked `cuda`. Kernel outputs are
NaN-poisoned (tests/conftest.py). Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import fastweights as fw
from fastweights.chunkwise import chunk_delta
from fastweights.chunkwise import common as twin
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.inputs import InputError
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.stages.cumsum import chunk_cumsum
from fastweights.kernels.triton.stages.delta_grads import sum_grads
from fastweights.kernels.triton.stages.qk_grads import qk_grads
from fastweights.kernels.triton.stages.scores import decayed_scores
from fastweights.recipe import Optimizer, Retention
from tests.kernels.helpers import (
    DEV,
    check,
    chunk_rows_agree,
    delta_inputs,
    delta_triton,
    each_sequence_alone,
    grads,
    rel,
    to_dev,
)
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, COMBA_WIPE_F32_REL, F32, TRITON_DELTA_LOW_REL

pytestmark = pytest.mark.triton

#: variant → (delta_inputs options, decay_first, tokens of the small whole-pipeline tests)
VARIANTS = {"comba": (dict(probe=True), False, 37), "product2": (dict(n=2), True, 19),
            "product3": (dict(n=3), True, 13)}



def _recipe(variant, gate):
    """The zoo's comba / deltaproduct with retention `gate` (and n micro-steps)."""
    if variant == "comba":
        return fw.zoo.get("comba").with_(retention=Retention(kind=gate, decay_first=False))
    return fw.zoo.get("deltaproduct").with_(optimizer=Optimizer(kind="gd", householder_steps=int(variant[-1])),
                                            retention=Retention(kind=gate))


def _recurrent(recipe):
    def run(x):
        extra = {key: x[key] for key in ("g", "p") if key in x}
        # Comba's β·p·k may leave the step bound (1 + α) on these inputs; the reference must still agree,
        # so its value checks (fastweights.stability) are off
        return fw.recurrent(recipe, x["q"], x["k"], x["v"], scale=0.4, beta=x["beta"], initial_state=x["S0"],
                            output_final_state=True, check_values=False, **extra)
    return run


def _against_recurrence(variant, gate, gen, *, cu=None, chunk_size=16, **shape):
    """The Triton pipeline against the float64 recurrence (each sequence alone with `cu`): outputs,
    final states and every gradient."""
    opts, decay_first, _ = VARIANTS[variant]
    x = delta_inputs(gate, gen, K=8, V=8, **opts, **shape)
    seed = secrets.randbits(31)
    rec = _recurrent(_recipe(variant, gate))
    want = grads(rec if cu is None else each_sequence_alone(rec, cu), {key: val.double() for key, val in x.items()},
                 seed)
    got = grads(delta_triton, x, seed, decay_first=decay_first, chunk_size=chunk_size, cu_seqlens=cu)
    check(got, want, CHUNK_F32_REL, f"{variant} {gate} {shape}")


# ---------------------------------------------------------------------------- the new stage paths
@pytest.mark.parametrize("gate", ["scalar", "diagonal"])
def test_exclusive_read_decay_stages(gate, gen):
    """Comba's stage paths on a varlen layout (an empty and a length-1 sequence), strong decay:
    chunk_cumsum's exclusive cumsum R (G's rows shifted, to the bit) and the strict reverse sums of
    dR; decayed_scores(p, k; Gq=R, strict) = the twin's strict P; qk_grads(p, k, dP; Gq=R) = autograd
    of that twin in p, k, G and R; sum_grads with a probe key and R's parts apart."""
    lengths = [9, 0, 50, 1]
    T, C, K = sum(lengths), 32, 12
    cu = torch.tensor([0] + lengths).cumsum(0)
    L = make_layout(1, T, 2, 1, K, 8, C, cu.to(DEV), DEV)
    lay = torch_layout(1, T, C, cu)
    x = delta_inputs(gate, gen, T=T, H=2, Hq=1, K=K, V=8, N=len(lengths), g_scale=3.0, probe=True)
    d = to_dev(x)
    G, R = chunk_cumsum(d["g"], L, exclusive=True)
    Gt = twin.chunk_cumsum(lay.to_chunks(x["g"].double()))  # [1, H, N, C(, K)]
    Rt = torch.cat([torch.zeros_like(Gt[:, :, :, :1]), Gt[:, :, :, :-1]], dim=3)
    assert rel(G, lay.from_chunks(Gt)) < F32
    Gc = lay.to_chunks(G.cpu())
    assert torch.equal(R.cpu(), lay.from_chunks(torch.cat([torch.zeros_like(Gc[:, :, :, :1]), Gc[:, :, :, :-1]], 3)))
    dG, dR = (torch.randn(G.shape, generator=gen) for _ in range(2))
    add = torch.randn(1, L.NT, 2, *G.shape[3:], generator=gen)
    dg = chunk_cumsum(dG.to(DEV), L, reverse=True, add=add.to(DEV), excl=dR.to(DEV))
    gc, dGc, dRc = (lay.to_chunks(t.double()) for t in (x["g"], dG, dR))
    gc.requires_grad_(True)
    Gg = twin.chunk_cumsum(gc)
    Rg = torch.cat([torch.zeros_like(Gg[:, :, :, :1]), Gg[:, :, :, :-1]], dim=3)
    (want,) = torch.autograd.grad((Gg * dGc).sum() + (Rg * dRc).sum(), gc)
    slots = torch.cat([torch.arange(n0, n1) for n0, n1 in lay.ranges])  # the chunk slots in use
    want = want + add[0, slots].double().transpose(0, 1).unsqueeze(0).unsqueeze(3)  # + the per-chunk term
    assert rel(dg, lay.from_chunks(want)) < F32

    # P = R̃Kᵀ (strict) and its backward
    pc = lay.to_chunks(x["p"].double().repeat_interleave(2, 2)).requires_grad_(True)
    kc = lay.to_chunks(x["k"].double().repeat_interleave(2, 2)).requires_grad_(True)
    Gl, Rl = Gt.clone().requires_grad_(True), Rt.clone().requires_grad_(True)
    P_want = twin.decayed_scores(pc, kc, Rl, Gl, strict=True)
    P = decayed_scores(d["p"], d["k"], G, None, 1.0, L, Gq=R, strict=True)
    assert rel(P, lay.from_chunks(P_want.detach())) < F32
    dP = torch.tril(torch.randn(P_want.shape, generator=gen, dtype=torch.float64), diagonal=-1)
    dp, dk, _, (dG_k, dG_q) = qk_grads(d["p"], d["k"], None, G, None, None, None, None,
                                       lay.from_chunks(dP).float().to(DEV), 1.0, L, grad_dtype=torch.float32, Gq=R)
    want = torch.autograd.grad((P_want * dP).sum(), [pc, kc, Gl, Rl])
    for got, w, name in zip((dp, dk, dG_k, dG_q), want, ("dp", "dk", "dG", "dR")):
        assert rel(got, lay.from_chunks(w)) < F32, name

    # sum_grads: dk = dk₁ + dk₄, dp = dk₂ + dk₃ (folded over the group), dG = dG₁ + dG₃, dR = dG₂ + dG₄
    parts = [torch.randn(1, T, 2, K, generator=gen) for _ in range(5)]
    dgs = [torch.randn(G.shape, generator=gen) for _ in range(4)]
    dq, dk, dp, dG, dR = sum_grads(parts[0].to(DEV), [t.to(DEV) for t in parts[1:]], [t.to(DEV) for t in dgs],
                                   torch.float32, L, probe=True)
    fold = lambda t: t.sum(2, keepdim=True)  # noqa: E731  (H_q = 1)
    assert rel(dq, fold(parts[0])) < F32
    assert rel(dk, fold(parts[1] + parts[4])) < F32 and rel(dp, fold(parts[2] + parts[3])) < F32
    assert rel(dG, dgs[0] + dgs[2]) < F32 and rel(dR, dgs[1] + dgs[3]) < F32


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("variant, T", [("comba", 1), ("comba", 63), ("comba", 65), ("comba", 130),
                                        ("product2", 1), ("product2", 33), ("product3", 1), ("product3", 21)])
def test_matches_recurrence(variant, T, gen):
    """The zoo's scalar gate; T around multiples of the chunk (16 rows; 64 for T = 130: the
    inverse's three merge levels), T·n rows for DeltaProduct; one token in two batch rows."""
    _against_recurrence(variant, "scalar", gen, B=2 if T == 1 else 1, T=T, chunk_size=64 if T == 130 else 16)


@pytest.mark.parametrize("gate", ["none", "diagonal"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_gates(variant, gate, gen):
    """No decay, and a diagonal (KDA-style) decay three times as strong: R − G exponents of every sign
    are masked before the exp."""
    _against_recurrence(variant, gate, gen, T=VARIANTS[variant][2], g_scale=3.0)


@pytest.mark.parametrize("gate", ["scalar", "diagonal"])
def test_comba_forgets_at_once(gate, gen):
    """Comba with g = −100 on some tokens (the state wiped): the read decay's R_i − G_i = −g_i = 100 on
    the diagonal must never reach an exp in fp32 (e^100 = inf, and inf · 0 = NaN in the backward)."""
    x = delta_inputs(gate, gen, T=37, K=8, V=8, probe=True)
    x["g"][:, 5::11] = -100.0
    seed = secrets.randbits(31)
    want = grads(_recurrent(_recipe("comba", gate)), {key: val.double() for key, val in x.items()}, seed)
    check(grads(delta_triton, x, seed, decay_first=False), want, COMBA_WIPE_F32_REL, "g = -100")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grouped_heads(variant, gen):
    """H_q = 1 | H = 2 at chunk 32: the q, k (and p) gradients sum over the group."""
    _against_recurrence(variant, "scalar", gen, T=VARIANTS[variant][2], H=2, Hq=1, chunk_size=32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_varlen(variant, gen):
    """Packed sequences (an empty and a length-1 one; cu_seqlens in tokens, scaled by n inside)
    equal each sequence run alone by the recurrence: outputs, final states, every gradient."""
    lengths = [7, 0, 12, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    _against_recurrence(variant, "scalar", gen, T=sum(lengths), N=len(lengths), cu=cu)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chained_states(variant, gen):
    """Running [0, t) then [t, T) from the carried state equals one run (t off a chunk boundary)."""
    opts, decay_first, T = VARIANTS[variant]
    d = to_dev(delta_inputs("scalar", gen, B=2, T=T, K=8, V=8, **opts))
    t = T // 2 + 1

    def run(a, b, S0):
        part = {key: val[:, a:b] for key, val in d.items() if key != "S0"}
        return chunk_delta_triton(part["q"], part["k"], part["v"], g=part["g"], beta=part["beta"], p=part.get("p"),
                                  decay_first=decay_first, scale=0.4, initial_state=S0, output_final_state=True,
                                  chunk_size=16)

    o, S = run(0, T, d["S0"])
    o1, S1 = run(0, t, d["S0"])
    o2, S2 = run(t, T, S1)
    assert rel(torch.cat([o1, o2], dim=1), o) < CHUNK_F32_REL
    assert rel(S2, S) < CHUNK_F32_REL


def _torch_run(decay_first, *, chunk_size=16, inverse="blocks"):
    def run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_delta(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], p=xd.get("p"),
                           decay_first=decay_first, scale=0.4, initial_state=xd["S0"], output_final_state=True,
                           chunk_size=chunk_size, inverse=inverse)
    return run


@pytest.mark.parametrize("variant", ["comba", "product2"])
def test_bf16_inputs(variant, gen):
    """bf16 inputs: o and every gradient in bf16, within TRITON_DELTA_LOW_REL of the fp32 torch chunk
    form on the same rounded values."""
    opts, decay_first, T = VARIANTS[variant]
    x = delta_inputs("scalar", gen, T=T, K=16, V=16, dtype=torch.bfloat16, **opts)
    seed = secrets.randbits(31)
    got = grads(delta_triton, x, seed, decay_first=decay_first)
    assert got[0].dtype == torch.bfloat16 and all(got[2][name].dtype == torch.bfloat16 for name in got[2])
    check(got, grads(_torch_run(decay_first), x, seed), TRITON_DELTA_LOW_REL[torch.bfloat16], variant)


def test_bad_arguments(gen):
    """A probe key of the wrong shape or dtype, a probe key with micro-steps, DeltaProduct's v or β
    of the wrong shape: InputError naming the argument."""
    x = to_dev(delta_inputs("scalar", gen, T=20, H=2, K=8, V=8, probe=True))
    with pytest.raises(InputError, match="p"):
        chunk_delta_triton(x["q"], x["k"], x["v"], p=x["p"][:, :3], decay_first=False, scale=None)
    with pytest.raises(InputError, match="p must have"):
        chunk_delta_triton(x["q"], x["k"], x["v"], p=x["p"].double(), decay_first=False, scale=None)
    y = to_dev(delta_inputs("scalar", gen, T=20, H=2, K=8, V=8, n=2))
    with pytest.raises(InputError, match="probe"):
        chunk_delta_triton(y["q"], y["k"], y["v"], p=x["p"], scale=None)
    with pytest.raises(InputError, match="v"):
        chunk_delta_triton(y["q"], y["k"], y["v"][:, :, :1], scale=None)
    with pytest.raises(InputError, match="beta"):
        chunk_delta_triton(y["q"], y["k"], y["v"], beta=y["beta"][:, :, 0], scale=None)


@pytest.mark.parametrize("model", ["comba", "deltaproduct"])
def test_dispatch_row_matches_torch_backend(model, gen):
    """The delta chunk triton row's fn on a validated Call gives the torch row's outputs and final
    state; called directly because its predicate asks for CUDA."""
    chunk_rows_agree(model, gen, CHUNK_F32_REL)


# ---------------------------------------------------------------------------- realistic shapes (GPU)
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["comba", "product2"])
@pytest.mark.cuda_big
def test_cuda_realistic(variant, dtype, gen):
    """On the GPU, B = 2, T = 2048, H = 4, D = 128 (DeltaProduct: 4096 micro-steps), chunk 64: outputs,
    final states and every gradient against the fp32 torch chunk form (the torch row's, inverse
    "solve"), bf16 inputs on the same rounded values; fp32 as well, at the tighter tolerance."""
    opts, decay_first, _ = VARIANTS[variant]
    x = delta_inputs("scalar", gen, B=2, T=2048, H=4, K=128, V=128, dtype=dtype, **opts)
    seed = secrets.randbits(31)
    want = grads(_torch_run(decay_first, chunk_size=64, inverse="solve"), to_dev(x), seed)
    got = grads(delta_triton, x, seed, decay_first=decay_first, chunk_size=64)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    check(got, want, tol, f"{variant} {dtype}")
