"""The shared chunk stages (fastweights/chunkwise/common.py), each against its direct definition
in float64: values and gradients, fresh random inputs each run."""

from __future__ import annotations

import pytest
import torch

from fastweights.chunkwise.common import chunk_cumsum, chunk_outputs, decayed_scores, exp, pass_states
from fastweights.chunkwise.varlen import make_layout
from tests.tolerances import DECAYED_SCORES_F64_REL, DECAYED_SCORES_GRAD_F64_REL, STAGE_F32_REL, STAGE_F64


@pytest.fixture
def gen():
    seed = torch.seed() % 2**62
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _rel_err(a, b) -> float:
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def _direct_scores(x, y, gx, gy, strict):
    """P_ij = Σ_d x_id y_jd e^{gx_id − gy_jd} on the causal mask, as one [.., C, C, K] tensor."""
    C = x.shape[-2]
    i, j = torch.arange(C)[:, None], torch.arange(C)[None, :]
    mask = (i > j) if strict else (i >= j)
    if gx is None:
        expo = torch.zeros(*x.shape[:-2], C, C, x.shape[-1], dtype=x.dtype)
    else:
        if gx.dim() == x.dim() - 1:
            gx, gy = gx.unsqueeze(-1), gy.unsqueeze(-1)
        expo = torch.where(mask[..., None], gx[..., :, None, :] - gy[..., None, :, :], 0.0)
    return torch.where(mask, (x[..., :, None, :] * y[..., None, :, :] * expo.exp()).sum(-1), 0.0)


@pytest.mark.parametrize("C", [64, 24, 7, 1])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("kind", ["none", "scalar", "diagonal"])
@pytest.mark.parametrize("rate", [0.05, 15.0, 60.0])  # log-decay per token: mild, strong, extreme
def test_decayed_scores(C, strict, kind, rate, gen):
    """Every path of decayed_scores equals the direct sum, values and gradients, whatever the decay
    (15 and 60 per token make every one-matmul factorization of a 16-row block overflow fp64's
    exponent range; the 2×2 split keeps every exponent ≤ 0). Comba's exclusive cumsum with strict."""
    B, H, N, K = 2, 2, 3, 5
    x = torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    gx = G = None
    if kind != "none":
        shape = (B, H, N, C, K) if kind == "diagonal" else (B, H, N, C)
        g = -rate * torch.rand(*shape, generator=gen, dtype=torch.float64)
        g = torch.where(torch.rand(*shape, generator=gen) < 0.3, 0.0, g)  # runs of exact zeros
        G = chunk_cumsum(g).requires_grad_()
        gx = torch.cat([torch.zeros_like(G.narrow(3, 0, 1)), G.narrow(3, 0, C - 1)], dim=3) if strict else G
    P = decayed_scores(x, y, gx, G, strict=strict)
    ref = _direct_scores(x, y, gx, G, strict)
    assert torch.isfinite(P).all()
    assert _rel_err(P, ref) < DECAYED_SCORES_F64_REL
    with torch.no_grad():  # the path that keeps nothing for a backward
        assert _rel_err(decayed_scores(x, y, gx, G, strict=strict), ref) < DECAYED_SCORES_F64_REL
    w = torch.randn(P.shape, generator=gen, dtype=torch.float64)
    leaves = (x, y) if G is None else (x, y, G)
    if P.requires_grad:
        d1 = torch.autograd.grad((P * w).sum(), leaves)
    else:  # C = 1 with strict: P is identically 0
        d1 = [torch.zeros_like(leaf) for leaf in leaves]
    d2 = torch.autograd.grad((ref * w).sum(), leaves, allow_unused=True, materialize_grads=True)
    for a, b in zip(d1, d2):
        assert torch.isfinite(a).all() and _rel_err(a, b) < DECAYED_SCORES_GRAD_F64_REL


