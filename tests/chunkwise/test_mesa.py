"""Mesa's chunk form: exact solve equals `recurrent`; CG converges to it and reports the residual."""

import pytest
import torch

import fastweights as fw
from fastweights.chunkwise.mesa import _matvec, _matvec_grads, chunk_states, mesa_chunk
from tests.helpers import make_case, max_err, run_with_grads
from tests.tolerances import (
    CHUNK_F64,
    EXACT_F64,
    MESA_BF16,
    MESA_CG_F64,
    MESA_CG_REL,
    MESA_CG_RESIDUAL,
    MESA_STATES_F32_REL,
)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 17, 100])
def test_exact_chunk_equals_recurrent(T, chunk_size):
    inputs, state = make_case("mesanet", T=T)
    o1, s1, g1 = run_with_grads(fw.recurrent, "mesanet", inputs, state)
    o2, s2, g2 = run_with_grads(fw.chunk, "mesanet", inputs, state, chunk_size=chunk_size, mesa_solve="exact")
    assert (o1 - o2).abs().max().item() < CHUNK_F64
    assert max_err(s1, s2) < CHUNK_F64
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() < CHUNK_F64


def test_cg_converges_to_the_exact_solve():
    inputs, state = make_case("mesanet", T=50, K=6)
    o1, _ = fw.recurrent("mesanet", initial_state=state, **inputs)
    o2, _ = fw.chunk("mesanet", initial_state=state, chunk_size=16, **inputs)  # 30 CG steps ≥ K
    assert (o1 - o2).abs().max().item() < MESA_CG_F64


def test_cg_residual_is_reported_and_falls_with_steps():
    B, T, H, K = 1, 40, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.float64, generator=gen) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    z = dict(H0=torch.zeros(B, H, K, K, dtype=torch.float64), G0=torch.zeros(B, H, K, K, dtype=torch.float64))
    args = dict(scale=1.0, g=None, beta=torch.ones(B, T, H, dtype=torch.float64),
                lamb=torch.full((H, K), 0.25, dtype=torch.float64), **z)
    res = [mesa_chunk(q, k, v, cg_steps=n, **args)[3].item() for n in (1, 4, 16)]
    assert res[0] > res[1] > res[2]
    assert res[2] < MESA_CG_RESIDUAL


def test_bf16_inputs_stay_finite_and_close():
    inputs, state = make_case("mesanet", T=64, with_state=False, dtype=torch.float32)
    o32, _ = fw.chunk("mesanet", **inputs)
    low = {k: (v.bfloat16() if k in ("q", "k", "v") else v) for k, v in inputs.items()}
    o16, _ = fw.chunk("mesanet", **low)
    assert o16.dtype == torch.bfloat16 and torch.isfinite(o16).all()
    assert (o16.float() - o32).abs().max() < MESA_BF16 * (1 + o32.abs().max())


def _mesa_grads(form, case, **kw):
    q, k, v, H0, G0, inputs = case
    o, st = form("mesanet", q, k, v, initial_state=fw.MesaState(H=H0, G=G0), output_final_state=True,
                 **inputs, **kw)
    gen = torch.Generator().manual_seed(1)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=x.dtype)).sum() for x in (o, st.H, st.G))
    return (o, st.H, st.G) + torch.autograd.grad(loss, (H0, G0, q, k, v, inputs["g"], inputs["beta"]))


