"""MQAR sweeps (fastweights.lab.mqar): presets build, the GPU presets' largest models take a step,
mixtures pad without leaking, the CLI writes results/table/plots and a re-run trains nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from fastweights.lab import mqar
from fastweights.lab.mqar import PRESETS, MQARCell, build_model, cell_data, format_table, make_cells, plot_mqar


def test_preset_grids():
    assert len(make_cells(PRESETS["zoology-fig2"])) == 7 * 4 * 4 * 4  # models × d × (L, kv) × lr
    based = make_cells(PRESETS["based-standard"])
    assert len(based) == 5 * 3 * 4
    assert sorted({c.d_model for c in based if c.model == "softmax_attention"}) == [32, 64, 128]
    assert {c.setting for c in based} == {"based-standard"}
    fig2 = make_cells(PRESETS["zoology-fig2"])
    assert {c.batch_size for c in fig2 if c.train_segments[0][0] == 512} == {128}
    assert {c.lr for c in fig2} == {1e-4, 4.642e-4, 2.154e-3, 1e-2}
    quick = make_cells(PRESETS["quick"], models=["deltanet"], d_models=[16], settings=[(32, 4)], lrs=[1e-3, 1e-2])
    assert [(c.model, c.d_model, c.setting, c.lr) for c in quick] == [("deltanet", 16, "L32-kv4", 1e-3),
                                                                    ("deltanet", 16, "L32-kv4", 1e-2)]


@pytest.mark.parametrize("name", ["zoology-fig2", "based-standard"])
def test_gpu_presets_construct_and_step(name):
    from fastweights.lab.train import Supervised

    cells = make_cells(PRESETS[name])
    d_max, d_min = max(c.d_model for c in cells), min(c.d_model for c in cells)
    L_max = max(c.seq_len for c in cells)
    for model in PRESETS[name].models:
        mine = [c for c in cells if c.model == model]
        big = max(mine, key=lambda c: c.d_model)
        assert build_model(big).num_parameters() > 0  # the largest model of the grid builds
        # one optimizer step on the longest sequence of the grid (one example; the smallest d_model,
        # for the test's time budget) with the cell's own optimizer settings
        c = min((c for c in mine if c.seq_len == L_max or c.setting == name), key=lambda c: (c.d_model, -c.lr))
        small = dataclasses.replace(c, train_segments=tuple((L, n, 1) for L, n, _ in c.train_segments[-1:]),
                                    test_segments=c.test_segments[:1])
        (x, y), _ = cell_data(small)
        assert x.shape == (1, max(s[0] for s in c.train_segments))
        net = build_model(small)
        opt = torch.optim.AdamW(net.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        logits, tgt, _ = Supervised(net)(x, y)
        loss = F.cross_entropy(logits, tgt)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss) and tgt.numel() == c.train_segments[-1][1]
    assert d_max > d_min


def test_mixture_padding_and_splits():
    cell = MQARCell(model="deltanet", d_model=16, setting="mix", lr=1e-3, vocab_size=128,
                    train_segments=((16, 2, 5), (32, 8, 3)), test_segments=((16, 4, 4), (32, 8, 2)))
    (xtr, ytr), (xte, yte) = cell_data(cell)
    assert xtr.shape == (8, 32) and xte.shape == (6, 32)
    assert (ytr[:5, 16:] == -100).all() and (xtr[:5, 16:] == 0).all()  # padding: unsupervised
    assert ((ytr[:5] != -100).sum(1) == 2).all() and ((ytr[5:] != -100).sum(1) == 8).all()
    assert ((yte[:4] != -100).sum(1) == 4).all()
    assert not torch.equal(xtr[5:7], xte[4:6])  # train and test come from disjoint seed ranges


def test_overrides_conv_gate_and_state_bytes():
    base = MQARCell(model="gated_deltanet", d_model=32, setting="s", lr=1e-3, vocab_size=64,
                    train_segments=((32, 4, 4),), test_segments=((32, 4, 4),))
    m = build_model(base)
    assert m.blocks[0].mixer.g_proj is not None and m.blocks[0].mixer.q_conv is not None
    m = build_model(dataclasses.replace(base, out_gate="none", conv="none"))
    assert m.blocks[1].mixer.g_proj is None and m.blocks[1].mixer.q_conv is None
    la = build_model(dataclasses.replace(base, model="linear_attention", conv="qkv", conv_size=3))
    assert la.blocks[0].mixer.v_conv.kernel_size == 3
    sm = dataclasses.replace(base, model="softmax_attention")
    r1 = build_model(sm).state_size(1, 32)
    r2 = build_model(sm).state_size(1, 64)
    assert r2 > r1 > 0  # the KV cache grows with the length
    with pytest.raises(ValueError):
        dataclasses.replace(base, conv="qk_only")


def _records():
    recs = []
    for m, accs in (("softmax_attention", (0.9, 1.0)), ("linear_attention", (0.1, 0.3))):
        for d, a in zip((16, 32), accs):
            for lr, f in ((1e-3, 0.5), (1e-2, 1.0)):
                recs.append({"model": m, "d_model": d, "setting": "L32-kv4", "lr": lr, "accuracy": a * f,
                             "state_bytes": d * 100})
    return recs


def test_table_and_plots(tmp_path):
    recs = _records()
    table = format_table(recs)
    assert "[L32-kv4]" in table and "d=16" in table and "d=32" in table
    row = next(ln for ln in table.splitlines() if ln.startswith("linear_attention"))
    assert "0.100" in row and "0.300" in row and "0.01" in row  # best over lr
    pngs = plot_mqar(recs, tmp_path)
    assert [p.name for p in pngs] == ["mqar_d_model.png", "mqar_state.png"]
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_cli_runs_writes_and_skips(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--models", "deltanet", "linear_attention", "--d-models", "16", "--seq-lens", "16", "--kv-pairs", "2",
            "--lrs", "0.01", "--epochs", "1", "--train-examples", "32", "--test-examples", "16", "--out", str(out),
            "--workers", "1", "--progress", "plain"]
    assert mqar.main(argv) == 0
    text = capsys.readouterr().out
    assert "[L16-kv2]" in text and "deltanet" in text and "linear_attention" in text
    recs = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and {r["model"] for r in recs} == {"deltanet", "linear_attention"}
    assert all(0 <= r["accuracy"] <= 1 and r["state_bytes"] > 0 and len(r["history"]) == 1 for r in recs)
    assert (out / "mqar_d_model.png").exists() and (out / "mqar_state.png").exists()
    assert mqar.main(argv) == 0
    text = capsys.readouterr().out
    assert "2 already done, 0 to run here" in text and "epoch 1/1" not in text
    assert len((out / "results.jsonl").read_text().splitlines()) == 2


def test_cuda_graph_is_recorded_per_cell_and_no_part_of_its_key(tmp_path, capsys):
    """--cuda-graph (default: on for a CUDA --device) reaches every cell and its record; a sweep resumed
    with the other setting skips the same finished cells (on the CPU the cell trains eagerly and says so)."""
    p = argparse.ArgumentParser()
    mqar.add_arguments(p)
    assert mqar.cuda_graph_default(p.parse_args(["--device", "cuda"])) is mqar.CUDA_GRAPH_BY_DEFAULT is False
    assert mqar.cuda_graph_default(p.parse_args(["--device", "cuda", "--cuda-graph"])) is True
    assert mqar.cuda_graph_default(p.parse_args(["--device", "cpu"])) is False
    assert mqar.cuda_graph_default(p.parse_args(["--device", "cuda", "--no-cuda-graph"])) is False
    out = tmp_path / "run"
    argv = ["--models", "deltanet", "--d-models", "16", "--seq-lens", "16", "--kv-pairs", "2", "--lrs", "0.01",
            "--epochs", "1", "--train-examples", "32", "--test-examples", "16", "--out", str(out), "--workers", "1",
            "--progress", "plain"]
    assert mqar.main([*argv, "--cuda-graph"]) == 0
    assert "cuda_graph: CUDA only (device cpu); training eagerly" in capsys.readouterr().out
    rec = json.loads((out / "results.jsonl").read_text())
    assert rec["cuda_graph"] is False and rec["cuda_graph_note"] == "CUDA only (device cpu)"
    assert "cuda_graph" not in rec["key"]
    assert mqar.main([*argv, "--no-cuda-graph"]) == 0
    assert "1 already done, 0 to run here" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert mqar.main(["--models", "nope", "--dry-run"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert mqar.main(["--seq-lens", "16", "--kv-pairs", "8", "--dry-run"]) == 2
    assert mqar.main(["--preset", "based-standard", "--dry-run"]) == 0
    assert "60 cells" in capsys.readouterr().out


def test_add_cli_registers_subcommand():
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    mqar.add_cli(sub)
    args = p.parse_args(["mqar", "--preset", "quick", "--d-models", "32", "--spread"])
    assert args.fn is mqar.cli_main and args.d_models == [32] and args.spread and not args.ddp


@pytest.mark.parametrize("argv, flag", [
    (["--epochs", "0"], "--epochs"), (["--epochs", "-1"], "--epochs"), (["--train-examples", "0"], "--train-examples"),
    (["--test-examples", "0"], "--test-examples"), (["--lrs", "-1"], "--lrs"), (["--lrs", "nan"], "--lrs"),
    (["--seq-lens", "0"], "--seq-lens"), (["--seq-lens", "63", "--kv-pairs", "4"], "--seq-lens"),
    (["--device", "tpu"], "--device"), (["--threads", "-1"], "--threads"), (["--workers", "0"], "--workers"),
    (["--ddp"], "--ddp"), (["--models", "foo"], "--models"), (["--out", "/proc/version/x"], "--out")])
def test_cli_rejects_bad_values_before_any_work(argv, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "run")]
    assert mqar.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}"), err
    assert not (tmp_path / "run").exists()  # nothing started


def test_cli_cuda_without_cuda_is_refused(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this check is about a CPU-only build")
    assert mqar.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda: this torch build sees no CUDA device" in capsys.readouterr().err


def test_other_dtype_is_not_taken_for_done_and_fresh_retrains(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--models", "deltanet", "--d-models", "16", "--seq-lens", "16", "--kv-pairs", "2", "--lrs", "0.01",
            "--epochs", "1", "--train-examples", "32", "--test-examples", "16", "--out", str(out), "--workers", "1",
            "--progress", "plain"]
    assert mqar.main(argv) == 0
    assert mqar.main([*argv, "--dtype", "float64"]) == 0
    text = capsys.readouterr().out
    assert "0 already done, 1 to run here" in text.split("MQAR, preset")[1]  # float64 trained its own cell
    recs = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["dtype"], r["device"]) for r in recs] == [("float32", "cpu"), ("float64", "cpu")]
    assert len(list((out / "checkpoints").glob("*.pt"))) == 2  # one checkpoint per dtype
    assert mqar.main([*argv, "--fresh"]) == 0
    text = capsys.readouterr().out
    assert "0 already done, 1 to run here" in text and "epoch 1/1" in text
    assert "resumed" not in text  # the finished checkpoint was discarded, not returned
    assert len((out / "results.jsonl").read_text().splitlines()) == 3


def test_cli_skips_and_reports_malformed_records(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    argv = ["--models", "deltanet", "--d-models", "16", "--seq-lens", "16", "--kv-pairs", "2", "--lrs", "0.01",
            "--epochs", "1", "--train-examples", "32", "--test-examples", "16", "--out", str(out), "--workers", "1",
            "--progress", "none"]
    (out / "results.jsonl").write_text(json.dumps({"key": "x", "model": "deltanet", "d_model": 16, "setting": "s",
                                                   "lr": 0.01, "accuracy": "high"}) + "\n"
                                       + json.dumps({"key": "y", "accuracy": 0.5}) + "\n" + '{"key": "z", "mo')
    assert mqar.main(argv) == 0
    cap = capsys.readouterr()
    assert "skipped 3 malformed line(s)" in cap.err and "accuracy is 'high', not a number" in cap.err
    assert "[L16-kv2]" in cap.out
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["model"] == "deltanet"  # after the torn line, not on it


@pytest.mark.parametrize("target", ["main process", "process group"])  # `kill -INT <pid>`; Ctrl-C in a terminal
def test_sigint_to_the_cli_saves_the_running_cells_and_says_how_to_resume(tmp_path, target):
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastweights.cli", "mqar", "--models", "deltanet", "linear_attention",
           "--d-models", "16", "--seq-lens", "16", "--kv-pairs", "2", "--lrs", "1e-4", "--epochs", "400",
           "--train-examples", "64", "--test-examples", "16", "--out", str(out), "--workers", "2",
           "--threads", "1", "--progress", "none"]
    proc = subprocess.Popen(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err_lines = []  # (when read, line) of its stderr, read as it comes

    def read_stderr():
        for line in proc.stderr:
            err_lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while len(list((out / "checkpoints").glob("*.pt"))) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(line for _, line in err_lines)
        time.sleep(0.1)
    if target == "main process":
        proc.send_signal(signal.SIGINT)
    else:  # what a terminal's Ctrl-C does: the main process and its workers at once
        os.killpg(proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    # The stop must be prompt: the cells saved and the closing line printed within 15 s (0.1-0.5 s at
    # load average 17-22 on 2 cores). The exit after it waits for the two workers' interpreters to shut
    # down (torch loaded), which takes 8-12 s at that load and grows with it, so it gets a wide bound that
    # still catches a hang.
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mqar still ran 120 s after SIGINT: " + "".join(line for _, line in err_lines))
    reader.join(timeout=10)
    err = "".join(line for _, line in err_lines)
    said = [t - t0 for t, line in err_lines if line.startswith("interrupted:")]
    assert proc.returncode == 130 and said, err
    assert said[0] < 15, f"the closing line came {said[0]:.1f} s after SIGINT"
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted: 0 of 2 cells")
    assert "2 running cell(s) saved" in err and "run the same command again to resume" in err
    for ck in (out / "checkpoints").glob("*.pt"):
        st = torch.load(ck, weights_only=False)
        assert 1 <= st["epoch"] < 400 and st["signature"]["cell"]["epochs"] == 400


# ------------------------------------------------------------------------------------------ ceilings (issue 24)
def _pilot_records(lrs_by_model):
    return [{"key": f"{m}-{lr}", "model": m, "lr": lr, "accuracy": acc, "final_accuracy": acc, "d_model": 128,
             "setting": "L128-kv32"} for m, accs in lrs_by_model.items() for lr, acc in accs]


def test_pilot_lrs_picks_each_models_best():
    recs = _pilot_records({"deltanet": [(1e-3, 0.5), (3e-3, 0.9), (1e-2, 0.7)],
                           "gla": [(1e-3, 0.2), (3e-3, 0.2), (1e-2, 0.1)]})
    assert mqar.pilot_lrs(recs, ["deltanet", "gla"]) == {"deltanet": (3e-3, 1e-2), "gla": (1e-3, 3e-3)}
    # lrs that solved the pilot (≥ 0.99, the early stop) rank by the epoch they got there, before any accuracy
    solved = _pilot_records({"kda": [(1e-3, 0.999), (3e-3, 0.991), (1e-2, 0.5)]})
    for r, epoch in zip(solved, (6, 2, 8)):
        r["best_epoch"] = epoch
    assert mqar.pilot_lrs(solved, ["kda"], pick=1) == {"kda": (3e-3,)}
    assert mqar.pilot_lrs(solved, ["kda"], pick=2) == {"kda": (1e-3, 3e-3)}
    # nothing learned at any lr (accuracy at chance): the lr whose training loss went furthest down
    flat = _pilot_records({"gated_deltanet": [(1e-3, 0.001), (3e-3, 0.011), (1e-2, 0.0)]})
    for r, loss in zip(flat, (6.8, 4.4, 7.8)):
        r["history"] = [{"loss": 8.9}, {"loss": loss}]
    flat[2]["accuracy"] = 0.02  # above the others, still chance: the loss decides
    assert mqar.pilot_lrs(flat, ["gated_deltanet"], pick=1) == {"gated_deltanet": (3e-3,)}
    with pytest.raises(ValueError, match="no cell of mamba2"):
        mqar.pilot_lrs(recs, ["deltanet", "mamba2"])


def test_dry_run_names_the_cells_the_skip_rule_leaves_out(tmp_path, capsys):
    """--dry-run asks the skip rule as the run would, from the records of the run's dtype and device only."""
    import json

    recs = tmp_path / "r.jsonl"
    rows = [{"key": f"{n}|{device}", "model": "deltanet", "d_model": 32, "setting": f"L16-kv{n}", "lr": 0.01,
             "accuracy": 0.1,
             "test_segments": [[16, n, 64]], "dtype": "float32", "device": device}
            for n in (2, 4) for device in ("cpu", "cuda")]
    recs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--preset", "ceilings-tiny", "--models", "deltanet", "--records", str(recs), "--dry-run"]
    assert mqar.main(argv) == 0
    out = capsys.readouterr().out
    assert "L32-kv8 lr=0.01" in out and "(skipped: accuracy below 0.5 at kv 2 (0.100) and 4 (0.100)" in out
    recs.write_text("".join(json.dumps(r) + "\n" for r in rows if r["device"] == "cuda"))  # another device's
    assert mqar.main(argv) == 0
    assert "skipped" not in capsys.readouterr().out


