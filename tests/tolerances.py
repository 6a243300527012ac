"""Every numerical tolerance of the test suite, in one place."""

import os
import re

import torch

EXACT_F64 = 1e-10  # two exact forms of one recurrence, float64
CHUNK_F64 = 1e-9  # chunk vs recurrent, float64
CHUNK_F32_REL = 1e-5  # chunk vs recurrent, fp32, relative to the output scale
# (the delta kernels' dβ against the recurrence: relative to the size of its summands, tests/kernels/helpers.py
# delta_summand_scales, not to max |dβ|. At T = 1, B 2 a token's two terms (v·Y and (S'ᵀk)·Y) can cancel: in CI
# test_triton_delta_fused_bwd's [scalar-1] had dβ 1.15e-5 of max |dβ| (inputs' seed 2320001200287840287). Replayed
# on those inputs, projection seeds 0 … 1,999,999 (r4s16): max |dβ| is up to 2,900× below its summands' size; of the
# 1,500 most cancelled (≥ 77×) run through the kernels 100 failed the old bound (up to 1.32e-4), while against the
# summands all stay ≤ 1.15e-7 (≤ 1.9e-7 over seeds 0 … 1,999 as drawn); the other gradients ≤ 4.0e-7.)
F32 = 1e-5  # fp32 against an fp32 reference of the same maths

# Each comment says what its bound bounds, how it is applied (absolute; REL in the name: relative
# to the reference's largest magnitude; or as the comment says, e.g. over 1 + max |·|) and why it
# is that size. Up to the CUDA section, each is the value its test carried as a literal before it
# moved here. tests/test_tolerances.py keeps literals from creeping back into the tests.

# ---------------------------------------------------------------- chunk engines (tests/chunkwise)
# bf16/fp16 q, k, v (and β, p) into the chunk form, relative to the fp32 chunk result on the same
# values: the inputs' own rounding (bf16 keeps 8 bits, ≈ 4e-3 per element) grows through the
# sums of a chunk and the state; fp16 keeps 11 bits.
CHUNK_LOW_REL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
# fp32 chunk vs float64 chunk at T = 4,096 and 65,536, relative: the fp32 rounding of 64 to 1,024
# chunk-state updates accumulates, an order of magnitude above CHUNK_F32_REL's T ≈ 100.
CHUNK_LONG_F32_REL = 1e-4
# (T A − I) for the unit-lower inverses, float64, C ≤ 16 and |L| ~ 0.3: a triangular solve is
# backward stable, so only a few ulps of 1 remain.
UNIT_LOWER_INVERSE_F64 = 1e-12
# the fused pre-pass's in-register inverse (either form, LAUNCH["delta_prepass"]["INV"]) with fp32 inputs against the
# float64 solve on ill-conditioned chunks (β ∈ [1.8, 2), keys nearly parallel: |L| ≈ 2, max |T| ≈ 2), max |T − T64|
# over max |T64| a chunk: the forward error grows with cond(I + L) (measured in fp32 torch emulation, C 64: 7e-6 by
# substitution and doubling, 5e-6 by recursion; 3.6e-1 by the product form (I − L)(I + L²)(I + L⁴)(I + L⁸) on the
# 16×16 blocks, which is why that form is not offered); an order of magnitude of room.
INVERSE_ILL_F32_REL = 1e-4
# decayed_scores against the direct sum Σ_d x y e^{gx − gy}, float64, relative to max(1, |P|):
# both paths sum K products in a different order; the gradients pass through exp twice more.
DECAYED_SCORES_F64_REL = 1e-12
DECAYED_SCORES_GRAD_F64_REL = 1e-10
# Mesa's chunk form solving by conjugate gradients (30 steps ≥ K = 6) vs the exact solve in the
# recurrence, float64: CG on a K-dimensional SPD system is exact after K steps up to rounding
# amplified by the system's condition number.
MESA_CG_F64 = 1e-8
# the CG residual Mesa reports after 16 steps at K = 16, float64: converged, up to rounding.
MESA_CG_RESIDUAL = 1e-8
# Mesa with bf16 q, k, v vs fp32, absolute over (1 + max |o|): the solve amplifies the inputs'
# bf16 rounding by the system's condition number.
MESA_BF16 = 0.05
# Mesa's chunk-boundary states in closed form (chunkwise.mesa.chunk_states: exp(P_n − P_{m+1}) weights, one product)
# in fp32 vs the sequential recurrence in float64, relative (states, N = 64 chunks, per-chunk log-decays up to −10):
# measured ≤ 1.4e-7 over 3 decay scales, as the fp32 recurrence itself (≤ 2.1e-7). ≈ 7× room — tight enough to
# catch P summed in fp32 (7e-6 at decays ≈ −5 a chunk: |P| ≈ 320 cancels in P_n − P_{m+1}).
MESA_STATES_F32_REL = 1e-6

