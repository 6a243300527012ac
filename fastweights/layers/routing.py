"""How the layer modules ask the dispatch table for their rows, and what they remember of it.

A module stores the *requested* backend ("auto" or a name) and routes every call afresh from the
call's Target (`fastweights.dispatch`, THE RULE): a module built on the CPU and moved to a GPU runs
what one built on the GPU runs. `routes` keeps, per form or op, the backend and device type of the
last call (what `repr` shows), and `variants` its rows' launch-table variants (`kernels.variants`) beside:
records, never read to decide anything.
"""

from __future__ import annotations

import torch

from .. import dispatch

__all__ = ["layer_op_row", "describe_routes"]


def layer_op_row(routes: dict[str, tuple[str, str]], op: str, backend: str, target: dispatch.Target,
                 variants: dict[str, tuple[str, ...]] | None = None) -> dispatch.Impl:
    """The row of layer op `op` for a call with `target` (`dispatch.layer_op`), recorded in `routes` (and, given
    `variants`, the launch-table variants it runs there: `Impl.variants_for`, e.g. ("conv backward: rows (RUN 128)",);
    not under torch.compile, whose trace keeps the last eager call's record)."""
    impl = dispatch.layer_op(op, backend, target)
    routes[op] = (impl.backend, target.device_type)
    if variants is not None and not torch.compiler.is_compiling():
        variants[op] = impl.variants_for(None, target)
    return impl


def describe_routes(routes: dict[str, tuple[str, str]], pipelines: dict[str, str | None] | None = None,
                    variants: dict[str, tuple[str, ...]] | None = None) -> str:
    """'' before the first call; else ' → conv: triton [conv backward: rows (RUN 128)] on cuda, chunk: triton (staged
    forward, fused backward) [fused backward: Aqk per value block] on cuda, …' (the last call of each form or op;
    `pipelines`: the named pipeline of a form's row, where it has one; `variants`: the launch-table variants the
    call ran in it, `kernels.variants`, where it ran any)."""
    if not routes:
        return ""
    pipelines = pipelines or {}
    variants = variants or {}

    def row(key, b):
        named = f"{b} ({pipelines[key]})" if pipelines.get(key) else b
        return f"{named} [{'; '.join(variants[key])}]" if variants.get(key) else named

    return " → " + ", ".join(f"{key}: {row(key, b)} on {dev}" for key, (b, dev) in routes.items())
