"""The inner mini-batch form: the chunk form of every memory trained with minibatch b > 1
(TTT-Linear, TTT-MLP, Titans, OmegaNet, ATLAS, and any recipe of that shape).

Within a mini-batch every gradient is taken at the weights θ₀ the mini-batch started from, so
all b per-token gradients are computed at once (one batched forward/backward of the memory),
and what the recurrence does after the gradient is linear in it and scanned in parallel:

    G_t  = Σ_{i ∈ window(t)} γ_i ∇ℓ(θ₀; φ(k_i), v_i)            banded sum over per-token gradients
    gd:        Δ_t = −β_t G_t
               averaged (TTT's 1/i, i_t = position in the mini-batch, o = tokens of it before
               this call): θ_t = θ₀ + (o(θ_s − θ₀) + Σ_{j≤t} Δ_j) / i_t
    momentum:  m_t = N_t m_s + Σ_{j≤t} (N_t/N_j)(−β_j G_j),  Δ_t = m_t           N_t = Π_{τ≤t} ν_τ
    muon:      m_t = N_t m_s + Σ_{j≤t} (N_t/N_j) G_j,         Δ_t = −β_t NS(m_t)  (NS per token)
    θ_t = A_t θ_s + Σ_{j≤t} (A_t/A_j) Δ_j                                          A_t = Π_{τ≤t} a_τ
    o_t = M_{θ_t}(scale·φ(q_t))

(products from the segment start s; the ratios are exps of differences of log-cumsums, masked
before the exp). The per-token weights θ_t are materialized for the readout: b copies of the
memory per head. Mini-batches stay aligned to the sequence start; a state with offset > 0
continues its mini-batch from the carried anchor θ₀. The result equals `recurrent` with the
same b exactly (float64 to rounding).
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ..reference import inner
from ..state import MemoryState

Tensor = torch.Tensor


def _ratio(logc: Tensor) -> Tensor:
    """exp(logc_t − logc_j) for j ≤ t, else 0: [B, H, L] -> [B, H, L, L]."""
    L = logc.shape[-1]
    mask = torch.ones(L, L, dtype=torch.bool, device=logc.device).tril()
    diff = logc[..., :, None] - logc[..., None, :]
    return torch.where(mask, diff, float("-inf")).exp()


def _scan(ratio: Tensor, start_decay: Tensor, start: Tensor | None, deltas: Tensor) -> Tensor:
    """x_t = D_t x_s + Σ_{j≤t} R_tj Δ_j for weight-shaped tensors.

    ratio [B, H, L, L]; start_decay [B, H, L] (D_t); start [B, H, ...] or None; deltas [B, H, L, ...].
    Returns [B, H, L, ...]."""
    flat = deltas.flatten(3)  # [B, H, L, P]
    out = (ratio @ flat).view_as(deltas)
    if start is not None:
        shape = start_decay.shape + (1,) * (deltas.dim() - 3)
        out = out + start_decay.view(shape) * start.unsqueeze(2)
    return out


def _log(x: Tensor) -> Tensor:
    return torch.log(x.clamp_min(torch.finfo(x.dtype).tiny))


def minibatch_chunk(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None,
                    beta: Tensor, nu: Tensor | None, gamma: Tensor | None, state: MemoryState,
                    ln: tuple[Tensor, Tensor] | None = None):
    """q [B, T, H, K']; k [B, T, H, K']; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H];
    nu None | [B, T, H]; gamma None | [B, T, H]; state a complete MemoryState (compute dtype);
    ln None | the residual LayerNorm's per-head affine (γ, β) [H, V] each.
    Returns (o [B, T, H, V], final MemoryState) — identical to reference.recurrent.memory_recurrent."""
    mem, obj, opt = recipe.memory, recipe.objective, recipe.optimizer
    objective = "dot" if obj.kind == "dot" else "l2"
    b, c = opt.minibatch, obj.window
    B, T, H, _ = q.shape
    weights, momentum, anchor, offset = state.weights, state.momentum, state.anchor, state.offset
    win_k, win_v, win_g = state.window_k, state.window_v, state.window_gamma
    if gamma is None:
        gamma = torch.ones(B, T, H, dtype=q.dtype, device=q.device)
    outs = []
    t0 = 0
    while t0 < T:
        L = min(b - offset, T - t0)
        sl = slice(t0, t0 + L)
        if offset == 0:
            anchor = weights
        # tokens whose gradients this segment needs: the carried window, then the segment
        kx = k[:, sl].transpose(1, 2)  # [B, H, L, K']
        vx = v[:, sl].transpose(1, 2)  # [B, H, L, V]
        gx = gamma[:, sl].transpose(1, 2)  # [B, H, L]
        if c > 1:
            kx = torch.cat([win_k.transpose(1, 2), kx], dim=2)  # [B, H, c−1+L, K']
            vx = torch.cat([win_v.transpose(1, 2), vx], dim=2)
            gx = torch.cat([win_g.transpose(1, 2), gx], dim=2)
        # per-token gradients at the anchor: the tokens go into a batch dimension
        point = tuple(w.unsqueeze(2) for w in anchor)  # [B, H, 1, in, out]
        grads = inner.closed_form_grad(mem, objective, point, kx.unsqueeze(3), vx.unsqueeze(3), gx.unsqueeze(3),
                                       ln=ln)
        # banded window sum: G_t = Σ_{s<c} (γ g)_{t−s}
        if c > 1:
            grads = tuple(sum(gr[:, :, s:s + L] for s in range(c)) for gr in grads)  # [B, H, L, in, out]
            win_k = torch.cat([win_k, k[:, sl]], dim=1)[:, -(c - 1):]
            win_v = torch.cat([win_v, v[:, sl]], dim=1)[:, -(c - 1):]
            win_g = torch.cat([win_g, gamma[:, sl]], dim=1)[:, -(c - 1):]
        bt = beta[:, sl].transpose(1, 2)  # [B, H, L]
        bw = bt[..., None, None]  # [B, H, L, 1, 1]
        if opt.kind == "gd":
            deltas = tuple(-bw * gr for gr in grads)
        else:
            logn = _log(nu[:, sl].transpose(1, 2)).cumsum(-1)  # [B, H, L]
            rn = _ratio(logn)
            src = tuple(-bw * gr for gr in grads) if opt.kind == "momentum" else grads
            ms = tuple(_scan(rn, logn.exp(), m0, s) for m0, s in zip(momentum, src))  # [B, H, L, in, out]
            momentum = tuple(m[:, :, -1] for m in ms)
            if opt.kind == "momentum":
                deltas = ms
            else:
                deltas = tuple(-bw * inner.newton_schulz(m, opt.ns_steps) for m in ms)
        if g is not None:
            loga = g[:, sl].transpose(1, 2).cumsum(-1)  # [B, H, L]
            ra, da = _ratio(loga), loga.exp()
        else:
            ra = torch.ones(L, L, dtype=q.dtype, device=q.device).tril().expand(B, H, L, L)
            da = torch.ones(B, H, L, dtype=q.dtype, device=q.device)
        if opt.minibatch_average:  # no retention: ra is the cumulative sum
            pos = torch.arange(offset + 1, offset + L + 1, dtype=q.dtype, device=q.device)  # i_t
            per_token = tuple(a0.unsqueeze(2) + (offset * (w0 - a0).unsqueeze(2) + _scan(ra, da, None, d))
                              / pos.view((L,) + (1,) * (d.dim() - 3))
                              for a0, w0, d in zip(anchor, weights, deltas))  # [B, H, L, in, out]
        else:
            per_token = tuple(_scan(ra, da, w0, d) for w0, d in zip(weights, deltas))  # [B, H, L, in, out]
        x = scale * q[:, sl].transpose(1, 2).unsqueeze(3)  # [B, H, L, 1, K']
        o = inner.forward(mem, per_token, x, ln=ln)[:, :, :, 0]  # [B, H, L, V]
        outs.append(o.transpose(1, 2))
        weights = tuple(w[:, :, -1] for w in per_token)
        offset = (offset + L) % b
        t0 += L
    final = MemoryState(weights=weights, momentum=momentum, normalizer=None, anchor=anchor, offset=offset,
                        window_k=win_k, window_v=win_v, window_gamma=win_g)
    return torch.cat(outs, dim=1), final
