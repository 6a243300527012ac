"""How the layer modules ask the dispatch table for their rows, and what they remember of it.

A module stores the *requested* backend ("auto" or a name) and routes every call afresh from the
call's Target (`fastweights.dispatch`, THE RULE): a module built on the CPU and moved to a GPU runs
what one built on the GPU runs. `routes` keeps, per form or op, the backend and device type of the
last call (what `repr` shows); it is a record, never read to decide anything.
"""

from __future__ import annotations

from .. import dispatch

__all__ = ["layer_op_row", "describe_routes"]


def layer_op_row(routes: dict[str, tuple[str, str]], op: str, backend: str, target: dispatch.Target) -> dispatch.Impl:
    """The row of layer op `op` for a call with `target` (`dispatch.layer_op`), recorded in `routes`."""
    impl = dispatch.layer_op(op, backend, target)
    routes[op] = (impl.backend, target.device_type)
    return impl


def describe_routes(routes: dict[str, tuple[str, str]], pipelines: dict[str, str | None] | None = None) -> str:
    """'' before the first call; else ' → conv: triton on cuda, chunk: triton (staged forward, fused backward) on
    cuda, …' (the last call of each form or op; `pipelines`: the named pipeline of a form's row, where it has one)."""
    if not routes:
        return ""
    pipelines = pipelines or {}

    def row(key, b):
        return f"{b} ({pipelines[key]})" if pipelines.get(key) else b

    return " → " + ", ".join(f"{key}: {row(key, b)} on {dev}" for key, (b, dev) in routes.items())