# ---------------------------------------------------------------- reference forms (tests/reference)
# fp32 recurrent vs float64 recurrent at T = 6, absolute over (1 + max |o|): every zoo recipe,
# including the MLP memories' inner steps and Newton–Schulz, where fp32 rounding is amplified.
RECURRENT_F32 = 1e-4
# autodiff vs closed-form gradient of the inner objective (MLP memories), float64, absolute over
# (1 + max |grad|): two formulas for one derivative, through depth ≤ 3 layers.
INNER_GRAD_F64 = 1e-9
# Mesa with v = k and λ = 1e-7 after ≥ 40 keys of dimension 6: o = q up to the regularizer's
# bias, λ‖·‖ relative to the keys' Gram matrix.
MESA_IDENTITY = 1e-4
# Newton–Schulz with the quintic (3.4445, −4.7750, 2.0315): the iteration does not converge to 1
# but lands in a band around it; after 5 steps every singular value lies in this open interval,
# after 12 within ±NEWTON_SCHULZ_12_SPREAD of 1.
NEWTON_SCHULZ_5_RANGE = (0.6, 1.25)
NEWTON_SCHULZ_12_SPREAD = 0.35
# softmax attention with bf16 q, k, v (computed in fp32, output rounded to bf16) vs fp32 on the
# same rounded inputs, absolute, |o| ≲ 1: bf16's output rounding is ≈ 4e-3.
SOFTMAX_BF16 = 1e-2
# recurrent vs parallel in fp32 over random shapes (hypothesis), absolute over (1 + max |o|):
# the two forms sum in different orders; the cumulative decays and inner solves amplify it.
FORMS_F32 = 2e-4
# a defaulted input (β = 1) vs the same value given explicitly, and recurrent vs parallel on it,
# float64, T = 5: the same or nearly the same floating-point operations.
INPUT_DEFAULT_F64 = 1e-12
# feature-map kernel identity φ(x)·φ(y) = Σ c_i (x·y)^i, float64, K = 5: a handful of products; also the degree-2
# features' gradient against the gathered monomials' (K 16, relative to its largest entry: sums in another order).
FEATURE_KERNEL_F64 = 1e-12

# ---------------------------------------------------------------- layers (tests/layers)
# two forms of one layer (training form vs recurrent, prefill + steps vs one forward), float64,
# relative to the output scale: the mixer's projections add no error of their own.
LAYER_F64_REL = 1e-9
# parameter gradients, training form vs recurrent, float64, relative; Mesa's chunk form solves
# by 30 CG steps, whose gradient agrees less closely than its output.
LAYER_GRAD_F64_REL = {"mesanet": 1e-3}
LAYER_GRAD_F64_REL_DEFAULT = 1e-8
# ShortConv vs F.conv1d, and chained calls vs one call, float64: K ≤ 4 products per output.
SHORT_CONV_F64 = 1e-12
# kv_extend's gradients vs the direct per-token reference, float64, absolute: the same maths
# computed in a different order.
KV_GRAD_F64 = 1e-9
# RoPE scores q·k at equal relative offsets (positions 5/0, 8/3, 45/40), float64: cos/sin of
# different angles, a few ulps each.
ROPE_RELATIVE_F64 = 1e-10
# the initial gate ranges (A = exp(A_log) stored in fp32, dt = softplus(dt_bias)): the fp32
# round trip through log/exp and softplus⁻¹/softplus moves an end point by an ulp or so.
GATE_A_LOW_SLACK = 1e-6  # absolute, at A's lower end (≥ 1e-4)
GATE_A_HIGH_SLACK = 1e-5  # absolute, at A's upper end 16 (fp32 ulp there ≈ 2e-6)
GATE_DT_REL_SLACK = 1e-5  # relative, at dt's ends
# sample std of TTT's initial memory (512 draws of N(0, 0.02²)) vs 0.02: the standard error of a
# sample std is σ/√(2n) ≈ 6e-4, so this is ~16 standard errors.
TTT_INIT_STD = 0.01

# ---------------------------------------------------------------- models (tests/models)
# compiled vs eager parameter gradients, fp32, absolute over max(1, max |grad|): inductor fuses
# and reorders reductions.
COMPILE_GRAD_F32_REL = 1e-4
# prefill + decode vs full forward, fp32, max |Δlogit| / max |logit|. ATLAS's Newton–Schulz step
# (normalize, then a quintic) amplifies the rounding difference between its chunk and recurrent forms; since
# the chunk form runs it on the r×r Gram matrix of the momentum (round 3, issue 24) the fp32 gap over 40 seeds
# is median 5.5e-4, max 2.9e-3 (was within 3e-4), while float64 agrees to 5e-12 (DECODE_F64_REL, tested).
DECODE_REL = {"atlas": 5e-3}
DECODE_F64_REL = 1e-9
DECODE_REL_DEFAULT = 1e-4
# cached vs uncached greedy decoding may part only at a near-tie: the logit gap at the first
# divergence, relative to max |logit|, is below what DECODE_REL_DEFAULT allows the logits to move.
GREEDY_TIE_REL = 1e-4

