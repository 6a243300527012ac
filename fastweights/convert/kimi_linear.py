"""transformers' Kimi-Linear KDA layer (`KimiLinearDeltaAttention`) ↔ a `kda` MemoryMixer, exact.

Kimi-Linear's linear-attention layer (transformers.models.kimi_linear), H heads of dim K
(values too: V = K), kernel W:

    q, k, v = SiLU(causal depthwise conv1d_W([q_proj x, k_proj x, v_proj x]))    (no bias)
    g  = −exp(A_log_h)·softplus(f_b_proj(f_a_proj x) + dt_bias)    [H, K] per token (rank K)
    β  = σ(b_proj x)
    o  = KDA(l2norm(q), l2norm(k), v, g, β), scale K^-0.5
    y  = o_proj(RMSNorm_K(o)·w ⊙ σ(g_b_proj(g_a_proj x)))        (norm, then sigmoid gate)

which is fastweights' `kda` preset (conv qkv, L2 q/k, per-channel Mamba decay of rank V, β = σ,
per-head norm then sigmoid gate through a low-rank g_proj) with head_dim = head_v_dim = K,
conv_size = W and norm_eps = rms_norm_eps. One difference in parameters, not in maths: the
preset's low-rank output gate has a bias on its second Linear (as fla's KDA) and Kimi-Linear's
has none, so a Kimi layer converts with that bias zero, and a mixer converts to Kimi-Linear only
while that bias is zero (else ConversionError).
"""

from __future__ import annotations

import torch

from ..layers.mixer import MemoryMixer
from .common import ConversionError, check_mixer, check_run_args, copy_weight, same_dtype, swap_layers

__all__ = ["from_kimi_linear", "to_kimi_linear", "swap_linear_attention"]

_WHAT = "transformers' KimiLinearDeltaAttention"


def _dims(layer) -> tuple[int, int, int, int]:
    """(d, H, K, W) of a KimiLinearDeltaAttention, checked."""
    if type(layer).__name__ != "KimiLinearDeltaAttention":
        raise ConversionError(f"expected {_WHAT}, got {type(layer).__name__}")
    if str(layer.activation) not in ("silu", "swish"):
        raise ConversionError(f"{_WHAT}: its conv activation (config.hidden_act) is {layer.activation!r}; "
                              "fastweights' short conv applies SiLU")
    if layer.conv1d.bias is not None:
        raise ConversionError(f"{_WHAT}: conv1d has a bias; fastweights' kda preset has none")
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "g_a_proj", "g_b_proj"):
        if getattr(layer, name).bias is not None:
            raise ConversionError(f"{_WHAT}: {name} has a bias; fastweights' kda preset has none there")
    fg = layer.forget_gate
    if fg.f_a_proj.bias is not None or fg.f_b_proj.bias is not None:
        raise ConversionError(f"{_WHAT}: the forget gate's projections have a bias; fastweights' has none")
    return layer.hidden_size, layer.num_heads, layer.head_dim, layer.conv_kernel_size


def from_kimi_linear(layer, **mixer_kwargs) -> MemoryMixer:
    """A MemoryMixer (zoo model `kda`) computing what `layer`, a transformers
    KimiLinearDeltaAttention, computes (no cache, no padding mask); the layer's dtype and device.
    `mixer_kwargs` go to MemoryMixer (backend=, chunk_size=, form=, layer_ops=: `common.RUN_ARGS`;
    any other argument raises ConversionError naming it: the wiring is the layer's)."""
    check_run_args(_WHAT, mixer_kwargs)
    d, H, K, W = _dims(layer)
    dtype, device = same_dtype(layer), layer.o_proj.weight.device
    mixer = MemoryMixer(d, "kda", H, head_dim=K, head_v_dim=K, conv_size=W, norm_eps=float(layer.layer_norm_epsilon),
                        **mixer_kwargs).to(device=device, dtype=dtype)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        copy_weight(getattr(mixer, name).weight, getattr(layer, name).weight, f"{name}.weight")
    cq, ck, cv = layer.conv1d.weight.split([H * K] * 3, dim=0)  # [H·K, 1, W] each
    copy_weight(mixer.q_conv.conv.weight, cq, "conv1d (q channels)")
    copy_weight(mixer.k_conv.conv.weight, ck, "conv1d (k channels)")
    copy_weight(mixer.v_conv.conv.weight, cv, "conv1d (v channels)")
    fg = layer.forget_gate
    copy_weight(mixer.decay.proj[0].weight, fg.f_a_proj.weight, "forget_gate.f_a_proj.weight")
    copy_weight(mixer.decay.proj[1].weight, fg.f_b_proj.weight, "forget_gate.f_b_proj.weight")
    copy_weight(mixer.decay.A_log, fg.A_log.reshape(-1), "forget_gate.A_log")  # [1, 1, H, 1] -> [H]
    copy_weight(mixer.decay.dt_bias, fg.dt_bias, "forget_gate.dt_bias")
    copy_weight(mixer.beta.proj.weight, layer.b_proj.weight, "b_proj.weight")
    copy_weight(mixer.g_proj[0].weight, layer.g_a_proj.weight, "g_a_proj.weight")
    copy_weight(mixer.g_proj[1].weight, layer.g_b_proj.weight, "g_b_proj.weight")
    with torch.no_grad():
        mixer.g_proj[1].bias.zero_()  # Kimi-Linear's output gate has no bias
    copy_weight(mixer.o_norm.weight, layer.o_norm.weight, "o_norm.weight")
    return mixer


