"""The backward of the gated-linear chunk form (`gated.chunk_gated`) written out as stages, in plain
PyTorch: the torch twins of the fused Triton backward (`kernels/triton/fused/gated_fused.py`), tested against
autograd through `chunk_gated` (tests/kernels/fused/test_triton_gated_fused.py).

Notation as in gated.py: chunks of C rows, G_i the chunk-local cumsum of g, G_L its last row, S_n the
state entering chunk n, k̂ = βk, Q̃ = scale q ⊙ e^{G}, K̃ = k̂ ⊙ e^{G_L − G}, a = e^{G_L},
A_ij = scale Σ_d q_id k̂_jd e^{G_id − G_jd} (j ≤ i). Given dO and dS_{n+1} (the gradient of the state
leaving chunk n):

    reverse_states   dS_n = a_n ⊙ dS_{n+1} + Q̃_nᵀ dO_n            (last chunk first, per sequence)
    chunk_grads      dV = Aᵀ dO + K̃ dS_{n+1},  dA = dO Vᵀ (j ≤ i)
                     dq_i = scale Σ_j dA_ij k̂_j ⊙ e^{G_i − G_j} + e^{G_i} ⊙ scale (S_n dO_i)
                     dk̂_j = scale Σ_i dA_ij q_i ⊙ e^{G_i − G_j} + e^{G_L − G_j} ⊙ (dS_{n+1} v_j)
                     dk = β dk̂, dβ_j = k_j·dk̂_j, dG_i = q_i ⊙ dq_i − k_i ⊙ dk_i (summed over d: scalar g)
                     ∂L/∂G_L = Σ_v S_{n+1} ⊙ dS_{n+1} (and over K: scalar g)
                     dg_s = Σ_{i ≥ s} dG_i + ∂L/∂G_L                (within the chunk)
"""

from __future__ import annotations

import torch

from .common import chunk_cumsum, chunk_inputs, exp, pass_states, scalar_or_diag
from .gated import gated_transitions, gated_writes
from .varlen import ChunkLayout

Tensor = torch.Tensor

__all__ = ["reverse_states", "chunk_grads", "chunk_gated_bwd"]


def reverse_states(layout: ChunkLayout, dS_final: Tensor, a: Tensor | None, reads: Tensor):
    """The transposed state pass: dS_n = a_n ⊙ dS_{n+1} + R_n from each sequence's last chunk to its first.

    dS_final: the final states' gradient [B or N_seq, H, K, V]; a: None or the decay [B, H, N, K' ∈ {1, K}, 1];
    reads: R_n = Q̃_nᵀ dO_n [B, H, N, K, V]. Returns (dS_{n+1}, the gradient of the state leaving every chunk
    [B, H, N, K, V]; dS_0, the initial states' gradient [B or N_seq, H, K, V])."""
    finals = dS_final.split(1, dim=0) if layout.varlen else [dS_final]
    leaving: list = [None] * reads.shape[2]
    starts = []
    for (n0, n1), dS in zip(layout.ranges, finals):
        for n in reversed(range(n0, n1)):
            leaving[n] = dS
            dS = reads[:, :, n] + (a[:, :, n] * dS if a is not None else dS)
        starts.append(dS)
    if leaving:
        stacked = torch.stack(leaving, dim=2)  # [B, H, N, K, V]
    else:
        stacked = reads.new_zeros(reads.shape)
    return stacked, torch.cat(starts, dim=0)


