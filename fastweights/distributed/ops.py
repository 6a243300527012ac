"""The functional API under context parallelism: `chunk(model, q_r, k_r, v_r, context=cp, ...)` is
`fastweights.chunk` over the whole sequence, each rank passing and receiving its own span."""

from __future__ import annotations

import torch

from .. import api
from ..zoo import resolve
from .context import ContextParallel, ContextParallelError

Tensor = torch.Tensor

__all__ = ["chunk"]


def chunk(model, q: Tensor, k: Tensor, v: Tensor, *, context: ContextParallel, chunk_size: int = 64,
          scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
          backend: str = "auto", **inputs) -> tuple[Tensor, Tensor | None]:
    """This rank's outputs o_r [B, T_r, H, V] of `fastweights.chunk` over the sequence whose span r is
    (q_r, k_r, v_r, inputs_r) — every rank of `context` calls it with its own span, in the same order — and
    the final state of the whole sequence [B, H, K, V] (the same on every rank) when output_final_state.

    initial_state: the state before the sequence's first token (rank 0's), given on every rank alike.
    The inputs are checked on each rank as `fastweights.chunk` checks them (shapes, dtypes, values)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ContextParallelError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(context, ContextParallel):
        raise ContextParallelError(f"context must be a ContextParallel, got {type(context).__name__}")
    recipe = resolve(model)
    from ..inputs import validate

    validate(recipe, q, k, v, inputs, check_values=True)  # the checks of the plain call, on this span
    api._check_state_device(initial_state, q.device)
    from ..dispatch import route

    def backend_for(width: int) -> str:
        return route(recipe, "chunk", backend, api.call_target("chunk", q, q.shape[-1], width, chunk_size)).backend

    s = scale if scale is not None else (recipe.scale if recipe.scale is not None else q.shape[-1] ** -0.5)
    return context.memory(api.chunk, recipe, q, k, v, scale=s, inputs=inputs, initial_state=initial_state,
                          output_final_state=output_final_state, backend_for=backend_for, chunk_size=chunk_size)
