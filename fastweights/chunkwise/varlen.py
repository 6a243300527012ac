"""Chunk layout shared by the chunk forms: a padded batch, or varlen sequences packed into chunks.

Tokens [B, T, H, ·] become chunks [B, H, N, C, ·]. Without `cu_seqlens` each batch row is cut
into N = ⌈T / C⌉ chunks, the last one zero-padded. With `cu_seqlens` (flash-attention's varlen
convention: an int tensor [S+1], 0 = cu[0] ≤ cu[1] ≤ … ≤ cu[S] = T, batch B = 1) sequence s
occupies tokens [cu[s], cu[s+1]) and gets ⌈L_s / C⌉ chunks of its own, its last one
zero-padded, so no chunk ever mixes two sequences.

A chunk never exceeds what the sequences need: the chunk size used is
C = min(chunk_size, the smallest power of two ≥ the longest sequence) (`effective_chunk_size`).
Every sequence then still fits in ⌈L / C⌉ chunks exactly as with the requested size (one chunk when
chunk_size ≥ L), so the result is the same computation on less padding; a chunk_size of 2**20 at
T = 20 costs what 32 costs, not a [2**20, 2**20] score matrix.

Zero padding is exact for the recurrences of this package: a padded token has k = 0 and β = 0
(it writes nothing), g = 0 (it does not decay), and its output is dropped.

`scan_chunks` runs the only sequential part, the state recurrence from chunk to chunk, and
restarts it from the sequence's own initial state at every sequence start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..inputs import InputError, check_data

Tensor = torch.Tensor

__all__ = ["ChunkLayout", "make_layout", "scan_chunks", "check_cu_seqlens", "num_sequences", "effective_chunk_size"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the backward returns its gradient contiguous."""

    generate_vmap_rule = True  # (torch.func transforms: `lab.stack`)

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: Tensor) -> Tensor:
    """x itself, with a contiguous gradient (a permuted or sliced one otherwise flows back)."""
    return _ContiguousGrad.apply(x) if x.requires_grad else x


@dataclass(frozen=True)
class ChunkLayout:
    """Where every token sits among the chunks.

    batch:       B of the token tensors (1 with varlen).
    length:      T of the token tensors.
    chunk_size:  C.
    num_chunks:  N, chunks per batch row.
    ranges:      per sequence, its chunks [n0, n1) (one range covering every chunk without varlen).
    gather:      varlen only: [N·C] int64, the token feeding each chunk slot (T = padding).
    scatter:     varlen only: [T] int64, the chunk slot of each token.
    """

    batch: int
    length: int
    chunk_size: int
    num_chunks: int
    ranges: tuple[tuple[int, int], ...]
    gather: Tensor | None = None
    scatter: Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.gather is not None

    @property
    def num_sequences(self) -> int:
        """Rows of the initial and final states: S with varlen, else B."""
        return len(self.ranges) if self.varlen else self.batch

    def to_chunks(self, x: Tensor) -> Tensor:
        """[B, T, H, *D] → [B, H, N, C, *D], zero-padded. The gradient flowing back to x is made
        contiguous (`contiguous_grad`): callers' backward passes may view it (Linear does, and
        AOT-compiled graphs do not re-stride it)."""
        x = contiguous_grad(x)
        B, T, H = x.shape[:3]
        rest = tuple(x.shape[3:])
        N, C = self.num_chunks, self.chunk_size
        if self.gather is None:
            if N * C > T:
                x = torch.cat([x, x.new_zeros(B, N * C - T, H, *rest)], dim=1)  # [B, N·C, H, *D]
        else:
            x = torch.cat([x, x.new_zeros(B, 1, H, *rest)], dim=1)  # [1, T + 1, H, *D]
            x = x.index_select(1, self.gather)  # [1, N·C, H, *D]
        x = x.reshape(B, N, C, H, *rest)  # [B, N, C, H, *D]
        return x.movedim(3, 1)  # [B, H, N, C, *D]

    def from_chunks(self, y: Tensor) -> Tensor:
        """[B, H, N, C, *D] → [B, T, H, *D], padding dropped."""
        B, H, N, C = y.shape[:4]
        rest = tuple(y.shape[4:])
        y = y.movedim(1, 3).reshape(B, N * C, H, *rest)  # [B, N·C, H, *D]
        if self.gather is None:
            return y[:, : self.length]  # [B, T, H, *D]
        return y.index_select(1, self.scatter)  # [1, T, H, *D]


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> list[int]:
    """The boundaries of a valid cu_seqlens as ints (InputError naming what is wrong otherwise)."""
    if not isinstance(cu_seqlens, Tensor):
        raise InputError(f"cu_seqlens must be an int tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InputError(f"cu_seqlens must be 1-D with N+1 ≥ 2 entries, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise InputError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if B != 1:
        raise InputError(f"with cu_seqlens the sequences are packed along T and the batch must be 1, got B={B}")
    check_data("cu_seqlens", cu_seqlens, hint=" (its boundaries are read on the host, check_values or not)")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T:
        raise InputError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} … {cu[-1]}")
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise InputError("cu_seqlens must be non-decreasing")
    return cu


