"""TTT-Linear and TTT-MLP against the official TTT's mini-batch dual form, written here from its
maths (research/models.md §10): inner biases, the per-position learning rate η_ij = lr_j / i,
and the per-head affine of the inner LayerNorm.

Per mini-batch of L ≤ b tokens from (W, b), with Q, K, V [H, L, D] and η_ij = tok_i·lr_j (i ≥ j):
    G     = ∂/∂Z ½‖γ⊙LN(Z) + β − (V − K)‖²  at Z = K W + b
    Z̄     = Q W − (η ⊙ tril(Q Kᵀ)) G + b − tril(η) G;   o = Q + γ⊙LN(Z̄) + β
    W ← W − Σ_j η_Lj K_jᵀ G_j;   b ← b − Σ_j η_Lj G_j
TTT-MLP applies the same layer by layer (G1 = (G2 W2ᵀ) ⊙ gelu_tanh'(Z1), the second layer read
at gelu_tanh(Z̄1)).
"""

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.inputs import PER_HEAD_INPUTS
from tests.tolerances import CHUNK_F64

EPS = 1e-6  # the official inner LayerNorm's eps


def _ln(z):
    mu = z.mean(-1, keepdim=True)
    std = (z.var(-1, keepdim=True, unbiased=False) + EPS).sqrt()
    return (z - mu) / std, std


def _ln_l2_grad(z, target, gam, bet):
    """∂/∂z of ½‖γ⊙LN(z) + β − target‖², the LayerNorm's backward written out."""
    xh, std = _ln(z)
    gxh = (gam * xh + bet - target) * gam
    D = z.shape[-1]
    return (D * gxh - gxh.sum(-1, keepdim=True) - xh * (gxh * xh).sum(-1, keepdim=True)) / (D * std)


def _gelu_grad(z):
    z = z.detach().requires_grad_(True)
    with torch.enable_grad():
        return torch.autograd.grad(F.gelu(z, approximate="tanh").sum(), z)[0]


def _dual_layer(Qin, Kin, G, W, b, eta):
    """Z̄ = Q W − (η ⊙ tril(Q Kᵀ)) G + b − tril(η) G and the layer's end-of-mini-batch (W, b)."""
    tril = torch.ones(eta.shape[-2:], dtype=torch.bool).tril()
    eta_t = torch.where(tril, eta, torch.zeros_like(eta))
    zbar = Qin @ W - (eta_t * (Qin @ Kin.transpose(-1, -2))) @ G + b - eta_t @ G
    last = eta_t[:, -1, :, None]  # [H, L, 1]: η_Lj
    return zbar, W - (last * Kin).transpose(-1, -2) @ G, b - (last * G).sum(1, keepdim=True)


