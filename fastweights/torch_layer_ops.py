"""The layer ops in plain PyTorch: the torch rows of the "layer" class of the dispatch table
(registered by `fastweights.registry`), any device and dtype; the Triton rows
(`kernels.rows`) take the same arguments and compute the same maths in fewer passes.

    conv      short_conv(x, weight, bias, tail, positions, activation) -> (y, new tail)
              y_t = act(Σ_{i<W} w_{c,i} x_{t−W+1+i, c} + b_c) per channel over the carried tail
              and x (`layers.conv.ShortConv`)
    norm      gated_rms_norm(o, z, weight, *, group_size, eps, activation, norm_before_gate) -> y
              RMSNorm over groups of `group_size` channels, optionally gated by act(z)
              (`layers.norm.GatedRMSNorm`, and `RMSNorm`: no gate, one group)
    prologue  delta_prologue(q, k, b, a, A_log, dt_bias, *, gate, beta_max, eps) -> (q̂, k̂, β, g)
              the delta layer's L2 norm of q and k, β = β_max·σ(b) and the Mamba/KDA gate
              g = −exp(A_log)·softplus(a + dt_bias) (`layers.mixer.MemoryMixer`)
    rope      rope(x, start, *, base, period, positions) -> y
              the rotary embedding of q and k, rotate-half layout (`layers.rotary`: the maths)

Precision: the statistics and gates in fp32 (fp64 for fp64 inputs), the results cast back to
the input's dtype as each docstring says — the layers' results on the CPU are these, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .inputs import GATE_ACTIVATIONS
from .state import compute_dtype

Tensor = torch.Tensor

__all__ = ["short_conv", "gated_rms_norm", "delta_prologue", "rope", "rope_frequencies", "l2norm", "rms",
           "gate_activation", "GATES"]

#: The gate activations of the gated norm.
GATES = GATE_ACTIVATIONS  # (named in fastweights.inputs, which the dispatch layer below this one may import)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σ x² + eps) along the last dimension, computed in fp32 (or fp64), cast back."""
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean x² + eps) along the last dimension, in fp32 (or fp64); not cast back."""
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def gate_activation(name: str, z: Tensor) -> Tensor:
    """swish z·σ(z), sigmoid σ(z) or gelu_tanh."""
    if name == "swish":
        return F.silu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    raise ValueError(f"gate activation must be one of {list(GATES)}, got {name!r}")


def short_conv(x: Tensor, weight: Tensor, bias: Tensor | None = None, tail: Tensor | None = None,
               positions: Tensor | None = None, activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """(y [B, T, C], new tail [B, W − 1, C], both in x's dtype): the causal depthwise conv.

    x [B, T, C]; weight [C, 1, W] (nn.Conv1d's depthwise weight); bias [C] or None; tail
    [B, W − 1, C] or None (zeros); positions [B, T] int (each token's position inside its
    document: the tap reaching i steps back is used only when i ≤ p_t) or None; activation
    "silu" or None. Computed in x's dtype (weight and bias cast to it)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if tail is None:
        tail = torch.zeros(B, W - 1, C, dtype=x.dtype, device=x.device)
    xp = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W − 1 + T, C]
    w = weight.reshape(C, W).to(x.dtype)  # [C, W]
    # W shifted multiply-adds (F.conv1d's CPU path is slow for these tiny depthwise shapes)
    if positions is None:
        y = xp[:, 0:T] * w[:, 0]
        for i in range(1, W):
            y = y + xp[:, i:i + T] * w[:, i]  # [B, T, C]
    else:  # tap i reaches W − 1 − i steps back: only within the token's document
        y = xp[:, W - 1:W - 1 + T] * w[:, W - 1]
        for i in range(W - 1):
            reach = (positions >= W - 1 - i).to(x.dtype)[..., None]  # [B, T, 1]
            y = y + xp[:, i:i + T] * w[:, i] * reach
    if bias is not None:
        y = y + bias.to(x.dtype)
    if activation == "silu":
        y = F.silu(y)
    new_tail = xp[:, xp.shape[1] - (W - 1):]  # [B, W − 1, C]
    return y, new_tail


def gated_rms_norm(o: Tensor, z: Tensor | None, weight: Tensor | None, *, group_size: int, eps: float = 1e-5,
                   activation: str = "swish", norm_before_gate: bool = True) -> Tensor:
    """y [..., C] in o's dtype: RMSNorm over groups of G = group_size channels (G | C), weight [G]
    shared by the groups (None: no affine), gated by act(z) when z [..., C] is given:

        norm_before_gate=True:  y = RMSNorm_G(o) ⊙ w ⊙ act(z)      (fla FusedRMSNormGated)
        norm_before_gate=False: y = RMSNorm_G(o ⊙ act(z)) ⊙ w      (Mamba2's RMSNormGated)"""
    shape = o.shape
    if z is not None and not norm_before_gate:
        o = o * gate_activation(activation, z.to(o.dtype))
    G = group_size
    y = rms(o, eps) if G == shape[-1] else rms(o.reshape(*shape[:-1], shape[-1] // G, G), eps)  # [..., (C / G,) G]
    if weight is not None:
        y = y * weight.to(y.dtype)
    y = y.reshape(shape)  # [..., C]
    if z is not None and norm_before_gate:
        y = y * gate_activation(activation, z.to(y.dtype))
    return y.to(o.dtype)


def delta_prologue(q: Tensor, k: Tensor, b: Tensor | None, a: Tensor | None, A_log: Tensor | None = None,
                   dt_bias: Tensor | None = None, *, gate: str | None = "mamba", beta_max: float = 1.0,
                   eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(q̂, k̂, β, g) of the delta layer: q̂ = l2norm(q), k̂ = l2norm(k) (their dtype); β = β_max·σ(b)
    in b's compute dtype (None without b); g = −exp(A_log)·softplus(a + dt_bias) in a's compute
    dtype (None when gate is None).

    q [B, T, H_q, K], k [B, T, H_k, K]; b [B, T, H_b]; gate "mamba": a [B, T, H], A_log [H],
    dt_bias [H] → g [B, T, H]; gate "kda": a [B, T, H, K_a], A_log [H], dt_bias [H·K_a] →
    g [B, T, H, K_a]."""
    beta = g = None
    if b is not None:
        beta = torch.sigmoid(b.to(compute_dtype(b)))
        if beta_max != 1.0:
            beta = beta * beta_max
    if gate is not None:
        af = a.to(compute_dtype(a))
        dt = F.softplus(af + dt_bias.to(af.dtype).view(a.shape[2:]))  # [B, T, H(, K_a)]
        A = A_log.to(dt.dtype).exp()  # [H]
        g = -A * dt if gate == "mamba" else -A[:, None] * dt
    return l2norm(q, eps), l2norm(k, eps), beta, g


def rope_frequencies(D: int, base: float, device, dtype: torch.dtype) -> Tensor:
    """θ_i = base^(−2i/D), i < D/2 [D/2] in `dtype`: RoPE's frequencies, computed once here for the torch row and the
    Triton row alike (the kernel's angles fp32(p)·θ are then the twin's, bit for bit)."""
    return base ** (-torch.arange(D // 2, device=device, dtype=dtype) * 2.0 / D)


def rope(x: Tensor, start: int, *, base: float = 10000.0, period: int | None = None,
         positions: Tensor | None = None) -> Tensor:
    """RoPE (`layers.rotary`'s maths): x [B, T, H, D] rotated for positions start, …, start + T − 1, or for
    `positions` [B, T] (int, per token: padded and packed batches) when given; mod period when given. Computed in
    fp32 (fp64 for fp64 x), returned in x's dtype."""
    B, T, H, D = x.shape
    if D % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {D}")
    half = D // 2
    cdt = compute_dtype(x)
    if positions is None:
        pos = torch.arange(start, start + T, device=x.device, dtype=torch.int64)[None]  # [1, T]
    else:
        pos = positions.to(device=x.device, dtype=torch.int64)  # [B, T]
    if period is not None:
        pos = pos % period
    inv = rope_frequencies(D, base, x.device, cdt)  # [D/2]
    ang = pos.to(cdt)[..., None] * inv  # [1 or B, T, D/2]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]  # [1 or B, T, 1, D/2]
    xf = x.to(cdt)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
