"""Cells for the fault tests (tests/lab/test_faults.py): a sweep script run in a subprocess, whose
run function must be importable by spawned worker processes.

    python -m tests.lab.sweep_cells OUT N_CELLS SECONDS WORKERS

runs N_CELLS cells through `run_sweep` on OUT/results.jsonl; each cell writes OUT/started/<cell>-<pid>
when it starts, sleeps SECONDS (in small slices, stopping when a stop is requested, as
`train_cell` does) and returns. Prints "interrupted: ..." and exits 130
when the sweep is interrupted."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SleepCell:
    name: str
    seconds: float
    out: str


def run_sleep_cell(cell: SleepCell, progress=None, desc=None) -> dict:
    started = Path(cell.out) / "started"
    started.mkdir(parents=True, exist_ok=True)
    (started / f"{cell.name}-{os.getpid()}").write_text("")
    from fastweights.training.control import Interrupted, stop_requested

    t_end = time.monotonic() + cell.seconds
    while time.monotonic() < t_end:
        if stop_requested():  # what train_cell does at every step
            raise Interrupted(f"{cell.name}: stopped")
        time.sleep(0.05)
    return {"accuracy": 0.5, "pid": os.getpid()}


def main(argv) -> int:
    from fastweights.lab.train import Interrupted, ResultStore, run_sweep

    out, n, seconds, workers = Path(argv[0]), int(argv[1]), float(argv[2]), int(argv[3])
    cells = [SleepCell(f"c{i}", seconds, str(out)) for i in range(n)]
    try:
        run_sweep(cells, ResultStore(out / "results.jsonl"), run_sleep_cell, mode="local", workers=workers,
                  progress="plain")
    except Interrupted as e:
        print(e, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
