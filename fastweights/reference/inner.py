"""The memory M_θ and the gradient of its inner objective, in closed form and by autodiff.

A linear memory is the depth-1 case of the MLP: weights (S [B, H, K', V],) and M(x) = Sᵀx.
An MLP of depth d has weights (W_1 [B, H, K', Hd], …, W_d [B, H, Hd, V]) and
M(x) = W_dᵀ σ(… σ(W_1ᵀ x)). With `memory.bias` every layer adds a trained inner bias,
z_l = W_lᵀ h_{l−1} + b_l, and the weights interleave (W_1, b_1, …, W_d, b_d) with b_l
[B, H, 1, out_l] (TTT's inner model). With `residual_ln` the memory is
x + γ ⊙ LN(M(x)) + β_ln (LayerNorm over the value dimension, eps 1e-6; TTT's wrapper, needs
K' == V); the affine (γ, β_ln) [H, V] is per head and an outer parameter (`ln`), not trained
by the inner loop; without it γ = 1, β_ln = 0.

Inner objectives over a window of N pairs (N = 1 except for the Omega rule), per (b, h), summed
over heads (heads are independent, so ∇ of the sum is the per-head gradient):
    dot:   ℓ = −Σ_i γ_i v_iᵀ M(k_i)
    l2:    ℓ =  Σ_i γ_i ½‖M(k_i) − v_i‖²
`closed_form_grad` is hand-written backpropagation through the memory (TTT's closed-form
gradient, generalized to any depth and activation):
    ∂ℓ/∂y = γ(y − v) (l2) or −γ v (dot);  through the LN: with n = LN(f), s = 1/σ,
    u = γ_ln ⊙ ∂ℓ/∂y, ∂ℓ/∂f = s (u − mean(u) − n mean(u ⊙ n));  then per layer, from the top:
    ∂ℓ/∂W_l = h_{l−1}ᵀ ∂ℓ/∂z_l, ∂ℓ/∂b_l = Σ_i ∂ℓ/∂z_{l,i}, ∂ℓ/∂z_{l−1} = (∂ℓ/∂z_l W_lᵀ) ⊙ σ'(z_{l−1}).
`autodiff_grad` is torch.func.grad of the same loss. Both are plain differentiable torch, so
outer gradients flow through either.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import grad as func_grad

from ..recipe import Memory

Tensor = torch.Tensor
LN_EPS = 1e-6
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def activation(name: str, z: Tensor) -> Tensor:
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    if name == "relu":
        return F.relu(z)
    return torch.tanh(z)


def activation_grad(name: str, z: Tensor) -> Tensor:
    """σ'(z), elementwise."""
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
        return cdf + z * pdf
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if name == "relu":
        return (z > 0).to(z.dtype)
    t = torch.tanh(z)
    return 1.0 - t * t


def layer_norm(f: Tensor) -> tuple[Tensor, Tensor]:
    """LayerNorm without affine over the last dim; returns (normalized, 1/σ)."""
    mu = f.mean(-1, keepdim=True)
    var = ((f - mu) ** 2).mean(-1, keepdim=True)
    inv = torch.rsqrt(var + LN_EPS)
    return (f - mu) * inv, inv


def layers(mem: Memory, weights: tuple[Tensor, ...]) -> list[tuple[Tensor, Tensor | None]]:
    """The (W_l, b_l or None) pairs of a memory's weights tuple."""
    if mem.bias:
        return [(weights[i], weights[i + 1]) for i in range(0, len(weights), 2)]
    return [(w, None) for w in weights]


def _per_head(p: Tensor, like: Tensor) -> Tensor:
    """A per-head parameter [H, V] viewed to broadcast over like [B, H, ..., V]."""
    return p.view((p.shape[0],) + (1,) * (like.dim() - 3) + (p.shape[-1],))


def affine(n: Tensor, ln: tuple[Tensor, Tensor] | None) -> Tensor:
    """γ ⊙ n + β_ln with per-head γ, β_ln [H, V] broadcast over n [B, H, ..., V]."""
    if ln is None:
        return n
    return n * _per_head(ln[0], n) + _per_head(ln[1], n)


def forward(mem: Memory, weights: tuple[Tensor, ...], x: Tensor, keep: bool = False,
            ln: tuple[Tensor, Tensor] | None = None):
    """M(x) for x [B, H, N, K'] -> [B, H, N, V] (any extra dims between H and N broadcast with the
    weights'); ln: the residual LayerNorm's affine (γ, β_ln) [H, V] or None (γ = 1, β_ln = 0).
    With keep, also the cache for backprop."""
    h = x
    pre = []  # pre-activations z_l, l < d
    inputs = [x]  # h_{l-1}, inputs of layer l
    pairs = layers(mem, weights)
    for i, (w, b) in enumerate(pairs):
        z = h @ w  # [B, H, N, out_l]
        if b is not None:
            z = z + b
        if i < len(pairs) - 1:
            pre.append(z)
            h = activation(mem.activation, z)
            inputs.append(h)
        else:
            h = z
    f = h
    if mem.residual_ln:
        n, inv = layer_norm(f)
        y = x + affine(n, ln)
    else:
        n, inv, y = None, None, f
    if keep:
        return y, (inputs, pre, n, inv)
    return y


