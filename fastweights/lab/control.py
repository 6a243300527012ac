"""Process control for the sweeps: workers that die with their parent, and per-cell locks so that
two processes on one output directory never train the same cell. (Stopping on Ctrl-C, shared with
`fastweights train`: `fastweights.training.control`.)

* **Workers.** `worker_init(parent_pid)` is the initializer of the sweep's worker processes: the
  worker asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`), and a daemon
  thread checks the parent's pid every half second (any POSIX system), so a SIGKILL of the main
  process never leaves workers training as orphans. A SIGINT in a worker sets the stop flag (the
  worker saves its cell and returns `Interrupted`).
* **Cell locks.** `CellLock.acquire(directory, key)` takes an exclusive, non-blocking `flock` on
  ``directory/<sha1(key)[:16]>.lock`` and writes its pid there; None (with the holder's pid in
  `CellLock.holder`) when another process holds it. The kernel drops the lock when the holder
  dies, however it dies, so a stale lock cannot block a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..training.control import stop_in_worker

__all__ = ["run_interruptible", "worker_init", "CellLock"]


# ------------------------------------------------------------------------------------------ workers
def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog thread remains
        pass


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def worker_init(parent_pid: int) -> None:
    """Initializer of a sweep worker process (see the module doc)."""
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    stop_in_worker()


# ------------------------------------------------------------------------------------------ locks
class CellLock:
    """An exclusive lock on one cell of one output directory (see the module doc)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    @staticmethod
    def path_for(directory, key: str) -> Path:
        return Path(directory) / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".lock")

    @classmethod
    def acquire(cls, directory, key: str) -> CellLock | None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no flock: no cross-process exclusion
            return cls(-1, Path(directory))
        path = cls.path_for(directory, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(fd, path)

    @classmethod
    def holder(cls, directory, key: str) -> int | None:
        """The pid written by the process holding (or last holding) the lock, if readable."""
        try:
            return int(cls.path_for(directory, key).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self.fd < 0:
            return
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def run_interruptible(fn, args, name: str) -> int:
    """fn(args), with a Ctrl-C outside a sweep's own handling ending in one line and status 130
    (the `python -m fastweights.lab.<name>` entry points; `fastweights` itself does the same)."""
    try:
        return fn(args) or 0
    except KeyboardInterrupt:
        print(f"interrupted: {name} stopped on Ctrl-C", file=sys.stderr)
        return 130
