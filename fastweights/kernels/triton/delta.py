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
each); the entering states h, U and the final state (the forward state pass run again) unless
`RECOMPUTE_STATES` is False; and q̂, k̂ when they come unmodified from `prologue.delta_prologue`,
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

With BACKWARD "fused" (no or a scalar decay, decay first, no probe: delta_fused_bwd.py, three kernels):

    h, U = delta_fused_bwd.recompute_states(k, v, g, β, T, S_0)   U = T diag(β)(V − Γ K S_n); (not if kept)
    dq, dk, dv, dg, dβ, dS_0 = delta_fused_bwd.fused_backward(...)  the reverse pass (dh, Y = Tᵀ dU, dv), then one
                                                                   chunk-parallel kernel for dq, dk, dβ, dg

Beyond chunk_delta: q, k (p) may have H_q heads dividing v's H (value head h reads q/k head
h // (H / H_q)); their gradients are summed over each group. The chunk size must be a power of
two ≥ 16 (micro-steps for DeltaProduct), K and V ≤ 256.
"""

from __future__ import annotations

import warnings

import torch

from ...chunkwise.delta import interleave_micro_steps
from ...inputs import InputError, check_tensor
from .args import check_chunk_args, no_tokens
from .conv import conv_recompute, conv_source
from .cumsum import chunk_cumsum
from .delta_fused import FUSED_MAX_HEAD_DIM_CUDA, fused_forward
from .delta_fused_bwd import fused_backward, recompute_states
from .delta_fused_bwd import supports as fused_bwd_supports
from .delta_grads import sum_grads
from .delta_inverse import unit_lower_inverse
from .delta_output import chunk_outputs, chunk_outputs_bwd_local
from .delta_states import pass_states_bwd, pass_states_fwd
from .delta_wy import wy_representation, wy_representation_bwd
from .prologue import l2_recompute, l2_source
from .qk_grads import qk_grads
from .scores import decayed_scores

Tensor = torch.Tensor

#: The backward recomputes the forward state pass (h, U, S_T) instead of the forward keeping them: one more
#: `pass_states_fwd` and U' in the backward for −(K·V/C + V)·H elements per token of saved memory. Read when
#: the forward runs; False keeps them (A/B timing). Either way the gradients are bitwise the same.
RECOMPUTE_STATES = True

#: The forward of the decay-first delta rule without a probe key (DeltaNet, gated DeltaNet, KDA, DeltaProduct):
#: "staged" (the six stage kernels above), "fused" (delta_fused.py: a chunk-parallel pre-pass and one
#: sequential kernel with the state in registers) or "auto": fused where it was measured faster on the H100 —
#: bf16/fp16 inputs with no or a scalar decay (KDA's fused forward lost: 3.55 vs 2.17 ms at the anchor,
#: BENCHMARKS §1d; fp32 inputs were not timed) and, on a GPU, K, V ≤ delta_fused.FUSED_MAX_HEAD_DIM_CUDA. Comba
#: (probe key, decay after) always runs staged. Read when the forward runs.
FORWARD = "auto"
FORWARDS = ("staged", "fused", "auto")

#: The head dims (K, V) at which "auto" picks the fused kernels on a GPU: the specializations the H100 has
#: checked against the fp32 torch chunk form (2026-11-26, H100, `scripts/gpu_fused_bwd.py`: bf16 K = V = 128 at
#: B4 T300, B1 T1500 Hq16 H32 and B1 T32768 Hq16 H32, fp32 grouped varlen; BENCHMARKS §1e). Every other head
#: dim compiles other kernels (BK = K, another BV) that no GPU has run yet, so "auto" keeps them staged there
#: until a GPU call checks them (add them here then); FORWARD / BACKWARD = "fused" still runs them on request.
#: (On the CPU, under the interpreter, every head dim is checked by the tests.) K = 128, V = 256 (the LM
#: preset's gated DeltaNet: value heads twice as wide) was added on 2026-11-26 with its GPU check (H200, Triton 3.6:
#: tests/kernels/test_triton_delta_fused_bwd.py::test_cuda_head_dims, three sizes, both gates; BENCHMARKS §1f,
#: docs/results/gpu/r3s4_call6_cuda_tests.log; not yet run on an H100); the forward there stays
#: staged (V > delta_fused.FUSED_MAX_HEAD_DIM_CUDA), the backward is fused.
FUSED_CHECKED_HEAD_DIMS_CUDA = frozenset({(128, 128), (128, 256)})

#: The smallest head dim (K and V) at which the delta class's kernels take bf16 / fp16 inputs on a GPU. Below it
#: the call runs the same kernels on fp32 copies of q, k, v (and p) and casts the output back, with a warning:
#: on the H200 with Triton 3.6 (2026-11-26, `scripts/gpu_diag.py`, docs/results/gpu/r3s4_call7_diag.txt) bf16 at
#: K = 16 and K = 32 gave wrong outputs and gradients (relative errors 0.1–1.4 against the fp32 torch form where
#: fp32 inputs give 5e-7; the fused forward NaN at K = 16) and an illegal memory access in the WY backward at
#: K = 16; K = 64 and above pass the cuda tests. (The interpreter, on the CPU, passes every head dim.)
LOW_PRECISION_MIN_HEAD_DIM_CUDA = 64

#: The backward of the same calls: "staged" (the stage kernels below), "fused" (delta_fused_bwd.py: the state
#: pass recomputed from T, one reverse sequential kernel and one chunk-parallel gradient kernel) or "auto" (the
#: fused one wherever it applies, for bf16/fp16 inputs). The fused backward takes no or a scalar decay with
#: K ≤ 128 and C ≤ 64 (`delta_fused_bwd.supports`); KDA, Comba, K = 256 and C = 128 always run staged. Read when
#: the forward runs; either forward feeds either backward (both save T).
BACKWARD = "auto"
BACKWARDS = ("staged", "fused", "auto")


def uses_fused_forward(p, g, decay_first: bool, L, x: Tensor) -> bool:
    """Whether a call with probe key p, gate g, decay order, layout L and inputs like x (dtype, device) runs the
    fused forward (FORWARD)."""
    if FORWARD not in FORWARDS:
        raise ValueError(f"delta.FORWARD must be one of {FORWARDS}, got {FORWARD!r}")
    takes = p is None and (decay_first or g is None)
    if FORWARD == "auto":
        return (takes and (g is None or g.dim() == 3) and x.dtype != torch.float32
                and (not x.is_cuda or ((L.K, L.V) in FUSED_CHECKED_HEAD_DIMS_CUDA
                                       and max(L.K, L.V) <= FUSED_MAX_HEAD_DIM_CUDA)))
    return FORWARD == "fused" and takes


def uses_fused_backward(p, g, decay_first: bool, L, x: Tensor) -> bool:
    """Whether a call with probe key p, gate g, decay order, layout L and inputs like x runs the fused backward
    (BACKWARD, decay first, no p, `delta_fused_bwd.supports`; "auto": not for fp32 inputs, and on a GPU only at
    the checked head dims `FUSED_CHECKED_HEAD_DIMS_CUDA`)."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"delta.BACKWARD must be one of {BACKWARDS}, got {BACKWARD!r}")
    if BACKWARD == "staged" or (BACKWARD == "auto" and x.dtype == torch.float32):
        return False
    if BACKWARD == "auto" and x.is_cuda and (L.K, L.V) not in FUSED_CHECKED_HEAD_DIMS_CUDA:
        return False
    return p is None and (decay_first or g is None) and fused_bwd_supports(g, L)


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
    def forward(ctx, q, k, v, g, beta, h0, p, scale, L, output_final_state, has_beta, decay_first):
        excl = g is not None and not decay_first
        ctx.recompute = RECOMPUTE_STATES
        ctx.fused_bwd = uses_fused_backward(p, g, decay_first, L, q)
        if uses_fused_forward(p, g, decay_first, L, q):
            # T only where a gradient will be asked for; h, U (and S_T, for the staged backward's ∂L/∂G_last) only
            # where the backward keeps them
            o, Ti, h, u, ht = fused_forward(
                q, k, v, g, beta, h0, scale, L, store_T=any(ctx.needs_input_grad), store_states=not ctx.recompute,
                output_final_state=output_final_state or (not ctx.recompute and g is not None and not ctx.fused_bwd))
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
            return dq, dk, dv, dg, (dbeta if ctx.has_beta else None), dh0, None, None, None, None, None, None
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
        return dq, dk, dv, dg, dbeta, dh0, dp, None, None, None, None, None


