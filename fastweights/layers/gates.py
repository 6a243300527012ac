"""The per-token gates a mixer computes from its input x [B, T, d_model], with their published
parameterizations and initializations. Every gate is computed in fp32 (fp64 for fp64 inputs).

Log-retention g = log α ≤ 0:
    MambaDecay   g = −exp(A_log)·softplus(a(x) + dt_bias)              (Mamba2, GDN, Comba, DeltaProduct)
                 A ~ U(A_range) per head, dt ~ logU[1e-3, 0.1] floored at 1e-4,
                 dt_bias = dt + log(−expm1(−dt)) (inverse softplus), so softplus(dt_bias) = dt.
                 Per channel (KDA): a(x) = Linear(d, V)·Linear(V, H·K) (bias-free), dt_bias ∈ R^{H·K},
                 A_log ∈ R^H. `forward` also returns dt = softplus(a(x) + dt_bias) (Mamba2's β).
    GLAGate      g = logsigmoid(Linear(16, H·K, bias)(Linear(d, 16)(x))) / 16        (GLA, diagonal)
    LogSigmoidGate  g = logsigmoid(Linear(d, H, bias)(x))     (FoX forget gate; Mesa's γ; Titans/ATLAS decay)

Step sizes and other gates:
    BetaGate     β = scale·σ(Linear(d, n·H)(x)) [/ head_dim for TTT]      (scale 2: negative eigenvalues;
                 PaTH's 2σ; TTT's base learning rate; Titans' max_lr)
    SigmoidGate  σ(Linear(d, H, bias)(x)): momentum ν (Titans/ATLAS), Omega's γ_i
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..state import compute_dtype

Tensor = torch.Tensor

__all__ = ["MambaDecay", "GLAGate", "LogSigmoidGate", "BetaGate", "SigmoidGate", "inverse_softplus"]


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) = y (y > 0): y + log(−expm1(−y))."""
    return y + torch.log(-torch.expm1(-y))


def _fp(x: Tensor) -> Tensor:
    return x.to(compute_dtype(x))


class MambaDecay(nn.Module):
    """g = −exp(A_log)·softplus(a(x) + dt_bias) ≤ 0: [B, T, H] (per head) or [B, T, H, K] (per channel).

    Args:
        d_model, num_heads: input width and heads H.
        channels: 1 (one gate per head) or K (KDA: one per key channel, through the low-rank
            a(x) = Linear(d, rank) → Linear(rank, H·K), both bias-free).
        A_range: A ~ U(A_range); (0, 16) for GDN/Comba/DeltaProduct, (1, 16) for Mamba2/KDA.
        rank: the low-rank width for channels > 1.
    """

    def __init__(self, d_model: int, num_heads: int, *, channels: int = 1, A_range=(0.0, 16.0),
                 rank: int | None = None, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
        super().__init__()
        self.num_heads, self.channels = num_heads, channels
        if channels == 1:
            self.proj = nn.Linear(d_model, num_heads, bias=False)
        else:
            r = rank or d_model
            self.proj = nn.Sequential(nn.Linear(d_model, r, bias=False), nn.Linear(r, num_heads * channels, bias=False))
        lo, hi = A_range
        A = torch.empty(num_heads).uniform_(lo, hi).clamp_min(1e-4)
        self.A_log = nn.Parameter(torch.log(A))  # [H]
        dt = torch.exp(torch.rand(num_heads * channels) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias = nn.Parameter(inverse_softplus(dt.clamp_min(dt_floor)))  # [H·C]
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def forward(self, x: Tensor, proj: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, d] -> (g, dt), each [B, T, H] (channels 1) or [B, T, H, C]. proj: self.proj(x)
        when the caller computed it already (the mixer's one matmul for the projections of x)."""
        B, T, _ = x.shape
        a = _fp(self.proj(x) if proj is None else proj) + self.dt_bias.to(_fp(x).dtype)  # [B, T, H·C]
        dt = F.softplus(a)
        A = self.A_log.to(dt.dtype).exp()  # [H]
        if self.channels == 1:
            return -A * dt, dt  # [B, T, H]
        dt = dt.view(B, T, self.num_heads, self.channels)  # [B, T, H, C]
        return -A[:, None] * dt, dt


class GLAGate(nn.Module):
    """GLA's diagonal gate g = logsigmoid(Linear(rank, H·K, bias)(Linear(d, rank)(x))) / normalizer: [B, T, H, K]."""

    def __init__(self, d_model: int, num_heads: int, channels: int, *, rank: int = 16, normalizer: float = 16.0):
        super().__init__()
        self.num_heads, self.channels, self.normalizer = num_heads, channels, normalizer
        self.proj = nn.Sequential(nn.Linear(d_model, rank, bias=False),
                                  nn.Linear(rank, num_heads * channels, bias=True))

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        g = F.logsigmoid(_fp(self.proj(x))) / self.normalizer  # [B, T, H·K]
        return g.view(B, T, self.num_heads, self.channels)  # [B, T, H, K]


class LogSigmoidGate(nn.Module):
    """g = logsigmoid(Linear(d, H, bias)(x)) ≤ 0: [B, T, H]; `bias_init` sets the initial bias (None: default)."""

    def __init__(self, d_model: int, num_heads: int, *, bias_init: float | None = None):
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads, bias=True)
        if bias_init is not None:
            nn.init.constant_(self.proj.bias, bias_init)

    def forward(self, x: Tensor) -> Tensor:
        return F.logsigmoid(_fp(self.proj(x)))  # [B, T, H]


class BetaGate(nn.Module):
    """β = scale·σ(Linear(d, n·H)(x)) [/ divide_by]: [B, T, H] or [B, T, n, H] (DeltaProduct's n_h steps).
    divide_by: head_dim (TTT's base learning rate) or the recipe's step normalizer (bounded β)."""

    def __init__(self, d_model: int, num_heads: int, *, steps: int = 1, scale: float = 1.0, bias: bool = False,
                 divide_by: float = 1):
        super().__init__()
        self.num_heads, self.steps, self.scale, self.divide_by = num_heads, steps, scale, divide_by
        self.proj = nn.Linear(d_model, steps * num_heads, bias=bias)
        if bias:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor, proj: Tensor | None = None) -> Tensor:
        """x [B, T, d] -> β; proj: self.proj(x) when the caller computed it already."""
        B, T, _ = x.shape
        beta = torch.sigmoid(_fp(self.proj(x) if proj is None else proj))
        if self.scale != 1.0:
            beta = beta * self.scale
        if self.divide_by != 1:
            beta = beta / self.divide_by
        if self.steps > 1:
            return beta.view(B, T, self.steps, self.num_heads)  # [B, T, n, H]
        return beta  # [B, T, H]


class SigmoidGate(nn.Module):
    """σ(Linear(d, H, bias)(x)) ∈ (0, 1): [B, T, H] (momentum ν, Omega γ)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(_fp(self.proj(x)))  # [B, T, H]
