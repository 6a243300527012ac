"""Experiments that need no training: probes of what the memories themselves can do.

* :mod:`fastweights.lab.capacity` — the training-free capacity probe (`fastweights capacity`):
  write n (key, value) pairs with each memory's own update rule, read every key back, score
  recall against n / d_k.
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
