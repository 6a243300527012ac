"""Typed states of the layers: what a mixer carries from one call to the next.

A mixer's state is its memory (what `fastweights.recurrent` carries: a bare S [B, H, K', V], a
MemoryState, a MesaState, or a KVCache for the softmax side) plus the tails of its short
convolutions and the number of tokens already consumed (RoPE positions).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from ..state import KVCache, MemoryState, MesaState

Tensor = torch.Tensor

__all__ = ["MixerState", "state_bytes", "state_tensors"]


@dataclass
class MixerState:
    """The state of one MemoryMixer between calls.

    memory:   S [B, H, K', V] (plain linear memories), MemoryState, MesaState, or KVCache
              (softmax side: grows by one entry per token); fp32 for fast-weight memories.
    conv_q, conv_k, conv_v: the last W − 1 inputs of each short convolution [B, W − 1, C], or None
              where the layer has no convolution there.
    conv_w:   PaTH's convolution tail over its Householder directions, or None.
    position: tokens consumed so far, padding included (the next token's position, for RoPE,
              unless the caller passes per-row positions: `fastweights.layers.segments`).
    kv_doc:   softmax side after a padded block: the document of every cached key [B, L] int64
              (0, or −1 for padding, which no later query sees); None: every cached key is visible.
    """

    memory: Tensor | MemoryState | MesaState | KVCache
    conv_q: Tensor | None = None
    conv_k: Tensor | None = None
    conv_v: Tensor | None = None
    conv_w: Tensor | None = None
    position: int = 0
    kv_doc: Tensor | None = None


def state_tensors(state, prefix: str = "state"):
    """(path, tensor) of every tensor of a state, e.g. ("state.memory.weights[0]", S): its dataclass
    fields and tuples walked in order."""
    if isinstance(state, Tensor):
        yield prefix, state
    elif isinstance(state, tuple):
        for i, y in enumerate(state):
            yield from state_tensors(y, f"{prefix}[{i}]")
    elif is_dataclass(state) and not isinstance(state, type):
        for f in fields(state):
            yield from state_tensors(getattr(state, f.name), f"{prefix}.{f.name}")


def state_bytes(state) -> int:
    """Bytes held by every tensor of a state (each tensor counted once)."""
    seen = {id(x): x.numel() * x.element_size() for _, x in state_tensors(state)}
    return sum(seen.values())
