"""`fastweights train`'s command line under bad input: an --out that is a file or read-only, a device
this machine lacks (by flag, config file or preset), a .bin token file of odd size, a disk too full
for a checkpoint, an --out that would damage what it points at (the --init-from model, the current
directory, a saved model or repository) — each one line on stderr naming the flag or file, status 2,
before any training; a new or empty --out trains and an earlier run resumes."""

import errno
import os
import time

import numpy as np
import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.pretrain import rundir

TINY = ["--model", "d_model=16", "--model", "n_layers=1", "--model", "num_heads=2", "--model", "head_dim=8",
        "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--progress", "none", "--threads", "1"]


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("the cat sat on the mat. " * 20, encoding="utf-8")
    return str(p)


def _one_line(capsys, prefix: str) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix) and not cap.out, cap.err[-2000:]
    return err[0]


def test_an_out_that_is_a_file_or_read_only(tmp_path, text, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "file"), *TINY]) == 2
    _one_line(capsys, f"error: --out {tmp_path / 'file'}: is a file; expected a run directory")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # (root writes anywhere: refuse the probe write as the kernel would)
        def denied(self, data):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(rundir.Path, "write_bytes", denied)
    assert cli_main(["train", "--data", text, "--out", str(ro / "run"), *TINY]) == 2
    _one_line(capsys, f"error: --out {ro / 'run'}: cannot write there (Permission denied)")


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "error: --device cuda: this torch build sees no CUDA device"),
    (["--preset", "gpu-125m"],
     "error: --preset gpu-125m runs on cuda, which this machine cannot use; pass --device cpu"),
    (["--config", "{cfg}"], "error: device (in --config {cfg}) cuda: this torch build sees no CUDA device"),
])
def test_a_device_this_machine_lacks(argv, message, tmp_path, text, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (the same answer on a GPU machine)
    cfg = tmp_path / "c.json"
    cfg.write_text('{"device": "cuda"}')
    argv = [a.format(cfg=cfg) for a in argv]
    t0 = time.perf_counter()
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, *argv]) == 2
    _one_line(capsys, message.format(cfg=cfg))
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "run").exists()  # before any work


def test_a_token_file_of_odd_size(tmp_path, capsys):
    (tmp_path / "t.bin").write_bytes(np.arange(100, dtype="<u2").tobytes() + b"\x07")
    assert cli_main(["train", "--data", str(tmp_path / "t.bin"), "--out", str(tmp_path / "run"), *TINY]) == 2
    _one_line(capsys, f"error: {tmp_path / 't.bin'}: 201 bytes is not a whole number of tokens")


def test_a_disk_too_full_for_a_checkpoint_is_refused_before_training(tmp_path, text, capsys, monkeypatch):
    class Usage:
        free = 10_000

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: Usage)
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY]) == 2
    _one_line(capsys, f"error: --out {tmp_path / 'run'}: 0.0 MB free on its file system, but a checkpoint of this "
                      "model needs at least")
    assert not list((tmp_path / "run").iterdir())  # no log, no config: nothing started


def test_a_disk_that_fills_mid_run_is_one_line_and_status_1(tmp_path, text, capsys, monkeypatch):
    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY]) == 1
    _one_line(capsys, f"error: --out {tmp_path / 'run'}: writing checkpoint.pt at step 2 failed (No space left on "
                      "device); no checkpoint had been written yet")


@pytest.mark.parametrize("argv, message", [
    (["--min-lr", "nan"], "error: min_lr must be a finite number ≥ 0, got nan"),
    (["--val-fraction", "nan"], "error: val_fraction must be a finite number ≥ 0, got nan"),
    (["--lr", "inf"], "error: lr must be a finite number ≥ 0, got inf"),
    (["--grad-clip", "nan"], "error: grad_clip must be a finite number > 0 or None, got nan"),
    (["--seed", "-7"], "error: seed must be an int ≥ 0, got -7"),
    (["--device", "cuda:7"], "error: --device cuda:7: "),
    (["--parallel", "fsdp"], "error: --parallel fsdp shards the model over several processes, but this run has one"),
])
def test_values_that_would_start_a_wrong_run_are_refused_before_work(argv, message, tmp_path, text, capsys):
    """nan learning rates or fractions, a CUDA device this machine lacks, FSDP without torchrun: one
    line naming the flag, status 2, and no run directory."""
    t0 = time.perf_counter()
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, *argv]) == 2
    _one_line(capsys, message)
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "run").exists()


def _saved_model(path):
    from fastweights.models import LM, LMConfig

    config = LMConfig(vocab_size=320, d_model=16, n_layers=1, num_heads=2, head_dim=8, mixer=["gated_deltanet"])
    LM(config).save_pretrained(path)
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_a_run_never_writes_over_the_model_it_starts_from(tmp_path, text, capsys):
    """--out equal to --init-from (a model directory or a run directory), or inside or above it:
    refused before any work, the source left byte for byte as it was (it used to lose its config.json)."""
    from fastweights.models import LM

    before = _saved_model(tmp_path / "m")
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, "--init-from",
                     str(tmp_path / "m")]) == 0
    capsys.readouterr()
    run_files = {p.name: p.read_bytes() for p in (tmp_path / "run" / "model").iterdir()}
    for init, out in [("m", "m"), ("m", "m/sub"), ("run", "run"), ("run/model", "run"), ("run", "run/model"),
                      ("run/model", "run/model")]:
        assert cli_main(["train", "--data", text, "--out", str(tmp_path / out), *TINY, "--init-from",
                         str(tmp_path / init)]) == 2, (init, out)
        _one_line(capsys, f"error: --out {tmp_path / out}: overlaps --init-from ")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "model").iterdir()} == run_files
    LM.from_pretrained(tmp_path / "m")


