"""Whole transformers models on fastweights' linear-attention layers: `swap_linear_attention(model)`.

Every linear-attention layer of a transformers Qwen3-Next (`Qwen3NextGatedDeltaNet`) or Kimi-Linear
(`KimiLinearDeltaAttention`) model becomes an `AsTransformersLayer` around the converted MemoryMixer,
keeping transformers' cache and padding: the model generates (greedy, sampling, beam search, left-padded
batches) as it did, its linear-attention layers computed by fastweights (Triton kernels on a GPU). Its
softmax attention, MoE and MLP blocks, norms and embeddings stay transformers' own.
"""

from __future__ import annotations

from .common import swap_layers
from .kimi_linear import from_kimi_linear
from .qwen3_next import from_qwen3_next

__all__ = ["swap_linear_attention"]

_CONVERTERS = {"Qwen3NextGatedDeltaNet": from_qwen3_next, "KimiLinearDeltaAttention": from_kimi_linear}


def swap_linear_attention(model, **mixer_kwargs):
    """`model` (a transformers Qwen3-Next or Kimi-Linear model) with every linear-attention layer replaced,
    in place, by fastweights' (see the module doc); `mixer_kwargs` go to MemoryMixer (backend=, chunk_size=).
    ConversionError when the model has none or one does not convert exactly. Returns the model."""
    return swap_layers(model, _CONVERTERS, " or ".join(_CONVERTERS), **mixer_kwargs)
