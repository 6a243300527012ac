"""`fastweights train` end to end on a CPU: it learns, writes its log, curve and a checkpoint that
loads as an LM and through transformers; a run killed with SIGKILL, or stopped by SIGINT/SIGTERM
(which save at the step boundary), resumes to exactly the weights of an uninterrupted run, reading
every sample once; settings come from presets, files and flags; a resume on other data is refused
naming the change (--fresh starts again); a disk that fills mid-run keeps the last good checkpoint."""

import errno
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.models import LM
from fastweights.pretrain import ConfigFileError, DataError, OutputError, PretrainConfig, train
from fastweights.pretrain.loop import lr_factor

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(d_model=16, n_layers=2, num_heads=2, head_dim=8, mixer=["gated_deltanet", "softmax_attention"])


def corpus(tmp_path, docs=40):
    d = tmp_path / "text"
    d.mkdir()
    for i in range(docs):  # short repetitive documents: learnable in a few steps
        (d / f"{i:03d}.txt").write_text(("the cat sat on the mat. " * (1 + i % 3)).strip(), encoding="utf-8")
    return d


def test_trains_and_writes_log_curve_and_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fastweights.hf  # noqa: F401

    cfg = PretrainConfig.build({"data": [str(corpus(tmp_path))], "out": str(tmp_path / "run"), "steps": 30,
                                "batch_size": 8, "seq_len": 32, "lr": 1e-2, "val_every": 10, "save_every": 10,
                                "val_fraction": 0.1, "progress": "none", "threads": 1, "model": TINY})
    summary = train(cfg)
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    val_recs = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, 31)) and [r["step"] for r in val_recs] == [10, 20, 30]
    assert train_recs[-1]["loss"] < train_recs[0]["loss"] - 1.0  # it learns
    assert val_recs[-1]["val_loss"] < val_recs[0]["val_loss"]
    assert val_recs[-1]["val_ppl"] == math.exp(val_recs[-1]["val_loss"]) == summary["val_ppl"]
    assert all(r["tokens_per_s"] > 0 for r in train_recs) and train_recs[-1]["tokens"] == 30 * 8 * 32
    assert (run / "loss.png").stat().st_size > 1000
    lm = LM.from_pretrained(run / "model")
    hf = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    ids = torch.tensor([tok("the cat")["input_ids"]])
    assert torch.equal(hf(ids).logits, lm(ids))
    # resuming a finished run trains nothing and keeps the log
    assert train(cfg)["steps"] == 30
    assert (run / "log.jsonl").read_text().count("\n") == len(recs)


def test_settings_from_preset_file_and_flags(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('steps = 7\nlr = 0.01\n[model]\nd_model = 32\n', encoding="utf-8")
    (tmp_path / "c.json").write_text(json.dumps({"steps": 9, "model": {"n_layers": 1}}), encoding="utf-8")
    from fastweights.cli import build_parser
    from fastweights.pretrain.cli import config_from_args

    args = build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml"), "--steps", "11", "--data", "x"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.lr, cfg.model["d_model"], cfg.model["n_layers"]) == (11, 0.01, 32, 4)  # flag > file > preset
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(tmp_path / "c.json"),
                                                      "--model", "mixer=kda", "--preset", "gpu-125m"]))
    assert (cfg.steps, cfg.model["n_layers"], cfg.model["mixer"], cfg.dtype) == (9, 1, "kda", "bfloat16")
    with pytest.raises(ConfigFileError, match="unknown setting"):
        PretrainConfig.build({"stepz": 3})
    with pytest.raises(ConfigFileError, match="batch_size"):
        PretrainConfig.build({"batch_size": 0})
    assert cli_main(["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert cli_main(["train", "--out", str(tmp_path / "o")]) == 2
    assert "error: data" in capsys.readouterr().err


def test_warmup_then_cosine():
    cfg = PretrainConfig.build({"steps": 100, "warmup": 10, "lr": 1.0, "min_lr": 0.1})
    f = [lr_factor(cfg, s) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5) and f[-1] > 0.1 and all(a >= b for a, b in zip(f[10:], f[11:]))


def test_bf16_autocast_with_accumulation_trains(tmp_path):
    cfg = PretrainConfig.build({"data": [str(corpus(tmp_path, docs=8))], "out": str(tmp_path / "run"), "steps": 2,
                                "batch_size": 4, "grad_accum": 2, "seq_len": 16, "dtype": "bfloat16",
                                "progress": "none", "threads": 1, "model": TINY})
    summary = train(cfg)
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    assert LM.from_pretrained(tmp_path / "run" / "model").embed.weight.dtype == torch.float32  # fp32 weights


# ------------------------------------------------------------------------------------------ faults
def _tiny(tmp_path, out, **kw):
    return PretrainConfig.build({"data": [str(tmp_path / "text")], "out": str(out), "steps": 6, "batch_size": 4,
                                 "seq_len": 16, "save_every": 2, "val_every": 3, "progress": "none", "threads": 1,
                                 "model": TINY, **kw})


def test_resume_on_changed_data_is_refused_naming_it_unless_fresh(tmp_path):
    corpus(tmp_path, docs=12)
    cfg = _tiny(tmp_path, tmp_path / "run")
    first = train(cfg)
    (tmp_path / "text" / "new.txt").write_text("a new document. " * 5, encoding="utf-8")
    with pytest.raises(DataError, match=r"checkpoint.pt was trained on other data: 1 file\(s\) added: "
                                        r".*new.txt; pass --fresh to discard it"):
        train(cfg)
    (tmp_path / "text" / "new.txt").unlink()
    (tmp_path / "text" / "003.txt").write_text("THE CAT SAT ON THE MAT.", encoding="utf-8")  # same size
    with pytest.raises(DataError, match=r"003.txt changed \(same size, other content\)"):
        train(cfg)
    assert json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])["step"] == 6  # untouched
    again = train(cfg, fresh=True)  # trains from step 0 on the new data
    recs = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 7)) and again["loss"] != first["loss"]
    assert train(cfg)["loss"] == again["loss"]  # and its own data key resumes


