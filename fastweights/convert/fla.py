"""flash-linear-attention (fla) checkpoints ↔ fastweights LM checkpoints, both directions, exact.

fla's HF model classes (fla.models: `<Name>ForCausalLM`, `config.json` with `model_type`) store a
model as `model.embeddings`, `model.layers.{i}.{attn_norm, attn, mlp_norm, mlp}`, `model.norm`,
`lm_head` (Mamba2: `backbone.embeddings`, `backbone.layers.{i}.{norm, mixer}`, `backbone.norm_f`,
no MLP); a fastweights LM as `embed`, `blocks.{i}.{norm1, mixer, norm2, mlp}`, `norm`, `lm_head`
(untied heads: LMConfig.tie_word_embeddings=False). The blocks are the same maths (pre-norm
RMSNorm, SwiGLU MLP gate/up/down = w1/w3/w2); each fla token mixer maps to a MemoryMixer:

    fla model_type      fastweights mixer      what must hold (else ConversionError)
    gated_deltanet      gated_deltanet         use_short_conv; no conv bias
    delta_net           deltanet               qk_activation 'silu', qk_norm 'l2', use_short_conv
    gla                 gla                    feature_map None, num_kv_heads = num_heads, clamp_min None,
                                               elementwise_affine, gate_logit_normalizer/low-rank 16
    kda                 kda                    use_short_conv, no safe_gate / lower_bound
    mamba2              mamba2                 n_groups 1, no in/out bias, D per head, dt_limit (0, ∞), rmsnorm
    retnet              retnet                 feature_map None, num_kv_heads = num_heads (RoPE base 10000)
    comba               comba                  use_short_conv
    gated_deltaproduct  deltaproduct (n_h = 2, gated) or a DeltaProduct Recipe for other n_h / no forget gate
    linear_attn         a linear-attention Recipe: feature map 'elu' (elu+1), 'relu' or 'identity', scale
                                               K^-0.5, no normalizer (fla's norm_feature_map divides by
                                               φ(q)·z + 1e-10, fastweights' by + 1e-6: refused), no norm_q/k
    mesa_net            mesanet                lambda_lower_bound 0.25 (fla's chunk kernel solves by ≤ 30
                                               CG steps, fastweights exactly: equal once CG has converged)

and fla's hybrid `attn` layers (config.attn: {layers, num_heads, num_kv_heads, qkv_bias,
window_size, rope_theta}) map to `softmax_attention` layers (no qkv bias, no window, head dim
hidden_size / num_heads). Both model kinds must fit one LMConfig: every layer has the same number
of query heads, and the dims and preset fields LMConfig shares between layers must give each
layer exactly fla's dims and wiring. Every conversion is checked by rebuilding the other side's
layers and comparing them field by field; a weight of the wrong shape or a missing one raises.

transformers' own Mamba2ForCausalLM checkpoints have fla's Mamba2 layout (weights and model_type) with
transformers' config fields: `from_fla` reads those by transformers' names and defaults
(`fastweights.convert.mamba2.mamba2_layout` / `fla_fields`), and `to_transformers` /
`convert_to_transformers` write a Mamba2 LM as a checkpoint of transformers' own class.

fla is never imported: its layouts are written out here (read from fla 0.6.0's source).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..layers.mixer import PRESETS, MemoryMixer, preset_for
from ..models.config import ConfigError, LMConfig
from ..models.lm import LM
from ..recipe import FeatureMap, Memory, Objective, Optimizer, Recipe, Retention
from ..zoo import ZOO, resolve
from .common import FORWARD_FIELDS, ConversionError, json_float, read_json, read_weights
from .mamba2 import (
    TRANSFORMERS_MAMBA2_DEFAULTS,
    Mamba2Dims,
    check_mamba2_options,
    fla_fields,
    mamba2_layout,
    mamba2_state_from_mixer,
    mixer_state_from_mamba2,
    transformers_config,
)

Tensor = torch.Tensor

__all__ = ["FLA_MODEL_TYPES", "from_fla", "to_fla", "convert_from_fla", "convert_to_fla", "read_fla_checkpoint",
           "to_transformers", "convert_to_transformers"]

#: fla model_type -> its ForCausalLM class name
FLA_MODEL_TYPES = {
    "gated_deltanet": "GatedDeltaNetForCausalLM", "delta_net": "DeltaNetForCausalLM", "gla": "GLAForCausalLM",
    "kda": "KDAForCausalLM", "mamba2": "Mamba2ForCausalLM", "retnet": "RetNetForCausalLM",
    "comba": "CombaForCausalLM", "gated_deltaproduct": "GatedDeltaProductForCausalLM",
    "linear_attn": "LinearAttentionForCausalLM", "mesa_net": "MesaNetForCausalLM",
}

# fla's config defaults (fla 0.6.0 configuration_*.py) for every field read here
_COMMON = dict(hidden_ratio=4, intermediate_size=None, hidden_act="swish", norm_eps=1e-6, attn=None,
               tie_word_embeddings=False, fuse_norm=True, attnres_block_size=None, max_position_embeddings=2048)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gated_deltanet": dict(hidden_size=2048, expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False,
                           conv_size=4, head_dim=256, num_heads=6, num_v_heads=None, num_hidden_layers=21,
                           output_gate_activation="swish"),
    "delta_net": dict(hidden_size=2048, expand_k=1.0, expand_v=1.0, use_gate=False, use_short_conv=True,
                      allow_neg_eigval=False, conv_size=4, use_beta=True, num_heads=16, qk_norm="l2",
                      qk_activation="silu", num_hidden_layers=24),
    "gla": dict(hidden_size=2048, expand_k=0.5, expand_v=1.0, num_hidden_layers=24, num_heads=4, num_kv_heads=None,
                feature_map=None, use_short_conv=False, conv_size=4, use_output_gate=True, clamp_min=None,
                elementwise_affine=True),
    "kda": dict(hidden_size=2048, expand_v=1.0, use_short_conv=True, allow_neg_eigval=False, safe_gate=False,
                lower_bound=None, conv_size=4, head_dim=128, num_heads=16, num_v_heads=None, num_hidden_layers=24),
    "mamba2": dict(head_dim=64, hidden_size=2048, state_size=128, num_hidden_layers=48, norm_eps=1e-5, expand=2,
                   conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, D_has_hdim=False, hidden_act="silu",
                   dt_limit=(0.0, math.inf), rmsnorm=True, norm_before_gate=False, residual_in_fp32=True),
    "retnet": dict(hidden_size=2048, expand_k=1.0, expand_v=2.0, hidden_ratio=2, num_hidden_layers=24, num_heads=8,
                   num_kv_heads=None, feature_map=None, use_output_gate=True, elementwise_affine=True),
    "comba": dict(hidden_size=2048, conv_size=4, head_dim=256, num_heads=6, num_v_heads=None, expand_v=2.0,
                  use_output_gate=True, use_short_conv=True, num_hidden_layers=21),
    "gated_deltaproduct": dict(conv_size=4, head_dim=256, num_heads=6, hidden_size=2048, expand_v=2.0,
                               use_output_gate=True, use_short_conv=True, num_hidden_layers=21, use_forget_gate=False,
                               allow_neg_eigval=False, num_householder=1),
    "linear_attn": dict(hidden_size=2048, expand_k=1.0, expand_v=1.0, num_hidden_layers=24, num_heads=4,
                        num_kv_heads=None, feature_map="elementwise_product", norm_q=False, norm_k=False,
                        norm_feature_map=False, elementwise_affine=True),
    "mesa_net": dict(hidden_size=2048, use_output_gate=False, conv_size=4, num_heads=16, head_dim=128,
                     lambda_lower_bound=0.25, num_hidden_layers=24),
}
_MODEL_OF_RECIPE = {"gated_deltanet": "gated_deltanet", "deltanet": "delta_net", "gla": "gla", "kda": "kda",
                    "mamba2": "mamba2", "retnet": "retnet", "comba": "comba", "deltaproduct": "gated_deltaproduct",
                    "mesanet": "mesa_net"}
_FEATURE_MAPS = {"elu": "elu1", "relu": "relu", "identity": "identity"}


def _preset(**kw) -> dict[str, Any]:
    """The FORWARD_FIELDS values of a layer: the defaults below with `kw` replaced."""
    base = dict(conv="qkv", conv_size=4, conv_bias=False, qk_norm="l2", rope=False, rope_period=None, decay="none",
                beta="none", beta_scale=1.0, beta_bias=False, out_norm="head", out_gate="none",
                out_gate_low_rank=False, norm_before_gate=True, d_skip=False)
    unknown = set(kw) - set(base)
    assert not unknown, unknown
    base.update(kw)
    return base


@dataclass
class LayerPlan:
    """What one fla layer is in fastweights' terms: the mixer (zoo name or Recipe), its heads
    (Hq query/key heads, H value heads; Hkv key/value heads on the softmax side), dims K and V,
    the preset's FORWARD_FIELDS values, and the weight names (fla name, fastweights name)."""

    mixer: str | Recipe
    Hq: int
    H: int
    K: int
    V: int
    preset: dict[str, Any]
    names: list[tuple[str, str]] = field(default_factory=list)
    Hkv: int | None = None
    rope_theta: float | None = None

    @property
    def recipe(self) -> Recipe:
        return resolve(self.mixer)


