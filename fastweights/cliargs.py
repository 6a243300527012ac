"""Checks of command-line values, shared by every `fastweights` command, so that each rejects a
bad value before starting any work, with one line naming the flag.

Each check raises `ArgError` (a ValueError) whose message starts with the flag; the commands print
it as ``error: <message>`` and exit with status 2, as argparse does for the errors it catches.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["ArgError", "Parser", "flag_message", "positive", "nonnegative", "positive_numbers", "device",
           "writable_dir", "file_path", "writable_file", "zoo_names", "threads", "checkpoint_dir", "WEIGHT_FILES"]


class ArgError(ValueError):
    """A bad command-line value; the message names the flag and what it must be."""


class Parser(argparse.ArgumentParser):
    """argparse, with its own errors (unknown flag, bad int, invalid choice) as one line too:
    ``error: argument --epochs: invalid int value: 'x' (see <prog> --help)``, status 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _ints(flag: str, values) -> list:
    vals = list(values) if isinstance(values, (list, tuple)) else [values]
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArgError(f"{flag} must be an integer, got {v!r}")
    return vals


def positive(flag: str, values, *, allow_none: bool = True) -> None:
    """Every value an int ≥ 1 (None: the flag was not given)."""
    if values is None and allow_none:
        return
    for v in _ints(flag, values):
        if v < 1:
            raise ArgError(f"{flag} must be a positive integer, got {v}")


def nonnegative(flag: str, values, *, allow_none: bool = True) -> None:
    if values is None and allow_none:
        return
    for v in _ints(flag, values):
        if v < 0:
            raise ArgError(f"{flag} must be an integer ≥ 0, got {v}")


def threads(flag: str, value, *, zero_ok: bool = False) -> None:
    """torch CPU threads: an int ≥ 1 (or 0 = torch's default, where the command allows it)."""
    if value is None:
        return
    _ints(flag, value)
    if value < (0 if zero_ok else 1):
        raise ArgError(f"{flag} must be {'≥ 0 (0: torch default)' if zero_ok else 'a positive integer'}, "
                       f"got {value}")


def positive_numbers(flag: str, values, *, allow_zero: bool = False) -> None:
    """Every value a finite number > 0 (≥ 0 with allow_zero)."""
    if values is None:
        return
    for v in (values if isinstance(values, (list, tuple)) else [values]):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (v < 0 if allow_zero else v <= 0):
            raise ArgError(f"{flag} must be {'finite numbers ≥ 0' if allow_zero else 'finite numbers > 0'}, "
                           f"got {v!r}")


