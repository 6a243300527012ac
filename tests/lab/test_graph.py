"""fastweights.lab.graph on the CPU: the graphed training path of `train_cell` run without a capture
(`_EMULATE_ON_CPU`: every step eager through the body the graph captures) equals the eager loop —
losses, lrs and weights, with a partial last batch, warm-up, clipping and a cosine — and so do its
stops, checkpoints (written in the eager optimizer form, resumed in either mode) and its handling of
a non-finite loss; with cuda_graph asked for on the CPU the eager loop runs unchanged, bit for bit.
The capture itself is tests/cuda/test_graph_train.py's (`pytest -m cuda`)."""

from __future__ import annotations

import math

import pytest
import torch

from fastweights.lab import graph
from fastweights.lab.train import IGNORE_INDEX, TrainConfig, best_over, train_cell
from fastweights.models import LM, LMConfig
from fastweights.tasks.mqar import MQARConfig, make_mqar_splits
from fastweights.training.control import Interrupted, clear_stop, request_stop
from tests.tolerances import GRAPH_EMULATED_F64, GRAPH_EMULATED_LOSS_REL


def _data(seed=1, n_train=200, n_test=32, L=32, kv=4, vocab=64):
    """MQAR pairs with about a third of the training targets dropped: the examples differ in their
    number of supervised positions (spare slots in `supervised_slots`)."""
    cfg = MQARConfig(vocab_size=vocab, seq_len=L, num_kv_pairs=kv, num_examples=n_train, seed=seed)
    (x, y), test = make_mqar_splits(cfg, MQARConfig(vocab_size=vocab, seq_len=L, num_kv_pairs=kv,
                                                    num_examples=n_test, seed=seed))
    drop = torch.rand(y.shape, generator=torch.Generator().manual_seed(seed)) < 0.3
    y = y.masked_fill(drop, IGNORE_INDEX)
    y[:, -1] = x[:, 0]  # (every example keeps a supervised position)
    return (x, y), test


LM_CFG = LMConfig(vocab_size=64, d_model=16, n_layers=2, mixer="gated_deltanet", num_heads=2, mlp="none")
# 200 examples in batches of 32: 7 steps per epoch, the last of 8 examples; a warm-up of 4 steps
CFG = TrainConfig(epochs=2, batch_size=32, lr=1e-2, warmup=4, grad_clip=0.5, early_stop=None, seed=3,
                  dtype="float64")


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(graph, "_EMULATE_ON_CPU", True)


def _run(cfg=CFG, data=None, hook=None, **kw):
    box = {}

    def make(c):
        m = LM(c)
        if hook is not None:
            m.embed.register_forward_hook(hook)
        box["model"] = m
        return m

    train, test = data or _data()
    res = train_cell(LM_CFG, train, test, cfg, progress="none", model_fn=make, **kw)
    return res, box["model"].state_dict()


def _close(a, b):
    (ra, wa), (rb, wb) = a, b
    assert len(ra["history"]) == len(rb["history"])
    for x, y in zip(ra["history"], rb["history"]):
        assert x["lr"] == y["lr"] and x["epoch"] == y["epoch"]
        assert math.isclose(x["loss"], y["loss"], rel_tol=GRAPH_EMULATED_LOSS_REL), (x, y)
    for k in wa:
        assert (wa[k] - wb[k]).abs().max().item() <= GRAPH_EMULATED_F64, k


def test_supervised_slots_hold_every_supervised_position_in_order():
    y = torch.full((3, 6), IGNORE_INDEX)
    y[0, [1, 4]] = torch.tensor([7, 8])
    y[1, [0, 2, 5]] = torch.tensor([1, 2, 3])  # row 2: nothing supervised
    pos, tgt = graph.supervised_slots(y)
    assert pos.tolist() == [[1, 4, 0], [0, 2, 5], [0, 0, 0]]
    assert tgt.tolist() == [[7, 8, IGNORE_INDEX], [1, 2, 3], [IGNORE_INDEX] * 3]


