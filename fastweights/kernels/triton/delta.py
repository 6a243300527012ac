"""Glue: `chunk_delta_triton`, the Triton twin of `fastweights.chunkwise.chunk_delta` — DeltaNet (no
g), Gated DeltaNet (scalar g [B, T, H]), KDA (diagonal g [B, T, H, K]), each with the decay first or
after (Comba: decay_first=False with a probe key p), and DeltaProduct (k [B, T, n, H_q, K]: n
micro-steps per token, run as the delta rule on the interleaved length T·n) — forward and backward
through one torch.autograd.Function. Every stage is a Triton kernel.

The read key r (p, or k without one) and the read state's log-decay R (G with the decay first,
the exclusive cumsum R_i = G_{i−1} with it after) enter the stages that read the error: P and W.

Forward (chunkwise/delta.py's stages, one kernel each):

    G(, R) = cumsum.chunk_cumsum(g)                            chunk-local cumsum (fp32)
    P   = scores.decayed_scores(r, k, G, None, 1; Gq=R)        decayed RKᵀ (its strict part is used)
    T   = delta_inverse.unit_lower_inverse(P, β)                (I + strict_tril(diag(β) P))⁻¹
    W, U' = delta_wy.wy_representation(r, v, R, β, T)
    h, S_T, U = delta_states.pass_states_fwd(k, W, U', G, S_0)  U = U' − W S_n; S_{n+1} = a S_n + K̃ᵀ U
    Aqk = scores.decayed_scores(q, k, G, None, scale)
    o   = output.chunk_outputs(q, U, G, Aqk, h, scale)          o = Aqk U + Q̃ S_n

Saved for the backward: the inputs and T. Recomputed there: G (R), P, Aqk, W and U' (one kernel
each); the entering states h, U and the final state (the forward state pass run again) unless the
pipeline's `recompute_states` is False; and q̂, k̂ when they come unmodified from `prologue.delta_prologue`,
whose raw q, k (kept for the prologue's own backward) are kept instead (`prologue.l2_source`).
Gated DeltaNet with 8 heads, K = 128, V = 256, C = 64, bf16: h and U would be 8 + 4 KB per token, q̂
and k̂ 4 KB, against the 10 KB of raw q, k, v and T kept.

Backward:

    dU^loc, dAqk = delta_output.chunk_outputs_bwd_local(Aqk, U, dO)
    dh, dS_0, ∂L/∂G_last = delta_states.pass_states_bwd(...)     dU = dU^loc + K̃ dS_{n+1}; the transposed pass
    dq, dk₁, dG₁ = qk_grads(q, k, U, G, h, dh, dO, dAqk)         Aqk, Q̃ and K̃ (the gated class's kernel)
    dv, dr₂, dβ, dR₂, dP = delta_wy.wy_representation_bwd(r, ..., R)   T, W and U'
    dr₃, dk₄, dG₃ (dR₄) = qk_grads(r, k, dP; Gq=R) (intra-chunk only)   P (its rows and its columns)
    dq, dk, dp, dG, dR = delta_grads.sum_grads(...)                the parts summed, grouped heads folded, cast
      — without a probe (r = k), decay first and H_q = H, the second qk_grads sums the parts itself
        (fold=…: dk = dk₁ + dr₂ + dr₃ + dk₄ and dG written once, dq in its dtype by the first) and no
        sum pass runs (−0.8 GB of fp32 traffic at B=4, T=4096, H=16, K=128)
    dg = reverse cumsum(dG) + strict reverse cumsum(dR) + ∂L/∂G_last

With the pipeline's forward "split" (`delta_split.split_forward`, the calls "fused" takes): the fused forward's
pre-pass, a sequential pass writing h, U and the final state alone, and a chunk-parallel output kernel o = diag(scale
Γ) Q h + Aqk U; h and U are then kept for the backward where `recompute_states` is False.

With the pipeline's backward "fused" (no or a scalar decay, decay first, no probe: delta_fused_bwd.py, three kernels):

    h, U = delta_fused_bwd.recompute_states(k, v, g, β, T, S_0)   U = T diag(β)(V − Γ K S_n); (not if kept)
    dq, dk, dv, dg, dβ, dS_0 = delta_fused_bwd.fused_backward(...)  the reverse pass (dh, Y = Tᵀ dU, dv), then one
                                                                   chunk-parallel kernel for dq, dk, dβ, dg

Beyond chunk_delta: q, k (p) may have H_q heads dividing v's H (value head h reads q/k head
h // (H / H_q)); their gradients are summed over each group. The chunk size must be a power of
two ≥ 16 (micro-steps for DeltaProduct), K and V ≤ 256.

Which forward and backward run, whether the backward recomputes the states and whether bf16 / fp16 inputs run on
fp32 copies is the `pipeline` argument (`kernels.pipelines.DeltaPipeline`), picked by the dispatch row from the
call's facts (`kernels.pipelines.delta_pipeline`) — or by the caller.
"""

