"""Documents inside a block of tokens: padding (`attention_mask`), packed documents (`cu_seqlens`,
or `position_ids` restarting at 0), and per-row positions that continue a decoding state.

    doc [B, T] int64   the document of each token inside its row (0, 1, …), −1 at padding
    pos [B, T] int64   each token's position inside its document, counting the tokens a carried
                       state already consumed (RoPE; position_ids where given); 0 at padding
    reach [B, T] int64 how many earlier tokens of its own document a short convolution may read
                       (the carried state's included): pos, unless position_ids were given

What every layer honours: a token attends to, convolves over and writes into the memory of its
own document only (same row, same doc); padding is seen by nothing and its outputs are
meaningless. Each document's tokens must be contiguous in its row (padding before and/or after
them), so "the last W − 1 inputs of my document" is a column window cut at `pos`.

`continues`: the block extends a carried state, so every row holds exactly one document (doc 0,
the state's) and per-row final states are defined; packed rows (several documents) have none.

`max_documents` (capture-safe packing): built from position_ids with a static bound on the block's
documents, a Segments reads nothing on the host and has no shape that depends on the data, so a
CUDA graph can capture the forward and backward over it. Its packing's cu_seqlens has max_documents + 1
entries, the documents' boundaries followed by empty sequences (each a no-op in every varlen kernel);
the memory always runs the varlen path (`single` is False even when every row holds one document).
The values are not checked there: the caller vouches that position_ids are ≥ 0 and that the block
holds at most max_documents documents (`check_documents`, which `training.GraphedLMStep` runs on the
host batch before copying it into the graph's buffers). A cu_seqlens built this way is valid by
construction (starts at 0, non-decreasing, ends at B·T), so the kernels may skip reading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..inputs import InputError, check_int, check_positions

Tensor = torch.Tensor

__all__ = ["Segments", "Packing", "RowStates", "split_rows", "cat_rows", "select_rows", "check_documents",
           "count_documents"]


@dataclass(frozen=True)
class Packing:
    """A block's documents laid end to end as the varlen sequences [1, N] of one call (`Segments.packing`).

    idx [N] int64: the flat indices in [B·T] of the real tokens, in order; None when every token is real (no
        padding: the documents are the block itself, reshaped, with nothing to gather or scatter).
    cu [S + 1] int64: the documents' boundaries in [0, N] (each row's documents in order, rows one after another).
    """

    idx: Tensor | None
    cu: Tensor
    capacity: int | None = None  # cu has capacity + 1 entries, valid by construction (`Segments.build(max_documents=)`)


@dataclass(frozen=True)
class Segments:
    """doc, pos, reach [B, T] (see the module doc); continues: one document per row continuing a
    state; single: no padding and one document per row (a memory then runs the batch as it is)."""

    doc: Tensor
    pos: Tensor
    continues: bool = False
    single: bool = False
    reach: Tensor | None = None  # [B, T] int64; None: = pos
    max_documents: int | None = None  # the capture-safe packing's bound (see the module doc); None: exact packing

    @cached_property
    def padded(self) -> bool:
        """Whether some token is padding (one host read, once per Segments: every layer of a forward asks;
        none with max_documents, which takes no padding)."""
        return False if self.max_documents is not None else bool((self.doc < 0).any())

    @cached_property
    def packing(self) -> Packing:
        """The documents as one varlen call's sequences (`Packing`), computed once per Segments — once per LM
        forward — instead of in every layer (two host reads: the padding check and the documents' count; none
        with max_documents: `_bounded_packing`)."""
        if self.max_documents is not None:
            return _bounded_packing(self.doc, self.max_documents)
        B, T = self.doc.shape
        rows = torch.arange(B, device=self.doc.device)[:, None].expand(B, T).reshape(-1)  # [B·T]
        doc = self.doc.reshape(-1)
        idx = None
        if self.padded:
            idx = (doc >= 0).nonzero()[:, 0]  # [N]
            rows, doc = rows[idx], doc[idx]
        counts = torch.unique_consecutive(rows * (T + 1) + doc, return_counts=True)[1]  # [S] one key a document
        return Packing(idx=idx, cu=torch.cat([counts.new_zeros(1), counts.cumsum(0)]))

    @property
    def conv_positions(self) -> Tensor:
        """[B, T]: how far back a short convolution may read (the tokens of the token's own
        document before it, a carried state's included) — `pos` unless position_ids said otherwise."""
        return self.pos if self.reach is None else self.reach

    @staticmethod
    def build(B: int, T: int, *, attention_mask: Tensor | None = None, cu_seqlens: Tensor | None = None,
              position_ids: Tensor | None = None, offsets: Tensor | None = None,
              device=None, max_documents: int | None = None) -> Segments | None:
        """The segments of a block [B, T], or None when it is one unpadded document per row starting
        at position 0 (the plain path).

        attention_mask [B, T] (1/True: a token, 0/False: padding); cu_seqlens [S+1] (B = 1, packed
        documents, flash-attention's convention); position_ids [B, T] (a document starts where the
        position is 0, as Hugging Face's packing collators write them); offsets [B] int64: tokens
        each row's document already holds in a carried state (then the block continues it).

        They combine: the documents come from cu_seqlens, else from position_ids, else one per row;
        attention_mask then removes padding from them (a document's positions count its tokens
        only, never its padding). Positions (RoPE) are position_ids where given, else each token's
        index among its document's tokens (+ offsets); given beside cu_seqlens, position_ids must
        restart at 0 exactly at each document's first token. A short convolution reads back only
        over its own document's tokens, whatever the positions say (`conv_positions`).

        max_documents: the capture-safe packing (see the module doc): position_ids only (no attention_mask,
        cu_seqlens or offsets), its values not read — the caller checked them (`check_documents`).
        """
        if max_documents is not None:
            return Segments._bounded(B, T, position_ids, device, max_documents,
                                     other=attention_mask is not None or cu_seqlens is not None or offsets is not None)
        if attention_mask is None and cu_seqlens is None and position_ids is None and offsets is None:
            return None
        continues = offsets is not None
        if continues and cu_seqlens is not None:
            raise InputError("cu_seqlens packs new documents: it cannot continue a carried state (state=None)")
        real = _check_mask(attention_mask, B, T, device)  # [B, T] bool
        given = _check_position_ids(position_ids, B, T, real, device)  # [B, T] int64 or None
        if cu_seqlens is not None:
            from ..chunkwise.varlen import check_cu_seqlens

            t = torch.arange(T, device=device)
            cu = torch.tensor(check_cu_seqlens(cu_seqlens, B, T), device=device)
            seg = torch.bucketize(t, cu[1:], right=True)  # [T] the segment of each token (empty ones skipped)
            doc = torch.cat([seg.new_zeros(1), (seg[1:] != seg[:-1]).long().cumsum(0)])[None]  # [1, T] 0, 1, …
        elif given is not None and not continues:
            doc = ((given == 0) & real).long().cumsum(1)  # a document starts at each position 0
        else:
            doc = torch.zeros(B, T, dtype=torch.int64, device=device)
        doc = torch.where(real, doc.clamp(min=0), torch.full_like(doc, -1))
        doc = torch.where(real, doc - _row_min(doc, real), doc)  # every row's first document is 0
        _check_contiguous(doc)
        local = _index_in_document(doc)  # [B, T]
        if continues:
            local = torch.where(real, local + offsets.to(device=device, dtype=torch.int64)[:, None], local)
        if given is not None and cu_seqlens is not None and \
                not torch.equal((given == 0) & real, (local == 0) & real):
            raise InputError("position_ids and cu_seqlens disagree: beside cu_seqlens, position_ids must be 0 "
                             "exactly at each document's first token (or leave one of them out)")
        pos = local if given is None else given
        reach = None if given is None else local
        return Segments(doc=doc, pos=pos, continues=continues, single=not bool((doc != 0).any()), reach=reach)

    @staticmethod
    def span(position_ids: Tensor | None, B: int, T: int, device=None) -> Segments | None:
        """The documents of one rank's span [B, T] under context parallelism (`fastweights.distributed`), from
        its slice of the whole sequence's position_ids: a document starts where the position is 0, and the
        span's first tokens continue the previous rank's last document unless their position is 0 — so the
        first document of every row is doc 0 and its positions (RoPE, the conv's reach into the halo) are the
        sequence's. None without position_ids (one document per row, continuing)."""
        if position_ids is None:
            return None
        pos = check_positions("position_ids", position_ids, B, T).to(device=device, dtype=torch.int64)
        if bool((pos < 0).any()):
            raise InputError("position_ids must be ≥ 0 at every token")
        start = pos == 0
        start[:, 0] = True  # the span's first token opens its first (maybe continuing) document
        doc = start.long().cumsum(1) - 1  # [B, T]
        return Segments(doc=doc, pos=pos, continues=False, single=not bool((doc != 0).any()))

    @staticmethod
    def _bounded(B: int, T: int, position_ids, device, max_documents, *, other: bool) -> Segments:
        """`build` with max_documents: the documents of position_ids [B, T] (one starts where the position is
        0, and at every row's first token), computed on the device without reading a value."""
        check_int("max_documents", max_documents, low=1)
        if position_ids is None or other:
            raise InputError("max_documents bounds the documents of position_ids (packed documents restarting at "
                             "position 0): give position_ids, and no attention_mask, cu_seqlens or carried state")
        pos = check_positions("position_ids", position_ids, B, T).to(device=device, dtype=torch.int64)
        start = pos == 0
        start[:, 0] = True  # every row's first token opens its first document
        doc = start.long().cumsum(1) - 1  # [B, T] 0, 1, … (no padding)
        return Segments(doc=doc, pos=pos, reach=_index_in_document(doc), max_documents=max_documents)

    def lengths(self) -> Tensor:
        """Tokens of each row [B] int64 (the documents' tokens, padding excluded)."""
        return (self.doc >= 0).sum(1)


def _bounded_packing(doc: Tensor, capacity: int) -> Packing:
    """The packing of doc [B, T] (no padding) with cu [capacity + 1]: the documents' boundaries in [0, B·T], then
    empty sequences (cu = B·T) up to the capacity; computed on the device, no host read, static shapes. A block of
    more than `capacity` documents is refused by a device-side assertion (the caller checks it on the host first:
    `check_documents`)."""
    B, T = doc.shape
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    rank = start.reshape(-1).long().cumsum(0) - 1  # [B·T] each token's document among the block's (non-decreasing)
    torch._assert_async(rank[-1] < capacity, f"a block holds more documents than max_documents={capacity}")
    s = torch.arange(capacity + 1, dtype=torch.int64, device=doc.device)
    cu = torch.searchsorted(rank, s)  # [capacity + 1] the first token of document s (B·T past the last one)
    return Packing(idx=None, cu=cu, capacity=capacity)


def count_documents(position_ids: Tensor) -> Tensor:
    """[...] int64: the documents of each block of position_ids [..., B, T] (a document starts where the position is
    0 and at every row's first token; the rows of a block laid end to end, as the packing does)."""
    return (position_ids[..., 1:] == 0).sum((-1, -2)) + position_ids.shape[-2]


def check_documents(position_ids, max_documents: int, name: str = "position_ids") -> None:
    """What `Segments.build(max_documents=)` does not read, checked on the host: position_ids an integer tensor
    [..., B, T] ≥ 0 whose every block [B, T] holds at most max_documents documents; InputError naming `name`."""
    check_int("max_documents", max_documents, low=1)
    if not isinstance(position_ids, Tensor) or position_ids.dim() < 2 or position_ids.is_floating_point() \
            or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor [..., B, T], got "
                         f"{getattr(position_ids, 'dtype', type(position_ids).__name__)} "
                         f"{list(getattr(position_ids, 'shape', []))}")
    if position_ids.numel() and int(position_ids.min()) < 0:
        raise InputError(f"{name} must be ≥ 0 at every token")
    most = int(count_documents(position_ids).max()) if position_ids.numel() else 0
    if most > max_documents:
        raise InputError(f"{name}: a block holds {most} documents, more than max_documents={max_documents}")