def _need(cond: bool, model: str, msg: str) -> None:
    if not cond:
        raise ConversionError(f"fla {model}: {msg}")


def _int_dim(value: float, model: str, what: str) -> int:
    _need(abs(value - round(value)) < 1e-6 and round(value) > 0, model, f"{what} = {value} is not a positive integer")
    return int(round(value))


def _gate(activation: str, model: str) -> str:
    _need(activation in ("swish", "silu", "sigmoid"), model, f"gate activation {activation!r} has no counterpart")
    return "sigmoid" if activation == "sigmoid" else "swish"


def _conv_names(q=True, k=True, v=True) -> list[tuple[str, str]]:
    return [(f"{c}_conv1d.weight", f"{c}_conv.conv.weight") for c, on in (("q", q), ("k", k), ("v", v)) if on]


_QKVO = [("q_proj.weight", "q_proj.weight"), ("k_proj.weight", "k_proj.weight"), ("v_proj.weight", "v_proj.weight"),
         ("o_proj.weight", "o_proj.weight")]
_MAMBA_GATE = [("a_proj.weight", "decay.proj.weight"), ("A_log", "decay.A_log"), ("dt_bias", "decay.dt_bias")]


# ---------------------------------------------------------------- fla config -> one layer's plan
def _plan_linear(model: str, c: dict[str, Any]) -> LayerPlan:
    """The plan of model `model`'s own token mixer from its config `c` (defaults filled)."""
    d = c["hidden_size"]
    if model in ("gated_deltanet", "kda", "comba", "gated_deltaproduct"):
        _need(c["use_short_conv"], model, "use_short_conv=False (SiLU without a conv) has no counterpart")
        Hq, K = c["num_heads"], c["head_dim"]
        V = _int_dim(K * c["expand_v"], model, "head_dim·expand_v")
        H = c.get("num_v_heads") or Hq
        names = _QKVO + _conv_names() + [("o_norm.weight", "o_norm.weight")]
        if model == "gated_deltanet":
            gate = _gate(c["output_gate_activation"], model) if c["use_gate"] else "none"
            p = _preset(conv_size=c["conv_size"], decay="mamba", beta="sigmoid",
                        beta_scale=2.0 if c["allow_neg_eigval"] else 1.0, out_gate=gate)
            names += _MAMBA_GATE + [("b_proj.weight", "beta.proj.weight")]
            names += [("g_proj.weight", "g_proj.weight")] if c["use_gate"] else []
            return LayerPlan("gated_deltanet", Hq, H, K, V, p, names)
        if model == "kda":
            _need(not c["safe_gate"] and c["lower_bound"] is None, model,
                  "safe_gate / lower_bound (a bounded sigmoid gate) has no counterpart")
            p = _preset(conv_size=c["conv_size"], decay="kda", beta="sigmoid",
                        beta_scale=2.0 if c["allow_neg_eigval"] else 1.0, out_gate="sigmoid", out_gate_low_rank=True)
            names += [("f_proj.0.weight", "decay.proj.0.weight"), ("f_proj.1.weight", "decay.proj.1.weight"),
                      ("A_log", "decay.A_log"), ("dt_bias", "decay.dt_bias"), ("b_proj.weight", "beta.proj.weight"),
                      ("g_proj.0.weight", "g_proj.0.weight"), ("g_proj.1.weight", "g_proj.1.weight"),
                      ("g_proj.1.bias", "g_proj.1.bias")]
            return LayerPlan("kda", Hq, H, K, V, p, names)
        if model == "comba":  # fla's Comba model always builds the inner decay and the output correction
            gate = "sigmoid" if c["use_output_gate"] else "none"
            p = _preset(conv_size=c["conv_size"], decay="mamba", beta="sigmoid", out_gate=gate)
            names += _MAMBA_GATE + [("b_proj.weight", "beta.proj.weight"), ("decay", "probe_decay"),
                                    ("D", "probe_correction")]
            names += [("g_proj.weight", "g_proj.weight")] if c["use_output_gate"] else []
            return LayerPlan("comba", Hq, H, K, V, p, names)
        # gated_deltaproduct: fla's model builds num_v_heads = num_heads
        n, gated = c["num_householder"], c["use_forget_gate"]
        H = Hq
        gate = "swish" if c["use_output_gate"] else "none"
        p = _preset(conv_size=c["conv_size"], decay="mamba" if gated else "none", beta="sigmoid",
                    beta_scale=2.0 if c["allow_neg_eigval"] else 1.0, out_gate=gate)
        names += [("b_proj.weight", "beta.proj.weight")] + (_MAMBA_GATE if gated else [])
        names += [("g_proj.weight", "g_proj.weight")] if c["use_output_gate"] else []
        return LayerPlan(_deltaproduct_recipe(n, gated), Hq, H, K, V, p, names)
    if model == "delta_net":
        _need(c["qk_activation"] == "silu", model, f"qk_activation={c['qk_activation']!r} (only 'silu' converts)")
        _need(c["qk_norm"] == "l2", model, f"qk_norm={c['qk_norm']!r} (only 'l2' converts)")
        _need(c["use_short_conv"], model, "use_short_conv=False (SiLU without a conv) has no counterpart")
        _need(c["use_beta"] or not c["allow_neg_eigval"], model, "allow_neg_eigval without use_beta (β = 2) "
              "has no counterpart")
        Hq = c["num_heads"]
        K = _int_dim(d * c["expand_k"] / Hq, model, "hidden_size·expand_k / num_heads")
        V = _int_dim(d * c["expand_v"] / Hq, model, "hidden_size·expand_v / num_heads")
        p = _preset(conv_size=c["conv_size"], beta="sigmoid" if c["use_beta"] else "none",
                    beta_scale=2.0 if c["allow_neg_eigval"] else 1.0, out_gate="swish" if c["use_gate"] else "none")
        names = _QKVO + _conv_names() + [("o_norm.weight", "o_norm.weight")]
        names += [("b_proj.weight", "beta.proj.weight")] if c["use_beta"] else []
        names += [("g_proj.weight", "g_proj.weight")] if c["use_gate"] else []
        return LayerPlan("deltanet", Hq, Hq, K, V, p, names)
    if model in ("gla", "retnet"):
        _need(c["feature_map"] is None, model, f"feature_map={c['feature_map']!r} has no counterpart")
        _need(c.get("num_kv_heads") in (None, c["num_heads"]), model,
              f"num_kv_heads={c.get('num_kv_heads')} < num_heads (k and v shared by query heads) has no counterpart")
        _need(bool(c["elementwise_affine"]), model, "elementwise_affine=False has no counterpart")
        _need(c["hidden_act"] == "swish", model, f"hidden_act={c['hidden_act']!r} (the output gate) must be 'swish'")
        Hq = c["num_heads"]
        K = _int_dim(round(d * c["expand_k"]) / Hq, model, "hidden_size·expand_k / num_heads")
        V = _int_dim(round(d * c["expand_v"]) / Hq, model, "hidden_size·expand_v / num_heads")
        gated = bool(c["use_output_gate"])
        norm = "g_norm_swish_gate.weight" if (gated and c["fuse_norm"]) else "g_norm.weight"
        names = _QKVO + [(norm, "o_norm.weight")] + ([("g_proj.weight", "g_proj.weight")] if gated else [])
        if model == "retnet":  # fla's RetNet model never builds its short convs
            p = _preset(conv="none", qk_norm="none", rope=True, out_gate="swish" if gated else "none")
            return LayerPlan("retnet", Hq, Hq, K, V, p, names, rope_theta=10000.0)
        _need(c["clamp_min"] is None, model, f"clamp_min={c['clamp_min']} has no counterpart")
        conv = bool(c["use_short_conv"])
        p = _preset(conv="qkv" if conv else "none", conv_size=c["conv_size"], qk_norm="none", decay="gla",
                    out_gate="swish" if gated else "none")
        names += [("gk_proj.0.weight", "decay.proj.0.weight"), ("gk_proj.1.weight", "decay.proj.1.weight"),
                  ("gk_proj.1.bias", "decay.proj.1.bias")] + (_conv_names() if conv else [])
        return LayerPlan("gla", Hq, Hq, K, V, p, names)
    if model == "mamba2":
        check_mamba2_options(n_groups=c["n_groups"], use_bias=c["use_bias"], hidden_act=c["hidden_act"],
                             dt_limit=[json_float(x, "dt_limit") for x in c["dt_limit"]], what="fla mamba2",
                             D_has_hdim=c["D_has_hdim"], rmsnorm=c["rmsnorm"])
        P, N = c["head_dim"], c["state_size"]
        H = _int_dim(c["expand"] * d / P, model, "expand·hidden_size / head_dim")
        _need(c.get("num_heads") in (None, H), model, f"num_heads={c.get('num_heads')} but expand·hidden_size / "
              f"head_dim = {H} heads")
        _need(not c.get("use_l2warp", False), model, "use_l2warp=True (fla's L2-warp training term) has no counterpart")
        p = _preset(conv_size=c["conv_kernel"], conv_bias=True, qk_norm="none", decay="mamba", beta="dt",
                    out_norm="all", out_gate="swish", norm_before_gate=bool(c["norm_before_gate"]), d_skip=True)
        return LayerPlan("mamba2", 1, H, N, P, p, [])  # weights: fastweights.convert.mamba2's maps
    if model == "linear_attn":
        fm = c["feature_map"]
        _need(fm in _FEATURE_MAPS, model, f"feature_map={fm!r} has no counterpart (elu, relu and identity convert; "
              "the learned maps do not)")
        _need(not c["norm_feature_map"], model, "norm_feature_map=True divides by φ(q)·z + 1e-10, fastweights' "
              "normalized linear attention by φ(q)·z + 1e-6: not the same maths")
        _need(not c["norm_q"] and not c["norm_k"], model, "norm_q / norm_k have no counterpart")
        _need(c.get("num_kv_heads") in (None, c["num_heads"]), model, "num_kv_heads < num_heads has no counterpart")
        _need(bool(c["elementwise_affine"]), model, "elementwise_affine=False has no counterpart")
        Hq = c["num_heads"]
        K = _int_dim(round(d * c["expand_k"]) / Hq, model, "hidden_size·expand_k / num_heads")
        V = _int_dim(round(d * c["expand_v"]) / Hq, model, "hidden_size·expand_v / num_heads")
        p = _preset(conv="none", qk_norm="none")
        return LayerPlan(_linear_attention_recipe(_FEATURE_MAPS[fm]), Hq, Hq, K, V, p,
                         _QKVO + [("norm.weight", "o_norm.weight")])
    if model == "mesa_net":
        _need(c["lambda_lower_bound"] == 0.25, model, f"lambda_lower_bound={c['lambda_lower_bound']} (fastweights' "
              "λ = softplus(λ_raw) + 0.25)")
        Hq, K = c["num_heads"], c["head_dim"]
        gated = bool(c["use_output_gate"])
        p = _preset(conv="qk", conv_size=c["conv_size"], decay="logsigmoid", beta="sigmoid", beta_bias=True,
                    out_gate="swish" if gated else "none")
        names = _QKVO + _conv_names(v=False) + [
            ("a_proj.weight", "decay.proj.weight"), ("a_proj.bias", "decay.proj.bias"),
            ("b_proj.weight", "beta.proj.weight"), ("b_proj.bias", "beta.proj.bias"),
            ("o_norm.weight", "o_norm.weight"), ("lambda_params", "lamb_raw")]
        names += [("g_proj.weight", "g_proj.weight")] if gated else []
        return LayerPlan("mesanet", Hq, Hq, K, K, p, names)
    raise ConversionError(f"fla model_type {model!r} is not converted; supported: {', '.join(FLA_MODEL_TYPES)}")


