"""The exact per-token recurrence of every fast-weight memory recipe (one generic loop).

Per token t (all inputs already feature-mapped; a = exp(g_t) scalar or diagonal on the key side):

    if minibatch b > 1 and t starts a mini-batch:  anchor ← θ
    if retention.decay_first:  θ ← a·θ                      (GDN, KDA, DeltaProduct)
    for each Householder micro-step j < n_h:
        point = anchor if b > 1 else θ                       (where the gradient is taken)
        G = ∇ℓ_t(point)                                      (dot, l2 (probe), omega window)
        gd:        θ ← [a·]θ − β_{t,j} G                     ([a·] only when not decay_first, j = 0)
                   averaged mini-batch (TTT's 1/i, i = offset + 1): θ ← θ₀ + ((i−1)/i)(θ − θ₀) − (β_t/i) G
        momentum:  m ← ν_t m − β_t G;      θ ← [a·]θ + m    (Titans: lr inside the momentum)
        muon:      m ← ν_t m + G;          θ ← [a·]θ − β_t NS(m)   (ATLAS)
    z ← a·z + β_t φ(k_t)                                      (normalized linear attention only)
    o_t = M_θ(scale·φ(q_t))  [/ (scale·φ(q_t)·z + 1e-6) when normalized]

Memories with inner biases carry them in θ like the weights (same updates, same retention).

The computation runs in float64 when the inputs are float64, else in float32; the state is
carried in that precision and outputs are cast back to v's dtype.
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ..state import MemoryState
from . import inner

Tensor = torch.Tensor


def _decay(x: Tensor, a: Tensor | None) -> Tensor:
    """a·x for a [B, H] (scalar) or [B, H, K'] (diagonal, on the key side of x [B, H, K', ...])."""
    if a is None:
        return x
    while a.dim() < x.dim():
        a = a.unsqueeze(-1)
    return a * x


def memory_recurrent(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                     g: Tensor | None, beta: Tensor, p: Tensor | None, nu: Tensor | None,
                     gamma: Tensor | None, state: MemoryState, inner_grad: str = "closed", readout: bool = True,
                     ln: tuple[Tensor, Tensor] | None = None):
    """Run the recurrence.

    q [B, T, H, K']; k [B, T, n, H, K']; v [B, T, n, H, V] (n = Householder steps, 1 otherwise);
    g None | [B, T, H] | [B, T, H, K']; beta [B, T, n, H]; p None | [B, T, H, K'];
    nu None | [B, T, H]; gamma None | [B, T, H] (Omega in-window gates); ln None | the residual
    LayerNorm's per-head affine (γ, β) [H, V] each.
    state: a MemoryState in the compute dtype. Returns (o [B, T, H, V], final MemoryState);
    readout=False skips the per-token reads (q unused) and returns (None, final MemoryState).
    """
    mem, obj, opt, ret = recipe.memory, recipe.objective, recipe.optimizer, recipe.retention
    grad_fn = inner.closed_form_grad if inner_grad == "closed" else inner.autodiff_grad
    T = q.shape[1]
    n_h = k.shape[2]
    b = opt.minibatch
    window = obj.window
    objective = "dot" if obj.kind == "dot" else "l2"

    weights = state.weights
    momentum = state.momentum
    z = state.normalizer
    anchor = state.anchor
    offset = state.offset
    win_k, win_v, win_g = state.window_k, state.window_v, state.window_gamma

    outs = []
    for t in range(T):
        a = g[:, t].exp() if g is not None else None  # [B, H] or [B, H, K']
        if b > 1 and offset == 0:
            anchor = weights
        if ret.decay_first and a is not None:
            weights = tuple(_decay(w, a) for w in weights)
        for j in range(n_h):
            kt = k[:, t, j]  # [B, H, K']
            vt = v[:, t, j]  # [B, H, V]
            if window > 1:
                wk = torch.cat([win_k, kt[:, None]], dim=1)  # [B, c, H, K']
                wv = torch.cat([win_v, vt[:, None]], dim=1)  # [B, c, H, V]
                wg = torch.cat([win_g, gamma[:, t, None]], dim=1)  # [B, c, H]
                win_k, win_v, win_g = wk[:, 1:], wv[:, 1:], wg[:, 1:]
                xk, xv, xg = wk.transpose(1, 2), wv.transpose(1, 2), wg.transpose(1, 2)  # [B, H, c, ·]
            else:
                xk, xv = kt[:, :, None], vt[:, :, None]  # [B, H, 1, ·]
                xg = (gamma[:, t, :, None] if gamma is not None
                      else torch.ones_like(xk[..., 0]))  # [B, H, 1]
            point = anchor if b > 1 else weights
            if p is not None:
                G = grad_fn(mem, objective, point, p[:, t, :, None], xv, xg, write_keys=xk)
            else:
                G = grad_fn(mem, objective, point, xk, xv, xg, ln=ln)
            bt = beta[:, t, j][:, :, None, None]  # [B, H, 1, 1]
            if not ret.decay_first and a is not None and j == 0:
                weights = tuple(_decay(w, a) for w in weights)
            if opt.kind == "gd" and opt.minibatch_average:
                i = offset + 1
                weights = tuple(a0 + ((i - 1) / i) * (w - a0) - (bt / i) * gi for a0, w, gi in zip(anchor, weights, G))
            elif opt.kind == "gd":
                weights = tuple(w - bt * gi for w, gi in zip(weights, G))
            elif opt.kind == "momentum":
                nt = nu[:, t][:, :, None, None]
                momentum = tuple(nt * m - bt * gi for m, gi in zip(momentum, G))
                weights = tuple(w + m for w, m in zip(weights, momentum))
            else:  # muon
                nt = nu[:, t][:, :, None, None]
                momentum = tuple(nt * m + gi for m, gi in zip(momentum, G))
                weights = tuple(w - bt * inner.newton_schulz(m, opt.ns_steps) for w, m in zip(weights, momentum))
        if z is not None:
            z = _decay(z, a) + beta[:, t, 0][..., None] * k[:, t, 0]  # [B, H, K']
        offset = (offset + 1) % b
        if not readout:
            continue
        x = scale * q[:, t, :, None]  # [B, H, 1, K']
        o = inner.forward(mem, weights, x, ln=ln)[:, :, 0]  # [B, H, V]
        if z is not None:
            o = o / ((x[:, :, 0] * z).sum(-1, keepdim=True) + 1e-6)
        outs.append(o)
    o = torch.stack(outs, dim=1) if readout else None  # [B, T, H, V]
    final = MemoryState(weights=weights, momentum=momentum, normalizer=z,
                        anchor=anchor if b > 1 else None, offset=offset,
                        window_k=win_k, window_v=win_v, window_gamma=win_g)
    return o, final


def mesa_recurrent(q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor,
                   lamb: Tensor, H0: Tensor, G0: Tensor):
    """Mesa: H_t = γ_t H_{t−1} + β_t k_t k_tᵀ, G_t = γ_t G_{t−1} + β_t k_t v_tᵀ,
    o_t = G_tᵀ (H_t + Diag(λ))⁻¹ (scale·q_t), solved exactly at every token.

    q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H]; lamb [H, K];
    H0 [B, H, K, K], read through its symmetric part ½(H0 + H0ᵀ) (H is a sum of β k kᵀ; every
    Mesa form reads it so); G0 [B, H, K, V]. Returns (o [B, T, H, V], H_T, G_T).
    """
    Hs, Gs = 0.5 * (H0 + H0.transpose(-1, -2)), G0
    lam = torch.diag_embed(lamb)  # [H, K, K]
    outs = []
    for t in range(q.shape[1]):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t][..., None, None]  # [B, H, K], [B, H, V], [B, H, 1, 1]
        if g is not None:
            a = g[:, t].exp()[..., None, None]  # [B, H, 1, 1]
            Hs, Gs = a * Hs, a * Gs
        Hs = Hs + bt * kt[..., :, None] * kt[..., None, :]
        Gs = Gs + bt * kt[..., :, None] * vt[..., None, :]
        qs = torch.linalg.solve(Hs + lam, scale * q[:, t][..., None])  # [B, H, K, 1]
        outs.append((Gs.transpose(-1, -2) @ qs)[..., 0])  # [B, H, V]
    return torch.stack(outs, dim=1), Hs, Gs