def device(flag: str, value: str | None) -> None:
    """A torch device string this build can use: cpu, cuda[:i] with CUDA available (and i < the
    device count), mps with MPS available."""
    if value is None:
        return
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ArgError(f"{flag} {value!r} is not a device string (cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgError(f"{flag} {value}: this torch build sees no CUDA device (torch.cuda.is_available() is "
                           "False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArgError(f"{flag} {value}: only {torch.cuda.device_count()} CUDA device(s) here")
        return
    if dev.type == "mps" and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return
    raise ArgError(f"{flag} {value}: not usable here (cpu{', cuda' if torch.cuda.is_available() else ''} are)")


def preset_device(name: str, value: str, given: str | None) -> None:
    """The device a preset runs on, when --device was not given (`given` None): usable here, or an
    ArgError telling to pass --device cpu."""
    if given is not None:
        return
    try:
        device("--device", value)
    except ArgError:
        raise ArgError(f"--preset {name} runs on {value}, which this machine cannot use; pass --device cpu") from None


def run_sweep_command(run):
    """(records, None) from `run()`, or (None, exit status) after one line on stderr: 130 for an
    interrupted sweep (its message says how to resume), 2 for a ValueError (e.g. a checkpoint
    written with other settings)."""
    import sys

    from .training.control import Interrupted

    try:
        return run(), None
    except Interrupted as e:
        print(e, file=sys.stderr)
        return None, 130
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2


def under_torchrun(flag: str, command: str) -> None:
    """A flag that only means something among several ranks (`flag` as the user wrote it, e.g. "--ddp" or "--mode
    ddp") refused outside torchrun (WORLD_SIZE unset): one process would run it alone without a word."""
    if "WORLD_SIZE" not in os.environ:
        raise ArgError(f"{flag} runs under torchrun (WORLD_SIZE is not set): launch with "
                       f"`torchrun --nproc_per_node=N -m fastweights.cli {command} ... {flag}`, or drop {flag}")


def writable_dir(flag: str, path) -> Path:
    """Create the directory if needed and check that a file can be written in it; an empty value
    (which would write into the current directory) is refused."""
    if not str(path).strip():
        raise ArgError(f"{flag} is empty; expected a directory to write into (an empty value would write into the "
                       "current directory)")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ArgError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return p


def file_path(flag: str, path) -> None:
    """A path given for a file is neither empty nor a directory (None: the flag was not given)."""
    if path is not None and not str(path).strip():
        raise ArgError(f"{flag} is empty; expected a file path")
    if path is not None and Path(path).is_dir():
        raise ArgError(f"{flag} {path}: is a directory, expected a file path")


def records_file(flag: str, path) -> None:
    """A results file a sweep appends its records to: new, empty, or already holding sweep records — never another
    file (a saved model's config.json, notes), which an append would damage (None: the flag was not given)."""
    if path is None:
        return
    file_path(flag, path)
    p = Path(path)
    if p.is_file() and p.stat().st_size > 0:
        from .lab.train import ResultStore

        if not ResultStore(p).records():
            raise ArgError(f"{flag} {path}: the file exists and holds no sweep records (a results file is JSON lines "
                           f"with a \"key\"); give a new path or an existing results file")


def writable_file(flag: str, path) -> Path:
    """The file's directory is writable and the path is not a directory."""
    p = Path(path)
    file_path(flag, path)
    try:
        writable_dir(flag, p.parent if str(p.parent) else ".")
    except ArgError as e:
        raise ArgError(f"{flag} {path}: cannot write its directory ({str(e).rsplit('(', 1)[-1]}") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise ArgError(f"{flag} {path}: the file is not writable")
    return p


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_HUB_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")  # what the Hugging Face Hub accepts as a repo id


def _path_like(value: str) -> bool:
    """A value that names a local path, not a Hub repo id: two slashes, a leading / . ~, a
    backslash, characters or lengths the Hub refuses, or `dir/name` where dir/ is a local directory
    (`runs/lm` beside a runs/: the Hub is not asked for a local path that is missing)."""
    return (value.startswith(("/", ".", "~")) or value.endswith("/") or not _HUB_ID.match(value)
            or ".." in value or "--" in value or len(value) > 96
            or ("/" in value and Path(value.split("/", 1)[0]).is_dir()))


def _unreadable(p: Path) -> str | None:
    """Why a checkpoint directory's config.json or safetensors weights cannot be read (None: they can)."""
    import json

    try:
        json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return f"{p / 'config.json'} is not JSON ({e})"
    if (p / "model.safetensors").is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(p / "model.safetensors"), framework="pt"):
                pass
        except (SafetensorError, OSError, ValueError) as e:
            return f"{p / 'model.safetensors'} is a corrupt or truncated safetensors file ({e})"
    return None


def checkpoint_dir(flag: str, value: str) -> None:
    """A checkpoint directory (config.json and the weights: `LM.save_pretrained`, transformers'
    `save_pretrained`, its config.json JSON and its safetensors header readable), checked where the
    value is a local path: one that exists, or one that cannot be a Hugging Face Hub repo id (a
    missing `runs/x/model`, or `runs/lm` where runs/ exists). A Hub id ("org/name") that is no
    local path is left to the loader."""
    p = Path(os.path.expanduser(value))
    expected = ("expected a checkpoint directory holding config.json and the weights (model.safetensors), "
                "such as the model/ directory of a `fastweights train` run")
    if not p.exists():
        if _path_like(value):
            raise ArgError(f"{flag}{value}: no such directory; {expected}")
        return
    if not p.is_dir():
        raise ArgError(f"{flag}{value}: is a file; {expected}")
    if (p / "config.json").is_file() and any((p / w).is_file() for w in WEIGHT_FILES):
        why = _unreadable(p)
        if why is not None:
            raise ArgError(f"{flag}{value}: {why}")
        return
    if (p / "model" / "config.json").is_file():  # (a run directory holds its own config.json: the run's settings)
        raise ArgError(f"{flag}{value}: is a `fastweights train` run directory, not a checkpoint; the run "
                       f"directory's checkpoint is at {p / 'model'}")
    if (p / "checkpoint.pt").is_file():
        raise ArgError(f"{flag}{value}: is a `fastweights train` run directory whose checkpoint ({p / 'model'}) "
                       "has not been written yet")
    if (p / "config.json").is_file():
        raise ArgError(f"{flag}{value}: holds config.json but no weights (one of {', '.join(WEIGHT_FILES)}); "
                       f"{expected}")
    raise ArgError(f"{flag}{value}: holds no config.json; {expected}")


def zoo_names(flag: str, names: Iterable[str] | None, *, allowed: Sequence[str] | None = None) -> None:
    """Every name a zoo model (or one of `allowed`), with the closest names for a typo."""
    if names is None:
        return
    from . import zoo

    pool = list(allowed) if allowed is not None else list(zoo.names())
    for n in names:
        if n not in pool:
            import difflib

            close = difflib.get_close_matches(n, pool, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(pool)}"
            raise ArgError(f"{flag}: unknown model {n!r}{hint}")


def flag_message(error: Exception, fields: Sequence[str]) -> str:
    """A config's message ("epochs must be ...") in the words of the command line ("--epochs must
    be ..."), when it starts with one of `fields`."""
    msg = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, KeyError) and msg.startswith(("'", '"')):
        msg = msg[1:-1]
    head = msg.split(" ", 1)[0]
    if head.rstrip(":") in fields:
        return "--" + head.replace("_", "-") + msg[len(head):]
    return msg
