"""`GraphedLMStep` on a GPU: steps replayed from the captured graph against the same steps run eagerly, from the
same weights on the same batches — fp32 (no autocast) to fp32 rounding, and bf16 autocast to bf16 noise — for a
Triton-served fast-weight LM and a transformer, with two micro-batches, clipping and a changing lr."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from fastweights.layers.segments import count_documents
from fastweights.models import LM, LMConfig
from fastweights.training.graphed import WARMUP, GraphedLMStep
from fastweights.training.step import adamw
from tests.tolerances import GRAPHED_LM_BF16_REL, GRAPHED_LM_F32_GRAD_REL, GRAPHED_LM_F32_REL

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]


def _run(mixer, seed, batches, capture, dtype, positions=None, max_documents=None):
    torch.manual_seed(seed)
    lm = LM(LMConfig(vocab_size=64, d_model=128, n_layers=2, num_heads=2, head_dim=64, mixer=mixer)).cuda()
    opt = adamw(lm, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    step = GraphedLMStep(lm, opt, tuple(batches[0].shape), autocast_dtype=dtype, grad_clip=1.0, capture=capture,
                         max_documents=max_documents)
    losses = []
    for s, ids in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = 3e-3 / (1 + s)
        losses.append(step.step(ids) if positions is None else step.step(ids, positions[s]))
    graphed = step.graphed
    grads = [p.grad.detach().float().cpu() for p in lm.parameters()]  # the last step's (the graph's own tensors)
    step.close()
    return torch.stack(losses).cpu(), [p.detach().float().cpu() for p in lm.parameters()], graphed, grads


@pytest.mark.parametrize("dtype,tol", [(None, GRAPHED_LM_F32_REL), (torch.bfloat16, GRAPHED_LM_BF16_REL)])
@pytest.mark.parametrize("mixer", ["gated_deltanet", "softmax_attention"])
def test_replays_equal_eager_steps(mixer, dtype, tol):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    batches = [torch.randint(0, 64, (2, 3, 130), device="cuda") for _ in range(WARMUP + 4)]
    lg, pg, graphed, _ = _run(mixer, seed, batches, True, dtype)
    le, pe, _, _ = _run(mixer, seed, batches, False, dtype)
    assert graphed
    assert torch.isfinite(lg).all()
    assert ((lg - le).abs() / le.abs()).max() < tol, (lg, le)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(pg, pe))
    assert worst < tol, worst


@pytest.mark.parametrize("dtype,tol", [(None, GRAPHED_LM_F32_REL), (torch.bfloat16, GRAPHED_LM_BF16_REL)])
@pytest.mark.parametrize("mixer", ["gated_deltanet", "softmax_attention"])
def test_replays_with_packed_documents_equal_eager_steps(mixer, dtype, tol):
    """Packed documents (position_ids from random end-of-text tokens, max_documents above the most any micro-batch
    holds): the step captures — no host read, no data-dependent shape — and its replays give the eager steps'
    losses, weights and (fp32) last gradients; the eager steps' first loss is the exact packing's. (bf16 gradients
    differ by bf16 noise with or without packing: GRAPHED_LM_F32_GRAD_REL's note.)"""
    from tests.training.test_graphed import random_packed_positions

    seed = int(torch.randint(0, 2**31 - 1, ()))
    M, B, T = 2, 3, 129
    batches = [torch.randint(0, 64, (M, B, T + 1), device="cuda") for _ in range(WARMUP + 4)]
    positions = [random_packed_positions(M, B, T) for _ in batches]  # (on the CPU, as the loader gives them)
    N = max(int(count_documents(p).max()) for p in positions) + 5  # trailing empty sequences in every block
    lg, pg, graphed, gg = _run(mixer, seed, batches, True, dtype, positions, N)
    le, pe, _, ge = _run(mixer, seed, batches, False, dtype, positions, N)
    assert graphed
    assert torch.isfinite(lg).all()
    assert ((lg - le).abs() / le.abs()).max() < tol, (lg, le)
    pairs = [(pg, pe, tol)] + ([(gg, ge, GRAPHED_LM_F32_GRAD_REL)] if dtype is None else [])
    for got, want, bound in pairs:
        worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(got, want))
        assert worst < bound, worst
    torch.manual_seed(seed)
    lm = LM(LMConfig(vocab_size=64, d_model=128, n_layers=2, num_heads=2, head_dim=64, mixer=mixer)).cuda()
    x, y, pos = batches[0][..., :-1], batches[0][..., 1:], positions[0].cuda()
    cast = torch.autocast("cuda", dtype=dtype, cache_enabled=False) if dtype is not None else contextlib.nullcontext()
    with torch.no_grad(), cast:
        exact = sum(F.cross_entropy(lm(x[m], position_ids=pos[m]).float().flatten(0, 1), y[m].flatten(),
                                    reduction="sum") for m in range(M)) / (M * B * T)
    assert abs(exact.item() - le[0].item()) / abs(exact.item()) < tol, (exact, le[0])
