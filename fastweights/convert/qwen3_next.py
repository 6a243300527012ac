"""transformers' `Qwen3NextGatedDeltaNet` ↔ a gated DeltaNet `MemoryMixer`, both directions, exact.

Qwen3-Next's linear-attention layer (transformers.models.qwen3_next), H_k key heads of dim K,
H value heads of dim V (r = H / H_k value heads per key head), kernel W:

    [q k v z]  = in_proj_qkvz(x)   rows grouped by key head: [H_k, (K, K, r·V, r·V)]
    [b a]      = in_proj_ba(x)     rows grouped by key head: [H_k, (r, r)]
    q, k, v    = SiLU(causal depthwise conv1d_W([q k v]))      (one conv over the three, no bias)
    β = σ(b),  g = −exp(A_log)·softplus(a + dt_bias)           (per value head)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β), scale K^-0.5, value head h reads key head h // r
    y = out_proj(RMSNorm_V(o)·w ⊙ SiLU(z))                       (norm, then gate; eps = rms_norm_eps)

which is fastweights' `gated_deltanet` preset exactly (conv qkv, L2 q/k, Mamba decay, β = σ,
per-head norm then swish gate) with num_heads = H_k, num_v_heads = H, conv_size = W and
norm_eps = rms_norm_eps. The conversion only regroups rows: q_proj/k_proj/v_proj/g_proj from the
key-head groups of in_proj_qkvz, beta.proj/decay.proj from in_proj_ba, the three convs from
conv1d. The conv's activation (config.hidden_act) must be SiLU.
"""

from __future__ import annotations

import torch

from ..layers.mixer import MemoryMixer
from .common import ConversionError, check_mixer, check_run_args, copy_weight, same_dtype, swap_layers

__all__ = ["from_qwen3_next", "to_qwen3_next", "swap_linear_attention"]

_WHAT = "transformers' Qwen3NextGatedDeltaNet"


def _dims(layer) -> tuple[int, int, int, int, int, int]:
    """(d, H_k, H, K, V, W) of a Qwen3NextGatedDeltaNet, checked."""
    if type(layer).__name__ != "Qwen3NextGatedDeltaNet":
        raise ConversionError(f"expected {_WHAT}, got {type(layer).__name__}")
    if str(layer.activation) not in ("silu", "swish"):
        raise ConversionError(f"{_WHAT}: its conv activation (config.hidden_act) is {layer.activation!r}; "
                              "fastweights' short conv applies SiLU")
    if layer.conv1d.bias is not None or layer.in_proj_qkvz.bias is not None or layer.out_proj.bias is not None:
        raise ConversionError(f"{_WHAT}: a bias on conv1d, in_proj_qkvz or out_proj has no counterpart")
    if layer.num_v_heads % layer.num_k_heads:
        raise ConversionError(f"{_WHAT}: num_v_heads={layer.num_v_heads} is not a multiple of "
                              f"num_k_heads={layer.num_k_heads}")
    return (layer.hidden_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
            layer.conv_kernel_size)


def from_qwen3_next(layer, **mixer_kwargs) -> MemoryMixer:
    """A MemoryMixer (zoo model `gated_deltanet`) computing what `layer`, a transformers
    Qwen3NextGatedDeltaNet, computes: y [B, T, d] equal for every x [B, T, d] (no cache, no
    padding mask). The mixer has the layer's dtype and device; `mixer_kwargs` go to MemoryMixer
    (backend=, chunk_size=, form=, layer_ops=: `common.RUN_ARGS`); the wiring is the layer's (any
    other argument raises ConversionError naming it)."""
    check_run_args(_WHAT, mixer_kwargs)
    d, Hk, H, K, V, W = _dims(layer)
    r = H // Hk
    dtype, device = same_dtype(layer), layer.out_proj.weight.device
    mixer = MemoryMixer(d, "gated_deltanet", Hk, head_dim=K, head_v_dim=V, num_v_heads=H, conv_size=W,
                        norm_eps=float(layer.layer_norm_epsilon), **mixer_kwargs).to(device=device, dtype=dtype)
    qkvz = layer.in_proj_qkvz.weight.view(Hk, 2 * K + 2 * r * V, d)  # [H_k, (K, K, rV, rV), d]
    q, k, v, z = qkvz.split([K, K, r * V, r * V], dim=1)
    ba = layer.in_proj_ba.weight.view(Hk, 2 * r, d)  # [H_k, (r, r), d]
    b, a = ba.split([r, r], dim=1)
    copy_weight(mixer.q_proj.weight, q.reshape(Hk * K, d), "in_proj_qkvz (q rows)")
    copy_weight(mixer.k_proj.weight, k.reshape(Hk * K, d), "in_proj_qkvz (k rows)")
    copy_weight(mixer.v_proj.weight, v.reshape(H * V, d), "in_proj_qkvz (v rows)")
    copy_weight(mixer.g_proj.weight, z.reshape(H * V, d), "in_proj_qkvz (z rows)")
    copy_weight(mixer.beta.proj.weight, b.reshape(H, d), "in_proj_ba (b rows)")
    copy_weight(mixer.decay.proj.weight, a.reshape(H, d), "in_proj_ba (a rows)")
    cq, ck, cv = layer.conv1d.weight.split([Hk * K, Hk * K, H * V], dim=0)  # [C, 1, W] each
    copy_weight(mixer.q_conv.conv.weight, cq, "conv1d (q channels)")
    copy_weight(mixer.k_conv.conv.weight, ck, "conv1d (k channels)")
    copy_weight(mixer.v_conv.conv.weight, cv, "conv1d (v channels)")
    copy_weight(mixer.decay.A_log, layer.A_log, "A_log")
    copy_weight(mixer.decay.dt_bias, layer.dt_bias, "dt_bias")
    copy_weight(mixer.o_norm.weight, layer.norm.weight, "norm.weight")
    copy_weight(mixer.o_proj.weight, layer.out_proj.weight, "out_proj.weight")
    return mixer


