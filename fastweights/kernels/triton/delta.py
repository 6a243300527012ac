"""Glue: `chunk_delta_triton`, the Triton twin of `fastweights.chunkwise.chunk_delta` for
decay_first=True (DeltaNet: no g; Gated DeltaNet: scalar g [B, T, H]; KDA: diagonal g [B, T, H, K]),
forward and backward through one torch.autograd.Function. Every stage is a Triton kernel.

Forward (chunkwise/delta.py's stages, one kernel each):

    G   = cumsum.chunk_cumsum(g)                               chunk-local cumsum (fp32)
    P   = scores.decayed_scores(k, k, G, None, 1)              decayed KKᵀ (its strict part is used)
    T   = delta_inverse.unit_lower_inverse(P, β)                (I + strict_tril(diag(β) P))⁻¹
    W, U' = delta_wy.wy_representation(k, v, G, β, T)
    h, S_T, U = delta_states.pass_states_fwd(k, W, U', G, S_0)  U = U' − W S_n; S_{n+1} = a S_n + K̃ᵀ U
    Aqk = scores.decayed_scores(q, k, G, None, scale)
    o   = output.chunk_outputs(q, U, G, Aqk, h, scale)          o = Aqk U + Q̃ S_n

Saved for the backward: the inputs, T, the entering states h, U and the final state; G, P, Aqk and
W are recomputed (one kernel each).

Backward:

    dU^loc, dAqk = delta_output.chunk_outputs_bwd_local(Aqk, U, dO)
    dh, dS_0, ∂L/∂G_last = delta_states.pass_states_bwd(...)     dU = dU^loc + K̃ dS_{n+1}; the transposed pass
    dq, dk₁, dG₁ = qk_grads(q, k, U, G, h, dh, dO, dAqk)         Aqk, Q̃ and K̃ (the gated class's kernel)
    dv, dk₂, dβ, dG₂, dP = delta_wy.wy_representation_bwd(...)    T, W and U'
    dk₃, dk₄, dG₃ = qk_grads(k, k, dP) (intra-chunk only)         P (its rows and its columns)
    dq, dk, dG = delta_grads.sum_grads(...)                        the parts summed, grouped heads folded, cast
    dg = reverse cumsum(dG) + ∂L/∂G_last

Beyond chunk_delta: q, k may have H_q heads dividing v's H (value head h reads q/k head
h // (H / H_q)); their gradients are summed over each group. The chunk size must be a power of
two ≥ 16, K and V ≤ 256. decay_first=False (Comba), a probe key and DeltaProduct are not served here.
"""

from __future__ import annotations

import torch

from .args import check_chunk_args, no_tokens
from .cumsum import chunk_cumsum
from .delta_grads import sum_grads
from .delta_inverse import unit_lower_inverse
from .delta_output import chunk_outputs, chunk_outputs_bwd_local
from .delta_states import pass_states_bwd, pass_states_fwd
from .delta_wy import wy_representation, wy_representation_bwd
from .qk_grads import qk_grads
from .scores import decayed_scores

Tensor = torch.Tensor


class ChunkDeltaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, L, output_final_state, has_beta):
        G = chunk_cumsum(g, L) if g is not None else None
        P = decayed_scores(k, k, G, None, 1.0, L)  # [B, T, H, C]
        Ti = unit_lower_inverse(P, beta, L)  # [B, T, H, C]
        w, u1 = wy_representation(k, v, G, beta, Ti, L)
        need_final = output_final_state or G is not None  # the backward's ∂L/∂G_last reads S_T
        h, ht, u = pass_states_fwd(k, w, u1, G, h0, L, output_final_state=need_final)
        A = decayed_scores(q, k, G, None, scale, L)  # [B, T, H, C]
        o = chunk_outputs(q, u, G, A, h, scale, L)  # [B, T, H, V] in v's dtype
        ctx.save_for_backward(q, k, v, g, beta, h0, Ti, h, u, ht)
        ctx.scale, ctx.L, ctx.output_final_state, ctx.has_beta = scale, L, output_final_state, has_beta
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, Ti, h, u, ht = ctx.saved_tensors
        scale, L = ctx.scale, ctx.L
        do = do.contiguous()
        G = chunk_cumsum(g, L) if g is not None else None
        P = decayed_scores(k, k, G, None, 1.0, L)
        A = decayed_scores(q, k, G, None, scale, L)
        w, _ = wy_representation(k, v, G, beta, Ti, L, with_u=False)
        dht = dht.contiguous() if (dht is not None and ctx.output_final_state) else None
        du, dA = chunk_outputs_bwd_local(A, u, do, L)
        dh, dh0, dgc = pass_states_bwd(q, k, w, G, h, ht, dht, do, du, scale, L, need_dh0=h0 is not None)
        dq, dk, _, dG = qk_grads(q, k, u, G, None, h, dh, do, dA, scale, L, grad_dtype=torch.float32)
        dv, dk_w, dbeta, dG_w, dP = wy_representation_bwd(k, v, G, beta, Ti, P, h, du, L)
        dk_r, dk_c, _, dG_p = qk_grads(k, k, None, G, None, None, None, None, dP, 1.0, L, grad_dtype=torch.float32)
        dq, dk, dG = sum_grads(dq, (dk, dk_w, dk_r, dk_c), (dG, dG_w, dG_p) if g is not None else None, q.dtype, L)
        dg = chunk_cumsum(dG, L, reverse=True, add=dgc, out_dtype=g.dtype) if g is not None else None
        dbeta = dbeta.to(beta.dtype) if ctx.has_beta else None
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


def chunk_delta_triton(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                       scale: float | None, initial_state: Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """Chunkwise delta rule on Triton, decay first: S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ,
    o_t = S_tᵀ(scale·q_t), D_t = Diag(exp g_t) (identity without g). Arguments and results as
    `fastweights.chunkwise.chunk_delta` with decay_first=True, no probe key, no micro-steps
    (o [B, T, H, V] in v's dtype; final state [B or N, H, K, V] fp32 or None), plus grouped heads:
    q, k [B, T, H_q, K] with H_q | H. Inputs fp32, bf16 or fp16 (fp32 states and accumulation)."""
    L, initial_state, scale = check_chunk_args(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if L.T == 0:
        return no_tokens(v, L, initial_state, output_final_state)
    has_beta = beta is not None
    beta_in = beta.contiguous() if has_beta else torch.ones(L.B, L.T, L.H, dtype=torch.float32, device=q.device)
    o, ht = ChunkDeltaTriton.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                   g.contiguous() if g is not None else None, beta_in, initial_state, scale, L,
                                   bool(output_final_state), has_beta)
    return o, (ht if output_final_state else None)
