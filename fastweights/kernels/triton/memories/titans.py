"""Titans' inner mini-batch loop (`chunkwise.minibatch` for the recipe `titans`) in Triton: a sequential program per
(sequence, value head) each way for the recurrence through the start states (the design of `ttt_mlp.py`: the MLP's
weights in a per-program global scratch streamed in hidden tiles), and the read of the queries and its gradients in
parallel over the mini-batches (the split of `ttt.py`, TTT-Linear's kernels). `titans_triton` is the glue of both of
Titans' pipelines: this "split" one and the "single" one of `titans_single.py` (one sequential program per (sequence,
head) each way, doing the reads too), chosen by `limits.titans_pipeline` from the head dims (or its `pipeline=`).

The memory (Behrouz et al. 2024, the zoo's `titans`): a 2-layer MLP without biases or residual LayerNorm, hidden
width F (4K in the zoo), σ = GELU (erf form, σ(z) = z Φ(z), σ'(z) = Φ(z) + z φ(z)):

    M_θ(x) = σ(x W1) W2                      θ = (W1 [K, F], W2 [F, V])

inner loss ℓ_t(θ) = ½‖M_θ(k_t) − v_t‖², the momentum optimizer with the step inside the momentum and scalar
retention, per token t (gates a_t = exp(g_t) the retention, ν_t the momentum decay, β_t the step; [B, T, H] each):

    m_t = ν_t m_{t−1} − β_t ∇ℓ_t(θ₀),     θ_t = a_t θ_{t−1} + m_t        (`reference.recurrent`)

with every gradient of a mini-batch (b tokens aligned to the sequence start) taken at its anchor θ₀, the weights
it started from. decay_first=False (the zoo's, and the only order a recipe with b > 1 takes: `recipe.Recipe` refuses
decay_first=True there) decays θ after the gradient is taken.

One mini-batch ("segment": the L ≤ b tokens of one mini-batch inside the call, rows t = 1 … L) from its start
state θ_s = (W1_s, W2_s), m_s = (M1_s, M2_s) and anchor θ₀ = (U1, U2) (θ₀ = θ_s unless the segment continues a
mini-batch carried into the call: offset o > 0, θ₀ the carried anchor). Products from the segment start
(`minibatch._coefficients`'s momentum branch):

    A_t = Π_{τ≤t} a_τ,   N_t = Π_{τ≤t} ν_τ,   (R_A)_{tu} = [u ≤ t] A_t / A_u,   (R_N)_{tj} = [j ≤ t] N_t / N_j

The gradients at the anchor, per token (rows [b, ·]; K, V the segment's keys and values):

    Z = K U1,  Hd = σ(Z)  [b, F],    f = Hd U2,  e = f − V  [b, V],    dz = (e U2ᵀ) ⊙ σ'(Z)  [b, F]
    G_i = ∇ℓ_i(θ₀) = (k_iᵀ dz_i,  Hd_iᵀ e_i)                         rank 1 in each layer

Unrolling the recurrence over the segment, every momentum and weight is start terms plus the rank-1 terms through
causal [b, b] coefficient matrices:

    m_t = N_t m_s + Σ_j Cm_{tj} G_j,          Cm = −R_N diag(β)           (Cm_{tj} = −[j ≤ t] β_j N_t / N_j)
    θ_t = A_t θ_s + c_t m_s + Σ_j C_{tj} G_j,   c_t = Σ_{u≤t} (A_t / A_u) N_u,   C = R_A Cm

(θ_t = A_t θ_s + Σ_{u≤t} (A_t / A_u) m_u.) The read at the queries x = scale·q, layer by layer in the dual form — no
per-token weight is formed:

    z1 = A ⊙ (X W1_s) + c ⊙ (X M1_s) + (C ∘ X Kᵀ) dz                [b, F]     (A, c scale the rows)
    h  = σ(z1)
    o  = A ⊙ (h W2_s) + c ⊙ (h M2_s) + (C ∘ h Hdᵀ) e                 [b, V]

and the segment's end (row L), the next segment's start and anchor:

    W1_e = A_L W1_s + c_L M1_s + Kᵀ diag(C_L) dz,     M1_e = N_L M1_s + Kᵀ diag(Cm_L) dz
    W2_e = A_L W2_s + c_L M2_s + Hdᵀ diag(C_L) e,     M2_e = N_L M2_s + Hdᵀ diag(Cm_L) e

(C_L, Cm_L: the last rows). In the kernel every segment is b rows: position r of mini-batch s is the call's token
s·b + r − o, and the rows outside the call (a carried mini-batch's first o, the tail past the sequence's end) take
a = 1, ν = 1, β = 0 and add no m_u to θ (R_A's columns of those rows are 0): the coefficients of the real rows are
unchanged, and row b's are the segment's last token's. (log ν is clamped at fp32's smallest normal, as
`minibatch._log` clamps at the compute dtype's.)

Where the weights live: θ and m (4·K·F·4 bytes per (sequence, head): 256 KiB at K = V = 64, F = 256) in the final
state's output tensors, which the state pass first fills with the initial state and then updates in place,
mini-batch by mini-batch — each tile of W1 [K, BF], M1, W2 [BF, V], M2 is rewritten in the same iteration that read
it (as `ttt_mlp.py`'s rolled slot; a `tl.debug_barrier` between mini-batches, num_stages = 1). The carried anchor
(offset > 0) is read from its own input in the first mini-batch only; the last mini-batch's anchor is written out.
On every call the state pass also copies each mini-batch's start state θ_s, m_s into its slot and stores its e
[b, V] (16·K·F + 4·b·V bytes a mini-batch at K = V: 1 MiB at D = 128): what the readout reads (a workspace of a call
without gradients, freed after it) and the backward reads back.

Forward, two launches:

1. `_state_kernel`, sequential, grid (R·H,), per mini-batch: the coefficients from the gates ([b, b] in registers);
   pass 1 over the hidden tiles accumulates f (then e, stored); pass 2 saves the tile's start state, recomputes Z,
   forms dz and rewrites the tile's W1, M1, W2, M2 to the segment's end. No query is read: 16DF dot FLOPs a token
   on the sequential path (the single forward kernel before it: 26DF + 4bF).
2. `_readout_kernel`, parallel, grid (slots, H): one program per (mini-batch, value head) reads its start state and
   e, recomputes Z, dz per tile and forms the read's z1, h, o's two start terms and h Hdᵀ (pass 2's read); o from
   the accumulators. 12DF + 4bF a token.

Backward (the maths; which kernel does what: below), the mini-batches in reverse, from the gradients
Ḡ_e = (W̄1_e, W̄2_e, M̄1_e, M̄2_e) of a segment's end state (the final state's, then each later segment's start's;
kept in place, [R·H, ·]) and ō [b, V]:

    o:    Ā += rowsum(ō ⊙ h W2_s),  c̄ += rowsum(ō ⊙ h M2_s),  C̄ += (ō eᵀ) ∘ (h Hdᵀ),  ē = (C ∘ h Hdᵀ)ᵀ ō,
          h̄ = (A ⊙ ō) W2_sᵀ + (c ⊙ ō) M2_sᵀ + ((ō eᵀ) ∘ C) Hd,  Hd̄ = ((ō eᵀ) ∘ C)ᵀ h,
          W̄2_s = hᵀ (A ⊙ ō),  M̄2_s = hᵀ (c ⊙ ō);   z̄1 = h̄ ⊙ σ'(z1), then the same for z1 with X, W1_s, M1_s,
          (C ∘ X Kᵀ) dz (X̄, K̄ through X Kᵀ; dz̄ = (C ∘ X Kᵀ)ᵀ z̄1; C̄ += (z̄1 dzᵀ) ∘ X Kᵀ);
    end:  W̄1_s += A_L W̄1_e,  M̄1_s += c_L W̄1_e + N_L M̄1_e  (and layer 2);  Ā_L = ⟨W̄_e, W_s⟩, c̄_L = ⟨W̄_e, M_s⟩,
          N̄_L = ⟨M̄_e, M_s⟩ (both layers);  the rank-1 terms: K̄ += diag(C_L) dz W̄1_eᵀ + diag(Cm_L) dz M̄1_eᵀ,
          dz̄ += C_L ⊙ K W̄1_e + Cm_L ⊙ K M̄1_e,  C̄_L = rowsum(dz ⊙ K W̄1_e) + rowsum(e ⊙ Hd W̄2_e)  (Cm̄_L the same
          with M̄_e), Hd̄, ē likewise from layer 2;
    anchor: ḡ1 = dz̄ ⊙ σ'(Z), ē += ḡ1 U2, Ū2 = ḡ1ᵀ e;  f̄ = ē (e = f − V: V̄ = −ē);  Hd̄ += f̄ U2ᵀ, Ū2 += Hdᵀ f̄;
          Z̄ = Hd̄ ⊙ σ'(Z) + dz̄ ⊙ (e U2ᵀ) ⊙ σ''(Z);  Ū1 = Kᵀ Z̄,  K̄ += Z̄ U1ᵀ  — Ū into θ̄_s (or into the carried
          anchor's gradient);
    gates: C = R_A Cm and c = R_A N back to R̄_A, Cm̄, N̄; then log A, log N (R's entries are exps of differences,
          A = e^{log A}, N = e^{log N}) and β (Cm = −R_N diag(β)); log a, log ν by the reverse cumsum (ν̄ = (log ν)̄ / ν).

Two launches. `_bwd_read_kernel`, parallel, grid (slots, H), per (mini-batch, value head), the "o" line and z1's: pass
B (the read's sums over the hidden dim: h W2_s, h M2_s, h Hdᵀ), pass C (per hidden tile: z̄1, X̄ and the coefficients'
read terms); it writes dq whole, K̄'s read part (through X Kᵀ) into dk, and per slot the read's dz̄ and Hd̄ terms, z̄1
and h ([b, F] each: 4·b·F·4 bytes a mini-batch, 128 KiB at D = 128), ē's read term [b, V] and Ā, c̄ [b], C̄ [b, b]
(with util.LAUNCH "titans_bwd" READ_TERMS 1, untimed: the start gradient's read terms below instead of z̄1 and h, a
start state's size a mini-batch). Then `_bwd_kernel`, sequential, grid (R·H,), the mini-batches in reverse from e
(stored by the forward): pass C (per hidden tile: the "end" and "anchor" lines but f̄'s side, with the pre-pass's dz̄
and Hd̄ added; ∂/∂Z but its f̄ term to a [b, F] scratch; the start state's gradients written over the end's, their
read terms W̄1_s += Xᵀ(A ⊙ z̄1), M̄1_s += Xᵀ(c ⊙ z̄1), W̄2_s += (A ⊙ h)ᵀ ō, M̄2_s += (c ⊙ h)ᵀ ō from the pre-pass's
z̄1 and h), pass D (per tile: the f̄ terms, Ū into the start weights' gradient or the carried anchor's), then the
gates' backward (with the pre-pass's Ā, c̄, C̄) and dk completed. The final anchor's gradient joins the last
mini-batch's start weights' (or the carried anchor's). dq, dk of grouped heads are written per value head and summed
by the glue. Dot FLOPs a token on the sequential path: 42DF (pass C 32DF, pass D 10DF; the single reverse kernel
before it: 70DF + 14bF); the pre-pass 28DF + 10bF.

FLOPs and bytes per token of the single kernels (`titans_single.py`; the split does the same work but for its
recomputations: the readout's and the pre-pass's Z, dz; K = V = D, F = 4D as the zoo's; a multiply-add 2 FLOPs; the
O(bD) and O(b²D) terms left out):
- forward: pass 1 K U1, Hd U2 (4DF); pass 2 K U1 again, e U2ᵀ, X W1_s, X M1_s, h W2_s, h M2_s and the four end
  updates Kᵀ(C_L dz), Kᵀ(Cm_L dz), Hdᵀ(C_L e), Hdᵀ(Cm_L e) (22DF), (C ∘ XKᵀ) dz and h Hdᵀ (4bF):
  26DF + 4bF = 104D² + 16bD, 442 kFLOP at D = 64, b = 16 (of which 2DF recompute pass 1's Z rather than keep it).
- on-chip traffic (the state's scratch, L2-resident): per mini-batch pass 1 reads U1, U2 (8DF bytes), pass 2 reads
  W1, W2, M1, M2 (the anchor is W_s's tile, read once) and writes them (32DF): 40DF/b = 160D²/b bytes a token,
  40 KiB at D = 64, b = 16 (with SAVE, 16DF more written a mini-batch: the start state's copy, to HBM below).
- backward: pass A 4DF, pass B (the read again) 12DF + 4bF, pass C 44DF + 10bF, pass D 10DF: 70DF + 14bF =
  280D² + 56bD, 1.20 MFLOP at D = 64, b = 16 (2.7× the forward).
- backward on-chip traffic: per mini-batch the start state read 3× and the anchor 3× (as the start weights' tile:
  read again), the state's gradients read twice and written twice (pass D: W1, W2 only), the [b, F] scratch once each
  way: ≈ 112DF/b = 448D²/b bytes a token (112 KiB at D = 64, b = 16).
- HBM: q, k, v in and o out (2K + 2V elements a token), the three gates (3 a token), and their gradients likewise in
  the backward; the state read and written once per call; the start states saved for the backward, 16DF/b =
  64D²/b bytes a token written by the forward and read by the backward (16 KiB at D = 64, b = 16).
The tl.dot products are fp32 at the call's `precision` (by default `limits.loop_precision("Titans", q.dtype)`: "ieee",
FMAs, at every input dtype: `limits.LOOP_BF16_KERNELS`); one sequential program walks its sequence's T/b
mini-batches in order, B·H programs in all, each parallel kernel (slots, H) programs.

Limits: K, V ≤ MAX_TTT_DIM (each padded to a power of two ≥ 16), F any width (tiles masked), b ∈ TTT_MINIBATCHES;
varlen (`cu_seqlens`: one sequential program per (sequence, head), each sequence's mini-batches from its own start,
its slots from the host's `ttt._Plan`, the parallel kernels' slot → sequence map likewise); grouped heads (value head
h reads q/k head h // (H / H_q)).
fp32 operands. Launch settings: util.LAUNCH's "titans_fwd" (the state pass) and "titans_bwd" (the reverse pass) at 8
warps, 1 stage (at 4 warps sm_90's ptxas built the single forward kernel at K = 128 with 32 registers and ~17 KB of
spills; the loops re-read what a previous pass wrote), "titans_readout" and "titans_bwd_read" at 4 warps, 2 stages
(their loads pipelined: read-only); each site's TILE sets its hidden tile (`hidden_tile`). This pipeline runs where
`limits.titans_pipeline` says "split" (head dims > 64; the single kernels, `titans_single.py`, below):
docs/kernel_notes.md (round 4, ninth session) has the sm_90 counts and the H200 times. Where sequences × heads ≤ 64
(util.LAUNCH["titans_sliced"] ON 2, the default; 1 always, 0 never) the two sequential passes run with the hidden width
sliced over programs instead, one launch a mini-batch each way (`titans_sliced.py`; docs/kernel_notes.md, "Titans
sliced"; H200, B 4, T 4096, H 8, D 128: 536.8 → 153.1 ms fwd+bwd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ...variants import titans_backward
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import MAX_TTT_DIM, TITANS_PRECISION, TTT_MINIBATCHES, loop_precision, titans_pipeline
from ..common.util import capturing, check_precision, launch, pow2, table, tile
from . import titans_single
from .titans_single import (  # the jit helpers the pipelines share (the single kernels' module holds them)
    _anchor,
    _coefficients,
    _coefficients_back,
    _gelu,
    _gelu2,
    _hidden,
    _keys,
    _pass_f,
    _rows_e,
    _state_tiles,
    _tile_read,
)
from .ttt import _plan, _sequence, _slot

Tensor = torch.Tensor

__all__ = ["titans_triton", "hidden_tile", "PRECISION"]

#: The kernel's default tl.dot input precision for fp32 and fp16 inputs (bf16: limits.LOOP_BF16_PRECISION; the
#: `precision` argument; limits.DOT_PRECISIONS).
PRECISION = TITANS_PRECISION

#: The most fp32 values of one [max(K, V), BF] weight tile (the hidden tile BF = this / pow2(max(K, V)), in
#: [16, pow2(F)]): pass 2 holds four of them (W1, M1, W2, M2) and the anchor's two.
TILE_ELEMENTS = 2048
_RSQRT2 = tl.constexpr(0.7071067811865476)  # 1 / √2 (a constexpr: a jit function reads only those globals)
_RSQRT2PI = tl.constexpr(0.3989422804014327)  # 1 / √(2π)
_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: log ν's clamp


def hidden_tile(K: int, V: int, F: int, elements: int = TILE_ELEMENTS) -> int:
    """The hidden dim's tile BF for head dims K, V and hidden width F (a power of two ≥ 16): [max(K, V), BF] tiles of
    at most `elements` fp32 values (each kernel's launch site's TILE, util.LAUNCH; by default TILE_ELEMENTS)."""
    return max(16, min(pow2(F), elements // pow2(max(K, V))))


def _site(geo: dict, name: str, launch_keys: bool = True) -> dict:
    """The constexprs and launch settings of launch site `name`: geo with its hidden tile BF (the call's `tile`, else
    `hidden_tile` at the site's TILE) and util.LAUNCH's settings (launch_keys False: the constexprs alone)."""
    BF = geo["TILE"] or hidden_tile(geo["DK"], geo["DV"], geo["F"], tile(name, "TILE"))
    return {**{k: val for k, val in geo.items() if k != "TILE"}, "BF": BF, **(launch(name) if launch_keys else {})}


# Every kernel taking NS (the anchor slots) leaves it unspecialized (`do_not_specialize`): with NS == 1 (Triton makes
# it a constant) and a carried anchor (HAS_A), Triton 3.6 for sm_90 crashed in TritonGPUCoalesce ("PassManager::run
# failed") compiling `_bwd_read_kernel`, and built titans_single's backward at D 16 with 32 registers and 12 KB of
# spills — a call of one slot, e.g. T 3 after an offset of 9 (r4s10 call 1; scripts/sm90_report.py compiles that
# case). Triton 3.9 compiles both.


@triton.jit
def _rows(q, k, v, g, beta, nu, bos, i_h, s, T, off, scale, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr,
          DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """`_keys` with the queries first: x = scale·q [BT, BDK] (0 outside the sequence), then `_keys`' rows."""
    kk, vv, lg, eta, nn, row, valid, mv = _keys(k, v, g, beta, nu, bos, i_h, s, T, off, H, HQ, DK, DV, BDK, BDV, BT)
    ck = tl.arange(0, BDK)
    i_hq = i_h // (H // HQ)
    x = tl.load(q + (row[:, None] * HQ + i_hq) * DK + ck[None, :], mask=valid[:, None] & (ck < DK)[None, :],
                other=0.0).to(tl.float32) * scale
    return x, kk, vv, lg, eta, nn, row, valid, mv


@triton.jit(do_not_specialize=["NS"])
def _state_kernel(k, v, g, beta, nu, W1_0, W2_0, M1_0, M2_0, A1_0, A2_0, W1, W2, M1, M2, A1o, A2o,
                  sw1, sw2, sm1, sm2, es, cu, slots, T, off, NS, H: tl.constexpr, HQ: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                  BF: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    # The sequential state pass, grid (R·H,). W1, W2, M1, M2 [R·H, ·]: the final state's outputs, the running state
    # (filled with the initial one first); sw1, sw2, sm1, sm2 [slots·H, ·]: every mini-batch's start state, es
    # [slots·H, BT, DV]: its e at the anchor — what the readout and the backward read. No query is read here.
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H  # i_b: the sequence (batch row, or cu_seqlens's)
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    empty = ns == 0  # a sequence of no mini-batch (varlen's empty one, no carried mini-batch): its anchor as it was
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        p1 = i_bh * (DK * F) + o1
        p2 = i_bh * (F * DV) + o2
        tl.store(W1 + p1, tl.load(W1_0 + p1, mask=m1, other=0.0), mask=m1)
        tl.store(M1 + p1, tl.load(M1_0 + p1, mask=m1, other=0.0), mask=m1)
        tl.store(W2 + p2, tl.load(W2_0 + p2, mask=m2, other=0.0), mask=m2)
        tl.store(M2 + p2, tl.load(M2_0 + p2, mask=m2, other=0.0), mask=m2)
        tl.store(A1o + p1, tl.load(A1_0 + p1, mask=m1 & empty, other=0.0), mask=m1 & empty)
        tl.store(A2o + p2, tl.load(A2_0 + p2, mask=m2 & empty, other=0.0), mask=m2 & empty)
    for s in range(0, ns):
        tl.debug_barrier()  # the previous mini-batch's (or the copy's) stores before this one's loads
        last = s == ns - 1
        kk, vv, lg, eta, nn, row, valid, mv = _keys(k, v, g, beta, nu, bos, i_h, s, Tn, off, H, HQ, DK, DV, BDK, BDV,
                                                    BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        # pass 1: e = ∂ℓ/∂f at the anchor, kept for the readout and the backward
        e = _pass_f(kk, vv, mv, A1_0, A2_0, i_bh, W1, W2, i_bh, s, ck, ckm, cv, cvm, DK, DV, F, BT, BDV, BF,
                    PREC, HAS_A)
        slot = (slot0 + s) * H + i_h
        tl.store(es + slot * (BT * DV) + r[:, None] * DV + cv[None, :], e, mask=cvm[None, :])
        eC = e * C_L[:, None]
        eM = e * Cm_L[:, None]
        kT = tl.trans(kk)
        # pass 2: per hidden tile, dz and the tile's end state (its start state saved first)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(W1, W2, M1, M2, i_bh, o1, o2, m1, m2, DK, DV, F)
            tl.store(sw1 + slot * (DK * F) + o1, w1, mask=m1)
            tl.store(sm1 + slot * (DK * F) + o1, mm1, mask=m1)
            tl.store(sw2 + slot * (F * DV) + o2, w2, mask=m2)
            tl.store(sm2 + slot * (F * DV) + o2, mm2, mask=m2)
            U1, U2 = w1, w2
            if HAS_A:
                if s == 0:  # the carried anchor (a branch, as `_anchor`'s)
                    U1 = tl.load(A1_0 + p1, mask=m1, other=0.0)
                    U2 = tl.load(A2_0 + p2, mask=m2, other=0.0)
            Hd, dg = _gelu(tl.dot(kk, U1, input_precision=PREC))
            dz = tl.dot(e, tl.trans(U2), input_precision=PREC) * dg
            # the call's last mini-batch: its anchor out
            tl.store(A1o + p1, U1, mask=m1 & last)
            tl.store(A2o + p2, U2, mask=m2 & last)
            HT = tl.trans(Hd)
            tl.store(W1 + p1, A_L * w1 + c_L * mm1 + tl.dot(kT, dz * C_L[:, None], input_precision=PREC), mask=m1)
            tl.store(M1 + p1, N_L * mm1 + tl.dot(kT, dz * Cm_L[:, None], input_precision=PREC), mask=m1)
            tl.store(W2 + p2, A_L * w2 + c_L * mm2 + tl.dot(HT, eC, input_precision=PREC), mask=m2)
            tl.store(M2 + p2, N_L * mm2 + tl.dot(HT, eM, input_precision=PREC), mask=m2)


@triton.jit(do_not_specialize=["NS"])
def _readout_kernel(q, k, v, g, beta, nu, A1_0, A2_0, sw1, sw2, sm1, sm2, es, o, cu, slots, seq_of, scale, T, off,
                    NS, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr,
                    BDK: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                    HAS_A: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The forward's parallel readout, grid (anchor slots, H): o of one mini-batch of one value head from its stored
    start state and e (`_state_kernel`'s), in the dual form over the hidden tiles (pass 2's read)."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    i_bh = i_b.to(tl.int64) * H + i_h  # the carried anchor's row
    slot = i_slot.to(tl.int64) * H + i_h
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                   BDK, BDV, BT)
    At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
    e = _rows_e(es, slot, BT, DV, BDV)
    X1 = C * tl.dot(x, tl.trans(kk), input_precision=PREC)  # C ∘ X Kᵀ
    zW = tl.zeros([BT, BDV], dtype=tl.float32)  # h W2_s
    zM = tl.zeros([BT, BDV], dtype=tl.float32)  # h M2_s
    S2 = tl.zeros([BT, BT], dtype=tl.float32)  # h Hdᵀ
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
        U1, U2 = w1, w2
        if HAS_A:
            if s == 0:  # the carried anchor
                U1 = tl.load(A1_0 + i_bh * (DK * F) + o1, mask=m1, other=0.0)
                U2 = tl.load(A2_0 + i_bh * (F * DV) + o2, mask=m2, other=0.0)
        Z, Hd, dg, g1, dz, P1, Q1, h, dh = _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
        zW += tl.dot(h, w2, input_precision=PREC)
        zM += tl.dot(h, mm2, input_precision=PREC)
        S2 += tl.dot(h, tl.trans(Hd), input_precision=PREC)
    out = At[:, None] * zW + ct[:, None] * zM + tl.dot(C * S2, e, input_precision=PREC)
    tl.store(o + (row[:, None] * H + i_h) * DV + cv[None, :], out.to(o.dtype.element_ty), mask=mv)


@triton.jit(do_not_specialize=["NS"])
def _bwd_read_kernel(q, k, v, g, beta, nu, A1_0, A2_0, sw1, sw2, sm1, sm2, es, do, dq, dk, zr, hr, z1s, hs, R1, RM1,
                     R2, RM2, des, dAs, dcs, dCs, cu, slots, seq_of, scale, T, off, NS, H: tl.constexpr,
                     HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BDK: tl.constexpr,
                     BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, HAS_A: tl.constexpr,
                     IS_VARLEN: tl.constexpr, RT: tl.constexpr):
    """The backward's parallel pre-pass, grid (anchor slots, H): the read's own gradients of one mini-batch of one
    value head from its stored start state and e. Writes dq whole and the read's part of dk (dq, dk [B, T, H, K],
    per value head), and per slot: the read's parts of ∂/∂dz (zr) and ∂/∂Hd (hr), the read's dz1 = ∂/∂z1 (z1s) and
    h (hs) [BT, F] — the reverse pass forms the start state's read terms xᵀ(A ⊙ dz1), hᵀ(A ⊙ ō) from them —, the
    read's part of ē (des [BT, DV]) and of the coefficients' gradients Ā, c̄ [BT] (dAs, dcs) and C̄ [BT, BT] (dCs).
    With RT the read's terms of the start state's gradient themselves, Xᵀ(A ⊙ z̄1), Xᵀ(c ⊙ z̄1) [K, F] and
    (A ⊙ h)ᵀ ō, (c ⊙ h)ᵀ ō [F, V] (R1, RM1, R2, RM2: a start state's size a slot), instead of z̄1 and h."""
    i_slot = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b, bos, Tn, s = _slot(i_slot, T, off, NS, cu, slots, seq_of, BT, IS_VARLEN)
    i_bh = i_b.to(tl.int64) * H + i_h
    slot = i_slot.to(tl.int64) * H + i_h
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                   BDK, BDV, BT)
    At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
    e = _rows_e(es, slot, BT, DV, BDV)
    S1 = tl.dot(x, tl.trans(kk), input_precision=PREC)
    X1 = C * S1
    # pass B: the read's sums over the hidden dim, h W2_s, h M2_s, h Hdᵀ
    P2 = tl.zeros([BT, BDV], dtype=tl.float32)
    Q2 = tl.zeros([BT, BDV], dtype=tl.float32)
    S2 = tl.zeros([BT, BT], dtype=tl.float32)
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
        U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
        Z, Hd, dg, g1, dz, P1, Q1, h, dh = _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
        P2 += tl.dot(h, w2, input_precision=PREC)
        Q2 += tl.dot(h, mm2, input_precision=PREC)
        S2 += tl.dot(h, tl.trans(Hd), input_precision=PREC)
    # o = A ⊙ P2 + c ⊙ Q2 + (C ∘ S2) e
    dO = tl.load(do + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
    dAt = tl.sum(dO * P2, axis=1)
    dct = tl.sum(dO * Q2, axis=1)
    Ee = tl.dot(dO, tl.trans(e), input_precision=PREC)  # do_t · e_j
    dC = Ee * S2
    dS2 = Ee * C
    de = tl.dot(tl.trans(C * S2), dO, input_precision=PREC)
    Ado = At[:, None] * dO
    cdo = ct[:, None] * dO
    D1 = tl.zeros([BT, BT], dtype=tl.float32)  # dz1 dzᵀ
    dX = tl.zeros([BT, BDK], dtype=tl.float32)
    zs = slot * (BT * F) + r[:, None] * F  # + fc[None, :]: the slot's scratch rows
    # pass C (the read's part): per hidden tile, ∂/∂z1, its terms of dX and the coefficients, and the scratches
    for f0 in range(0, F, BF):
        fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
        w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
        U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
        Z, Hd, dg, g1, dz, P1, Q1, h, dh = _tile_read(x, kk, e, X1, At, ct, U1, U2, w1, mm1, PREC)
        dz1 = (tl.dot(Ado, tl.trans(w2), input_precision=PREC) + tl.dot(cdo, tl.trans(mm2), input_precision=PREC)
               + tl.dot(dS2, Hd, input_precision=PREC)) * dh
        dAt += tl.sum(dz1 * P1, axis=1)
        dct += tl.sum(dz1 * Q1, axis=1)
        dX += tl.dot(At[:, None] * dz1, tl.trans(w1), input_precision=PREC) \
            + tl.dot(ct[:, None] * dz1, tl.trans(mm1), input_precision=PREC)
        D1 += tl.dot(dz1, tl.trans(dz), input_precision=PREC)
        fs = zs + fc[None, :]
        tl.store(zr + fs, tl.dot(tl.trans(X1), dz1, input_precision=PREC), mask=fm[None, :])
        tl.store(hr + fs, tl.dot(tl.trans(dS2), h, input_precision=PREC), mask=fm[None, :])
        if RT:  # the start state's read terms, off the reverse pass
            xT = tl.trans(x)
            tl.store(R1 + slot * (DK * F) + o1, tl.dot(xT, At[:, None] * dz1, input_precision=PREC), mask=m1)
            tl.store(RM1 + slot * (DK * F) + o1, tl.dot(xT, ct[:, None] * dz1, input_precision=PREC), mask=m1)
            tl.store(R2 + slot * (F * DV) + o2, tl.dot(tl.trans(h), Ado, input_precision=PREC), mask=m2)
            tl.store(RM2 + slot * (F * DV) + o2, tl.dot(tl.trans(h), cdo, input_precision=PREC), mask=m2)
        else:
            tl.store(z1s + fs, dz1, mask=fm[None, :])
            tl.store(hs + fs, h, mask=fm[None, :])
    dC += D1 * S1
    dS1 = D1 * C
    dX += tl.dot(dS1, kk, input_precision=PREC)
    dK = tl.dot(tl.trans(dS1), x, input_precision=PREC)
    hk = (row[:, None] * H + i_h) * DK + ck[None, :]
    mk = valid[:, None] & ckm[None, :]
    tl.store(dq + hk, (dX * scale).to(dq.dtype.element_ty), mask=mk)
    tl.store(dk + hk, dK, mask=mk)
    tl.store(des + slot * (BT * DV) + r[:, None] * DV + cv[None, :], de, mask=cvm[None, :])
    tl.store(dAs + slot * BT + r, dAt)
    tl.store(dcs + slot * BT + r, dct)
    tl.store(dCs + slot * (BT * BT) + r[:, None] * BT + r[None, :], dC)


@triton.jit(do_not_specialize=["NS"])
def _bwd_kernel(q, k, v, g, beta, nu, A1_0, A2_0, sw1, sw2, sm1, sm2, es, do, GW1, GW2, GM1, GM2, GA1, GA2,
                dk, dv, dg_ptr, dbeta, dnu, dZs, zr, hr, z1s, hs, R1, RM1, R2, RM2, des, dAs, dcs, dCs, cu, slots,
                scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
                PREC: tl.constexpr, HAS_A: tl.constexpr, IS_VARLEN: tl.constexpr, RT: tl.constexpr):
    # The reverse sequential pass, grid (R·H,), after `_bwd_read_kernel`. GW1, GW2, GM1, GM2 [R·H, ·]: seeded with the
    # final state's gradients, rewritten in place mini-batch by mini-batch (in reverse) to the gradients of each one's
    # start state: at the end, the initial state's. GA1, GA2: seeded with the final anchor's gradient; the last
    # mini-batch moves it to its start weights' unless its anchor is the carried one, whose gradient they accumulate.
    # dZs [R·H, BT, F]: ∂/∂Z between passes C and D. dk holds the pre-pass's part, completed here.
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    bos, Tn, ns, slot0 = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
    r = tl.arange(0, BT)
    zs = i_bh * (BT * F) + r[:, None] * F  # + fc[None, :]: the program's dZ scratch rows
    for si in range(0, ns):
        tl.debug_barrier()  # the previous (later) mini-batch's gradient stores before this one's loads
        s = ns - 1 - si
        slot = (slot0 + s) * H + i_h
        carried = s < 0
        if HAS_A:
            carried = s == 0
        fresh = carried == 0
        lastmb = si == 0
        x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                       BDK, BDV, BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        e = _rows_e(es, slot, BT, DV, BDV)
        dO = tl.load(do + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        Ado = At[:, None] * dO
        cdo = ct[:, None] * dO
        Ax = At[:, None] * x
        cx = ct[:, None] * x
        eC = e * C_L[:, None]
        eM = e * Cm_L[:, None]
        de = tl.zeros([BT, BDV], dtype=tl.float32)
        dK = tl.zeros([BT, BDK], dtype=tl.float32)
        HG2 = tl.zeros([BT, BDV], dtype=tl.float32)  # Hd GW2_e
        HM2 = tl.zeros([BT, BDV], dtype=tl.float32)  # Hd GM2_e
        dC_L = tl.zeros([BT], dtype=tl.float32)
        dCm_L = tl.zeros([BT], dtype=tl.float32)
        sAL = tl.zeros([BF], dtype=tl.float32)  # per hidden unit, summed after the loop: dA_L, dc_L, dN_L
        scL = tl.zeros([BF], dtype=tl.float32)
        sNL = tl.zeros([BF], dtype=tl.float32)
        ss = slot * (BT * F) + r[:, None] * F  # the pre-pass's scratch rows of this slot
        # pass C: per hidden tile, the end state's gradients through the rank-1 terms; the start state's gradient but
        # for the anchor's f-side (pass D)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1, mm1, w2, mm2 = _state_tiles(sw1, sw2, sm1, sm2, slot, o1, o2, m1, m2, DK, DV, F)
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
            gw1, gm1, gw2, gm2 = _state_tiles(GW1, GW2, GM1, GM2, i_bh, o1, o2, m1, m2, DK, DV, F)
            Z = tl.dot(kk, U1, input_precision=PREC)
            Hd, dg = _gelu(Z)
            g1 = tl.dot(e, tl.trans(U2), input_precision=PREC)
            dz = g1 * dg
            fs = ss + fc[None, :]
            # dz's uses: the read (the pre-pass's), W1_e and M1_e
            KG1 = tl.dot(kk, gw1, input_precision=PREC)
            KM1 = tl.dot(kk, gm1, input_precision=PREC)
            ddz = tl.load(zr + fs, mask=fm[None, :], other=0.0) + C_L[:, None] * KG1 + Cm_L[:, None] * KM1
            dC_L += tl.sum(KG1 * dz, axis=1)
            dCm_L += tl.sum(KM1 * dz, axis=1)
            dK += tl.dot(dz * C_L[:, None], tl.trans(gw1), input_precision=PREC) \
                + tl.dot(dz * Cm_L[:, None], tl.trans(gm1), input_precision=PREC)
            # Hd's uses but f's: the read (the pre-pass's), W2_e and M2_e
            dHd = tl.load(hr + fs, mask=fm[None, :], other=0.0) + tl.dot(eC, tl.trans(gw2), input_precision=PREC) \
                + tl.dot(eM, tl.trans(gm2), input_precision=PREC)
            HG2 += tl.dot(Hd, gw2, input_precision=PREC)
            HM2 += tl.dot(Hd, gm2, input_precision=PREC)
            # dz = (e U2ᵀ) ⊙ σ'(Z), Hd = σ(Z)
            dg1 = ddz * dg
            de += tl.dot(dg1, U2, input_precision=PREC)
            dU2 = tl.dot(tl.trans(dg1), e, input_precision=PREC)
            tl.store(dZs + zs + fc[None, :], ddz * g1 * _gelu2(Z) + dHd * dg, mask=fm[None, :])
            # the end state's scalars
            sAL += tl.sum(gw1 * w1, axis=0) + tl.sum(gw2 * w2, axis=1)
            scL += tl.sum(gw1 * mm1, axis=0) + tl.sum(gw2 * mm2, axis=1)
            sNL += tl.sum(gm1 * mm1, axis=0) + tl.sum(gm2 * mm2, axis=1)
            # the start state's gradients (the read's terms from the pre-pass's dz1 and h; the anchor's f-side in
            # pass D); the final anchor's gradient moves to the last mini-batch's start weights when they are its
            # anchor
            if RT:  # the pre-pass's read terms
                r1 = tl.load(R1 + slot * (DK * F) + o1, mask=m1, other=0.0)
                rm1 = tl.load(RM1 + slot * (DK * F) + o1, mask=m1, other=0.0)
                r2 = tl.load(R2 + slot * (F * DV) + o2, mask=m2, other=0.0)
                rm2 = tl.load(RM2 + slot * (F * DV) + o2, mask=m2, other=0.0)
            else:
                dz1 = tl.load(z1s + fs, mask=fm[None, :], other=0.0)
                h = tl.load(hs + fs, mask=fm[None, :], other=0.0)
                r1 = tl.dot(tl.trans(Ax), dz1, input_precision=PREC)
                rm1 = tl.dot(tl.trans(cx), dz1, input_precision=PREC)
                r2 = tl.dot(tl.trans(h), Ado, input_precision=PREC)
                rm2 = tl.dot(tl.trans(h), cdo, input_precision=PREC)
            ga1 = tl.load(GA1 + p1, mask=m1 & lastmb & fresh, other=0.0)
            ga2 = tl.load(GA2 + p2, mask=m2 & lastmb & fresh, other=0.0)
            tl.store(GA1 + p1, tl.zeros_like(ga1), mask=m1 & lastmb & fresh)
            tl.store(GA2 + p2, tl.zeros_like(ga2), mask=m2 & lastmb & fresh)
            tl.store(GW1 + p1, A_L * gw1 + r1 + ga1, mask=m1)
            tl.store(GM1 + p1, c_L * gw1 + N_L * gm1 + rm1, mask=m1)
            tl.store(GW2 + p2, A_L * gw2 + r2 + ga2 + tl.where(fresh, dU2, 0.0), mask=m2)
            tl.store(GM2 + p2, c_L * gw2 + N_L * gm2 + rm2, mask=m2)
            if HAS_A:
                tl.store(GA2 + p2, tl.load(GA2 + p2, mask=m2 & carried, other=0.0) + dU2, mask=m2 & carried)
        tl.debug_barrier()  # the scratch and the gradients' stores before pass D reads them
        de += tl.load(des + slot * (BT * DV) + r[:, None] * DV + cv[None, :], mask=cvm[None, :], other=0.0) \
            + C_L[:, None] * HG2 + Cm_L[:, None] * HM2
        dC_L += tl.sum(HG2 * e, axis=1)
        dCm_L += tl.sum(HM2 * e, axis=1)
        df = tl.where(mv, de, 0.0)  # e = f − V
        # pass D: f = Hd U2, Hd = σ(Z), Z = K U1 — the anchor's gradient (the start weights', or the carried one's)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            U1, U2 = _anchor(A1_0, A2_0, i_bh, sw1, sw2, slot, s, o1, o2, m1, m2, DK, DV, F, HAS_A)
            Hd, dg = _gelu(tl.dot(kk, U1, input_precision=PREC))
            dZ = tl.load(dZs + zs + fc[None, :], mask=fm[None, :], other=0.0) \
                + tl.dot(df, tl.trans(U2), input_precision=PREC) * dg
            dU1 = tl.dot(tl.trans(kk), dZ, input_precision=PREC)
            dU2 = tl.dot(tl.trans(Hd), df, input_precision=PREC)
            dK += tl.dot(dZ, tl.trans(U1), input_precision=PREC)
            tl.store(GW1 + p1, tl.load(GW1 + p1, mask=m1 & fresh, other=0.0) + dU1, mask=m1 & fresh)
            tl.store(GW2 + p2, tl.load(GW2 + p2, mask=m2 & fresh, other=0.0) + dU2, mask=m2 & fresh)
            if HAS_A:
                tl.store(GA1 + p1, tl.load(GA1 + p1, mask=m1 & carried, other=0.0) + dU1, mask=m1 & carried)
                tl.store(GA2 + p2, tl.load(GA2 + p2, mask=m2 & carried, other=0.0) + dU2, mask=m2 & carried)
        dAt = tl.load(dAs + slot * BT + r)
        dct = tl.load(dcs + slot * BT + r)
        dC = tl.load(dCs + slot * (BT * BT) + r[:, None] * BT + r[None, :])
        dlg, dbt, dnv = _coefficients_back(lg, eta, nn, valid, dAt, dct, dC, tl.sum(sAL, axis=0),
                                           tl.sum(sNL, axis=0), tl.sum(scL, axis=0), dC_L, dCm_L, BT, PREC)
        # per value head: the glue sums dk over grouped heads (the pre-pass's part read back and completed)
        hk = (row[:, None] * H + i_h) * DK + ck[None, :]
        mk = valid[:, None] & ckm[None, :]
        tl.store(dk + hk, tl.load(dk + hk, mask=mk, other=0.0) + dK, mask=mk)
        tl.store(dv + (row[:, None] * H + i_h) * DV + cv[None, :], (-df).to(dv.dtype.element_ty), mask=mv)
        gate = row * H + i_h
        tl.store(dg_ptr + gate, dlg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.store(dbeta + gate, dbt.to(dbeta.dtype.element_ty), mask=valid)
        tl.store(dnu + gate, dnv.to(dnu.dtype.element_ty), mask=valid)


class _Titans(torch.autograd.Function):
    """Forward: `_state_kernel`, then `_readout_kernel`; backward: `_bwd_read_kernel`, then `_bwd_kernel` — with
    `titans_sliced.sliced_on(R, H)`, `_state_kernel` and (BWD) `_bwd_kernel` give way to `titans_sliced`'s kernels, the
    hidden width sliced over programs (the same stored start states and e). q, k [B, T, H_q, K], v [B, T, H, V], g,
    beta, nu [B, T, H], the state W1, W2, M1, M2 and the anchor A1, A2 ([R, H, K, F] / [R, H, F, V], fp32; the anchor
    is the weights themselves when offset is 0), then scale, offset, cu (int32 [N+1] on the device, or None), the
    `ttt._Plan`, steps (the most mini-batches of one sequence) and the kernels' constexprs. Returns (o [B, T, H, V] in
    v's dtype, the end W1, W2, M1, M2 and the last mini-batch's anchor A1, A2, fp32). The start states and e of every
    mini-batch ([slots, H, ·], 16·K·F + 4·b·V bytes a mini-batch at K = V) are written on every call: what the
    readout reads (a workspace of a call without gradients, freed after it) and the backward reads back."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, scale, offset, cu, plan, steps, geo):
        B, T = q.shape[:2]
        R, H = W1.shape[:2]
        f32 = dict(dtype=torch.float32, device=q.device)
        o = empty_output(B, T, H, v.shape[-1], dtype=v.dtype, device=q.device)
        flags = dict(HAS_A=offset > 0, IS_VARLEN=cu is not None)
        from . import titans_sliced  # (it imports this module's jit helpers)

        sliced = titans_sliced.sliced_on(R, H, capturing(q))  # `kernels.variants.titans`: the branch that names it
        if sliced:  # the hidden width sliced over programs, one launch a mini-batch (util.LAUNCH "titans_sliced")
            outs, slots, es = titans_sliced.sliced_forward(k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, offset=offset,
                                                           cu=cu, plan=plan, steps=steps,
                                                           geo=_site(geo, "titans_fwd", launch_keys=False))
        else:
            outs = [empty_output(*t.shape, **f32) for t in (W1, W2, M1, M2, A1, A2)]
            n = max(plan.slots, 1)
            slots = [empty_output(n, *t.shape[1:], **f32) for t in (W1, W2, M1, M2)]
            es = empty_output(n, H, geo["BT"], geo["DV"], **f32)
            seq = (cu if cu is not None else o, plan.first if plan.first is not None else o)
            _state_kernel[(R * H,)](k, v, g, beta, nu, W1, W2, M1, M2, A1, A2, *outs, *slots, es, *seq, T, offset,
                                    plan.NS, **flags, **_site(geo, "titans_fwd"))
        if plan.slots:
            pseq = (cu, plan.first, plan.seq_of) if cu is not None else (o, o, o)
            _readout_kernel[(plan.slots, H)](q, k, v, g, beta, nu, A1, A2, *slots, es, o, *pseq, scale, T, offset,
                                             plan.NS, **flags, **_site(geo, "titans_readout"))
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(q, k, v, g, beta, nu, A1, A2, *slots, es)
        ctx.geo, ctx.scale, ctx.offset, ctx.plan, ctx.cu, ctx.steps = geo, scale, offset, plan, cu, steps
        ctx.sliced = bool(sliced and tile("titans_sliced", "BWD"))  # the reverse pass sliced too
        return (o, *outs)

    @staticmethod
    def backward(ctx, do, *gouts):
        q, k, v, g, beta, nu, A1, A2, *rest = ctx.saved_tensors
        slots, es = rest[:4], rest[4]
        B, T, Hq, K = q.shape
        H, V = v.shape[2:]
        plan, geo, cu = ctx.plan, ctx.geo, ctx.cu
        R, F, BT = plan.R, A1.shape[-1], geo["BT"]
        f32 = dict(dtype=torch.float32, device=q.device)
        shapes = [(R, H, K, F), (R, H, F, V)] * 3

        def grad_in(t, shape):  # a fresh fp32 buffer: the kernel rewrites it in place
            return torch.zeros(shape, **f32) if t is None else t.to(torch.float32, copy=True).contiguous()

        do = torch.zeros(B, T, H, V, **f32) if do is None else do.contiguous()
        G = [grad_in(t, shape) for t, shape in zip(gouts, shapes)]  # W1, W2, M1, M2, then the anchor's A1, A2
        dq, dk = (empty_output(B, T, H, K, **f32) for _ in range(2))
        dv = empty_output(B, T, H, V, **f32)
        dg, dbeta, dnu = (empty_output(B, T, H, **f32) for _ in range(3))
        n = max(plan.slots, 1)
        RT = titans_backward(table()).read_terms  # the variant (`kernels.variants`): the branch that names it
        # the read's ∂/∂dz, ∂/∂Hd, then dz1 and h [slots, H, BT, F] — or (RT) the start gradient's read terms
        scratch = [empty_output(n, H, BT, F, **f32) for _ in range(2 if RT else 4)]
        terms = [empty_output(n, H, *t.shape[2:], **f32) for t in slots] if RT else [dq] * 4
        scratch += [dq] * 2 if RT else []
        des = empty_output(n, H, BT, V, **f32)
        dAs, dcs = (empty_output(n, H, BT, **f32) for _ in range(2))
        dCs = empty_output(n, H, BT, BT, **f32)
        flags = dict(HAS_A=ctx.offset > 0, IS_VARLEN=cu is not None)
        if plan.slots:
            pseq = (cu, plan.first, plan.seq_of) if cu is not None else (dq, dq, dq)
            _bwd_read_kernel[(plan.slots, H)](q, k, v, g, beta, nu, A1, A2, *slots, es, do, dq, dk, *scratch, *terms,
                                              des, dAs, dcs, dCs, *pseq, ctx.scale, T, ctx.offset, plan.NS, RT=RT,
                                              **flags, **_site(geo, "titans_bwd_read"))
        if ctx.sliced:  # the hidden width sliced over programs, one launch a mini-batch (util.LAUNCH "titans_sliced")
            from .titans_sliced import sliced_backward

            sliced_backward(q, k, v, g, beta, nu, A1, A2, slots, es, do, G, dk, dv, dg, dbeta, dnu,
                            [*scratch, *terms], des, dAs, dcs, dCs, scale=ctx.scale, offset=ctx.offset, cu=cu,
                            plan=plan, steps=ctx.steps, geo=_site(geo, "titans_fwd", launch_keys=False), RT=RT)
        else:
            dZs = torch.empty(R * H, BT, F, **f32)  # each sequential program's [b, F] scratch
            seq = (cu, plan.first) if cu is not None else (dq, dq)
            _bwd_kernel[(R * H,)](q, k, v, g, beta, nu, A1, A2, *slots, es, do, *G, dk, dv, dg, dbeta, dnu, dZs,
                                  *scratch, *terms, des, dAs, dcs, dCs, *seq, ctx.scale, T, ctx.offset, plan.NS, RT=RT,
                                  **flags, **_site(geo, "titans_bwd"))
        if Hq != H:  # grouped heads: the value heads of one q/k head summed
            dq = dq.view(B, T, Hq, H // Hq, K).sum(3)
            dk = dk.view(B, T, Hq, H // Hq, K).sum(3)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                dnu.to(nu.dtype), *G, None, None, None, None, None, None)


def _check(q, k, v, g, beta, nu, weights, momentum, anchor, offset: int, minibatch: int, cu_seqlens):
    """(H, K, V, F, cu: the boundaries of cu_seqlens as a list or None, R: the state's rows), or InputError naming
    the argument the kernel cannot take (shapes and dtypes; cu_seqlens's values)."""
    from ....chunkwise.varlen import check_cu_seqlens
    from ....inputs import check_tensor
    from ..args import check_qkv

    B, T, Hq, H, K, V = check_qkv(q, k, v)
    for name, d in (("K", K), ("V", V)):
        if d > MAX_TTT_DIM:
            raise InputError(f"the Titans kernel takes head dims ≤ {MAX_TTT_DIM}, got {name}={d}")
    if minibatch not in TTT_MINIBATCHES:
        raise InputError(f"the Titans kernel takes a mini-batch b in {TTT_MINIBATCHES}, got {minibatch!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < minibatch:
        raise InputError(f"offset must be an int in [0, {minibatch}), got {offset!r}")
    for name, gate in (("g", g), ("beta", beta), ("nu", nu)):
        check_tensor(name, gate, (B, T, H), values=False)
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    R = B if cu is None else len(cu) - 1
    F = None
    for name, pair in (("weights", weights), ("momentum", momentum), ("anchor", anchor)):
        if pair is None and name == "anchor":
            continue
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], Tensor) \
                or pair[0].dim() != 4:
            raise InputError(f"{name} must be 2 tensors (W1 [R, H, K, F], W2 [R, H, F, V]), R = {R} sequences")
        F = pair[0].shape[-1] if F is None else F
        check_tensor(f"{name}[0]", pair[0], (R, H, K, F), values=False)
        check_tensor(f"{name}[1]", pair[1], (R, H, F, V), values=False)
    if offset and anchor is None:
        raise InputError("offset > 0 needs the anchor (the weights the mini-batch started from)")
    return H, K, V, F, cu, R


def titans_triton(q, k, v, g, beta, nu, *, scale: float, weights, momentum, anchor=None, offset: int = 0,
                  minibatch: int = 16, cu_seqlens=None, tile: int | None = None, precision: str | None = None,
                  pipeline: str | None = None):
    """Titans' chunk form on the kernels (see the module doc); differentiable in every tensor.

    q, k: [B, T, H_q, K]; v: [B, T, H, V] (H_q | H: value head h reads q/k head h // (H / H_q)), one dtype of
    fp32/bf16/fp16; g (log retention, ≤ 0), beta (the step β), nu (the momentum decay ν) [B, T, H]; weights
    (W1 [R, H, K, F], W2 [R, H, F, V]) and momentum (same) the memory's state, one row per sequence (R = B, or N with
    cu_seqlens: int [N+1] packing N sequences along T with B = 1, each with its own state and mini-batches aligned to
    its own start, every one continuing its carried mini-batch by `offset` tokens); anchor (same) the weights the
    carried mini-batch started from, needed when offset > 0; minibatch b; tile: the hidden dim's tile BF (a power of
    two ≥ 16; None: `hidden_tile`). Returns (o [B, T, H, V] in v's dtype, end weights, end momentum, anchor of the
    last mini-batch — 2 fp32 tensors each, R rows — and the offset after the call; with cu_seqlens, a list: each
    sequence's): `chunkwise.minibatch`'s final MemoryState fields. precision: tl.dot's input precision
    (limits.DOT_PRECISIONS; None: `limits.loop_precision` for q's dtype). pipeline: "split" (this module's kernels)
    or "single" (`titans_single`'s); None: `limits.titans_pipeline` of K, V."""
    precision = check_precision(loop_precision("Titans", q.dtype) if precision is None else precision)
    H, K, V, F, cu, R = _check(q, k, v, g, beta, nu, weights, momentum, anchor, offset, minibatch, cu_seqlens)
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 16 or tile & (tile - 1)):
        raise InputError(f"tile must be a power of two ≥ 16, got {tile!r}")
    if pipeline not in (None, "single", "split"):
        raise InputError(f"pipeline must be 'single', 'split' or None, got {pipeline!r}")
    state = [t.float() for t in (*weights, *momentum, *(anchor if offset else weights))]
    B, T, Hq, _ = q.shape
    plan = _plan(B, T, offset, minibatch, cu, q.device)
    args = [t.contiguous() for t in (q, k, v, g, beta, nu, *state)]
    cu_dev = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    geo = dict(H=H, HQ=Hq, DK=K, DV=V, F=F, BDK=pow2(K), BDV=pow2(V), TILE=tile, BT=minibatch,
               PREC=precision)
    if (pipeline or titans_pipeline(K, V, table())) == "single":
        save = torch.is_grad_enabled() and any(t.requires_grad for t in args)  # else no start state is kept
        geo = {**{key: val for key, val in geo.items() if key != "TILE"}, "BF": tile or hidden_tile(K, V, F)}
        o, *outs = titans_single._Titans.apply(*args, float(scale), offset, save, cu_dev, plan, geo)
    else:
        steps = plan.NS if cu is None else max((-(-(offset + e - s) // minibatch) for s, e in zip(cu[:-1], cu[1:])),
                                               default=0)  # the most mini-batches of one sequence
        o, *outs = _Titans.apply(*args, float(scale), offset, cu_dev, plan, steps, geo)
    if cu is None:
        off = (offset + T) % minibatch
    else:
        off = [(offset + e - s) % minibatch for s, e in zip(cu[:-1], cu[1:])]
    return o, tuple(outs[:2]), tuple(outs[2:4]), tuple(outs[4:]), off