@pytest.mark.parametrize("C", [64, 24, 7, 1])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("rate", [0.05, 15.0, 60.0])
def test_decayed_scores_two_diagonal_decays(C, strict, rate, gen):
    """A diagonal decay with gx and gy two separate leaves (gx_i = gy_i − δ_i, δ ≥ 0, so gx_i ≤ gy_j
    for j ≤ i): the diagonal's own factor e^{gx_i − gy_i} and the gradients of gx and of gy each
    on their own (not summed as when gx is gy), against the direct sum in float64."""
    B, H, N, K = 2, 2, 3, 5
    x = torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    g = -rate * torch.rand(B, H, N, C, K, generator=gen, dtype=torch.float64)
    g = torch.where(torch.rand(B, H, N, C, K, generator=gen) < 0.3, 0.0, g)  # runs of exact zeros
    gy = chunk_cumsum(g)
    delta = rate * torch.rand(B, H, N, C, K, generator=gen, dtype=torch.float64)
    gx = (gy - torch.where(torch.rand(B, H, N, C, K, generator=gen) < 0.3, 0.0, delta)).requires_grad_()
    gy.requires_grad_()
    P = decayed_scores(x, y, gx, gy, strict=strict)
    ref = _direct_scores(x, y, gx, gy, strict)
    assert torch.isfinite(P).all()
    assert _rel_err(P, ref) < DECAYED_SCORES_F64_REL
    with torch.no_grad():
        assert _rel_err(decayed_scores(x, y, gx, gy, strict=strict), ref) < DECAYED_SCORES_F64_REL
    w = torch.randn(P.shape, generator=gen, dtype=torch.float64)
    d1 = torch.autograd.grad((P * w).sum(), (x, y, gx, gy))
    d2 = torch.autograd.grad((ref * w).sum(), (x, y, gx, gy), allow_unused=True, materialize_grads=True)
    for a, b in zip(d1, d2):
        assert torch.isfinite(a).all() and _rel_err(a, b) < DECAYED_SCORES_GRAD_F64_REL


