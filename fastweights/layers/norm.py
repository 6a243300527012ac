"""Normalizations used by the layers: L2 norm of q/k, RMSNorm, and the gated output RMSNorm.

    l2norm(x)     = x / sqrt(Σ_d x_d² + 1e-6)                      (fla's l2norm, on q and k)
    RMSNorm(x)    = x / sqrt(mean_d x_d² + eps) ⊙ w                 (computed in fp32)
    GatedRMSNorm  norm-then-gate  y = RMSNorm(o) ⊙ act(z)           (fla FusedRMSNormGated)
                  gate-then-norm  y = RMSNorm(o ⊙ act(z))           (Mamba2, norm_before_gate=False)
                  over groups of `group_size` channels (one head, or the whole width).

GatedRMSNorm and RMSNorm run the "norm" layer op of the dispatch table on every call, routed from
the call (device type, the promoted dtype of o, z and the weight, the group size, the gate) and
the module's requested `backend`: on CUDA ("auto": triton importable, fp32/bf16/fp16, group ≤ 8192,
gate swish or sigmoid or none) one Triton kernel each way (`kernels.triton.layer.norm.gated_rms_norm`,
fp32 statistics and arithmetic, the gate product not rounded to o's dtype); elsewhere the torch
ops (`torch_layer_ops.gated_rms_norm`). RMSNorm is the same op: no gate, one group of `dim`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..dispatch import Target, check_backend, promoted_dtype
from ..inputs import InputError, check_choice, check_flag, check_int
from ..torch_layer_ops import GATES, gate_activation, l2norm
from .routing import describe_routes, layer_op_row

Tensor = torch.Tensor

__all__ = ["l2norm", "RMSNorm", "GatedRMSNorm", "gate_activation"]

GateAct = Literal["swish", "sigmoid", "gelu_tanh"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension `dim`: x / sqrt(mean(x²) + eps) ⊙ w, w initialized to 1
    (affine=False: no w). backend: of the "norm" layer op, "auto" or a name."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True, backend: str = "auto"):
        super().__init__()
        check_int("dim", dim)
        check_flag("affine", affine)
        check_backend(None, "norm", backend)
        self.dim, self.eps, self.backend = dim, eps, backend
        self.routes: dict[str, tuple[str, str]] = {}
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        _check_channels("x", x, self.dim, multiple=False)
        target = Target.of(x.device, promoted_dtype(x, self.weight), group_size=self.dim)
        return layer_op_row(self.routes, "norm", self.backend, target).fn(x, None, self.weight, group_size=self.dim,
                                                                         eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, backend={self.backend}{describe_routes(self.routes)}"


class GatedRMSNorm(nn.Module):
    """The output norm of a mixer, over groups of `group_size` channels, with an optional gate.

    Input o [..., C] (C = number of groups × group_size), gate z [..., C] or None.
    norm_before_gate=True:  y = RMSNorm_g(o) ⊙ w ⊙ act(z)      (fla FusedRMSNormGated)
    norm_before_gate=False: y = RMSNorm_g(o ⊙ act(z)) ⊙ w      (Mamba2's RMSNormGated)
    The weight w [group_size] is shared by the groups (one head = one group).
    backend: of the "norm" layer op, "auto" or a name (`fastweights.layer_op_backends("norm")`).
    """

    def __init__(self, group_size: int, eps: float = 1e-5, activation: GateAct = "swish",
                 norm_before_gate: bool = True, backend: str = "auto"):
        super().__init__()
        check_int("group_size", group_size)
        check_choice("activation", activation, GATES)
        check_flag("norm_before_gate", norm_before_gate)
        check_backend(None, "norm", backend)
        self.backend = backend
        self.routes: dict[str, tuple[str, str]] = {}
        self.group_size, self.eps = group_size, eps
        self.activation, self.norm_before_gate = activation, norm_before_gate
        self.weight = nn.Parameter(torch.ones(group_size))

    def forward(self, o: Tensor, z: Tensor | None = None) -> Tensor:
        G = self.group_size
        _check_channels("o", o, G, multiple=True)
        if z is not None and (not isinstance(z, Tensor) or z.shape != o.shape or not z.is_floating_point()):
            raise InputError(f"z must be None or a floating tensor shaped like o {list(o.shape)}, got "
                             f"{getattr(z, 'dtype', type(z).__name__)} {list(getattr(z, 'shape', []))}")
        target = Target.of(o.device, promoted_dtype(o, z, self.weight), group_size=G,
                           gate=self.activation if z is not None else None)
        return layer_op_row(self.routes, "norm", self.backend, target).fn(
            o, z, self.weight, group_size=G, eps=self.eps, activation=self.activation,
            norm_before_gate=self.norm_before_gate)

    def extra_repr(self) -> str:
        return (f"group_size={self.group_size}, eps={self.eps}, activation={self.activation}, "
                f"norm_before_gate={self.norm_before_gate}, backend={self.backend}{describe_routes(self.routes)}")


def _check_channels(name: str, x, width: int, *, multiple: bool) -> None:
    """x: a floating tensor [..., C] with C = width (multiple=True: a multiple of it, the groups)."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0 or \
            (x.shape[-1] % width != 0 if multiple else x.shape[-1] != width) or x.shape[-1] == 0:
        want = f"a multiple of group_size={width}" if multiple else f"{width}"
        raise InputError(f"{name} must be a floating tensor [..., C] with C = {want}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
