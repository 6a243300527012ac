"""`GraphedLMStep` on a GPU: steps replayed from the captured graph against the same steps run eagerly, from the
same weights on the same batches — fp32 (no autocast) to fp32 rounding, and bf16 autocast to bf16 noise — for a
Triton-served fast-weight LM and a transformer, with two micro-batches, clipping and a changing lr."""

from __future__ import annotations

import pytest
import torch

from fastweights.models import LM, LMConfig
from fastweights.training.graphed import WARMUP, GraphedLMStep
from fastweights.training.step import adamw
from tests.tolerances import GRAPHED_LM_BF16_REL, GRAPHED_LM_F32_REL

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]


def _run(mixer, seed, batches, capture, dtype):
    torch.manual_seed(seed)
    lm = LM(LMConfig(vocab_size=64, d_model=128, n_layers=2, num_heads=2, head_dim=64, mixer=mixer)).cuda()
    opt = adamw(lm, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    step = GraphedLMStep(lm, opt, tuple(batches[0].shape), autocast_dtype=dtype, grad_clip=1.0, capture=capture)
    losses = []
    for s, ids in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = 3e-3 / (1 + s)
        losses.append(step.step(ids))
    graphed = step.graphed
    step.close()
    return torch.stack(losses).cpu(), [p.detach().float().cpu() for p in lm.parameters()], graphed


@pytest.mark.parametrize("dtype,tol", [(None, GRAPHED_LM_F32_REL), (torch.bfloat16, GRAPHED_LM_BF16_REL)])
@pytest.mark.parametrize("mixer", ["gated_deltanet", "softmax_attention"])
def test_replays_equal_eager_steps(mixer, dtype, tol):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    batches = [torch.randint(0, 64, (2, 3, 130), device="cuda") for _ in range(WARMUP + 4)]
    lg, pg, graphed = _run(mixer, seed, batches, True, dtype)
    le, pe, _ = _run(mixer, seed, batches, False, dtype)
    assert graphed
    assert torch.isfinite(lg).all()
    assert ((lg - le).abs() / le.abs()).max() < tol, (lg, le)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(pg, pe))
    assert worst < tol, worst
