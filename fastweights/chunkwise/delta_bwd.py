"""The delta rule's chunk backward in closed form (decay first, no probe key; no or a scalar decay):
the torch twin of the fused Triton backward (`fastweights/kernels/triton/fused/delta_fused_bwd.py`), stage by
stage, on the chunk layout [B, H, N, C, ·] of `varlen.ChunkLayout`. The plain torch chunk form
(`delta.chunk_delta`) is differentiated by autograd; these functions give the same gradients from
formulas, which is what the kernels compute (tests/chunkwise/test_delta_bwd.py checks them against
autograd in float64).

Forward of one chunk (delta.py's stages, rewritten): with G the chunk-local cumsum of g, Γ = e^{G},
E_ij = e^{G_i − G_j}, a = e^{G_last}, T = (I + strict_tril(diag(β) K Kᵀ ⊙ E))⁻¹ and S_n the state
entering the chunk,

    X = diag(β)(V − diag(Γ) K S_n)                  [C, V]   (the UT system's right-hand side)
    U = T X                                          [C, V]   (= U' − W S_n)
    o = scale diag(Γ) Q S_n + Aqk U,    Aqk = scale causal(Q Kᵀ ⊙ E)
    S_{n+1} = a S_n + Kᵀ diag(e^{G_last − G}) U

Backward, last chunk first (`delta_states_bwd`, the one sequential stage), dS_{n+1} the gradient of
the state leaving chunk n:

    dU_n = Aqkᵀ dO_n + diag(e^{G_last − G}) K dS_{n+1}
    Y_n  = Tᵀ dU_n                                  (= dX: the gradient of the right-hand side)
    dv_n = diag(β) Y_n,   dβ^v_i = Σ_v V_iv Y_iv
    dS_n = a dS_{n+1} + scale Qᵀ diag(Γ) dO_n − Kᵀ diag(Γ β) Y_n

U depends on T only through U = T X, so dT = dU Xᵀ and the inverse's gradient collapses:
dLm = −strict_tril(Tᵀ dT Tᵀ) = −strict_tril(Tᵀ dU (T X)ᵀ) = −strict_tril(Y Uᵀ) — no T, no V.
Then per chunk, independently (`delta_chunk_grads`), with h = S_n, dh = dS_{n+1}:

    dA = dO Uᵀ,  dL = Y Uᵀ                                           [C, C]
    M1 = scale causal(dA ⊙ E)             (∂L/∂(Q Kᵀ) through Aqk)
    N  = strict(dL ⊙ E),  M2 = −diag(β) N  (∂L/∂(K Kᵀ) through T: dP ⊙ E, dP = diag(β) dLm)
    dQ̃ = dO hᵀ,  dK̃ = U dhᵀ,  Z = Y hᵀ                               [C, K]
    dq = M1 K + scale diag(Γ) dQ̃
    dk = M1ᵀ Q + (M2 + M2ᵀ) K + diag(e^{G_last − G}) dK̃ − diag(β Γ) Z
    dβ = dβ^v − Γ ⊙ rowsum(K ⊙ Z) − rowsum(N ⊙ K Kᵀ)
    dG = scale Γ ⊙ rowsum(Q ⊙ dQ̃) + rowsum(M1 ⊙ QKᵀ) − colsum(M1 ⊙ QKᵀ)
         − e^{G_last − G} ⊙ rowsum(K ⊙ dK̃) − β Γ ⊙ rowsum(K ⊙ Z) + rowsum(M2 ⊙ KKᵀ) − colsum(M2 ⊙ KKᵀ)
    ∂L/∂G_last = a Σ h ⊙ dh + Σ_i e^{G_last − G_i} rowsum(K ⊙ dK̃)_i
    dg = the chunk's reverse cumsum of dG + ∂L/∂G_last on every row

(each dG term is a log-decay's factor times its gradient: Q̃ = scale Q ⊙ Γ, the rows and columns of E
in Aqk and in P = K Kᵀ ⊙ E, K̃ = K ⊙ e^{G_last − G}, K ⊙ Γ in X, and a and K̃ through G_last.)
"""

from __future__ import annotations

import torch

from .common import exp
from .varlen import ChunkLayout

Tensor = torch.Tensor

__all__ = ["delta_states_bwd", "delta_chunk_grads", "delta_decay_factors"]