def official_dual(q, k, v, lr, weights, gam, bet, mb, mlp):
    """q, k, v [H, T, D]; lr [H, T]; weights (W, b) or (W1, b1, W2, b2) with W [H, ·, ·], b [H, 1, ·]."""
    H, T, D = q.shape
    outs, w = [], list(weights)
    for s in range(0, T, mb):
        Q, K, V = q[:, s:s + mb], k[:, s:s + mb], v[:, s:s + mb]
        L = Q.shape[1]
        tok = 1.0 / torch.arange(1, L + 1, dtype=q.dtype)
        eta = tok[None, :, None] * lr[:, None, s:s + L]  # [H, L, L]: η_ij = tok_i · lr_j
        if not mlp:
            W, b = w
            G = _ln_l2_grad(K @ W + b, V - K, gam, bet)
            zbar, W, b = _dual_layer(Q, K, G, W, b, eta)
            w = [W, b]
        else:
            W1, b1, W2, b2 = w
            Z1 = K @ W1 + b1
            X2 = F.gelu(Z1, approximate="tanh")
            G2 = _ln_l2_grad(X2 @ W2 + b2, V - K, gam, bet)
            G1 = (G2 @ W2.transpose(-1, -2)) * _gelu_grad(Z1)
            z1bar, W1, b1 = _dual_layer(Q, K, G1, W1, b1, eta)
            zbar, W2, b2 = _dual_layer(F.gelu(z1bar, approximate="tanh"), X2, G2, W2, b2, eta)
            w = [W1, b1, W2, b2]
        outs.append(Q + gam * _ln(zbar)[0] + bet)
    return torch.cat(outs, 1), w


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp"])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_ttt_equals_the_official_dual_form(name, form):
    H, T, D = 2, 37, 8  # two full mini-batches of 16 and a partial one
    recipe = fw.zoo.get(name)
    gen = torch.Generator().manual_seed(torch.seed() % 2**62)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(H, T, D), rnd(H, T, D), rnd(H, T, D)
    lr = torch.rand(H, T, generator=gen, dtype=torch.float64)
    gam, bet = 1 + 0.3 * rnd(H, 1, D), 0.3 * rnd(H, 1, D)
    dims = [D, D] if name == "ttt_linear" else [D, 4 * D, D]
    weights = []
    for a, c in zip(dims[:-1], dims[1:]):
        weights += [rnd(H, a, c) / a ** 0.5, 0.3 * rnd(H, 1, c)]
    ref, ref_w = official_dual(q, k, v, lr, weights, gam, bet, 16, name == "ttt_mlp")

    to_fw = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [H, T, D] -> [1, T, H, D]
    state = fw.MemoryState(weights=tuple(w[None] for w in weights))
    o, st = getattr(fw, form)(name, to_fw(q), to_fw(k), to_fw(v), beta=lr.T[None], initial_state=state,
                              ln_weight=gam[:, 0], ln_bias=bet[:, 0], output_final_state=True)
    assert (o[0].transpose(0, 1) - ref).abs().max().item() < CHUNK_F64 * (1 + ref.abs().max().item())
    # the carried weights are the ones the official form ends its last full mini-batch with, plus
    # the partial one's running-mean update (equal to the official end-of-mini-batch formula)
    assert recipe.memory.bias and recipe.optimizer.minibatch_average
    for a, b in zip(st.weights, ref_w):
        assert (a[0] - b).abs().max().item() < CHUNK_F64 * (1 + b.abs().max().item())


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp"])
def test_ttt_chunk_chains_from_the_middle_of_a_minibatch(name):
    from tests.helpers import make_case, max_err

    inputs, state = make_case(name, T=40)
    o, s = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    a = {key: x if key in PER_HEAD_INPUTS else x[:, :21] for key, x in inputs.items()}
    b = {key: x if key in PER_HEAD_INPUTS else x[:, 21:] for key, x in inputs.items()}
    o1, s1 = fw.chunk(name, initial_state=state, output_final_state=True, **a)
    assert s1.offset == 21 % 16
    o2, s2 = fw.chunk(name, initial_state=s1, output_final_state=True, **b)
    assert (torch.cat([o1, o2], 1) - o).abs().max().item() < CHUNK_F64 * (1 + o.abs().max().item())
    assert max_err(s2, s) < CHUNK_F64


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp"])
def test_ttt_gradients_agree_across_forms_and_inner_gradients(name):
    """float64: recurrent with the closed-form inner gradient, recurrent with torch.func's, and the
    chunk form give the same outputs, final states and gradients of every input (the inner biases
    in the initial state and the LayerNorm affine included)."""
    from tests.helpers import make_case, run_with_grads

    inputs, state = make_case(name, T=37)
    assert "ln_weight" in inputs and len(state.weights) == (2 if name == "ttt_linear" else 4)
    o1, s1, g1 = run_with_grads(fw.recurrent, name, inputs, state)
    for form, kw in ((fw.recurrent, {"inner_grad": "autodiff"}), (fw.chunk, {})):
        o2, s2, g2 = run_with_grads(form, name, inputs, state, **kw)
        assert (o1 - o2).abs().max().item() < CHUNK_F64 * (1 + o1.abs().max().item())
        for a, b in zip(s1.weights, s2.weights):
            assert (a - b).abs().max().item() < CHUNK_F64 * (1 + a.abs().max().item())
        for a, b in zip(g1, g2):
            assert (a - b).abs().max().item() < CHUNK_F64 * (1 + a.abs().max().item())
