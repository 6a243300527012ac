"""Titans' inner mini-batch loop (`chunkwise.minibatch` for the recipe `titans`) in one Triton program per
(sequence, value head): the design of `ttt_mlp.py` (the MLP's weights in a per-program global scratch streamed in
hidden tiles) for Titans' memory and optimizer. Forward only so far (see "Status" below).

The memory (Behrouz et al. 2024, the zoo's `titans`): a 2-layer MLP without biases or residual LayerNorm, hidden
width F (4K in the zoo), σ = GELU (erf form, σ(z) = z Φ(z), σ'(z) = Φ(z) + z φ(z)):

    M_θ(x) = σ(x W1) W2                      θ = (W1 [K, F], W2 [F, V])

inner loss ℓ_t(θ) = ½‖M_θ(k_t) − v_t‖², the momentum optimizer with the step inside the momentum and scalar
retention, per token t (gates a_t = exp(g_t) the retention, ν_t the momentum decay, β_t the step; [B, T, H] each):

    m_t = ν_t m_{t−1} − β_t ∇ℓ_t(θ₀),     θ_t = a_t θ_{t−1} + m_t        (`reference.recurrent`)

with every gradient of a mini-batch (b tokens aligned to the sequence start) taken at its anchor θ₀, the weights
it started from. decay_first=False (the zoo's) decays θ after the gradient is taken; as the gradient is taken at
θ₀, not at θ_{t−1}, the order is immaterial for b > 1: decay_first=True is the same recurrence.

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
state's output tensors, which the kernel first fills with the initial state and then updates in place, mini-batch by
mini-batch — each tile of W1 [K, BF], M1, W2 [BF, V], M2 is rewritten in the same iteration that read it, after the
read (as `ttt_mlp.py`'s rolled slot; a `tl.debug_barrier` between mini-batches, num_stages = 1). The carried anchor
(offset > 0) is read from its own input in the first mini-batch only; the last mini-batch's anchor is written out.

Forward (`_fwd_kernel`), per mini-batch: the coefficients from the gates ([b, b] in registers); pass 1 over the
hidden tiles accumulates f (then e); pass 2 recomputes Z, forms dz, the read's z1 and h, accumulates o's two start
terms and h Hdᵀ, and rewrites the tile's W1, M1, W2, M2 to the segment's end; o from the accumulators.

FLOPs and bytes per token (K = V = D, F = 4D as the zoo's; a multiply-add 2 FLOPs; the O(bD) and O(b²D) terms left
out):
- forward: pass 1 K U1, Hd U2 (4DF); pass 2 K U1 again, e U2ᵀ, X W1_s, X M1_s, h W2_s, h M2_s and the four end
  updates Kᵀ(C_L dz), Kᵀ(Cm_L dz), Hdᵀ(C_L e), Hdᵀ(Cm_L e) (22DF), (C ∘ XKᵀ) dz and h Hdᵀ (4bF):
  26DF + 4bF = 104D² + 16bD, 442 kFLOP at D = 64, b = 16 (of which 2DF recompute pass 1's Z rather than keep it).
- on-chip traffic (the state's scratch, L2-resident): per mini-batch pass 1 reads U1, U2 (8DF bytes), pass 2 reads
  W1, W2, M1, M2 (the anchor is W_s's tile, read once) and writes them (32DF): 40DF/b = 160D²/b bytes a token,
  40 KiB at D = 64, b = 16.
- HBM: q, k, v in and o out (2K + 2V elements a token), the three gates (3 a token); the state read and written
  once per call.
The tl.dot products are fp32 at the call's `precision` ("ieee" by default: FMAs, no tensor cores); one program
walks its sequence's T/b mini-batches in order, B·H programs in all.

Limits: K, V ≤ MAX_TTT_DIM (each padded to a power of two ≥ 16), F any width (tiles masked), b ∈ TTT_MINIBATCHES;
varlen (`cu_seqlens`: one program per (sequence, head), each sequence's mini-batches from its own start); grouped
heads (value head h reads q/k head h // (H / H_q)).

Status: forward only — `titans_triton` refuses a call that needs gradients (InputError), and the generic row
(`kernels.rows.titans_chunk`) runs such calls on the torch mini-batch form. The backward (reverse over the
mini-batches from per-mini-batch stored θ_s, m_s: 16DF bytes a mini-batch) is not written yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import MAX_TTT_DIM, TITANS_PRECISION, TTT_MINIBATCHES
from ..common.util import check_precision, launch, pow2
from .ttt import _plan, _sequence

Tensor = torch.Tensor

__all__ = ["titans_triton", "hidden_tile", "PRECISION"]

#: The kernel's default tl.dot input precision (the `precision` argument; limits.DOT_PRECISIONS).
PRECISION = TITANS_PRECISION

#: The most fp32 values of one [max(K, V), BF] weight tile (the hidden tile BF = this / pow2(max(K, V)), in
#: [16, pow2(F)]): pass 2 holds four of them (W1, M1, W2, M2) and the anchor's two.
TILE_ELEMENTS = 2048
_RSQRT2 = tl.constexpr(0.7071067811865476)  # 1 / √2 (a constexpr: a jit function reads only those globals)
_RSQRT2PI = tl.constexpr(0.3989422804014327)  # 1 / √(2π)
_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: log ν's clamp


def hidden_tile(K: int, V: int, F: int) -> int:
    """The hidden dim's tile BF of the kernel for head dims K, V and hidden width F (a power of two ≥ 16)."""
    return max(16, min(pow2(F), TILE_ELEMENTS // pow2(max(K, V))))


@triton.jit
def _gelu(z):
    """(σ(z), σ'(z)) of GELU's erf form, elementwise: σ = z Φ(z), σ' = Φ(z) + z φ(z)."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * _RSQRT2))
    return z * cdf, cdf + z * tl.exp(-0.5 * z * z) * _RSQRT2PI


@triton.jit
def _rows(q, k, v, g, beta, nu, bos, i_h, s, T, off, scale, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr,
          DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr):
    """Mini-batch s's rows of the sequence at row bos of T tokens (position r is its token s·b + r − off): x = scale·q,
    k [BT, BDK] and v [BT, BDV] (fp32, 0 outside the sequence), the gates log a, β [BT] (0 outside) and ν [BT] (1
    outside), the token rows' offsets, their validity and the [BT, BDV] mask of o."""
    r = tl.arange(0, BT)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    t = s * BT + r - off
    valid = (t >= 0) & (t < T)
    row = bos + tl.where(valid, t, 0)
    i_hq = i_h // (H // HQ)
    mk = valid[:, None] & (ck < DK)[None, :]
    mv = valid[:, None] & (cv < DV)[None, :]
    qk = (row[:, None] * HQ + i_hq) * DK + ck[None, :]
    x = tl.load(q + qk, mask=mk, other=0.0).to(tl.float32) * scale
    kk = tl.load(k + qk, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v + (row[:, None] * H + i_h) * DV + cv[None, :], mask=mv, other=0.0).to(tl.float32)
    gate = row * H + i_h
    lg = tl.load(g + gate, mask=valid, other=0.0).to(tl.float32)
    eta = tl.load(beta + gate, mask=valid, other=0.0).to(tl.float32)
    nn = tl.load(nu + gate, mask=valid, other=1.0).to(tl.float32)
    return x, kk, vv, lg, eta, nn, row, valid, mv


@triton.jit
def _coefficients(lg, eta, nn, valid, BT: tl.constexpr, PREC: tl.constexpr):
    """The segment's coefficients from its gates log a, β, ν [BT] and its rows' validity (module doc): per row A_t,
    c_t [BT], the matrix C [BT, BT], and the last row's A_L, N_L, c_L (scalars), C_L, Cm_L [BT]."""
    r = tl.arange(0, BT)
    tri = r[:, None] >= r[None, :]
    la = tl.sum(tl.where(tri, lg[None, :], 0.0), axis=1)  # log A_t (an inclusive cumsum)
    ln = tl.sum(tl.where(tri, tl.log(tl.maximum(nn, _TINY))[None, :], 0.0), axis=1)  # log N_t
    # A_t / A_u for u ≤ t and u a token of the segment (a padded row adds no m_u to θ)
    Ra = tl.where(tri & valid[None, :], tl.exp(tl.where(tri, la[:, None] - la[None, :], 0.0)), 0.0)
    Cm = tl.where(tri, -eta[None, :] * tl.exp(tl.where(tri, ln[:, None] - ln[None, :], 0.0)), 0.0)
    C = tl.dot(Ra, Cm, input_precision=PREC)
    Nt = tl.exp(ln)
    At = tl.exp(la)
    ct = tl.sum(Ra * Nt[None, :], axis=1)
    end = r == BT - 1
    C_L = tl.sum(tl.where(end[:, None], C, 0.0), axis=0)
    Cm_L = tl.sum(tl.where(end[:, None], Cm, 0.0), axis=0)
    A_L = tl.sum(tl.where(end, At, 0.0), axis=0)
    N_L = tl.sum(tl.where(end, Nt, 0.0), axis=0)
    c_L = tl.sum(tl.where(end, ct, 0.0), axis=0)
    return At, ct, C, A_L, N_L, c_L, C_L, Cm_L


@triton.jit
def _hidden(f0, ck, ckm, cv, cvm, DK: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, BF: tl.constexpr):
    """Hidden tile f0's indices fc [BF], mask fm, and within one (sequence, head) the offsets o1 [BDK, BF] of a
    [K, F] matrix's tile and o2 [BF, BDV] of an [F, V] one's, with their masks m1, m2."""
    fc = f0 + tl.arange(0, BF)
    fm = fc < F
    return fc, fm, ck[:, None] * F + fc[None, :], fc[:, None] * DV + cv[None, :], ckm[:, None] & fm[None, :], \
        fm[:, None] & cvm[None, :]


@triton.jit
def _anchor(A1_0, A2_0, W1, W2, i_bh, carried, fresh, o1, o2, m1, m2, DK: tl.constexpr, DV: tl.constexpr,
            F: tl.constexpr):
    """The anchor's tiles (U1 [BDK, BF], U2 [BF, BDV]): the carried anchor's when `carried` (the first mini-batch of
    a call with offset > 0), else the running weights' (each read from one place only)."""
    U1 = tl.load(A1_0 + i_bh * (DK * F) + o1, mask=m1 & carried, other=0.0) \
        + tl.load(W1 + i_bh * (DK * F) + o1, mask=m1 & fresh, other=0.0)
    U2 = tl.load(A2_0 + i_bh * (F * DV) + o2, mask=m2 & carried, other=0.0) \
        + tl.load(W2 + i_bh * (F * DV) + o2, mask=m2 & fresh, other=0.0)
    return U1, U2


@triton.jit
def _fwd_kernel(q, k, v, g, beta, nu, W1_0, W2_0, M1_0, M2_0, A1_0, A2_0, o, W1, W2, M1, M2, A1o, A2o, cu, slots,
                scale, T, off, NS, H: tl.constexpr, HQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                F: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr,
                PREC: tl.constexpr, HAS_A: tl.constexpr, IS_VARLEN: tl.constexpr):
    # W1, W2, M1, M2 [R·H, ·]: the final state's outputs, the running state (filled with the initial one first)
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H  # i_b: the sequence (batch row, or cu_seqlens's)
    bos, Tn, ns, _ = _sequence(i_b, T, off, NS, cu, slots, BT, IS_VARLEN)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ckm = ck < DK
    cvm = cv < DV
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
        carried = s < 0  # the first mini-batch of a call with offset > 0: its anchor is the carried one
        if HAS_A:
            carried = s == 0
        fresh = carried == 0
        last = s == ns - 1
        x, kk, vv, lg, eta, nn, row, valid, mv = _rows(q, k, v, g, beta, nu, bos, i_h, s, Tn, off, scale, H, HQ, DK, DV,
                                                BDK, BDV, BT)
        At, ct, C, A_L, N_L, c_L, C_L, Cm_L = _coefficients(lg, eta, nn, valid, BT, PREC)
        # pass 1: f at the anchor, then e = ∂ℓ/∂f
        f = tl.zeros([BT, BDV], dtype=tl.float32)
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            U1, U2 = _anchor(A1_0, A2_0, W1, W2, i_bh, carried, fresh, o1, o2, m1, m2, DK, DV, F)
            Hd, _ = _gelu(tl.dot(kk, U1, input_precision=PREC))
            f += tl.dot(Hd, U2, input_precision=PREC)
        e = tl.where(mv, f - vv, 0.0)
        X1 = C * tl.dot(x, tl.trans(kk), input_precision=PREC)  # C ∘ X Kᵀ
        zW = tl.zeros([BT, BDV], dtype=tl.float32)  # h W2_s
        zM = tl.zeros([BT, BDV], dtype=tl.float32)  # h M2_s
        S2 = tl.zeros([BT, BT], dtype=tl.float32)  # h Hdᵀ
        eC = e * C_L[:, None]
        eM = e * Cm_L[:, None]
        # pass 2: per hidden tile, dz, the read's first layer, o's accumulators, and the tile's end state
        for f0 in range(0, F, BF):
            fc, fm, o1, o2, m1, m2 = _hidden(f0, ck, ckm, cv, cvm, DK, DV, F, BF)
            p1 = i_bh * (DK * F) + o1
            p2 = i_bh * (F * DV) + o2
            w1 = tl.load(W1 + p1, mask=m1, other=0.0)
            mm1 = tl.load(M1 + p1, mask=m1, other=0.0)
            w2 = tl.load(W2 + p2, mask=m2, other=0.0)
            mm2 = tl.load(M2 + p2, mask=m2, other=0.0)
            U1, U2 = w1, w2
            if HAS_A:
                U1 = tl.where(carried, tl.load(A1_0 + p1, mask=m1 & carried, other=0.0), w1)
                U2 = tl.where(carried, tl.load(A2_0 + p2, mask=m2 & carried, other=0.0), w2)
            Hd, dg = _gelu(tl.dot(kk, U1, input_precision=PREC))
            dz = tl.dot(e, tl.trans(U2), input_precision=PREC) * dg
            z1 = At[:, None] * tl.dot(x, w1, input_precision=PREC) \
                + ct[:, None] * tl.dot(x, mm1, input_precision=PREC) + tl.dot(X1, dz, input_precision=PREC)
            h, _ = _gelu(z1)
            zW += tl.dot(h, w2, input_precision=PREC)
            zM += tl.dot(h, mm2, input_precision=PREC)
            S2 += tl.dot(h, tl.trans(Hd), input_precision=PREC)
            # the call's last mini-batch: its anchor out
            tl.store(A1o + p1, U1, mask=m1 & last)
            tl.store(A2o + p2, U2, mask=m2 & last)
            kT = tl.trans(kk)
            HT = tl.trans(Hd)
            tl.store(W1 + p1, A_L * w1 + c_L * mm1 + tl.dot(kT, dz * C_L[:, None], input_precision=PREC), mask=m1)
            tl.store(M1 + p1, N_L * mm1 + tl.dot(kT, dz * Cm_L[:, None], input_precision=PREC), mask=m1)
            tl.store(W2 + p2, A_L * w2 + c_L * mm2 + tl.dot(HT, eC, input_precision=PREC), mask=m2)
            tl.store(M2 + p2, N_L * mm2 + tl.dot(HT, eM, input_precision=PREC), mask=m2)
        out = At[:, None] * zW + ct[:, None] * zM + tl.dot(C * S2, e, input_precision=PREC)
        tl.store(o + (row[:, None] * H + i_h) * DV + cv[None, :], out.to(o.dtype.element_ty), mask=mv)


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
                  minibatch: int = 16, cu_seqlens=None, tile: int | None = None, precision: str = PRECISION):
    """Titans' chunk form on the kernel (see the module doc); forward only: a call that needs gradients (grad enabled
    and an input that requires one) is refused.

    q, k: [B, T, H_q, K]; v: [B, T, H, V] (H_q | H: value head h reads q/k head h // (H / H_q)), one dtype of
    fp32/bf16/fp16; g (log retention, ≤ 0), beta (the step β), nu (the momentum decay ν) [B, T, H]; weights
    (W1 [R, H, K, F], W2 [R, H, F, V]) and momentum (same) the memory's state, one row per sequence (R = B, or N with
    cu_seqlens: int [N+1] packing N sequences along T with B = 1, each with its own state and mini-batches aligned to
    its own start, every one continuing its carried mini-batch by `offset` tokens); anchor (same) the weights the
    carried mini-batch started from, needed when offset > 0; minibatch b; tile: the hidden dim's tile BF (a power of
    two ≥ 16; None: `hidden_tile`). Returns (o [B, T, H, V] in v's dtype, end weights, end momentum, anchor of the
    last mini-batch — 2 fp32 tensors each, R rows — and the offset after the call; with cu_seqlens, a list: each
    sequence's): `chunkwise.minibatch`'s final MemoryState fields. precision: tl.dot's input precision
    (limits.DOT_PRECISIONS)."""
    check_precision(precision)
    H, K, V, F, cu, R = _check(q, k, v, g, beta, nu, weights, momentum, anchor, offset, minibatch, cu_seqlens)
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 16 or tile & (tile - 1)):
        raise InputError(f"tile must be a power of two ≥ 16, got {tile!r}")
    state = [*weights, *momentum, *(anchor if offset else weights)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, nu, *state)):
        raise InputError("the Titans kernel has no backward yet: call it under torch.no_grad() or on tensors that "
                         "need no gradient (the generic row runs such calls on the torch mini-batch form)")
    B, T, Hq, _ = q.shape
    plan = _plan(B, T, offset, minibatch, cu, q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = empty_output(B, T, H, V, dtype=v.dtype, device=q.device)
    outs = [empty_output(R, H, K, F, **f32), empty_output(R, H, F, V, **f32), empty_output(R, H, K, F, **f32),
            empty_output(R, H, F, V, **f32), empty_output(R, H, K, F, **f32), empty_output(R, H, F, V, **f32)]
    W1, W2, M1, M2, A1, A2 = (t.float().contiguous() for t in state)
    cu_dev = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
    seq = (cu_dev if cu_dev is not None else o, plan.first if plan.first is not None else o)
    args = [t.contiguous() for t in (q, k, v, g, beta, nu)]
    _fwd_kernel[(R * H,)](*args, W1, W2, M1, M2, A1, A2, o, *outs, *seq, float(scale), T, offset, plan.NS, H=H, HQ=Hq,
                          DK=K, DV=V, F=F, BDK=pow2(K), BDV=pow2(V), BF=tile or hidden_tile(K, V, F), BT=minibatch,
                          PREC=precision, HAS_A=offset > 0, IS_VARLEN=cu is not None, **launch("titans_fwd"))
    if cu is None:
        off = (offset + T) % minibatch
    else:
        off = [(offset + e - s) % minibatch for s, e in zip(cu[:-1], cu[1:])]
    return o, tuple(outs[:2]), tuple(outs[2:4]), tuple(outs[4:]), off
