"""The fused pre-pass's in-register inverse forms (`LAUNCH["delta_prepass"]["INV"]`, `kernels.variants.INVERSE_FORMS`):
0 — 16×16 diagonal blocks by forward substitution, then the doubling products (`delta_fused._unit_lower_inverse`);
1 — 2×2 block recursion on the whole [C, C] tile (`delta_fused._unit_lower_inverse_rec`); 2 — the 16×16 blocks by that
recursion as batched [NB, 16, 16] products, then the doubling products (`_unit_lower_inverse`, LEAF_REC; the default
since r4s15, so every other fused test runs it). The forms other than the default through the whole fused pipeline
(the fused forward, and the fused backward where it takes the call) against the torch twins and the float64
recurrence: outputs, final states, every gradient; odd lengths, varlen with an empty and a length-1 sequence, chained
states, grouped heads, every gate, bf16. Every form on ill-conditioned
chunks (β near 2, keys nearly parallel) against the float64 solve, their errors printed.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py
NaN-poisons the kernels' outputs). Inputs are fresh random each run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import fastweights as fw
from fastweights.kernels import variants as V
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.fused import delta_fused
from fastweights.kernels.triton.fused.delta_fused import fused_forward
from tests.kernels.fused.test_triton_delta_fused import fused_forward_matches_twins
from tests.kernels.helpers import (
    DEV,
    check,
    delta_bf16_agrees,
    delta_summand_scales,
    each_sequence_alone,
    force_delta_pipeline,
    grads,
    spy_launches,
    to_dev,
)
from tests.kernels.helpers import delta_inputs as _inputs
from tests.kernels.helpers import delta_triton as _triton
from tests.kernels.test_triton_delta import GATES, _recurrent
from tests.tolerances import CHUNK_F32_REL, F32, INVERSE_ILL_F32_REL

pytestmark = pytest.mark.triton

#: The LAUNCH["delta_prepass"]["INV"] forms under test here: every form but the default (every other fused test's).
OTHER_FORMS = [form for form in sorted(V.INVERSE_FORMS) if form != util.LAUNCH["delta_prepass"]["INV"]]


def _form(monkeypatch, form: int) -> None:
    monkeypatch.setattr(util, "LAUNCH", {**util.LAUNCH, "delta_prepass": {**util.LAUNCH["delta_prepass"], "INV": form}})


@pytest.fixture(params=OTHER_FORMS, ids=lambda form: V.INVERSE_FORMS[form].replace(" ", "_"))
def other_form(request, monkeypatch):
    """An inverse form other than the default (each of OTHER_FORMS) in the pre-pass; the fused forward, and the fused
    backward where it takes the call (no diagonal decay, K ≤ 128, C ≤ 64), for the test's calls; the pre-pass's INV
    launches recorded after the form (first item)."""
    _form(monkeypatch, request.param)
    force_delta_pipeline(monkeypatch, forward="fused", backward="fused")
    seen = [request.param]
    real = delta_fused._prepass_kernel.run

    def spy(*args, **kw):
        seen.append(kw["INV"])
        return real(*args, **kw)

    monkeypatch.setattr(delta_fused._prepass_kernel, "run", spy)
    return seen


def test_the_form_is_a_named_launch_choice(monkeypatch):
    """INV 0 is named "inverse by substitution" by `fw.pipeline(..., variants=True)`'s rule, 1 "inverse by recursion",
    2 (the default) "inverse by batched recursion"; each listed among the alternatives, and an INV the rule does not
    know is refused."""
    table = {**util.LAUNCH, "delta_prepass": {**util.LAUNCH["delta_prepass"], "INV": 1}}
    got = V.delta_fused_forward("scalar", 128, 64, torch.bfloat16, table)
    assert got.inverse_form == "recursion" and str(got.variant).endswith("; inverse tf32x3; inverse by recursion")
    default = str(V.delta_fused_forward("scalar", 128, 64, torch.bfloat16, util.LAUNCH).variant)
    assert util.LAUNCH["delta_prepass"]["INV"] == 2 and default.endswith("; inverse by batched recursion"), default
    substitution = {**table, "delta_prepass": {**table["delta_prepass"], "INV": 0}}
    assert str(V.delta_fused_forward("scalar", 128, 64, torch.bfloat16, substitution).variant).endswith(
        "; inverse by substitution")
    assert all(f"+ inverse by {form}" in V.ALTERNATIVES["delta fused forward"][0] for form in V.INVERSE_FORMS.values())
    batched = {**table, "delta_prepass": {**table["delta_prepass"], "INV": 2}}
    assert str(V.delta_fused_forward("none", 64, 64, torch.float32, batched).variant).endswith(
        "; raw q, k; inverse by batched recursion")
    with pytest.raises(ValueError, match='"INV"'):
        V.delta_fused_forward("none", 64, 64, torch.float32, {**table, "delta_prepass": {**table["delta_prepass"],
                                                                                        "INV": 3}})
    fwd = fw.pipeline("gated_deltanet", device="cuda", dtype=torch.bfloat16, head_dim=128, head_v_dim=128,
                      chunk_size=64, variants=True, launch=table)[2]
    assert fwd and "inverse by recursion" in fwd[0]


# ---------------------------------------------------------------------------- the kernels vs the torch twins
@pytest.mark.parametrize("form", OTHER_FORMS)
@pytest.mark.parametrize("gate, C", [(gate, C) for gate in GATES for C in (16, 32, 64, 128)
                                     if gate != "diagonal" or C in (16, 128)])
def test_other_forms_match_twins(gate, C, form, gen, monkeypatch):
    """The pre-pass with each inverse form but the default (T at C 16, 32, 64, 128: the recursion's 3 to 6 levels of
    two products; the batched leaves then 0 to 3 doubling levels; W, U') and the sequential kernel (h, U, o, the final
    state) against the torch twins, varlen with an empty and a length-1 sequence, grouped heads H_q = 1 | H = 2, strong
    decay (as test_triton_delta_fused.test_kernels_match_twins)."""
    _form(monkeypatch, form)
    fused_forward_matches_twins(gate, gen, C)


def _ill_chunks(gen, C: int, n: int, gate: str):
    """n sequences of one chunk each, ill-conditioned: β ∈ [1.8, 2), unit keys within ≈ 0.1 of one direction (so
    |k_i · k_j| ≈ 1 and (I + L)'s off-diagonal entries ≈ 2), K = V = 16; a weak scalar decay for `gate` "scalar"."""
    x = _inputs(gate, gen, B=n, T=C, K=16, V=16)
    k = torch.randn(n, C, 1, 16, generator=gen, dtype=torch.float64) * 0.1 + 1.0
    x["k"] = torch.nn.functional.normalize(k, dim=-1).float()
    x["beta"] = (1.8 + 0.2 * torch.rand(n, C, 1, generator=gen, dtype=torch.float64)).float()
    if gate == "scalar":
        x["g"] = x["g"] * 0.05
    return x


@pytest.mark.parametrize("gate", ["none", "scalar"])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_inverse_forms_on_ill_conditioned_chunks(C, gate, gen, monkeypatch):
    """Each form's T (fp32 inputs: ieee products) against the float64 solve on ill-conditioned chunks: the forward
    error max|T − T64| / max|T64| within INVERSE_ILL_F32_REL and the backward-stable residual |T (I + L) − I| within
    F32 × max(|T| |I + L|), for today's form and the recursion alike; the errors printed (the report's numbers)."""
    n = 6
    x = _ill_chunks(gen, C, n, gate)
    L = make_layout(n, C, 1, 1, 16, 16, C, None, DEV)
    d = to_dev(x)
    k = x["k"][:, :, 0].double()  # [n, C, K]
    P = k @ k.transpose(-1, -2)
    if gate == "scalar":
        G = x["g"][:, :, 0].double().cumsum(-1)
        P = P * torch.exp(torch.tril(G[:, :, None] - G[:, None, :], -1))
    Lm = torch.tril(x["beta"][:, :, 0, None].double() * P, -1)  # [n, C, C]
    eye = torch.eye(C, dtype=torch.float64)
    T64 = torch.linalg.solve_triangular(eye + Lm, eye.expand_as(Lm), upper=False, unitriangular=True)
    for form in sorted(V.INVERSE_FORMS):
        _form(monkeypatch, form)
        _, Ti, _, _, _ = fused_forward(d["q"], d["k"], d["v"], d.get("g"), d["beta"], None, 0.4, L,
                                       output_final_state=False, store_states=False, store_T=True)
        Tw = Ti[:, :, 0].double().cpu()  # [n, C, C]
        err = ((Tw - T64).abs().amax((-1, -2)) / T64.abs().amax((-1, -2))).max().item()
        res = ((Tw @ (eye + Lm) - eye).abs().amax((-1, -2))
               / (Tw.abs() @ (eye + Lm).abs()).amax((-1, -2))).max().item()
        print(f"C {C} {gate} {V.INVERSE_FORMS[form]}: max|T| {T64.abs().max().item():.2f}, forward error {err:.2e}, "
              f"residual {res:.2e}")
        assert err < INVERSE_ILL_F32_REL, (form, err)
        assert res < F32, (form, res)


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen, other_form):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64 recurrence, T around a
    multiple of the chunk (16), a single token in two batch rows; the pre-pass ran the form under test."""
    x = _inputs(gate, gen, B=2 if T == 1 else 1, T=T, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}", scales=delta_summand_scales(x, seed, want))
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}


@pytest.mark.parametrize("gate", GATES)
def test_chunk_64_grouped(gate, gen, other_form):
    """The GPU's chunk 64 (five levels), T = 130, grouped heads H_q = 1 | H = 2."""
    x = _inputs(gate, gen, T=130, H=2, Hq=1, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, CHUNK_F32_REL, "C=64")
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}


