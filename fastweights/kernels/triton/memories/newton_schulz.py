"""Muon's Newton–Schulz on Gram matrices (`chunkwise.minibatch._newton_schulz_gram`) in one Triton
program per matrix, each way: ATLAS's step at the ceilings shape spent ~70% of its memory traffic
there (17 batched r × r products per token and their autograd backward, each a round trip of
every token's matrices through GPU memory: measured on the CPU by bytes moved, 11.7 of 16.3 GiB of
one LM training step at L 64, B 4). Here a matrix is read once and its result written once; the
iteration runs in registers.

For G = X Xᵀ [r, r] (r ≤ MAX_NS_DIM, padded to R = max(16, next power of two): the padding is a
zero block, which the iteration keeps apart — the polynomial of a block-diagonal matrix is
block-diagonal):

    s = 1 / (√max(tr G, tiny) + 1e-7),  A₀ = s² G,  for n < steps:
    Q_n = aI + bA_n + cA_n²,  P_{n+1} = Q_n P_n (P₁ = Q₀),  A_{n+1} = Q_n A_n Q_n (n < steps − 1)
    out = s P_steps                                     (NS(X) = out · X)

Backward (nothing saved but G: the forward is recomputed in registers — with Muon's 5 steps every
A_n, Q_n, P_n is kept there, otherwise A_n and P_n are recomputed at each step of the reverse
sweep), with D = ∂L/∂out:

    ds = Σ D ⊙ P_steps,  dP_steps = s D,  for n = steps − 1 … 0:
    dQ_n = dP_{n+1} P_nᵀ (n > 0; dQ₀ = dP₁),  dP_n = Q_nᵀ dP_{n+1}
    dQ_n += dA_{n+1} (A_n Q_n)ᵀ + (Q_n A_n)ᵀ dA_{n+1},  dA_n = Q_nᵀ dA_{n+1} Q_nᵀ   (n < steps − 1)
    dA_n += b dQ_n + c (dQ_n A_nᵀ + A_nᵀ dQ_n)
    dG = s² dA₀ + (ds + 2s Σ dA₀ ⊙ G) · ∂s/∂tr · I,  ∂s/∂tr = −1 / (2√tr (√tr + 1e-7)²) (0 where tr < tiny)

— the reverse of the torch iteration's own autograd. fp32 throughout: tl.dot with input_precision
"ieee" (fp32 FMAs, as torch's fp32 bmm without TF32) unless the `precision` argument says "tf32x3"
(three TF32 tensor-core products per dot, about fp32's accuracy) or "tf32" (one: ~1e-3 per product,
below the tests' tolerance) — for a measurement on the GPU (`kernels.rows.generic_chunk(..., precision=)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import DOT_PRECISIONS, MAX_NS_DIM, NS_PRECISION
from ..common.util import check_precision

Tensor = torch.Tensor

__all__ = ["newton_schulz_gram", "ns_bmm", "MAX_NS_DIM", "NS_COEFFS", "PRECISIONS", "BMM_TILES"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
#: tl.dot's input precisions the kernels take (see the module doc).
PRECISIONS = DOT_PRECISIONS


@triton.jit
def _load(ptr, m, r, R: tl.constexpr):
    i = tl.arange(0, R)
    mask = (i[:, None] < r) & (i[None, :] < r)
    off = m * r * r + i[:, None] * r + i[None, :]
    return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32), off, mask


@triton.jit
def _step(A, P, eye, a, b, c, FIRST: tl.constexpr, LAST: tl.constexpr, PREC: tl.constexpr):
    """One iteration: (Q, P_{n+1}, A_{n+1}) from (A_n, P_n)."""
    Q = a * eye + b * A + c * tl.dot(A, A, input_precision=PREC)
    if FIRST:
        P = Q
    else:
        P = tl.dot(Q, P, input_precision=PREC)
    if not LAST:
        A = tl.dot(tl.dot(Q, A, input_precision=PREC), Q, input_precision=PREC)
    return Q, P, A


@triton.jit
def _ns_fwd(g_ptr, out_ptr, r, a, b, c, tiny, STEPS: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    G, off, mask = _load(g_ptr, m, r, R)
    i = tl.arange(0, R)
    eye = (i[:, None] == i[None, :]).to(tl.float32)
    tr = tl.sum(tl.sum(G * eye, axis=1), axis=0)
    s = 1.0 / (tl.sqrt(tl.maximum(tr, tiny)) + 1e-7)
    A = G * (s * s)
    P = eye
    for n in tl.static_range(STEPS):
        Q, P, A = _step(A, P, eye, a, b, c, n == 0, n == STEPS - 1, PREC)
    tl.store(out_ptr + off, P * s, mask=mask)


@triton.jit
def _back(dP, dA, Q, A, P, b, c, FIRST: tl.constexpr, LAST: tl.constexpr, PREC: tl.constexpr):
    """One step of the reverse sweep: (dP_n, dA_n) from (dP_{n+1}, dA_{n+1}) and Q_n, A_n, P_n
    (FIRST: n = 0, P₁ = Q₀; LAST: n = steps − 1, no A_{n+1})."""
    if FIRST:
        dQ = dP
    else:
        dQ = tl.dot(dP, tl.trans(P), input_precision=PREC)
        dP = tl.dot(tl.trans(Q), dP, input_precision=PREC)
    if LAST:
        dA = tl.zeros_like(dQ)
    else:
        AQ = tl.dot(A, Q, input_precision=PREC)
        QA = tl.dot(Q, A, input_precision=PREC)
        dQ += tl.dot(dA, tl.trans(AQ), input_precision=PREC) + tl.dot(tl.trans(QA), dA, input_precision=PREC)
        dA = tl.dot(tl.dot(tl.trans(Q), dA, input_precision=PREC), tl.trans(Q), input_precision=PREC)
    At = tl.trans(A)
    dA += b * dQ + c * (tl.dot(dQ, At, input_precision=PREC) + tl.dot(At, dQ, input_precision=PREC))
    return dP, dA


@triton.jit
def _ns_bwd(g_ptr, d_ptr, dg_ptr, r, a, b, c, tiny, STEPS: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    G, off, mask = _load(g_ptr, m, r, R)
    D, _, _ = _load(d_ptr, m, r, R)
    i = tl.arange(0, R)
    eye = (i[:, None] == i[None, :]).to(tl.float32)
    tr = tl.sum(tl.sum(G * eye, axis=1), axis=0)
    sq = tl.sqrt(tl.maximum(tr, tiny))
    s = 1.0 / (sq + 1e-7)
    A0 = G * (s * s)
    if STEPS == 5:  # Muon's count: every A_n, Q_n and P_n kept in registers, one forward pass
        Q0, P1, A1 = _step(A0, eye, eye, a, b, c, True, False, PREC)
        Q1, P2, A2 = _step(A1, P1, eye, a, b, c, False, False, PREC)
        Q2, P3, A3 = _step(A2, P2, eye, a, b, c, False, False, PREC)
        Q3, P4, A4 = _step(A3, P3, eye, a, b, c, False, False, PREC)
        Q4, P5, _ = _step(A4, P4, eye, a, b, c, False, True, PREC)
        ds = tl.sum(tl.sum(D * P5, axis=1), axis=0)
        dP = D * s
        dP, dA = _back(dP, dP, Q4, A4, P4, b, c, False, True, PREC)
        dP, dA = _back(dP, dA, Q3, A3, P3, b, c, False, False, PREC)
        dP, dA = _back(dP, dA, Q2, A2, P2, b, c, False, False, PREC)
        dP, dA = _back(dP, dA, Q1, A1, P1, b, c, False, False, PREC)
        dP, dA = _back(dP, dA, Q0, A0, eye, b, c, True, False, PREC)
    else:
        dA = _ns_bwd_recompute(A0, D, s, eye, a, b, c, STEPS, R, PREC)
        ds = _ns_ds(A0, D, eye, a, b, c, STEPS, PREC)
    ds += 2.0 * s * tl.sum(tl.sum(dA * G, axis=1), axis=0)
    dtr = tl.where(tr >= tiny, -ds / (2.0 * sq * (sq + 1e-7) * (sq + 1e-7)), 0.0)
    dG = dA * (s * s) + dtr * eye
    tl.store(dg_ptr + off, dG, mask=mask)


@triton.jit
def _ns_ds(A0, D, eye, a, b, c, STEPS: tl.constexpr, PREC: tl.constexpr):
    """Σ D ⊙ P_steps (the forward run once more)."""
    A = A0
    P = eye
    for n in tl.static_range(STEPS):
        Q, P, A = _step(A, P, eye, a, b, c, n == 0, n == STEPS - 1, PREC)
    return tl.sum(tl.sum(D * P, axis=1), axis=0)


@triton.jit
def _ns_bwd_recompute(A0, D, s, eye, a, b, c, STEPS: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """dA₀ for any step count: A_n and P_n recomputed from A₀ at each step of the reverse sweep."""
    dP = D * s
    dA = tl.zeros((R, R), dtype=tl.float32)
    for n in tl.static_range(STEPS - 1, -1, -1):
        An = A0  # A_n and P_n, recomputed from A₀
        Pn = eye
        for k in tl.static_range(n):
            _, Pn, An = _step(An, Pn, eye, a, b, c, k == 0, False, PREC)
        Q = a * eye + b * An + c * tl.dot(An, An, input_precision=PREC)
        if n == 0:
            dQ = dP
        else:
            dQ = tl.dot(dP, tl.trans(Pn), input_precision=PREC)
            dP = tl.dot(tl.trans(Q), dP, input_precision=PREC)
        if n < STEPS - 1:
            AQ = tl.dot(An, Q, input_precision=PREC)
            QA = tl.dot(Q, An, input_precision=PREC)
            dQ += tl.dot(dA, tl.trans(AQ), input_precision=PREC) + tl.dot(tl.trans(QA), dA, input_precision=PREC)
            dA = tl.dot(tl.dot(tl.trans(Q), dA, input_precision=PREC), tl.trans(Q), input_precision=PREC)
        At = tl.trans(An)
        dA += b * dQ + c * (tl.dot(dQ, At, input_precision=PREC) + tl.dot(At, dQ, input_precision=PREC))
    return dA


def _launch_args(G: Tensor):
    r = G.shape[-1]
    R = max(16, triton.next_power_of_2(r))
    return r, R, G.numel() // (r * r), (4 if R <= 32 else 8)


class NewtonSchulzGramFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, G: Tensor, steps: int, precision: str) -> Tensor:
        G = G.contiguous()
        r, R, M, warps = _launch_args(G)
        out = empty_output(*G.shape, dtype=G.dtype, device=G.device)
        if M > 0:
            _ns_fwd[(M,)](G, out, r, *NS_COEFFS, torch.finfo(torch.float32).tiny, STEPS=steps, R=R, PREC=precision,
                          num_warps=warps)
        ctx.save_for_backward(G)
        ctx.steps, ctx.prec = steps, precision
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        (G,) = ctx.saved_tensors
        r, R, M, warps = _launch_args(G)
        dG = empty_output(*G.shape, dtype=G.dtype, device=G.device)
        if M > 0:
            _ns_bwd[(M,)](G, dout.contiguous(), dG, r, *NS_COEFFS, torch.finfo(torch.float32).tiny, STEPS=ctx.steps,
                          R=R, PREC=ctx.prec, num_warps=warps)
        return dG, None, None


def newton_schulz_gram(G: Tensor, steps: int, *, precision: str = NS_PRECISION) -> Tensor:
    """P [..., r, r] with NS(X) = P X from the Gram matrix G = X Xᵀ [..., r, r] (fp32, r ≤ MAX_NS_DIM),
    `steps` iterations: `chunkwise.minibatch._newton_schulz_gram` in one kernel each way (see the
    module doc), tl.dot at `precision` (one of PRECISIONS). Differentiable in G (first order)."""
    if G.dtype != torch.float32:
        raise ValueError(f"newton_schulz_gram takes fp32 Gram matrices, got {G.dtype}")
    if G.dim() < 2 or G.shape[-1] != G.shape[-2] or not 1 <= G.shape[-1] <= MAX_NS_DIM:
        raise ValueError(f"G must be [..., r, r] with 1 ≤ r ≤ {MAX_NS_DIM}, got {list(G.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int ≥ 1, got {steps!r}")
    check_precision(precision)
    return NewtonSchulzGramFn.apply(G, steps, precision)


#: `ns_bmm`'s tiles (BM, BN, BK) and num_warps: [64, 64] fp32 accumulators, 32-wide K steps, 4 warps.
BMM_TILES = {"BM": 64, "BN": 64, "BK": 32, "num_warps": 4}


@triton.jit
def _bmm(a_ptr, b_ptr, c_ptr, out_ptr, n, m, k, alpha,
         sa0, sa1, sa2, sb0, sb1, sb2, sc0, sc1, sc2,
         HAS_C: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """out[z] = alpha · a[z] @ b[z] (+ c[z]) for one [BM, BN] tile of one batch entry z; a, b, c by strides."""
    i_m, i_n, z = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rm = i_m * BM + tl.arange(0, BM)
    rn = i_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + z * sa0 + rm[:, None] * sa1 + kk[None, :] * sa2,
                    mask=(rm[:, None] < n) & (kk[None, :] < k), other=0.0)
        b = tl.load(b_ptr + z * sb0 + kk[:, None] * sb1 + rn[None, :] * sb2,
                    mask=(kk[:, None] < k) & (rn[None, :] < m), other=0.0)
        acc += tl.dot(a, b, input_precision=PREC)
    acc = acc * alpha
    mask = (rm[:, None] < n) & (rn[None, :] < m)
    if HAS_C:
        acc += tl.load(c_ptr + z * sc0 + rm[:, None] * sc1 + rn[None, :] * sc2, mask=mask, other=0.0)
    tl.store(out_ptr + z * n * m + rm[:, None] * m + rn[None, :], acc, mask=mask)


def ns_bmm(a: Tensor, b: Tensor, c: Tensor | None = None, alpha: float = 1.0, *, precision: str = "tf32x3") -> Tensor:
    """c + alpha · a @ b (c None: alpha · a @ b) for fp32 a [M, n, k], b [M, k, m], c [M, n, m] (any strides: the
    backward's transposes are views), each product's tl.dot at `precision` — the products of the torch Newton–Schulz
    iteration at Gram sides the register kernel does not take (`chunkwise.minibatch._TF32Product`, the generic row's
    "tf32x3": three TF32 tensor-core products a dot inside the kernel, no hi / lo tensors through memory as the torch
    split writes). Not differentiable itself (its caller's Function differentiates). Returns a contiguous [M, n, m]."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or (c is not None and c.dtype != torch.float32):
        raise ValueError(f"ns_bmm takes fp32 tensors, got {a.dtype}, {b.dtype}" + (f", {c.dtype}" if c is not None
                                                                                   else ""))
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"ns_bmm takes a [M, n, k] and b [M, k, m], got {list(a.shape)} and {list(b.shape)}")
    M, n, k = a.shape
    m = b.shape[2]
    if c is not None and tuple(c.shape) != (M, n, m):
        raise ValueError(f"c must be [M, n, m] = {[M, n, m]}, got {list(c.shape)}")
    check_precision(precision)
    out = empty_output(M, n, m, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_() if c is None else out.copy_(c)
    t = BMM_TILES
    cc = c if c is not None else out
    grid = (triton.cdiv(n, t["BM"]), triton.cdiv(m, t["BN"]), M)
    _bmm[grid](a, b, cc, out, n, m, k, float(alpha), *a.stride(), *b.stride(), *cc.stride(), HAS_C=c is not None,
               BM=t["BM"], BN=t["BN"], BK=t["BK"], PREC=precision, num_warps=t["num_warps"])
    return out
