"""Mamba2's mixer ↔ a `mamba2` MemoryMixer, exact: transformers' `Mamba2Mixer` (and fla's
`Mamba2` layer, which has the same weights: `fastweights.convert.fla` uses the state-dict maps here).

Mamba2 (d_inner I = H·P, H heads of dim P, n_groups G, state size N, kernel W):

    [z x B C dt] = in_proj(u)           rows [I, I, G·N, G·N, H]
    x, B, C = SiLU(causal depthwise conv1d_W([x B C]) + bias)
    dt = softplus(dt + dt_bias),  A = −exp(A_log)                          (per head)
    h_t = exp(dt·A) h_{t−1} + dt·x_t B_tᵀ,   y_t = h_t C_t + D·x_t        (head h reads group h // (H/G))
    out = out_proj(RMSNorm_I(y ⊙ SiLU(z))·w)                               (gate, then norm over all I)

is fastweights' `mamba2` recipe (scale 1, β = dt) with its preset (conv qkv with bias, Mamba
decay, out_norm over all heads, gate before norm, D skip): q = C, k = B, v = x, num_heads = G,
head_dim = N, num_v_heads = H, head_v_dim = P. Converted exactly when G = 1 (the norm then spans
all I channels as fastweights' "all" norm does; with G > 1 Mamba2 normalizes each group of I/G
channels with its own weights, which no preset has), the in/out projections have no bias, D is
per head, dt_limit is (0, ∞) and the activation is SiLU; anything else raises ConversionError.

Whole checkpoints come in two layouts that share `model_type: mamba2`, the class name
`Mamba2ForCausalLM` and every weight name (`backbone.embeddings`, `backbone.layers.{i}.{norm, mixer}`,
`backbone.norm_f`, `lm_head`), but not their config fields: fla's (`norm_eps`, `dt_limit`, fla's
defaults) and transformers' own `Mamba2Config` (`layer_norm_epsilon`, `time_step_limit`, transformers'
defaults, e.g. n_groups 8). `mamba2_layout` tells them apart by their fields and `fla_fields` reads
either as fla's names; `MAMBA2_FIELDS` says what becomes of every field of both: carried into the
LMConfig, refused unless it has the one value fastweights computes, or without effect on the
converted model's outputs (initialization, token ids, kernel choices).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layers.mixer import MemoryMixer
from .common import ConversionError, check_mixer, copy_weight, json_float, same_dtype

Tensor = torch.Tensor

__all__ = ["from_mamba2", "to_mamba2", "mixer_state_from_mamba2", "mamba2_state_from_mixer", "Mamba2Dims",
           "MAMBA2_FIELDS", "TRANSFORMERS_MAMBA2_DEFAULTS", "mamba2_layout", "fla_fields", "transformers_config"]

_WHAT = "Mamba2's mixer"


class Mamba2Dims(tuple):
    """(d, H, P, N, W): model width, heads, head dim, state size, conv kernel (G = 1)."""

    def __new__(cls, d: int, H: int, P: int, N: int, W: int):
        return super().__new__(cls, (d, H, P, N, W))


def check_mamba2_options(*, n_groups: int, use_bias: bool, hidden_act: str, dt_limit, what: str = _WHAT,
                         D_has_hdim: bool = False, rmsnorm: bool = True, dt_field: str = "dt_limit") -> None:
    """ConversionError for every Mamba2 option fastweights' mamba2 preset has no counterpart for."""
    if n_groups != 1:
        raise ConversionError(f"{what}: n_groups={n_groups}; its gated RMSNorm then normalizes each of the "
                              f"{n_groups} groups with its own weights, which fastweights' mamba2 preset (one norm "
                              "over all heads) cannot express: only n_groups=1 converts exactly")
    if use_bias:
        raise ConversionError(f"{what}: use_bias=True (in_proj/out_proj biases) has no counterpart")
    if str(hidden_act) not in ("silu", "swish"):
        raise ConversionError(f"{what}: hidden_act={hidden_act!r}; fastweights' conv and gate apply SiLU")
    lo, hi = (float(x) for x in dt_limit)
    if lo != 0.0 or not math.isinf(hi):
        raise ConversionError(f"{what}: {dt_field}={tuple(dt_limit)} clamps dt; fastweights' mamba2 does not clamp "
                              "(only (0, inf) converts)")
    if D_has_hdim:
        raise ConversionError(f"{what}: D_has_hdim=True (D per channel) has no counterpart (D is per head)")
    if not rmsnorm:
        raise ConversionError(f"{what}: rmsnorm=False has no counterpart (fastweights' mamba2 normalizes)")


