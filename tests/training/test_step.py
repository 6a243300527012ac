"""The shared optimizer step (fastweights.training.step): parameter groups, the schedule, autocast,
and one step = clip, AdamW step, cleared gradients, the schedule advanced."""

import math

import pytest
import torch
from torch import nn

from fastweights.models import LM, LMConfig
from fastweights.training.step import adamw, autocast, lr_factor, optimizer_step, param_groups


def _lm():
    return LM(LMConfig(vocab_size=64, d_model=16, n_layers=2, mixer="gated_deltanet", num_heads=1, mlp="none"))


def test_param_groups_decay_matrices_but_not_embeddings_norms_or_marked_parameters():
    lm = _lm()
    groups = param_groups(lm, 0.1, "matrices")
    decayed = {id(p) for p in groups[0]["params"]}
    assert id(lm.embed.weight) not in decayed
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[1]["weight_decay"] == 0.0
    marked = [p for p in lm.parameters() if getattr(p, "_no_weight_decay", False)]
    assert marked and not any(id(p) in decayed for p in marked)
    assert sum(len(g["params"]) for g in groups) == len(list(lm.parameters()))
    assert len(param_groups(lm, 0.1, "all")) == 1
    opt = adamw(lm, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.defaults["betas"] == (0.9, 0.95)


def test_warmup_then_cosine_or_constant():
    f = [lr_factor(s, total=110, warmup=10, floor=0.1) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55) and f[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert lr_factor(50, total=110, warmup=10, floor=0.1, schedule="constant") == 1.0
    assert lr_factor(0, total=5, warmup=50, floor=0.0) == pytest.approx(1 / 5)  # warm-up capped at the total
    assert lr_factor(3, total=4, warmup=0, floor=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 4)))


def test_autocast_only_for_half_dtypes():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast("bfloat16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
    with autocast("float32", "cpu"):
        assert (a @ b).dtype == torch.float32


def test_optimizer_step_clips_steps_clears_and_advances_the_schedule():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (net, ref)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in opts]
    x = torch.randn(5, 3)
    for step in range(2):
        (net(x) * 100).sum().backward()
        (ref(x) * 100).sum().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.25)  # what the step must do, by hand
        lr = optimizer_step(opts[0], scheds[0], net.parameters(), 0.25)
        opts[1].step()
        opts[1].zero_grad(set_to_none=True)
        scheds[1].step()
        assert lr == pytest.approx(0.5 / (step + 1))
        assert all(p.grad is None for p in net.parameters())
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), ref.parameters()))
    assert scheds[0].get_last_lr() == scheds[1].get_last_lr() == [0.5 / 3]
