"""The torch twins of the TTT kernels (`kernels.triton.memories.ttt.ttt_linear_triton`, `ttt_mlp.ttt_mlp_triton`), on
the kernels' own contract: only the tests need them (the torch row runs `chunkwise.minibatch` itself)."""

from __future__ import annotations

import dataclasses

from fastweights.chunkwise.minibatch import minibatch_chunk
from fastweights.state import MemoryState, compute_dtype
from fastweights.zoo import get


def _ttt_torch(recipe_name, q, k, v, beta, ln_weight, ln_bias, *, scale, weights, anchor, offset, minibatch):
    """`chunkwise.minibatch.minibatch_chunk` for the zoo recipe `recipe_name` with mini-batch b, in fp32 (float64
    for float64 inputs), grouped heads expanded (no cu_seqlens: the reference of a varlen call is this on each
    sequence alone). q, k [B, T, H_q, D], v [B, T, H, D]; returns (o in v's dtype, final weights, anchor, offset)."""
    recipe = get(recipe_name)
    recipe = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, minibatch=minibatch))
    cdt = compute_dtype(q)
    G = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(G, dim=2).to(cdt) for x in (q, k))
    st = MemoryState(weights=tuple(w.to(cdt) for w in weights), offset=offset,
                     anchor=None if anchor is None else tuple(w.to(cdt) for w in anchor))
    o, final = minibatch_chunk(recipe, q, k, v.to(cdt), scale=scale, g=None, beta=beta.to(cdt), nu=None, gamma=None,
                               state=st, ln=(ln_weight.to(cdt), ln_bias.to(cdt)))
    return o.to(v.dtype), final.weights, final.anchor, final.offset


def ttt_linear_torch(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                     minibatch: int = 16):
    """The torch twin of `ttt_linear_triton` (same contract): the recipe `ttt_linear`."""
    return _ttt_torch("ttt_linear", q, k, v, beta, ln_weight, ln_bias, scale=scale, weights=weights, anchor=anchor,
                      offset=offset, minibatch=minibatch)


def ttt_mlp_torch(q, k, v, beta, ln_weight, ln_bias, *, scale: float, weights, anchor=None, offset: int = 0,
                  minibatch: int = 16):
    """The torch twin of `ttt_mlp_triton` (same contract): the recipe `ttt_mlp`."""
    return _ttt_torch("ttt_mlp", q, k, v, beta, ln_weight, ln_bias, scale=scale, weights=weights, anchor=anchor,
                      offset=offset, minibatch=minibatch)