def to_qwen3_next(mixer: MemoryMixer, layer=None):
    """The Qwen3NextGatedDeltaNet computing what `mixer` (gated DeltaNet with the preset above)
    computes. `layer`: an existing layer to fill (its config must have the mixer's dims), else a
    new one is built from a minimal Qwen3NextConfig (needs transformers) in the mixer's dtype."""
    check_mixer(mixer, "gated_deltanet", _WHAT, conv_size=mixer.preset.conv_size)
    d, Hk, H, K, V = mixer.d_model, mixer.Hq, mixer.H, mixer.K, mixer.V
    W = mixer.preset.conv_size
    if layer is None:
        from transformers.models.qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        cfg = Qwen3NextConfig(hidden_size=d, linear_num_key_heads=Hk, linear_num_value_heads=H,
                              linear_key_head_dim=K, linear_value_head_dim=V, linear_conv_kernel_dim=W,
                              rms_norm_eps=mixer.o_norm.eps, hidden_act="silu", num_hidden_layers=1,
                              layer_types=["linear_attention"])
        w = mixer.o_proj.weight
        layer = Qwen3NextGatedDeltaNet(cfg, 0).to(device=w.device, dtype=w.dtype)
    got = _dims(layer)
    if got != (d, Hk, H, K, V, W):
        raise ConversionError(f"{_WHAT} has (d, H_k, H, K, V, W) = {got}; the mixer's are {(d, Hk, H, K, V, W)}")
    if float(layer.layer_norm_epsilon) != mixer.o_norm.eps:
        raise ConversionError(f"{_WHAT}: rms_norm_eps={layer.layer_norm_epsilon}, the mixer's norm_eps is "
                              f"{mixer.o_norm.eps}")
    r = H // Hk

    def grouped(*mats_rows):  # rows [H_k·n_i, d] each -> [H_k, Σ n_i, d] -> [H_k·Σ n_i, d]
        return torch.cat([m.reshape(Hk, n, d) for m, n in mats_rows], dim=1).reshape(-1, d)

    copy_weight(layer.in_proj_qkvz.weight, grouped((mixer.q_proj.weight, K), (mixer.k_proj.weight, K),
                                                   (mixer.v_proj.weight, r * V), (mixer.g_proj.weight, r * V)),
                "in_proj_qkvz.weight")
    copy_weight(layer.in_proj_ba.weight, grouped((mixer.beta.proj.weight, r), (mixer.decay.proj.weight, r)),
                "in_proj_ba.weight")
    copy_weight(layer.conv1d.weight, torch.cat([mixer.q_conv.conv.weight, mixer.k_conv.conv.weight,
                                                mixer.v_conv.conv.weight]), "conv1d.weight")
    copy_weight(layer.A_log, mixer.decay.A_log, "A_log")
    copy_weight(layer.dt_bias, mixer.decay.dt_bias, "dt_bias")
    copy_weight(layer.norm.weight, mixer.o_norm.weight, "norm.weight")
    copy_weight(layer.out_proj.weight, mixer.o_proj.weight, "out_proj.weight")
    return layer


def swap_linear_attention(model, **mixer_kwargs):
    """transformers' Qwen3-Next model (`Qwen3NextForCausalLM`, ...) with every Qwen3NextGatedDeltaNet
    (`decoder_layer.linear_attn`) replaced, in place, by `AsTransformersLayer(from_qwen3_next(layer))`:
    fastweights' layers keeping transformers' cache and padding, so the model generates as before.
    Its attention, MoE and MLP blocks, norms and embeddings stay transformers'. Returns the model."""
    return swap_layers(model, {"Qwen3NextGatedDeltaNet": from_qwen3_next}, "Qwen3NextGatedDeltaNet", **mixer_kwargs)
