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

`check_out(out, sources)` refuses, before any work, an `--out` that is a file or cannot be written,
and one a run would damage (`check_out_use`): an empty `--out` or the current directory, a directory
holding something other than an earlier run (a saved model, a repository, other files), or one that
overlaps `sources` (the `--init-from` directory and its model/); `check_space(out, needed)` one whose
file system has less free space than a checkpoint needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .config import ConfigFileError

__all__ = ["CHECKPOINT", "LOG", "PLOT", "MODEL_DIR", "OutputError", "check_out", "check_out_path", "check_out_use",
           "check_space", "checkpoint_bytes", "write_text", "replace_dir"]

CHECKPOINT, LOG, PLOT, MODEL_DIR = "checkpoint.pt", "log.jsonl", "loss.png", "model"
#: every name a run writes in its directory; an earlier run's directory holds only these (and its
#: temporary files) and at least one of RUN_MARKERS (log.jsonl is written before the first step)
RUN_NAMES = (CHECKPOINT, LOG, PLOT, "config.json", MODEL_DIR, MODEL_DIR + ".new", MODEL_DIR + ".old")
RUN_MARKERS = (CHECKPOINT, LOG)


class OutputError(RuntimeError):
    """The run directory could not be written during the run; the message names the file, the step,
    and what was kept."""


def _run_temporary(name: str) -> bool:
    """A temporary file of a run (write_text's, the plot's, atomic_save's, the write probe's)."""
    return name.startswith(".write-test-") or (name.startswith(".") and name.endswith((".tmp", ".tmp.png"))) \
        or (name.startswith(CHECKPOINT + ".") and name.endswith(".tmp"))


def _foreign(p: Path) -> str | None:
    """What an existing directory holds that no run wrote (None: empty, or an earlier run's)."""
    names = sorted(e.name for e in p.iterdir() if not _run_temporary(e.name))
    if not names:
        return None
    others = [n for n in names if n not in RUN_NAMES]
    if not others and any(n in RUN_MARKERS for n in names):
        return None
    from ..cliargs import WEIGHT_FILES

    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    what = ("a saved model" if "config.json" in names and any(w in names for w in WEIGHT_FILES)
            else "a git repository" if ".git" in names else "no run")
    if not others:  # only names a run writes, but neither checkpoint.pt nor log.jsonl
        return f"holds {shown} but no {CHECKPOINT} or {LOG} ({what})"
    return f"holds {shown} ({what})"


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_out_use(out, sources=()) -> None:
    """ConfigFileError naming --out when a run there could damage what it points at: an empty
    value, the current directory, a path equal to, inside or above one of `sources` (the directories
    the run reads a model from: --init-from and its model/), or an existing directory that is
    neither empty nor an earlier run's (a saved model, a git repository, other files: named)."""
    if not str(out).strip():
        raise ConfigFileError("--out is empty; expected a run directory of its own (e.g. runs/train)")
    p = Path(out)
    here, where = Path.cwd().resolve(), p.resolve()
    if where == here:
        raise ConfigFileError(f"--out {out}: is the current directory; a run writes config.json, model/ and "
                              "checkpoint.pt there, so give it a directory of its own (e.g. runs/train)")
    for src in sources:
        if _overlaps(where, Path(src).resolve()):
            raise ConfigFileError(f"--out {out}: overlaps --init-from {src}, which the run reads its model from "
                                  "(the run would write over it); give --out a directory of its own")
    if p.is_dir():
        try:
            found = _foreign(p)
        except OSError as e:
            raise ConfigFileError(f"--out {out}: cannot list what it holds ({e.strerror or e}); expected a readable "
                                  "directory") from None
        if found is not None:
            raise ConfigFileError(f"--out {out}: {found}; expected a new or empty directory, or an earlier "
                                  f"`fastweights train` run's ({CHECKPOINT}, {LOG}, {MODEL_DIR}/) to resume")


def check_out(out, sources=()) -> Path:
    """The run directory, created if needed, after checking that it is not a file, that a file
    can be written in it, and `check_out_use` (ConfigFileError naming --out otherwise)."""
    p = Path(out)
    check_out_use(out, sources)
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


def check_out_path(out, sources=()) -> None:
    """What `check_out` checks, without creating anything (the command line's check before any work):
    `check_out_use`, `out` is not a file, and the nearest existing directory above it is writable."""
    p = Path(out)
    check_out_use(out, sources)
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
