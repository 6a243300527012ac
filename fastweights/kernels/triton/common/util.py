"""Small @triton.jit helpers shared by the stage kernels, and launch helpers."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from . import interpreter  # (the interpreter's shims, applied before any kernel runs)
from .layout import Layout


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
    return DT, (2 if interpreter.interpreting() else 0)


def pow2(n: int, floor: int = 16) -> int:
    """The tile size covering n (≥ 16: tl.dot's smallest)."""
    return max(floor, triton.next_power_of_2(n))


def row_view(x: torch.Tensor, lead: int) -> torch.Tensor:
    """x itself when a kernel can read it in place as rows: its first `lead` dims step whole rows of one stride
    (x.stride(lead − 1)) and the rest is one contiguous block (e.g. a column view [B, T, C] of a wider [B, T, N]
    projection); else a contiguous copy. Size-1 dims' strides are not looked at."""
    if x.is_contiguous():
        return x
    if x.numel() == 0 or x.dim() <= lead:
        return x.contiguous()
    block = 1
    for j in range(x.dim() - 1, lead - 1, -1):  # the trailing block: contiguous
        if x.shape[j] > 1 and x.stride(j) != block:
            return x.contiguous()
        block *= x.shape[j]
    step = x.stride(lead - 1)  # the row stride
    for i in range(lead - 2, -1, -1):  # the leading dims: whole numbers of rows, contiguously
        step *= x.shape[i + 1]
        if x.shape[i] > 1 and x.stride(i) != step:
            return x.contiguous()
    return x


def varlen_args(L: Layout, device):
    """(cu, chunk_seq, chunk_local, offsets) pointers, placeholders without varlen."""
    if L.varlen:
        return L.cu, L.chunk_seq, L.chunk_local, L.offsets
    d = torch.empty(1, dtype=torch.int32, device=device)  # never read without varlen: no fill kernel launched
    return d, d, d, d


#: Launch settings of every kernel launch site, by a stable stage name, pinned (no autotuning: on
#: Triton 3.6 + Hopper each config must be checked against the reference, see docs/kernels.md;
#: `scripts/gpu_kernels.py --stages sweep-kernels` checks and times each kernel's candidates alone).
#: num_warps / num_stages go to the launch; the upper-case keys are the tile constexprs the wrapper
#: takes from here (pure launch choices, any power of two ≥ 16 that the wrapper's rule allows):
#: BV the value columns per program (delta_states_*: capped at 32 for K > 128, register room for the
#: [K, BV] fp32 state tile), BC / BC_DIAG the query rows per qk_grads program without / with
#: diagonal decay. 4 warps × 2 stages everywhere: checked and timed on the H100 against 8 warps
#: globally, which was slower for every gate (docs/kernel_notes.md).
LAUNCH: dict[str, dict] = {
    # forward, in pipeline order
    "prologue": dict(num_warps=4, num_stages=2),  # prologue._prologue_kernel (forward and backward)
    "cumsum": dict(num_warps=4, num_stages=2),  # cumsum._cumsum_kernel (forward G, backward reverse dg)
    "scores": dict(num_warps=4, num_stages=2),  # scores._scores_kernel (Aqk, and the delta class's P)
    "inverse": dict(num_warps=4, num_stages=2),  # delta_inverse._inverse_kernel
    "wy_fwd": dict(num_warps=4, num_stages=2),  # delta_wy._wy_fwd_kernel (forward, backward's recompute of W)
    "delta_states_fwd": dict(num_warps=4, num_stages=2, BV=64),  # delta_states._delta_states_fwd_kernel
    "states_fwd": dict(num_warps=4, num_stages=2, BV=64),  # states._states_fwd_kernel (gated class)
    "output_fwd": dict(num_warps=4, num_stages=2, BV=64),  # output._output_fwd_kernel
    # the delta class's fused forward (delta_fused.py): PROGRAMS, the sequential grid's target (BV halves,
    # down to 16, until B·H·⌈V/BV⌉ — H·⌈V/BV⌉ with varlen — reaches it; 132 = the H100's SMs; the NS·H rows of a
    # graphed packing instead: +1.3 %, within spread, r4s9 — not taken)
    # AQK 1: the pre-pass computes Aqk (no/scalar decay) and the sequential kernel reads it; 0: recomputed there
    # WU 1: the pre-pass writes W and U' for the sequential kernel; 0 (no/scalar decay, K ≤ 128): it writes only T
    # and delta_fused_bwd._states_kernel computes U = T diag(β)(V − Γ K S) in the loop ("delta_fused_fwd_t")
    # RAW_KV 1 (no/scalar decay): W = (T diag(β e^G)) K, U' = (T diag(β)) V, k and v to the tensor cores as stored;
    # INV_TF32 1: the inverse's doubling products at one TF32 product (16-bit inputs; 0: tf32x3, fp32-accurate)
    # INV 1: the inverse by 2×2 block recursion on the [C, C] tile (masked products only, no [NB, 16, 16] reshapes:
    # `delta_fused._unit_lower_inverse_rec`); 2: the 16×16 blocks by that recursion as batched [NB, 16, 16] products,
    # then the doubling products; 0: the 16×16 blocks by forward substitution, then the doubling products.
    # INV 2 the default since r4s15 call 1 (H200, bf16; BENCHMARKS §1x/§1y): the pre-pass alone 0.576–0.651 → 0.456 ms
    # at B 4, T 4096, H 16, D 128 and 0.247–0.269 → 0.215 at the preset's 8×2048×6; on ill-conditioned chunks (β near 2,
    # keys within 0.1 of one direction) its fp32 forward error 8.6e-6 against substitution's 1.26e-5, bf16 the same
    # 2.0e-3; the preset LM's graphed step 41.5 → 41.1 ms (8×2048) and 44.7 → 44.3 (4×4096), within spread.
    # delta_fused._prepass_kernel
    "delta_prepass": dict(num_warps=4, num_stages=2, AQK=0, WU=1, RAW_KV=0, INV_TF32=0, INV=2),
    # delta_fused._fused_fwd_kernel; delta_fused_bwd._states_kernel, o
    # RAW_QK 1 (no/scalar decay): q and k reach the tensor cores as stored, the scale and decays applied to the [C, C]
    # and [C, BV] sides (o = diag(scale e^{G}) Q S + A U, S += Kᵀ diag(e^{G_last − G}) U); 0: Q̃, K̃ formed in fp32.
    # H200, r4s10 call 2, gated DeltaNet bf16, fwd / fwd+bwd ms: 8×2048×6 0.478 / 1.295 → 0.464 / 1.206, 1×16384×6
    # 1.267 / 3.316 → 1.162 / 3.118
    "delta_fused_fwd": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132, RAW_QK=1),
    "delta_fused_fwd_t": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132),
    # the split forward (delta_split.py; issue 32, untimed): its states pass (delta_fused_bwd._states_kernel, h and U
    # only; BV, PROGRAMS as delta_fused_fwd's) and its chunk-parallel output kernel (BV: one V block at V ≤ 128, so
    # Q Kᵀ is formed once a chunk; BK the K tile of its loop). ON 1: the split forward wherever the rule would run the
    # fused one (`pipelines.delta_pipeline(split=True)`, read by delta.py's and rows.py's callers): the switch that lets
    # an LM (`fastweights bench train --launch`) run it; 0 (default): only a `DeltaPipeline(forward="split")` asks
    "delta_split_states": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132),
    "delta_split_out": dict(num_warps=8, num_stages=2, BV=128, BK=64, ON=0),  # delta_split._output_kernel
    # the gated-linear class's fused pipeline (gated_fused.py): BV / PROGRAMS of both sequential kernels as for
    # delta_fused_fwd but halving only down to MIN_BV (32: BV 16 is the regime of the H100's faults, see
    # gated_fused.value_block), WARPS_DIAG the forward's warps with the diagonal decay (GLA), AQK 1: the scores A
    # once per chunk by gated_fused._scores_kernel, read by the forward (0: recomputed there per V block),
    # PREFETCH 1: the forward loads chunk c+1's β while it works on chunk c (0: β loaded where it is used, a
    # global-memory round trip in every chunk's dependency chain); the chunk kernel holds a whole chunk's dq, dk
    # accumulators (8 warps) and loops over BV tiles
    "gated_fused_fwd": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132, MIN_BV=32, WARPS_DIAG=8, AQK=0,
                            PREFETCH=1),  # gated_fused._fwd_kernel
    "gated_fused_scores": dict(num_warps=4, num_stages=1),  # gated_fused._scores_kernel (AQK = 1 only)
    "gated_fused_bwd_states": dict(num_warps=4, num_stages=2),  # gated_fused._bwd_states_kernel
    "gated_fused_bwd_chunk": dict(num_warps=8, num_stages=1, BV=64),  # gated_fused._bwd_chunk_kernel
    # backward
    "output_bwd": dict(num_warps=4, num_stages=2),  # output._output_bwd_kernel (gated class)
    "delta_output_bwd": dict(num_warps=4, num_stages=2),  # delta_output._local_bwd_kernel
    "delta_states_bwd": dict(num_warps=4, num_stages=2, BV=64),  # delta_states._delta_states_bwd_kernel
    "states_bwd": dict(num_warps=4, num_stages=2, BV=64),  # states._states_bwd_kernel (gated class)
    "qk_grads": dict(num_warps=4, num_stages=2, BC=32, BC_DIAG=16),  # qk_grads._qk_grads_kernel
    "wy_bwd": dict(num_warps=4, num_stages=2),  # delta_wy._wy_bwd_kernel
    "delta_grads": dict(num_warps=4, num_stages=2),  # delta_grads._sum_kernel
    # the delta class's fused backward (delta_fused_bwd.py; BV, PROGRAMS as delta_fused_fwd's):
    "delta_fused_rec": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132),  # _states_kernel: h, U
    # AQK 1: the recompute writes Aqk (each chunk's once) and the reverse kernel reads it; 0: recomputed per V block
    "delta_fused_rev": dict(num_warps=4, num_stages=2, BV=64, PROGRAMS=132, AQK=0),  # _reverse_kernel
    # ROWSUMS 1: no Q Kᵀ, K Qᵀ, K Kᵀ products (dG's and dβ's rowsums against dq's and dk's own products; 13 → 11
    # products a chunk with the gate); 0 until timed on a GPU (issue 32)
    "delta_fused_grads": dict(num_warps=8, num_stages=2, BV=64, ROWSUMS=0),  # _grads_kernel (BV: its V loops' tile)
    # ON 1: the gradient kernel with each chunk's C rows split over C / BR programs (_grads_rows_kernel: the same
    # products, BR rows each, no product recomputed; dg finished by chunk_cumsum from its dG rows and ∂L/∂G_last
    # parts); 0: _grads_kernel, one program a chunk (the default until timed on a GPU: issue 32, docs/kernel_notes.md
    # "The gradient kernel's rows over programs"); BV as delta_fused_grads'; MAXNREG > 0: ptxas's register cap
    # (Triton's `maxnreg`: 65,536 / (MAXNREG · 32 · num_warps) programs fit an SM by registers; 0: none)
    "delta_fused_grads_rows": dict(num_warps=4, num_stages=1, ON=0, BR=16, BV=64, MAXNREG=0),  # _grads_rows_kernel
    # the deep memories' loop kernels (memories/ttt.py, memories/ttt_mlp.py): one program per (sequence, head);
    # num_stages 1 (ttt_mlp's loops re-read a scratch behind a barrier: no software pipelining)
    # (TTT-Linear at 8 warps: its [D, D] weight's registers; 2.7× faster than 4 at tf32x3, H200, BENCHMARKS §1m)
    # TTT-Linear's forward: the sequential state pass (one program per sequence and head) and the parallel readout
    # (one per mini-batch and head; BK: the rows of the anchor A read at a time for x A and k A, ≤ D's tile; 2 stages:
    # the next block's loads in flight; sm_90, D 128: 255 registers and no spill at BK 32, spills from BK 64 on)
    "ttt_linear_fwd": dict(num_warps=8, num_stages=1),  # memories.ttt._state_kernel
    "ttt_linear_readout": dict(num_warps=4, num_stages=2, BK=32),  # memories.ttt._readout_kernel
    # TTT-Linear's backward: the parallel pre-pass (the readout's own gradients; BK as the readout's) and the reverse
    # sequential pass (CARRY 1: `_bwd_carry_kernel`, the anchor's gradient carried in registers instead of read and
    # written in place in dA0 each mini-batch; DIRECT 1: do read, dq and dv written in the inputs' dtypes by the
    # kernels, no fp32 copies and casts in the glue; both the default since r4s15 call 3 — H200, bf16, B 4, T 4096,
    # H 16, D 128 fwd+bwd 9.45 ms (both 0) → 8.58 (CARRY) → 8.55 (both); docs/kernel_notes.md "TTT-Linear's
    # backward"). POST 1: the chain-only reverse pass (`_bwd_chain_kernel`: per mini-batch k G, xᵀ dz, kᵀ df — 3
    # products, not 6 — and no anchor read; f = k A + a from the pre-pass, `_bwd_read_f_kernel`), each mini-batch's b·G
    # (fp32) and df stored for `_bwd_post_kernel` (grid (slots, H), BK its column block), which adds dk's −(η e) Gᵀ
    # and df Aᵀ in parallel; POST 2 the same with b·G in bf16 for bf16 inputs — the default since r4s16 call 5 (H200,
    # bf16, B 4, T 4096, H 16, D 128 fwd+bwd 8.19 ms (POST 0) → 7.76 (1) → 7.44 (2), every variant within the
    # default's errors of float64; + 0.75 GiB of transient scratch at that shape, 1.25 with fp32 inputs). The sliced
    # reverse pass (a CUDA graph's, B·H ≤ MAX_BH) takes no POST (docs/kernel_notes.md "TTT-Linear's chunk-parallel
    # backward", BENCHMARKS §1z)
    "ttt_linear_bwd_read": dict(num_warps=4, num_stages=2, BK=32),  # memories.ttt._bwd_read_kernel
    "ttt_linear_bwd": dict(num_warps=8, num_stages=1, CARRY=1, DIRECT=1, POST=2),  # memories.ttt._bwd_kernel (…)
    "ttt_linear_bwd_post": dict(num_warps=4, num_stages=2, BK=32),  # memories.ttt._bwd_post_kernel (POST ≥ 1)
    # TTT-Linear's sequential passes with the value columns of W [K, V] sliced over NP programs a (sequence, head),
    # one launch a mini-batch each way, the LayerNorm's per-row sums over V exchanged through a small buffer
    # (memories/ttt_linear_sliced.py; the parallel readout and pre-pass unchanged). ON 0 off, 1 on, 2 on
    # where sequences × heads ≤ MAX_BH (`kernels.variants.ttt_linear`, the rule TTT-MLP's and Titans' sliced kernels
    # take). Eager it loses: H200, bf16, B 4, T 4096, H 16, D 128 (64 programs), fwd / fwd+bwd ms (r4s14 call 5)
    # one program 2.54 / 9.46, NP 4 11.58 / 28.02, NP 2 at 8 warps 15.14 / 30.57 — TTT-Linear's chain a mini-batch is
    # two [D, D] products (TTT-MLP's and Titans' are tens), so 257 launches a way and the exchanges cost more than the
    # shorter chain saves. NP: at most NP slices, each ≥ 16 columns (`ttt_linear_sliced.slices`); BWD 1: with ON, the
    # reverse pass sliced too (0: ttt_linear_bwd's kernel reads the same anchors); SYNC 1: each pass one persistent
    # launch (`_step_sync_kernel`, `_chain_sync_kernel`), the NP programs of a head meeting at a global-memory count
    # each mini-batch instead of 257 launches — GPU only (the interpreter runs programs one at a time): its 12 cuda
    # tests (float64 twin, NP 2/4/8, up to the LM shape) passed on the H200 in r4s15 call 1, untimed there; 0 until
    # timed (scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear; docs/kernel_notes.md "TTT-Linear sliced").
    # ON 3 (the default since r4s15 call 1): sliced where sequences × heads ≤ MAX_BH and the call is being captured
    # into a CUDA graph (`util.capturing`), whose replays pay no Python launch: the LM (d 1024, 8 layers, 8 heads of
    # 128, 4×4096, bf16, graphed; 32 programs one way) stepped in 88.2 ms sliced NP 4 against 99.9 one program (peak
    # 12.53 against 11.79 GiB). MAX_BH 32: the grid measured; 64 (the op's H 16) not measured in a graph.
    "ttt_linear_sliced": dict(num_warps=4, num_stages=1, ON=3, MAX_BH=32, NP=4, BWD=1, SYNC=0),  # …_step_kernel
    "ttt_linear_sliced_bwd": dict(num_warps=4, num_stages=1),  # memories.ttt_linear_sliced._chain_kernel
    # TTT-MLP at 8 warps (H200, BENCHMARKS §1p): at tf32 (bf16 inputs) B 4, T 4096, H 16, D 128 fwd+bwd 309 → 266 ms,
    # B 64, T 512, H 2, D 64 8.41 → 8.35; at ieee (fp32/fp16) 13.95 → 13.47 ms; sm_90 spills fall (D 64 bwd 1,564 →
    # 1,024 B, fwd 304 → 108 B)
    "ttt_mlp_fwd": dict(num_warps=8, num_stages=1),  # memories.ttt_mlp._fwd_kernel
    "ttt_mlp_bwd": dict(num_warps=8, num_stages=1),  # memories.ttt_mlp._bwd_kernel
    # TTT-MLP's forward with the hidden width sliced over NP programs a (sequence, head), one launch a mini-batch,
    # and a parallel read (memories/ttt_mlp_sliced.py). ON 0 off, 1 on, 2 (the default) on when the one-program
    # kernels' grid — sequences × heads — is at most MAX_BH programs (`ttt_mlp.sliced_on`; a fact of the call's
    # shape, never of T or the data). H200, bf16, fwd+bwd ms, one-program → NP 8 at 4 warps (r4s12 call 5, r4s13
    # call 1): B 4 H 8 D 128 (32 programs) 247.7 → 79.3; B 4 H 16 D 128 (64) 266.8 → 142.2 (NP 4: 138.1);
    # B 64 H 2 D 64 (128) 8.67 → 9.78 (the grid already fills the 132 SMs: slicing only adds exchanges). BF: the
    # steps' hidden tile (0: the glue's, `ttt_mlp.hidden_tile`). sm_90, bf16, D 128, NP 4: the step at 8 warps 170
    # registers (BF 16) / 255 (BF 32), no spill; at 4 warps 255, none (BF 16); the read 255, ≈ 350 B spilled
    # BWD 1: with ON, the backward sliced too (a parallel pre-pass, then two launches a mini-batch: _bwd_chain_kernel);
    # ZS 1: Z1 = K A1 + a1 of every mini-batch stored by the steps (b·F·4 B a mini-batch) and read by the steps and the
    # chain instead of recomputed (one dot a tile fewer in each: 21 → 18 a tile on the chain)
    "ttt_mlp_sliced": dict(num_warps=4, num_stages=1, ON=2, MAX_BH=64, NP=8, BF=0, BWD=1, ZS=0),  # _step_kernel
    "ttt_mlp_sliced_read": dict(num_warps=8, num_stages=1),  # memories.ttt_mlp_sliced._read_kernel, _bwd_pre_kernel
    "ttt_mlp_sliced_bwd_pre": dict(num_warps=8, num_stages=1),  # memories.ttt_mlp_sliced._bwd_pre2_kernel
    # Titans' (8 warps: at 4, sm_90's ptxas builds the fp32 forward at K 128 with 32 registers and ~17 KB of spills;
    # at 8 every variant keeps 255 registers and ≤ 0.5 KB forward, ≤ 3 KB backward — compiled, not yet timed)
    # (TILE: the most fp32 values of one [max(K, V), BF] weight tile, `titans.hidden_tile`). The parallel kernels at
    # 4 warps and 2 stages: H200, bf16, B 4, T 4096, H 16, D 128: readout 33.6 → 18.1 ms, backward pre-pass 118 → 67
    # MAX_DIM: the widest head dim (max(K, V)) that runs the single pipeline (`limits.titans_pipeline`); wider ones
    # the split one. H200, bf16 (r4s9): at B 64, T 512, H 2, D 64 single 17.6 ms fwd + bwd, split 19.0; at B 4,
    # T 4096, H 16, D 128 single 722, split 540
    "titans_single_fwd": dict(num_warps=8, num_stages=1, MAX_DIM=64),  # memories.titans_single._fwd_kernel
    # KEEP (r4s15; 2 the default since call 3: H200, bf16, B 64, T 512, H 2, D 64 fwd+bwd KEEP 0 18.11 ms, 1 15.32,
    # 2 14.59 — gated DeltaNet 2.99 in the same process: 4.88×; 320 MiB more kept at that shape, the start states'
    # 1 GiB beside it): what the single forward keeps for its backward beside the start states — 1: e,
    # h W2_s, h M2_s [b, V] and h Hdᵀ [b, b] a mini-batch (the backward drops its passes A and B: 70DF + 14bF →
    # 54DF + 10bF dot FLOPs a token); 2: also Z, e U2ᵀ, z1, X W1_s, X M1_s [b, F] (5·b·F·4 B a mini-batch; pass C
    # reads them instead of recomputing the read, pass D reads Z: 44DF + 8bF)
    "titans_single_bwd": dict(num_warps=8, num_stages=1, KEEP=2),  # memories.titans_single._bwd_kernel
    # the split pipeline (16 warps for the reverse pass: 365 → 605 ms at D 128; TILE 4096 there: 562 ms)
    "titans_fwd": dict(num_warps=8, num_stages=1, TILE=2048),  # memories.titans._state_kernel (state in place)
    "titans_readout": dict(num_warps=4, num_stages=2, TILE=2048),  # memories.titans._readout_kernel (parallel)
    "titans_bwd_read": dict(num_warps=4, num_stages=2, TILE=2048),  # memories.titans._bwd_read_kernel (parallel)
    # READ_TERMS 1: the pre-pass writes the start gradient's read terms (a start state's size a mini-batch) and the
    # reverse pass adds them (4 of its 21 dots a hidden tile off the sequential path; untimed, so 0)
    "titans_bwd": dict(num_warps=8, num_stages=1, TILE=2048, READ_TERMS=0),  # memories.titans._bwd_kernel
    # The split pipeline's sequential passes with the hidden width sliced over NP programs a (sequence, head), one
    # launch a mini-batch each way (memories/titans_sliced.py; the reads stay titans_readout's and titans_bwd_read's).
    # ON 0 off, 1 on, 2 (the default) on where sequences × heads ≤ MAX_BH (`kernels.variants.titans`, the rule
    # TTT-MLP's sliced kernels take): H200, bf16, D 128, fwd+bwd, one program → NP 4 (r4s13 calls 6, 7): B 4 T 4096
    # H 8 (32 programs) 536.8 → 153.1 ms, H 16 (64) 586.7 → 299.3; above 64 untimed. BF: the slices' hidden tile
    # (0: the "titans_fwd" site's,
    # `titans.hidden_tile`); BWD 1: with ON, the reverse pass sliced too (0: titans_bwd's kernel reads the same start
    # states). 8 warps, not ttt_mlp_sliced's 4: Titans' dots are ieee (FMA) at every dtype, and sm_90's ptxas (Triton
    # 3.6, bf16, D 128, BF 16) builds the reverse chain at 4 warps with 32 registers and 18–24 KB of spills; at 8 it
    # is 255 registers and ≈ 1.2 KB, the step 255 and ≈ 0.1 KB (≈ 1 KB at 4). NP 4: 8-warp CTAs of 255 registers,
    # one an SM — B 4 × H 8 × NP 4 = 128 programs, one wave of 132 SMs.
    "titans_sliced": dict(num_warps=8, num_stages=1, ON=2, MAX_BH=64, NP=4, BF=0, BWD=1),  # titans_sliced._step_kernel
    # FUSE 1: one chain launch a mini-batch (pass D of j, then pass C of j − 1); 0: two (pass D, then pass C)
    "titans_sliced_bwd": dict(num_warps=8, num_stages=1, FUSE=1),  # memories.titans_sliced._chain_kernel
    "titans_sliced_gates": dict(num_warps=4, num_stages=1),  # memories.titans_sliced._gates_kernel (parallel)
    # the short causal conv (layer/conv.py; no num_stages: Triton's default, as the conv has always launched):
    # forward BT rows × BC channels a program; the one-pass backward (`short_conv(..., one_pass_backward=True)`, the
    # default since the H100 sweep of scripts/bench_conv.py) BT rows a block (BT − W + 1 owned) × BC channels × NBLK
    # blocks a program; the two-kernel backward's dpre kernel (BT × BC × NBLK; DPRE_FP32 1: its scratch in fp32,
    # else x's dtype; 8 × 128 tiles: 80 registers for sm_90, 64 × 64 took 255) and dx kernel (BT × BC)
    "conv_fwd": dict(num_warps=4, BT=64, BC=64),  # layer.conv._conv_fwd
    # DW_ACC 1 (W ≤ 4): dw's products summed per tap over the program's blocks, reduced once (H200, r4s9 call 5,
    # bench_conv --sweep: 189.6 → 127.1 µs at C 1024, 346.4 → 232.0 at C 2048; 0: one reduction per block)
    "conv_bwd_fused": dict(num_warps=4, BT=64, BC=32, NBLK=8, DW_ACC=1),  # layer.conv._conv_bwd_fused
    # the one-pass backward streamed along the rows (W ≤ 4; ON=0: the block one-pass above): RUN xp rows × BC
    # channels a program, one row a step, [BC] vectors only (sm_90 registers in docs/kernel_notes.md "The joint q,
    # k, v conv"). On since H200 r4s12 call 2 (the preset's LM graphed, 8×2048 / 4×4096 / 1×16384 ms a step: off
    # 43.4 / 46.8 / 67.2; RUN 64 42.0 / 45.4 / 65.8; RUN 128 42.1 / 45.4 / 65.5; RUN 256 42.9 / 46.1 / 66.5)
    "conv_bwd_rows": dict(num_warps=2, ON=1, RUN=128, BC=256),  # layer.conv._conv_bwd_rows
    "conv_bwd_dpre": dict(num_warps=4, BT=8, BC=128, NBLK=16, DPRE_FP32=0),  # layer.conv._conv_bwd_dpre
    "conv_bwd_dx": dict(num_warps=4, BT=16, BC=128),  # layer.conv._conv_bwd_dx
    # RoPE (layer/rope.py): BR tokens × one head a program, forward and backward alike
    "rope": dict(num_warps=4, BR=32),  # layer.rope._rope_kernel
}

