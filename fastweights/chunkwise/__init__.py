"""Chunkwise-parallel training forms (plain PyTorch, any device), reached through
`fastweights.chunk(model, ...)`:

    gated.py      chunk_gated  — gated-linear class (linear attention, RetNet, Mamba2, GLA)
    delta.py      chunk_delta  — delta class via the WY/UT transform (DeltaNet, GDN, KDA, Comba,
                                 DeltaProduct)
    varlen.py     the chunk layout shared by both (padded batch or cu_seqlens packing)
    mesa.py       Mesa's chunk-boundary states + chunked conjugate-gradient solve
    minibatch.py  the inner mini-batch form of trained memories (TTT, Titans, ATLAS, ...)

(The folder is not called `chunk` so that it never shadows the function `fastweights.chunk`.)
"""

from .delta import chunk_delta
from .gated import chunk_gated

__all__ = ["chunk_gated", "chunk_delta"]