from __future__ import annotations

import warnings

import torch

from ...chunkwise.delta import interleave_micro_steps
from ...inputs import InputError, check_tensor
from ..pipelines import LOW_PRECISION_MIN_HEAD_DIM_CUDA, DeltaPipeline, delta_pipeline, gate_kind
from ..variants import split_forward_on
from .args import check_chunk_args, no_tokens
from .fused.delta_fused import fused_forward
from .fused.delta_fused_bwd import fused_backward, recompute_states
from .fused.delta_fused_bwd import supports as fused_bwd_supports
from .fused.delta_split import split_forward
from .layer.conv import conv_recompute, conv_source
from .layer.prologue import l2_recompute, l2_source
from .stages.cumsum import chunk_cumsum
from .stages.delta_grads import sum_grads
from .stages.delta_inverse import unit_lower_inverse
from .stages.delta_output import chunk_outputs, chunk_outputs_bwd_local
from .stages.delta_states import pass_states_bwd, pass_states_fwd
from .stages.delta_wy import wy_representation, wy_representation_bwd
from .stages.qk_grads import qk_grads
from .stages.scores import decayed_scores

Tensor = torch.Tensor

def _cumsums(g, L, excl: bool):
    """(G, R): the chunk-local cumsum and the read state's log-decay (G itself, or the exclusive
    cumsum with the decay after), or (None, None) without decay."""
    if g is None:
        return None, None
    if excl:
        return chunk_cumsum(g, L, exclusive=True)
    G = chunk_cumsum(g, L)
    return G, G


class ChunkDeltaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, p, scale, L, output_final_state, has_beta, decay_first, pipeline):
        excl = g is not None and not decay_first
        ctx.recompute = pipeline.recompute_states
        ctx.fused_bwd = pipeline.backward == "fused"
        if pipeline.forward in ("fused", "split"):
            # T only where a gradient will be asked for; h, U (and S_T, for the staged backward's ∂L/∂G_last) only
            # where the backward keeps them (the split forward writes h and U anyway: kept at no extra cost)
            need_final = output_final_state or (not ctx.recompute and g is not None and not ctx.fused_bwd)
            if pipeline.forward == "fused":
                o, Ti, h, u, ht = fused_forward(q, k, v, g, beta, h0, scale, L, store_T=any(ctx.needs_input_grad),
                                                store_states=not ctx.recompute, output_final_state=need_final)
            else:
                o, Ti, h, u, ht = split_forward(q, k, v, g, beta, h0, scale, L, store_T=any(ctx.needs_input_grad),
                                                output_final_state=need_final)
        else:
            r = k if p is None else p  # the read key
            G, R = _cumsums(g, L, excl)
            P = decayed_scores(r, k, G, None, 1.0, L, Gq=R if excl else None, strict=excl)  # [B, T, H, C]
            Ti = unit_lower_inverse(P, beta, L)  # [B, T, H, C]
            w, u1 = wy_representation(r, v, R, beta, Ti, L)
            need_final = output_final_state or G is not None  # the backward's ∂L/∂G_last reads S_T
            h, ht, u = pass_states_fwd(k, w, u1, G, h0, L, output_final_state=need_final)
            A = decayed_scores(q, k, G, None, scale, L)  # [B, T, H, C]
            o = chunk_outputs(q, u, G, A, h, scale, L)  # [B, T, H, V] in v's dtype
        # q, k straight from the delta prologue: keep what recomputes q̂, k̂ (the raw q, k its backward keeps anyway,
        # or — straight from the short conv — the conv's inputs), not q̂, k̂ too; v straight from the conv likewise
        ctx.q_src, ctx.k_src, ctx.v_src = l2_source(q), l2_source(k), conv_source(v)
        ctx.save_for_backward(None if ctx.q_src else q, None if ctx.k_src else k, None if ctx.v_src else v, g, beta,
                              h0, p, Ti,
                              *((None, None, None) if ctx.recompute else (h, u, ht)))
        ctx.scale, ctx.L, ctx.output_final_state, ctx.has_beta, ctx.excl = scale, L, output_final_state, has_beta, excl
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, p, Ti, h, u, ht = ctx.saved_tensors
        q = l2_recompute(*ctx.q_src) if ctx.q_src else q
        k = l2_recompute(*ctx.k_src) if ctx.k_src else k
        v = conv_recompute(ctx.v_src) if ctx.v_src else v
        ctx.q_src = ctx.k_src = ctx.v_src = None
        scale, L, excl = ctx.scale, ctx.L, ctx.excl
        do = do.contiguous()
        dht = dht.contiguous() if (dht is not None and ctx.output_final_state) else None
        if ctx.fused_bwd:
            A = None
            if ctx.recompute:
                h, u, A = recompute_states(q, k, v, g, beta, Ti, h0, scale, L)
            dq, dk, dv, dg, dbeta, dh0 = fused_backward(q, k, v, g, beta, Ti, h, u, do, dht, scale, L,
                                                        need_dh0=h0 is not None, A=A)
            del h, u, A
            return dq, dk, dv, dg, (dbeta if ctx.has_beta else None), dh0, None, None, None, None, None, None, None
        r = k if p is None else p
        G, R = _cumsums(g, L, excl)
        P = decayed_scores(r, k, G, None, 1.0, L, Gq=R if excl else None, strict=excl)
        A = decayed_scores(q, k, G, None, scale, L)
        w, u1 = wy_representation(r, v, R, beta, Ti, L, with_u=ctx.recompute)
        if ctx.recompute:  # the forward's state pass again: the same kernel on the same inputs, bitwise the same
            h, ht, u = pass_states_fwd(k, w, u1, G, h0, L, output_final_state=ctx.output_final_state or G is not None)
        del u1
        du, dA = chunk_outputs_bwd_local(A, u, do, L)
        dh, dh0, dgc = pass_states_bwd(q, k, w, G, h, ht, dht, do, du, scale, L, need_dh0=h0 is not None)
        fold = p is None and not excl and L.H == L.Hq  # r = k: the last kernel sums dk's parts (no sum pass)
        dq, dk, _, dG = qk_grads(q, k, u, G, None, h, dh, do, dA, scale, L,
                                 grad_dtype=q.dtype if fold else torch.float32)
        dv, dr_w, dbeta, dR_w, dP = wy_representation_bwd(r, v, R, beta, Ti, P, h, du, L)
        if fold:
            _, dk, _, dG = qk_grads(k, k, None, G, None, None, None, None, dP, 1.0, L, fold=(dk, dr_w, dG, dR_w))
            dp = dR = None
        else:
            dr_p, dk_p, _, dG_p = qk_grads(r, k, None, G, None, None, None, None, dP, 1.0, L,
                                           grad_dtype=torch.float32, Gq=R if excl else None)
            dgs = None if g is None else ((dG, dR_w, *dG_p) if excl else (dG, dR_w, dG_p))
            dq, dk, dp, dG, dR = sum_grads(dq, (dk, dr_w, dr_p, dk_p), dgs, q.dtype, L, probe=p is not None)
        dg = chunk_cumsum(dG, L, reverse=True, add=dgc, excl=dR, out_dtype=g.dtype) if g is not None else None
        dbeta = dbeta.to(beta.dtype) if ctx.has_beta else None
        return dq, dk, dv, dg, dbeta, dh0, dp, None, None, None, None, None, None


def _check_pipeline(pipeline: DeltaPipeline, p, g, decay_first: bool, L) -> None:
    """A fused forward or backward asked for a call its kernels do not take: one error naming the argument."""
    takes = p is None and (decay_first or g is None)
    if pipeline.forward in ("fused", "split") and not takes:
        raise InputError(f"pipeline.forward='{pipeline.forward}' takes the decay first (or none) and no probe key p; "
                         "pass DeltaPipeline(forward='staged', ...) for this call")
    if pipeline.backward == "fused" and not (takes and fused_bwd_supports(g, L)):
        raise InputError(f"pipeline.backward='fused' takes the decay first (or none), no probe key, no or a scalar "
                         f"decay, K ≤ 128 and a chunk ≤ 64 (got gate {gate_kind(g)}, K={L.K}, C={L.C}); "
                         "pass DeltaPipeline(backward='staged', ...) for this call")


