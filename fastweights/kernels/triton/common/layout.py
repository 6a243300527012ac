"""The chunk index a kernel launch needs, built on the device (no host synchronization, so a
varlen call can be captured in a CUDA graph).

A padded batch [B, T]: chunk slot n of batch row b covers tokens [b·T + n·C, min(b·T + (n+1)·C, (b+1)·T)).
Varlen (`cu_seqlens` [S+1], B = 1): sequence s has ⌈L_s / C⌉ chunks starting at slot
offsets[s] = Σ_{s' < s} ⌈L_s' / C⌉. The number of slots must be known on the host to size the
launch grid, so it is the bound NT = ⌈T / C⌉ + S (each sequence adds at most one partial
chunk); slots past offsets[S] get sequence −1: `util.chunk_span` gives them no token, and the chunk kernels'
programs on them exit at once (the layer prologue's run masked: it writes per-slot partial sums). Empty
sequences (cu[s] = cu[s + 1]: `Segments.build(max_documents=)` pads cu_seqlens with them) add only such slots.
Per-chunk arrays (the states) have NT slots per batch row; the unused ones are never written or read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class Layout:
    """B, T: of the token tensors; H value heads, Hq query/key heads (H_q | H); K, V head dims;
    C chunk size; NT chunk slots per batch row; NS sequences (B, or S with varlen).
    Varlen only: cu (int32 [S+1]), chunk_seq / chunk_local (int32 [NT]: each slot's sequence,
    −1 for unused slots, and its chunk within the sequence), offsets (int32 [S+1], first slot
    of each sequence)."""

    B: int
    T: int
    H: int
    Hq: int
    K: int
    V: int
    C: int
    NT: int
    NS: int
    cu: Tensor | None = None
    chunk_seq: Tensor | None = None
    chunk_local: Tensor | None = None
    offsets: Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu is not None

    def dummy(self) -> Tensor:
        """A placeholder pointer for absent varlen tensors."""
        return torch.empty(1, dtype=torch.int32)


def make_layout(B: int, T: int, H: int, Hq: int, K: int, V: int, C: int, cu_seqlens: Tensor | None,
                device) -> Layout:
    if cu_seqlens is None:
        return Layout(B=B, T=T, H=H, Hq=Hq, K=K, V=V, C=C, NT=-(-T // C), NS=B)
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    S = cu.numel() - 1
    NT = -(-T // C) + S
    per_seq = (cu[1:] - cu[:-1] + C - 1) // C  # chunks of each sequence  [S]
    offsets = torch.cat([cu.new_zeros(1), per_seq.cumsum(0).to(torch.int32)])  # [S+1]
    slots = torch.arange(NT, device=device, dtype=torch.int32)
    seq = torch.searchsorted(offsets[1:].contiguous(), slots, right=True).to(torch.int32)  # [NT]
    valid = slots < offsets[-1]
    local = slots - offsets[seq.clamp(max=S - 1).long()] if S > 0 else slots
    chunk_seq = torch.where(valid, seq, torch.full_like(seq, -1))
    chunk_local = torch.where(valid, local, torch.zeros_like(local)).to(torch.int32)
    return Layout(B=1, T=T, H=H, Hq=Hq, K=K, V=V, C=C, NT=NT, NS=S, cu=cu, chunk_seq=chunk_seq.contiguous(),
                  chunk_local=chunk_local.contiguous(), offsets=offsets.contiguous())
