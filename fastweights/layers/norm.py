"""Normalizations used by the layers: L2 norm of q/k, RMSNorm, and the gated output RMSNorm.

    l2norm(x)     = x / sqrt(Σ_d x_d² + 1e-6)                      (fla's l2norm, on q and k)
    RMSNorm(x)    = x / sqrt(mean_d x_d² + eps) ⊙ w                 (computed in fp32)
    GatedRMSNorm  norm-then-gate  y = RMSNorm(o) ⊙ act(z)           (fla FusedRMSNormGated)
                  gate-then-norm  y = RMSNorm(o ⊙ act(z))           (Mamba2, norm_before_gate=False)
                  over groups of `group_size` channels (one head, or the whole width).

GatedRMSNorm on CUDA (the rule of `layers.fused.use_fused`: o, z and the weight on a CUDA device,
triton importable, fp32/bf16/fp16, group_size ≤ 8192, gate swish or sigmoid or none) runs one
Triton kernel each way (`kernels.triton.norm.gated_rms_norm`, fp32 statistics and arithmetic,
the gate product not rounded to o's dtype); elsewhere the torch ops below. RMSNorm (with its
weight) takes the same kernel on the same rule: no gate, one group of `dim` channels.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.triton.limits import MAX_GROUP
from .fused import use_fused

Tensor = torch.Tensor

__all__ = ["l2norm", "RMSNorm", "GatedRMSNorm", "gate_activation"]

GateAct = Literal["swish", "sigmoid", "gelu_tanh"]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σ x² + eps) along the last dimension, computed in fp32 (or fp64), cast back."""
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gate_activation(name: str, z: Tensor) -> Tensor:
    """swish z·σ(z), sigmoid σ(z) or gelu_tanh."""
    if name == "swish":
        return F.silu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    raise ValueError(f"gate activation must be 'swish', 'sigmoid' or 'gelu_tanh', got {name!r}")


def _rms(x: Tensor, eps: float) -> Tensor:
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension `dim`: x / sqrt(mean(x²) + eps) ⊙ w, w initialized to 1."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is not None and use_fused(x, self.weight, fits=self.dim <= MAX_GROUP):
            from ..kernels.triton.norm import gated_rms_norm  # the same kernel, no gate, one group

            return gated_rms_norm(x, None, self.weight, eps=self.eps)
        y = _rms(x, self.eps)
        if self.weight is not None:
            y = y * self.weight.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """The output norm of a mixer, over groups of `group_size` channels, with an optional gate.

    Input o [..., C] (C = number of groups × group_size), gate z [..., C] or None.
    norm_before_gate=True:  y = RMSNorm_g(o) ⊙ w ⊙ act(z)      (fla FusedRMSNormGated)
    norm_before_gate=False: y = RMSNorm_g(o ⊙ act(z)) ⊙ w      (Mamba2's RMSNormGated)
    The weight w [group_size] is shared by the groups (one head = one group).
    """

    def __init__(self, group_size: int, eps: float = 1e-5, activation: GateAct = "swish",
                 norm_before_gate: bool = True):
        super().__init__()
        gate_activation(activation, torch.zeros(1))  # validate the name
        self.group_size, self.eps = group_size, eps
        self.activation, self.norm_before_gate = activation, norm_before_gate
        self.weight = nn.Parameter(torch.ones(group_size))

    def forward(self, o: Tensor, z: Tensor | None = None) -> Tensor:
        shape = o.shape
        G = self.group_size
        fits = G <= MAX_GROUP and (z is None or self.activation in ("swish", "sigmoid"))
        if use_fused(o, z, self.weight, fits=fits):
            from ..kernels.triton.norm import gated_rms_norm  # imported on first use (TRITON_INTERPRET is read then)

            return gated_rms_norm(o, z, self.weight, eps=self.eps, activation=self.activation,
                                  norm_before_gate=self.norm_before_gate)
        if z is not None and not self.norm_before_gate:
            o = o * gate_activation(self.activation, z.to(o.dtype))
        y = _rms(o.reshape(*shape[:-1], shape[-1] // G, G), self.eps)  # [..., C / G, G]
        y = (y * self.weight.to(y.dtype)).reshape(shape)  # [..., C]
        if z is not None and self.norm_before_gate:
            y = y * gate_activation(self.activation, z.to(y.dtype))
        return y.to(o.dtype)

    def extra_repr(self) -> str:
        return (f"group_size={self.group_size}, eps={self.eps}, activation={self.activation}, "
                f"norm_before_gate={self.norm_before_gate}")
