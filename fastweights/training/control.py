"""Stop requests: a training loop asked to stop (Ctrl-C) saves where it is and stops, instead of
losing the work since its last checkpoint.

`stop_on_signals(signals)` (a context manager, main thread only) replaces the handlers of the given
signals (`stop_on_sigint()`: SIGINT alone, the sweeps; `fastweights train`: SIGINT and SIGTERM):
while a training loop is running in this process (`training()`), the first signal only sets a
flag; the loop sees it at its next step (`stop_requested()`), saves a checkpoint of where it is
and raises `Interrupted`. A signal while nothing is training raises KeyboardInterrupt at once, and
so does a second one — unless `repeats="ignore"`: under torchrun a Ctrl-C reaches every rank twice
(from the terminal and forwarded by torchrun), and the save must not be cut short (torchrun itself
kills what is still running 30 s later). `request_stop()` / `clear_stop()` set and clear the flag
directly (tests, embedding code); `stop_in_worker()` makes every SIGINT of a sweep's worker
process only set the flag (the worker saves its cell and returns `Interrupted`;
`fastweights.lab.control.worker_init`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

__all__ = ["Interrupted", "stop_on_signals", "stop_on_sigint", "training", "stop_requested", "request_stop",
           "clear_stop", "stop_in_worker", "resume_hint"]


class Interrupted(Exception):
    """A training run, a sweep or a cell stopped on request (SIGINT); its message says what was saved."""


_STOP = threading.Event()
_ACTIVE = [0]  # training loops running in this process
_IN_WORKER = [False]
_IGNORE_REPEATS = [False]


def stop_requested() -> bool:
    return _STOP.is_set()


def request_stop() -> None:
    """Ask the running training loop to save and stop (what the first SIGINT does)."""
    _STOP.set()


def clear_stop() -> None:
    _STOP.clear()


@contextlib.contextmanager
def training():
    """Marks a training loop: while one runs, the first SIGINT only requests a stop."""
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1


def _on_signal(signum, frame):
    if _IN_WORKER[0]:
        _STOP.set()
        return
    if _ACTIVE[0] > 0 and not _STOP.is_set():
        _STOP.set()
        return
    if _ACTIVE[0] > 0 and _IGNORE_REPEATS[0]:
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT,), *, repeats: str = "interrupt"):
    """Install the stop handler for `signals` for the duration (a no-op off the main thread); the
    stop flag is cleared on entry and on exit. repeats: "interrupt" (a second signal during a
    training loop raises KeyboardInterrupt) or "ignore" (it is ignored)."""
    if repeats not in ("interrupt", "ignore"):
        raise ValueError(f"repeats must be 'interrupt' or 'ignore', got {repeats!r}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    old = {s: signal.signal(s, _on_signal) for s in signals}
    was, _IGNORE_REPEATS[0] = _IGNORE_REPEATS[0], repeats == "ignore"
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _IGNORE_REPEATS[0] = was
        _STOP.clear()


def stop_on_sigint():
    """`stop_on_signals((SIGINT,))`: the sweeps' Ctrl-C."""
    return stop_on_signals((signal.SIGINT,))


def stop_in_worker() -> None:
    """In a sweep's worker process: every SIGINT only requests a stop (the parent decides when to
    kill)."""
    _IN_WORKER[0] = True
    signal.signal(signal.SIGINT, _on_signal)


def resume_hint() -> str:
    """'run the same command again to resume' with the command line when it is known."""
    argv = " ".join(sys.argv) if sys.argv and sys.argv[0] else ""
    return "run the same command again to resume" + (f" ({argv})" if argv and len(argv) < 200 else "")