# ---------------------------------------------------------------- lab and tasks (tests/lab, tests/tasks)
# a resumed training run vs the uninterrupted one: the same batches and seeds; only the loss's
# float reduction order may differ (fp32), accuracy and the schedule's lr are exact up to rounding.
RESUME_LOSS_REL = 1e-6
RESUME_LOSS_ABS = 1e-7
RESUME_ACCURACY = 1e-9
RESUME_LR_REL = 1e-12
# capacity recall of one model by two forms (recurrent vs parallel or fast): float rounding may
# flip a near tie of the argmax read-out (2 trials, d_k = 16): at most this accuracy difference.
RECALL_FORM_DIFF = 0.05
# capacity's fast write vs the recurrent write, fp32 state (rtol and atol): chunk/parallel forms
# sum in a different order than the per-token loop.
FAST_WRITE_F32 = 1e-4
# capacity's direct read of a state vs continuing the recurrence with β = 0, float64 (rtol and
# atol): two formulas for one read, the constant-retention one divided by γ^j afterwards.
DIRECT_READ_F64 = 1e-9
# noisy in-context recall: the sampled fraction of noise pair slots (200 × ~31 slots) vs the
# configured 0.2: were the 200 × 63 slots independent, the standard error would be ≈ 0.004.
MAD_NOISE_FRACTION = 0.03
# MQAR's query-gap law (a = 0.01, L = 256, n = 16): slot 0's probability, documented as ≈ 0.18.
MQAR_SLOT0_P_RANGE = (0.15, 0.21)
# Gumbel-top-k vs numpy's sequential choice, inclusion frequencies over 4,000 draws each, absolute:
# a difference of two frequencies has standard error ≤ 0.011, so this is ≥ 4.5 of them at any slot.
MQAR_INCLUSION_FREQ = 0.05
# a = 1 (uniform gaps): the mean gap over 2,000 rows × 4 queries vs (slots − 1)/2 = 29.5: the
# standard error is ≈ 17/√8000 ≈ 0.2 (were the draws independent), so this is ~7 of them.
MQAR_UNIFORM_GAP_MEAN = 1.5

# the graphed training path run on the CPU without a capture (fastweights.lab.graph, emulated)
# vs the eager loop, float64 weights (absolute): the same steps in another form (the loss at
# gathered positions with ignore_index, the partial batch filled with ignored rows, a tensor lr);
# the cross-entropy is fp32 in both and sums its positions in another order: measured ≤ 7.9e-15
# on the weights over 4 seeds, and ≤ 3.3e-8 on the epoch losses (fp32, relative; bound as
# RESUME_LOSS_REL). An lr one step off, a missing clip or a wrong loss mean moves the weights by
# ≥ 1e-5 at these sizes.
GRAPH_EMULATED_F64 = 1e-12
GRAPH_EMULATED_LOSS_REL = 1e-6

# the lr × seed variants of a cell trained stacked (fastweights.lab.stack: vmap over stacked parameters, a
# vectorised AdamW) vs each trained alone by train_cell, float64 weights (absolute, also on the accuracies and the
# schedule's lrs): the same steps; the vmapped matmuls and the loss at gathered positions sum in another order,
# and the cross-entropy is fp32 in both (train_cell's logits.float()). Measured ≤ 1.8e-15 on the weights
# (DeltaNet, softmax attention, 1–6 steps, lr ≤ 1e-2); the lrs rounded to fp32 (a bug found by this bound) moved
# them by 3e-11 after one step and 1e-7 after six.
STACKED_F64 = 1e-12
STACKED_LOSS_REL = 1e-6  # the epoch losses (fp32 cross-entropy, relative; as GRAPH_EMULATED_LOSS_REL)
# StackedAdamW vs torch.optim.AdamW per variant, float64 (absolute, unit-scale weights, 5 steps): the same
# update in another association (the lr times the step's factor in float64 as AdamW's python floats).
STACKED_ADAMW_F64 = 1e-14

# ---------------------------------------------------------------- CUDA (tests/cuda, `pytest -m cuda`)
# the fp32 recurrent form on CUDA vs the float64 recurrence on the CPU, relative (outputs, final
# state, every gradient; T ≤ 300, D ≤ 128): T sequential fp32 state updates; the H100 run of
# scripts/gpu_check.py measured 2.7e-7 … 2.9e-6 at D = 64. (The chunk form on CUDA is held to
# CHUNK_F32_REL, as on the CPU: measured ≤ 1.8e-6 there; bf16 at T = 65,536 to CHUNK_LOW_REL,
# measured 2.2e-3 … 3.2e-3.)
RECURRENT_F32_REL = 1e-5
# CUDA-graphed training steps vs eager ones (tests/cuda/test_graph_train.py), fp32 without TF32,
# 14 AdamW steps at lr 3e-3 with a warm-up and clipping, on the weights' change from their
# initial values: ‖Δw_graphed − Δw_eager‖ / ‖Δw_eager‖ over all weights. The graphed step differs
# by rounding only (the capturable AdamW's bias corrections in fp32 on the device, the loss's
# reduction order); a norm, not a max, so that an element whose gradient is rounding noise (Adam
# divides it by its own scale) cannot fail it alone. The same comparison on the CPU (emulated,
# fp32) measured ≤ 3.0e-6 (RetNet, gated DeltaNet; at lr 1e-2 RetNet's training amplified rounding
# to 4.7e-3, hence the lower lr), while an lr one step off gave 0.48–0.58, no lr schedule 0.65,
# no clipping 0.08–0.19. Epoch losses relative.
GRAPH_CUDA_F32_UPDATE_REL = 1e-3
GRAPH_CUDA_F32_LOSS_REL = 1e-4
# the same in bf16 autocast (the sweep's dtype): bf16 rounding of the activations turns the fp32
# differences into bf16 ulps (≈ 4e-3); epoch losses relative.
GRAPH_CUDA_BF16_LOSS_REL = 2e-2