def closed_form_factors(mem: Memory, objective: str, weights, x: Tensor, v: Tensor, gamma: Tensor,
                        ln: tuple[Tensor, Tensor] | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """The per-pair factors of ∇_θ ℓ, by hand-written backprop: (inputs, dz), one of each per layer,
    with ∂ℓ/∂W_l = Σ_i inputs[l]_iᵀ dz[l]_i (a sum of N rank-1 terms) and ∂ℓ/∂b_l = Σ_i dz[l]_i.

    x: [B, H, N, K'] keys the memory is read at; v: [B, H, N, V]; gamma: [B, H, N] pair weights
    (folded into dz). inputs[l]: h_{l−1} [B, H, N, in_l] (inputs[0] = x); dz[l]: ∂ℓ/∂z_l [B, H, N, out_l].
    """
    y, (inputs, pre, n, inv) = forward(mem, weights, x, keep=True, ln=ln)
    gamma = gamma.unsqueeze(-1)  # [B, H, N, 1]
    dy = gamma * (y - v) if objective != "dot" else -gamma * v  # [B, H, N, V]
    if mem.residual_ln:  # back through y = x + γ_ln ⊙ LN(f) + β_ln
        du = dy * _per_head(ln[0], dy) if ln is not None else dy  # ∂ℓ/∂n = γ_ln ⊙ ∂ℓ/∂y
        df = inv * (du - du.mean(-1, keepdim=True) - n * (du * n).mean(-1, keepdim=True))
    else:
        df = dy
    pairs = layers(mem, weights)
    dzs = [None] * len(pairs)
    dz = df
    for i in range(len(pairs) - 1, -1, -1):
        dzs[i] = dz
        if i > 0:
            dz = (dz @ pairs[i][0].transpose(-1, -2)) * activation_grad(mem.activation, pre[i - 1])
    return inputs, dzs


def closed_form_grad(mem: Memory, objective: str, weights, x: Tensor, v: Tensor, gamma: Tensor,
                     write_keys: Tensor | None = None, ln: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ...]:
    """∇_θ ℓ by hand-written backprop, in the order of `weights` (biases included): the sums of
    `closed_form_factors`' rank-1 terms.

    x: [B, H, N, K'] keys the memory is read at; v: [B, H, N, V]; gamma: [B, H, N] window weights.
    write_keys (Comba's probe; plain linear memory only): the error is read at x = p but the
    gradient is written at k, G = Σ γ k (Sᵀp − v)ᵀ. ln: the residual LayerNorm's affine or None.
    """
    inputs, dzs = closed_form_factors(mem, objective, weights, x, v, gamma, ln=ln)
    if write_keys is not None:
        inputs = [write_keys] + inputs[1:]
    grads = []
    for h_in, dz in zip(inputs, dzs):
        grads.append(h_in.transpose(-1, -2) @ dz)  # [B, H, in_l, out_l]
        if mem.bias:
            grads.append(dz.sum(-2, keepdim=True))  # [B, H, 1, out_l]
    return tuple(grads)


def autodiff_grad(mem: Memory, objective: str, weights, x: Tensor, v: Tensor, gamma: Tensor,
                  write_keys: Tensor | None = None, ln: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ...]:
    """∇_θ ℓ by torch.func.grad of the inner loss (same arguments as closed_form_grad)."""
    if write_keys is not None:
        raise ValueError("autodiff inner gradients do not support a probe key (Comba)")

    def loss(ws):
        y = forward(mem, ws, x, ln=ln)
        if objective == "dot":
            return -(gamma.unsqueeze(-1) * v * y).sum()
        return 0.5 * (gamma.unsqueeze(-1) * (y - v) ** 2).sum()

    return tuple(func_grad(loss)(tuple(weights)))


def newton_schulz(m: Tensor, steps: int) -> Tensor:
    """Muon's orthogonalization of a batch of matrices [..., R, C] (Keller Jordan's quintic
    iteration, coefficients (3.4445, −4.7750, 2.0315), Frobenius normalization + 1e-7)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    transpose = m.shape[-2] > m.shape[-1]
    x = m.transpose(-1, -2) if transpose else m
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.transpose(-1, -2)
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.transpose(-1, -2) if transpose else x