def check_precision(precision) -> str:
    """`precision` if it is one of DOT_PRECISIONS, else InputError naming it."""
    from .limits import DOT_PRECISIONS

    if precision not in DOT_PRECISIONS:
        from ....inputs import InputError

        raise InputError(f"precision must be one of {list(DOT_PRECISIONS)}, got {precision!r}")
    return precision

#: The Triton function of each launch site (what a profiler names its kernels): its module's path under
#: `fastweights.kernels.triton`, then the function (`path.rsplit(".", 1)`).
KERNEL_FN = {
    "prologue": "layer.prologue._prologue_kernel", "cumsum": "stages.cumsum._cumsum_kernel",
    "scores": "stages.scores._scores_kernel", "inverse": "stages.delta_inverse._inverse_kernel",
    "wy_fwd": "stages.delta_wy._wy_fwd_kernel", "delta_states_fwd": "stages.delta_states._delta_states_fwd_kernel",
    "states_fwd": "stages.states._states_fwd_kernel", "output_fwd": "stages.output._output_fwd_kernel",
    "delta_prepass": "fused.delta_fused._prepass_kernel", "delta_fused_fwd": "fused.delta_fused._fused_fwd_kernel",
    "output_bwd": "stages.output._output_bwd_kernel", "delta_output_bwd": "stages.delta_output._local_bwd_kernel",
    "delta_states_bwd": "stages.delta_states._delta_states_bwd_kernel",
    "states_bwd": "stages.states._states_bwd_kernel", "qk_grads": "stages.qk_grads._qk_grads_kernel",
    "wy_bwd": "stages.delta_wy._wy_bwd_kernel", "delta_grads": "stages.delta_grads._sum_kernel",
    "delta_fused_fwd_t": "fused.delta_fused_bwd._states_kernel",
    "delta_split_states": "fused.delta_fused_bwd._states_kernel", "delta_split_out": "fused.delta_split._output_kernel",
    "delta_fused_rec": "fused.delta_fused_bwd._states_kernel",
    "delta_fused_rev": "fused.delta_fused_bwd._reverse_kernel",
    "delta_fused_grads": "fused.delta_fused_bwd._grads_kernel",
    "delta_fused_grads_rows": "fused.delta_fused_bwd._grads_rows_kernel",
    "gated_fused_fwd": "fused.gated_fused._fwd_kernel",
    "gated_fused_bwd_states": "fused.gated_fused._bwd_states_kernel",
    "gated_fused_bwd_chunk": "fused.gated_fused._bwd_chunk_kernel",
    "gated_fused_scores": "fused.gated_fused._scores_kernel",
    "ttt_linear_fwd": "memories.ttt._state_kernel", "ttt_linear_readout": "memories.ttt._readout_kernel",
    "ttt_linear_bwd_read": "memories.ttt._bwd_read_kernel", "ttt_linear_bwd": "memories.ttt._bwd_kernel",
    "ttt_linear_bwd_post": "memories.ttt._bwd_post_kernel",
    "ttt_linear_sliced": "memories.ttt_linear_sliced._step_kernel",
    "ttt_linear_sliced_bwd": "memories.ttt_linear_sliced._chain_kernel",
    "ttt_mlp_fwd": "memories.ttt_mlp._fwd_kernel", "ttt_mlp_bwd": "memories.ttt_mlp._bwd_kernel",
    "ttt_mlp_sliced": "memories.ttt_mlp_sliced._step_kernel",
    "ttt_mlp_sliced_read": "memories.ttt_mlp_sliced._read_kernel",
    "ttt_mlp_sliced_bwd_pre": "memories.ttt_mlp_sliced._bwd_pre2_kernel",
    "titans_single_fwd": "memories.titans_single._fwd_kernel",
    "titans_single_bwd": "memories.titans_single._bwd_kernel", "titans_fwd": "memories.titans._state_kernel",
    "titans_readout": "memories.titans._readout_kernel",
    "titans_bwd_read": "memories.titans._bwd_read_kernel", "titans_bwd": "memories.titans._bwd_kernel",
    "titans_sliced": "memories.titans_sliced._step_kernel",
    "titans_sliced_bwd": "memories.titans_sliced._chain_kernel",
    "titans_sliced_gates": "memories.titans_sliced._gates_kernel",
    "conv_fwd": "layer.conv._conv_fwd", "conv_bwd_fused": "layer.conv._conv_bwd_fused",
    "conv_bwd_rows": "layer.conv._conv_bwd_rows",
    "conv_bwd_dpre": "layer.conv._conv_bwd_dpre", "conv_bwd_dx": "layer.conv._conv_bwd_dx",
    "rope": "layer.rope._rope_kernel",
}

