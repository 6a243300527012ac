"""Triton kernels of the chunk form (GPU; CPU tensors under TRITON_INTERPRET=1).

Never imported by `import fastweights`: `@triton.jit` reads TRITON_INTERPRET when a kernel is
*defined*, so the dispatch rows (`fastweights.kernels.rows`) import these modules on the
first call only.

One file per stage, each the twin of a plain-torch stage of `fastweights.chunkwise`:

    layout.py    the chunk index of a padded batch or of varlen `cu_seqlens`, built on the device
    cumsum.py    chunk_cumsum: G = chunk-local cumsum of the log-gates (and the reverse pass of dg)
    scores.py    decayed_scores: A_ij = scale Σ_d q_id β_j k_jd e^{G_id − G_jd}, j ≤ i
    states.py    pass_states: entering states S_n + final state; backward: the transposed pass
    output.py    chunk_outputs: o = A V + (scale q ⊙ e^G) S_n; backward: dv and dA = dO Vᵀ
    qk_grads.py  backward of scores and outputs: dq, dk, dβ and the per-row dG
    gated.py     glue: autograd.Function, `chunk_gated_triton` with chunk_gated's signature
    args.py      the argument checks and the T = 0 result both glues share
    decode.py    fused_recurrent_step: T tokens of the recurrence, state updated in place (decoding)

The delta class (DeltaNet, gated DeltaNet, KDA; Comba's probe key and decay after; DeltaProduct's
micro-steps interleaved), reusing cumsum, scores, output and qk_grads (interpreter tests in CI;
every path checked on the H100 and picked by "auto" on CUDA):

    delta_inverse.py  the per-chunk (I + strict(β K Kᵀ ⊙ decay))⁻¹
    delta_wy.py       W and U' (the WY representation) and their backward
    delta_states.py   the delta state pass with U = U' − W S_n fused in, and its transposed pass
    delta_output.py   the output's local backward (Aqkᵀ dO, dAqk)
    delta_grads.py    the dq/dk/dG parts summed, folded over grouped heads, cast
    delta_fused.py    the fused forward: a chunk-parallel pre-pass (P, T, W, U') and one sequential kernel
    delta_fused_bwd.py  the fused backward: the state pass recomputed from T, the reverse pass, one
                      chunk-parallel kernel for dq, dk, dβ, dg (no/scalar decay; twin chunkwise/delta_bwd.py)
    delta.py          glue: autograd.Function, `chunk_delta_triton` with chunk_delta's signature
    prologue.py       the layer's options in one pass: L2 norm of q and k, β = β_max·σ(b), the
                      Mamba/KDA gate g = −exp(A_log)·softplus(a + dt_bias), optionally its
                      chunk-local cumsum (interpreter-verified; MemoryMixer calls it on CUDA)

MesaNet's chunked conjugate-gradient solve (`kernels.rows.mesa_chunk`: the torch chunk form with both CG solves
in the kernel; interpreter-verified, not yet run on a GPU):

    mesa_cg.py        one program per chunk runs every CG iteration of its C systems, x, r, p and the chunk's
                      Hs, kc, A in registers (C ≤ 64, K ≤ 128), and the per-token residual

The mini-batch form's Muon step (ATLAS: `kernels.rows.generic_chunk`, the torch mini-batch form
with this kernel; interpreter-verified):

    newton_schulz.py  Newton–Schulz on every token's r × r Gram matrix (r ≤ 64), one program per
                      matrix each way, the iteration in registers (the backward recomputes it)

TTT-Linear's whole inner mini-batch loop (`kernels.rows.ttt_linear_chunk`; interpreter-verified, not yet run
on a GPU):

    ttt.py            one program per (sequence, value head) walks the mini-batches with the fast weights in
                      registers, each way (the backward recomputes each mini-batch from its stored anchor)

The layer kernels around the memory (the Triton rows of the layer ops "conv" and "norm" of the
dispatch table, `kernels.rows`; "auto" takes them on CUDA; interpreter-verified):

    conv.py     short_conv: the causal depthwise short conv + bias + SiLU with its carried tail
    norm.py     gated_rms_norm: the gated output RMSNorm (either order, swish/sigmoid gate)
    limits.py   their shape limits (importable without triton)
"""