def mixer_state_from_mamba2(sd: dict[str, Tensor], dims: Mamba2Dims) -> dict[str, Tensor]:
    """A mamba2 MemoryMixer's state dict from a Mamba2 mixer's (keys in_proj.weight, conv1d.weight,
    conv1d.bias, dt_bias, A_log, D, norm.weight, out_proj.weight; G = 1)."""
    d, H, P, N, W = dims
    I = H * P  # noqa: E741 (Mamba2's d_inner)
    need = {"in_proj.weight": (2 * I + 2 * N + H, d), "conv1d.weight": (I + 2 * N, 1, W),
            "conv1d.bias": (I + 2 * N,), "dt_bias": (H,), "A_log": (H,), "D": (H,), "norm.weight": (I,),
            "out_proj.weight": (d, I)}
    for key, shape in need.items():
        if key not in sd:
            raise ConversionError(f"{_WHAT}: weight {key} is missing")
        if tuple(sd[key].shape) != shape:
            raise ConversionError(f"{_WHAT}: {key} has shape {list(sd[key].shape)}, expected {list(shape)}")
    z, x, B, C, dt = sd["in_proj.weight"].split([I, I, N, N, H], dim=0)
    cw = sd["conv1d.weight"].split([I, N, N], dim=0)  # x, B, C channels
    cb = sd["conv1d.bias"].split([I, N, N], dim=0)
    return {"D": sd["D"], "q_proj.weight": C, "k_proj.weight": B, "v_proj.weight": x,
            "q_conv.conv.weight": cw[2], "q_conv.conv.bias": cb[2], "k_conv.conv.weight": cw[1],
            "k_conv.conv.bias": cb[1], "v_conv.conv.weight": cw[0], "v_conv.conv.bias": cb[0],
            "decay.A_log": sd["A_log"], "decay.dt_bias": sd["dt_bias"], "decay.proj.weight": dt,
            "g_proj.weight": z, "o_norm.weight": sd["norm.weight"], "o_proj.weight": sd["out_proj.weight"]}


