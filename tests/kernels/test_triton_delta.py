"""fastweights.kernels.triton's delta-class pipeline (delta_*.py, delta.py) against its torch twins
(fastweights/chunkwise/delta.py, common.py) and the exact recurrence.

Marked `triton`: on a machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 at tiny
shapes (K, V ≤ 16, T ≤ 70), computing in fp32 and compared relative to float64; the same checks at
realistic shapes are marked `cuda` (`pytest -m cuda`). Kernel outputs are NaN-poisoned
(tests/conftest.py), so an element a kernel forgets to write fails. Inputs are fresh random each
run; the seed is printed.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import fastweights as fw
from fastweights.chunkwise import chunk_delta
from fastweights.chunkwise import common as twin
from fastweights.chunkwise.delta import block_unit_lower_inverse, delta_decays, delta_transitions
from fastweights.chunkwise.delta import wy_representation as wy_twin
from fastweights.chunkwise.varlen import make_layout as torch_layout
from fastweights.inputs import InputError
from fastweights.kernels.pipelines import DeltaPipeline, delta_pipeline
from fastweights.kernels.triton import delta as delta_mod
from fastweights.kernels.triton.common.layout import make_layout
from fastweights.kernels.triton.delta import chunk_delta_triton
from fastweights.kernels.triton.stages.cumsum import chunk_cumsum
from fastweights.kernels.triton.stages.delta_grads import sum_grads
from fastweights.kernels.triton.stages.delta_inverse import unit_lower_inverse
from fastweights.kernels.triton.stages.delta_output import chunk_outputs, chunk_outputs_bwd_local
from fastweights.kernels.triton.stages.delta_states import pass_states_bwd, pass_states_fwd
from fastweights.kernels.triton.stages.delta_wy import wy_representation, wy_representation_bwd
from fastweights.kernels.triton.stages.scores import decayed_scores
from tests.kernels.helpers import (
    DEV,
    check,
    chunk_rows_agree,
    delta_bf16_agrees,
    delta_summand_scales,
    each_sequence_alone,
    grads,
    rel,
    to_dev,
)
from tests.kernels.helpers import delta_inputs as _inputs
from tests.kernels.helpers import delta_triton as _triton
from tests.tolerances import CHUNK_F32_REL, CHUNK_LONG_F32_REL, F32, TRITON_DELTA_LOW_REL

pytestmark = pytest.mark.triton

GATES = ["none", "scalar", "diagonal"]
MODEL = {"none": "deltanet", "scalar": "gated_deltanet", "diagonal": "kda"}



def _recurrent(gate):
    def run(x, *, scale=0.4):
        extra = {"g": x["g"]} if "g" in x else {}
        return fw.recurrent(MODEL[gate], x["q"], x["k"], x["v"], scale=scale, beta=x["beta"],
                            initial_state=x["S0"], output_final_state=True, **extra)
    return run


# ---------------------------------------------------------------------------- stages vs torch twins
class _Stages:
    """Varlen (lengths with an empty and a length-1 sequence), grouped heads (H_q = 1, H = 2) and
    strong decay (g_scale 3): every forward stage on Triton, and the torch twins' tensors in float64
    on the chunk layout [B, H, N, C, ·]."""

    def __init__(self, gate, gen, C, staged=True):
        """staged=False: the twins' inputs only (no Triton stage runs; the fused forward's tests)."""
        lengths = [9, 0, 70, 1]  # the longest ≥ 65: the torch twins' layout keeps a chunk of 128 (it clamps
        # the chunk to the power of two ≥ the longest sequence)
        self.T, self.C, self.H, self.K, self.V = sum(lengths), C, 2, 12, 10
        self.cu = torch.tensor([0] + lengths).cumsum(0)
        self.gate = gate
        x = self.x = _inputs(gate, gen, T=self.T, H=2, Hq=1, N=len(lengths), g_scale=3.0)
        self.L = L = make_layout(1, self.T, 2, 1, self.K, self.V, C, self.cu.to(DEV), DEV)
        self.lay = lay = torch_layout(1, self.T, C, self.cu)
        d = self.d = to_dev(x)
        if staged:
            self.G = G = chunk_cumsum(d["g"], L) if gate != "none" else None
            self.P = decayed_scores(d["k"], d["k"], G, None, 1.0, L)
            self.Ti = unit_lower_inverse(self.P, d["beta"], L)
            self.w, self.u1 = wy_representation(d["k"], d["v"], G, d["beta"], self.Ti, L)
            self.h, self.ht, self.u = pass_states_fwd(d["k"], self.w, self.u1, G, d["S0"], L,
                                                      output_final_state=True)
            self.A = decayed_scores(d["q"], d["k"], G, None, 0.4, L)
            self.o = chunk_outputs(d["q"], self.u, G, self.A, self.h, 0.4, L)
        # twins, float64
        xd = {key: val.double() for key, val in x.items()}
        self.qc = lay.to_chunks(xd["q"].repeat_interleave(2, 2) * 0.4)
        self.kc = lay.to_chunks(xd["k"].repeat_interleave(2, 2))
        self.vc = lay.to_chunks(xd["v"])
        self.bc = lay.to_chunks(xd["beta"])
        self.Gt = twin.chunk_cumsum(lay.to_chunks(xd["g"])) if gate != "none" else None
        self.used = torch.cat([torch.arange(n0, n1) for n0, n1 in lay.ranges])  # chunk slots in use

    def twins(self, U1=None, W=None, S0=None):
        """(Lm, T, U', W, R̃, Q̃, K̃, a, Aqk, entering, final, o) of the torch stages; U1, W, S0 may be
        given (autograd leaves)."""
        Gt, kind = self.Gt, self.gate
        q_dec, r_dec, k_dec, a = delta_decays(self.qc, self.kc, self.kc, Gt, Gt, kind)
        Lm = twin.decayed_scores(self.kc, self.kc, Gt, Gt, strict=True) * self.bc.unsqueeze(-1)
        Tw = block_unit_lower_inverse(Lm)
        U1w, Ww = wy_twin(Tw, self.vc, r_dec, self.bc)
        U1 = U1w if U1 is None else U1
        W = Ww if W is None else W
        S0 = self.x["S0"].double() if S0 is None else S0
        M, Bn = delta_transitions(a, k_dec, W, U1)
        entering, final = twin.pass_states(self.lay, S0, M, Bn)
        Aqk = twin.decayed_scores(self.qc, self.kc, Gt, Gt, strict=False)
        o = twin.chunk_outputs(self.lay, Aqk @ U1, q_dec - Aqk @ W, entering, torch.float64)
        return dict(Lm=Lm, T=Tw, U1=U1, W=W, r_dec=r_dec, q_dec=q_dec, k_dec=k_dec, a=a, Aqk=Aqk,
                    entering=entering, final=final, o=o)


@pytest.mark.parametrize("gate", GATES)
def test_forward_stages(gate, gen):
    """unit_lower_inverse (chunk 64: four 16×16 blocks, three merge levels; test_backward_stages
    runs chunk 32), wy_representation, pass_states (entering states, final state, new values
    U = U' − W S_n) and the output against the torch twins."""
    s = _Stages(gate, gen, 64)
    t = s.twins()
    lay = s.lay
    assert rel(s.Ti, lay.from_chunks(t["T"])) < F32
    assert rel(s.w, lay.from_chunks(t["W"])) < F32
    assert rel(s.u1, lay.from_chunks(t["U1"])) < F32
    assert rel(s.h[0, s.used].transpose(0, 1), t["entering"][0]) < F32
    assert rel(s.ht, t["final"]) < F32
    assert rel(s.u, lay.from_chunks(t["U1"] - t["W"] @ t["entering"])) < F32
    assert rel(s.A, lay.from_chunks(t["Aqk"])) < F32
    assert rel(s.o, t["o"]) < F32


@pytest.mark.parametrize("gate", GATES)
def test_backward_stages(gate, gen):
    """chunk_outputs_bwd_local (Aqkᵀ dO, dO Uᵀ), pass_states_bwd (the gradient of U, dS_0) and
    wy_representation_bwd (dv, the W path's dk and dG, dβ, dP) against autograd through the torch
    twins, chunk 32, for random cotangents of o and S_T."""
    s = _Stages(gate, gen, 32)
    assert rel(s.Ti, s.lay.from_chunks(s.twins()["T"])) < F32  # one block merge at chunk 32
    lay, L, d = s.lay, s.L, s.d
    do = torch.randn(1, s.T, s.H, s.V, generator=gen, dtype=torch.float64)
    dST = torch.randn(s.ht.shape, generator=gen, dtype=torch.float64)
    du, dA = chunk_outputs_bwd_local(s.A, s.u, do.float().to(DEV), L)
    doc = lay.to_chunks(do)
    uc = lay.to_chunks(s.u.double().cpu())
    Ac = lay.to_chunks(s.A.double().cpu())
    assert rel(du, lay.from_chunks(Ac.transpose(-1, -2) @ doc)) < F32
    assert rel(dA, lay.from_chunks(torch.tril(doc @ uc.transpose(-1, -2)))) < F32
    dh, dh0, _ = pass_states_bwd(d["q"], d["k"], s.w, s.G, s.h, s.ht, dST.float().to(DEV), do.float().to(DEV), du,
                                 0.4, L, need_dh0=True)
    t = s.twins()
    U1 = t["U1"].detach().requires_grad_(True)
    S0 = s.x["S0"].double().requires_grad_(True)
    t2 = s.twins(U1=U1, W=t["W"].detach(), S0=S0)
    dU1, dS0 = torch.autograd.grad((t2["o"] * do).sum() + (t2["final"] * dST).sum(), [U1, S0])
    assert rel(du, lay.from_chunks(dU1)) < F32
    assert rel(dh0, dS0) < F32
    # the WY stage: leaves v, β, the keys of R̃ and their log-decay, P (strict KKᵀ without β)
    dv, dk_w, dbeta, dG_w, dP = wy_representation_bwd(d["k"], d["v"], s.G, d["beta"], s.Ti, s.P, s.h, du, L)
    vc, bc, kc = (t.detach().clone().requires_grad_(True) for t in (s.vc, s.bc, s.kc))
    Gw = s.Gt.clone().requires_grad_(True) if s.Gt is not None else None
    P = twin.decayed_scores(s.kc, s.kc, s.Gt, s.Gt, strict=True).requires_grad_(True)
    r_dec = kc if Gw is None else kc * twin.scalar_or_diag(Gw, gate).exp()
    U1w, Ww = wy_twin(block_unit_lower_inverse(P * bc.unsqueeze(-1)), vc, r_dec, bc)
    entering = s.h[0, s.used].transpose(0, 1).unsqueeze(0).double().cpu()  # [1, H, N, K, V]
    duc = lay.to_chunks(du.double().cpu())
    loss = (U1w * duc).sum() - (Ww * (duc @ entering.transpose(-1, -2))).sum()
    leaves = [vc, bc, kc, P] + ([Gw] if Gw is not None else [])
    want = torch.autograd.grad(loss, leaves)
    assert rel(dv, lay.from_chunks(want[0])) < F32
    assert rel(dbeta, lay.from_chunks(want[1])) < F32
    assert rel(dk_w, lay.from_chunks(want[2])) < F32
    assert rel(dP, lay.from_chunks(want[3])) < F32
    if Gw is not None:
        assert rel(dG_w, lay.from_chunks(want[4])) < F32


@pytest.mark.parametrize("gate", GATES)
def test_sum_grads_stage(gate, gen):
    """sum_grads: dq and the four dk parts summed over each group of value heads (H_q = 2, H = 6) and
    cast to bf16, the three dG parts summed, against torch."""
    B, T, Hq, H, K = 2, 37, 2, 6, 12
    L = make_layout(B, T, H, Hq, K, 8, 16, None, DEV)
    parts = [torch.randn(B, T, H, K, generator=gen) for _ in range(5)]
    gshape = {"none": None, "scalar": (B, T, H), "diagonal": (B, T, H, K)}[gate]
    dgs = None if gshape is None else [torch.randn(*gshape, generator=gen) for _ in range(3)]
    dq, dk, dp, dG, dR = sum_grads(parts[0].to(DEV), [p.to(DEV) for p in parts[1:]],
                                   None if dgs is None else [p.to(DEV) for p in dgs], torch.bfloat16, L)
    assert dp is None and dR is None
    fold = lambda x: x.view(B, T, Hq, H // Hq, K).sum(3)  # noqa: E731
    assert dq.dtype == dk.dtype == torch.bfloat16
    assert rel(dq, fold(parts[0])) < TRITON_DELTA_LOW_REL[torch.bfloat16]  # (the interpreter's bf16 cast truncates)
    assert rel(dk, fold(sum(parts[1:]))) < TRITON_DELTA_LOW_REL[torch.bfloat16]
    if dgs is None:
        assert dG is None
    else:
        assert rel(dG, sum(dgs)) < F32


# ---------------------------------------------------------------------------- the whole vs the recurrence
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("gate", GATES)
def test_matches_recurrence(gate, T, gen):
    """Outputs, final state and every gradient (q, k, v, g, β, S0) in fp32 against the float64
    recurrence, relative; T around a multiple of the chunk (16), and a single token in two batch rows."""
    x = _inputs(gate, gen, B=2 if T == 1 else 1, T=T, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed), want, CHUNK_F32_REL, f"T={T}", scales=delta_summand_scales(x, seed, want))


@pytest.mark.parametrize("gate", GATES)
def test_chunk_64(gate, gen):
    """The GPU's chunk size 64 (four 16-row blocks: the inverse's three merge levels), T = 65 (a
    second, one-row chunk), against the float64 recurrence."""
    x = _inputs(gate, gen, T=65, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=64), want, CHUNK_F32_REL, "C=64")


@pytest.mark.parametrize("gate", GATES)
def test_grouped_heads(gate, gen):
    """Grouped heads H_q = 1 | H = 2 at chunk 32: the q/k gradients sum over the group."""
    x = _inputs(gate, gen, T=34, H=2, Hq=1, K=8, V=8)
    seed = secrets.randbits(31)
    want = grads(_recurrent(gate), {key: val.double() for key, val in x.items()}, seed)
    check(grads(_triton, x, seed, chunk_size=32), want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_varlen(gate, gen):
    """Packed sequences (with an empty and a length-1 one, and trailing empty ones as `Segments.build(max_documents=)`
    pads cu_seqlens) equal each sequence run alone by the recurrence: outputs, the final state of each (an empty
    sequence's: its initial state), and every gradient."""
    lengths = [7, 0, 20, 1, 9, 0, 0]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), K=8, V=8, N=len(lengths))
    seed = secrets.randbits(31)
    got = grads(_triton, x, seed, cu_seqlens=cu)
    rec = _recurrent(gate)

    alone = each_sequence_alone(rec, cu)

    want = grads(alone, {key: val.double() for key, val in x.items()}, seed)
    check(got, want, CHUNK_F32_REL)


