"""CUDA-graphed training steps (fastweights.lab.graph through `train_cell(cuda_graph=True)`) on a GPU:
the captured steps equal the eager ones to rounding (weights' change and epoch losses) for a
Triton-kernel memory (gated DeltaNet), a mini-batch MLP memory (TTT-MLP) and the two models whose
capture used to fail (RetNet, ALiBi: a host → device copy per call); a graphed run stopped
mid-epoch resumes graphed, and an eager checkpoint resumes graphed; a capture that fails (a
pageable copy, a host sync in the step) falls back to eager steps, says so in the record, and
leaves the process able to capture and to draw CUDA random numbers.

Marked `cuda`: `python3 -m pytest -m cuda tests/cuda/test_graph_train.py` on a GPU machine
(the graphcheck stage of scripts/gpu_round3.sh, deleted after commit 8f55329)."""

from __future__ import annotations

import math

import pytest
import torch

from fastweights.lab import graph
from fastweights.lab.train import TrainConfig, train_cell
from fastweights.models import LM, LMConfig
from fastweights.tasks.mqar import MQARConfig, make_mqar_splits
from fastweights.training.control import Interrupted, clear_stop, request_stop
from tests.tolerances import GRAPH_CUDA_BF16_LOSS_REL, GRAPH_CUDA_F32_LOSS_REL, GRAPH_CUDA_F32_UPDATE_REL

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]

DEVICE = "cuda"


def _data():
    cfg = MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_examples=200, seed=1)
    return make_mqar_splits(cfg, MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_examples=32, seed=1))


def _cfg(dtype="float32"):
    # 200 examples in batches of 32: 7 steps per epoch (the last of 8 examples), 14 in all; the capture
    # follows graph.WARMUP eager steps
    return TrainConfig(epochs=2, batch_size=32, lr=3e-3, warmup=4, grad_clip=0.5, early_stop=None, seed=3,
                       device=DEVICE, dtype=dtype)


def _run(model, *, dtype="float32", hook=None, **kw):
    """(result, initial weights, final weights) of one cell, weights as fp32 on the CPU."""
    box = {}

    def make(c):
        m = LM(c)
        box["init"] = {k: v.detach().float().clone() for k, v in m.state_dict().items()}
        if hook is not None:
            m.embed.register_forward_hook(hook)
        box["model"] = m
        return m

    lm = LMConfig(vocab_size=64, d_model=32, n_layers=2, mixer=model, num_heads=2, mlp="none")
    train, test = _data()
    res = train_cell(lm, train, test, _cfg(dtype), progress="none", model_fn=make, **kw)
    final = {k: v.detach().float().cpu() for k, v in box["model"].state_dict().items()}
    return res, box["init"], final


def _update_rel(a, b) -> float:
    """‖Δw_a − Δw_b‖ / ‖Δw_b‖ over all weights (Δw: the change from the common initial weights)."""
    (_, init, wa), (_, _, wb) = a, b
    num = sum(float(((wa[k] - wb[k]) ** 2).sum()) for k in init)
    den = sum(float(((wb[k] - init[k]) ** 2).sum()) for k in init)
    return math.sqrt(num / den)


def _losses_close(a, b, rel):
    ha, hb = a[0]["history"], b[0]["history"]
    assert len(ha) == len(hb)
    for x, y in zip(ha, hb):
        assert x["lr"] == y["lr"]
        assert math.isclose(x["loss"], y["loss"], rel_tol=rel), (x, y)


@pytest.mark.parametrize("model", ["gated_deltanet", "ttt_mlp", "ttt_linear", "mesanet", "retnet", "alibi"])
def test_graphed_steps_equal_eager_steps(model):
    eager = _run(model)
    graphed = _run(model, cuda_graph=True)
    assert eager[0]["cuda_graph"] is False
    assert graphed[0]["cuda_graph"] is True, graphed[0].get("cuda_graph_note")
    _losses_close(graphed, eager, GRAPH_CUDA_F32_LOSS_REL)
    assert _update_rel(graphed, eager) <= GRAPH_CUDA_F32_UPDATE_REL


def test_graphed_steps_in_bf16_autocast():
    eager = _run("gated_deltanet", dtype="bfloat16")
    graphed = _run("gated_deltanet", dtype="bfloat16", cuda_graph=True)
    assert graphed[0]["cuda_graph"] is True, graphed[0].get("cuda_graph_note")
    _losses_close(graphed, eager, GRAPH_CUDA_BF16_LOSS_REL)