def mamba2_state_from_mixer(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of `mixer_state_from_mamba2`: a Mamba2 mixer's weights from a mamba2 MemoryMixer's."""
    return {"in_proj.weight": torch.cat([sd["g_proj.weight"], sd["v_proj.weight"], sd["k_proj.weight"],
                                         sd["q_proj.weight"], sd["decay.proj.weight"]]),
            "conv1d.weight": torch.cat([sd["v_conv.conv.weight"], sd["k_conv.conv.weight"], sd["q_conv.conv.weight"]]),
            "conv1d.bias": torch.cat([sd["v_conv.conv.bias"], sd["k_conv.conv.bias"], sd["q_conv.conv.bias"]]),
            "dt_bias": sd["decay.dt_bias"], "A_log": sd["decay.A_log"], "D": sd["D"],
            "norm.weight": sd["o_norm.weight"], "out_proj.weight": sd["o_proj.weight"]}


def mamba2_mixer(dims: Mamba2Dims, *, norm_eps: float, **mixer_kwargs) -> MemoryMixer:
    """The (randomly initialized) mamba2 MemoryMixer with Mamba2's dims (G = 1)."""
    d, H, P, N, W = dims
    return MemoryMixer(d, "mamba2", 1, head_dim=N, head_v_dim=P, num_v_heads=H, conv_size=W, norm_eps=norm_eps,
                       **mixer_kwargs)


def check_mamba2_mixer(mixer: MemoryMixer, what: str = _WHAT) -> Mamba2Dims:
    """The Mamba2 dims of a mamba2 MemoryMixer wired as Mamba2 (ConversionError otherwise)."""
    check_mixer(mixer, "mamba2", what, conv_size=mixer.preset.conv_size)
    if mixer.Hq != 1:
        raise ConversionError(f"{what} converts with n_groups=1 only (one B, C for all heads); this mixer has "
                              f"num_heads={mixer.Hq} q/k heads")
    return Mamba2Dims(mixer.d_model, mixer.H, mixer.V, mixer.K, mixer.preset.conv_size)


def _layer_dims(layer) -> Mamba2Dims:
    if type(layer).__name__ != "Mamba2Mixer":
        raise ConversionError(f"expected transformers' Mamba2Mixer, got {type(layer).__name__}")
    check_mamba2_options(n_groups=layer.n_groups, use_bias=layer.use_bias, hidden_act=layer.activation,
                         dt_limit=layer.time_step_limit, what="transformers' Mamba2Mixer", dt_field="time_step_limit")
    if not layer.use_conv_bias:
        raise ConversionError("transformers' Mamba2Mixer: use_conv_bias=False; fastweights' mamba2 conv has a bias "
                              "(set it to zero to convert the other way)")
    return Mamba2Dims(layer.hidden_size, layer.num_heads, layer.head_dim, layer.ssm_state_size, layer.conv_kernel_size)


def from_mamba2(layer, **mixer_kwargs) -> MemoryMixer:
    """A MemoryMixer (zoo model `mamba2`) computing what `layer`, a transformers Mamba2Mixer,
    computes (no cache, no padding mask); the layer's dtype and device."""
    dims = _layer_dims(layer)
    mixer = mamba2_mixer(dims, norm_eps=float(layer.layer_norm_epsilon), **mixer_kwargs)
    mixer = mixer.to(device=layer.out_proj.weight.device, dtype=same_dtype(layer))
    mixer.load_state_dict(mixer_state_from_mamba2(layer.state_dict(), dims), strict=True)
    return mixer


def to_mamba2(mixer: MemoryMixer, layer=None):
    """The transformers Mamba2Mixer computing what `mixer` (mamba2 wired as above) computes.
    `layer`: an existing layer to fill, else one built from a minimal Mamba2Config."""
    dims = check_mamba2_mixer(mixer, "transformers' Mamba2Mixer")
    d, H, P, N, W = dims
    if layer is None:
        from transformers.models.mamba2 import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

        if (H * P) % d:
            raise ConversionError(f"transformers' Mamba2Config sets d_inner = expand·hidden_size; H·P = {H * P} is "
                                  f"not a multiple of d_model = {d}: pass a Mamba2Mixer built for these dims")
        cfg = Mamba2Config(hidden_size=d, num_heads=H, head_dim=P, state_size=N, expand=H * P // d, n_groups=1,
                           conv_kernel=W, use_conv_bias=True, use_bias=False, hidden_act="silu",
                           layer_norm_epsilon=mixer.o_norm.eps, num_hidden_layers=1)
        w = mixer.o_proj.weight
        layer = Mamba2Mixer(cfg, 0).to(device=w.device, dtype=w.dtype)
    got = _layer_dims(layer)
    if got != dims:
        raise ConversionError(f"transformers' Mamba2Mixer has (d, H, P, N, W) = {tuple(got)}; the mixer's are "
                              f"{tuple(dims)}")
    if float(layer.layer_norm_epsilon) != mixer.o_norm.eps:
        raise ConversionError(f"transformers' Mamba2Mixer: layer_norm_epsilon={layer.layer_norm_epsilon}, the "
                              f"mixer's norm_eps is {mixer.o_norm.eps}")
    for key, val in mamba2_state_from_mixer(mixer.state_dict()).items():
        copy_weight(layer.get_parameter(key), val, key)
    return layer


# ---------------------------------------------------------------- whole checkpoints: fla's and transformers' config
#: transformers' Mamba2Config defaults (5.17 – 5.24) of the fields read here: what a field missing from a
#: transformers config.json means (tests/convert check them against the installed class)
TRANSFORMERS_MAMBA2_DEFAULTS: dict[str, Any] = dict(
    num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128, num_hidden_layers=64,
    layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=8, use_bias=False, use_conv_bias=True,
    hidden_act="silu", residual_in_fp32=True, time_step_limit=(0.0, math.inf), tie_word_embeddings=False)

#: Every config field of fla's Mamba2Config and of transformers' (both names where they differ) and what
#: a conversion does with it:
#:   "carried"   the converted model has the same value (dims, eps, conv bias, head tying, norm order: fla's
#:               norm_before_gate; transformers' Mamba2 always gates first, whatever its config.json says);
#:   "checked"   must agree with the carried fields (num_heads = expand·hidden_size / head_dim);
#:   "refused"   converts only at the one value fastweights computes, else ConversionError naming it
#:               (n_groups 1, no in/out bias, SiLU, dt unclamped (0, ∞), D per head, the gated RMSNorm,
#:               no L2-warp training term);
#:   "no effect" does not change the converted model's outputs: initialization (initializer_range,
#:               rescale_prenorm_residual, the dt / A / conv init ranges), time_step_rank (transformers'
#:               forward never reads it), the chunk of the chunked scan (rounding only), fused-kernel
#:               switches, use_cache, the token ids (transformers' generation_config.json keeps them),
#:               and residual_in_fp32: precision only — transformers and fla keep the residual stream in
#:               fp32; fastweights keeps it in the parameters' dtype (fp32 parameters, or bf16 autocast
#:               over fp32 parameters, as `fastweights train` runs, keep it in fp32 too).
MAMBA2_FIELDS: dict[str, str] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "state_size", "expand",
                     "conv_kernel", "norm_eps", "layer_norm_epsilon", "use_conv_bias", "tie_word_embeddings",
                     "norm_before_gate"), "carried"),
    "num_heads": "checked",
    **dict.fromkeys(("n_groups", "use_bias", "hidden_act", "dt_limit", "time_step_limit", "D_has_hdim", "rmsnorm",
                     "use_l2warp"), "refused"),
    **dict.fromkeys(("residual_in_fp32", "chunk_size", "initializer_range", "rescale_prenorm_residual",
                     "time_step_rank", "time_step_min", "time_step_max", "time_step_floor", "dt_min", "dt_max",
                     "dt_init_floor", "A_init_range", "conv_init", "use_cache", "pad_token_id", "bos_token_id",
                     "eos_token_id", "fuse_norm", "fuse_cross_entropy", "fuse_linear_cross_entropy"), "no effect"),
}