def chunk_grads(qc: Tensor, kc: Tensor, vc: Tensor, beta_c: Tensor | None, G: Tensor | None, kind: str,
                entering: Tensor, dleaving: Tensor, dOc: Tensor, scale: float):
    """The chunk-parallel backward (every chunk at once). qc, kc [B, H, N, C, K] (q unscaled, k without β);
    vc, dOc [B, H, N, C, V]; beta_c None or [B, H, N, C]; G None or the chunk-local cumsum [B, H, N, C(, K)];
    entering S_n and dleaving dS_{n+1} [B, H, N, K, V]. Returns (dq, dk [B, H, N, C, K], dv [B, H, N, C, V],
    dg like G or None (the raw log-decay's gradient: the suffix sums of dG plus ∂L/∂G_L), dβ [B, H, N, C] or None)."""
    C = qc.shape[-2]
    kh = kc * beta_c.unsqueeze(-1) if beta_c is not None else kc  # k̂
    mask = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()  # [i, j]: j ≤ i
    dA = torch.where(mask, dOc @ vc.transpose(-1, -2), 0.0)  # [B, H, N, C, C]
    if G is None:
        A = torch.where(mask, scale * (qc @ kh.transpose(-1, -2)), 0.0)
        dq = scale * (dA @ kh)
        dkh = scale * (dA.transpose(-1, -2) @ qc)
    elif kind == "scalar":
        D = exp(torch.where(mask, G[..., :, None] - G[..., None, :], 0.0))  # e^{G_i − G_j}, exponent ≤ 0
        A = torch.where(mask, scale * (qc @ kh.transpose(-1, -2)) * D, 0.0)
        dq = scale * ((dA * D) @ kh)
        dkh = scale * ((dA * D).transpose(-1, -2) @ qc)
    else:  # diagonal: e^{G_id − G_jd} per channel  [B, H, N, C, C, K]
        E = exp(torch.where(mask[..., None], G[..., :, None, :] - G[..., None, :, :], 0.0)) * mask[..., None]
        A = scale * torch.einsum("...id,...jd,...ijd->...ij", qc, kh, E)
        dq = scale * torch.einsum("...ij,...jd,...ijd->...id", dA, kh, E)
        dkh = scale * torch.einsum("...ij,...id,...ijd->...jd", dA, qc, E)
    _, k_dec, a = gated_transitions(qc, kh, G, kind)  # K̃, a = e^{G_L} [B, H, N, 1 or K, 1]
    dv = A.transpose(-1, -2) @ dOc + k_dec @ dleaving
    inter_q = scale * (dOc @ entering.transpose(-1, -2))  # scale S_n dO_i as rows  [B, H, N, C, K]
    dq = dq + (inter_q if G is None else exp(scalar_or_diag(G, kind)) * inter_q)
    inter_k = vc @ dleaving.transpose(-1, -2)  # dS_{n+1} v_j as rows  [B, H, N, C, K]
    if G is None:
        dkh = dkh + inter_k
    else:
        Gb = scalar_or_diag(G, kind)
        dkh = dkh + exp(Gb[..., -1:, :] - Gb) * inter_k
    dk = dkh * beta_c.unsqueeze(-1) if beta_c is not None else dkh
    dbeta = (kc * dkh).sum(-1) if beta_c is not None else None
    dg = None
    if G is not None:
        dG = qc * dq - kc * dk  # [B, H, N, C, K]
        S_next = (a * entering if a is not None else entering) + gated_writes(k_dec, vc)  # S_{n+1}
        d_last = (S_next * dleaving).sum(-1)  # ∂L/∂G_L per channel  [B, H, N, K]
        if kind == "scalar":
            dG, d_last = dG.sum(-1), d_last.sum(-1)  # [B, H, N, C], [B, H, N]
        dg = dG.flip(3).cumsum(3).flip(3) + d_last.unsqueeze(3)
    return dq, dk, dv, dg, dbeta


def chunk_gated_bwd(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                    scale: float | None, initial_state: Tensor | None = None, do: Tensor,
                    dht: Tensor | None = None, chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """The gradients of `chunk_gated(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
    output_final_state=True, chunk_size, cu_seqlens)` for the output gradient `do` [B, T, H, V] and the final
    state's `dht` [B or N, H, K, V] (None: zero), through the stages above (no autograd). Returns a dict:
    q, k, v, g, beta, initial_state (each None where its input is None), in the compute dtype (fp32 or
    float64), token layout; plus the stages' tensors (chunked: entering, dleaving, and dS0)."""
    c = chunk_inputs(q, k, v, beta=beta, g=g, scale=1.0, initial_state=initial_state, chunk_size=chunk_size,
                     cu_seqlens=cu_seqlens)
    layout, qc, kc, vc = c.layout, c.qc, c.kc, c.vc
    scale = c.K ** -0.5 if scale is None else float(scale)
    beta_c = layout.to_chunks(beta.to(c.cdt)) if beta is not None else None
    kh = kc * beta_c.unsqueeze(-1) if beta_c is not None else kc
    G = chunk_cumsum(layout.to_chunks(g.to(c.cdt))) if c.kind != "none" else None
    q_dec, k_dec, a = gated_transitions(qc * scale, kh, G, c.kind)
    entering, _ = pass_states(layout, c.S0, a, gated_writes(k_dec, vc))
    dOc = layout.to_chunks(do.to(c.cdt))
    dS_final = dht.to(c.cdt) if dht is not None else torch.zeros_like(c.S0)
    dleaving, dS0 = reverse_states(layout, dS_final, a, q_dec.transpose(-1, -2) @ dOc)
    dq, dk, dv, dg, dbeta = chunk_grads(qc, kc, vc, beta_c, G, c.kind, entering, dleaving, dOc, scale)
    back = layout.from_chunks
    return {"q": back(dq), "k": back(dk), "v": back(dv), "g": back(dg) if dg is not None else None,
            "beta": back(dbeta) if dbeta is not None else None,
            "initial_state": dS0 if initial_state is not None else None,
            "entering": entering, "dleaving": dleaving, "dS0": dS0}
