"""Chunkwise-parallel training form of the gated-linear class (linear attention, RetNet, Mamba2, GLA).

Recurrence, per (batch, head), state S [K, V], readout o_t = S_tᵀ(scale·q_t):

    S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ

with log-retention g_t ≤ 0 either a scalar (RetNet, Mamba2) or a vector in R^K acting on the
key side (GLA), β_t = 1 unless given.

Chunks of C tokens. Inside chunk n, with chunk-local cumulative log-gates G_i = Σ_{s ≤ i} g_s
(s counted from the chunk's first token) and S_n the state entering the chunk:

    o_i     = (scale·q_i ⊙ e^{G_i})ᵀ S_n  +  Σ_{j ≤ i} [Σ_d scale·q_id β_j k_jd e^{G_id − G_jd}] v_j
    S_{n+1} = Diag(e^{G_C}) S_n  +  Σ_j (β_j k_j ⊙ e^{G_C − G_j}) v_jᵀ

Everything is a batched matmul over all chunks at once except S_n → S_{n+1}, an elementwise
scan over N = T/C chunks; the cost is linear in T.

Stages (chunkwise/common.py holds the shared ones):

    chunk_inputs → chunk_cumsum → decayed_scores (A = QKᵀ ⊙ decay) → gated_transitions
    (Q̃ = Q ⊙ e^{G}, K̃ = βK ⊙ e^{G_C − G}, a = e^{G_C}) → gated_writes (B_n = K̃ᵀV)
    → pass_states (S_{n+1} = a ⊙ S_n + B_n) → chunk_outputs (o = A V + Q̃ S_n)

Precision: every input is cast to fp32 (float64 stays float64) before any arithmetic; the
state is carried in that precision; o is returned in v's dtype. The exponent G_i − G_j is a
difference of two cumsums, so its absolute rounding error is about eps·|G| ≤ eps·C·max|g|:
negligible unless a chunk mixes very strong decay (|G| in the hundreds) with weak, nonzero
decay after it (then ~1e-5 relative in fp32; exact zeros g = 0 stay exact).
"""

from __future__ import annotations

import torch

from .common import chunk_cumsum, chunk_inputs, chunk_outputs, decayed_scores, exp, pass_states, scalar_or_diag

Tensor = torch.Tensor

__all__ = ["chunk_gated", "gated_transitions", "gated_writes"]


def gated_transitions(qc: Tensor, kc: Tensor, G: Tensor | None, kind: str):
    """Stage 3 (gated-linear class): the decayed rows and the chunk's own transition.

    qc, kc: [B, H, N, C, K] (kc already multiplied by β); G: chunk-local cumsum [B, H, N, C(, K)]
    or None. Returns (Q̃ = q_i ⊙ e^{G_i}, K̃ = k_j ⊙ e^{G_C − G_j}, both [B, H, N, C, K]; a = e^{G_C}
    on the key side [B, H, N, 1 or K, 1], or None without decay)."""
    if G is None:
        return qc, kc, None
    Gb = scalar_or_diag(G, kind)  # [B, H, N, C, 1 or K]
    G_last = Gb[:, :, :, -1:]  # [B, H, N, 1, 1 or K]
    q_dec = qc * exp(Gb)  # exponent ≤ 0
    k_dec = kc * exp(G_last - Gb)  # exponent ≤ 0
    return q_dec, k_dec, exp(G_last).transpose(-1, -2)  # [B, H, N, 1 or K, 1]


def gated_writes(k_dec: Tensor, vc: Tensor) -> Tensor:
    """Stage 3b: what chunk n writes into the state, B_n = Σ_j k̃_j v_jᵀ = K̃ᵀV  [B, H, N, K, V]."""
    return k_dec.transpose(-1, -2) @ vc


# ---------------------------------------------------------------------------- the gated-linear class
def chunk_gated(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                scale: float | None, initial_state: Tensor | None = None, output_final_state: bool = False,
                chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """Chunkwise gated linear attention: S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ(scale·q_t).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (one floating dtype: fp32, bf16, fp16 or float64).
        g: log-retention ≤ 0, None (no decay), [B, T, H] (scalar: RetNet, Mamba2) or
            [B, T, H, K] (diagonal on the key side of S: GLA).
        beta: [B, T, H] write strength (default 1).
        scale: query multiplier (None: K^-0.5).
        initial_state: S_0 [B, H, K, V] (with cu_seqlens: [N, H, K, V], one row per sequence).
        output_final_state: also return S_T.
        chunk_size: tokens per chunk C (any positive int; 16, 32, 64 usual). T needs not be a multiple.
        cu_seqlens: int [N+1] with B = 1: N packed sequences (flash-attention convention).
    Returns:
        o [B, T, H, V] in v's dtype; final state [B (or N), H, K, V] in fp32 (float64 for float64
        inputs) when output_final_state, else None.
    """
    c = chunk_inputs(q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     cu_seqlens=cu_seqlens)
    layout, qc, kc, vc = c.layout, c.qc, c.kc, c.vc
    if beta is not None:
        kc = kc * layout.to_chunks(beta.to(c.cdt)).unsqueeze(-1)  # β_j k_j  [B, H, N, C, K]
    G = chunk_cumsum(layout.to_chunks(g.to(c.cdt))) if c.kind != "none" else None  # [B, H, N, C(, K)]
    A = decayed_scores(qc, kc, G, G, strict=False)  # [B, H, N, C, C]
    q_dec, k_dec, a = gated_transitions(qc, kc, G, c.kind)
    entering, final = pass_states(layout, c.S0, a, gated_writes(k_dec, vc))  # [B, H, N, K, V], [B, H, K, V]
    o = chunk_outputs(layout, A @ vc, q_dec, entering, v.dtype)  # [B, T, H, V]
    return o, (final if output_final_state else None)
