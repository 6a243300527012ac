"""The run directory of `fastweights train` (`--out`): checked before any work, and written so that
a failed write (a full disk) leaves the last good checkpoint intact.

    out/checkpoint.pt   resume state: `fastweights.training.checkpoint.atomic_save` (temporary file,
                        fsync, rename): the previous checkpoint stays whole until the new one is
    out/model/          `LM.save_pretrained` + the tokenizer, written into model.new/ and swapped
                        in by two renames (model/ -> model.old/, model.new/ -> model/), so a failed
                        write leaves the previous model/ as it was
    out/log.jsonl       one JSON line per record, appended (a torn last line is dropped on resume);
                        rewritten at start through a temporary file
    out/config.json, out/loss.png    through a temporary file and a rename

`check_out(out)` refuses, before any work, an `--out` that is a file or cannot be written;
`check_space(out, needed)` one whose file system has less free space than a checkpoint needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .config import ConfigFileError

__all__ = ["CHECKPOINT", "LOG", "PLOT", "MODEL_DIR", "OutputError", "check_out", "check_out_path", "check_space",
           "checkpoint_bytes", "write_text", "replace_dir"]

CHECKPOINT, LOG, PLOT, MODEL_DIR = "checkpoint.pt", "log.jsonl", "loss.png", "model"


class OutputError(RuntimeError):
    """The run directory could not be written during the run; the message names the file, the step,
    and what was kept."""


def check_out(out) -> Path:
    """The run directory, created if needed, after checking that it is not a file and that a file
    can be written in it (ConfigFileError naming --out otherwise)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigFileError(f"--out {p}: is a file; expected a run directory (existing or to be created)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigFileError(f"--out {p}: cannot write there ({e.strerror or e}); expected a writable "
                              "directory") from None
    return p


def check_out_path(out) -> None:
    """What `check_out` checks, without creating anything (the command line's check before any work):
    `out` is not a file, and the nearest existing directory above it is writable."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigFileError(f"--out {p}: is a file; expected a run directory (existing or to be created)")
    up = p
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        raise ConfigFileError(f"--out {p}: {up} is a file, so no directory can be made there; expected a run "
                              "directory (existing or to be created)")
    if not os.access(up, os.W_OK | os.X_OK):
        raise ConfigFileError(f"--out {p}: cannot write there (Permission denied); expected a writable directory")


def checkpoint_bytes(n_parameters: int) -> int:
    """A lower bound of what one save writes for a model of fp32 parameters: checkpoint.pt (the
    weights and AdamW's two moments) and model/ (the weights)."""
    return 4 * n_parameters * 4


def check_space(out, needed: int) -> None:
    """ConfigFileError naming --out when its file system has fewer than `needed` bytes free."""
    free = shutil.disk_usage(out).free
    if free < needed:
        raise ConfigFileError(f"--out {out}: {free / 1e6:.1f} MB free on its file system, but a checkpoint of this "
                              f"model needs at least {needed / 1e6:.1f} MB (checkpoint.pt: weights and AdamW "
                              "moments; model/: weights); free space or use another --out")


def write_text(path: Path, text: str) -> None:
    """`text` onto `path` through a temporary file of this process, fsynced and renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def replace_dir(target: Path, write: Callable[[Path], None]) -> None:
    """write(staging) into a fresh `target`.new/, then swap it in for `target` (see the module doc);
    on failure the staging directory is removed and `target` is left as it was."""
    stage, old = target.with_name(target.name + ".new"), target.with_name(target.name + ".old")
    shutil.rmtree(stage, ignore_errors=True)
    try:
        write(stage)
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not target.exists():  # (the second rename failed: put the old one back)
            os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
