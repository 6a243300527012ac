"""Checkpoint files of a training run: written so that a kill at any moment leaves the previous
file whole, with the RNG states that make a resumed run draw what an uninterrupted one draws.

`atomic_save(obj, path)` writes `torch.save(obj)` to a temporary file of this process and thread
(never a name another writer uses), fsyncs it and `os.replace`s it onto `path`: a reader sees the
old file or the new one, never a torn one, and a failed write (a full disk) removes its temporary
file and leaves the old one as it was. `rng_state()` / `set_rng_state(st)` capture and restore the
torch (CPU and every CUDA device), NumPy and Python generators.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["atomic_save", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state_all(st["cuda"])


def atomic_save(obj, path) -> None:
    """torch.save(obj) onto `path` through a temporary file of this writer (see the module doc)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