# the fields only one of the two layouts has: what tells them apart
_TRANSFORMERS_ONLY = ("layer_norm_epsilon", "time_step_limit", "time_step_rank", "time_step_min", "time_step_max",
                      "time_step_floor")
# (not norm_before_gate: a transformers config.json may hold one too, which transformers' Mamba2 never reads)
_FLA_ONLY = ("norm_eps", "dt_limit", "rmsnorm", "D_has_hdim", "fuse_norm", "dt_min", "dt_max", "dt_init_floor",
             "A_init_range", "conv_init", "use_l2warp", "fuse_cross_entropy", "fuse_linear_cross_entropy")


def mamba2_layout(config: dict[str, Any]) -> str:
    """"fla" or "transformers": whose Mamba2Config a `model_type: mamba2` config.json is, by its fields
    (ConversionError when it has fields of both, or of neither: then whose defaults apply is unknown)."""
    hf = [k for k in _TRANSFORMERS_ONLY if k in config]
    fl = [k for k in _FLA_ONLY if k in config]
    if hf and fl:
        raise ConversionError(f"mamba2 config.json has fields of fla's Mamba2Config ({', '.join(fl)}) and of "
                              f"transformers' ({', '.join(hf)}): cannot tell whose names and defaults apply")
    if not hf and not fl:
        raise ConversionError("mamba2 config.json has none of fla's Mamba2Config fields (norm_eps, dt_limit, ...) nor "
                              "transformers' (layer_norm_epsilon, time_step_limit, ...): cannot tell whose defaults "
                              "apply (fla's n_groups is 1, transformers' 8)")
    return "transformers" if hf else "fla"


def fla_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers Mamba2Config's config.json as fla's fields (transformers' defaults filled in,
    layer_norm_epsilon -> norm_eps, time_step_limit -> dt_limit), after refusing, by transformers'
    names, what fastweights' mamba2 cannot compute."""
    c = {**TRANSFORMERS_MAMBA2_DEFAULTS, **config}
    limit = [json_float(x, "time_step_limit") for x in c["time_step_limit"]]
    check_mamba2_options(n_groups=c["n_groups"], use_bias=c["use_bias"], hidden_act=c["hidden_act"], dt_limit=limit,
                         what="transformers' Mamba2Config", dt_field="time_step_limit")
    heads = c["expand"] * c["hidden_size"] / c["head_dim"]
    if c["num_heads"] != heads:
        raise ConversionError(f"transformers' Mamba2Config: num_heads={c['num_heads']} but expand·hidden_size / "
                              f"head_dim = {heads:g} heads")
    out = {k: v for k, v in c.items() if k not in ("layer_norm_epsilon", "time_step_limit")}
    out.update(norm_eps=c["layer_norm_epsilon"], dt_limit=limit, D_has_hdim=False, rmsnorm=True,
               norm_before_gate=False)  # transformers' gated norm: gate, then norm, whatever a config.json says
    return out


def transformers_config(c: dict[str, Any]) -> dict[str, Any]:
    """transformers' Mamba2Config fields of the model that fla's mamba2 config `c` (as
    `fastweights.convert.fla.to_fla` writes it: n_groups 1, integer expand) describes;
    ConversionError for what transformers' Mamba2 cannot compute."""
    if c.get("norm_before_gate"):
        raise ConversionError("transformers' Mamba2 gates before its norm; this LM's mamba2 layers normalize before "
                              "the gate (norm_before_gate=True): no transformers Mamba2Config computes it")
    H = round(c["expand"] * c["hidden_size"] / c["head_dim"])
    return dict(architectures=["Mamba2ForCausalLM"], vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                num_hidden_layers=c["num_hidden_layers"], num_heads=H, head_dim=c["head_dim"],
                state_size=c["state_size"], expand=c["expand"], conv_kernel=c["conv_kernel"], n_groups=1,
                use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=c["norm_eps"],
                residual_in_fp32=True, time_step_limit=(0.0, math.inf),
                tie_word_embeddings=c["tie_word_embeddings"], pad_token_id=None, bos_token_id=None, eos_token_id=None)