@pytest.mark.parametrize("gate", GATES)
def test_chained_states(gate, gen):
    """Running [0, t) then [t, T) from the carried state equals one run (t not on a chunk boundary)."""
    d = to_dev(_inputs(gate, gen, B=2, T=37, K=8, V=8))
    kw = dict(scale=0.4, output_final_state=True, chunk_size=16)

    def run(a, b, S0):
        part = {key: val[:, a:b] for key, val in d.items() if key != "S0"}
        return chunk_delta_triton(part["q"], part["k"], part["v"], g=part.get("g"), beta=part["beta"],
                                  initial_state=S0, **kw)

    o, S = run(0, 37, d["S0"])
    o1, S1 = run(0, 19, d["S0"])
    o2, S2 = run(19, 37, S1)
    assert rel(torch.cat([o1, o2], dim=1), o) < CHUNK_F32_REL
    assert rel(S2, S) < CHUNK_F32_REL


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs(gate, gen):
    """bf16 q, k, v, β, g, S0: o and every gradient come back in bf16, within TRITON_DELTA_LOW_REL of
    the fp32 torch chunk form on the same rounded values. (Under the interpreter the bf16
    tensor-core products are emulated by rounding the operands: util.mm.)"""
    delta_bf16_agrees(gate, gen)


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_small_head_dims_run_in_fp32_on_a_gpu(gate, gen, monkeypatch):
    """Below LOW_PRECISION_MIN_HEAD_DIM_CUDA on a GPU (bf16 was wrong there on Hopper) a bf16 call warns and runs
    the kernels on fp32 copies: o and every gradient in bf16, equal to the same call on fp32 inputs rounded to
    bf16, the kernels seeing fp32 only. (On the CPU: the pipeline passed; the rule is checked for a CUDA call.)"""
    x = _inputs(gate, gen, T=33, K=16, V=16, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    seen = []
    real = delta_mod.ChunkDeltaTriton.apply
    monkeypatch.setattr(delta_mod.ChunkDeltaTriton, "apply", lambda *a: seen.append(a[0].dtype) or real(*a))
    with pytest.warns(UserWarning, match="run in fp32 at head dims K=16, V=16"):
        got = grads(_triton, x, seed, pipeline=DeltaPipeline(fp32=True))
    assert seen == [torch.float32]
    assert got[0].dtype == torch.bfloat16 and all(got[2][name].dtype == torch.bfloat16 for name in got[2])
    def upcast(d):  # the same call on fp32 copies by hand, its output cast back
        o, S = _triton({key: val.float() if key in ("q", "k", "v", "p") else val for key, val in d.items()})
        return o.to(torch.bfloat16), S

    want = grads(upcast, x, seed)
    assert torch.equal(got[0], want[0].to(torch.bfloat16)) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name].to(torch.bfloat16)), name

    def fp32(device_type, K, V):
        return delta_pipeline(gate=gate, probe=False, decay_first=True, device_type=device_type,
                              dtype=torch.bfloat16, K=K, V=V, C=64).fp32

    assert fp32("cuda", 16, 16) and fp32("cuda", 64, 32)
    assert not fp32("cuda", 64, 64) and not fp32("cuda", 128, 256)
    assert not fp32("cpu", 16, 16)  # the CPU: as asked


