"""`fastweights.training.GraphedLMStep` off a GPU (capture=False: every step eager through the graph's body):
the micro-batch accumulation, the clipping and the per-group lrs equal a plain training loop, in float64; bad
shapes are refused by name. The captured replays are compared with eager steps on a GPU in
tests/cuda/test_graphed_step.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights.models import LM, LMConfig
from fastweights.training.graphed import GraphedLMStep
from fastweights.training.step import adamw
from tests.tolerances import EXACT_F64


def _lm(seed: int, mixer: str) -> LM:
    torch.manual_seed(seed)
    return LM(LMConfig(vocab_size=40, d_model=16, n_layers=2, num_heads=2, head_dim=8, mixer=mixer)).double()


@pytest.mark.parametrize("mixer", ["gated_deltanet", "softmax_attention"])
def test_steps_equal_a_plain_loop_with_accumulation_clipping_and_lrs(mixer):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    a, b = _lm(seed, mixer), _lm(seed, mixer)
    oa = adamw(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ob = adamw(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    M, B, T = 2, 3, 11
    graphed = GraphedLMStep(a, oa, (M, B, T + 1), autocast_dtype=None, grad_clip=0.5, capture=False)
    for s in range(4):
        ids = torch.randint(0, 40, (M, B, T + 1))
        for o in (oa, ob):  # a schedule: each step its own lrs, different per group
            for i, g in enumerate(o.param_groups):
                g["lr"] = 1e-2 / (s + 1) / (i + 1)
        got = graphed.step(ids)
        ob.zero_grad(set_to_none=True)
        want = 0.0
        for m in range(M):
            loss = F.cross_entropy(b(ids[m, :, :-1]).flatten(0, 1), ids[m, :, 1:].flatten()) / M
            loss.backward()
            want += loss.item()
        torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
        ob.step()
        assert abs(got.item() - want) < EXACT_F64
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max() < EXACT_F64, n
    assert not graphed.graphed  # nothing was captured on the CPU


def test_refuses_bad_shapes_by_name():
    lm = _lm(0, "gated_deltanet")
    opt = adamw(lm, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    with pytest.raises(ValueError, match="shape must be"):
        GraphedLMStep(lm, opt, (2, 3), capture=False)
    step = GraphedLMStep(lm, opt, (1, 2, 9), capture=False)
    with pytest.raises(ValueError, match=r"ids must be \[1, 2, 9\]"):
        step.step(torch.zeros(1, 2, 8, dtype=torch.long))


def test_labeled_steps_equal_a_plain_loop_over_the_supervised_tokens():
    """step_labeled: the loss of each micro-batch is its summed cross-entropy over the supervised labels divided by
    the whole step's supervised count (as `fastweights train` weighs its micro-batches), float64."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    a, b = _lm(seed, "gated_deltanet"), _lm(seed, "gated_deltanet")
    oa = adamw(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ob = adamw(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    M, B, T = 3, 2, 9
    graphed = GraphedLMStep(a, oa, (M, B, T + 1), autocast_dtype=None, grad_clip=None, capture=False)
    for _ in range(3):
        x = torch.randint(0, 40, (M, B, T))
        y = torch.randint(0, 40, (M, B, T))
        y[torch.rand(M, B, T) < 0.3] = -100  # unsupervised tokens (e.g. after an end-of-text input)
        y[1] = -100  # a micro-batch with none
        got = graphed.step_labeled(x, y)
        ob.zero_grad(set_to_none=True)
        n, want = int((y != -100).sum()), 0.0
        for m in range(M):
            loss = F.cross_entropy(b(x[m]).flatten(0, 1), y[m].flatten(), reduction="sum") / n
            loss.backward()
            want += loss.item()
        ob.step()
        assert abs(got.item() - want) < EXACT_F64
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max() < EXACT_F64, name
    with pytest.raises(ValueError, match=r"labels must be \[3, 2, 9\]"):
        graphed.step_labeled(x, y[:, :, :-1])


def random_packed_positions(M: int, B: int, T: int) -> torch.Tensor:
    """position_ids [M, B, T] as `pretrain.data.pack` writes them for random end-of-text tokens (each row's first
    document cut at a random position; some documents of length 1)."""
    from fastweights.pretrain.data import pack

    x = torch.randint(1, 40, (M * B, T + 1))
    x[torch.rand(M * B, T + 1) < 0.3] = 0  # end-of-text id 0
    pos = pack(x, 0)["position_ids"]  # [M·B, T]
    first = ((pos == 0) & (torch.arange(T) > 0)).cumsum(1) == 0  # the tokens of each row's first document
    return (pos + first * torch.randint(0, 5, (M * B, 1))).view(M, B, T)


def test_packed_documents_steps_equal_a_plain_loop_over_the_exact_packing():
    """max_documents: the steps take position_ids [M, B, T] (copied into a static buffer, each micro-batch's
    documents packed into max_documents varlen sequences) and equal a plain loop whose forwards take the same
    position_ids through the exact packing, in float64; position_ids missing, unasked for, or over the bound
    are refused by name."""
    from fastweights.inputs import InputError
    from fastweights.layers.segments import count_documents

    seed = int(torch.randint(0, 2**31 - 1, ()))
    a, b = _lm(seed, "gated_deltanet"), _lm(seed, "gated_deltanet")
    oa = adamw(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ob = adamw(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    M, B, T = 2, 2, 9
    graphed = GraphedLMStep(a, oa, (M, B, T + 1), autocast_dtype=None, grad_clip=0.5, capture=False,
                            max_documents=B * T)
    for _ in range(3):
        x, y = torch.randint(0, 40, (M, B, T)), torch.randint(0, 40, (M, B, T))
        pos = random_packed_positions(M, B, T)
        got = graphed.step_labeled(x, y, pos)
        ob.zero_grad(set_to_none=True)
        want = 0.0
        for m in range(M):
            loss = F.cross_entropy(b(x[m], position_ids=pos[m]).flatten(0, 1), y[m].flatten(),
                                   reduction="sum") / (M * B * T)
            loss.backward()
            want += loss.item()
        torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
        ob.step()
        assert abs(got.item() - want) < EXACT_F64
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max() < EXACT_F64, name
    ids = torch.randint(0, 40, (M, B, T + 1))
    with pytest.raises(ValueError, match="position_ids .* come with max_documents, and only then"):
        graphed.step(ids)
    with pytest.raises(ValueError, match=r"position_ids must be \[2, 2, 9\]"):
        graphed.step(ids, pos[:, :, :-1])
    few = int(count_documents(pos).max()) - 1
    tight = GraphedLMStep(a, oa, (M, B, T + 1), autocast_dtype=None, capture=False, max_documents=few)
    with pytest.raises(InputError, match=f"more than max_documents={few}"):
        tight.step(ids, pos)
    with pytest.raises(ValueError, match="position_ids .* come with max_documents, and only then"):
        GraphedLMStep(a, oa, (M, B, T + 1), capture=False).step(ids, pos)
