"""FLOPs of the chunk form (`chunk_gated`, `chunk_delta`), counted from its matmuls: the floors of
`fastweights bench speed` and the mixer's share of a training step's model FLOPs
(`training.throughput.model_flops_per_token`)."""

from __future__ import annotations

__all__ = ["chunk_flops", "muon_flops_per_token", "newton_schulz_flops"]


def chunk_flops(B, T, H, K, V, C=64, delta=True) -> float:
    """Forward FLOPs of the chunk form (2 per multiply-add).

    Per chunk of C tokens: QKᵀ (C²K), intra-chunk output (C²V), state read QS (CKV), state
    update KᵀU (CKV); the delta class adds KKᵀ (C²K), the triangular solve (≈C³/3), W and U
    (C²K + C²V) and the state read W S (CKV)."""
    macs = C * C * K + C * C * V + 2 * C * K * V
    if delta:
        macs += C * C * K + C ** 3 / 3 + C * C * (K + V) + C * K * V
    return 2.0 * macs * (T / C) * B * H


def newton_schulz_flops(r: int, steps: int = 5) -> float:
    """FLOPs of `minibatch._newton_schulz_gram` on one r × r Gram matrix: per step A² (the baddbmm), Q·P (from the
    second step) and Q·A·Q (two products, all steps but the last): (steps + 3·(steps − 1)) r³ multiply-adds, 2 FLOPs
    each (the elementwise terms not counted)."""
    return 2.0 * (steps + 3 * (steps - 1)) * r ** 3


def muon_flops_per_token(rows: int, cols: int, steps: int = 5) -> float:
    """Forward FLOPs of one token's Muon step on one weight matrix of the memory ([rows, cols]; ATLAS's MLP memory
    runs one per layer), as the mini-batch form computes it: the Gram matrix G = X Xᵀ of the momentum (X its
    [r, c] orientation, r = min(rows, cols), c = max), Newton–Schulz on G (`newton_schulz_flops`) and NS(X) = P X;
    2 FLOPs a multiply-add. ATLAS at K 64 (degree-2 features: rows 2145, hidden 256): ≈ 1.13 GFLOP a token and head
    for the first layer — ≈ 74 TFLOP a forward at B 64, T 512, H 2, ≥ 0.07 s at 990 TFLOP/s before any backward."""
    r, c = min(rows, cols), max(rows, cols)
    return 2.0 * r * r * c + newton_schulz_flops(r, steps) + 2.0 * r * r * c