def _deltaproduct_recipe(n: int, gated: bool) -> str | Recipe:
    """The zoo's deltaproduct for n_h = 2 with the forget gate, else the same recipe with n_h steps
    and with (scalar) or without retention."""
    base = ZOO["deltaproduct"]
    if n == 2 and gated:
        return "deltaproduct"
    return dataclasses.replace(base, name=f"deltaproduct_n{n}{'' if gated else '_nogate'}",
                               citation=base.citation + " (fla's gated_deltaproduct layout)",
                               optimizer=Optimizer(kind="gd", householder_steps=n),
                               retention=Retention(kind="scalar") if gated else Retention(kind="none"))


def _linear_attention_recipe(feature_map: str) -> Recipe:
    """fla's LinearAttention: S_t = S_{t−1} + φ(k_t)v_tᵀ, o_t = S_tᵀ(K^-0.5·φ(q_t)), no normalizer."""
    return Recipe(name=f"linear_attention_{feature_map}", citation="fla's LinearAttention (unnormalized)",
                  memory=Memory(kind="linear"), feature_map=FeatureMap(kind=feature_map),
                  objective=Objective(kind="dot"), optimizer=Optimizer(kind="gd"), retention=Retention(kind="none"))


def _plan_attn(spec: dict[str, Any], d: int) -> LayerPlan:
    _need(not spec.get("qkv_bias", False), "attn", "qkv_bias=True has no counterpart (fastweights' attention "
          "projections have no bias)")
    _need(spec.get("window_size") is None, "attn", f"window_size={spec.get('window_size')} (sliding window) has "
          "no counterpart")
    Hq = spec["num_heads"]
    Hkv = spec.get("num_kv_heads") or Hq
    K = _int_dim(d / Hq, "attn", "hidden_size / num_heads")
    p = {f: getattr(PRESETS["softmax_attention"], f) for f in FORWARD_FIELDS}
    return LayerPlan("softmax_attention", Hq, Hq, K, K, p, _QKVO, Hkv=Hkv, rope_theta=float(spec.get("rope_theta",
                                                                                                      10000.0)))