@pytest.mark.parametrize("gate", GATES)
def test_varlen(gate, gen, other_form):
    """Packed sequences (an empty and a length-1 one among them), chunk 32, equal each sequence alone (the
    recurrence): outputs, each final state, every gradient."""
    lengths = [7, 0, 45, 1, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    want = grads(each_sequence_alone(_recurrent(gate), cu), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, cu_seqlens=cu, chunk_size=32), want, CHUNK_F32_REL)
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}


@pytest.mark.parametrize("gate", GATES)
def test_chained_states(gate, gen, other_form):
    """[0, t) then [t, T) from the carried state equals one run (t not on a chunk boundary); the gradients of the
    chained run equal the one run's."""
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)

    def chained(xd):
        kw = dict(scale=0.4, output_final_state=True, chunk_size=16)

        def run(a, b, S0):
            part = {key: val[:, a:b] for key, val in xd.items() if key != "S0"}
            return chunk_delta_triton(part["q"], part["k"], part["v"], g=part.get("g"), beta=part["beta"],
                                      initial_state=S0, **kw)

        o1, S1 = run(0, 19, xd["S0"])
        o2, S2 = run(19, 37, S1)
        return torch.cat([o1, o2], dim=1), S2

    check(grads(lambda xd: chained(to_dev(xd)), x, seed), grads(_triton, x, seed), CHUNK_F32_REL, "chained")
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs(gate, gen, other_form):
    """bf16 q, k, v, β, g, S0 (the inverse's products at tf32x3): o and every gradient in bf16, within
    TRITON_DELTA_LOW_REL of the fp32 torch chunk form on the same rounded values."""
    delta_bf16_agrees(gate, gen)
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_every_form_equals_the_default(gate, gen, monkeypatch):
    """Each form through the fused pipeline (fused forward and backward) agrees with the default's to fp32 rounding:
    outputs, final states, every gradient, varlen with an empty and a length-1 sequence, grouped heads, chunk 64."""
    force_delta_pipeline(monkeypatch, forward="fused", backward="fused")
    launched = spy_launches(monkeypatch, delta_fused, ["_prepass_kernel"])
    lengths = [70, 0, 1, 33]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=2, Hq=1, K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    out = {}
    for form in sorted(V.INVERSE_FORMS):
        _form(monkeypatch, form)
        out[form] = grads(_triton, x, seed, cu_seqlens=cu, chunk_size=64)
    for form in OTHER_FORMS:
        check(out[form], out[util.LAUNCH["delta_prepass"]["INV"]], F32, V.INVERSE_FORMS[form])
    assert launched


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(3, 1000, 8, 4, 128)], ids=lambda s: "B{}-T{}-H{}-Hq{}-D{}".format(*s))
@pytest.mark.parametrize("gate", ["none", "scalar", "diagonal"])
def test_cuda_other_forms(gate, size, dtype, gen, other_form):
    """On the GPU (Triton 3.6's sm_90 code, tf32x3's real rounding), each form but the default through the fused
    pipeline against the fp32 torch chunk form: outputs, final states, every gradient (the default runs in every other
    cuda test of the fused pipeline)."""
    from tests.kernels.fused.test_triton_delta_fused import _torch_run
    from tests.tolerances import CHUNK_LONG_F32_REL, TRITON_DELTA_LOW_REL

    B, T, H, Hq, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, Hq=Hq, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed), tol, f"{size} {dtype}")
    assert len(other_form) > 1 and set(other_form) == {other_form[0]}