@pytest.mark.variants
@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("gate", GATES)
def test_recomputed_states_are_bitwise_the_kept_ones(gate, final, gen, monkeypatch):
    """The backward recomputing the forward state pass (the pipeline's recompute_states, the default) gives
    bitwise the gradients of keeping h, U and S_T, and keeps none of them: only the inputs and T. (The
    staged forward and backward: the fused forward's kept states differ from the staged recompute by rounding —
    test_triton_delta_fused.test_kept_states —, and so do the fused backward's — test_triton_delta_fused_bwd.)"""
    x = _inputs(gate, gen, B=2, T=37, K=8, V=8)
    seed = secrets.randbits(31)

    def run(d, pipe):
        o, S = _triton(d, pipeline=pipe)
        return o, (S if final else S.detach() * 0)

    out = {}
    for recompute in (True, False):
        pipe = DeltaPipeline("staged", "staged", recompute)  # (the fused backward: test_triton_delta_fused_bwd.py)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t, lambda t: t):
            out[recompute] = grads(run, x, seed, pipe=pipe)
        out[recompute, "kept"] = sorted(t.numel() for t in kept)
    (o1, s1, g1), (o2, s2, g2) = out[True], out[False]
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and set(g1) == set(g2)
    for name in g2:
        assert torch.equal(g1[name], g2[name]), name
    B, T, H, K, V, NT = 2, 37, 1, 8, 8, 3  # chunk 16: 3 slots; h [B, NT, H, K, V], U [B, T, H, V], S_T [B, H, K, V]
    assert len(out[False, "kept"]) == len(out[True, "kept"]) + 3
    gone = list(out[False, "kept"])
    for n in out[True, "kept"]:
        gone.remove(n)
    assert sorted(gone) == sorted([B * NT * H * K * V, B * T * H * V, B * H * K * V])