def test_an_empty_out_or_the_current_directory_is_refused(tmp_path, text, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.json").write_text('{"mine": 1}')
    monkeypatch.chdir(work)
    assert cli_main(["train", "--data", text, "--out", "", *TINY]) == 2
    _one_line(capsys, "error: --out is empty; expected a run directory of its own")
    for out in (".", str(work), "../work"):
        assert cli_main(["train", "--data", text, "--out", out, *TINY]) == 2
        _one_line(capsys, f"error: --out {out}: is the current directory; ")
    assert sorted(p.name for p in work.iterdir()) == ["config.json"]
    assert (work / "config.json").read_text() == '{"mine": 1}'


def test_an_out_holding_something_other_than_a_run_is_refused_naming_it(tmp_path, text, capsys):
    before = _saved_model(tmp_path / "model_dir")
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "README.md").write_text("x")
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "notes.txt").write_text("x")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    for name, found in [("model_dir", "holds config.json, fastweights_auto.py, model.safetensors (a saved model)"),
                        ("repo", "holds .git, README.md (a git repository)"), ("misc", "holds notes.txt (no run)"),
                        ("half", "holds config.json but no checkpoint.pt or log.jsonl (no run)")]:
        assert cli_main(["train", "--data", text, "--out", str(tmp_path / name), *TINY]) == 2, name
        _one_line(capsys, f"error: --out {tmp_path / name}: {found}; expected a new or empty directory, or an "
                          "earlier `fastweights train` run's")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model_dir").iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "half").iterdir()) == ["config.json"]


def test_a_new_or_empty_out_trains_and_an_earlier_run_resumes(tmp_path, text, capsys):
    (tmp_path / "empty").mkdir()
    for out in ("empty", "new/run"):
        assert cli_main(["train", "--data", text, "--out", str(tmp_path / out), *TINY]) == 0, out
        assert (tmp_path / out / "checkpoint.pt").is_file()
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "empty"), *TINY, "--steps", "3"]) == 0
    assert torch.load(tmp_path / "empty" / "checkpoint.pt", weights_only=False)["step"] == 3


def test_a_tokenizer_directory_without_a_tokenizer_names_it_and_the_files(tmp_path, text, capsys):
    """An empty or unrelated directory (it gave a misleading message about sentencepiece) and a
    damaged tokenizer_config.json: one line naming --tokenizer DIR, status 2, no run started."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "notes.txt").write_text("x")
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, "--tokenizer",
                     str(tmp_path / "tok")]) == 2
    _one_line(capsys, f"error: --tokenizer {tmp_path / 'tok'}: holds no tokenizer (none of tokenizer.json, "
                      "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, spiece.model); expected a "
                      "Hugging Face tokenizer directory")
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{broken")
    assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, "--tokenizer",
                     str(tmp_path / "tok")]) == 2
    _one_line(capsys, f"error: --tokenizer {tmp_path / 'tok'}: transformers cannot load a tokenizer from it (")
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())


def test_an_empty_tokenizer_is_refused_not_read_as_the_current_directory(tmp_path, text, capsys, monkeypatch):
    """--tokenizer '' was the current directory: a tokenizer saved there was taken without a word."""
    _saved_model(tmp_path / "m")  # a directory holding a tokenizer, made the current directory
    monkeypatch.chdir(tmp_path / "m")
    for blank in ("", "  "):
        assert cli_main(["train", "--data", text, "--out", str(tmp_path / "run"), *TINY, "--tokenizer", blank]) == 2
        _one_line(capsys, "error: --tokenizer is empty; expected 'bytes' or a local tokenizer directory")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, message", [
    ("tokenizer = 5", "tokenizer must be a string ('bytes' or a tokenizer directory), got 5"),
    ("data = 5", "data must be a path or a list of paths (strings), got 5"),
    ("data = [true]", "data must be a path or a list of paths (strings), got [True]"),
    ("out = 5", "out must be a string (a run directory), got 5"),
])
def test_config_file_settings_of_the_wrong_type_are_one_line(setting, message, tmp_path, capsys):
    """`tokenizer = 5` and `data = 5` in --config were raw tracebacks (AttributeError, TypeError)."""
    (tmp_path / "c.toml").write_text(setting + "\n", encoding="utf-8")
    argv = ["train", "--config", str(tmp_path / "c.toml"), *TINY]
    argv += [] if setting.startswith("data") else ["--data", str(tmp_path / "missing.txt")]
    argv += [] if setting.startswith("out") else ["--out", str(tmp_path / "run")]
    assert cli_main(argv) == 2
    _one_line(capsys, f"error: {message}")
    assert not (tmp_path / "run").exists()


def test_a_fastweights_checkpoint_is_a_tokenizer_directory(tmp_path):
    from fastweights.pretrain.data import check_tokenizer, load_tokenizer

    _saved_model(tmp_path / "m")  # (config.json of model_type fastweights: its byte tokenizer)
    check_tokenizer(str(tmp_path / "m"))
    assert load_tokenizer(str(tmp_path / "m")).vocab_size == 257