def num_sequences(cu_seqlens, B: int, T: int) -> int | None:
    """N for a valid cu_seqlens (int [N+1], 0 = cu[0] ≤ … ≤ cu[N] = T, B = 1); None without varlen."""
    if cu_seqlens is None:
        return None
    return len(check_cu_seqlens(cu_seqlens, B, T)) - 1


def effective_chunk_size(chunk_size: int, longest: int) -> int:
    """The chunk size a layout uses: min(chunk_size, the smallest power of two ≥ longest), where
    `longest` is the longest sequence (T without varlen). A chunk beyond the longest sequence would
    only hold padding, and the engines' score and inverse matrices grow as C²."""
    enough = 1
    while enough < longest:
        enough *= 2
    return min(chunk_size, enough)


def make_layout(B: int, T: int, chunk_size: int, cu_seqlens: Tensor | None = None,
                device: torch.device | None = None) -> ChunkLayout:
    """The layout of a batch [B, T] (or of `cu_seqlens`' packed sequences) in chunks of
    `effective_chunk_size(chunk_size, longest sequence)`."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if cu_seqlens is None:
        C = effective_chunk_size(chunk_size, T)
        N = -(-T // C)
        return ChunkLayout(batch=B, length=T, chunk_size=C, num_chunks=N, ranges=((0, N),))
    cu = check_cu_seqlens(cu_seqlens, B, T)
    C = effective_chunk_size(chunk_size, max(b - a for a, b in zip(cu[:-1], cu[1:])))
    gather, scatter, ranges = [], [], []
    n = 0
    for start, end in zip(cu[:-1], cu[1:]):
        L = end - start
        chunks = -(-L // C)
        scatter.append(torch.arange(L) + n * C)  # slots of this sequence's tokens
        gather.append(torch.arange(start, end))
        gather.append(torch.full((chunks * C - L,), T))  # padding slots read the zero row T
        ranges.append((n, n + chunks))
        n += chunks
    return ChunkLayout(batch=1, length=T, chunk_size=C, num_chunks=n, ranges=tuple(ranges),
                       gather=torch.cat(gather).to(device=device, dtype=torch.long),
                       scatter=torch.cat(scatter).to(device=device, dtype=torch.long))


def scan_chunks(layout: ChunkLayout, initial: Tensor, step: Callable[[int, Tensor], Tensor]):
    """The chunk-to-chunk state recurrence S_{n+1} = step(n, S_n), sequence by sequence.

    initial: [B, H, K, V] (varlen: [num_sequences, H, K, V]); each sequence starts from its row.
    Returns (the state entering every chunk [B, H, N, K, V], the final states [B or S, H, K, V]).
    """
    inits = initial.split(1, dim=0) if layout.varlen else [initial]
    starts, finals = [], []
    for (n0, n1), S in zip(layout.ranges, inits):
        for n in range(n0, n1):
            starts.append(S)
            S = step(n, S)
        finals.append(S)
    if starts:
        entering = torch.stack(starts, dim=2)  # [B, H, N, K, V]
    else:
        B = layout.batch
        entering = initial.new_zeros(B, *initial.shape[1:2], 0, *initial.shape[2:])  # [B, H, 0, K, V]
    return entering, torch.cat(finals, dim=0)
