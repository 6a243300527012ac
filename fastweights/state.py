"""Typed recurrent states.

A plain linear memory (every recipe whose whole state is one matrix: linear attention without
its normalizer, RetNet, Mamba2, GLA, DeltaNet, Gated DeltaNet, Comba, DeltaProduct, KDA) uses a
bare tensor S [B, H, K, V] (fp32), with readout o_t = S_tᵀ(scale·φ(q_t)). Every other recipe
carries one of the dataclasses below; `initial_state` accepts what `output_final_state` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

Tensor = torch.Tensor

__all__ = ["MemoryState", "MesaState", "KVCache", "state_map", "compute_dtype"]


def compute_dtype(x: Tensor | torch.dtype) -> torch.dtype:
    """The precision the torch reference computes and carries states in, for inputs of x's dtype:
    float64 stays float64 (the exact checks), every other floating dtype computes in fp32 (fp32
    accumulation for bf16/fp16 inputs). The one place this rule is written; kernel backends
    choose their own operand precision and keep fp32 states."""
    dtype = x.dtype if isinstance(x, Tensor) else x
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class MemoryState:
    """State of a fast-weight memory trained by an inner optimizer.

    weights:    linear: (S [B, H, K', V],); MLP of depth d: (W_1 [B, H, K', Hd], …, W_d [B, H, Hd, V])
                (K' = feature dimension of φ(k), Hd = hidden width); fp32.
    momentum:   same shapes as weights (momentum/muon optimizers), else None.
    normalizer: z [B, H, K'] = Σ φ(k) (Katharopoulos' normalized linear attention), else None.
    anchor:     the weights the current inner mini-batch started from (minibatch > 1), else None.
    offset:     tokens already consumed inside the current inner mini-batch (0 ≤ offset < b).
    window_k, window_v, window_gamma: the last c − 1 (φ(k), v, γ) of an Omega window of size c,
                [B, c−1, H, K'], [B, c−1, H, V], [B, c−1, H] (zeros, γ = 0, before the sequence).
    """

    weights: tuple[Tensor, ...]
    momentum: tuple[Tensor, ...] | None = None
    normalizer: Tensor | None = None
    anchor: tuple[Tensor, ...] | None = None
    offset: int = 0
    window_k: Tensor | None = None
    window_v: Tensor | None = None
    window_gamma: Tensor | None = None


@dataclass
class MesaState:
    """Mesa's sufficient statistics: H [B, H, K, K] = Σ Γ β k kᵀ and G [B, H, K, V] = Σ Γ β k vᵀ (fp32)."""

    H: Tensor
    G: Tensor


@dataclass
class KVCache:
    """The unbounded memory of softmax attention (and its variants), one entry per past token.

    k: [B, L, H, K] cached keys (PaTH: already transformed by every Householder seen since);
    v: [B, L, H, V] cached values (DeltaFormer: the solved values u);
    c: [B, L, H] fp32 cumulative log-retention at each cached position (FoX, ALiBi, gated PaTH),
       or None without retention. Scores are q_t·k_j·scale + (c_t − c_j).
    """

    k: Tensor
    v: Tensor
    c: Tensor | None = None

    @property
    def length(self) -> int:
        return self.k.shape[1]


def state_map(state, fn):
    """Apply fn to every tensor inside a state: a tensor, a tuple, a state dataclass (nested
    ones included: an LMState of MixerStates of MemoryStates), or None; other values are kept."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return fn(state)
    if isinstance(state, tuple):
        return tuple(state_map(x, fn) for x in state)
    if is_dataclass(state) and not isinstance(state, type):
        return replace(state, **{f.name: state_map(getattr(state, f.name), fn) for f in fields(state)})
    return state


def state_tensors(state) -> list[Tensor]:
    """Every tensor inside a state, in `state_map`'s order (fields in declaration order)."""
    out: list[Tensor] = []
    state_map(state, lambda t: out.append(t) or t)
    return out
