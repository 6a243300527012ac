"""Checkpoint writes (fastweights.training.checkpoint): concurrent writers never collide, a failed
write (a full disk) leaves the previous file whole and no temporary behind, RNG states round-trip."""

import errno
import random
import threading

import numpy as np
import pytest
import torch

from fastweights.training.checkpoint import atomic_save, rng_state, set_rng_state


def test_concurrent_checkpoint_writers_never_collide(tmp_path):
    path, errors = tmp_path / "c.pt", []

    def writer(tag):
        try:
            for i in range(40):
                atomic_save({"tag": tag, "i": i, "x": torch.randn(256)}, path)
        except Exception as e:  # a fixed temporary name raced here: FileNotFoundError
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.load(path, weights_only=False)["i"] == 39 and not list(tmp_path.glob("*.tmp"))


def test_a_write_that_fails_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    atomic_save({"step": 1}, path)

    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as e:
        atomic_save({"step": 2}, path)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_rng_states_round_trip():
    st = rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(st)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