@pytest.mark.parametrize("symmetric", [True, False])
def test_every_form_has_the_same_gradient_for_any_initial_state(symmetric):
    """The issue's case (B=1, T=37, H=1, K=16, unit q and k, g = −0.1, β = 0.5, H0 = A Aᵀ) and a
    non-symmetric H0 (a learned or perturbed state): outputs, final states and the gradients with
    respect to H0, G0 and every input agree between recurrent, parallel and chunk (CG, CG with
    cg_steps = 2K, exact solve); ∂L/∂H0 is symmetric."""
    B, T, H, K = 1, 37, 1, 16
    gen = torch.Generator().manual_seed(torch.seed() % 2**62)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q, k, v = unit(rnd(B, T, H, K)), unit(rnd(B, T, H, K)), rnd(B, T, H, K)
    A = rnd(B, H, K, K)
    H0 = A @ A.transpose(-1, -2) + (0 if symmetric else rnd(B, H, K, K))
    G0 = rnd(B, H, K, K)
    inputs = dict(g=torch.full((B, T, H), -0.1, dtype=torch.float64), beta=torch.full((B, T, H), 0.5,
                                                                                         dtype=torch.float64))
    for x in (q, k, v, H0, G0, *inputs.values()):
        x.requires_grad_(True)
    case = (q, k, v, H0, G0, inputs)
    ref = _mesa_grads(fw.recurrent, case)
    others = {"parallel": _mesa_grads(fw.parallel, case),
              "chunk exact": _mesa_grads(fw.chunk, case, chunk_size=16, mesa_solve="exact"),
              "chunk cg": _mesa_grads(fw.chunk, case, chunk_size=16),
              # CG is exact after K steps in exact arithmetic; in float64 the Krylov basis loses
              # orthogonality on ill-conditioned draws (3e-5 seen at K), so the case runs 2K
              "chunk cg 2K steps": _mesa_grads(fw.chunk, case, chunk_size=16, cg_steps=2 * K)}
    names = ["o", "H_T", "G_T", "dH0", "dG0", "dq", "dk", "dv", "dg", "dbeta"]
    for form, got in others.items():
        for name, a, b in zip(names, got, ref):
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < (MESA_CG_REL if "cg" in form else CHUNK_F64), (form, name, rel)
    dH0 = ref[3]
    assert (dH0 - dH0.transpose(-1, -2)).abs().max().item() < CHUNK_F64 * dH0.abs().max().item()


def _states_loop(a, dH, dG, H0, G0):
    """The recurrence chunk_states replaces: S_{n+1} = exp(a_n) S_n + dS_n, one chunk at a time."""
    last = a.exp()[..., None, None]
    Hs, Gs = [H0], [G0]
    for n in range(a.shape[-1]):
        Hs.append(last[:, :, n] * Hs[-1] + dH[:, :, n])
        Gs.append(last[:, :, n] * Gs[-1] + dG[:, :, n])
    return torch.stack(Hs[:-1], 2), torch.stack(Gs[:-1], 2), Hs[-1], Gs[-1]


@pytest.mark.parametrize("scale", [0.01, 1.0, 10.0])
def test_chunk_states_equal_the_sequential_recurrence(scale):
    """The chunk-boundary states in closed form (one [N + 1, N] product) against the chunk-by-chunk recurrence, N = 64
    chunks, per-chunk log-decays in [−scale, 0] (|P| up to 640): float64 values and every gradient (a, dH, dG, H0, G0)
    to rounding; fp32 within MESA_STATES_F32_REL of the float64 recurrence — as close as the fp32 recurrence (P is
    summed in float64: in fp32 its cancellation cost 7e-6)."""
    gen = torch.Generator().manual_seed(0)
    B, H, N, K, V = 2, 2, 64, 8, 6
    a = -scale * torch.rand(B, H, N, generator=gen, dtype=torch.float64)
    X = torch.randn(B, H, N, K, K, generator=gen, dtype=torch.float64)
    dH, dG = X @ X.transpose(-1, -2), torch.randn(B, H, N, K, V, generator=gen, dtype=torch.float64)
    H0, G0 = torch.eye(K, dtype=torch.float64).expand(B, H, K, K).clone(), torch.randn(B, H, K, V, generator=gen,
                                                                                        dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (a, dH, dG, H0, G0)]
    got, want = chunk_states(*leaves), _states_loop(*leaves)
    w = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in want]
    g1 = torch.autograd.grad(sum((x * y).sum() for x, y in zip(got, w)), leaves)
    g2 = torch.autograd.grad(sum((x * y).sum() for x, y in zip(want, w)), leaves)
    for x, y in zip(list(got) + list(g1), list(want) + list(g2)):
        assert ((x - y).norm() / y.norm()).item() < EXACT_F64
    f32 = chunk_states(*(t.float() for t in (a, dH, dG, H0, G0)))
    for x, y in zip(f32, want):
        assert ((x.double() - y).norm() / y.norm()).item() < MESA_STATES_F32_REL


