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
