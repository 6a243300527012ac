"""`fastweights mad` (fastweights.lab.mad): MAD's macro accuracy, scoring (best over the grid, mean over
settings, mean over tasks) on a hand-computed example, the AutoEncoder backbone, cells and presets,
an end-to-end tiny run with resume, tables and CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fastweights.lab import mad as lab
from fastweights.tasks.mad import mad_settings


def test_macro_accuracy_hand_computed():
    # -100 dropped; class 0: 1 of 2 right, class 1: 1 of 1 -> (0.5 + 1) / 2
    assert lab.macro_accuracy(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 0, 1, -100]), 4) == pytest.approx(0.75)
    # class 2 is predicted but never a target: it counts 0 (torchmetrics' macro average) -> (0.5 + 0) / 2
    assert lab.macro_accuracy(torch.tensor([0, 2]), torch.tensor([0, 0]), 4) == pytest.approx(0.25)
    # micro pools positions
    assert lab.micro_accuracy(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 0, 1, -100])) == pytest.approx(2 / 3)
    # perfect predictions
    t = torch.randint(0, 8, (50,))
    assert lab.macro_accuracy(t.clone(), t, 8) == 1.0


def test_scores_aggregate_like_mad():
    """Best over lr x wd per setting, mean over settings per task, mean over tasks."""
    recs = []

    def add(model, task, setting, lr, wd, acc):
        recs.append(dict(model=model, task=task, setting=setting, lr=lr, wd=wd, accuracy=acc))

    # model A, task t1: setting s1 best 0.9 (of 0.5, 0.9), setting s2 best 0.7 -> task 80
    add("A", "in-context-recall", "baseline", 1e-3, 0.0, 0.5)
    add("A", "in-context-recall", "baseline", 5e-4, 0.1, 0.9)
    add("A", "in-context-recall", "seq_len=256", 1e-3, 0.0, 0.7)
    add("A", "in-context-recall", "seq_len=256", 5e-4, 0.0, 0.2)
    # model A, task t2: one setting, best 0.4 -> task 40
    add("A", "compression", "baseline", 1e-3, 0.0, 0.4)
    add("A", "compression", "baseline", 1e-3, 0.1, 0.1)
    # model B, task t1 only: 0.3
    add("B", "in-context-recall", "baseline", 1e-3, 0.0, 0.3)
    sc = lab.scores(recs)
    assert sc["A"]["settings"]["in-context-recall"] == {"baseline": pytest.approx(90.0),
                                                        "seq_len=256": pytest.approx(70.0)}
    assert sc["A"]["tasks"] == {"in-context-recall": pytest.approx(80.0), "compression": pytest.approx(40.0)}
    assert sc["A"]["mad"] == pytest.approx(60.0)
    assert sc["A"]["best"]["in-context-recall"]["baseline"] == (5e-4, 0.1)
    assert sc["B"]["mad"] == pytest.approx(30.0)
    overall = lab.format_overall(recs).splitlines()
    assert overall[0] == "| model | Compress | ICR | MAD score |"
    assert overall[2] == "| A | 40.0 | 80.0 | 60.0 |"
    assert overall[3] == "| B | – | 30.0 | 30.0 |"
    tables = lab.format_task_tables(recs)
    assert "| A | 90.0 | 70.0 | 80.0 |" in tables


def test_autoencoder_shape_and_pooling():
    from fastweights.models import LMConfig

    cfg = LMConfig(vocab_size=16, d_model=16, n_layers=1, mixer="deltanet", num_heads=2, mlp="none")
    ae = lab.MADAutoEncoder(cfg, max_length=64)
    x = torch.randint(0, 16, (3, 32))
    out = ae(x)
    assert out.shape == (3, 32, 16)
    # the decoder sees only the last position's code: changing only the last token changes every output,
    # while the code is a function of the whole (causal) prefix
    y = x.clone()
    y[:, 0] = (y[:, 0] + 1) % 16
    assert not torch.allclose(ae(y), out)
    with pytest.raises(ValueError, match="max_length"):
        ae(torch.randint(0, 16, (1, 65)))


def test_presets_and_cells():
    full = lab.preset("full")
    assert full.lrs == (1e-4, 5e-4, 1e-3) and full.wds == (0.0, 0.1) and full.epochs == 200
    assert full.batch_size == 128 and full.d_model == 128 and full.test_examples == 1280
    n_settings = sum(len(mad_settings(t)) for t in lab.TASKS)
    assert n_settings == 66
    assert len(lab.cells(full)) == len(full.models) * 66 * 6
    small = lab.preset("small")
    per_task = {t: [n for n, _ in small.task_settings(t)] for t in small.tasks}
    assert per_task["memorization"] == ["baseline"]
    assert all(v == ["num_examples=800"] for t, v in per_task.items() if t != "memorization")
    assert len(lab.cells(small)) == len(small.models) * 6 * len(small.lrs) * len(small.wds)
    assert lab.preset("small", settings=("all",)).settings is None
    with pytest.raises(ValueError, match="no setting"):
        lab.MADRunConfig(settings=("nonexistent",))
    with pytest.raises(ValueError):
        lab.MADRunConfig(models=("nope",))
    with pytest.raises(ValueError):
        lab.MADRunConfig(tasks=("copying",))


def _tiny(tmp_path, **kw):
    base = dict(models=("deltanet",), tasks=("memorization", "compression"), settings=("baseline",), lrs=(1e-3,),
                wds=(0.0, 0.1), d_model=16, n_layers=1, num_heads=2, mlp="none", epochs=1, batch_size=32,
                train_examples=32, test_examples=16, threads=1, mode="local", out=str(tmp_path / "mad"))
    base.update(kw)
    return lab.MADRunConfig(**base)


def test_end_to_end_tiny_run_and_resume(tmp_path):
    cfg = _tiny(tmp_path)
    recs = lab.run_mad(cfg, progress="none")
    assert len(recs) == 1 * 2 * 1 * 1 * 2  # models x tasks x settings x lrs x wds
    for r in recs:
        assert {"model", "task", "setting", "lr", "wd", "accuracy", "accuracy_macro", "accuracy_micro"} <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["accuracy"] == r["accuracy_macro"]
    store = tmp_path / "mad" / "mad.jsonl"
    assert len(store.read_text().splitlines()) == 4
    assert not list((tmp_path / "mad" / "checkpoints").glob("*.pt"))  # cleaned once recorded

    # Resume: nothing is trained again; a widened grid trains only the new cells.
    again = lab.run_mad(cfg, progress="none")
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in recs]
    assert len(store.read_text().splitlines()) == 4
    wider = lab.run_mad(_tiny(tmp_path, lrs=(1e-3, 5e-4)), progress="none")
    assert len(wider) == 8 and len(store.read_text().splitlines()) == 8

    sc = lab.scores(wider)
    assert set(sc["deltanet"]["tasks"]) == {"memorization", "compression"}
    md = lab.write_report(cfg, wider, wall_s=1.0, command="fastweights mad", preset_name="tiny")
    text = md.read_text()
    assert "MAD score" in text and "Published" in text and "**compression**" in text
    assert lab.plot_mad(wider, tmp_path / "mad" / "mad.png").stat().st_size > 1000


def test_published_table():
    lines = lab.format_published().splitlines()
    assert len(lines) == 2 + 6
    assert lines[-1] == "| DeltaNet | deltanet | 42.2 | 35.7 | 100.0 | 52.8 | 100.0 | 100.0 | 71.8 |"


def test_cli_parses_and_runs(tmp_path, capsys):
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    p = lab.add_cli(sub)
    out = tmp_path / "cli"
    args = p.parse_args(["--models", "mamba2", "--tasks", "memorization", "--settings", "baseline", "--lrs", "1e-3",
                         "--wds", "0", "--d-model", "16", "--n-layers", "1", "--num-heads", "2", "--epochs", "1",
                         "--train-examples", "32", "--test-examples", "16", "--mode", "local", "--out", str(out),
                         "--progress", "none"])
    assert args.fn is lab.cli_main
    assert lab.cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "MAD score" in printed and "mamba2" in printed
    assert (out / "mad.md").exists() and (out / "mad.png").exists()
    rec = json.loads((out / "mad.jsonl").read_text().splitlines()[0])
    assert rec["model"] == "mamba2" and rec["task"] == "memorization"
    assert lab.cli_main(p.parse_args(["--settings", "nope", "--out", str(out)])) == 2


@pytest.mark.parametrize("argv, flag", [(["--device", "tpu"], "--device"), (["--threads", "-2"], "--threads"),
                                        (["--lrs", "nan"], "--lrs"), (["--epochs", "0"], "--epochs"),
                                        (["--models", "foo"], "--models"), (["--out", "/proc/version/x"], "--out"),
                                        (["--preset", "gpu"], "--preset gpu"),
                                        (["--mode", "ddp"], "--mode ddp runs under torchrun"),
                                        (["--mode", "spread"], "--mode spread runs under torchrun")])
def test_cli_rejects_bad_values_in_one_line(argv, flag, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if torch.cuda.is_available() and flag == "--preset gpu":
        pytest.skip("the gpu preset runs here")
    p = lab.add_cli(argparse.ArgumentParser().add_subparsers(dest="command"))
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "x")]
    assert lab.cli_main(p.parse_args(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}"), err
    assert not (tmp_path / "x").exists()