#: Set to a set() to collect the names of the launch sites that run, and "name.KEY" of the tile keys
#: read (scripts/gpu_kernels.py, tests).
SEEN: set | None = None


def launch(name: str) -> dict:
    """The launch keyword arguments (num_warps, num_stages, …) of launch site `name`; its tile
    keys (upper case, see LAUNCH) are read with `tile`."""
    if SEEN is not None:
        SEEN.add(name)
    return {key: val for key, val in LAUNCH[name].items() if not key[:1].isupper()}


class _SeenSite(Mapping):
    """One launch site's settings, read through `table()` while SEEN collects: each key read adds "name.KEY"."""

    def __init__(self, name: str, cfg: dict):
        self._name, self._cfg = name, cfg

    def __getitem__(self, key):
        SEEN.add(f"{self._name}.{key}")
        return self._cfg[key]

    def __iter__(self):
        return iter(self._cfg)

    def __len__(self):
        return len(self._cfg)


class _SeenTable(Mapping):
    def __getitem__(self, name):
        return _SeenSite(name, LAUNCH[name])

    def __iter__(self):
        return iter(LAUNCH)

    def __len__(self):
        return len(LAUNCH)


def capturing(x: torch.Tensor) -> bool:
    """Whether a call on `x` is being captured into a CUDA graph (its stream's capture; False on the CPU): a fact of
    the call the sliced kernels' ON 3 rule reads (`kernels.variants._sliced_rule`)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def table() -> Mapping:
    """The launch table as the pure variant rules (`kernels.variants`) take it: LAUNCH itself, or while SEEN collects
    a view whose reads add "name.KEY" to it as `tile` does."""
    return LAUNCH if SEEN is None else _SeenTable()


def state_pass_launch(name: str, dtype: torch.dtype, K: int) -> dict:
    """`launch(name)` for a sequential state pass, whose `for` loop over the chunks Triton software-
    pipelines: the next chunk's tiles are staged in shared memory num_stages − 1 times over. With fp32
    inputs or K > 128 those tiles outgrow the H100's 227 KB (fp32, diagonal decay, K = 128: 246 KB;
    fp32, K = 256: 336 KB — seen on the H100), so those passes run unpipelined (num_stages = 1)."""
    kw = launch(name)
    if dtype == torch.float32 or K > 128:
        kw["num_stages"] = 1
    return kw


def tile(name: str, key: str) -> int:
    """Tile constexpr `key` of launch site `name` (see LAUNCH)."""
    if SEEN is not None:
        SEEN.add(f"{name}.{key}")
    return int(LAUNCH[name][key])


def load_launch(path: str | os.PathLike | dict) -> dict:
    """Update LAUNCH from a JSON file {name: {key: value}} (or such a dict), e.g. the `best_launch.json`
    of `scripts/gpu_kernels.py --stages sweep-kernels`; a listed site takes the listed keys, the rest
    keep theirs. Unknown names or keys raise KeyError (a stale file must not pass silently).
    Returns the table before the update, for `LAUNCH.update(old)` to undo it."""
    if isinstance(path, dict):
        table = path
    else:
        with open(path) as f:
            table = json.load(f)
    for name, cfg in table.items():  # all checked before any is applied
        if name not in LAUNCH:
            raise KeyError(f"unknown launch site {name!r} (known: {sorted(LAUNCH)})")
        for key in cfg:
            if key not in LAUNCH[name]:
                raise KeyError(f"launch site {name!r} has no setting {key!r} (has: {sorted(LAUNCH[name])})")
    old = {name: dict(cfg) for name, cfg in LAUNCH.items()}
    for name, cfg in table.items():
        LAUNCH[name].update({key: int(val) for key, val in cfg.items()})
    return old