def chunk_delta_triton(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                       p: Tensor | None = None, decay_first: bool = True, scale: float | None,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64, cu_seqlens: Tensor | None = None,
                       pipeline: DeltaPipeline | None = None, check_cu_seqlens: bool = True):
    """Chunkwise delta rule on Triton, o_t = S_tᵀ(scale·q_t), D_t = Diag(exp g_t) (identity without g):

        decay_first=True   S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ      (DeltaNet, GDN, KDA)
        decay_first=False  S_t = D_t S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ         (Comba; p = k if None)

    Arguments and results as `fastweights.chunkwise.chunk_delta` (o [B, T, H, V] in v's dtype; final
    state [B or N, H, K, V] fp32 or None), DeltaProduct included (k [B, T, n, H_q, K], v [B, T, n, H, V],
    β [B, T, n, H]; chunk_size in micro-steps), plus grouped heads: q, k, p [B, T, H_q, K] with
    H_q | H. Inputs fp32, bf16 or fp16 (fp32 states and accumulation).

    pipeline: which kernels run (`kernels.pipelines.DeltaPipeline`: staged or fused forward and backward, the
    states recomputed or kept, fp32 copies of bf16 / fp16 inputs); None: the one `kernels.pipelines.delta_pipeline`
    picks from the call's facts (what the dispatch row passes). check_cu_seqlens=False: cu_seqlens valid by
    construction, not read on the host (`check_chunk_args`)."""
    if isinstance(k, Tensor) and k.dim() == 5:
        return _delta_product(q, k, v, g=g, beta=beta, p=p, decay_first=decay_first, scale=scale,
                              initial_state=initial_state, output_final_state=output_final_state,
                              chunk_size=chunk_size, cu_seqlens=cu_seqlens, pipeline=pipeline,
                              check_cu_seqlens=check_cu_seqlens)
    L, initial_state, scale = check_chunk_args(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                               chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                                               check_cu_seqlens=check_cu_seqlens)
    if p is not None:
        check_tensor("p", p, tuple(q.shape), values=False)
        if p.dtype != q.dtype:
            raise InputError(f"p must have q's dtype {q.dtype}, got {p.dtype}")
    if L.T == 0:
        return no_tokens(v, L, initial_state, output_final_state)
    if pipeline is None:
        pipeline = delta_pipeline(gate=gate_kind(g), probe=p is not None, decay_first=decay_first,
                                  device_type=q.device.type, dtype=q.dtype, K=L.K, V=L.V, C=L.C,
                                  split=split_forward_on())
    if not isinstance(pipeline, DeltaPipeline):
        raise InputError(f"pipeline must be a kernels.pipelines.DeltaPipeline or None, got {pipeline!r}")
    if pipeline.fp32 and q.dtype != torch.float32:
        warnings.warn(f"fastweights: the delta rule's Triton kernels run in fp32 at head dims K={L.K}, V={L.V} on a "
                      f"GPU: {q.dtype} below {LOW_PRECISION_MIN_HEAD_DIM_CUDA} gave wrong results under Triton on "
                      "Hopper (fastweights.kernels.pipelines.LOW_PRECISION_MIN_HEAD_DIM_CUDA)", stacklevel=2)
        o, ht = chunk_delta_triton(q.float(), k.float(), v.float(), g=g, beta=beta,
                                   p=p.float() if p is not None else None, decay_first=decay_first, scale=scale,
                                   initial_state=initial_state, output_final_state=output_final_state,
                                   chunk_size=chunk_size, cu_seqlens=cu_seqlens, pipeline=pipeline,
                                   check_cu_seqlens=check_cu_seqlens)
        return o.to(v.dtype), ht
    _check_pipeline(pipeline, p, g, decay_first, L)
    has_beta = beta is not None
    beta_in = beta.contiguous() if has_beta else torch.ones(L.B, L.T, L.H, dtype=torch.float32, device=q.device)
    o, ht = ChunkDeltaTriton.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                   g.contiguous() if g is not None else None, beta_in, initial_state,
                                   p.contiguous() if p is not None else None, scale, L, bool(output_final_state),
                                   has_beta, bool(decay_first), pipeline)
    return o, (ht if output_final_state else None)


def _delta_product(q, k, v, *, g, beta, p, decay_first, scale, initial_state, output_final_state, chunk_size,
                   cu_seqlens, pipeline, check_cu_seqlens=True):
    """n Householder micro-steps per token (`interleave_micro_steps`, which checks the shapes), the
    output of each token picked from its last micro-step's row."""
    n = k.shape[2]
    q_il, k_il, v_il, beta_il, g_il, cu_il = interleave_micro_steps(q, k, v, beta, g, p, cu_seqlens)
    o, final = chunk_delta_triton(q_il, k_il, v_il, g=g_il, beta=beta_il, decay_first=decay_first, scale=scale,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  chunk_size=chunk_size, cu_seqlens=cu_il, pipeline=pipeline,
                                  check_cu_seqlens=check_cu_seqlens)
    return o.unflatten(1, (-1, n))[:, :, -1], final  # [B, T, H, V]