def runs_in_fp32(x: Tensor, L) -> bool:
    """Whether a call with inputs like x (dtype, device) and layout L runs on fp32 copies of its bf16 / fp16
    inputs: on a GPU below LOW_PRECISION_MIN_HEAD_DIM_CUDA."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and min(L.K, L.V) < LOW_PRECISION_MIN_HEAD_DIM_CUDA)


def chunk_delta_triton(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                       p: Tensor | None = None, decay_first: bool = True, scale: float | None,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """Chunkwise delta rule on Triton, o_t = S_tᵀ(scale·q_t), D_t = Diag(exp g_t) (identity without g):

        decay_first=True   S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ      (DeltaNet, GDN, KDA)
        decay_first=False  S_t = D_t S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ         (Comba; p = k if None)

    Arguments and results as `fastweights.chunkwise.chunk_delta` (o [B, T, H, V] in v's dtype; final
    state [B or N, H, K, V] fp32 or None), DeltaProduct included (k [B, T, n, H_q, K], v [B, T, n, H, V],
    β [B, T, n, H]; chunk_size in micro-steps), plus grouped heads: q, k, p [B, T, H_q, K] with
    H_q | H. Inputs fp32, bf16 or fp16 (fp32 states and accumulation)."""
    if isinstance(k, Tensor) and k.dim() == 5:
        return _delta_product(q, k, v, g=g, beta=beta, p=p, decay_first=decay_first, scale=scale,
                              initial_state=initial_state, output_final_state=output_final_state,
                              chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    L, initial_state, scale = check_chunk_args(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if p is not None:
        check_tensor("p", p, tuple(q.shape), values=False)
        if p.dtype != q.dtype:
            raise InputError(f"p must have q's dtype {q.dtype}, got {p.dtype}")
    if L.T == 0:
        return no_tokens(v, L, initial_state, output_final_state)
    if runs_in_fp32(q, L):
        warnings.warn(f"fastweights: the delta rule's Triton kernels run in fp32 at head dims K={L.K}, V={L.V} on a "
                      f"GPU: {q.dtype} below {LOW_PRECISION_MIN_HEAD_DIM_CUDA} gave wrong results under Triton on "
                      "Hopper (fastweights.kernels.triton.delta.LOW_PRECISION_MIN_HEAD_DIM_CUDA)", stacklevel=2)
        o, ht = chunk_delta_triton(q.float(), k.float(), v.float(), g=g, beta=beta,
                                   p=p.float() if p is not None else None, decay_first=decay_first, scale=scale,
                                   initial_state=initial_state, output_final_state=output_final_state,
                                   chunk_size=chunk_size, cu_seqlens=cu_seqlens)
        return o.to(v.dtype), ht
    has_beta = beta is not None
    beta_in = beta.contiguous() if has_beta else torch.ones(L.B, L.T, L.H, dtype=torch.float32, device=q.device)
    o, ht = ChunkDeltaTriton.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                   g.contiguous() if g is not None else None, beta_in, initial_state,
                                   p.contiguous() if p is not None else None, scale, L, bool(output_final_state),
                                   has_beta, bool(decay_first))
    return o, (ht if output_final_state else None)


def _delta_product(q, k, v, *, g, beta, p, decay_first, scale, initial_state, output_final_state, chunk_size,
                   cu_seqlens):
    """n Householder micro-steps per token (`interleave_micro_steps`, which checks the shapes), the
    output of each token picked from its last micro-step's row."""
    n = k.shape[2]
    q_il, k_il, v_il, beta_il, g_il, cu_il = interleave_micro_steps(q, k, v, beta, g, p, cu_seqlens)
    o, final = chunk_delta_triton(q_il, k_il, v_il, g=g_il, beta=beta_il, decay_first=decay_first, scale=scale,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  chunk_size=chunk_size, cu_seqlens=cu_il)
    return o.unflatten(1, (-1, n))[:, :, -1], final  # [B, T, H, V]
