"""FLOPs of the chunk form (`chunk_gated`, `chunk_delta`), counted from its matmuls: the floors of
`fastweights bench speed` and the mixer's share of a training step's model FLOPs
(`training.throughput.model_flops_per_token`)."""

from __future__ import annotations

__all__ = ["chunk_flops"]


def chunk_flops(B, T, H, K, V, C=64, delta=True) -> float:
    """Forward FLOPs of the chunk form (2 per multiply-add).

    Per chunk of C tokens: QKᵀ (C²K), intra-chunk output (C²V), state read QS (CKV), state
    update KᵀU (CKV); the delta class adds KKᵀ (C²K), the triangular solve (≈C³/3), W and U
    (C²K + C²V) and the state read W S (CKV)."""
    macs = C * C * K + C * C * V + 2 * C * K * V
    if delta:
        macs += C * C * K + C ** 3 / 3 + C * C * (K + V) + C * K * V
    return 2.0 * macs * (T / C) * B * H
