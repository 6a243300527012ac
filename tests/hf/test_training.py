"""transformers' Trainer over the model: gradient accumulation honours `num_items_in_batch` (4
micro-batches of 1 row = 1 batch of 4 rows: the same loss and the same weights after a step)."""

import pytest
import torch

import fastweights.hf as fh
from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.tolerances import TRAINER_LOSS_REL, TRAINER_STEP_F64


def rows(n=4, T=9):
    """n rows whose labels hold different counts of real targets (−100 elsewhere)."""
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (T,))
        labels = ids.clone()
        labels[: 2 * i] = -100  # row i: T − 1 − max(0, 2i − 1) shifted targets
        out.append({"input_ids": ids, "labels": labels})
    return out


def train_one_step(model, data, tmp_path, batch, accumulation):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.5, optim="sgd",
                             weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    out = trainer.train()
    return out.training_loss


@pytest.mark.parametrize("mixer", [("gated_deltanet", "softmax_attention")])
def test_gradient_accumulation_equals_one_step_on_the_concatenated_batch(mixer, tmp_path):
    lm = LM(tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer))).double()
    data = rows()
    before = [p.detach().clone() for p in lm.parameters()]
    a, b = fh.from_lm(lm), fh.from_lm(LM(lm.config).double())
    b.lm.load_state_dict(lm.state_dict())
    whole = torch.stack([r["input_ids"] for r in data])
    labels = torch.stack([r["labels"] for r in data])
    loss_whole = a(whole, labels=labels).loss.item()  # the mean over all the batch's targets
    got_a = train_one_step(a, data, tmp_path / "a", batch=4, accumulation=1)
    got_b = train_one_step(b, data, tmp_path / "b", batch=1, accumulation=4)
    for got in (got_a, got_b):  # without num_items_in_batch, accumulation reported 4× the loss
        assert abs(got - loss_whole) < TRAINER_LOSS_REL * loss_whole, (got_a, got_b, loss_whole)
    moved = 0.0
    for (name, p), q, p0 in zip(a.named_parameters(), b.parameters(), before):
        assert (p - q).abs().max() < TRAINER_STEP_F64, name
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-3  # the step did move the weights


def test_num_items_in_batch_divides_the_summed_loss():
    model = fh.from_lm(LM(tiny_config("deltanet")).double())
    ids = torch.randint(0, VOCAB, (2, 7))
    labels = ids.clone()
    labels[0, :3] = -100
    n = int((labels[:, 1:] != -100).sum())
    mean = model(ids, labels=labels).loss
    assert torch.allclose(model(ids, labels=labels, num_items_in_batch=torch.tensor(3 * n)).loss, mean / 3)


def block_calls(lm):
    """A record of every block's forward calls (a checkpointed block runs again in backward; a pre-hook,
    as torch stops a recomputation once it has what backward needs, before the block returns)."""
    calls = []
    for i, block in enumerate(lm.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    return calls


@pytest.mark.parametrize("every_n_layers", [1, 2])
def test_gradient_checkpointing_recomputes_blocks_and_gives_the_same_gradients(every_n_layers):
    import inspect

    lm = LM(tiny_config("gated_deltanet", mixer=("gated_deltanet", "softmax_attention"), n_layers=4)).double()
    model = fh.from_lm(lm)
    ids = torch.randint(0, VOCAB, (2, 9))
    model(ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if "every_n_layers" in inspect.signature(enable).parameters:  # transformers 5.24
        enable(every_n_layers=every_n_layers)
    else:  # 5.17: every block
        enable()
        every_n_layers = 1
    assert model.is_gradient_checkpointing and lm.gradient_checkpointing
    calls = block_calls(lm)
    model(ids, labels=ids).loss.backward()
    recomputed = [i for i in range(4) if i % every_n_layers == 0]
    assert sorted(calls) == sorted(list(range(4)) + recomputed)  # the checkpointed blocks ran twice
    for n, p in model.named_parameters():
        assert (p.grad - ref[n]).abs().max() < TRAINER_STEP_F64, n
    with torch.no_grad():  # nothing to recompute without gradients: one call per block
        calls.clear()
        model(ids)
        assert calls == [0, 1, 2, 3]
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert not model.is_gradient_checkpointing


def test_trainer_with_gradient_checkpointing_takes_the_same_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    lm = LM(tiny_config("gated_deltanet", mixer=("gated_deltanet", "softmax_attention"), n_layers=2)).double()
    data = rows()
    steps = []
    for checkpointing in (False, True):
        model = fh.from_lm(LM(lm.config).double())
        model.lm.load_state_dict(lm.state_dict())
        args = TrainingArguments(output_dir=str(tmp_path / str(checkpointing)), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=1, learning_rate=0.5, optim="sgd",
                                 max_grad_norm=0.0, gradient_checkpointing=checkpointing, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=0)
        calls = block_calls(model.lm)
        Trainer(model=model, args=args, train_dataset=data).train()
        assert len(calls) == (8 if checkpointing else 4)  # 2 micro-batches × 2 blocks (× 2: recomputed)
        steps.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*steps):
        assert (p - q).abs().max() < TRAINER_STEP_F64
