"""Quadratic matrix (parallel) forms of the linear-memory recipes that have one.

One-step-GD linear memories with rank-1 writes (seeds/002, Table: (QKᵀ⊙Γ)(I + KKᵀ⊙Γ⁻)⁻¹V).
Write S_t = D_t S_{t−1} + k_t u_tᵀ, with D_t = Diag(exp g_t) (scalar or diagonal) and u_t the
"new value" of step t. Let G_i = Σ_{τ≤i} g_τ and Γ(i, j) = Diag(exp(G_i − G_j)) (decay from j to i).

    dot objective (gated linear class):  u_t = β_t v_t
    l2 objective (delta class):          u_t = β_t (v_t − R_tᵀ r_t),   r = k (or Comba's probe p)
        R_t = D_t S_{t−1} (decay_first: GDN, KDA)   or   R_t = S_{t−1} (Comba)
        ⇒ (I + diag(β) A) U = diag(β)(V − [read of S_0]),  A_ij = r_iᵀ Γ(i', j) k_j for j < i,
          i' = i (decay_first) or i − 1 (read before the decay)
    o_i = Σ_{j≤i} (scale q_i)ᵀ Γ(i, j) k_j u_j + S_0ᵀ Γ(i, 0)(scale q_i)
    S_T = Γ(T, 0) S_0 + Σ_j Γ(T, j) k_j u_jᵀ

DeltaProduct's n_h micro-steps are interleaved into a sequence of length T·n_h (gate on the
first micro-step, output read after the last). Normalized linear attention appends a column of
ones to v, so the normalizer z is the last column of the state.

Mesa: q*_t = (H_t + Λ)⁻¹(scale q_t) with H_t = Γ(t, 0) H_0 + Σ_{j≤t} Γ(t, j) β_j k_j k_jᵀ, solved
for all t at once; o_t = Σ_{j≤t} Γ(t, j) β_j (k_j·q*_t) v_j + G_0ᵀ Γ(t, 0) q*_t.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _pair_decay(G: Tensor, Gread: Tensor, strict: bool = False) -> Tensor:
    """exp(Gread_i − G_j) for j ≤ i (j < i when strict), 0 elsewhere.

    G, Gread: [B, H, L] or [B, H, L, K] -> [B, H, L, L] or [B, H, L, L, K]; the mask is
    applied to the exponent (−inf) before the exp, never multiplied in."""
    diag = G.dim() == 4
    Gi = Gread[:, :, :, None] if not diag else Gread[:, :, :, None, :]
    Gj = G[:, :, None, :] if not diag else G[:, :, None, :, :]
    L = G.shape[2]
    mask = torch.ones(L, L, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    if diag:
        mask = mask[..., None]
    return torch.where(mask, Gi - Gj, float("-inf")).exp()


def linear_parallel(q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor,
                    p: Tensor | None, delta: bool, decay_first: bool, S0: Tensor):
    """Matrix form of the gated-linear (delta=False) and delta (delta=True) classes.

    q [B, T, H, K]; k [B, T, n, H, K]; v [B, T, n, H, V]; g None | [B, T, H] | [B, T, H, K];
    beta [B, T, n, H]; p None | [B, T, H, K]; S0 [B, H, K, V] (compute dtype).
    Returns (o [B, T, H, V], S_T [B, H, K, V]).
    """
    B, T, n, H, K = k.shape
    L = T * n
    kk = k.reshape(B, L, H, K).transpose(1, 2)  # [B, H, L, K]
    vv = v.reshape(B, L, H, -1).transpose(1, 2)  # [B, H, L, V]
    bb = beta.reshape(B, L, H).transpose(1, 2)  # [B, H, L]
    # gate on the first micro-step of each token, zero on the others
    if g is None:
        gl = torch.zeros(B, H, L, dtype=kk.dtype, device=kk.device)
    else:
        gt = g.transpose(1, 2)  # [B, H, T] or [B, H, T, K]
        gl = torch.zeros(*gt.shape[:2], T, n, *gt.shape[3:], dtype=kk.dtype, device=kk.device)
        gl[:, :, :, 0] = gt
        gl = gl.flatten(2, 3)  # [B, H, L] or [B, H, L, K]
    G = gl.cumsum(2)
    diag = G.dim() == 4
    Gfull = G if diag else G[..., None]  # [B, H, L, K or 1]
    rows = torch.arange(T, device=kk.device) * n + (n - 1)  # the micro-step each output is read at
    sq = scale * q.transpose(1, 2)  # [B, H, T, K]
    if delta:
        r = kk if p is None else p.transpose(1, 2)  # [B, H, L, K]
        Gread = G if decay_first else G - gl  # read at i (decayed) or at i − 1 (undecayed)
        Gread_full = Gread if diag else Gread[..., None]
        Dr = _pair_decay(G, Gread, strict=True)  # [B, H, L, L(, K)]
        if diag:
            A = torch.einsum("bhik,bhijk,bhjk->bhij", r, Dr, kk)
        else:
            A = (r @ kk.transpose(-1, -2)) * Dr
        A = A.tril(-1)
        rhs = vv - (r * Gread_full.exp()) @ S0  # [B, H, L, V]
        eye = torch.eye(L, dtype=A.dtype, device=A.device)
        U = torch.linalg.solve_triangular(eye + bb[..., None] * A, bb[..., None] * rhs,
                                          upper=False, unitriangular=True)  # [B, H, L, V]
    else:
        U = bb[..., None] * vv  # [B, H, L, V]
    D = _pair_decay(G, G)  # [B, H, L, L(, K)]
    Gq = Gfull[:, :, rows]  # [B, H, T, K or 1]
    Dq = D[:, :, rows]  # [B, H, T, L(, K)]
    if diag:
        Aqk = torch.einsum("bhik,bhijk,bhjk->bhij", sq, Dq, kk)
    else:
        Aqk = (sq @ kk.transpose(-1, -2)) * Dq
    o = Aqk @ U + (sq * Gq.exp()) @ S0  # [B, H, T, V]
    G_last = Gfull[:, :, -1:]  # [B, H, 1, K or 1]
    S = G_last.exp().transpose(-1, -2) * S0 + (kk * (G_last - Gfull).exp()).transpose(-1, -2) @ U
    return o.transpose(1, 2), S


def mesa_parallel(q: Tensor, k: Tensor, v: Tensor, *, scale: float, g: Tensor | None, beta: Tensor,
                  lamb: Tensor, H0: Tensor, G0: Tensor):
    """Mesa's exact solve for all tokens at once (see the module docstring).

    q, k [B, T, H, K]; v [B, T, H, V]; g None | [B, T, H]; beta [B, T, H]; lamb [H, K];
    H0 [B, H, K, K], read through its symmetric part ½(H0 + H0ᵀ) as in every Mesa form;
    G0 [B, H, K, V]. Returns (o [B, T, H, V], H_T, G_T).
    """
    B, T, H, K = k.shape
    H0 = 0.5 * (H0 + H0.transpose(-1, -2))
    kk, vv, qq = k.transpose(1, 2), v.transpose(1, 2), scale * q.transpose(1, 2)  # [B, H, T, ·]
    bb = beta.transpose(1, 2)  # [B, H, T]
    G = (g.transpose(1, 2) if g is not None else torch.zeros_like(bb)).cumsum(-1)  # [B, H, T]
    D = _pair_decay(G, G) * bb[:, :, None, :]  # [B, H, T, T]: Γ(i, j) β_j
    decay0 = G.exp()[..., None, None]  # [B, H, T, 1, 1]
    outer = kk[..., :, None] * kk[..., None, :]  # [B, H, T, K, K]
    Hs = torch.einsum("bhij,bhjkl->bhikl", D, outer) + decay0 * H0[:, :, None]  # [B, H, T, K, K]
    Hs = Hs + torch.diag_embed(lamb)[None, :, None]
    qs = torch.linalg.solve(Hs, qq[..., None])[..., 0]  # [B, H, T, K]
    o = ((qs @ kk.transpose(-1, -2)) * D) @ vv + (qs * decay0[..., 0]) @ G0  # [B, H, T, V]
    GT = G[..., -1][..., None, None]  # [B, H, 1, 1]
    w = (G[..., -1:] - G).exp() * bb  # [B, H, T]
    H_T = GT.exp() * H0 + (kk * w[..., None]).transpose(-1, -2) @ kk
    G_T = GT.exp() * G0 + (kk * w[..., None]).transpose(-1, -2) @ vv
    return o.transpose(1, 2), H_T, G_T