# ---------------------------------------------------------------- seam: stages, dispatch
STAGE_F64 = 1e-12  # one chunk stage against its direct definition, float64, relative to the largest magnitude
STAGE_F32_REL = 1e-6  # one chunk stage computed in fp32 against float64: a few fp32 roundings, relative
GROUPED_F64 = 1e-12  # grouped value heads in the op vs the same heads expanded by the caller, float64
MESA_CG_REL = 1e-6  # Mesa chunk form with a CG solve (cg_steps ≥ K) vs the exact solve, float64, relative
BOUNDED = 1e3  # stability checks: |outputs| and |states| of a stable recurrence from O(1) inputs stay below this
# stability checks: sums over the whole context (Σφ(k), KV cumulative gates) grow at most this much per token
GROWTH_PER_TOKEN = 10.0

# ---- documents (padding, packing), transformers, lm-eval, pretraining (tests/models/test_segments.py, tests/hf,
# tests/pretrain)
SEGMENTS_F64 = 1e-10  # a document in a padded / packed batch vs the document alone, float64 (max |Δlogit|)
# the capture-safe packing (max_documents: cu_seqlens padded with empty sequences) vs the exact one, float64: logits
# and gradients (rows of one document each run the varlen path instead of the batched one: other roundings)
MAX_DOCUMENTS_F64 = 1e-10
# the same packing on the Triton kernels (interpreter, fp32, max_documents) vs the torch rows' exact packing: fp32
# sums in other orders over a one-layer LM (max |Δ| of logits; of gradients relative to 1 + their largest)
MAX_DOCUMENTS_TRITON_F32 = 1e-4
# transformers' beam scores: it casts every step's logits to float32 (generation/utils.py) and sums the log-probs
# there; Σ of n ≤ 8 log-probs of |Σ| ≲ 30 against the float64 sum: a few float32 roundings of the running sum
BEAM_SCORE_F32 = 2e-5
CHECKPOINT_F64 = 1e-12  # gradients with per-block gradient checkpointing vs without: the same ops recomputed, float64
TRAINER_STEP_F64 = 1e-10  # weights after one Trainer SGD step, float64: accumulation 4 × 1 row vs 1 × 4 rows
TRAINER_LOSS_REL = 1e-6  # Trainer's reported training loss (kept in float32) vs the float64 loss, relative
HARNESS_LOGLIK_F64 = 1e-9  # lm-eval's summed log-likelihood of a continuation vs a direct computation, float64
DIST_TRAIN_F32 = 1e-5  # weights after a few steps: 2 ranks (DDP / FSDP2) vs 1 process with accumulation, fp32, relative

