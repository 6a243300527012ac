"""Small @triton.jit helpers shared by the stage kernels, and launch helpers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .layout import Layout


def _interpreter_run_time_ranges() -> None:
    """Let `range(0, n)` take a run-time bound under TRITON_INTERPRET=1 with numpy ≥ 2.4.

    Triton 3.6's interpreter gives its scalar tensors `__index__ = int(handle.data)`, and its
    scalars are 1-element arrays, which numpy 2.4 no longer converts with int(): every loop whose
    bound is a kernel argument or a loaded value raises there. The compiled path is unaffected.
    This re-sets `__index__` (for the duration of each interpreted launch, as the interpreter does)
    to take the one element; nothing else of the interpreter changes."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "fastweights_index", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.fastweights_index = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_run_time_ranges()


@triton.jit
def chunk_span(i_n, i_b, T, C: tl.constexpr, cu, chunk_seq, chunk_local, IS_VARLEN: tl.constexpr):
    """(t0, eos) of chunk slot i_n of batch row i_b: its first token and the end of its sequence
    (rows t0 + i with t0 + i < eos are real tokens). An unused varlen slot gets eos = t0 (no row)."""
    if IS_VARLEN:
        seq = tl.load(chunk_seq + i_n)
        c = tl.load(chunk_local + i_n)
        s = tl.maximum(seq, 0)
        bos = tl.load(cu + s).to(tl.int64)
        eos = tl.load(cu + s + 1).to(tl.int64)
        t0 = bos + c.to(tl.int64) * C
        eos = tl.where(seq >= 0, eos, t0)
    else:
        t0 = i_b.to(tl.int64) * T + i_n.to(tl.int64) * C
        eos = i_b.to(tl.int64) * T + T
    return t0, eos


@triton.jit
def seq_span(i_s, T, C: tl.constexpr, NT, cu, offsets, IS_VARLEN: tl.constexpr):
    """(bos, eos, number of chunks, first chunk slot in the per-chunk arrays) of sequence i_s."""
    if IS_VARLEN:
        bos = tl.load(cu + i_s).to(tl.int64)
        eos = tl.load(cu + i_s + 1).to(tl.int64)
        slot0 = tl.load(offsets + i_s).to(tl.int64)
    else:
        bos = i_s.to(tl.int64) * T
        eos = bos + T
        slot0 = i_s.to(tl.int64) * NT
    n_chunks = (eos - bos + C - 1) // C
    return bos, eos, n_chunks, slot0


@triton.jit
def mm(a, b, DT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation. IEEE = 1: fp32 operands in full precision; 0: operands cast to
    DT (the inputs' bf16/fp16) for the tensor cores; 2 (interpreter only, whose bf16 tl.dot is
    wrong in Triton 3.6): operands rounded to DT, then an fp32 product — the same numbers as 0."""
    if IEEE == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE == 2:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


def dot_dtype(dtype: torch.dtype):
    """(DT, IEEE) constexprs of `mm` for inputs of `dtype` (see `mm`)."""
    if dtype == torch.float32:
        return tl.float32, 1
    DT = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    return DT, (2 if os.environ.get("TRITON_INTERPRET") == "1" else 0)


def pow2(n: int, floor: int = 16) -> int:
    """The tile size covering n (≥ 16: tl.dot's smallest)."""
    return max(floor, triton.next_power_of_2(n))


def varlen_args(L: Layout, device):
    """(cu, chunk_seq, chunk_local, offsets) pointers, placeholders without varlen."""
    if L.varlen:
        return L.cu, L.chunk_seq, L.chunk_local, L.offsets
    d = torch.zeros(1, dtype=torch.int32, device=device)
    return d, d, d, d


#: Launch settings of every kernel, pinned (no autotuning: on Triton 3.6 + Hopper each config must
#: be checked against the reference, see docs/kernels.md). Checked and timed on the H100 against
#: 8 warps, which was slower for every gate (docs/kernel_notes.md).
LAUNCH = dict(num_warps=4, num_stages=2)