def _check_position_ids(position_ids, B: int, T: int, real: Tensor, device) -> Tensor | None:
    """position_ids as int64 [B, T] on `device` (0 at padding), or None; InputError unless an
    integer tensor [B, T] that is ≥ 0 at every token."""
    if position_ids is None:
        return None
    pos = check_positions("position_ids", position_ids, B, T).to(device=device, dtype=torch.int64)
    if bool((pos[real] < 0).any()):
        raise InputError("position_ids must be ≥ 0 at every token")
    return torch.where(real, pos, torch.zeros_like(pos))


def _row_min(doc: Tensor, real: Tensor) -> Tensor:
    """[B, 1]: the smallest document id of each row's tokens (0 for a row of padding only)."""
    big = torch.iinfo(torch.int64).max
    low = torch.where(real, doc, torch.full_like(doc, big)).min(1, keepdim=True).values
    return torch.where(low == big, torch.zeros_like(low), low)


def _index_in_document(doc: Tensor) -> Tensor:
    """[B, T] int64: each token's index among its document's tokens in this block (0 at the
    document's first token; 0 at padding). Documents are contiguous (`_check_contiguous`)."""
    B, T = doc.shape
    real = doc >= 0
    seen = real.long().cumsum(1) - 1  # [B, T] index among the row's tokens
    big = torch.iinfo(torch.int64).max
    first = torch.full((B, T + 1), big, dtype=torch.int64, device=doc.device)  # per document id
    first = first.scatter_reduce(1, doc.clamp(min=0), torch.where(real, seen, torch.full_like(seen, big)), "amin")
    return torch.where(real, seen - first.gather(1, doc.clamp(min=0)), torch.zeros_like(seen))