def test_a_full_disk_mid_run_keeps_the_last_good_checkpoint_and_says_so(tmp_path, monkeypatch):
    corpus(tmp_path, docs=12)
    ref = train(_tiny(tmp_path, tmp_path / "ref"))
    run = tmp_path / "run"
    real_save, calls = torch.save, []

    def fills_up(obj, f, *a, **k):  # the second checkpoint (step 4) hits a full disk half-way
        calls.append(obj["step"])
        if len(calls) == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", fills_up)
    with pytest.raises(OutputError) as e:
        train(_tiny(tmp_path, run))
    assert str(e.value) == (f"--out {run}: writing checkpoint.pt at step 4 failed (No space left on device); the "
                            f"last good checkpoint is intact: {run / 'checkpoint.pt'} holds step 2; free space and "
                            "run the same command again to resume")
    monkeypatch.undo()
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 2
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "config.json", "log.jsonl", "loss.png", "model"]
    step2 = LM.from_pretrained(run / "model").state_dict()

    # model/ fails half-way at step 4: checkpoint.pt holds step 4, model/ keeps step 2 whole
    real_pretrained = LM.save_pretrained

    def model_fills_up(self, directory, *a, **k):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"torn")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LM, "save_pretrained", model_fills_up)
    with pytest.raises(OutputError, match=re.escape(
            f"writing model/ at step 4 failed (No space left on device); the last good checkpoint is intact: "
            f"{run / 'checkpoint.pt'} holds step 4 (model/ holds step 2)")):
        train(_tiny(tmp_path, run))
    monkeypatch.setattr(LM, "save_pretrained", real_pretrained)
    kept = LM.from_pretrained(run / "model").state_dict()
    assert all(torch.equal(kept[k], step2[k]) for k in step2) and not (run / "model.new").exists()

    resumed = train(_tiny(tmp_path, run))  # space freed: it resumes and ends where an uninterrupted run ends
    assert resumed["loss"] == ref["loss"] and resumed["val_loss"] == ref["val_loss"]
    a, b = LM.from_pretrained(tmp_path / "ref" / "model").state_dict(), LM.from_pretrained(run / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 7))


SIGNAL_STEPS = 40


