"""FastWeightsCache: the LM's own decoding state as a transformers `Cache`.

It holds one `LMState` (per layer: the fixed-size memory, the short-convolution tails, or the KV
cache of a softmax-side layer; and, after a padded prefill, every row's own length as a tensor
[B], from which positions are taken). Generation hands it back to the model at every step;
beam search reorders its rows (`reorder_cache`), and `batch_repeat_interleave` /
`batch_select_indices` expand or pick rows. It cannot be cropped: a fast-weight memory has no
earlier version to roll back to (so assisted decoding, which crops, is not available).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..layers.segments import select_rows
from ..models.lm import LMState

__all__ = ["FastWeightsCache"]


class FastWeightsCache(Cache):
    """state: the LMState after the tokens seen so far (None before the first forward)."""

    def __init__(self, state: LMState | None = None, batch_size: int = -1):
        super().__init__(layers=[])
        self.state = state
        self._batch = batch_size

    def __repr__(self):
        return f"FastWeightsCache(batch_size={self._batch}, position={self.get_seq_length()})"

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return self._batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens consumed (padding included: the width of the attention mask so far)."""
        return 0 if self.state is None else self.state.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.state is not None

    def reset(self):
        self.state, self._batch = None, -1

    def _select(self, index: torch.Tensor):
        self.state = select_rows(self.state, index)
        self._batch = int(index.numel())

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int):
        if self.state is not None:
            self._select(torch.arange(self._batch).repeat_interleave(repeats))

    def crop(self, max_length: int):
        raise NotImplementedError("a FastWeightsCache cannot be cropped: a fast-weight memory keeps no earlier "
                                  "versions of itself")
