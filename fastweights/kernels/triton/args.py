"""The argument checks and the empty-sequence result shared by the chunk glue of both classes
(`gated.chunk_gated_triton`, `delta.chunk_delta_triton`): validated once, before any launch."""

from __future__ import annotations

import torch

from ...chunkwise.common import gate_kind
from ...chunkwise.varlen import check_cu_seqlens as validate_cu_seqlens
from ...chunkwise.varlen import effective_chunk_size
from ...inputs import InputError, check_tensor
from .common.layout import Layout, make_layout

Tensor = torch.Tensor

MAX_HEAD_DIM = 256


#: The Triton layout never clamps the chunk below this (see `check_chunk_args`).
MIN_CLAMPED_CHUNK = 64


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """(B, T, H_q, H, K, V) of q, k [B, T, H_q, K] and v [B, T, H, V] with H_q | H and one dtype of fp32, bf16 or
    fp16 — what every Triton kernel of a memory takes — or InputError naming the argument."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise InputError(f"q must be 4-D [B, T, H_q, K], got {list(q.shape) if isinstance(q, Tensor) else q!r}")
    B, T, Hq, K = q.shape
    V = v.shape[-1] if isinstance(v, Tensor) and v.dim() == 4 else -1
    H = v.shape[2] if isinstance(v, Tensor) and v.dim() == 4 else -1
    check_tensor("k", k, (B, T, Hq, K), values=False)
    check_tensor("v", v, (B, T, H, V), values=False)
    if H % Hq:
        raise InputError(f"v's heads H={H} must be a multiple of q's and k's H_q={Hq}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"q, k, v must share one dtype of fp32, bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, T, Hq, H, K, V


def check_chunk_args(q, k, v, *, g, beta, scale, initial_state, chunk_size, cu_seqlens, check_cu_seqlens=True):
    """(Layout, the initial state as fp32 contiguous or None, the resolved scale), or InputError
    naming the argument: q, k [B, T, H_q, K], v [B, T, H, V] with H_q | H, one dtype of fp32/bf16/
    fp16, K, V ≤ 256, chunk_size a power of two ≥ 16, β [B, T, H], g [B, T, H(, K)], cu_seqlens
    (not read while a CUDA graph is being captured, nor with check_cu_seqlens=False: valid by construction,
    `Segments.build(max_documents=)`), initial_state [B or N, H, K, V].
    The layout's chunk is min(chunk_size, the smallest power of two ≥ max(T, 64)): never longer than
    the sequence needs beyond the GPU chunk of 64 (the bound uses T, not the longest varlen sequence, which
    would need a read of cu_seqlens on the host; and never below 64, so that a chunk_size ≤ 64 is never
    changed and varlen packings of any total length compile one set of kernels)."""
    B, T, Hq, H, K, V = check_qkv(q, k, v)
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise InputError(f"head dims K={K}, V={V} must be ≤ {MAX_HEAD_DIM} for the Triton kernels")
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size & (chunk_size - 1)):
        raise InputError(f"chunk_size must be a power of two ≥ 16 for the Triton kernels, got {chunk_size!r}")
    if beta is not None:
        check_tensor("beta", beta, (B, T, H), values=False)
    gate_kind(g, B, T, H, K)
    if cu_seqlens is not None and check_cu_seqlens and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        validate_cu_seqlens(cu_seqlens, B, T)  # validation reads the boundaries; skipped while capturing a graph
    C = effective_chunk_size(chunk_size, max(T, MIN_CLAMPED_CHUNK))
    L = make_layout(B, T, H, Hq, K, V, C, cu_seqlens, q.device)
    if initial_state is not None:
        what = "number of sequences N (len(cu_seqlens) − 1)" if L.varlen else "batch B"
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (L.NS, H, K, V):
            shape = list(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
            raise InputError(f"initial_state must have shape [{what}, H, K, V] = {[L.NS, H, K, V]}, got {shape}")
        initial_state = initial_state.float().contiguous()
    return L, initial_state, (K ** -0.5 if scale is None else float(scale))


def no_tokens(v: Tensor, L: Layout, initial_state, output_final_state: bool):
    """T = 0: an empty output and the state unchanged (a copy; zeros when none was given)."""
    o = v.new_zeros(L.B, 0, L.H, L.V)
    if not output_final_state:
        return o, None
    S = initial_state if initial_state is not None else torch.zeros(L.NS, L.H, L.K, L.V, device=v.device)
    return o, S.clone()
