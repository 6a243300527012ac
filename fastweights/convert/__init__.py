"""Ways in and out of fastweights.

Layers of transformers' models, both directions, exact (ConversionError where no exact mapping
exists):
    from_qwen3_next / to_qwen3_next     Qwen3NextGatedDeltaNet   ↔ MemoryMixer("gated_deltanet")
    from_kimi_linear / to_kimi_linear   KimiLinearDeltaAttention ↔ MemoryMixer("kda")
    from_mamba2 / to_mamba2             Mamba2Mixer              ↔ MemoryMixer("mamba2")
    swap_linear_attention(model)        a transformers Qwen3-Next or Kimi-Linear model on fastweights'
                                        linear-attention layers, keeping transformers' cache and padding

Checkpoints of flash-linear-attention (fla) models, both directions (`fastweights convert`):
    fla.from_fla / fla.to_fla           (config dict, state dict) ↔ (LMConfig, LM state dict)
    fla.convert_from_fla / fla.convert_to_fla   directories (config.json + safetensors)
transformers is imported only where a transformers layer is built; fla is never imported.
"""

from .common import AsTransformersLayer, ConversionError
from .kimi_linear import from_kimi_linear, to_kimi_linear
from .mamba2 import from_mamba2, to_mamba2
from .qwen3_next import from_qwen3_next, to_qwen3_next
from .swap import swap_linear_attention

__all__ = ["ConversionError", "AsTransformersLayer", "swap_linear_attention", "from_qwen3_next", "to_qwen3_next",
           "from_kimi_linear", "to_kimi_linear", "from_mamba2", "to_mamba2"]
