"""Glue: `chunk_gated_triton`, the Triton twin of `fastweights.chunkwise.chunk_gated` (same
signature and results), forward and backward through one torch.autograd.Function.

Forward:  G = cumsum(g) → A = decayed_scores → (h, S_T) = pass_states → o = chunk_outputs.
Backward (recomputes G, h and A from the saved inputs rather than keeping h [B, NT, H, K, V]):
          dh, dS_0, ∂L/∂G_last = pass_states_bwd → dv, dA = chunk_outputs_bwd
          → dq, dk, dβ, dG = qk_grads → dg = reverse cumsum(dG) + ∂L/∂G_last.

Beyond chunk_gated: q, k may have H_q heads dividing v's H (value head h reads q/k head
h // (H / H_q)); their gradients are summed over each group. The chunk size must be a power of
two ≥ 16 (tl.arange and tl.dot tile sizes), K and V ≤ 256.
"""

from __future__ import annotations

import torch

from ...chunkwise.common import gate_kind
from ...chunkwise.varlen import check_cu_seqlens
from ...inputs import InputError, check_tensor
from .cumsum import chunk_cumsum
from .layout import Layout, make_layout
from .output import chunk_outputs, chunk_outputs_bwd
from .qk_grads import qk_grads
from .scores import decayed_scores
from .states import pass_states_bwd, pass_states_fwd

Tensor = torch.Tensor

MAX_HEAD_DIM = 256


def _fold_groups(x: Tensor, L: Layout) -> Tensor:
    """A per-value-head gradient [B, T, H, K] summed over each group → [B, T, H_q, K]."""
    if L.H == L.Hq:
        return x
    return x.view(L.B, L.T, L.Hq, L.H // L.Hq, L.K).sum(3)  # [B, T, H_q, K]


class ChunkGatedTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, L, output_final_state):
        G = chunk_cumsum(g, L) if g is not None else None
        A = decayed_scores(q, k, G, beta, scale, L)
        h, ht = pass_states_fwd(k, v, G, beta, h0, L, output_final_state=output_final_state)
        o = chunk_outputs(q, v, G, A, h, scale, L)
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.scale, ctx.L, ctx.output_final_state = scale, L, output_final_state
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, L = ctx.scale, ctx.L
        do = do.contiguous()
        G = chunk_cumsum(g, L) if g is not None else None
        need_final = G is not None
        h, ht = pass_states_fwd(k, v, G, beta, h0, L, output_final_state=need_final)
        A = decayed_scores(q, k, G, beta, scale, L)
        dht = dht.contiguous() if (dht is not None and ctx.output_final_state) else None
        dh, dh0, dgc = pass_states_bwd(q, G, do, h, ht, dht, scale, L, need_dh0=h0 is not None)
        dv, dA = chunk_outputs_bwd(k, v, G, beta, A, dh, do, L)
        dq, dk, dbeta, dG = qk_grads(q, k, v, G, beta, h, dh, do, dA, scale, L)
        dg = chunk_cumsum(dG, L, reverse=True, add=dgc, out_dtype=g.dtype) if g is not None else None
        dq = _fold_groups(dq, L).to(q.dtype)
        dk = _fold_groups(dk, L).to(k.dtype)
        return (dq, dk, dv, dg, dbeta.to(beta.dtype) if beta is not None else None, dh0, None, None, None)


def chunk_gated_triton(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                       scale: float | None, initial_state: Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """Chunkwise gated linear attention on Triton: S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ,
    o_t = S_tᵀ(scale·q_t). Arguments and results as `fastweights.chunkwise.chunk_gated`
    (o [B, T, H, V] in v's dtype; final state [B or N, H, K, V] fp32 or None), plus grouped
    heads: q, k [B, T, H_q, K] with H_q | H. Inputs fp32, bf16 or fp16 (fp32 accumulation)."""
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
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise InputError(f"head dims K={K}, V={V} must be ≤ {MAX_HEAD_DIM} for the Triton kernels")
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size & (chunk_size - 1)):
        raise InputError(f"chunk_size must be a power of two ≥ 16 for the Triton kernels, got {chunk_size!r}")
    if beta is not None:
        check_tensor("beta", beta, (B, T, H), values=False)
    gate_kind(g, B, T, H, K)
    if cu_seqlens is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_cu_seqlens(cu_seqlens, B, T)  # validation reads the boundaries; skipped while capturing a graph
    L = make_layout(B, T, H, Hq, K, V, chunk_size, cu_seqlens, q.device)
    if initial_state is not None:
        what = "number of sequences N (len(cu_seqlens) − 1)" if L.varlen else "batch B"
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (L.NS, H, K, V):
            shape = list(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
            raise InputError(f"initial_state must have shape [{what}, H, K, V] = {[L.NS, H, K, V]}, got {shape}")
        initial_state = initial_state.float().contiguous()
    scale = K ** -0.5 if scale is None else float(scale)
    if T == 0:
        o = v.new_zeros(B, 0, H, V)
        if not output_final_state:
            return o, None
        S = initial_state if initial_state is not None else torch.zeros(L.NS, H, K, V, device=v.device)
        return o, S.clone()
    o, ht = ChunkGatedTriton.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                   g.contiguous() if g is not None else None,
                                   beta.contiguous() if beta is not None else None, initial_state, scale, L,
                                   bool(output_final_state))
    return o, (ht if output_final_state else None)
