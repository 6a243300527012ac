"""The verdict of one malformed call, shared by the fuzz tests (tests/test_fuzz_*.py).

A call given a malformed argument must end in a *clear error*: an exception of the project's error
classes (or argparse's exit status 2) whose message names the argument. Anything else is a finding:

    raw     another exception type (a traceback from deep inside torch or the library)
    silent  it returned (a malformed value taken as valid, or exit status 0)
    unnamed a project error whose message does not name the argument
    hang    it ran past the watchdog's seconds
    nan     (valid-but-degenerate calls only) a result with nan/inf from finite inputs

Census (the counts of the issue's report): with FASTWEIGHTS_FUZZ_CENSUS=<file>, `judge` appends each
verdict to <file> as a JSON line instead of asserting, e.g.
    FASTWEIGHTS_FUZZ_CENSUS=/tmp/c.jsonl pytest tests/test_fuzz_api.py tests/test_fuzz_cli.py -p no:randomly \
        --hypothesis-seed=0
then count the lines by entry point and verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter

import torch

from fastweights.cliargs import ArgError
from fastweights.dispatch import FormNotAvailable
from fastweights.inputs import InputError
from fastweights.layers.mixer import MixerError
from fastweights.models.checkpoint import CheckpointError
from fastweights.models.config import ConfigError
from fastweights.recipe import RecipeError

PROJECT_ERRORS = (InputError, RecipeError, FormNotAvailable, ConfigError, MixerError, CheckpointError, ArgError)

#: verdicts of every case judged in this process, per (entry point, verdict)
TALLY: Counter = Counter()


class Hang(BaseException):
    """Raised by the watchdog (a BaseException: no `except Exception` of the code under test swallows it)."""


@contextlib.contextmanager
def watchdog(seconds: int):
    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def verdict(fn, names, *, seconds: int = 30) -> tuple[str, str]:
    """(verdict, detail) of calling fn() with a malformed argument that one of `names` spells."""
    try:
        with watchdog(seconds):
            out = fn()
    except Hang as e:
        return "hang", str(e)
    except SystemExit as e:  # argparse's own errors
        return ("clear", str(e)) if e.code == 2 else ("silent" if not e.code else "raw", f"SystemExit({e.code})")
    except PROJECT_ERRORS as e:
        msg = str(e)
        return ("clear", msg) if any(n in msg for n in names) else ("unnamed", f"{type(e).__name__}: {msg}")
    except Exception as e:  # noqa: BLE001 — every other type is the finding
        return "raw", f"{type(e).__name__}: {str(e)[:300]}"
    return "silent", f"returned {summarize(out)}"


def summarize(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor {list(out.shape)} {out.dtype}"
    if isinstance(out, (tuple, list)):
        return "(" + ", ".join(summarize(x) for x in out[:3]) + ")"
    return repr(out)[:100]


def judge(entry: str, fn, names, what: str, *, seconds: int = 30) -> None:
    """Assert the call fn() (with the malformed `what`) ends in a clear error naming one of `names`."""
    v, detail = verdict(fn, names, seconds=seconds)
    record(entry, what, v, detail)


def record(entry: str, what: str, v: str, detail: str) -> None:
    """Count the verdict; in a census append it to the census file, else assert it is "clear"."""
    TALLY[(entry, v)] += 1
    census = os.environ.get("FASTWEIGHTS_FUZZ_CENSUS")
    if census:
        with open(census, "a") as f:
            f.write(json.dumps({"entry": entry, "what": what, "verdict": v, "detail": detail[:300]}) + "\n")
        return
    assert v == "clear", f"{entry} with {what}: {v} — {detail}"


def all_finite(out) -> bool:
    """Every floating tensor in a (nested) result is finite."""
    from fastweights.state import state_tensors

    if isinstance(out, torch.Tensor):
        return not out.is_floating_point() or bool(torch.isfinite(out).all())
    if isinstance(out, (tuple, list)):
        return all(all_finite(x) for x in out)
    return all(all_finite(x) for x in state_tensors(out)) if out is not None else True
