"""The training harness (fastweights.lab.train): learning, exact resumption, JSONL results, sweeps
that skip finished cells, accuracy reductions, progress lines, config validation."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from fastweights.lab.train import (
    ResultStore,
    TrainConfig,
    TrainError,
    _lr_lambda,
    accuracy,
    best_over,
    cell_key,
    run_sweep,
    train_cell,
)
from fastweights.models import LM, LMConfig
from fastweights.tasks.mqar import MQARConfig, make_mqar_splits
from fastweights.training import Progress
from tests.tolerances import RESUME_ACCURACY, RESUME_LOSS_ABS, RESUME_LOSS_REL, RESUME_LR_REL


def _data(seed: int, n_train: int = 512, n_test: int = 128, L: int = 32, kv: int = 4, vocab: int = 64):
    cfg = MQARConfig(vocab_size=vocab, seq_len=L, num_kv_pairs=kv, num_examples=n_train, seed=seed)
    return make_mqar_splits(cfg, MQARConfig(vocab_size=vocab, seq_len=L, num_kv_pairs=kv, num_examples=n_test,
                                            seed=seed))


def _lm(model="deltanet", d=32, vocab=64):
    return LMConfig(vocab_size=vocab, d_model=d, n_layers=2, mixer=model, num_heads=1, mlp="none")


def test_tiny_mqar_run_learns():
    # fixed seed: a threshold on a training run must not depend on luck (measured: ≈0.9 after 6 epochs)
    train, test = _data(seed=7, n_train=1024)
    cfg = TrainConfig(epochs=6, batch_size=32, lr=1e-2, warmup=0.05, seed=3, accuracy="examples")
    res = train_cell(_lm("deltanet"), train, test, cfg, progress="none")
    chance = 1 / 32  # 32 value ids
    assert res["accuracy"] > 10 * chance, res["history"]
    assert res["accuracy"] == max(h["accuracy"] for h in res["history"])
    assert res["history"][-1]["loss"] < res["history"][0]["loss"]
    assert res["params"] == LM(_lm("deltanet")).num_parameters()
    assert res["state_bytes"] > 0 and res["epochs_run"] == len(res["history"])


def test_resume_after_kill_loses_nothing(tmp_path):
    seed = int(torch.randint(0, 2**30, ()).item())
    train, test = _data(seed, n_train=128, n_test=32, L=16, kv=2)
    cfg = TrainConfig(epochs=4, batch_size=32, lr=3e-3, early_stop=None, seed=seed % 1000)
    lm = _lm("gated_deltanet", d=16)
    ref = train_cell(lm, train, test, cfg, progress="none")

    class Killed(Exception):
        pass

    def kill_after_2(epoch, entry):
        if epoch == 2:
            raise Killed

    ck = tmp_path / "cell.pt"
    with pytest.raises(Killed):
        train_cell(lm, train, test, cfg, checkpoint_path=ck, progress="none", on_epoch=kill_after_2)
    assert ck.exists() and not (tmp_path / "cell.pt.tmp").exists()
    res = train_cell(lm, train, test, cfg, checkpoint_path=ck, progress="none")
    assert res["resumed_from"] == 2 and res["epochs_run"] == 4
    for a, b in zip(ref["history"], res["history"]):
        assert a["epoch"] == b["epoch"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=RESUME_LOSS_REL, abs_tol=RESUME_LOSS_ABS), (a, b)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=RESUME_ACCURACY)
        assert a["lr"] == pytest.approx(b["lr"], rel=RESUME_LR_REL)
    # a finished cell is returned from its checkpoint without training
    again = train_cell(lm, train, test, cfg, checkpoint_path=ck, progress="none",
                       on_epoch=lambda *a: pytest.fail("trained a finished cell"))
    assert again["resumed_from"] == 4 and again["history"] == res["history"]


def test_early_stop_and_checkpoint_contents(tmp_path):
    train, test = _data(1, n_train=64, n_test=16, L=16, kv=2)
    cfg = TrainConfig(epochs=5, batch_size=32, lr=1e-3, early_stop=0.0)  # any accuracy > 0 stops
    res = train_cell(_lm(d=16), train, test, cfg, progress="none", checkpoint_path=tmp_path / "c.pt")
    if res["history"][0]["accuracy"] > 0:
        assert res["stopped_early"] and res["epochs_run"] == 1
    st = torch.load(tmp_path / "c.pt", weights_only=False)
    assert {"model", "optimizer", "scheduler", "rng", "epoch", "history", "finished"} <= set(st)
    assert st["finished"] and st["epoch"] == res["epochs_run"]


class _Fixed(nn.Module):
    """model(inputs) = one-hot logits of pred[row], the row id being inputs[:, 0]."""

    def __init__(self, pred):
        super().__init__()
        self.pred = pred
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.nn.functional.one_hot(self.pred[x[:, 0]], 10).float() + 0 * self.w


def test_accuracy_positions_vs_examples():
    labels = torch.tensor([[1, -100, 2, -100], [3, 4, 5, 6], [-100, -100, -100, -100]])
    pred = torch.tensor([[1, 0, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]])  # row 0: 1/2 right, row 1: 1/4 right
    inputs = torch.arange(3)[:, None].expand(3, 4).contiguous()
    m = _Fixed(pred)
    for bs in (1, 2, 3):  # rows are never split, so the batch size changes nothing
        assert accuracy(m, inputs, labels, batch_size=bs) == pytest.approx(2 / 6)
        # row 2 has no supervised position: left out of the per-example mean
        assert accuracy(m, inputs, labels, batch_size=bs, reduction="examples") == pytest.approx(0.375)
    with pytest.raises(TrainError):
        accuracy(m, inputs, labels, reduction="tokens")


def test_store_appends_reads_and_ignores_torn_line(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    assert store.records() == [] and not store.done("x")
    store.append({"key": "a", "accuracy": 0.5})
    store.append({"key": "b", "accuracy": 0.7, "t": torch.tensor(1.0)})
    with open(store.path, "a") as f:
        f.write('{"key": "c", "accur')  # a kill mid-write
    assert [r["key"] for r in store.records()] == ["a", "b"]
    assert store.done("a") and not store.done("c")
    assert json.loads(store.path.read_text().splitlines()[1])["t"] == 1.0


@dataclass(frozen=True)
class _Cell:
    name: str
    lr: float


def _fake_run(cell, progress=None, desc=None):
    return {"accuracy": {"a": 0.2, "b": 0.9}[cell.name] * cell.lr * 1000}


def test_run_sweep_skips_finished_and_best_over(tmp_path):
    cells = [_Cell(n, lr) for n in ("a", "b") for lr in (1e-3, 5e-4)]
    calls = []

    def run(cell, progress=None, desc=None):
        calls.append(cell)
        return _fake_run(cell)

    store = ResultStore(tmp_path / "s.jsonl")
    recs = run_sweep(cells[:2], store, run, progress="none")
    assert len(recs) == 2 and len(calls) == 2
    recs = run_sweep(cells, store, run, progress="none")  # only the two missing cells run
    assert len(recs) == 4 and len(calls) == 4 and calls[2:] == cells[2:]
    run_sweep(cells, store, run, progress="none")
    assert len(calls) == 4  # a finished sweep trains nothing
    assert [r["key"] for r in recs] == [cell_key(c) for c in cells]
    best = best_over(recs, over=("lr",))
    assert [(r["name"], r["best_lr"]) for r in best] == [("a", 1e-3), ("b", 1e-3)]
    assert best[1]["accuracy"] == pytest.approx(0.9)


def test_progress_plain_lines(capsys, tmp_path):
    train, test = _data(2, n_train=64, n_test=16, L=16, kv=2)
    buf = io.StringIO()  # not a TTY: "auto" means plain lines
    prog = Progress("auto", stream=buf)
    assert prog.mode == "plain"
    train_cell(_lm(d=16), train, test, TrainConfig(epochs=2, batch_size=32, early_stop=None), progress=prog,
               desc="tiny")
    lines = buf.getvalue().splitlines()
    assert [ln.split(" loss")[0] for ln in lines] == ["tiny: epoch 1/2", "tiny: epoch 2/2"]
    assert all("acc" in ln for ln in lines)
    store = ResultStore(tmp_path / "r.jsonl")
    run_sweep([_Cell("a", 1e-3)], store, _fake_run, progress="plain")
    out = capsys.readouterr().out
    assert "sweep: 1 cells" in out and "[1/1]" in out and "accuracy 0.2000" in out


def test_schedule_of_a_train_config():  # (the parameter groups: tests/training/test_step.py)
    f = _lr_lambda(TrainConfig(lr=1.0, warmup=10, min_lr=0.1), 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(110) == pytest.approx(0.1) and f(60) == pytest.approx(0.55)


@pytest.mark.parametrize("kw", [dict(epochs=0), dict(lr=0), dict(warmup=1.5), dict(decay_filter="x"),
                                dict(early_stop=2.0), dict(dtype="int8"), dict(min_lr=1.0, lr=0.1),
                                dict(batch_size=True), dict(betas=(0.9,))])
def test_config_errors(kw):
    with pytest.raises(TrainError):
        TrainConfig(**kw)


def test_data_errors():
    cfg = TrainConfig(epochs=1)
    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(TrainError, match="no supervised"):
        train_cell(_lm(d=16), (x, torch.full_like(x, -100)), (x, x), cfg, progress="none")
    with pytest.raises(TrainError, match="differ in shape"):
        train_cell(_lm(d=16), (x, x[:, :4]), (x, x), cfg, progress="none")


# ------------------------------------------------------------------------------------------ faults
def test_checkpoint_of_other_settings_is_refused_naming_them_and_fresh_restarts(tmp_path):
    train, test = _data(4, n_train=64, n_test=16, L=16, kv=2)
    ck = tmp_path / "c.pt"
    cfg5 = TrainConfig(epochs=2, batch_size=32, early_stop=None, seed=1)
    train_cell(_lm(d=16), train, test, cfg5, checkpoint_path=ck, progress="none", signature={"task": "a"})
    cfg1 = TrainConfig(epochs=1, batch_size=32, early_stop=None, seed=1)
    with pytest.raises(TrainError, match=r"epochs: 2 -> 1.*--fresh"):
        train_cell(_lm(d=16), train, test, cfg1, checkpoint_path=ck, progress="none", signature={"task": "a"})
    with pytest.raises(TrainError, match=r"model.d_model: 16 -> 32"):
        train_cell(_lm(d=32), train, test, cfg5, checkpoint_path=ck, progress="none", signature={"task": "a"})
    with pytest.raises(TrainError, match=r"cell.task: 'a' -> 'b'"):
        train_cell(_lm(d=16), train, test, cfg5, checkpoint_path=ck, progress="none", signature={"task": "b"})
    with pytest.raises(TrainError, match=r"train.dtype: 'float32' -> 'bfloat16'"):
        train_cell(_lm(d=16), train, test, TrainConfig(epochs=2, batch_size=32, early_stop=None, seed=1,
                                                       dtype="bfloat16"),
                   checkpoint_path=ck, progress="none", signature={"task": "a"})
    res = train_cell(_lm(d=16), train, test, cfg1, checkpoint_path=ck, progress="none", signature={"task": "a"},
                     fresh=True)
    assert res["resumed_from"] == 0 and res["epochs_run"] == 1
    assert torch.load(ck, weights_only=False)["signature"]["train"]["epochs"] == 1
    # a foreign model under the same name, without a signature (older checkpoints): one clean error
    st = torch.load(ck, weights_only=False)
    st.pop("signature")
    torch.save(st, ck)
    with pytest.raises(TrainError, match="holds another model"):
        train_cell(_lm(d=32), train, test, cfg1, checkpoint_path=ck, progress="none")


def test_stop_mid_epoch_saves_and_resumes_to_the_uninterrupted_history(tmp_path):
    from fastweights.training.control import Interrupted, clear_stop, request_stop

    seed = int(torch.randint(0, 2**30, ()).item())
    train, test = _data(seed, n_train=160, n_test=32, L=16, kv=2)
    cfg = TrainConfig(epochs=3, batch_size=32, lr=3e-3, early_stop=None, seed=seed % 1000)
    lm = _lm("gated_deltanet", d=16)
    ref = train_cell(lm, train, test, cfg, progress="none")
    calls = [0]

    def make(c):
        model = LM(c)

        def stop_on_8th(mod, args):
            # forwards: epoch 1 = 5 steps + 1 evaluation batch; the 8th is epoch 2's step index 1, so
            # the stop is seen before step index 2
            calls[0] += 1
            if calls[0] == 8:
                request_stop()

        model.embed.register_forward_pre_hook(stop_on_8th)
        return model

    ck = tmp_path / "c.pt"
    try:
        with pytest.raises(Interrupted, match=r"at epoch 2 step 2/5; saved to"):
            train_cell(lm, train, test, cfg, checkpoint_path=ck, progress="none", model_fn=make)
    finally:
        clear_stop()
    st = torch.load(ck, weights_only=False)
    assert st["epoch"] == 1 and st["step"] == 2 and not st["finished"]
    res = train_cell(lm, train, test, cfg, checkpoint_path=ck, progress="none")
    assert res["resumed_from"] == 1 and res["epochs_run"] == 3
    for a, b in zip(ref["history"], res["history"], strict=True):
        assert a["epoch"] == b["epoch"] and a["lr"] == pytest.approx(b["lr"], rel=RESUME_LR_REL)
        assert math.isclose(a["loss"], b["loss"], rel_tol=RESUME_LOSS_REL, abs_tol=RESUME_LOSS_ABS), (a, b)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=RESUME_ACCURACY)


def test_append_after_a_torn_line_starts_a_new_line_and_malformed_records_are_reported(tmp_path):
    from fastweights.lab.train import NUMBER

    store = ResultStore(tmp_path / "r.jsonl", required={"model": str, "accuracy": NUMBER})
    store.append({"key": "a", "model": "m", "accuracy": 0.5})
    with open(store.path, "a") as f:
        f.write('{"key": "b", "model": "m", "accur')  # a kill mid-append
    store.append({"key": "c", "model": "m", "accuracy": 0.7})
    with open(store.path, "a") as f:
        f.write(json.dumps({"key": "d", "model": "m", "accuracy": "0.9"}) + "\n")
        f.write(json.dumps({"key": "e", "accuracy": 0.9}) + "\n")
        f.write(json.dumps({"key": "f", "model": "m", "accuracy": True}) + "\n")
    assert [r["key"] for r in store.records()] == ["a", "c"]
    assert [n for n, _ in store.skipped] == [2, 4, 5, 6]
    warning = store.warning()
    assert "skipped 4 malformed line(s)" in warning and "line 4: accuracy is '0.9', not a number" in warning
    assert "line 5: no 'model'" in warning


@dataclass(frozen=True)
class _Cell2:
    name: str


def test_run_sweep_keys_by_context_and_fresh_reruns(tmp_path):
    calls = []

    def run(cell, progress=None, desc=None):
        calls.append(cell.name)
        return {"accuracy": 0.1 * len(calls)}

    store = ResultStore(tmp_path / "s.jsonl")
    cells = [_Cell2("a"), _Cell2("b")]
    r32 = run_sweep(cells, store, run, progress="none", context={"dtype": "float32", "device": "cpu"})
    assert [r["dtype"] for r in r32] == ["float32", "float32"] and len(calls) == 2
    r16 = run_sweep(cells, store, run, progress="none", context={"dtype": "bfloat16", "device": "cpu"})
    assert len(calls) == 4 and [r["dtype"] for r in r16] == ["bfloat16", "bfloat16"]  # not taken for done
    again = run_sweep(cells, store, run, progress="none", context={"dtype": "float32", "device": "cpu"})
    assert len(calls) == 4 and [r["accuracy"] for r in again] == [r["accuracy"] for r in r32]
    fresh = run_sweep(cells, store, run, progress="none", context={"dtype": "float32", "device": "cpu"},
                      fresh=True)
    assert len(calls) == 6 and [r["accuracy"] for r in fresh] == pytest.approx([0.5, 0.6])
    later = run_sweep(cells, store, run, progress="none", context={"dtype": "float32", "device": "cpu"})
    assert len(calls) == 6 and [r["accuracy"] for r in later] == pytest.approx([0.5, 0.6])  # newest wins


def test_run_sweep_skip_sees_this_runs_records_so_far_and_skipped_cells_get_no_record(capsys, tmp_path):
    calls, seen = [], []

    def run(cell, progress=None, desc=None):
        calls.append(cell.name)
        return {"accuracy": 0.5}

    def skip(cell, records):
        seen.append((cell.name, [r["name"] for r in records]))
        if cell.name == "b":
            return "b is out of reach"
        return "c ran" if cell.name == "d" and any(r["name"] == "c" for r in records) else None

    store = ResultStore(tmp_path / "s.jsonl")
    cells = [_Cell2(n) for n in "abcd"]
    f32, bf16 = {"dtype": "float32", "device": "cpu"}, {"dtype": "bfloat16", "device": "cpu"}
    run_sweep(cells[:1], store, run, progress="none", context=bf16)  # another dtype's record of "a"
    recs = run_sweep(cells, store, run, progress="plain", context=f32, skip=skip, describe=lambda c: c.name)
    assert calls == ["a", "a", "c"] and [r["name"] for r in recs] == ["a", "c"]
    assert seen == [("a", []), ("b", ["a"]), ("c", ["a"]), ("d", ["a", "c"])]  # not the bfloat16 "a"
    assert [(r["name"], r["dtype"]) for r in store.records()] == [("a", "bfloat16"), ("a", "float32"),
                                                                   ("c", "float32")]
    out = capsys.readouterr().out
    assert "b: skipped, b is out of reach" in out and "d: skipped, c ran" in out
    run_sweep(cells, store, run, progress="none", context=f32)  # no record: a later run without skip trains them
    assert calls[3:] == ["b", "d"]


def test_a_pools_manager_thread_is_joined_before_concurrent_futures_exit_hook():
    """run_sweep shuts its worker pool down without waiting (Ctrl-C's line stays prompt); CPython
    3.11's exit hook of concurrent.futures then raced the manager thread closing its wake-up pipe
    ("Bad file descriptor" from threading._shutdown in one Ctrl-C test run of six). The pool's
    manager is joined by a hook that threading runs first (its hooks run in reverse order)."""
    import concurrent.futures.process as cfp
    import threading

    from fastweights.lab import train as lab_train

    done = threading.Event()
    t = threading.Thread(target=done.wait)
    t.start()
    lab_train._join_at_exit(t)
    hooks = [getattr(h, "func", h) for h in threading._threading_atexits]
    assert hooks.index(lab_train._join_unjoined) > hooks.index(cfp._python_exit)  # registered later: runs first
    done.set()
    lab_train._join_unjoined()
    assert not t.is_alive() and not lab_train._UNJOINED