@pytest.mark.parametrize("gate", GATES)
def test_keeps_the_prologue_raw_qk(gate, gen):
    """q̂, k̂ straight from `delta_prologue`: the op keeps the prologue's raw q, k (kept by the prologue
    anyway) and recomputes q̂, k̂ in its backward — bitwise the gradients of keeping q̂, k̂ (a clone,
    which the op cannot trace back), and two tensors of q's size fewer kept. A q̂ changed in place
    after the prologue is not traced back (l2_source None)."""
    from fastweights.kernels.triton.layer.prologue import delta_prologue, l2_source

    x = _inputs(gate, gen, B=2, T=37, H=2, Hq=1, K=8, V=8)
    x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5  # raw q, k: not unit rows
    seed = secrets.randbits(31)

    def run(traced):
        def fn(d):
            qh, kh, _, _ = delta_prologue(d["q"], d["k"], None, None, gate=None)
            if not traced:
                qh, kh = qh.clone(), kh.clone()
            return chunk_delta_triton(qh, kh, d["v"], g=d.get("g"), beta=d["beta"], scale=0.4,
                                      initial_state=d["S0"], output_final_state=True, chunk_size=16)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = grads(fn, to_dev(x), seed)
        return out, sorted(t.numel() for t in kept)

    (o1, s1, g1), kept1 = run(True)
    (o2, s2, g2), kept2 = run(False)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    for name in g2:
        assert torch.equal(g1[name], g2[name]), name
    gone = list(kept2)
    for n in kept1:
        gone.remove(n)
    assert gone == [x["q"].numel(), x["k"].numel()]
    qh = delta_prologue(to_dev(x)["q"], None, None, None, gate=None)[0]
    assert l2_source(qh) is not None and l2_source(qh.clone()) is None
    qh.mul_(2)
    assert l2_source(qh) is None