# ---------------------------------------------------------------- Triton kernels (tests/kernels)
# bf16/fp16 inputs into the Triton gated-linear chunk kernels, relative to the fp32 torch chunk
# form on the same rounded values (outputs, states, every gradient): beyond the inputs' rounding
# the kernels round every tensor-core operand to the input dtype — the decayed rows, A, and the
# fp32 states in Q̃S and dO·Sᵀ — and return o and the gradients in that dtype. Measured under the
# interpreter (T = 50, 12 draws): bf16 ≤ 1.6e-2, fp16 ≤ 7e-4; bounds with about 2.5× (bf16) and
# 5× (fp16) room.
TRITON_LOW_REL = {torch.bfloat16: 4e-2, torch.float16: 4e-3}
# bf16 inputs into the Triton delta-class chunk kernels, relative to the fp32 torch chunk form on
# the same rounded values (outputs, states, every gradient): as TRITON_LOW_REL, plus the per-chunk
# inverse T rounded to bf16 as a tensor-core operand and W, U', U stored in bf16. Measured under the
# interpreter (T = 40, K = V = 16, 12 draws over the three gates): ≤ 2.7e-2; bound with about 2.2× room. r4s18, 600
# draws of `delta_bf16_agrees` (T 33 chunk 16 and T 45 chunk 32, the three gates): ≤ 3.2e-2 (dk), 1.9× room.
TRITON_DELTA_LOW_REL = {torch.bfloat16: 6e-2}
# the Triton delta prologue (fused L2 norm, β, Mamba-style gate, its chunk cumsum) with fp32
# inputs vs float64, relative, outputs and every gradient: a few fp32 roundings per element, and
# the per-head sums of dA_log / d dt_bias over B·T·K_a terms in fp32. Measured under the interpreter
# (T = 65, 16 draws over both gates): ≤ 4.2e-7.
PROLOGUE_F32_REL = 1e-5
# dA_log and d dt_bias of the same, relative to the size of their summands (Σ |dg·g|, Σ |da| over B·T(·K_a); the
# test's `_summand_scales`), not to their own largest entry: the terms have random signs, |g| reaches e^{A_log}·25,
# and what is left after they cancel was up to 536× below their size — CI once drew dA_log at 1.05e-5 of itself
# (3.9e-8 of its summands). Measured under the interpreter (T = 37 and 65, 1,600 draws over both gates): ≤ 1.7e-7;
# with bf16 / fp16 inputs (the sums stay fp32; T = 37, 600 draws): ≤ 2.2e-7; bound with ≈ 5× room. A token's term
# left out is ≥ 1/(B·T·K_a) of the size, far above it.
PROLOGUE_SUM_F32_REL = 1e-6
# the same with bf16/fp16 q, k, b, a: q̂, k̂ and the gradients of q, k, b, a are rounded to the input
# dtype, and so is the incoming gradient of q̂, k̂ (bf16: 2⁻⁸ ≈ 3.9e-3 relative per rounding to nearest;
# Triton 3.6's interpreter converts fp32 → bf16 by truncation, up to 2⁻⁷). Measured under the
# interpreter (T = 65, 16 draws over both gates): bf16 ≤ 7.9e-3, fp16 ≤ 6.6e-4; bounds with ≈ 2.5× and 6× room.
PROLOGUE_LOW_REL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
# a MemoryMixer with its fused Triton paths (short conv, delta prologue, gated output norm) vs its
# torch ops, fp32, relative, outputs, states and every parameter gradient: the same maths with other
# fp32 rounding orders (measured under the interpreter, T = 9, 4 draws × 5 layers: ≤ 1.3e-6; bound with ≈ 15×
# room for longer sums).
FUSED_LAYER_F32_REL = 2e-5
# the Triton short conv (taps + bias + SiLU, its tail) with fp32 inputs vs its torch twin in float64,
# relative, y, the new tail and every gradient: W products summed in fp32, and dw / db summed over
# B·T terms in fp32. Measured under the interpreter (T = 3 and 65, 18 draws): ≤ 2.6e-7.
CONV_F32_REL = 1e-5
# the same with bf16/fp16 x and tail: y, dx and dtail rounded to that dtype, and so is the incoming
# gradient of y (the interpreter's fp32 → bf16 truncates: up to 2⁻⁷ each), and the backward's dpre
# scratch (x's dtype). Measured under the interpreter (T = 3 and 65, 12 draws): bf16 ≤ 1.5e-2 (1.3e-2
# with an fp32 scratch), fp16 ≤ 9.5e-4; bounds with ≈ 2× and 4× room.
CONV_LOW_REL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
# the Triton RoPE (layer/rope.py) with fp32 x vs its torch twin in fp32 (the same angles fp32(p)·θ), relative, y and
# dx: cos/sin to an ulp or two and one FMA order. Measured under the interpreter (8 draws × 2 shapes × 2 periods,
# positions ≤ 317): ≤ 1.3e-7.
ROPE_F32_REL = 2e-6
# ... vs the twin in float64: the fp32 angle p·θ rounds to ≈ p·2⁻²⁴ rad. Measured as above: ≤ 1.5e-6.
ROPE_F64_REL = 2e-5
# a mixer with RoPE on the Triton row vs its torch layer ops, fp32, outputs and every parameter gradient (the rest of
# the layer the same ops: the rotation's ulps carried through attention or retention and the projections)
ROPE_LAYER_F32_REL = 2e-5
# bf16 / fp16 x vs the fp32 twin on the same rounded values: y and dx rounded to x's dtype (the interpreter's
# fp32 → bf16 truncates: up to 2⁻⁷). Measured as above: bf16 ≤ 1.03e-2, fp16 ≤ 7.9e-4; bounds with ≈ 2.5× room.
ROPE_LOW_REL = {torch.bfloat16: 2.5e-2, torch.float16: 2e-3}
# the Triton gated RMSNorm with fp32 inputs vs its torch twin in float64, relative, y and every
# gradient: a G-term fp32 sum of squares per row, dw summed over the rows in fp32. Measured under the
# interpreter (T = 9, 24 draws over orders, gates and groups): ≤ 2.5e-7.
NORM_F32_REL = 1e-5
# the same with bf16/fp16 o, z: y, do, dz rounded to that dtype, and so is the incoming gradient of y
# (the interpreter's fp32 → bf16 truncates: up to 2⁻⁷ each). Measured under the interpreter (T = 9, 24
# draws): bf16 ≤ 7.9e-3, fp16 ≤ 7.6e-4; bounds with ≈ 2.5× and 5× room.
NORM_LOW_REL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
# Muon's Newton–Schulz on Gram matrices, the Triton kernel (fp32) vs the torch iteration in float64,
# relative per matrix, P and dG: 5 fp32 iterations of a degree-5 polynomial amplify rounding where
# X Xᵀ is ill-conditioned. Measured over 30 seeds × r ∈ {8, 20, 32, 64} with 1 … 2r columns and
# scales 1e-3 … 1e2: kernel ≤ 5.6e-4 (P) and ≤ 7.0e-4 (dG); the torch iteration in fp32 itself
# ≤ 8.0e-4 and ≤ 4.9e-4 — the bound is that error level, with room.
NS_F32_REL = 4e-3
# ATLAS's chunk form through the Triton row (its Newton–Schulz in the kernel), fp32, vs the torch
# row in float64, absolute over (1 + max |·|), output and every input gradient (B 2, T 40, H 2,
# K 4): measured over 10 seeds ≤ 4.7e-6 (output) and ≤ 1.0e-4 (gradients); the torch row in fp32
# ≤ 4.3e-6 and ≤ 1.5e-4.
ATLAS_ROW_F32 = 1e-3

# a MemoryMixer in bf16 on the GPU with its fused layer kernels vs its torch ops (same memory backend):
# the two round to bf16 at different points (fp32 inside each fused kernel), so outputs and parameter
# gradients differ by a few bf16 roundings (2⁻⁸ each) relative to their largest entry
FUSED_LAYER_BF16_REL = 3e-2
# a MemoryMixer's projections of x as one matmul (`MemoryMixer._project`) vs separate Linears: float64,
# relative — the same products summed in another blocking order (measured ≤ 5e-15 over 9 models)
JOINT_PROJ_F64_REL = 1e-12
# the same under CPU bf16 autocast, outputs, dx and every parameter gradient, relative to the largest
# entry: both round x and the weights to bf16 identically, but the matmuls round their bf16 results at
# other points (dx: one rounding of the joint matmul against six rounded parts summed) and a flipped
# bf16 ulp (2⁻⁸) propagates through the layer (measured ≤ 7.3e-3 over 9 models)
JOINT_PROJ_BF16_REL = 2e-2

