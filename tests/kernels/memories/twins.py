"""The torch twins of the loop kernels (`kernels.triton.memories.ttt.ttt_linear_triton`, `ttt_mlp.ttt_mlp_triton`,
`titans.titans_triton`), on the kernels' own contract: only the tests need them (the torch row runs
`chunkwise.minibatch` itself)."""

from __future__ import annotations

import dataclasses

from fastweights.chunkwise.minibatch import minibatch_chunk
from fastweights.state import MemoryState, compute_dtype
from fastweights.zoo import get


def _ttt_torch(recipe_name, q, k, v, beta, ln_weight, ln_bias, *, scale, weights, anchor, offset, minibatch):
    """`chunkwise.minibatch.minibatch_chunk` for the zoo recipe `recipe_name` with mini-batch b, in fp32 (float64
    for float64 inputs), grouped heads expanded (no cu_seqlens: the reference of a varlen call is this on each
    sequence alone). q, k [B, T, H_q, D], v [B, T, H, D]; returns (o in v's dtype, final weights, anchor, offset)."""
    recipe = get(recipe_name)
    recipe = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, minibatch=minibatch))
    cdt = compute_dtype(q)
    G = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(G, dim=2).to(cdt) for x in (q, k))
    st = MemoryState(weights=tuple(w.to(cdt) for w in weights), offset=offset,
                     anchor=None if anchor is None else tuple(w.to(cdt) for w in anchor))
    o, final = minibatch_chunk(recipe, q, k, v.to(cdt), scale=scale, g=None, beta=beta.to(cdt), nu=None, gamma=None,
                               state=st, ln=(ln_weight.to(cdt), ln_bias.to(cdt)))
    return o.to(v.dtype), final.weights, final.anchor, final.offset


def ttt_linear_torch(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                     minibatch: int = 16):
    """The torch twin of `ttt_linear_triton` (same contract): the recipe `ttt_linear`."""
    return _ttt_torch("ttt_linear", q, k, v, beta, ln_weight, ln_bias, scale=scale, weights=weights, anchor=anchor,
                      offset=offset, minibatch=minibatch)


def ttt_mlp_torch(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                  minibatch: int = 16):
    """The torch twin of `ttt_mlp_triton` (same contract): the recipe `ttt_mlp`."""
    return _ttt_torch("ttt_mlp", q, k, v, beta, ln_weight, ln_bias, scale=scale, weights=weights, anchor=anchor,
                      offset=offset, minibatch=minibatch)


def ttt_linear_readout_torch(q, k, v, beta, ln_weight, ln_bias, anchors, carried, *, scale: float, offset: int,
                             minibatch: int, eps: float = 1e-6):
    """The torch twin of TTT-Linear's readout (`ttt._readout_kernel`) in the primal form, on any anchors: token t,
    the i-th of its mini-batch, reads its own weights W_i = A + P_i / i, b_i = a + p_i / i, with P_i = P_0 −
    Σ_{j ≤ i} η_j k_jᵀ e_j and e_j = ∂½‖k_j + γ ⊙ LN(f_j) + β_ln − v_j‖² / ∂f_j at f_j = k_j A + a (by autograd),
    then o_t = x_t + γ ⊙ LN(x_t W_i + b_i) + β_ln, x = scale·q. q, k [B, T, H_q, D], v [B, T, H, D], beta [B, T, H],
    ln_weight, ln_bias [H, D]; anchors (A [B, NS, H, D, D], a [B, NS, H, D]): mini-batch s's start (aligned so that
    the first holds b − offset tokens); carried (P_0 [B, H, D, D], p_0 [B, H, D]): the first mini-batch's consumed
    sums. Computes in q's dtype (float64 in the tests); returns o [B, T, H, D]."""
    import torch
    import torch.nn.functional as F

    B, T, Hq, D = q.shape
    H = v.shape[2]
    G = H // Hq
    x, k = (t.repeat_interleave(G, dim=2) for t in (scale * q, k))
    A, a = anchors
    o = torch.empty_like(v)
    for s in range(A.shape[1]):
        t0, t1 = max(s * minibatch - offset, 0), min((s + 1) * minibatch - offset, T)
        ipos = torch.arange(t0, t1, dtype=q.dtype) + offset - s * minibatch + 1  # [n] 1-based positions
        kk, vv, xx, eta = k[:, t0:t1], v[:, t0:t1], x[:, t0:t1], beta[:, t0:t1]  # [B, n, H, ·]
        f = torch.einsum("bnhd,bhde->bnhe", kk, A[:, s]) + a[:, s, None]
        with torch.enable_grad():
            f = f.detach().requires_grad_(True)
            y = kk + ln_weight * F.layer_norm(f, (D,), eps=eps) + ln_bias
            e, = torch.autograd.grad(0.5 * ((y - vv) ** 2).sum(), f)
        ee = eta[..., None] * e
        P = -torch.einsum("bnhd,bnhe->bnhde", kk, ee).cumsum(1)  # [B, n, H, D, D]
        p = -ee.cumsum(1)
        if s == 0:
            P, p = P + carried[0][:, None], p + carried[1][:, None]
        W = A[:, s, None] + P / ipos[:, None, None, None]
        bias = a[:, s, None] + p / ipos[:, None, None]
        z = torch.einsum("bnhd,bnhde->bnhe", xx, W) + bias
        o[:, t0:t1] = xx + ln_weight * F.layer_norm(z, (D,), eps=eps) + ln_bias
    return o


def titans_torch(q, k, v, g, beta, nu, *, scale: float, weights, momentum, anchor=None, offset: int = 0,
                 minibatch: int = 16):
    """The torch twin of `titans.titans_triton` (same contract, no cu_seqlens): `chunkwise.minibatch.minibatch_chunk`
    for the zoo recipe `titans` with mini-batch b, in fp32 (float64 for float64 inputs), grouped heads expanded.
    Returns (o in v's dtype, final weights, momentum, anchor, offset)."""
    recipe = get("titans")
    recipe = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, minibatch=minibatch))
    cdt = compute_dtype(q)
    G = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(G, dim=2).to(cdt) for x in (q, k))
    st = MemoryState(weights=tuple(w.to(cdt) for w in weights), momentum=tuple(m.to(cdt) for m in momentum),
                     offset=offset, anchor=None if anchor is None else tuple(w.to(cdt) for w in anchor))
    o, final = minibatch_chunk(recipe, q, k, v.to(cdt), scale=scale, g=g.to(cdt), beta=beta.to(cdt), nu=nu.to(cdt),
                               gamma=None, state=st)
    return o.to(v.dtype), final.weights, final.momentum, final.anchor, final.offset
