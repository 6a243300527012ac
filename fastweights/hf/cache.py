"""FastWeightsCache: the LM's own decoding state as a transformers `Cache`, croppable.

It holds one `LMState` (per layer: the fixed-size memory, the short-convolution tails, or the KV
cache of a softmax-side layer; and, after a padded prefill, every row's own length as a tensor
[B], from which positions are taken). Generation hands it back to the model at every step;
beam search reorders its rows (`reorder_cache`), and `batch_repeat_interleave` /
`batch_select_indices` expand or pick rows.

Cropping (assisted and prompt-lookup decoding). Those feed several candidate tokens in one
forward, then `crop(-k)` drops the k rejected ones; transformers first calls
`activate_past_recording()` on the cache (the main model's before decoding, an assistant's when
its cache is made). While recording, every forward on the cache keeps a checkpoint: the state
before the call and the call's inputs (ids [B, t] or embeddings [B, t, d], and the padding mask
of a first block). The state after a call is the next checkpoint's "before" (or the current
state), so a crop to a call boundary is a lookup; a crop inside a call restores the state before
it and runs the kept prefix of its inputs again (`LM.prefill`). `crop` then forgets the history:
it is the point where the kept tokens are accepted (transformers never crops past it).

Why the state before a call plus its inputs, not the state after every token: the chunked
training forms give only the state at the end of a block, and the state after each token would
need the recurrent form token by token (n states per layer, and the verification of n candidate
tokens no longer one parallel forward). Re-running the kept prefix costs one forward over the
accepted tokens of the last call and is exact for every layer by construction: the memory, the
convolution tails, a KV cache (its entries recomputed are the ones the block had), inner
mini-batch offsets, per-row states after padding — the state after `crop(m)` is the state of
having fed the kept tokens as they were fed, never having seen the dropped ones. A single-token
decoding step is a call of its own, so an assistant drafting token by token crops by lookup.

Memory: without recording (plain generation: greedy, sampling, beam search) nothing is kept — one
LMState, as before. While recording: one LMState per forward call since the last crop (one or two
in the main model of assisted decoding; the assistant's draft steps) plus those calls' inputs.
The first call of assisted decoding feeds the prompt and the first draft together: its crop runs
the prompt again once.

`crop(n)`: n < 0 drops the last −n tokens (transformers ≥ 5.17's convention); n = 0 keeps every
token and forgets the history; n > 0 keeps the first n tokens (the older absolute convention,
which 5.17 still reads: nothing to do when n ≥ the tokens held).

What `generate` calls (read in 5.17.0 and 5.24.0, `generation/utils.py` and
`generation/candidate_generator.py`): `_validate_generation_mode` refuses assisted decoding for a
model with `_is_stateful` (no longer set); `_assisted_decoding` raises without a cache before the
first forward (so `_prepare_cache_for_generation` of the model makes an empty one), calls
`activate_past_recording()` on it, checks `is_croppable` after the first forward (5.24), and
after each check calls `crop(-(drafted − accepted))` — a 0-d tensor in 5.17, an int in 5.24, and
`crop(0)` when every draft was accepted; an assistant's `_update_past_and_masks` calls
`get_seq_length()` and `crop(-k)` (k ≥ 0) on the assistant's cache, which
`_prepare_cache_for_generation` sets recording for an assistant. `is_compileable` False keeps
generate from compiling the step; mps's deferred stop check (`DeferredStopCheck`) calls `crop(0)`
/ `crop(-1)` too (it reads `is_croppable`; not run here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..inputs import InputError
from ..layers.segments import select_rows
from ..models.lm import LMState

__all__ = ["FastWeightsCache"]


@dataclass
class _Call:
    """One forward call on a recording cache: the state before it (None: none yet) and its inputs.

    ids [B, t] int64 or embeds [B, t, d_model] (one of the two); mask [B, t] the padding mask of a
    first block (None: every position a token)."""

    before: LMState | None
    ids: torch.Tensor | None
    embeds: torch.Tensor | None
    mask: torch.Tensor | None

    @property
    def start(self) -> int:
        return 0 if self.before is None else self.before.position


class FastWeightsCache(Cache):
    """state: the LMState after the tokens seen so far (None before the first forward)."""

    def __init__(self, state: LMState | None = None, batch_size: int = -1):
        super().__init__(layers=[])
        self.state = state
        self._batch = batch_size
        self.record_past = False
        self._calls: list[_Call] = []
        self._lm = None  # the LM that ran the recorded calls (re-runs a cropped one)

    def __repr__(self):
        return f"FastWeightsCache(batch_size={self._batch}, position={self.get_seq_length()})"

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """[False]: to `generate`, this cache is one that holds `get_seq_length()` tokens and is continued with the
        tokens after them — not one of transformers' linear-attention caches, which it feeds the whole sequence again
        (transformers 5.24's prefill slices input_ids to the uncached part only when `not all(cache.is_linear)`; with
        the base class's [] it did not, and an assistant's every `generate` round re-fed its whole sequence on top of
        its cropped state — wrong drafts, and an InputError once an attention mask came along)."""
        return [False]

    @property
    def is_croppable(self) -> bool:
        """True while recording: `crop` then puts the state back exactly (see the module doc)."""
        return self.record_past

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
        self.record_past, self._calls, self._lm = False, [], None

    # ------------------------------------------------------------------ updates (the model's forward)
    def update_state(self, after: LMState, lm, *, ids: torch.Tensor | None = None,
                     embeds: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        """The state after a forward call on this cache over ids [B, t] (or embeds [B, t, d]; mask
        [B, t] for a padded first block); recorded for `crop` while recording."""
        if self.record_past:
            self._calls.append(_Call(self.state, ids, embeds, mask))
            self._lm = lm
        self.state = after

    def activate_past_recording(self):
        """Keep what `crop` needs from now on (transformers calls it before assisted decoding)."""
        self.record_past = True
        self._calls = []

    # ------------------------------------------------------------------ rows
    def _select(self, index: torch.Tensor):
        self.state = select_rows(self.state, index)
        self._calls = [_Call(select_rows(c.before, index), select_rows(c.ids, index), select_rows(c.embeds, index),
                             select_rows(c.mask, index)) for c in self._calls]
        self._batch = int(index.numel())

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int):
        if self.state is not None:
            self._select(torch.arange(self._batch).repeat_interleave(repeats))

    # ------------------------------------------------------------------ cropping
    def crop(self, max_length: int):
        """Drop tokens: max_length < 0 drops the last −max_length, > 0 keeps the first max_length
        (nothing when that is all of them or more), 0 drops none; then forgets the history (the kept
        tokens are accepted). Exact: see the module doc. Needs `activate_past_recording()` first."""
        if isinstance(max_length, torch.Tensor) and max_length.numel() == 1 and not max_length.is_floating_point():
            max_length = int(max_length)  # (5.17's assisted decoding passes a 0-d tensor)
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise InputError(f"crop(max_length): an int (or a 0-d integer tensor), got {max_length!r}")
        held = self.get_seq_length()
        target = held + max_length if max_length <= 0 else min(max_length, held)
        if target < 0:
            raise InputError(f"crop({max_length}): the cache holds only {held} tokens")
        if target < held:
            self.state = self._rewind(target, max_length)
        self._calls = []

    def _rewind(self, target: int, asked: int) -> LMState | None:
        """The state after the first `target` tokens, from the recorded calls."""
        if not self.record_past:
            raise InputError(f"crop({asked}): this FastWeightsCache is not recording its past (a fast-weight memory "
                             "cannot be rolled back from its current state alone); call activate_past_recording() "
                             "before the forward calls to be cropped (generate does for assisted decoding)")
        if not self._calls or target < self._calls[0].start:
            since = self._calls[0].start if self._calls else self.get_seq_length()
            raise InputError(f"crop({asked}): the cache can go back to token {since} at the earliest (recorded since "
                             f"activate_past_recording() or the last crop), asked for {target}")
        i = max(j for j, c in enumerate(self._calls) if c.start <= target)
        call = self._calls[i]
        k = target - call.start
        if k == 0:
            return call.before
        with torch.no_grad():
            _, state = self._lm.prefill(None if call.ids is None else call.ids[:, :k], call.before,
                                        attention_mask=None if call.mask is None else call.mask[:, :k],
                                        inputs_embeds=None if call.embeds is None else call.embeds[:, :k])
        return state
