"""Layers: any recipe as a token mixer (`MemoryMixer`), softmax attention and its variants
(`SoftmaxAttention`), and their parts (short convolution, norms, gates, RoPE)."""

from .conv import ShortConv
from .mixer import (
           PRESETS,
           MemoryMixer,
           MixerConfig,
           MixerError,
           MixerPreset,
           SoftmaxAttention,
           derived_preset,
           preset_for,
           training_form,
)
from .norm import GatedRMSNorm, RMSNorm, l2norm
from .rotary import apply_rope
from .state import MixerState, state_bytes

__all__ = ["MemoryMixer", "SoftmaxAttention", "MixerConfig", "MixerPreset", "MixerState", "MixerError", "PRESETS",
           "preset_for", "derived_preset", "training_form", "ShortConv", "RMSNorm", "GatedRMSNorm", "l2norm",
           "apply_rope", "state_bytes"]
