"""The run directory (fastweights.pretrain.rundir): an --out that is a file or cannot be written,
or whose disk is too full for a checkpoint, is refused naming --out; a failed write of model/ or of
a text file leaves the previous one as it was."""

import errno
import os

import pytest

from fastweights.pretrain import ConfigFileError, rundir
from fastweights.pretrain.rundir import check_out, check_space, checkpoint_bytes, replace_dir, write_text


def test_an_out_that_is_a_file_or_read_only_is_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigFileError, match=r"^--out .*/f: is a file; expected a run directory"):
        check_out(tmp_path / "f")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # (root writes anywhere: refuse the probe write as the kernel would)
        def denied(self, data):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(rundir.Path, "write_bytes", denied)
    with pytest.raises(ConfigFileError, match=r"^--out .*/ro: cannot write there \(Permission denied\)"):
        check_out(ro)
    monkeypatch.undo()
    ro.chmod(0o755)
    assert check_out(tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())


def test_too_little_free_space_for_a_checkpoint_is_refused(tmp_path, monkeypatch):
    assert checkpoint_bytes(1000) == 16000
    check_space(tmp_path, 16000)

    class Usage:
        free = 15999

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(ConfigFileError, match=r"^--out .*: 0.0 MB free on its file system, but a checkpoint"):
        check_space(tmp_path, 16000)


def test_a_failed_write_leaves_the_previous_directory_and_file(tmp_path, monkeypatch):
    target = tmp_path / "model"

    def good(d, text="old"):
        d.mkdir()
        (d / "w").write_text(text)

    replace_dir(target, good)

    def full(d):
        good(d, "new, partly")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        replace_dir(target, full)
    assert (target / "w").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    replace_dir(target, lambda d: good(d, "new"))
    assert (target / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    write_text(tmp_path / "log", "a\n")

    def full_fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", full_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_text(tmp_path / "log", "b\n")
    assert (tmp_path / "log").read_text() == "a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log", "model"]


def test_an_earlier_run_with_its_temporary_files_is_a_run_and_anything_more_is_not(tmp_path):
    """What a killed run leaves (its temporary files beside checkpoint.pt) is resumable; one file
    more that no run writes makes the directory someone else's."""
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    for name in ("checkpoint.pt", "log.jsonl", "config.json", "loss.png", "checkpoint.pt.x1y2.tmp",
                 ".log.jsonl.123.tmp", ".loss.123.tmp.png", ".write-test-9"):
        (run / name).write_bytes(b"")
    assert check_out(run) == run
    (run / "data.txt").write_text("mine")
    with pytest.raises(ConfigFileError, match=r"^--out .*/run: holds checkpoint.pt, config.json, data.txt, "
                                              r"log.jsonl and 2 more \(no run\); expected a new or empty directory"):
        check_out(run)
    assert (run / "data.txt").read_text() == "mine"


def test_train_refuses_an_out_that_is_its_init_from(tmp_path):
    """The library call refuses it as the command line does, before writing anything."""
    from fastweights.models import LM, LMConfig
    from fastweights.pretrain import PretrainConfig, train

    src = tmp_path / "m"
    LM(LMConfig(vocab_size=320, d_model=16, n_layers=1, num_heads=2, head_dim=8, mixer="gated_deltanet")) \
        .save_pretrained(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    cfg = PretrainConfig.build({"data": [str(tmp_path / "a.txt")], "out": str(src), "init_from": str(src),
                                "steps": 1, "batch_size": 2, "seq_len": 8, "progress": "none", "threads": 1})
    with pytest.raises(ConfigFileError, match=rf"^--out {src}: overlaps --init-from {src}, which the run reads"):
        train(cfg)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
