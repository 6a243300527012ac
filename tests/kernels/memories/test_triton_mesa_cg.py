"""fastweights.kernels.triton.memories.mesa_cg (MesaNet's chunked conjugate-gradient solve, every iteration of a chunk's
systems in one program) against its torch twin `mesa_cg_torch` (the torch CG of chunkwise.mesa on the same
contract): the solutions x and every token's relative residual, on random SPD systems (λ per key), a nearly
converged one, padded rows, 0 to 30 steps, odd C and K (padded tiles). Then the dispatch row ("mesa", "chunk",
"triton") that runs Mesa's chunk form with both CG solves in the kernel: `fw.chunk("mesanet")` forward and backward
against the torch row and the float64 exact solve, and the shapes it refuses (with the reason shown).

Marked `triton`: under TRITON_INTERPRET=1 on CPU tensors at tiny shapes; kernel outputs are NaN-poisoned
(tests/conftest.py). Fresh random inputs every run; the seed is printed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.dispatch import DISPATCH, Target
from fastweights.inputs import InputError
from fastweights.kernels import rows
from fastweights.kernels.triton.memories import mesa_cg as mesa_cg_mod
from fastweights.kernels.triton.memories.mesa_cg import MAX_CG_C, MAX_CG_K, mesa_cg, mesa_cg_torch, mesa_cg_triton
from tests.fake_cuda import FakeCuda
from tests.kernels.helpers import DEV, rel
from tests.tolerances import (
    CHUNK_F32_REL,
    CHUNK_LONG_F32_REL,
    MESA_CG_TF32_BF16_REL,
    MESA_CG_TF32_OF_BF16,
    MESA_CG_TF32_ROW_RATIO,
)

pytestmark = pytest.mark.triton


def _system(gen, *, B=1, H=2, N=2, C=16, K=16, kind="random", dtype=torch.float64):
    """The CG contract's tensors for random SPD systems as Mesa's chunk form builds them: unit keys kc, decays
    within the chunk (A_tj = exp(c_t − c_j) β_j for j ≤ t, d_t = exp(c_t)), a symmetric PSD chunk-start state Hs,
    λ ∈ [0.25, 1.25) per key, a random right-hand side b. kind "converged": H_t + Λ ≈ Λ (Hs and β tiny: CG meets
    rounding within a few steps and iterates on it); "padded": the last rows of every chunk are 0 (a padded chunk)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kc = F.normalize(rnd(B, H, N, C, K), dim=-1)
    cum = (-0.3 * torch.rand(B, H, N, C, generator=gen, dtype=torch.float64)).cumsum(-1)
    beta = torch.rand(B, H, N, C, generator=gen, dtype=torch.float64)
    X = rnd(B, H, N, K, K)
    Hs = X @ X.transpose(-1, -2) / K
    b = rnd(B, H, N, C, K)
    if kind == "converged":
        beta, Hs = 1e-6 * beta, 1e-6 * Hs
    if kind == "padded":
        b[..., C // 2:, :] = 0
        beta[..., C // 2:] = 0
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    A = torch.where(mask, cum[..., :, None] - cum[..., None, :], float("-inf")).exp() * beta[..., None, :]
    lam = (0.25 + torch.rand(H, K, generator=gen, dtype=torch.float64))[None, :, None, None, :]
    args = (b, cum.exp()[..., None], Hs, kc, A, lam)
    return tuple(t.to(dtype) for t in args)


def _on(device, args):
    return tuple(t.to(device) for t in args)


@pytest.mark.parametrize("kind", ["random", "converged", "padded"])
@pytest.mark.parametrize("steps", [0, 1, 4, 30])
def test_the_kernel_equals_its_twin(gen, kind, steps):
    """x and the residuals of the kernel (fp32) against the twin on the same fp32 tensors: 0 steps (x = 0, residual
    1), 1 and 4 (unconverged: the iterations themselves compared), 30 (converged; the nearly converged system
    iterates ~25 steps on rounding, through the 1e-30 guards). Every element written (outputs NaN-poisoned)."""
    args = _system(gen, kind=kind, dtype=torch.float32)
    x1, r1 = mesa_cg_triton(*_on(DEV, args), steps)
    x2, r2 = mesa_cg_torch(*args, steps)
    assert x1.shape == x2.shape and r1.shape == r2.shape == args[0].shape[:-1]
    assert torch.isfinite(x1).all() and torch.isfinite(r1).all()
    if steps == 0:
        assert (x1 == 0).all()
    else:
        assert rel(x1, x2) < CHUNK_F32_REL, f"x: {rel(x1, x2):.3g}"
    assert (r1.cpu() - r2).abs().max().item() < CHUNK_F32_REL
    if kind == "padded":  # a zero right-hand side: x = 0, residual 0, as the torch form
        assert (x1[..., 8:, :] == 0).all() and (r1[..., 8:] == 0).all()
    if steps == 30:
        assert r1.max().item() < CHUNK_F32_REL  # converged (K = 16 ≤ 30 steps), to fp32 rounding
        x64 = _exact(_system_f64(args))
        assert rel(x1, x64) < CHUNK_F32_REL


def _system_f64(args):
    return tuple(t.double() for t in args)


def _exact(args):
    """x = (H_t + Λ)⁻¹ b_t by forming every H_t (float64): the solve CG approximates."""
    b, d, Hs, kc, A, lam = args
    Ht = d[..., None] * Hs.unsqueeze(3) + torch.einsum("bhntj,bhnjk,bhnjl->bhntkl", A, kc, kc)
    Ht = Ht + torch.diag_embed(lam[0, :, 0, 0])[None, :, None, None]
    return torch.linalg.solve(Ht, b[..., None])[..., 0]


@pytest.mark.parametrize("C, K", [(5, 7), (13, 20), (1, 16), (33, 3)])
def test_odd_chunks_and_key_dims_are_padded(gen, C, K):
    """C and K that are no power of two (tiles 16, 32, 64 with masked rows and columns), 3 chunks on 2 heads: the
    padding adds nothing to the products (x and residuals equal the twin's) and λ is read per head."""
    args = _system(gen, N=3, C=C, K=K, dtype=torch.float32)
    for steps in (3, 30):
        x1, r1 = mesa_cg_triton(*_on(DEV, args), steps)
        x2, r2 = mesa_cg_torch(*args, steps)
        assert rel(x1, x2) < CHUNK_F32_REL and (r1.cpu() - r2).abs().max().item() < CHUNK_F32_REL


@pytest.mark.parametrize("launch", [dict(rows=16, stream=False, causal=True), dict(rows=16, stream=True, causal=False),
                                    dict(rows=32, stream=True, causal=True), dict(rows=64, stream=False, causal=False),
                                    dict(rows=16, stream=False, causal=False)])
@pytest.mark.parametrize("C, K", [(64, 24), (33, 16), (50, 40)])
def test_the_rows_of_a_chunk_split_over_programs(gen, monkeypatch, launch, C, K):
    """Every launch variant (CG_LAUNCH: 16, 32 or 64 rows of a chunk per program — B·H·N × ⌈C / rows⌉ programs —
    Hsᵀ and kc held or re-read each iteration, the row blocks' kc tiles cut at their last row or not) solves each
    row's system alone: x and the residuals equal the twin's, a last row block cut by C (33, 50) included, and the rows
    of kc a block leaves unread or unmultiplied (j > its last row) change nothing."""
    for key, val in launch.items():
        monkeypatch.setitem(mesa_cg_mod.CG_LAUNCH, key, val)
    grids = []
    real = mesa_cg_mod._cg_kernel
    monkeypatch.setattr(mesa_cg_mod, "_cg_kernel", type("Spy", (), {"__getitem__": lambda s, g: grids.append(g) or
                                                                    real[g]})())
    args = _system(gen, N=2, C=C, K=K, dtype=torch.float32)
    x1, r1 = mesa_cg_triton(*_on(DEV, args), 30)
    x2, r2 = mesa_cg_torch(*args, 30)
    rows = min(launch["rows"], 64 if C > 32 else 32)
    blocks = -(-C // rows)
    tiles = [min(64, max(16, 1 << ((b + 1) * rows - 1).bit_length())) for b in range(blocks)]
    want = [(t, tiles.count(t)) for t in dict.fromkeys(tiles)] if launch["causal"] else [(64, blocks)]
    assert [(BC, n) for _, n, BC in mesa_cg_mod.launches(C, rows, launch["causal"])] == want
    assert grids == [(2 * 2, n) for _, n in want]
    assert rel(x1, x2) < CHUNK_F32_REL and (r1.cpu() - r2).abs().max().item() < CHUNK_F32_REL
    assert rel(x1, _exact(_system_f64(args))) < CHUNK_F32_REL


def test_tf32_solves_below_the_error_of_bf16_inputs(gen):
    """The row's precision for bf16 q, k, v (`limits.mesa_cg_precision`: "tf32", one TF32 product per tl.dot; under
    the interpreter its operands rounded to TF32, what the GPU's tensor cores multiply): x of fp32 systems (C = 64, as
    the layer's chunks) against the float64 exact solve stays well under how far the exact solve itself moves when its
    inputs are rounded to bf16 — the error every bf16 call carries anyway. ("ieee" stays at fp32 rounding.)"""
    from fastweights.kernels.triton.common.limits import mesa_cg_precision

    assert mesa_cg_precision(torch.bfloat16) == "tf32" and mesa_cg_precision(torch.float32) == "ieee"
    args = _system(gen, N=2, C=64, K=32)
    want = _exact(args)
    inputs_err = rel(_exact([t.to(torch.bfloat16).double() for t in args]), want)
    x, res = mesa_cg_triton(*_on(DEV, [t.float() for t in args]), 30, "tf32")
    assert rel(x, want) < MESA_CG_TF32_OF_BF16 * inputs_err, f"{rel(x, want):.3g} vs inputs {inputs_err:.3g}"
    assert res.max().item() < MESA_CG_TF32_OF_BF16 * inputs_err
    x, _ = mesa_cg_triton(*_on(DEV, [t.float() for t in args]), 30, "ieee")
    assert rel(x, want) < CHUNK_F32_REL
    with pytest.raises(InputError, match="precision must be one of"):
        mesa_cg_triton(*_on(DEV, [t.float() for t in args]), 30, "fp16")


def test_the_glue_and_the_kernel_refuse_what_they_do_not_take(gen):
    """The glue runs the kernel under the interpreter (or on CUDA); the kernel refuses float64, C > MAX_CG_C,
    K > MAX_CG_K and malformed tensors by name — the row's predicate keeps such calls on the torch CG."""
    calls = []
    real = mesa_cg_mod._cg_kernel
    args = _system(gen, dtype=torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mesa_cg_mod, "_cg_kernel", type("Spy", (), {"__getitem__": lambda s, g: calls.append(g) or
                                                               real[g]})())
        mesa_cg(*_on(DEV, args), 2)
    assert calls == [(2 * 2, 1)]  # one launch: a program per chunk (B·H·N = 4) and per 16 rows (C = 16)
    with pytest.raises(InputError, match="solves in fp32, not torch.float64"):
        mesa_cg_triton(*_system_f64(args), 2)
    with pytest.raises(InputError, match=f"chunks C ≤ {MAX_CG_C}, got 65"):
        mesa_cg_triton(*_system(gen, N=1, C=65, K=4, dtype=torch.float32), 2)
    with pytest.raises(InputError, match=f"key dims K ≤ {MAX_CG_K}, got 130"):
        mesa_cg_triton(*_system(gen, N=1, C=4, K=130, dtype=torch.float32), 2)
    b, d, Hs, kc, A, lam = args
    with pytest.raises(InputError, match="Hs must be"):
        mesa_cg_triton(b, d, Hs[..., :3], kc, A, lam, 2)
    with pytest.raises(InputError, match="lam must broadcast"):
        mesa_cg_triton(b, d, Hs, kc, A, lam[..., :3], 2)
    with pytest.raises(InputError, match="steps must be an int ≥ 0"):
        mesa_cg_triton(b, d, Hs, kc, A, lam, -1)


# ---------------------------------------------------------------------------- the dispatch row
def test_the_mesa_row_serves_cuda_and_refuses_the_rest_with_its_reason():
    recipe = fw.zoo.get("mesanet")
    cuda = Target.of("cuda", torch.bfloat16, 64, 64, 64)
    assert rows.triton_mesa_supports(recipe, cuda) is None
    # "auto" takes the row on CUDA (its cuda tests passed on an H200, BENCHMARKS §1m), as backend="triton" does
    for backend in ("auto", "triton"):
        assert fw.pipeline("mesanet", backend=backend, device="cuda", dtype=torch.bfloat16, head_dim=64,
                           chunk_size=64) == ("triton", "CG kernel")
    assert fw.backends("mesanet", device="cuda", dtype=torch.float32, head_dim=128, chunk_size=16) == ["triton",
                                                                                                        "torch"]
    assert ("mesa", "chunk", "triton", "CG kernel") in fw.dispatch.rows(pipelines=True)
    for target, why in ((Target.of("cuda", torch.float32, 64, 64, 128), "chunks C ≤ 64, got chunk_size=128"),
                        (Target.of("cuda", torch.float32, 256, 64, 64), "key dims ≤ 128, got 256"),
                        (Target.of("cuda", torch.float64, 64, 64, 64), "float64"),
                        (Target.of("cpu", torch.float32, 64, 64, 64), "CUDA")):
        assert why in rows.triton_mesa_supports(recipe, target)
        assert fw.pipeline("mesanet", device=target.device_type, dtype=target.dtype, head_dim=target.head_k_dim,
                           chunk_size=target.chunk_size) == ("torch", None)


def test_an_explicit_triton_backend_names_the_reason(monkeypatch):
    """A call the kernel cannot take is not run on other maths: backend="triton" raises with the predicate's reason
    (here chunk 128 > MAX_CG_C on the fake CUDA table); "auto" takes the torch row, backend="triton" at chunk 16 the
    kernel's."""
    fake = FakeCuda(monkeypatch).install()
    x = fw.example_inputs("mesanet", batch_size=1, seq_len=5, num_heads=1, head_dim=8)
    with pytest.raises(fw.api.BackendNotAvailable, match="chunks C ≤ 64, got chunk_size=128"):
        fw.chunk("mesanet", backend="triton", chunk_size=128, **x)
    fw.chunk("mesanet", chunk_size=128, **x)
    fw.chunk("mesanet", backend="triton", chunk_size=16, **x)
    assert fake.take() == [("mesa", "chunk", "torch"), ("mesa", "chunk", "triton")]


def _mesa_run(backend, dtype, x, state, device="cpu", **kw):
    """(outputs [o, H_T, G_T], {leaf: gradient}) of fw.chunk("mesanet") on x (q, k, v cast to `dtype`, the gates,
    λ and the state to fp32 for bf16, on `device`) under a random float64 projection of every output (a fixed seed:
    the same projection for every run)."""
    rest = torch.float32 if dtype == torch.bfloat16 else dtype
    leaves = {key: val.detach().to(device, dtype if key in ("q", "k", "v") else rest).requires_grad_(True)
              for key, val in x.items()}
    H0, G0 = (t.detach().to(device, rest).requires_grad_(True) for t in state)
    o, st = fw.chunk("mesanet", backend=backend, initial_state=fw.MesaState(H=H0, G=G0), output_final_state=True,
                     **leaves, **kw)
    outs = [o, st.H, st.G]
    g = torch.Generator().manual_seed(7)
    loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
    grads = torch.autograd.grad(loss, list(leaves.values()) + [H0, G0])
    return [t.detach() for t in outs], dict(zip(list(leaves) + ["H0", "G0"], grads))


def _mesa_case(gen, *, B=1, T=37, H=2, K=16, V=16):
    """Float64 inputs of mesanet (`fw.example_inputs`: unit q, k, gates, β, λ) and a random symmetric PSD H0, G0."""
    x = fw.example_inputs("mesanet", batch_size=B, seq_len=T, num_heads=H, head_dim=K, head_v_dim=V,
                          dtype=torch.float64, generator=gen)
    x.pop("initial_state", None)
    X = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64)
    G0 = 0.3 * torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return x, (0.1 * X @ X.transpose(-1, -2), G0)


def _agree(got, want, tol, what):
    (o1, g1), (o2, g2) = got, want
    for name, a, b in zip(("o", "H_T", "G_T"), o1, o2):
        assert rel(a, b) < tol, f"{what} {name}: {rel(a, b):.3g}"
    assert set(g1) == set(g2)
    for name in g2:
        assert rel(g1[name], g2[name]) < tol, f"{what} d{name}: {rel(g1[name], g2[name]):.3g}"


def test_fw_chunk_runs_both_solves_in_the_kernel(monkeypatch, gen):
    """fw.chunk("mesanet", backend="triton") on a (fake, on the CPU) CUDA device takes the row (as "auto" does,
    test_the_mesa_row_serves_cuda_...), whose forward and backward solves each run the kernel once; output, final
    state and every gradient (q, k, v, g, β, λ, H0, G0) equal the torch row's (fp32, the torch CG) and the float64
    exact solve's. T = 37 (a padded last chunk of 16)."""
    calls = []
    real = mesa_cg_mod.mesa_cg_triton
    monkeypatch.setattr(mesa_cg_mod, "mesa_cg_triton", lambda *a: calls.append(1) or real(*a))
    fake = FakeCuda(monkeypatch, kernels=True).install() if DEV == "cpu" else None
    x, state = _mesa_case(gen)
    exact = _mesa_run("torch", torch.float64, x, state, mesa_solve="exact", chunk_size=16)
    torch_cg = _mesa_run("torch", torch.float32, x, state, chunk_size=16)
    got = _mesa_run("triton", torch.float32, x, state, device=DEV, chunk_size=16)
    _agree(got, torch_cg, CHUNK_F32_REL, "triton vs torch CG")
    _agree(got, exact, CHUNK_F32_REL, "triton vs exact")
    assert len(calls) == 2  # a forward and a backward solve
    if fake is not None:
        assert fake.take().count(("mesa", "chunk", "triton")) == 1


def _errors(got, want):
    """{name: relative error} of _mesa_run's outputs (o, H_T, G_T) and gradients against another run's."""
    (o1, g1), (o2, g2) = got, want
    out = {name: rel(a, b) for name, a, b in zip(("o", "H_T", "G_T"), o1, o2)}
    out.update({"d" + name: rel(g1[name], g2[name]) for name in g2})
    return out


@pytest.mark.parametrize("T, K", [(150, 32), (77, 16)])
def test_bf16_calls_solve_at_tf32_within_the_inputs_error(monkeypatch, gen, T, K):
    """bf16 q, k, v on the row (fake CUDA on the CPU): its solves at "tf32" (`limits.mesa_cg_precision`), the chunk
    form's rest as the torch row's. Against the float64 exact solve on the same (unrounded) inputs, o, the final
    states and every gradient (q, k, v, g, β, λ, H0, G0) stay within MESA_CG_TF32_BF16_REL, and the largest of those
    errors within MESA_CG_TF32_ROW_RATIO of the torch row's (fp32 CG on the same bf16 inputs): the TF32 products add
    nothing visible to what bf16 inputs and outputs carry. Odd T (a padded last chunk), chunks of 64 (the layer's)."""
    calls = []
    real = mesa_cg_mod.mesa_cg_triton
    monkeypatch.setattr(mesa_cg_mod, "mesa_cg_triton", lambda *a: calls.append(a[-1]) or real(*a))
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    x, state = _mesa_case(gen, T=T, K=K, V=K)
    exact = _mesa_run("torch", torch.float64, x, state, mesa_solve="exact", chunk_size=64)
    got = _errors(_mesa_run("triton", torch.bfloat16, x, state, device=DEV, chunk_size=64), exact)
    ref = _errors(_mesa_run("torch", torch.bfloat16, x, state, chunk_size=64), exact)
    assert calls == ["tf32", "tf32"]  # the forward's and the backward's solves
    assert max(got.values()) < MESA_CG_TF32_BF16_REL, got
    assert max(got.values()) < MESA_CG_TF32_ROW_RATIO * max(ref.values()), (got, ref)
    with rows.pinned("mesa", precision="ieee") as row:  # an A/B run: the row's solves at another precision
        assert row.pipeline(fw.zoo.get("mesanet"), None) == "CG kernel (ieee)"
        pinned = _errors(_mesa_run("triton", torch.bfloat16, x, state, device=DEV, chunk_size=64), exact)
    assert calls[2:] == ["ieee", "ieee"] and max(pinned.values()) < MESA_CG_TF32_BF16_REL


def test_chained_states_on_the_row_equal_one_call(monkeypatch, gen):
    """The row's final state carried into a second call (T 70 then 45: both with a padded last chunk of 16) equals
    one call over the 115 tokens and the float64 exact solve: o, the final states, and every gradient through the
    chain (q, k, v, g, β of both halves, λ, H0, G0)."""
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    x, state = _mesa_case(gen, T=115)

    def run(backend, dtype, device, split, **kw):
        leaves = {key: val.detach().to(device, dtype).requires_grad_(True) for key, val in x.items()}
        H0, G0 = (t.detach().to(device, dtype).requires_grad_(True) for t in state)
        st, outs = fw.MesaState(H=H0, G=G0), []
        for lo, hi in ((0, split), (split, 115)) if split else ((0, 115),):
            part = {key: (val if key == "lamb" else val[:, lo:hi]) for key, val in leaves.items()}
            o, st = fw.chunk("mesanet", backend=backend, initial_state=st, output_final_state=True, chunk_size=16,
                             **part, **kw)
            outs.append(o)
        outs = [torch.cat(outs, dim=1), st.H, st.G]
        g = torch.Generator().manual_seed(3)
        loss = sum((t.double().cpu() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in outs)
        grads = torch.autograd.grad(loss, list(leaves.values()) + [H0, G0])
        return [t.detach() for t in outs], dict(zip(list(leaves) + ["H0", "G0"], grads))

    chained = run("triton", torch.float32, DEV, 70)
    _agree(chained, run("triton", torch.float32, DEV, None), CHUNK_F32_REL, "chained vs one call")
    _agree(chained, run("torch", torch.float64, "cpu", None, mesa_solve="exact"), CHUNK_F32_REL, "chained vs exact")


def test_the_row_refuses_packed_sequences_as_the_torch_form_does(monkeypatch):
    """Varlen: Mesa's chunk form has none (`torch_backend._no_varlen`), so neither has the row — a packed call raises
    the form's reason on both rows instead of running the sequences as one."""
    if DEV == "cpu":
        FakeCuda(monkeypatch, kernels=True).install()
    x = fw.example_inputs("mesanet", batch_size=1, seq_len=9, num_heads=1, head_dim=8)
    x.pop("initial_state", None)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for backend in ("triton", "torch"):
        with pytest.raises(fw.api.FormNotAvailable, match="cu_seqlens"):
            fw.chunk("mesanet", backend=backend, cu_seqlens=cu, chunk_size=16, **{k: v.to(DEV) for k, v in x.items()})


def test_the_row_reports_the_kernels_residual_and_keeps_the_exact_solve(gen):
    """The row's Mesa form reports the kernel's residual (max over tokens) as the torch form reports its own (fewer
    steps: larger, equal to rounding); solve="exact" runs the exact solve on the row as on the torch row."""
    from fastweights.chunkwise.mesa import mesa_chunk

    B, T, H, K = 1, 21, 2, 16
    x, (H0, G0) = _mesa_case(gen, B=B, T=T, H=H, K=K)
    args = {key: val.float().to(DEV) for key, val in x.items()}
    kw = dict(scale=0.5, g=args["g"], beta=args["beta"], lamb=args["lamb"], H0=H0.float().to(DEV),
              G0=G0.float().to(DEV), chunk_size=16)
    q, k, v = args["q"], args["k"], args["v"]
    for steps in (2, 30):
        got = mesa_chunk(q, k, v, cg_steps=steps, cg=mesa_cg, **kw)
        want = mesa_chunk(*(t.cpu() for t in (q, k, v)), cg_steps=steps,
                          **{key: (val.cpu() if torch.is_tensor(val) else val) for key, val in kw.items()})
        assert abs(got[3].item() - want[3].item()) < CHUNK_F32_REL
        assert rel(got[0], want[0]) < CHUNK_F32_REL
    call_x = {key: val.float() for key, val in x.items()}
    o1, _ = DISPATCH[("mesa", "chunk", "triton")].fn(_call(call_x), chunk_size=16, solve="exact")
    o2, _ = DISPATCH[("mesa", "chunk", "torch")].fn(_call(call_x), chunk_size=16, solve="exact")
    assert torch.equal(o1, o2)


def _call(x):
    from fastweights.dispatch import Call
    from fastweights.inputs import validate

    recipe = fw.zoo.get("mesanet")
    d = dict(x)
    q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
    return Call(recipe=recipe, q=q, k=k, v=v, inputs=d, shapes=validate(recipe, q, k, v, d), scale=0.5,
                initial_state=None, output_final_state=True)


@pytest.mark.cuda
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_realistic(gen, dtype, K):
    """On the GPU (Hopper + Triton 3.6 is where miscompiles hide): fw.chunk("mesanet") at B 4, T 500, H 2, K = V = 64
    and 128 (chunk 64: the kernel's [16, K] row tiles, C = 64; a padded last chunk). fp32: the triton row ("ieee")
    against the torch row on the same device and inputs (CG rounding over 500 tokens). bf16 q, k, v (the row's solves
    at "tf32"): both rows against the float64 exact solve — each quantity within MESA_CG_TF32_BF16_REL, the row's
    largest error within MESA_CG_TF32_ROW_RATIO of the torch row's. Outputs, final state and every gradient. (Written
    for the GPU session's `pytest -m cuda`.)"""
    x, state = _mesa_case(gen, B=4, T=500, H=2, K=K, V=K)
    got = _mesa_run("triton", dtype, x, state, device="cuda", chunk_size=64)
    if dtype == torch.float32:
        _agree(got, _mesa_run("torch", dtype, x, state, device="cuda", chunk_size=64), CHUNK_LONG_F32_REL, "fp32")
        return
    exact = _mesa_run("torch", torch.float64, x, state, device="cuda", mesa_solve="exact", chunk_size=64)
    err = _errors(got, exact)
    ref = _errors(_mesa_run("torch", dtype, x, state, device="cuda", chunk_size=64), exact)
    assert max(err.values()) < MESA_CG_TF32_BF16_REL, err
    assert max(err.values()) < MESA_CG_TF32_ROW_RATIO * max(ref.values()), (err, ref)
