"""The optimizer step shared by the lab's sweeps (`fastweights.lab.train.train_cell`) and
`fastweights train` (`fastweights.pretrain.loop`): AdamW over two parameter groups, a linear
warm-up then a cosine (or constant) learning-rate schedule, optional bf16/fp16 autocast, clipping
of the global gradient norm.

    lr_s / lr = (s + 1) / warm                                    s < warm
              = floor + (1 − floor) · ½ (1 + cos π t),  t = min(1, (s − warm) / max(1, total − warm))
                                                                  (cosine; constant: 1)

with floor = min_lr / lr. Weight decay (`param_groups`, decay_filter "matrices") falls on ≥2-D
weights other than embeddings; norms, biases, 1-D gate vectors, the embedding (the tied head
included) and parameters marked `_no_weight_decay` (Mamba's A_log, dt_bias) are not decayed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["param_groups", "adamw", "lr_factor", "autocast", "AUTOCAST_DTYPES", "optimizer_step"]

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def param_groups(model: nn.Module, weight_decay: float, decay_filter: str = "matrices") -> list[dict]:
    """AdamW groups: with "matrices", weight decay on ≥2-D parameters that are not embeddings;
    norms, biases, 1-D gate vectors, embeddings (the tied head included) and parameters marked
    `_no_weight_decay` (Mamba's A_log, dt_bias) get none. "all": one
    group, every parameter decayed (Zoology)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_filter == "all":
        return [{"params": params, "weight_decay": weight_decay}]
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in params:
        skip = p.dim() < 2 or id(p) in emb or getattr(p, "_no_weight_decay", False)
        (no_decay if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw(model: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
          decay_filter: str = "matrices") -> torch.optim.AdamW:
    """AdamW over `param_groups(model, weight_decay, decay_filter)`."""
    return torch.optim.AdamW(param_groups(model, weight_decay, decay_filter), lr=lr, betas=betas)


def lr_factor(step: int, *, total: int, warmup: int, floor: float, schedule: str = "cosine") -> float:
    """lr_step / lr at optimizer step `step` (0-based) of `total`: a linear warm-up over `warmup`
    steps, then a cosine to `floor` (= min_lr / lr) at the last step, or constant 1."""
    warm = min(warmup, total)
    if warm and step < warm:
        return (step + 1) / warm
    if schedule == "constant":
        return 1.0
    t = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def autocast(dtype: str, device: torch.device):
    """A fresh autocast context for "bfloat16"/"float16" on the device's type; a no-op context for
    any other dtype (float32, and float64 whose weights are themselves float64)."""
    if dtype in AUTOCAST_DTYPES:
        return torch.autocast(device_type=torch.device(device).type, dtype=AUTOCAST_DTYPES[dtype])
    return contextlib.nullcontext()


def optimizer_step(opt: torch.optim.Optimizer, sched, parameters: Iterable[torch.Tensor],
                   grad_clip: float | None) -> float:
    """After the backward passes of a step: clip the global gradient norm of `parameters` to
    `grad_clip` (None: no clipping), step the optimizer, clear the gradients (set to None) and
    advance the schedule. Returns the learning rate the step used (of the first group)."""
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    lr = sched.get_last_lr()[0]
    sched.step()
    return lr