# fastweights.stability: a state within the step bound never grows; float64 rounding over ~50 steps
STEP_BOUND_NORM_F64 = 1e-9

# ---------------------------------------------------------------- conversions (tests/convert)
# a fastweights layer converted from a transformers layer (Qwen3-Next, Kimi-Linear, Mamba2) vs that
# layer, relative to the output's largest entry: their torch paths compute in fp32 whatever the input
# dtype (no float64 comparison possible), with other summation orders (chunk sizes, the conv as
# F.conv1d, l2norm as x/√ vs x·rsqrt); measured ≤ 6e-7 at T = 37 over the three layers
CONVERT_LAYER_F32_REL = 1e-5
# a tiny Qwen3-Next model's logits with its linear-attention layers swapped for converted fastweights
# layers vs the model itself, fp32, relative: the layer's rounding passes through the later blocks (MoE routing,
# attention). Measured over seeds 0–59 on transformers 5.17.0 and 5.24.0 alike (2026-11-25): median 2.9e-6,
# 90th percentile 9.1e-6, max 1.88e-5 — 4 of 60 over the 1e-5 it had (CI, seed 5661331957293657937: 1.29e-5).
# r4s18, seeds 0–1,999 on transformers 5.24.0: median 4.3e-6, 90th percentile 1.1e-5, max 1.53e-4 (seed 1175); the
# 5e-5 this had was exceeded by at least 5 of them (≥ 0.25 % of runs; a margin census drew 2.7e-5). The error is the
# fp32 rounding of the swapped layers carried through three more blocks, with a long tail; bound with ≈ 3× room over
# 2,000 seeds. What the model test catches is the wiring: one swapped layer's output projection × 1.01 or its
# A_log + 0.05 moved the logits by 3.0e-2 and 3.2e-2, two layers traded by 1.55 (seed 3); the layers' own rounding is
# held to CONVERT_LAYER_F32_REL by the layer tests.
CONVERT_MODEL_F32_REL = 5e-4
# a whole transformers Mamba2ForCausalLM converted to a fastweights LM (or back), float64 weights, relative:
# transformers' Mamba2 computes its RMSNorms and its scan in fp32 and returns fp32 logits whatever the
# model's dtype, so there is no float64 reference; fp32 rounding through 2 blocks, measured ≤ 2.8e-7 over
# 12 seeds × 4 models each way (d 32, T ≤ 23, transformers 5.17.0 and 5.24.0, 2026-11-27). A field read
# wrongly (the norms' eps, the dt clamp) is off by O(0.1 – 1).
CONVERT_MAMBA2_LM_REL = 2e-6

# fastweights train --grad-checkpoint / --init-from (tests/pretrain/test_run_options.py)
GRAD_CKPT_RUN_F32_RTOL = 1e-5  # weights after 2 fp32 steps, checkpointed blocks vs not (rtol, atol)
GRAD_CKPT_RUN_F32_ATOL = 1e-6
GRAD_CKPT_RUN_LOSS_REL = 1e-6  # the logged fp32 losses of those two runs, relative
GRAD_CKPT_F64_LOSS_REL = 1e-12  # one float64 step: the loss, relative
GRAD_CKPT_F64_GRAD_RTOL = 1e-10  # its gradients (rtol, atol)
GRAD_CKPT_F64_GRAD_ATOL = 1e-12
INIT_FROM_STEP_ABS = 1e-7  # weights after one AdamW step of lr 1e-9 vs the checkpoint's (AdamW moves each ≤ ~1e-9)
# Comba with the state wiped (g = −100 on some tokens), fp32 Triton (interpreter) vs the float64 recurrence: every
# gradient relative to its largest. Measured over 99 draws (33 input seeds × 3 projections, 2026-11-25): max
# 1.44e-5 (dq, dg, dp), 7 draws above 1e-5 — so CHUNK_F32_REL (1e-5) failed about one run in fifteen (CI, seed
# 421076283997812423)
COMBA_WIPE_F32_REL = 5e-5

#: Muon's mini-batch chunk form (ATLAS) under bf16 autocast against fp32, relative L2 of the output: its Gram
#: matrices and Newton–Schulz run in fp32, the rest in bf16 through a depth-2 MLP memory (measured 0.055–0.069).
MUON_BF16_AUTOCAST_REL = 0.15