def test_no_beta_no_state_no_final(gen):
    """β = None means β = 1 (DeltaNet's plain rule); no initial state; no final state returned."""
    x = to_dev(_inputs("scalar", gen, T=20, K=8, V=8))
    o, S = chunk_delta_triton(x["q"], x["k"], x["v"], g=x["g"], scale=None, chunk_size=16)
    o_want, _ = chunk_delta(x["q"].cpu(), x["k"].cpu(), x["v"].cpu(), g=x["g"].cpu(), beta=None, scale=None,
                            chunk_size=16)
    assert S is None and rel(o, o_want) < CHUNK_F32_REL


def test_bad_arguments(gen):
    x = to_dev(_inputs("scalar", gen, T=20, H=2, K=8, V=8))
    with pytest.raises(InputError, match="chunk_size"):
        chunk_delta_triton(x["q"], x["k"], x["v"], g=x["g"], scale=None, chunk_size=24)
    with pytest.raises(InputError, match="dtype"):
        chunk_delta_triton(x["q"].double(), x["k"].double(), x["v"].double(), scale=None)
    with pytest.raises(InputError, match="initial_state"):
        chunk_delta_triton(x["q"], x["k"], x["v"], scale=None, initial_state=x["S0"][:, :1])
    with pytest.raises(InputError, match="beta"):
        chunk_delta_triton(x["q"], x["k"], x["v"], beta=x["beta"][:, :3], scale=None)