def test_kv_pairs_alone_take_the_grids_own_settings():
    """--kv-pairs without --seq-lens on the ceilings grid: the grid's L for each kv (no off-grid cell such as
    L 1024 with 128 pairs); with --seq-lens, or on a preset whose grid lacks the kv, every L × kv that fits."""
    import argparse

    ns = argparse.Namespace
    assert mqar._settings(ns(seq_lens=None, kv_pairs=[128, 256]), PRESETS["ceilings"]) == [(512, 128), (1024, 256)]
    assert mqar._settings(ns(seq_lens=[1024], kv_pairs=[128]), PRESETS["ceilings"]) == [(1024, 128)]
    assert mqar._settings(ns(seq_lens=None, kv_pairs=[4]), PRESETS["quick"]) == [(64, 4)]
    assert mqar._settings(ns(seq_lens=None, kv_pairs=None), PRESETS["quick"]) is None


def test_ceilings_grid_heads_and_lrs():
    from fastweights import zoo

    p = PRESETS["ceilings"]
    lrs = {m: (1e-3, 3e-3) for m in p.models}
    cells = make_cells(p, lrs_for=lrs)
    assert set(p.models) == set(zoo.names()) and len(cells) == 20 * 6 * 2
    assert {(c.seq_len, c.num_kv_pairs) for c in cells} == {(64, 8), (64, 16), (128, 32), (256, 64), (512, 128),
                                                            (1024, 256)}
    assert {c.model: c.num_heads for c in cells}["atlas"] == 16 and {c.model: c.num_heads for c in cells}["gla"] == 2
    assert {c.batch_size for c in cells if c.seq_len == 1024} == {16}
    assert make_cells(p, lrs=[1e-2], lrs_for=lrs)[0].lr == 1e-2  # an explicit --lrs wins
    # 2000 steps in every setting: 8 epochs of 16000 examples / 64 up to L = 256, 8000 / 32 at 512, 4000 / 16 at 1024
    assert {mqar.cell_steps(c) for c in cells} == {2000}
    assert {c.train_segments[0][2] for c in cells if c.seq_len == 512} == {8000}
    assert make_cells(p, lrs_for=lrs, train_examples=640)[-1].train_segments[0][2] == 640  # an override: every L
    steps = {m: {"L64-B64": 10.0, "L128-B64": 10.0, "L256-B64": 10.0, "L512-B32": 10.0, "L1024-B16": 10.0}
             for m in p.models}
    est = mqar.cost_estimate([c for c in cells if c.model == "deltanet"], steps)
    train = 2 * 6 * 2000  # 2 lrs, 6 settings, 2000 steps each
    evals = 2 * 8 * (4 * 8 + 16 + 32)  # ⌈500 test examples / batch⌉ every epoch
    assert est["deltanet"] == pytest.approx((train + evals / 3) * 0.01)
    # with CUDA-graphed step times: graphed steps after each cell's 3 warm-up steps and its capture
    # (eager); a model whose capture failed (NaN) stays eager
    steps["deltanet+graph"] = {k: 2.0 for k in steps["deltanet"]}
    steps["gla+graph"] = {k: float("nan") for k in steps["gla"]}
    sources = {}
    est = mqar.cost_estimate([c for c in cells if c.model in ("deltanet", "gla")], steps, graphed=True,
                             sources=sources)
    n_cells = 2 * 6
    assert est["deltanet"] == pytest.approx(((train - 4 * n_cells) * 2.0 + (4 * n_cells + evals / 3) * 10.0) / 1e3)
    assert est["gla"] == pytest.approx((train + evals / 3) * 0.01)
    assert sources == {"deltanet": "graphed", "gla": "eager"}
    with pytest.raises(ValueError, match="no step time"):
        mqar.cost_estimate(cells[:1], {})