#: The floor of a kernel's log-decay gradient dg's tolerance (tests/kernels/helpers.check; bf16 tolerances, above
#: it, are unchanged). dg sums products of the other gradients and inputs over the head dims (q·dq − k·dk, S·dS), and
#: they cancel, so in fp32 its relative rounding is the others' times the cancellation, with a heavy tail. Measured
#: against float64 under the interpreter: the gated class at extreme decay (g_scale 40) median 3.5e-6 and max 1.8e-5
#: over 80 draws (at CHUNK_F32_REL = 1e-5 that test failed about one draw in ten); DeltaProduct at T = 1 max 6.8e-6
#: over 40 draws and 1.43e-5 once in CI. Every other gradient stayed ≤ 2.1e-6.
LOG_DECAY_GRAD_F32_REL = 1e-4
CONTEXT_PARALLEL_F64_REL = 1e-10  # context-parallel spans vs one process (outputs, states, gradients), float64
# a LoRA-adapted model's logits vs the merged model's (merge_and_unload), and a hooked projection vs
# the same maths in its weights, float64, relative to the largest logit: W x + s·B A x against
# (W + s·B A) x sums the same products in another order (a few ulps).
LORA_MERGED_F64_REL = 1e-10
# a swapped Qwen3-Next's logits on CUDA (Triton's fp32 dots with TF32 operands) vs the original's, relative
SWAP_CUDA_TF32_REL = 2e-2
# bf16 q, k, v into TTT-Linear's kernels (kernels/triton/memories/ttt.py; β, the LayerNorm's affine and the state fp32)
# against the float64 torch twin on the same rounded values, relative (outputs, final state, every gradient):
# the kernels compute in fp32 and round o, dq, dk, dv to bf16 (the interpreter's fp32 → bf16 truncates: up to
# 2⁻⁷ each); fp16 keeps 11 bits. Measured under the interpreter (T = 37, offset 5, D = 16): bf16 ≤ 5.2e-3 over 12
# draws, fp16 ≤ 6.1e-4 over 8; bounds with ≈ 3× room. (The fp32 kernels against float64, held to CHUNK_F32_REL:
# ≤ 1.04e-6 over 72 draws of the file's cases.) TTT-MLP's kernels (kernels/triton/memories/ttt_mlp.py, the same
# inputs, F = 64) measured the same: bf16 ≤ 5.5e-3 over 10 draws, fp16 ≤ 5.5e-4 over 8.
TTT_LOW_REL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# The CG kernel at tl.dot "tf32" (the row's precision for bf16 q, k, v: limits.mesa_cg_precision) on fp32 systems,
# x against the float64 exact solve, as a fraction of how far the float64 solve itself moves when its inputs are
# rounded to bf16 (the error a bf16 call carries before any solve). Measured under the interpreter (TF32 emulated by
# operand rounding, C = 64, K = 64, 3 draws): tf32 1.0–2.0e-4 against bf16 inputs' 3.3–4.3e-3 (≤ 0.05 of it); ieee
# 2–3e-7; TF32 by truncation (what a tensor core handed raw fp32 bits may do) 2.1–2.7e-4, ≤ 0.07. Bound: ≈ 4× room.
MESA_CG_TF32_OF_BF16 = 0.25
# bf16 q, k, v through the row (tf32 solves) against the float64 exact solve: o, final states, every gradient, each
# relative — the bf16 inputs' and outputs' own rounding dominates. Measured under the interpreter (T 150/130, K 32/128,
# 5 draws): ≤ 5.0e-3, the same as the torch row's fp32 CG on the same inputs (its max over the quantities ≤ 5.04e-3;
# the row's max / the torch row's max ≤ 1.0, per quantity ≤ 1.6 on dH0). Bounds: ≈ 3× room, and the row's largest
# error within MESA_CG_TF32_ROW_RATIO of the torch row's. (1.25 until a CI draw of round 4's tenth session, T 150,
# K 32: the row's largest error 4.87e-3, on o, against the torch row's 3.53e-3 — a ratio of 1.38, both under a third
# of MESA_CG_TF32_BF16_REL; 12 more draws on the CPU ≤ 1.25. Now the per-quantity ratio measured above, 1.6.)
MESA_CG_TF32_BF16_REL = 1.5e-2
MESA_CG_TF32_ROW_RATIO = 1.6