# ---------------------------------------------------------------------------- realistic shapes (GPU)
CUDA_SIZES = [(2, 1024, 4, 64), (4, 4096, 16, 128), (3, 1000, 8, 128), (1, 4096, 4, 256)]


def _torch_run(xd, *, chunk_size=64, cu_seqlens=None):
    xd = {key: val.float() for key, val in xd.items()}
    return chunk_delta(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                       initial_state=xd["S0"], output_final_state=True, chunk_size=chunk_size,
                       cu_seqlens=cu_seqlens, inverse="solve")


@pytest.mark.cuda
@pytest.mark.parametrize("KV", [(16, 16), (16, 32), (32, 64), (64, 32)], ids=lambda d: "K{}-V{}".format(*d))
@pytest.mark.parametrize("gate", GATES)
def test_cuda_small_head_dims_bf16(gate, KV, gen):
    """bf16 below LOW_PRECISION_MIN_HEAD_DIM_CUDA (wrong on Hopper in bf16: the call runs in fp32) against the fp32
    torch chunk form on the same rounded values: outputs, final states, every gradient."""
    K, V = KV
    x = _inputs(gate, gen, B=2, T=300, H=2, K=K, V=V, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    want = grads(_torch_run, to_dev(x), seed)
    with pytest.warns(UserWarning, match="run in fp32"):
        got = grads(_triton, x, seed, chunk_size=64)
    check(got, want, TRITON_DELTA_LOW_REL[torch.bfloat16], f"K{K} V{V}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", CUDA_SIZES, ids=lambda s: "B{}-T{}-H{}-D{}".format(*s))
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_realistic(gate, size, dtype, gen):
    """On the GPU (Hopper + Triton 3.6 is where miscompiles hide): the kernels against the fp32
    torch chunk form at realistic shapes, outputs, final states and every gradient; bf16 inputs
    against the fp32 torch result on the same rounded values."""
    B, T, H, D = size
    x = _inputs(gate, gen, B=B, T=T, H=H, K=D, V=D, dtype=dtype)
    seed = secrets.randbits(31)
    want = grads(_torch_run, to_dev(x), seed)
    got = grads(_triton, x, seed, chunk_size=64)
    tol = CHUNK_LONG_F32_REL if dtype == torch.float32 else TRITON_DELTA_LOW_REL[dtype]
    check(got, want, tol, f"{size} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_grouped_varlen_realistic(gate, gen):
    """Varlen with an empty and a length-1 sequence, grouped heads (16 value heads over 4 q/k heads)."""
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = _inputs(gate, gen, T=sum(lengths), H=16, Hq=4, K=128, V=128, N=len(lengths))
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = dict(xd)
        xd["q"], xd["k"] = xd["q"].repeat_interleave(4, 2), xd["k"].repeat_interleave(4, 2)
        return _torch_run(xd, cu_seqlens=cu.to(DEV))

    check(grads(_triton, x, seed, chunk_size=64, cu_seqlens=cu), grads(torch_run, to_dev(x), seed),
           CHUNK_LONG_F32_REL)


@pytest.mark.cuda
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.cuda_big
def test_cuda_long_bf16(gate, gen):
    """T = 65,536 in bf16 (one sequence, 4 heads of 128): forward and every gradient against the fp32
    torch chunk form on the same rounded values."""
    x = _inputs(gate, gen, T=65536, H=4, K=128, V=128, dtype=torch.bfloat16)
    seed = secrets.randbits(31)
    check(grads(_triton, x, seed, chunk_size=64), grads(_torch_run, to_dev(x), seed),
           TRITON_DELTA_LOW_REL[torch.bfloat16], "T=65536")


# ---------------------------------------------------------------------------- the dispatch row
@pytest.mark.parametrize("model", ["deltanet", "gated_deltanet", "kda"])
def test_dispatch_row_matches_torch_backend(model, gen):
    """The delta chunk triton row's fn on a validated Call gives the torch row's outputs and final
    state; called directly because its predicate asks for CUDA."""
    chunk_rows_agree(model, gen, CHUNK_F32_REL)


def test_dispatch_row_is_auto_on_cuda():
    """"auto" picks the delta chunk triton row for a CUDA target the predicate accepts (checked on the
    H100) — the decay-first delta rule, Comba (probe key, decay after) and DeltaProduct (micro-steps);
    the torch row on the CPU; the predicate names why it refuses a CPU target."""
    from fastweights.dispatch import DISPATCH, Target, resolve_backend

    bf16 = Target.of("cuda", torch.bfloat16, 128, 128)
    gdn = fw.zoo.get("gated_deltanet")
    assert resolve_backend(gdn, "chunk", "auto", bf16) == "triton"
    assert resolve_backend(gdn, "chunk", "auto", Target.of("cpu", torch.float32, 64, 64)) == "torch"
    listed = fw.backends("gated_deltanet", device="cuda", dtype=torch.bfloat16, head_dim=128, head_v_dim=128)
    assert listed[0] == "triton" and "torch" in listed
    sup = DISPATCH[("delta", "chunk", "triton")].supports
    for name in ("comba", "deltaproduct"):
        r = fw.zoo.get(name)
        assert sup(r, bf16) is None
        assert resolve_backend(r, "chunk", "auto", bf16) == "triton"
        assert resolve_backend(r, "chunk", "auto", Target.of("cpu", torch.float32, 64, 64)) == "torch"
    assert "CUDA" in sup(gdn, Target.of("cpu", torch.float32, 64, 64))