def test_graphed_steps_equal_the_eager_steps(emulate):
    eager = _run()
    graphed = _run(cuda_graph=True)
    assert graphed[0]["cuda_graph"] is False and "emulated" in graphed[0]["cuda_graph_note"]
    _close(eager, graphed)


def test_cuda_graph_on_the_cpu_runs_the_eager_loop_bit_for_bit_and_says_so():
    cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-2, warmup=2, seed=3)  # fp32: rounding would show
    (ra, wa), (rb, wb) = _run(cfg), _run(cfg, cuda_graph=True)
    assert ra["cuda_graph"] is False and "cuda_graph_note" not in ra
    assert rb["cuda_graph"] is False and rb["cuda_graph_note"] == "CUDA only (device cpu)"
    assert ra["history"][0]["loss"] == rb["history"][0]["loss"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        _run(cfg, cuda_graph="yes")
    # the new fields are results, not configuration: best_over keeps one record per configuration
    recs = [{"model": "m", "lr": 1.0, "accuracy": 0.5, "cuda_graph": True},
            {"model": "m", "lr": 2.0, "accuracy": 0.7, "cuda_graph": False, "cuda_graph_note": "x"}]
    assert [r["lr"] for r in best_over(recs)] == [2.0]


def _stop_at(call):
    calls = [0]

    def hook(mod, args, out):
        calls[0] += 1
        if calls[0] == call:
            request_stop()

    return hook


@pytest.mark.parametrize("first, then", [(True, True), (True, False), (False, True)])
def test_a_stop_mid_epoch_saves_in_the_eager_form_and_resumes_either_way(emulate, tmp_path, first, then):
    ref = _run()
    ck = tmp_path / "c.pt"
    # forwards: epoch 1 = 7 steps + 1 evaluation batch; the 10th is epoch 2's step index 1
    try:
        with pytest.raises(Interrupted, match=r"at epoch 2 step 2/7"):
            _run(hook=_stop_at(10), checkpoint_path=ck, cuda_graph=first)
    finally:
        clear_stop()
    st = torch.load(ck, weights_only=False)
    assert st["epoch"] == 1 and st["step"] == 2 and st["loss_n"] == 2
    assert all(g["capturable"] is False for g in st["optimizer"]["param_groups"])
    assert all(s["step"].device.type == "cpu" for s in st["optimizer"]["state"].values())
    res = _run(checkpoint_path=ck, cuda_graph=then)
    assert res[0]["resumed_from"] == 1
    _close(ref, res)


def test_a_non_finite_loss_stops_the_cell_with_the_eager_epoch_loss(emulate):
    def poison(step):
        calls = [0]

        def hook(mod, args, out):
            calls[0] += 1
            return out * float("nan") if calls[0] == step else out

        return hook

    # step 5 of epoch 1 (forward 5) gives a nan loss: the cell stops after that epoch, whose loss is
    # the mean of its first 4 steps; graphed, it is seen when the losses are read, at the epoch's end
    (ra, _), (rb, _) = _run(hook=poison(5)), _run(hook=poison(5), cuda_graph=True)
    for r in (ra, rb):
        assert r["stopped_early"] and r["epochs_run"] == 1 and math.isfinite(r["history"][0]["loss"])
    assert math.isclose(ra["history"][0]["loss"], rb["history"][0]["loss"], rel_tol=GRAPH_EMULATED_LOSS_REL)


def test_optimizer_forms_convert_both_ways():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(2)
    opt.step()
    sd = graph.eager_state_dict(opt)
    assert sd["param_groups"][0]["capturable"] is False and sd["state"][0]["step"].item() == 1
    graph.set_capturable(opt, True)
    assert opt.param_groups[0]["capturable"] is True
    graph.set_capturable(opt, False)
    assert opt.state[p]["step"].device.type == "cpu" and opt.param_groups[0]["capturable"] is False
    assert graph.account([1.0, 2.0, float("inf"), 4.0], 3, 0.5, 1) == (3.5, 3, 5)
    assert graph.account([1.0], 0, 0.0, 0) == (1.0, 1, None)
