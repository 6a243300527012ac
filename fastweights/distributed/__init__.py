"""Work spread over several processes along the sequence: context parallelism (`context`).

`fastweights.training.distributed` holds the process-group helpers of data parallelism (DDP, FSDP2);
this package splits one sequence over ranks (see `context`'s module doc for the maths)."""

from .context import ContextParallel, ContextParallelError, span_bounds, supports
from .ops import chunk

__all__ = ["ContextParallel", "ContextParallelError", "span_bounds", "supports", "chunk"]
