"""Sweeps under faults, for real, in subprocesses (fastweights.lab.control and run_sweep): a SIGKILL
of the main process takes its workers with it; two processes on one store never run a cell twice.
(A SIGINT to the main process alone: tests/lab/test_mqar.py, through the CLI.) Every wait is
bounded; the cells sleep instead of training (tests/lab/sweep_cells.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastweights.lab.control import CellLock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and flock")

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 90  # python + torch imports in the main process and in spawned workers, on a loaded machine
STOP_S = 15  # what "stops within seconds" allows


def _start(out: Path, n: int, seconds: float, workers: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "tests.lab.sweep_cells", str(out), str(n), str(seconds),
                             str(workers)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_started(out: Path, n: int, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        files = list((out / "started").glob("*")) if (out / "started").exists() else []
        if len(files) >= n:
            return [int(f.name.rsplit("-", 1)[1]) for f in files]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the sweep did not start {n} cells in {STARTUP_S} s: {proc.communicate()}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_workers_die_when_the_main_process_is_sigkilled(tmp_path):
    proc = _start(tmp_path, n=2, seconds=120, workers=2)
    pids = _wait_started(tmp_path, 2, proc)
    assert proc.pid not in pids  # the cells run in worker processes
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=STOP_S)
    deadline = time.monotonic() + STOP_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leave them behind even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their SIGKILLed parent"


def test_two_processes_on_one_store_run_each_cell_once(tmp_path):
    a = _start(tmp_path, n=4, seconds=1.0, workers=1)
    _wait_started(tmp_path, 1, a)  # the first holds a cell when the second starts
    b = _start(tmp_path, n=4, seconds=1.0, workers=1)
    outs = [p.communicate(timeout=STARTUP_S) for p in (a, b)]
    assert a.returncode == 0 and b.returncode == 0, outs
    recs = [json.loads(ln) for ln in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and len({r["key"] for r in recs}) == 4
    started = sorted(f.name.rsplit("-", 1)[0] for f in (tmp_path / "started").glob("*"))
    assert started == ["c0", "c1", "c2", "c3"]  # every cell ran once, whichever process ran it


def test_cell_lock_is_exclusive_and_names_its_holder(tmp_path):
    lk = CellLock.acquire(tmp_path, "k")
    assert lk is not None and CellLock.holder(tmp_path, "k") == os.getpid()
    assert CellLock.acquire(tmp_path, "k") is None  # flock: another open file cannot take it
    assert CellLock.acquire(tmp_path, "other") is not None
    lk.release()
    again = CellLock.acquire(tmp_path, "k")
    assert again is not None
    again.release()
