"""Experiments: what the memories can hold and what trained models of them recall.

* :mod:`fastweights.lab.capacity` — the training-free capacity probe (`fastweights capacity`):
  write n (key, value) pairs with each memory's own update rule, read every key back, score
  recall against n / d_k.
* :mod:`fastweights.lab.mqar`, :mod:`~fastweights.lab.niah`, :mod:`~fastweights.lab.mad` — trained
  recall sweeps (`fastweights mqar|niah|mad`) on the generators of :mod:`fastweights.tasks`.
* :mod:`fastweights.lab.train` — the training harness those sweeps share (resumable cells, DDP,
  JSONL results); :mod:`~fastweights.lab.control` (sweep workers, cell locks). The optimizer
  step, checkpoints, stop requests and the process group are :mod:`fastweights.training`'s.
"""

from .capacity import (
    MODELS,
    SETTINGS,
    Probe,
    format_table,
    plot_capacity,
    probes,
    read_state,
    recall,
    run_capacity,
)

__all__ = ["MODELS", "SETTINGS", "Probe", "probes", "run_capacity", "read_state", "recall", "format_table",
           "plot_capacity"]