def test_ceilings_models_build_and_step_at_the_longest_setting():
    """Every zoo model of the ceilings preset builds with its heads and takes an optimizer step on one
    example of the longest setting (L 1024, 256 kv pairs)."""
    from fastweights.lab.train import Supervised

    cells = [c for c in make_cells(PRESETS["ceilings"], lrs=[1e-3]) if c.seq_len == 1024]
    for c in cells:
        small = dataclasses.replace(c, train_segments=((1024, 256, 1),), test_segments=((1024, 256, 1),))
        (x, y), _ = cell_data(small)
        net = build_model(small)
        logits, tgt, _ = Supervised(net)(x, y)
        loss = F.cross_entropy(logits, tgt)
        loss.backward()
        assert torch.isfinite(loss), c.model
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in net.parameters()), c.model


def test_ceilings_needs_its_pilot_and_records_resume_across_out_dirs(tmp_path, capsys):
    assert mqar.main(["--preset", "ceilings", "--dry-run", "--lrs-from", str(tmp_path / "none.jsonl")]) == 2
    assert "--preset ceilings-pilot" in capsys.readouterr().err
    pilot = tmp_path / "pilot.jsonl"
    pilot.write_text("\n".join(json.dumps(r) for r in _pilot_records(
        {m: [(1e-3, 0.1), (1e-2, 0.2)] for m in PRESETS["ceilings"].models})) + "\n")
    assert mqar.main(["--preset", "ceilings", "--dry-run", "--lrs-from", str(pilot)]) == 0
    out = capsys.readouterr().out
    assert "120 cells" in out and "lrs from the pilot: softmax_attention 0.01;" in out  # the best one (lr_pick 1)
    # --records: a second machine (another --out) skips what the first recorded
    records = tmp_path / "docs" / "ceil.jsonl"
    argv = ["--preset", "ceilings-tiny", "--models", "deltanet", "--kv-pairs", "2", "--seq-lens", "16",
            "--epochs", "1", "--train-examples", "32", "--test-examples", "16", "--records", str(records),
            "--workers", "1", "--progress", "plain"]
    assert mqar.main([*argv, "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert "| deltanet | delta | 1 × 32 |" in text and (tmp_path / "a" / "ceilings_frontier.png").exists()
    assert mqar.main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "1 already done, 0 to run here" in capsys.readouterr().out
    assert len(records.read_text().splitlines()) == 1 and not (tmp_path / "a" / "results.jsonl").exists()


def test_lrs_from_where_it_would_be_ignored_is_refused(tmp_path, capsys):
    """--lrs-from on a preset without an lr pilot, or beside --lrs, would be ignored: one line, status 2."""
    pilot = tmp_path / "pilot.jsonl"
    pilot.write_text("\n".join(json.dumps(r) for r in _pilot_records(
        {m: [(1e-3, 0.1), (1e-2, 0.2)] for m in PRESETS["ceilings"].models})) + "\n")
    with_pilot = sorted(n for n, p in PRESETS.items() if p.lr_pilot is not None)
    for argv, message in [
        (["--preset", "quick"], f"error: --lrs-from: the preset quick has no lr pilot (presets with one: "
                                f"{', '.join(with_pilot)}); leave --lrs-from out"),
        (["--preset", "ceilings", "--lrs", "0.01"], "error: --lrs-from and --lrs both set the lrs; give one"),
    ]:
        assert mqar.main([*argv, "--dry-run", "--lrs-from", str(pilot), "--out", str(tmp_path / "run")]) == 2
        cap = capsys.readouterr()
        assert cap.err.strip().splitlines() == [message] and not cap.out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--records", "--lrs-from"])
def test_a_directory_where_a_file_is_expected(flag, tmp_path, capsys):
    argv = ["--preset", "ceilings"] if flag == "--lrs-from" else ["--models", "deltanet"]
    for dry in ([], ["--dry-run"]):
        assert mqar.main([*argv, *dry, flag, str(tmp_path), "--out", str(tmp_path / "run")]) == 2
        cap = capsys.readouterr()
        assert cap.err.strip().splitlines() == [f"error: {flag} {tmp_path}: is a directory, expected a file path"]
    assert not (tmp_path / "run").exists()


def test_records_that_are_the_pilots_are_refused(tmp_path, capsys):
    """--records equal to the pilot's records (--lrs-from) would append the sweep's cells to the file it
    takes its lrs from: refused, the file left as it was."""
    pilot = tmp_path / "pilot.jsonl"
    pilot.write_text("\n".join(json.dumps(r) for r in _pilot_records(
        {m: [(1e-3, 0.1), (1e-2, 0.2)] for m in PRESETS["ceilings"].models})) + "\n")
    before = pilot.read_bytes()
    assert mqar.main(["--preset", "ceilings", "--models", "deltanet", "--lrs-from", str(pilot),
                      "--records", str(tmp_path / "." / "pilot.jsonl"),
                      "--out", str(tmp_path / "run")]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines() == [f"error: --records {tmp_path / '.' / 'pilot.jsonl'}: is the pilot's "
                                            f"records (--lrs-from {pilot}), which the sweep reads its lrs from; its "
                                            "own records would be appended there: give --records another file"]
    assert pilot.read_bytes() == before and not (tmp_path / "run").exists()


def test_ceilings_dry_run_works_from_any_directory_on_a_fresh_clone(tmp_path, monkeypatch, capsys):
    """`fastweights mqar --preset ceilings --dry-run` from a directory outside the checkout: the committed pilot is
    found beside the package, and ATLAS (no pilot records) takes the preset's own lr instead of failing the run."""
    from fastweights import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["mqar", "--preset", "ceilings", "--dry-run", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "120 cells" in out and "atlas d=128 L64-kv8 lr=0.003" in out
    assert "lrs of the preset's own: atlas 0.003" in out


def test_records_that_are_another_kind_of_file_are_refused(tmp_path, capsys):
    """--records appends to its file: an existing file that holds no sweep record (a saved model's config.json, notes)
    is refused with one line, exit 2, and left as it was; a new path, an empty file and a records file are taken."""
    cfg = tmp_path / "model" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text('{"d_model": 16}\n')
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\n")
    argv = ["--preset", "ceilings-tiny", "--models", "deltanet", "--kv-pairs", "2", "--seq-lens", "16", "--dry-run"]
    for path in (cfg, notes):
        before = path.read_bytes()
        assert mqar.main(argv + ["--records", str(path)]) == 2
        err = capsys.readouterr().err
        assert "--records" in err and "holds no sweep records" in err and len(err.strip().splitlines()) == 1
        assert path.read_bytes() == before
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"key": "MQARCell{}", "model": "deltanet"}) + "\n")
    for path in (tmp_path / "new.jsonl", empty, good):
        assert mqar.main(argv + ["--records", str(path)]) == 0