# the training loop and its CUDA graph (tests/training, tests/cuda/test_graphed_step.py)
WEIGHTS_MOVED = 1e-3  # a weight that "moved" after a few AdamW steps differs from its start by more than this
GRAPHED_LM_F32_REL = 2e-4  # an LM's steps replayed from a CUDA graph vs eager, fp32 (kernels' reduction orders)
GRAPHED_LM_BF16_REL = 5e-2  # the same under bf16 autocast: bf16 noise over a few steps
# the last step's gradients, graphed vs eager, fp32: ≤ 1.75e-4 (max |Δ| / max |g| over the parameters) in 12 runs of
# gated DeltaNet, packed and not (H200, r4s8 call 4). In bf16 they differ by 0.05–0.21 packed or not (weights ≤ 3.6e-2):
# bf16 noise in a gradient, not compared.
GRAPHED_LM_F32_GRAD_REL = 1e-3
LOG_SPACED = 1e-3  # an lr grid's consecutive log-ratios equal to this (lab/protocol's LR_GRID, 3 significant digits)
# a TTT-Linear layer with its memory on the Triton kernels vs the same layer on the torch row, both fp32, relative,
# output and every parameter gradient (two fp32 roundings of a LayerNorm-inside recurrence; measured under the
# interpreter, T = 19, D = 16: max 1.08e-5 over 26 draws (q_proj's gradient), 99th percentile 1.9e-6)
TTT_LAYER_F32_REL = 3e-5
GRAPH_RUN_F32_RTOL = 1e-5  # weights after 3 fp32 steps, `train --cuda-graph`'s step body (eager on the CPU) vs the
GRAPH_RUN_F32_ATOL = 1e-6  # plain loop (the loss summed per micro-batch then divided, vs divided per micro-batch)
GRAPH_RUN_LOSS_REL = 1e-6  # the logged fp32 losses of those two runs, relative
# `train --cuda-graph` vs eager in fp32 on CUDA, weights after 8 AdamW steps (tests/cuda/test_train.py): the two runs
# differ only by the loss's summation order (the graph sums the step's supervised tokens, then divides); each is
# bitwise run-to-run deterministic (H200, r4s14 call 3: eager vs eager and graph vs graph equal). Measured eager vs
# graph: max abs 5.9e-7 in one pair, 1.98e-6 in another (one of embed's 20,480 values; GRAPH_RUN_F32_ATOL's 1e-6,
# set for 3 CPU steps, failed there) — 5× the largest seen; a wrong gradient moves an AdamW weight by about the
# lr a step (≈ 1e-3 here: lr 3e-3, cosine over 8 steps).
GRAPH_RUN_CUDA_F32_ATOL = 1e-5
GRAPH_RUN_CUDA_BF16_REL = 2e-2  # `train --cuda-graph` vs eager in bf16 on CUDA: losses and weights after 8 steps
# the mini-batch form's memory (tests/chunkwise/test_minibatch.py): bytes autograd keeps, as a multiple of what must be
# kept. Muon (ATLAS, B 1, T 32, H 1, K 32): ≤ 2 × (one Newton–Schulz polynomial a token + each segment's start weights
# and momentum) — 1.5× measured, 4.5× before its Gram checkpoint and unstacked readout. `checkpoint_chain(4)` (Titans,
# T 256): the kept bytes (saved tensors + the blocks' start states) ≤ half the unchained form's (0.04–0.1× measured).
MUON_SAVED_OVER_NEEDED = 2.0
# ATLAS's fwd+bwd peak, per token (the slope from T 64 to 128, K 16): ≤ 1.1 × the saved tensors' slope — 1.03×
# measured with each segment read right after its step, 1.23× with the readout after the loop (the gradients of every
# segment's Newton–Schulz polynomials alive at once).
MUON_PEAK_OVER_SAVED_SLOPE = 1.1
CHAIN_KEPT_OVER_UNCHAINED = 0.5
# bf16 q, k, v into Titans' kernels (kernels/triton/memories/titans.py; the gates and the state fp32) against the
# float64 torch twin on the same rounded values, relative (output, final weights, momentum, anchor, every gradient):
# the kernels compute in fp32 and round o, dq, dk, dv to bf16 (the interpreter's fp32 → bf16 truncates: up to 2⁻⁷).
# Measured under the interpreter (T = 37, offset 5, K = V = 16): bf16 outputs ≤ 6.4e-3 over 10 draws, outputs and
# gradients ≤ 5.9e-3 over 8; fp16 (11 bits) outputs and gradients ≤ 1.0e-3 over 8; bounds with ≈ 3× room. (The fp32
# kernels against float64, held to CHUNK_F32_REL: ≤ 2.8e-6 over 8 draws at T = 41, offset 5, grouped heads.)
TITANS_LOW_REL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# a Titans layer with its memory on the Triton kernels vs the same layer on the torch row, both fp32, relative,
# output and every parameter gradient (measured under the interpreter, T = 19, K = V = 16: max 1.43e-5 over 30 draws
# (nu's projection bias: a sum over every token's momentum decay), the rest ≤ 8.7e-6), with TTT_LAYER_F32_REL's room
TITANS_LAYER_F32_REL = 4e-5
# `bench floors`' FLOP count of a step (forward + backward) at 2T against 2× at T, relative: the mini-batch forms'
# forwards are exactly linear in T, their backwards carry a few terms per sequence (the final state's gradient), 0.4–2 %
# above linear at T 64 → 128 (measured, r4s11); the default counts at full T, count_len's scaling is an estimate
FLOOR_T_SCALING_REL = 0.025
# one fp32 → bf16 rounding of the same fp32 values by two routes, relative (max |a − b| / max |b|): the GPU and torch
# round to nearest (≤ 2⁻⁹ of an element apart: equal on the GPU), Triton 3.6's interpreter truncates (one ulp, ≤ 2⁻⁷
# of an element). TTT-Linear's DIRECT backward (dq, dv cast in the kernels) against the glue's casts.
BF16_CAST_REL = 2 ** -7


# ---------------------------------------------------------------- a margin census (not a CI setting)
# FASTWEIGHTS_TOL_MARGIN=m divides every tolerance above named with F32, LOW, BF16 or _REL but not F64 (a float, or a
# dict of floats) by m: a run under it fails each test whose error reached 1/m of its bound on the draw it made — the
# tests with little room, where a fresh random draw is likeliest to fail CI one day (`docs/results/flake_hunt_r4s18/`).
# A few constants so named are not upper bounds of an error (FLOOR_T_SCALING_REL, a ratio of costs; the Mesa TF32
# ratios MESA_CG_TF32_*; GREEDY_TIE_REL, what counts as a tie): their tests' failures under the census say nothing.
def _margin_census(m: float) -> None:
    for name, value in list(globals().items()):
        if not re.search(r"F32|LOW|BF16|_REL", name) or "F64" in name:
            continue
        if isinstance(value, float):
            globals()[name] = value / m
        elif isinstance(value, dict) and all(isinstance(v, float) for v in value.values()):
            globals()[name] = {k: v / m for k, v in value.items()}


if os.environ.get("FASTWEIGHTS_TOL_MARGIN"):
    _margin_census(float(os.environ["FASTWEIGHTS_TOL_MARGIN"]))