def _signal_run(tmp, out, save_every=100) -> subprocess.Popen:
    """`fastweights train` in a subprocess on tmp/text (by default no checkpoint due before its last step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = ["--data", str(tmp / "text"), "--steps", str(SIGNAL_STEPS), "--batch-size", "4", "--seq-len", "16",
            "--save-every", str(save_every), "--val-every", "20", "--threads", "1", "--progress", "plain",
            "--lr", "1e-2"]
    for k, v in TINY.items():
        args += ["--model", f"{k}={json.dumps(v)}"]
    return subprocess.Popen([sys.executable, "-m", "fastweights.cli", "train", *args, "--out", str(out)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def signal_reference(tmp_path_factory):
    """The uninterrupted run the signalled ones are compared with (one per module)."""
    tmp = tmp_path_factory.mktemp("signal_ref")
    corpus(tmp)
    ref = _signal_run(tmp, tmp / "ref")
    assert ref.wait(timeout=300) == 0, ref.stderr.read()[-3000:]
    return tmp


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_at_the_step_boundary_and_the_run_resumes_to_the_uninterrupted_weights(
        signal_reference, tmp_path, sig):
    tmp, steps = signal_reference, SIGNAL_STEPS
    start = functools.partial(_signal_run, tmp)
    victim = start(tmp_path / "run")
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(x).get("step", 0) >= 5 for x in lines[:-1]):  # no checkpoint was due before step 40
            victim.send_signal(sig)
            break
        time.sleep(0.005)
    out, err = victim.communicate(timeout=120)
    assert victim.returncode == 130, err[-3000:]
    stopped = json.loads(log.read_text().splitlines()[-1])["step"]
    assert 5 <= stopped < steps
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"interrupted at step {stopped} of {steps}: .*checkpoint.pt holds step {stopped}; run the "
                        r"same command again to resume( \(.*\))?", line), err[-2000:]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == stopped  # nothing lost

    resumed = start(tmp_path / "run")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming {tmp_path / 'run'} at step {stopped}" in out
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, steps + 1))
    ref_recs = [json.loads(x) for x in (tmp / "ref" / "log.jsonl").read_text().splitlines()]
    assert [r.get("loss", r.get("val_loss")) for r in recs] == [r.get("loss", r.get("val_loss")) for r in ref_recs]
    a = LM.from_pretrained(tmp / "ref" / "model").state_dict()
    b = LM.from_pretrained(tmp_path / "run" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_killed_by_sigkill_resumes_to_the_uninterrupted_weights(signal_reference, tmp_path):
    """kill -9 past the checkpoint at step 5: the same command resumes from it and ends where the uninterrupted run
    (the module's reference, which saved nothing on the way: saving does not change a run) ends, every sample once."""
    tmp, steps = signal_reference, SIGNAL_STEPS
    start = functools.partial(_signal_run, tmp, save_every=5)
    victim = start(tmp_path / "run")
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(x).get("step", 0) >= 8 for x in lines[:-1]):  # past the checkpoint at step 5
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = max(json.loads(x)["step"] for x in log.read_text().splitlines()[:-1])
    assert killed_at < steps

    resumed = start(tmp_path / "run")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    resumed_at = re.search(r"resuming .* at step (\d+)", out)
    assert resumed_at and 0 < int(resumed_at.group(1)) <= killed_at and int(resumed_at.group(1)) % 5 == 0, out[:500]

    recs = [json.loads(x) for x in log.read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, steps + 1))  # each step once
    assert [r["samples"] for r in train_recs] == [[4 * s, 4 * s + 4] for s in range(steps)]  # no sample twice
    ref_recs = [json.loads(x) for x in (tmp / "ref" / "log.jsonl").read_text().splitlines()]
    assert [r.get("loss", r.get("val_loss")) for r in recs] == [r.get("loss", r.get("val_loss")) for r in ref_recs]
    a = LM.from_pretrained(tmp / "ref" / "model").state_dict()
    b = LM.from_pretrained(tmp_path / "run" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_log_carries_the_steady_rate_and_mfu(tmp_path, monkeypatch):
    """Each train record has tokens_per_s_steady (None for steps 1 and 2, then > 0) and mfu (None on the CPU: no
    peak); the steady figure leaves out the first step — made 1 s slower here, as a compile would — so it is
    well above the running one, and the plain progress line prints both."""
    import io

    from fastweights.pretrain import loop
    from fastweights.training.progress import Progress

    real, calls = loop.training_step.optimizer_step, []

    def slow_first(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)
        return real(*a, **kw)

    monkeypatch.setattr(loop.training_step, "optimizer_step", slow_first)
    cfg = PretrainConfig.build({"data": [str(corpus(tmp_path))], "out": str(tmp_path / "run"), "steps": 6,
                                "batch_size": 4, "seq_len": 16, "val_every": 100, "save_every": 100, "threads": 1,
                                "model": TINY})
    out = io.StringIO()
    summary = train(cfg, progress=Progress("plain", stream=out))
    recs = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    assert [r["tokens_per_s_steady"] is None for r in train_recs] == [True, True, False, False, False, False]
    assert all(r["mfu"] is None for r in train_recs) and summary["mfu"] is None
    last = train_recs[-1]
    assert last["tokens_per_s_steady"] == summary["tokens_per_s_steady"] > 0
    assert 4 * 16 / last["tokens_per_s_steady"] < 0.5  # no step in the window took the first step's second
    assert last["tokens_per_s_steady"] > 2 * last["tokens_per_s"]
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert "(steady —)" in lines[0]
    assert re.search(r"step 6/6 .* tok/s \(steady \d+ tok/s, MFU —\)", lines[-1]), lines[-1]
