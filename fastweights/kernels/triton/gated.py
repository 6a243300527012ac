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

from . import gated_fused
from .args import check_chunk_args, no_tokens
from .cumsum import chunk_cumsum
from .layout import Layout
from .output import chunk_outputs, chunk_outputs_bwd
from .qk_grads import qk_grads
from .scores import decayed_scores
from .states import pass_states_bwd, pass_states_fwd

Tensor = torch.Tensor

#: "staged" (the stage kernels above) or "fused" (gated_fused.py: one sequential kernel forward; backward a
#: states recompute, one reverse sequential kernel and one chunk-parallel kernel), for the calls the fused
#: pipeline serves (`gated_fused.supports`: no or a scalar decay; GLA's diagonal one always runs staged).
#: Read on each call.
PIPELINE = "staged"
PIPELINES = ("staged", "fused")


def uses_fused(g, K: int, V: int, is_cuda: bool) -> bool:
    """Whether a call runs the fused pipeline (PIPELINE, and a call `gated_fused.supports`)."""
    if PIPELINE not in PIPELINES:
        raise ValueError(f"gated.PIPELINE must be one of {PIPELINES}, got {PIPELINE!r}")
    return PIPELINE == "fused" and gated_fused.supports(g, K, V, is_cuda)


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
    L, initial_state, scale = check_chunk_args(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if L.T == 0:
        return no_tokens(v, L, initial_state, output_final_state)
    fn = gated_fused.ChunkGatedFused if uses_fused(g, L.K, L.V, q.is_cuda) else ChunkGatedTriton
    o, ht = fn.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                   g.contiguous() if g is not None else None,
                                   beta.contiguous() if beta is not None else None, initial_state, scale, L,
                                   bool(output_final_state))
    return o, (ht if output_final_state else None)