def _filled(c: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, the config with fla's defaults filled in)."""
    if not isinstance(c, dict):
        raise ConversionError(f"an fla config must be a JSON object, got {type(c).__name__}")
    model = c.get("model_type")
    if model not in FLA_MODEL_TYPES:
        raise ConversionError(f"fla model_type {model!r} is not converted; supported: {', '.join(FLA_MODEL_TYPES)}")
    if model == "mamba2" and mamba2_layout(c) == "transformers":  # transformers' own Mamba2: its names and defaults
        _check_field_types("transformers' Mamba2Config", {**TRANSFORMERS_MAMBA2_DEFAULTS, **c},
                           TRANSFORMERS_MAMBA2_DEFAULTS)
        c = fla_fields(c)
    c = {**_COMMON, **_DEFAULTS[model], **c}
    _check_field_types(f"fla {model} config", c, {**_COMMON, **_DEFAULTS[model]})
    return model, c


#: fields fla types Optional although their default is not None
_NULLABLE = frozenset({"hidden_ratio"})


def _check_field_types(what: str, c: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Every field of config `c` with a default holds the JSON type of its default (a bool for a bool, a
    number for a number, a string for a string, a list for a tuple; null only where the default is);
    vocab_size, hidden_size and num_hidden_layers are positive integers. ConversionError naming the field."""
    for key, default in defaults.items():
        v = c[key]
        if default is None or (v is None and key in _NULLABLE):
            continue
        if isinstance(default, bool):
            ok, want = isinstance(v, bool), "true or false"
        elif isinstance(default, (int, float)):
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        elif isinstance(default, str):
            ok, want = isinstance(v, str), "a string"
        else:
            ok, want = isinstance(v, (list, tuple)), "a list"
        if not ok:
            raise ConversionError(f"{what}: {key}={v!r}, expected {want}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConversionError(f"{what}: {key}={v!r}, expected a positive integer"
                                  f"{' (the field is missing)' if key not in c else ''}")


def _layer_plans(model: str, c: dict[str, Any]) -> list[LayerPlan]:
    n, d = c["num_hidden_layers"], c["hidden_size"]
    _need(c.get("attnres_block_size") is None, model, "attnres_block_size (attention residuals) has no counterpart")
    attn = c.get("attn")
    specs = [] if attn is None else ([attn] if isinstance(attn, dict) else list(attn))
    by_layer: dict[int, dict] = {}
    for s in specs:
        layers = s.get("layers") if isinstance(s, dict) else None
        _need(isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
              model, f"attn must be {{'layers': [layer indices], 'num_heads': ..., ...}} (or a list of them), "
              f"got {s!r}")
        heads = s.get("num_heads")
        _need(isinstance(heads, int) and not isinstance(heads, bool) and heads > 0, model,
              f"attn's num_heads={heads!r}, expected a positive integer")
        for i in layers:
            _need(0 <= i < n and i not in by_layer, model, f"attn layer {i} is out of range or given twice")
            by_layer[i] = s
    _need(model != "mamba2" or not by_layer, model, "hybrid attn layers in a Mamba2 model are not converted")
    own = _plan_linear(model, c)
    return [_plan_attn(by_layer[i], d) if i in by_layer else own for i in range(n)]


# ---------------------------------------------------------------- plans -> LMConfig, checked
def _signature(m: MemoryMixer) -> dict[str, Any]:
    """What a built MemoryMixer computes, field by field (for comparing with a plan)."""
    sig = {"recipe": _maths(m.recipe), "Hq": m.Hq, "H": m.H, "K": m.K, "V": m.V, "scale": m.scale,
           **{f: getattr(m.preset, f) for f in FORWARD_FIELDS}}
    if m.is_softmax:
        sig["Hkv"] = m.Hkv
    if m.preset.rope:
        sig["rope_theta"] = m.config.rope_theta
    return sig


def _plan_signature(p: LayerPlan) -> dict[str, Any]:
    r = p.recipe
    sig = {"recipe": _maths(r), "Hq": p.Hq, "H": p.H, "K": p.K, "V": p.V,
           "scale": r.scale if r.scale is not None else p.K ** -0.5, **p.preset}
    if r.is_softmax:
        sig["Hkv"] = p.Hkv
    if p.preset["rope"]:
        sig["rope_theta"] = p.rope_theta
    return sig


def _meta_lm(config: LMConfig) -> LM:
    with torch.device("meta"):
        return LM(config)


def _differences(lm: LM, plans: list[LayerPlan]) -> list[str]:
    out = []
    for i, (block, plan) in enumerate(zip(lm.blocks, plans)):
        got, want = _signature(block.mixer), _plan_signature(plan)
        bad = [f"{k}={got.get(k)!r} (fla: {want[k]!r})" for k in want if got.get(k) != want[k]]
        if bad:
            out.append(f"layer {i}: " + ", ".join(bad))
    return out


def _lm_config(model: str, c: dict[str, Any], plans: list[LayerPlan]) -> LMConfig:
    """The LMConfig whose layers are `plans` exactly (ConversionError when LMConfig cannot say it)."""
    heads = {p.Hq for p in plans}
    _need(len(heads) == 1, model, f"the layers have {sorted(heads)} query heads; LMConfig has one num_heads for "
          "every layer (set the attn layers' num_heads to the model's)")
    linear = [p for p in plans if not p.recipe.is_softmax]
    soft = [p for p in plans if p.recipe.is_softmax]
    kv = {p.Hkv for p in soft}
    _need(len(kv) <= 1, model, f"attn layers with different num_kv_heads {sorted(kv)} do not fit one LMConfig")
    thetas = {p.rope_theta for p in plans if p.preset["rope"]}
    _need(len(thetas) <= 1, model, f"layers with different RoPE bases {sorted(thetas)} (fla's RetNet uses 10000) do "
          "not fit one LMConfig")
    own = linear[0] if linear else None
    overrides: dict[str, Any] = {}
    if own is not None:
        default = preset_for(own.recipe)
        overrides = {f: own.preset[f] for f in FORWARD_FIELDS if getattr(default, f) != own.preset[f]}
    if model == "mamba2":
        mlp, hidden = "none", None
    else:
        _need(c["hidden_act"] == "swish", model, f"hidden_act={c['hidden_act']!r}: the MLP must be SwiGLU ('swish')")
        hidden = c.get("intermediate_size")
        if hidden is None:  # fla's GatedMLP: 2/3·hidden_ratio·d rounded up to a multiple of 256
            ratio = 4 if c["hidden_ratio"] is None else c["hidden_ratio"]  # (fla's GatedMLP: None -> 4)
            hidden = int(c["hidden_size"] * ratio * 2 / 3)
            hidden = 256 * ((hidden + 255) // 256)
        mlp = "swiglu"
    H = own.H if own is not None else None
    base = dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                mixer=tuple(p.mixer for p in plans), num_heads=heads.pop(), mlp=mlp, mlp_hidden=hidden,
                num_v_heads=H if (H is not None and H != own.Hq) else None,
                num_kv_heads=kv.pop() if kv else None, rope_theta=thetas.pop() if thetas else 10000.0,
                norm_eps=float(c["norm_eps"]), mixer_overrides=overrides,
                tie_word_embeddings=bool(c["tie_word_embeddings"]))
    if len(set(base["mixer"])) == 1:
        base["mixer"] = base["mixer"][0]
    K = own.K if own is not None else soft[0].K
    V = own.V if own is not None else soft[0].V
    last = None
    for hd, hv in ((K, None), (None, None), (K, V), (None, V)):
        try:
            cfg = LMConfig(**base, head_dim=hd, head_v_dim=hv)
        except (ConfigError, ValueError) as e:
            last = [str(e)]
            continue
        diff = _differences(_meta_lm(cfg), plans)
        if not diff:
            if cfg.mlp_hidden is not None and dataclasses.replace(cfg, mlp_hidden=None).hidden == cfg.mlp_hidden:
                cfg = dataclasses.replace(cfg, mlp_hidden=None)  # LMConfig's own default width
            return cfg
        last = diff
    raise ConversionError(f"fla {model}: no LMConfig builds these layers exactly (LMConfig shares head dims and "
                          f"preset fields between layers): {'; '.join(last[:3])}")


# ---------------------------------------------------------------- weights
def _block_names(model: str) -> tuple[str, str, str]:
    """(prefix of the model, of layer i's block (format with i), the mixer's name inside a block)."""
    if model == "mamba2":
        return "backbone.", "backbone.layers.{i}.", "mixer"
    return "model.", "model.layers.{i}.", "attn"


def _take(sd: dict[str, Tensor], key: str, used: set[str]) -> Tensor:
    if key not in sd:
        raise ConversionError(f"fla checkpoint: weight {key} is missing")
    used.add(key)
    return sd[key]


def from_fla(config: dict[str, Any], state_dict: dict[str, Tensor]) -> tuple[LMConfig, dict[str, Tensor]]:
    """(LMConfig, LM state dict) of the fastweights LM computing what the fla model (its
    config.json as a dict, its weights) computes. Every fla weight must be used, every LM weight
    filled, every shape equal (ConversionError otherwise)."""
    model, c = _filled(config)
    plans = _layer_plans(model, c)
    cfg = _lm_config(model, c, plans)
    top, blk, mix = _block_names(model)
    used: set[str] = set()
    out: dict[str, Tensor] = {"embed.weight": _take(state_dict, top + "embeddings.weight", used)}
    for i, plan in enumerate(plans):
        b, f = f"blocks.{i}.", blk.format(i=i)
        if model == "mamba2":
            out[b + "norm1.weight"] = _take(state_dict, f + "norm.weight", used)
            layer = {k[len(f + "mixer."):]: v for k, v in state_dict.items() if k.startswith(f + "mixer.")}
            used.update(f + "mixer." + k for k in layer)
            if "conv1d.bias" not in layer and not c["use_conv_bias"]:  # no conv bias: fastweights' is zero
                layer["conv1d.bias"] = layer["conv1d.weight"].new_zeros(layer["conv1d.weight"].shape[0])
            dims = Mamba2Dims(c["hidden_size"], plan.H, plan.V, plan.K, plan.preset["conv_size"])
            out.update({b + "mixer." + k: v for k, v in mixer_state_from_mamba2(layer, dims).items()})
            continue
        out[b + "norm1.weight"] = _take(state_dict, f + "attn_norm.weight", used)
        out[b + "norm2.weight"] = _take(state_dict, f + "mlp_norm.weight", used)
        for fla_name, fw_name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[b + f"mlp.{fw_name}.weight"] = _take(state_dict, f + f"mlp.{fla_name}.weight", used)
        for fla_name, fw_name in plan.names:
            w = _take(state_dict, f + f"{mix}.{fla_name}", used)
            if fla_name == "lambda_params":  # [H·K] -> [H, K]
                w = w.reshape(plan.H, plan.K)
            out[b + "mixer." + fw_name] = w
    out["norm.weight"] = _take(state_dict, top + ("norm_f.weight" if model == "mamba2" else "norm.weight"), used)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _take(state_dict, "lm_head.weight", used)
    elif "lm_head.weight" in state_dict:  # a tied head saved anyway: it must be the embedding
        used.add("lm_head.weight")
        if not torch.equal(state_dict["lm_head.weight"], out["embed.weight"]):
            raise ConversionError("fla checkpoint: tie_word_embeddings=True but lm_head.weight differs from the "
                                  "embedding")
    unused = sorted(set(state_dict) - used)
    if unused:
        raise ConversionError(f"fla checkpoint: weights with no counterpart: {unused[:8]}"
                              f"{'…' if len(unused) > 8 else ''}")
    _check_shapes(_meta_lm(cfg), out)
    return cfg, out


def _check_shapes(lm: LM, sd: dict[str, Tensor]) -> None:
    want = lm.state_dict()
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        raise ConversionError(f"converted weights do not fit the LM: missing {missing[:8]}, unexpected {extra[:8]}")
    for k, v in want.items():
        if tuple(v.shape) != tuple(sd[k].shape):
            raise ConversionError(f"{k}: the converted weight has shape {list(sd[k].shape)}, the LM the config "
                                  f"describes {list(v.shape)} (do the config's dims match the weights?)")
        if not sd[k].is_floating_point():
            raise ConversionError(f"{k}: the converted weight is {sd[k].dtype}, expected a floating dtype")


# ---------------------------------------------------------------- fastweights -> fla
def _fla_fields(model: str, m: MemoryMixer) -> dict[str, Any]:
    """fla's config fields for layers like `m` (checked afterwards by planning them back)."""
    p, d = m.preset, m.d_model
    neg = {"allow_neg_eigval": p.beta_scale == 2.0}
    if model in ("gated_deltanet", "kda", "comba", "gated_deltaproduct"):
        out = dict(num_heads=m.Hq, head_dim=m.K, expand_v=m.V / m.K, conv_size=p.conv_size, use_short_conv=True)
        if model == "gated_deltanet":
            out.update(num_v_heads=m.H, use_gate=p.out_gate != "none",
                       output_gate_activation=p.out_gate if p.out_gate != "none" else "swish", **neg)
        elif model == "kda":
            out.update(num_v_heads=m.H, **neg)
        elif model == "comba":
            out.update(num_v_heads=m.H, use_output_gate=p.out_gate != "none")
        else:
            out.update(use_output_gate=p.out_gate != "none", use_forget_gate=p.decay != "none",
                       num_householder=m.n, **neg)
        return out
    if model == "delta_net":
        return dict(num_heads=m.Hq, expand_k=m.Hq * m.K / d, expand_v=m.Hq * m.V / d, conv_size=p.conv_size,
                    use_beta=p.beta != "none", use_gate=p.out_gate != "none", **neg)
    if model in ("gla", "retnet"):
        out = dict(num_heads=m.Hq, expand_k=m.Hq * m.K / d, expand_v=m.Hq * m.V / d,
                   use_output_gate=p.out_gate != "none")
        if model == "gla":
            out.update(use_short_conv=p.conv != "none", conv_size=p.conv_size)
        return out
    if model == "mamba2":
        if m.Hq != 1:
            raise ConversionError(f"fla mamba2 converts with n_groups=1 (one B, C shared by all heads: num_heads=1); "
                                  f"this LM's mamba2 layers have num_heads={m.Hq}")
        return dict(head_dim=m.V, state_size=m.K, expand=m.H * m.V / d, n_groups=1, conv_kernel=p.conv_size,
                    norm_before_gate=p.norm_before_gate)
    if model == "linear_attn":
        fm = {v: k for k, v in _FEATURE_MAPS.items()}[m.recipe.feature_map.kind]
        return dict(num_heads=m.Hq, expand_k=m.Hq * m.K / d, expand_v=m.Hq * m.V / d, feature_map=fm)
    if model == "mesa_net":
        return dict(num_heads=m.Hq, head_dim=m.K, conv_size=p.conv_size, use_output_gate=p.out_gate != "none")
    raise AssertionError(model)  # pragma: no cover


def _maths(r: Recipe) -> tuple:
    """A recipe's axes and scale: what it computes, whatever its name and citation."""
    return (r.memory, r.feature_map, r.objective, r.optimizer, r.retention, r.scale)


def _model_of(m: MemoryMixer) -> str:
    """The fla model_type whose token mixer computes m's recipe."""
    r = m.recipe
    for name, model in _MODEL_OF_RECIPE.items():
        if _maths(ZOO[name]) == _maths(r):
            return model
    if r.retention.kind in ("scalar", "none"):
        dp = resolve(_deltaproduct_recipe(r.optimizer.householder_steps, r.retention.kind == "scalar"))
        if _maths(dp) == _maths(r):
            return "gated_deltaproduct"
    if r.feature_map.kind in _FEATURE_MAPS.values():
        if _maths(_linear_attention_recipe(r.feature_map.kind)) == _maths(r):
            return "linear_attn"
    raise ConversionError(f"layer mixer {r.name!r} has no fla model (fla's: {', '.join(sorted(_MODEL_OF_RECIPE))}, "
                          "DeltaProduct with any n_h, unnormalized linear attention with elu+1, relu or identity "
                          "features)")


def to_fla(config: LMConfig, state_dict: dict[str, Tensor], *, fuse_norm: bool = True
           ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(fla config dict, fla state dict) of the fla model computing what the fastweights LM
    (config, weights) computes; ConversionError when fla has no such model. fuse_norm: fla's
    config flag (its fused norm kernels; GLA and RetNet name their output norm after it)."""
    lm = _meta_lm(config)
    mixers = [b.mixer for b in lm.blocks]
    linear = [i for i, m in enumerate(mixers) if not m.is_softmax]
    if not linear:
        raise ConversionError("every layer is softmax attention: fla's converted models have a linear-attention "
                              "layer type (fla's transformer model is not converted)")
    model = _model_of(mixers[linear[0]])
    for i in linear[1:]:
        if _signature(mixers[i]) != _signature(mixers[linear[0]]):
            raise ConversionError(f"layers {linear[0]} and {i} are different linear-attention layers; an fla model "
                                  "has one kind (plus softmax attn layers)")
    soft = [i for i, m in enumerate(mixers) if m.is_softmax]
    if soft and any(mixers[i].recipe != ZOO["softmax_attention"] for i in soft):
        raise ConversionError("fla's hybrid attn layers are plain softmax attention; this model has "
                              f"{sorted({mixers[i].recipe.name for i in soft})}")
    if (config.mlp == "none") != (model == "mamba2"):
        raise ConversionError(f"fla {model} blocks {'have no' if model == 'mamba2' else 'have a SwiGLU'} MLP; this "
                              f"LM's mlp is {config.mlp!r}")
    c: dict[str, Any] = {"model_type": model, "architectures": [FLA_MODEL_TYPES[model]],
                         "vocab_size": config.vocab_size, "hidden_size": config.d_model,
                         "num_hidden_layers": config.n_layers, "norm_eps": config.norm_eps,
                         "tie_word_embeddings": config.tie_word_embeddings}
    c.update(_fla_fields(model, mixers[linear[0]]))
    if model == "mamba2":
        c.update(hidden_act="silu", residual_in_fp32=True, use_conv_bias=True, use_bias=False)
    else:
        c.update(hidden_act="swish", intermediate_size=config.hidden, fuse_norm=fuse_norm)
    if soft:
        m = mixers[soft[0]]
        c["attn"] = {"layers": soft, "num_heads": m.Hq, "num_kv_heads": m.Hkv, "qkv_bias": False,
                     "window_size": None, "rope_theta": m.config.rope_theta}
    for key in ("expand_v", "expand_k", "expand"):
        if key in c and float(c[key]).is_integer():
            c[key] = int(c[key]) if key == "expand" else float(c[key])
    if model == "mamba2" and not isinstance(c["expand"], int):
        inner = mixers[linear[0]].H * mixers[linear[0]].V
        raise ConversionError(f"fla mamba2 sets d_inner = expand·hidden_size with an integer expand; H·P = {inner} "
                              f"is not a multiple of d_model={config.d_model}")
    # the check: fla's layers, planned back, are this LM's layers field by field
    plans = _layer_plans(*_filled(c))
    diff = _differences(lm, plans)
    if diff:
        raise ConversionError(f"fla {model} has no exact counterpart: {'; '.join(diff[:3])}")
    _check_shapes(lm, state_dict)
    top, blk, mix = _block_names(model)
    out: dict[str, Tensor] = {top + "embeddings.weight": state_dict["embed.weight"]}
    for i, plan in enumerate(plans):
        b, f = f"blocks.{i}.", blk.format(i=i)
        layer = {k[len(b + "mixer."):]: v for k, v in state_dict.items() if k.startswith(b + "mixer.")}
        if model == "mamba2":
            out[f + "norm.weight"] = state_dict[b + "norm1.weight"]
            out.update({f + "mixer." + k: v for k, v in mamba2_state_from_mixer(layer).items()})
            continue
        out[f + "attn_norm.weight"] = state_dict[b + "norm1.weight"]
        out[f + "mlp_norm.weight"] = state_dict[b + "norm2.weight"]
        for fla_name, fw_name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f + f"mlp.{fla_name}.weight"] = state_dict[b + f"mlp.{fw_name}.weight"]
        for fla_name, fw_name in plan.names:
            w = layer.pop(fw_name)
            out[f + f"{mix}.{fla_name}"] = w.reshape(-1) if fla_name == "lambda_params" else w
        if layer:
            raise ConversionError(f"layer {i}: weights with no fla counterpart: {sorted(layer)}")
    out[top + ("norm_f.weight" if model == "mamba2" else "norm.weight")] = state_dict["norm.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state_dict["lm_head.weight"]
    return c, out


# ---------------------------------------------------------------- directories
def read_fla_checkpoint(directory) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config dict, state dict) of an fla (HF) checkpoint directory: config.json and
    model.safetensors, sharded safetensors (model.safetensors.index.json) or pytorch_model.bin.
    A missing, damaged or inconsistent file raises ConversionError naming it."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise ConversionError(f"{d}: no config.json (an fla checkpoint is a save_pretrained directory)")
    config = read_json(d / "config.json")
    try:
        _layer_plans(*_filled(config))  # model_type, the fields' types, the layers: named with the file
    except ConversionError as e:
        raise ConversionError(f"{d / 'config.json'}: {e}") from None
    if (d / "model.safetensors").is_file():
        sd = read_weights(d / "model.safetensors")
    elif (d / "model.safetensors.index.json").is_file():
        index_path = d / "model.safetensors.index.json"
        weight_map = read_json(index_path).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ConversionError(f"{index_path}: no 'weight_map' (expected {{tensor name: shard file}})")
        sd = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).is_absolute() or Path(shard).name != shard:  # a shard is a file of the checkpoint itself
                raise ConversionError(f"{index_path}: names the shard {shard!r}, which is not a file name in {d} "
                                      "(a shard lies beside the index)")
            if not (d / shard).is_file():
                raise ConversionError(f"{index_path}: names the shard {shard}, which is not in {d}")
            sd.update(read_weights(d / shard))
    elif (d / "pytorch_model.bin").is_file():
        sd = read_weights(d / "pytorch_model.bin")
    else:
        raise ConversionError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
    return config, sd


def checkpoint_kind(config: dict[str, Any]) -> str:
    """"transformers Mamba2" for a config.json of transformers' own Mamba2Config, else "fla"."""
    if config.get("model_type") == "mamba2" and mamba2_layout(config) == "transformers":
        return "transformers Mamba2"
    return "fla"


def convert_from_fla(src, dst) -> LMConfig:
    """Read the fla checkpoint directory `src` (or one of transformers' own Mamba2ForCausalLM: the same
    layout), write the fastweights checkpoint `dst` (`LM.from_pretrained` and transformers'
    AutoModelForCausalLM load it). Returns its LMConfig."""
    config, sd = read_fla_checkpoint(src)
    cfg, weights = from_fla(config, sd)
    lm = _meta_lm(cfg)
    lm.load_state_dict(weights, strict=True, assign=True)
    lm.save_pretrained(dst)  # records each layer's requested backend ("auto"): the loading machine picks
    return cfg


def convert_to_fla(src, dst) -> dict[str, Any]:
    """Read the fastweights checkpoint `src` (LM.save_pretrained), write an fla checkpoint directory
    `dst` (config.json + model.safetensors) that fla's AutoModelForCausalLM loads. Returns the config."""
    from safetensors.torch import save_file

    lm = LM.from_pretrained(src)
    c, sd = to_fla(lm.config, lm.state_dict())
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(sd.values())).dtype
    c["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(c, indent=2), encoding="utf-8")
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return c


# ---------------------------------------------------------------- transformers' own Mamba2 (fla's weight layout)
def to_transformers(config: LMConfig, state_dict: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(transformers Mamba2Config fields, state dict) of the transformers `Mamba2ForCausalLM` computing what
    the fastweights LM computes: an LM of mamba2 layers that `to_fla` converts (n_groups 1, no MLP) and
    whose gated norm gates first (transformers' Mamba2 has no norm_before_gate). transformers' weight
    names are fla's; its other models have no fastweights counterpart here (ConversionError)."""
    c, sd = to_fla(config, state_dict)
    if c["model_type"] != "mamba2":
        raise ConversionError(f"transformers' own classes are written for Mamba2 LMs only (Mamba2ForCausalLM); this "
                              f"LM is fla's {c['model_type']}: convert it with to-fla (fla's classes)")
    return transformers_config(c), sd


def convert_to_transformers(src, dst) -> dict[str, Any]:
    """Read the fastweights checkpoint `src`, write a checkpoint directory `dst` that transformers'
    own `Mamba2ForCausalLM.from_pretrained` (and AutoModelForCausalLM) loads, no fastweights or fla
    needed. Returns its Mamba2Config fields."""
    from safetensors.torch import save_file
    from transformers import Mamba2Config

    lm = LM.from_pretrained(src)
    fields, sd = to_transformers(lm.config, lm.state_dict())
    try:
        cfg = Mamba2Config(**fields)  # transformers' own validation
    except (TypeError, ValueError) as e:
        raise ConversionError(f"transformers' Mamba2Config refused the converted fields: {e}") from None
    cfg.dtype = next(iter(sd.values())).dtype
    out = Path(dst)
    cfg.save_pretrained(out)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return fields