def to_kimi_linear(mixer: MemoryMixer, layer=None):
    """The KimiLinearDeltaAttention computing what `mixer` (kda, the preset above, V = K, H value
    heads = H query heads, output-gate bias zero) computes. `layer`: an existing layer to fill,
    else one built from a minimal KimiLinearConfig in the mixer's dtype."""
    check_mixer(mixer, "kda", _WHAT, conv_size=mixer.preset.conv_size)
    d, H, K, V, W = mixer.d_model, mixer.H, mixer.K, mixer.V, mixer.preset.conv_size
    if V != K or mixer.Hq != H:
        raise ConversionError(f"{_WHAT} has V = K and one value head per query head; this mixer has K={K}, "
                              f"V={V}, {mixer.Hq} query and {H} value heads")
    bias = mixer.g_proj[1].bias
    if bool((bias != 0).any()):
        raise ConversionError(f"{_WHAT}'s output gate g_b_proj has no bias; this mixer's g_proj.1.bias is nonzero "
                              f"(max |b| = {bias.abs().max().item():.3g}): no exact conversion")
    if layer is None:
        from transformers.models.kimi_linear import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        cfg = KimiLinearConfig(hidden_size=d, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=W,
                               rms_norm_eps=mixer.o_norm.eps, hidden_act="silu", num_hidden_layers=1,
                               layer_types=["linear_attention"])
        w = mixer.o_proj.weight
        layer = KimiLinearDeltaAttention(cfg, 0).to(device=w.device, dtype=w.dtype)
    got = _dims(layer)
    if got != (d, H, K, W):
        raise ConversionError(f"{_WHAT} has (d, H, K, W) = {got}; the mixer's are {(d, H, K, W)}")
    if float(layer.layer_norm_epsilon) != mixer.o_norm.eps:
        raise ConversionError(f"{_WHAT}: rms_norm_eps={layer.layer_norm_epsilon}, the mixer's norm_eps is "
                              f"{mixer.o_norm.eps}")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        copy_weight(getattr(layer, name).weight, getattr(mixer, name).weight, f"{name}.weight")
    copy_weight(layer.conv1d.weight, torch.cat([mixer.q_conv.conv.weight, mixer.k_conv.conv.weight,
                                                mixer.v_conv.conv.weight]), "conv1d.weight")
    fg = layer.forget_gate
    copy_weight(fg.f_a_proj.weight, mixer.decay.proj[0].weight, "forget_gate.f_a_proj.weight")
    copy_weight(fg.f_b_proj.weight, mixer.decay.proj[1].weight, "forget_gate.f_b_proj.weight")
    copy_weight(fg.A_log, mixer.decay.A_log.view(fg.A_log.shape), "forget_gate.A_log")
    copy_weight(fg.dt_bias, mixer.decay.dt_bias, "forget_gate.dt_bias")
    copy_weight(layer.b_proj.weight, mixer.beta.proj.weight, "b_proj.weight")
    copy_weight(layer.g_a_proj.weight, mixer.g_proj[0].weight, "g_a_proj.weight")
    copy_weight(layer.g_b_proj.weight, mixer.g_proj[1].weight, "g_b_proj.weight")
    copy_weight(layer.o_norm.weight, mixer.o_norm.weight, "o_norm.weight")
    return layer


def swap_linear_attention(model, **mixer_kwargs):
    """transformers' Kimi-Linear model (`KimiLinearForCausalLM`, ...) with every KimiLinearDeltaAttention
    (the `self_attn` of its linear-attention layers) replaced, in place, by
    `AsTransformersLayer(from_kimi_linear(layer))`: fastweights' layers keeping transformers' cache and
    padding. Its MLA attention, MoE and MLP blocks, norms and embeddings stay transformers'. Returns the model."""
    return swap_layers(model, {"KimiLinearDeltaAttention": from_kimi_linear}, "KimiLinearDeltaAttention",
                       **mixer_kwargs)
