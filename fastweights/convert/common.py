"""What every converter shares: the error it raises, the copy of one weight with its shape
checked, and the check that a MemoryMixer is wired the way the peer layer is.

A conversion is exact or it does not happen: a weight of the wrong shape, a preset field the peer
has no counterpart for, or a value the peer cannot hold (a nonzero bias where it has none) raises
ConversionError naming the weight or field, never a silent approximation.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.mixer import MemoryMixer, MixerPreset
from ..zoo import ZOO

Tensor = torch.Tensor

__all__ = ["ConversionError", "FORWARD_FIELDS", "copy_weight", "check_mixer", "same_dtype", "json_float"]


class ConversionError(ValueError):
    """A layer or checkpoint that cannot be converted exactly; the message names what differs."""


#: The MixerPreset fields that change what a layer computes (the others only set initial values
#: or default dims, which a conversion gives explicitly).
FORWARD_FIELDS = ("conv", "conv_size", "conv_bias", "qk_norm", "rope", "rope_period", "decay", "beta",
                  "beta_scale", "beta_bias", "out_norm", "out_gate", "out_gate_low_rank", "norm_before_gate",
                  "d_skip")


def json_float(x) -> float:
    """A float from config.json: transformers writes ±inf and nan as {"__float__": "Infinity"}."""
    if isinstance(x, dict) and set(x) == {"__float__"}:
        return float(x["__float__"])
    return float(x)


def copy_weight(dst: Tensor, src: Tensor, name: str) -> None:
    """dst ← src (in dst's dtype), after checking the shapes agree; `name` is the weight's name."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ConversionError(f"{name}: shape {list(src.shape)} does not fit {list(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.detach().to(device=dst.device, dtype=dst.dtype))


def check_mixer(mixer: MemoryMixer, model: str, what: str, **preset) -> MixerPreset:
    """`mixer` must be a MemoryMixer running zoo model `model` with the zoo's recipe, its scale,
    and a preset that equals PRESETS[model] with `preset` replaced on every FORWARD_FIELDS field;
    else ConversionError listing the differences. `what` names the peer layer in the message."""
    if not isinstance(mixer, MemoryMixer):
        raise ConversionError(f"{what}: expected a fastweights MemoryMixer, got {type(mixer).__name__}")
    if mixer.recipe != ZOO[model]:
        raise ConversionError(f"{what} computes fastweights' zoo model {model!r}; this mixer runs "
                              f"{mixer.recipe.name!r}{'' if mixer.recipe.name != model else ' (a changed recipe)'}")
    want_scale = ZOO[model].scale if ZOO[model].scale is not None else mixer.K ** -0.5
    if mixer.scale != want_scale:
        raise ConversionError(f"{what} scales q by {want_scale}; this mixer's scale is {mixer.scale}")
    from ..layers.mixer import PRESETS

    want = {f: getattr(PRESETS[model], f) for f in FORWARD_FIELDS}
    want.update(preset)
    have = {f: getattr(mixer.preset, f) for f in FORWARD_FIELDS}
    diff = [f"{f}={have[f]!r} (needs {want[f]!r})" for f in FORWARD_FIELDS if have[f] != want[f]]
    if diff:
        raise ConversionError(f"{what} has no counterpart for this mixer's preset: {', '.join(diff)}")
    return mixer.preset


def same_dtype(module: nn.Module) -> torch.dtype:
    """The one floating dtype of a module's parameters (ConversionError if they mix dtypes)."""
    dts = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dts) != 1:
        raise ConversionError(f"{type(module).__name__}'s parameters mix dtypes {sorted(map(str, dts))}; "
                              "cast the layer to one dtype first")
    return dts.pop()


class AsTransformersLayer(nn.Module):
    """A MemoryMixer standing where a transformers model calls its linear-attention layer:
    forward(hidden_states [B, T, d], attention_mask=None, **kwargs) -> y [B, T, d].

    It runs the whole sequence in the mixer's training form. transformers' recurrent cache is not
    kept (a cache under any of `CACHE_ARGS` raises: call the model with use_cache=False; 5.17 passes
    it as `cache_params`, 5.24 as `cache`), and neither is padding: a mask
    that marks any token as padding raises (an all-ones mask is accepted)."""

    def __init__(self, mixer: MemoryMixer):
        super().__init__()
        self.mixer = mixer

    #: the names transformers' decoder layers hand a layer its cache by: `cache` (5.24), `cache_params`
    #: (5.17–5.23, and Mamba2), `past_key_values` / `past_key_value` (attention layers)
    CACHE_ARGS = ("cache", "cache_params", "past_key_values", "past_key_value")

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        if any(kwargs.get(name) is not None for name in self.CACHE_ARGS):
            raise ConversionError("a fastweights layer swapped into a transformers model does not keep "
                                  "transformers' cache: call the model with use_cache=False")
        if attention_mask is not None and not bool((attention_mask != 0).all()):
            raise ConversionError("a fastweights layer swapped into a transformers model takes no padding: "
                                  "attention_mask must be all ones (or None)")
        return self.mixer(hidden_states)[0]