def test_decayed_scores_diagonal_is_once_differentiable(gen):
    """The diagonal-decay path's backward is written out from saved factors: a second derivative
    raises instead of coming out silently wrong."""
    x, y, g = (torch.randn(1, 1, 1, 8, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    G = chunk_cumsum(-g.detach().abs()).requires_grad_()
    (dx,) = torch.autograd.grad(decayed_scores(x, y, G, G, strict=False).sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()


def test_exp_is_torch_exp_to_rounding(gen):
    """common.exp (2^{d·log₂ e}) against torch.exp in float64, e^0 = 1 exactly, and its first and
    second derivatives (gradcheck, gradgradcheck)."""
    d = torch.cat([-60 * torch.rand(1000, generator=gen, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                   torch.randn(100, generator=gen, dtype=torch.float64)])
    assert _rel_err(exp(d), torch.exp(d)) < STAGE_F64
    assert ((exp(d) - torch.exp(d)).abs() / torch.exp(d)).max() < STAGE_F64
    assert (exp(torch.zeros(5, dtype=torch.float64)) == 1).all()
    small = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(exp, (small,))
    assert torch.autograd.gradgradcheck(exp, (small,))


def test_chunk_cumsum_is_chunk_local_and_non_increasing(gen):
    g = -torch.rand(2, 3, 4, 16, 5, generator=gen)  # fp32 on purpose: monotone in floating point too
    G = chunk_cumsum(g)
    assert torch.equal(G[:, :, :, 0], g[:, :, :, 0])  # restarts in every chunk
    assert (G[:, :, :, 1:] <= G[:, :, :, :-1]).all()
    assert _rel_err(G.double(), g.double().cumsum(3)) < STAGE_F32_REL


def _step(M, S, n, transition):
    if M is None:
        return S
    return M[:, :, n] @ S if transition == "matrix" else M[:, :, n] * S


@pytest.mark.parametrize("transition", ["identity", "scalar", "diagonal", "matrix"])
@pytest.mark.parametrize("varlen", [False, True])
def test_pass_states_is_the_affine_chain(transition, varlen, gen):
    """S_{n+1} = M_n S_n + B_n chunk by chunk, restarting at every sequence (varlen)."""
    H, K, V, C = 2, 4, 3, 4
    if varlen:
        cu = torch.tensor([0, 5, 5, 13, 14])  # an empty and a length-1 sequence
        layout = make_layout(1, 14, C, cu)
        B, rows = 1, 4
    else:
        layout = make_layout(2, 11, C)
        B, rows = 2, 2
    N = layout.num_chunks
    S0 = torch.randn(rows, H, K, V, generator=gen, dtype=torch.float64)
    Bn = torch.randn(B, H, N, K, V, generator=gen, dtype=torch.float64)
    M = {"identity": None,
         "scalar": torch.rand(B, H, N, 1, 1, generator=gen, dtype=torch.float64),
         "diagonal": torch.rand(B, H, N, K, 1, generator=gen, dtype=torch.float64),
         "matrix": torch.randn(B, H, N, K, K, generator=gen, dtype=torch.float64)}[transition]
    entering, final = pass_states(layout, S0, M, Bn)
    assert entering.shape == (B, H, N, K, V) and final.shape == (rows, H, K, V)
    inits = S0.split(1) if varlen else [S0]
    for (n0, n1), S in zip(layout.ranges, inits):
        for n in range(n0, n1):
            assert _rel_err(entering[:, :, n], S) < STAGE_F64
            S = _step(M, S, n, transition) + Bn[:, :, n]
    # the final state of each sequence is its state after its last chunk (its initial state when empty)
    for s, ((n0, n1), S) in enumerate(zip(layout.ranges, inits)):
        for n in range(n0, n1):
            S = _step(M, S, n, transition) + Bn[:, :, n]
        row = final[s:s + 1] if varlen else final
        assert _rel_err(row, S) < STAGE_F64


def test_chunk_outputs(gen):
    layout = make_layout(2, 10, 4)  # N = 3, the last chunk padded
    B, H, N, C, K, V = 2, 2, 3, 4, 5, 3
    o_intra = torch.randn(B, H, N, C, V, generator=gen, dtype=torch.float64)
    q_eff = torch.randn(B, H, N, C, K, generator=gen, dtype=torch.float64)
    S = torch.randn(B, H, N, K, V, generator=gen, dtype=torch.float64)
    o = chunk_outputs(layout, o_intra, q_eff, S, torch.float32)
    assert o.shape == (B, 10, H, V) and o.dtype == torch.float32
    ref = (o_intra + q_eff @ S).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :10]
    assert _rel_err(o.double(), ref) < STAGE_F32_REL


@pytest.mark.parametrize("T,chunk_size,want", [(20, 4096, 32), (20, 2**40, 32), (20, 24, 24), (20, 16, 16),
                                               (1, 64, 1), (64, 64, 64), (65, 4096, 128), (0, 64, 1)])
def test_layout_chunk_never_exceeds_the_sequence(T, chunk_size, want):
    """The chunk a layout uses is min(chunk_size, the smallest power of two ≥ T): a chunk_size far
    beyond T (2**40) costs what the sequence needs, not a C×C matrix per chunk."""
    layout = make_layout(2, T, chunk_size)
    assert layout.chunk_size == want
    assert layout.num_chunks == -(-T // want)


def test_varlen_layout_chunk_follows_the_longest_sequence():
    cu = torch.tensor([0, 5, 5, 18, 19])  # longest sequence 13 → chunks of 16
    layout = make_layout(1, 19, 4096, cu)
    assert layout.chunk_size == 16
    assert layout.ranges == ((0, 1), (1, 1), (1, 2), (2, 3))


@pytest.mark.parametrize("C", [64, 24, 7])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("rate", [0.05, 60.0])
def test_decayed_scores_diagonal_under_torch_func(C, strict, rate, gen):
    """Under torch.func (vmap over stacked variants, grad: what a stacked lab run does, `lab.stack`) the diagonal
    path takes its functional form: the direct sum's values and gradients, for every variant, whatever the decay."""
    V, B, H, N, K = 2, 1, 2, 2, 5
    x, y, w = (torch.randn(V, B, H, N, C, K if i < 2 else C, generator=gen, dtype=torch.float64) for i in range(3))
    g = -rate * torch.rand(V, B, H, N, C, K, generator=gen, dtype=torch.float64)
    G = torch.stack([chunk_cumsum(gv) for gv in g])
    excl = torch.cat([torch.zeros_like(G.narrow(4, 0, 1)), G.narrow(4, 0, C - 1)], dim=4)
    gx = excl if strict else G

    def loss(fn, x, y, gx, G, w):
        return (fn(x, y, gx, G, strict) * w).sum()

    def ours(x, y, gx, G, strict):
        return decayed_scores(x, y, gx, G, strict=strict)

    got = torch.func.vmap(torch.func.grad_and_value(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3)))(x, y, gx, G, w)
    for v in range(V):
        leaves = [t[v].clone().requires_grad_() for t in (x, y, gx, G)]
        ref = loss(_direct_scores, *leaves, w[v])
        d = torch.autograd.grad(ref, leaves, allow_unused=True, materialize_grads=True)
        assert abs(got[1][v].item() - ref.item()) < DECAYED_SCORES_F64_REL * max(1.0, abs(ref.item()))
        for a, b in zip(got[0], d):
            assert torch.isfinite(a[v]).all() and _rel_err(a[v], b) < DECAYED_SCORES_GRAD_F64_REL
