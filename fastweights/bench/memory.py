"""What a computation holds in memory, measured on the CPU: `cpu_peak_bytes(fn)`, the peak of the tensor storages the
ops create while fn() runs — the CPU's stand-in for torch.cuda.max_memory_allocated (used by
scripts/minibatch_memory.py --cpu-peak and tests/chunkwise/test_minibatch.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["cpu_peak_bytes"]


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of the CPU tensor storages the ops inside fn() create, each counted from its creation until it is
    freed (weakref finalizers on the storages); what existed before fn() is not counted."""
    live = {"now": 0, "peak": 0}
    seen: set[int] = set()

    def free(key: int, nbytes: int) -> None:
        seen.discard(key)
        live["now"] -= nbytes

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key and key not in seen:
                        seen.add(key)
                        live["now"] += st.nbytes()
                        live["peak"] = max(live["peak"], live["now"])
                        weakref.finalize(st, free, key, st.nbytes())
            return out

    with Track():
        fn()
    return live["peak"]
