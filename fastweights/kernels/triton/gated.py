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

from ...inputs import InputError
from ..pipelines import GatedPipeline, gate_kind, gated_fused_serves, gated_pipeline
from .args import check_chunk_args, no_tokens
from .common.layout import Layout
from .fused import gated_fused
from .stages.cumsum import chunk_cumsum
from .stages.output import chunk_outputs, chunk_outputs_bwd
from .stages.qk_grads import qk_grads
from .stages.scores import decayed_scores
from .stages.states import pass_states_bwd, pass_states_fwd

Tensor = torch.Tensor


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
                       chunk_size: int = 64, cu_seqlens: Tensor | None = None,
                       pipeline: GatedPipeline | None = None, check_cu_seqlens: bool = True):
    """Chunkwise gated linear attention on Triton: S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ,
    o_t = S_tᵀ(scale·q_t). Arguments and results as `fastweights.chunkwise.chunk_gated`
    (o [B, T, H, V] in v's dtype; final state [B or N, H, K, V] fp32 or None), plus grouped
    heads: q, k [B, T, H_q, K] with H_q | H. Inputs fp32, bf16 or fp16 (fp32 accumulation).

    pipeline: the stage kernels or the fused ones (`kernels.pipelines.GatedPipeline`); None: the one
    `kernels.pipelines.gated_pipeline` picks from the call's facts (what the dispatch row passes).
    check_cu_seqlens=False: cu_seqlens valid by construction, not read on the host (`check_chunk_args`)."""
    L, initial_state, scale = check_chunk_args(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                               chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                                               check_cu_seqlens=check_cu_seqlens)
    if L.T == 0:
        return no_tokens(v, L, initial_state, output_final_state)
    if pipeline is None:
        pipeline = gated_pipeline(gate=gate_kind(g), device_type=q.device.type, dtype=q.dtype, K=L.K, V=L.V)
    if not isinstance(pipeline, GatedPipeline):
        raise InputError(f"pipeline must be a kernels.pipelines.GatedPipeline or None, got {pipeline!r}")
    args = (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else None,
            beta.contiguous() if beta is not None else None, initial_state, scale, L, bool(output_final_state))
    if pipeline.pipeline == "fused":
        kind = gate_kind(g)
        if not gated_fused_serves(q.device.type, L.K, L.V, gate=kind, dtype=q.dtype):
            raise InputError(f"the fused gated-linear pipeline does not serve K={L.K}, V={L.V}, {kind} decay, "
                             f"{q.dtype} on {q.device.type} (kernels.pipelines.gated_fused_serves); pass "
                             "GatedPipeline('staged')")
        o, ht = gated_fused.ChunkGatedFused.apply(*args, pipeline.recompute_states)
    else:
        o, ht = ChunkGatedTriton.apply(*args)
    return o, (ht if output_final_state else None)