def _check_mask(mask, B: int, T: int, device) -> Tensor:
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor) or tuple(mask.shape) != (B, T) or mask.is_floating_point():
        raise InputError(f"attention_mask must be a bool or 0/1 integer tensor [B, T] = [{B}, {T}], got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {list(getattr(mask, 'shape', []))}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise InputError("attention_mask must hold only 0 (padding) and 1 (a token)")
    return mask.to(device=device, dtype=torch.bool)


def _check_contiguous(doc: Tensor) -> None:
    """Every document's tokens contiguous in its row (padding only around the documents)."""
    real = doc >= 0
    if not bool(real.any()):
        return
    T = doc.shape[1]
    t = torch.arange(T, device=doc.device)
    first = torch.where(real, t, T).min(1).values  # [B]
    last = torch.where(real, t, -1).max(1).values  # [B]
    n = real.sum(1)
    if bool(((n > 0) & (last - first + 1 != n)).any()):
        raise InputError("attention_mask: padding must lie before and/or after a row's tokens, not between them")
    step = doc[:, 1:] - doc[:, :-1]
    both = real[:, 1:] & real[:, :-1]
    if bool((both & (step != 0) & (step != 1)).any()):
        raise InputError("documents of a row must follow each other (doc ids 0, 1, 2, … in order)")


@dataclass
class RowStates:
    """Per-row memories that cannot share one batched state (e.g. rows at different offsets inside
    their inner mini-batch after a padded prefill): rows[b] is row b's memory with batch 1."""

    rows: tuple


def split_rows(memory, B: int) -> list:
    """A batched memory (tensor, state dataclass, RowStates or None) as B memories of batch 1."""
    from ..state import state_map

    if memory is None:
        return [None] * B
    if isinstance(memory, RowStates):
        return list(memory.rows)
    return [state_map(memory, lambda x, b=b: x[b:b + 1]) for b in range(B)]


def cat_rows(memories: list):
    """The inverse of split_rows: one batched memory when the rows agree on every non-tensor field
    (offsets, …), else RowStates."""
    import dataclasses

    first = memories[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(memories, dim=0)
    if isinstance(first, tuple):
        parts = [cat_rows([m[i] for m in memories]) for i in range(len(first))]
        return tuple(parts) if not any(isinstance(p, RowStates) for p in parts) else RowStates(tuple(memories))
    if dataclasses.is_dataclass(first):
        out = {}
        for f in dataclasses.fields(first):
            vals = [getattr(m, f.name) for m in memories]
            if vals[0] is None or isinstance(vals[0], (Tensor, tuple)):
                if any((v is None) != (vals[0] is None) for v in vals):
                    return RowStates(tuple(memories))
                out[f.name] = cat_rows(vals)
                if isinstance(out[f.name], RowStates):
                    return RowStates(tuple(memories))
            elif all(v == vals[0] for v in vals):
                out[f.name] = vals[0]
            else:
                return RowStates(tuple(memories))
        return dataclasses.replace(first, **out)
    raise TypeError(f"cannot batch memories of type {type(first).__name__}")


def select_rows(state, index: Tensor):
    """A state (LMState, MixerState, memory, …) with its batch rows picked by index [B'] int64
    (beam search's reordering, a batch expanded for several samples); RowStates pick their rows."""
    import dataclasses

    if state is None:
        return None
    if isinstance(state, RowStates):
        return RowStates(tuple(state.rows[i] for i in index.tolist()))
    if isinstance(state, Tensor):
        return state.index_select(0, index.to(state.device))
    if isinstance(state, tuple):
        return tuple(select_rows(x, index) for x in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: select_rows(getattr(state, f.name), index)
                                             for f in dataclasses.fields(state)})
    return state