def test_the_implicit_backwards_matvec_gradients_equal_autograd():
    """The CG solve's backward pushes −uᵀ M(θ) q* to (d, Hs, kc, A, λ) by hand (`_matvec_grads`): equal to autograd
    through `_matvec` (float64, a non-symmetric Hs so its orientation shows, λ broadcast over batch and chunks), and
    None for what is not asked."""
    gen = torch.Generator().manual_seed(0)
    B, H, N, C, K = 2, 3, 2, 5, 4
    x, u, kc = (torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64) for _ in range(3))
    d = torch.rand(B, H, N, C, 1, generator=gen, dtype=torch.float64)
    Hs = torch.randn(B, H, N, K, K, generator=gen, dtype=torch.float64)
    A = torch.randn(B, H, N, C, C, generator=gen, dtype=torch.float64).tril()
    lam = torch.rand(1, H, 1, 1, K, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (d, Hs, kc, A, lam)]
    want = torch.autograd.grad(-(u * _matvec(x, *leaves)).sum(), leaves)
    got = _matvec_grads(x, u, d, Hs, kc, A, lam)
    for name, a, b in zip(("d", "Hs", "kc", "A", "lam"), got, want):
        assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < EXACT_F64, name
    assert _matvec_grads(x, u, d, Hs, kc, A, lam, needs=(False, True, False, True, False))[::2] == (None, None, None)


@pytest.mark.parametrize("with_g", [True, False])
def test_tf32_region_changes_no_number_off_cuda(with_g):
    """mesa_chunk(tf32=True) runs the form in `_TF32Region` (its own graph, its backward through torch.autograd.grad
    under `tf32_matmuls`); cuBLAS's flag has no effect on the CPU, so the outputs, the final states, the residual and
    every gradient (the inputs that want one; none for those that do not) are bitwise those of tf32=False — what is
    left to the GPU is TF32's rounding alone (tests/kernels/memories/test_triton_mesa_cg.py). Fresh inputs each run."""
    B, T, H, K, V = 2, 37, 2, 8, 6
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = -torch.rand(B, T, H) if with_g else None
    beta, lamb = torch.rand(B, T, H), 0.25 + torch.rand(H, K)
    H0, G0 = torch.randn(B, H, K, K), torch.randn(B, H, K, V)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, H0, G0) + ((g,) if with_g else ())]
    outs = {}
    for tf32 in (False, True):
        o, Ht, Gt, res = mesa_chunk(q, k, v, scale=0.3, g=g, beta=beta, lamb=lamb, H0=H0, G0=G0, chunk_size=16,
                                    tf32=tf32)
        gen = torch.Generator().manual_seed(3)
        loss = sum((x * torch.randn(x.shape, generator=gen)).sum() for x in (o, Ht, Gt))
        outs[tf32] = (o, Ht, Gt, res) + torch.autograd.grad(loss, leaves)
        assert not res.requires_grad and lamb.grad is None
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)


def test_tf32_region_keeps_no_output():
    """The region's backward differentiates from its outputs' gradient edges (`_edge`), not from the outputs, so the
    fp32 o that the layer casts and drops is freed then, not kept until the backward — where this torch takes edges
    (`_grad_takes_edges`; torch ≥ 2.6 must: a newer torch that stopped would fail here, loudly). Gradients: the
    tests above."""
    from fastweights.chunkwise import mesa as mesa_mod

    B, T, H, K, V = 1, 20, 1, 8, 8
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V).requires_grad_()
    o = mesa_chunk(q, k, v, scale=0.3, g=None, beta=torch.rand(B, T, H), lamb=0.25 + torch.rand(H, K),
                   H0=torch.zeros(B, H, K, K), G0=torch.zeros(B, H, K, V), chunk_size=8, tf32=True)[0]
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert mesa_mod._grad_takes_edges() or version < (2, 6)
    kept = o.grad_fn.outs
    assert len(kept) == 3 and kept[0] is not None  # o, H_T, G_T (not the residual): o wants a gradient
    assert all(isinstance(e, torch.Tensor) != mesa_mod._grad_takes_edges() for e in kept if e is not None)


def test_tf32_region_runs_the_form_without_autocast():
    """Under a bf16 autocast the tf32 form keeps its fp32 products in fp32 (autocast off inside the region, forward
    and backward): its numbers equal the form's outside any autocast, bitwise, on the CPU; the plain form under the
    same autocast differs (its products round to bf16) — the test can tell the two apart."""
    B, T, H, K, V = 1, 40, 2, 16, 16
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v, beta, lamb = torch.randn(B, T, H, V), torch.rand(B, T, H), 0.25 + torch.rand(H, K)
    H0, G0 = torch.zeros(B, H, K, K), torch.zeros(B, H, K, V)
    v.requires_grad_()

    def run(tf32, autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = mesa_chunk(q, k, v, scale=0.3, g=None, beta=beta, lamb=lamb, H0=H0, G0=G0, chunk_size=16, tf32=tf32)[0]
        return o, torch.autograd.grad(o.float().square().sum(), v)[0]

    plain = run(False, False)
    for a, b in zip(run(True, True), plain, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(run(False, True)[0].float(), plain[0])
