"""What every converter shares: the error it raises, the copy of one weight with its shape
checked, and the check that a MemoryMixer is wired the way the peer layer is.

A conversion is exact or it does not happen: a weight of the wrong shape, a preset field the peer
has no counterpart for, or a value the peer cannot hold (a nonzero bias where it has none) raises
ConversionError naming the weight or field, never a silent approximation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..layers.mixer import MemoryMixer, MixerPreset
from ..layers.state import MixerState
from ..state import compute_dtype
from ..zoo import ZOO

Tensor = torch.Tensor

__all__ = ["ConversionError", "FORWARD_FIELDS", "RUN_ARGS", "copy_weight", "check_mixer", "same_dtype",
           "check_run_args", "read_json", "read_weights", "json_float", "AsTransformersLayer", "swap_layers"]


class ConversionError(ValueError):
    """A layer or checkpoint that cannot be converted exactly; the message names what differs."""


def read_json(path) -> dict:
    """The JSON object in the file `path`; ConversionError naming the file when it is missing, not
    JSON, or not an object."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{p}: no such file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{p}: not JSON ({e})") from None
    except OSError as e:
        raise ConversionError(f"{p}: cannot be read ({e.strerror or e})") from None
    if not isinstance(obj, dict):
        raise ConversionError(f"{p}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_weights(path) -> dict[str, Tensor]:
    """{name: tensor} of a .safetensors file or a PyTorch .bin (weights only); ConversionError naming
    the file when it is missing, truncated or corrupt."""
    p = Path(path)
    if not p.is_file():
        raise ConversionError(f"{p}: no such file")
    kind = "safetensors" if p.suffix == ".safetensors" else "PyTorch weights"
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # (SafetensorError, torch.load's unpickling errors, OSError: a damaged file)
        msg = (str(e).strip().splitlines() or [""])[0]
        raise ConversionError(f"{p}: a corrupt or truncated {kind} file ({type(e).__name__}: {msg})") from None
    if not (isinstance(sd, dict) and all(isinstance(v, Tensor) for v in sd.values())):
        raise ConversionError(f"{p}: expected a state dict (tensor names to tensors), got {type(sd).__name__}")
    return sd


#: The MixerPreset fields that change what a layer computes (the others only set initial values
#: or default dims, which a conversion gives explicitly).
FORWARD_FIELDS = ("conv", "conv_size", "conv_bias", "qk_norm", "rope", "rope_period", "decay", "beta",
                  "beta_scale", "beta_bias", "out_norm", "out_gate", "out_gate_low_rank", "norm_before_gate",
                  "d_skip")


#: The MemoryMixer arguments a converter passes through (how the mixer runs, not what it computes);
#: every other one (num_heads, head_dim, conv_size, a preset field, ...) is the peer layer's.
RUN_ARGS = ("form", "chunk_size", "backend", "layer_ops")


def check_run_args(what: str, mixer_kwargs: dict) -> None:
    """ConversionError naming the first argument of `mixer_kwargs` that is not one of RUN_ARGS (the
    conversion takes the wiring from the layer, `what`)."""
    for name in mixer_kwargs:
        if name not in RUN_ARGS:
            raise ConversionError(f"{name}={mixer_kwargs[name]!r}: the converted mixer takes {name} from {what}; "
                                  f"pass only {', '.join(RUN_ARGS)} (how the mixer runs)")


def json_float(x, name: str = "a config field") -> float:
    """A float from config.json: transformers writes ±inf and nan as {"__float__": "Infinity"}; a number
    or that form only (ConversionError naming `name` otherwise: a string such as "1" is not read)."""
    if isinstance(x, dict) and set(x) == {"__float__"} and isinstance(x["__float__"], str):
        try:
            return float(x["__float__"])
        except ValueError:
            pass
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    raise ConversionError(f"{name} holds {x!r}, expected a number")


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
    """A MemoryMixer standing where a transformers model calls its linear-attention layer (Qwen3-Next's
    `linear_attn`, Kimi-Linear's `self_attn` on its KDA layers):
    forward(hidden_states [B, T, d], attention_mask=None, cache=None, **kwargs) -> y [B, T, d].

    The mixer computes (its forward, and its step for one token after a cache: fastweights' functional
    API, routed per call like every LM layer's, so Triton kernels on a GPU); transformers' padding and
    cache are kept as the replaced layer kept them:

    - padding: attention_mask [B, T] (transformers' 2-D mask of its recurrent layers, 0 at padding; None
      where there is none) zeroes the padded positions' inputs, which then run through the layer like
      tokens — transformers' own rule (`apply_mask_to_padding_states`). Left padding is exact: a zero
      input leaves a zero state zero (these layers have no biases before the memory).
    - cache: the layer's state lives in transformers' cache (the argument `cache`, 5.24, or
      `cache_params` / `past_key_values`, 5.17) at `layer_idx`, in the replaced layer's layout:
      conv_states[0] [B, C_q + C_k + C_v, W] the conv inputs of the q, k, v channels (the last W − 1 in
      its last columns; its first column is never read) and recurrent_states[0] [B, H, K, V] the memory
      (fp32). So generate, beam search's reorder, a reset and transformers' own layer read it as theirs.
      transformers' past recording (cropping the cache for assisted decoding, which transformers refuses
      for these models too) and packed sequences (`cu_seq_lens_q`) are refused (ConversionError).
    """

    #: the names transformers' decoder layers hand a layer its cache by: `cache` (5.24), `cache_params`
    #: (5.17–5.23, and Mamba2), `past_key_values` / `past_key_value` (attention layers)
    CACHE_ARGS = ("cache", "cache_params", "past_key_values", "past_key_value")

    def __init__(self, mixer: MemoryMixer, layer_idx: int | None = None):
        super().__init__()
        if mixer.is_softmax or mixer.preset.rope or mixer.q_conv is None or mixer.v_conv is None:
            raise ConversionError("AsTransformersLayer keeps transformers' linear-attention cache: the mixer must be a "
                                  "fast-weight layer with short convs on q, k and v and no RoPE")
        self.mixer = mixer
        self.layer_idx = layer_idx

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        x = hidden_states  # [B, T, d]
        B, T, _ = x.shape
        if kwargs.get("cu_seq_lens_q") is not None:
            raise ConversionError("a fastweights layer swapped into a transformers model does not take packed "
                                  "sequences (cu_seq_lens_q): pass one sequence per row, padded")
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (B, T):
                raise ConversionError(f"attention_mask must be transformers' 2-D padding mask [B, T] = [{B}, {T}] "
                                      f"(0 at padding), got {list(getattr(attention_mask, 'shape', []))}")
            x = x * attention_mask[:, :, None].to(x.dtype)  # padding's inputs zeroed, as transformers does
        cache = next((kwargs[n] for n in self.CACHE_ARGS if kwargs.get(n) is not None), None)
        if cache is None:
            return self.mixer(x)[0]
        state = self._read(cache, x)
        if state is None:  # the first call on this cache: the whole prompt
            y, state = self.mixer(x, output_state=True)
        elif T == 1:  # one decoding step, by the recurrent form (as LM.step)
            y, state = self.mixer.step(x, state)
        else:  # several tokens continuing the cached state
            y, state = self.mixer(x, state)
        self._write(cache, state)
        return y

    def _layer(self, cache):
        if self.layer_idx is None:
            raise ConversionError("this AsTransformersLayer was built without layer_idx: it cannot find its state in "
                                  "transformers' cache (build it with the replaced layer's layer_idx)")
        layer = cache.layers[self.layer_idx]
        if getattr(layer, "record_past", False):
            raise ConversionError("transformers' cache records past states (for cropping: assisted decoding); a "
                                  "fastweights layer swapped into a transformers model does not keep them")
        return layer

    def _read(self, cache, x: Tensor) -> MixerState | None:
        """The mixer's state from transformers' cache layer, or None before its first update."""
        layer = self._layer(cache)
        if not cache.has_previous_state(self.layer_idx):
            return None
        m = self.mixer
        W = m.preset.conv_size
        conv = layer.conv_states[0]  # [B, C, W]
        tails = conv[:, :, conv.shape[-1] - (W - 1):].transpose(1, 2).to(x.dtype)  # [B, W − 1, C]
        tq, tk, tv = tails.split([m.q_conv.channels, m.k_conv.channels, m.v_conv.channels], dim=-1)
        memory = layer.recurrent_states[0].to(compute_dtype(x.dtype))  # [B, H, K, V]
        return MixerState(memory=memory, conv_q=tq.contiguous(), conv_k=tk.contiguous(), conv_v=tv.contiguous())

    def _write(self, cache, state: MixerState) -> None:
        """The mixer's state into transformers' cache layer (its own update methods: lazily created,
        conv inputs shifted in, the memory copied in place)."""
        conv = torch.cat([state.conv_q, state.conv_k, state.conv_v], dim=-1).transpose(1, 2)  # [B, C, W − 1]
        cache.update_conv_state(conv, self.layer_idx, conv_kernel_size=self.mixer.preset.conv_size)
        cache.update_recurrent_state(state.memory, self.layer_idx)


def swap_layers(model, converters: dict[str, Callable[..., MemoryMixer]], what: str, **mixer_kwargs):
    """Replace, in place, every submodule of `model` whose class name is a key of `converters` by
    AsTransformersLayer(converters[name](layer, **mixer_kwargs), layer.layer_idx); ConversionError
    when there is none (`what` names the layers looked for). Returns the model."""
    found = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            convert = converters.get(type(child).__name__)
            if convert is not None:
                setattr(module, name, AsTransformersLayer(convert(child, **mixer_kwargs), child.layer_idx))
                found += 1
    if not found:
        raise ConversionError(f"{type(model).__name__} has no {what} layer to swap")
    return model