@pytest.fixture
def stop_at_step(monkeypatch):
    """Request a stop after the n-th graphed step of a run (replays run no Python hooks)."""
    orig = graph.GraphedSteps.step

    def arm(n):
        count = [0]

        def step(self, s, selection, log=None):
            orig(self, s, selection, log)
            count[0] += 1
            if count[0] == n:
                request_stop()

        monkeypatch.setattr(graph.GraphedSteps, "step", step)

    yield arm
    monkeypatch.setattr(graph.GraphedSteps, "step", orig)
    clear_stop()


@pytest.mark.parametrize("first", [True, False])
def test_a_stopped_run_resumes_graphed(tmp_path, stop_at_step, monkeypatch, first):
    """Stopped in epoch 2 — graphed (captured at step 4 of epoch 1) before step 4, or eager before
    step 3 — and resumed with cuda_graph: the remaining 3 or 4 steps start with the warm-up (the
    hand-over of the optimizer state between the forms is what is checked; the capture after a
    resume is test_a_resumed_run_with_enough_steps_left_captures')."""
    ref = _run("gated_deltanet", cuda_graph=True)
    ck = tmp_path / "c.pt"
    if first:
        stop_at_step(11)
    else:  # eager: stop in the second epoch from the embedding's forward hook (eager steps run hooks)
        calls = [0]

        def hook(mod, args, out):
            calls[0] += 1
            if calls[0] == 11:  # epoch 1: 7 steps + 1 evaluation batch; epoch 2's step index 2
                request_stop()
    try:
        with pytest.raises(Interrupted, match="at epoch 2 step"):
            _run("gated_deltanet", cuda_graph=first, checkpoint_path=ck, hook=None if first else hook)
    finally:
        clear_stop()
    monkeypatch.undo()
    st = torch.load(ck, weights_only=False)
    assert st["epoch"] == 1 and all(g["capturable"] is False for g in st["optimizer"]["param_groups"])
    res = _run("gated_deltanet", cuda_graph=True, checkpoint_path=ck)
    assert res[0]["resumed_from"] == 1
    _losses_close(res, ref, GRAPH_CUDA_F32_LOSS_REL)
    assert _update_rel(res, ref) <= GRAPH_CUDA_F32_UPDATE_REL


def test_a_resumed_run_with_enough_steps_left_captures(tmp_path):
    """An eager checkpoint after epoch 1, resumed graphed for epochs 2-3: the capture happens in the
    resumed call (the optimizer state loaded from the eager form, made capturable)."""
    ck = tmp_path / "c.pt"
    lm = LMConfig(vocab_size=64, d_model=32, n_layers=2, mixer="gated_deltanet", num_heads=2, mlp="none")
    train, test = _data()
    cfg = TrainConfig(**{**_cfg().to_dict(), "epochs": 3})
    ref = train_cell(lm, train, test, cfg, progress="none")
    try:
        with pytest.raises(Interrupted, match="after epoch 1"):
            train_cell(lm, train, test, cfg, progress="none", checkpoint_path=ck,
                       on_epoch=lambda e, h: request_stop() if e == 1 else None)
    finally:
        clear_stop()
    res = train_cell(lm, train, test, cfg, progress="none", checkpoint_path=ck, cuda_graph=True)
    assert res["resumed_from"] == 1 and res["cuda_graph"] is True, res.get("cuda_graph_note")
    for x, y in zip(res["history"], ref["history"]):
        assert math.isclose(x["loss"], y["loss"], rel_tol=GRAPH_CUDA_F32_LOSS_REL), (x, y)


def _pageable_copy(mod, args, out):
    return out + torch.zeros(1, 1, 1).to(out.device)  # a host → device copy from pageable memory


def _host_sync(mod, args, out):
    return out * (1.0 + 0.0 * float(out.detach().sum()))  # .item()-like: the host waits for the device


@pytest.mark.parametrize("hook", [_pageable_copy, _host_sync], ids=["pageable_copy", "host_sync"])
def test_a_failed_capture_falls_back_loudly_and_leaves_the_process_clean(hook, capsys):
    eager = _run("gated_deltanet", hook=hook)
    res = _run("gated_deltanet", hook=hook, cuda_graph=True)
    assert res[0]["cuda_graph"] is False and res[0]["cuda_graph_note"].startswith("capture failed"), res[0]
    _losses_close(res, eager, GRAPH_CUDA_F32_LOSS_REL)
    assert _update_rel(res, eager) <= GRAPH_CUDA_F32_UPDATE_REL
    assert graph.capture_blocked() is None  # a clean failure: later cells still capture
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.manual_seed(0)
    a = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(0)
    assert torch.equal(a, torch.randn(4, device="cuda"))
    assert _run("gated_deltanet", cuda_graph=True)[0]["cuda_graph"] is True