def delta_decay_factors(G: Tensor | None, C: int, like: Tensor):
    """(Γ = e^{G} [..., C], e^{G_last − G} [..., C], a = e^{G_last} [...], E [..., C, C] on the causal mask (0
    above it)) of a scalar chunk-local cumsum G [B, H, N, C] — or of no decay (ones) with G None."""
    ar = torch.arange(C, device=like.device)
    causal = ar[:, None] >= ar[None, :]
    if G is None:
        ones = like.new_ones(like.shape[:3] + (C,))
        return ones, ones, like.new_ones(like.shape[:3]), torch.where(causal, 1.0, 0.0).to(like)
    G_last = G[..., -1:]
    E = torch.where(causal, exp(torch.where(causal, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    return exp(G), exp(G_last - G), exp(G_last[..., 0]), E


def delta_states_bwd(layout: ChunkLayout, qc: Tensor, kc: Tensor, vc: Tensor, bc: Tensor, G: Tensor | None,
                     Tinv: Tensor, dO: Tensor, dST: Tensor | None, scale: float):
    """Stage (sequential, last chunk first): see the module docstring.

    qc, kc [B, H, N, C, K] (q unscaled), vc, dO [B, H, N, C, V], bc [B, H, N, C] (β), G None or [B, H, N, C],
    Tinv [B, H, N, C, C], dST None or [B or N_seq, H, K, V] (the final state's gradient).
    Returns (dh [B, H, N, K, V]: dS_{n+1} of every chunk, dS_0 [B or N_seq, H, K, V], Y [B, H, N, C, V],
    dv [B, H, N, C, V], dβ^v [B, H, N, C])."""
    C = kc.shape[-2]
    gam, gkd, a, E = delta_decay_factors(G, C, kc)
    Aqk = scale * (qc @ kc.transpose(-1, -2)) * E  # [B, H, N, C, C]
    dU_loc = Aqk.transpose(-1, -2) @ dO  # [B, H, N, C, V]
    QdO = scale * qc.transpose(-1, -2) @ (gam[..., None] * dO)  # [B, H, N, K, V]
    kd = gkd[..., None] * kc  # K̃ [B, H, N, C, K]
    kg = (gam * bc)[..., None] * kc  # diag(Γ β) K
    Tt = Tinv.transpose(-1, -2)
    B, H = kc.shape[:2]
    K, V = kc.shape[-1], vc.shape[-1]
    S_rows = layout.num_sequences
    dS_fin = dST if dST is not None else kc.new_zeros(S_rows, H, K, V)
    dh, Y = [None] * layout.num_chunks, [None] * layout.num_chunks
    finals = []
    for s, (n0, n1) in enumerate(layout.ranges):
        dS = dS_fin[s:s + 1] if layout.varlen else dS_fin  # [B or 1, H, K, V]
        for n in reversed(range(n0, n1)):
            dh[n] = dS
            dU = dU_loc[:, :, n] + kd[:, :, n] @ dS
            Y[n] = Tt[:, :, n] @ dU
            dS = a[:, :, n, None, None] * dS + QdO[:, :, n] - kg[:, :, n].transpose(-1, -2) @ Y[n]
        finals.append(dS)
    if layout.num_chunks:
        dh_t, Y_t = torch.stack(dh, dim=2), torch.stack(Y, dim=2)
    else:
        dh_t, Y_t = kc.new_zeros(B, H, 0, K, V), vc.new_zeros(B, H, 0, C, V)
    dS0 = torch.cat(finals, dim=0) if layout.varlen else finals[0]
    return dh_t, dS0, Y_t, bc[..., None] * Y_t, (vc * Y_t).sum(-1)


def delta_chunk_grads(qc: Tensor, kc: Tensor, bc: Tensor, G: Tensor | None, h: Tensor, dh: Tensor, U: Tensor,
                      Y: Tensor, dO: Tensor, dbeta_v: Tensor, scale: float):
    """Stage (chunk-parallel): dq, dk [B, H, N, C, K] (per value head), dβ [B, H, N, C] and dg [B, H, N, C] (None
    without decay) from the entering states h and their gradients dh [B, H, N, K, V], U, Y, dO [B, H, N, C, V]
    and dβ^v of `delta_states_bwd`: see the module docstring."""
    C = kc.shape[-2]
    ar = torch.arange(C, device=kc.device)
    strict = ar[:, None] > ar[None, :]
    gam, gkd, a, E = delta_decay_factors(G, C, kc)
    QK = qc @ kc.transpose(-1, -2)
    KK = kc @ kc.transpose(-1, -2)
    M1 = scale * (dO @ U.transpose(-1, -2)) * E  # E is 0 above the diagonal
    Nm = torch.where(strict, (Y @ U.transpose(-1, -2)) * E, 0.0)
    M2 = -bc[..., None] * Nm
    dQt = dO @ h.transpose(-1, -2)  # [B, H, N, C, K]
    dKt = U @ dh.transpose(-1, -2)
    Z = Y @ h.transpose(-1, -2)
    dq = M1 @ kc + (scale * gam)[..., None] * dQt
    dk = M1.transpose(-1, -2) @ qc + (M2 + M2.transpose(-1, -2)) @ kc + gkd[..., None] * dKt \
        - (bc * gam)[..., None] * Z
    kz = (kc * Z).sum(-1)  # [B, H, N, C]
    dbeta = dbeta_v - gam * kz - (Nm * KK).sum(-1)
    if G is None:
        return dq, dk, dbeta, None
    kdk = (kc * dKt).sum(-1)
    A1, A2 = M1 * QK, M2 * KK
    dG = (scale * gam * (qc * dQt).sum(-1) + A1.sum(-1) - A1.sum(-2) - gkd * kdk - bc * gam * kz
          + A2.sum(-1) - A2.sum(-2))
    dG_last = a * (h * dh).sum((-1, -2)) + (gkd * kdk).sum(-1)  # [B, H, N]
    dg = dG.flip(-1).cumsum(-1).flip(-1) + dG_last[..., None]
    return dq, dk, dbeta, dg
