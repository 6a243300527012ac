"""MesaNet's chunked conjugate-gradient solve (`chunkwise.mesa._cg_flat`) in one Triton launch per kc tile size (at
most three at C = 64): every CG iteration of a chunk's C systems in programs of BR rows each (the backward's solve is
the same kernel).

Per chunk m (M = B·H·N chunks, the batch, heads and chunks flattened; h = head of m), for every token t of it:

    (H_t + Λ) x_t = b_t,   (H_t + Λ) x = d_t (x Hsᵀ) + Σ_{j≤t} A_tj (k_j · x) k_j + λ ⊙ x

Row t's system reads only its own x_t, d_t, A[t, :] and the chunk's shared Hs and kc, so the C rows split over
⌈C / BR⌉ programs (grid M × ⌈C / BR⌉; BR = CG_LAUNCH["rows"], 16 by default), each computing on its BR rows
Y = d ⊙ (X Hsᵀ) + ((X kcᵀ) ⊙ A) kc + λ ⊙ X (the torch form's `_flat_matvec`); kc rows past the block's last row
(A_tj = 0 there) are not read, and with CG_LAUNCH["causal"] not multiplied either: the row blocks launch grouped by
the power-of-two kc tile that covers their rows (`launches`; C = 64, 16 rows: tiles 16, 32, 64, 64 in 3 launches).
From x₀ = 0 it runs exactly `steps` iterations of the torch CG (`chunkwise.mesa._cg`; no early stop, the same
guards):

    Ap = op(p);  α = rr / (p·Ap + 1e-30);  x += α p;  r −= α Ap;  rr' = r·r;  p = r + (rr' / (rr + 1e-30)) p

per row, then one more matvec for the per-token relative residual ‖op(x_t) − b_t‖ / max(‖b_t‖, 1e-30) (what
`mesa_chunk` reports; the torch path computes it by a separate pass). A padded token (b_t = 0) gets α = 0: x_t = 0,
residual 0, as in the torch form.

Layout (fp32, contiguous): b, kc, x [M, C, K]; d [M, C]; Hs [M, K, K] (symmetric, read as Hsᵀ as the torch form
does); A [M, C, C] (lower-triangular decays × β); λ [H, K] (head h = (m // N) mod H); res [M, C]. A program keeps
x, r, p, Ap, b [BR, K] and Hsᵀ [K, K], kc [C, K], A [BR, C] on chip (C ≤ MAX_CG_C = 64, K ≤ MAX_CG_K = 128, each
padded to a power of two ≥ 16 — tl.dot's tile — and masked: padded rows and columns stay 0); CG_LAUNCH["stream"]
re-reads Hsᵀ and kc every iteration instead (L1/L2-resident). Products by tl.dot at `precision`: "ieee" (fp32 FMAs,
as torch's fp32 bmm without TF32: fp32 calls), "tf32" (one TF32 tensor-core product: bf16 calls,
`limits.mesa_cg_precision`; under the interpreter its operands are rounded to TF32 first: TF32's error) or
"tf32x3". sm_90 (Triton 3.6's ptxas, `scripts/sm90_report.py --pipelines mesa`): at K = 128 the one-program-per-
chunk kernel before this split spilled 45.8 KB a thread (32 registers); 16 rows at "tf32" spill nothing (164
registers at 8 warps), "ieee" 0.5 KB — docs/kernel_notes.md, "MesaNet's CG at the LM shape".

Cost per chunk and solve (s = steps; the ⌈C / BR⌉ programs together, full tiles; causal: the 4C²K term × 0.69 at
C = 64, BR = 16):
    FLOPs  (s + 1)·(2CK² + 4C²K + ~12CK)   (C = K = 64, s = 30: 4.9e7; C = 64, K = 128: 1.3e8)
    bytes  4·(⌈C / BR⌉(K² + CK) + 2CK + C² + C + K) read (Hs and kc once per program) + 4·(CK + C) written
against the torch form's ~14 launches per iteration, each a round trip of [M, C, K] through GPU memory.

`mesa_cg_triton` (the kernel), `mesa_cg_torch` (its twin: the torch CG on the same contract) and `mesa_cg` (the
glue: the kernel on CUDA tensors or under the interpreter, the twin elsewhere) take and return the same tensors.
Differentiation is the caller's (`chunkwise.mesa._CGSolve`: implicit, the backward solve by the same function).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ..common import interpreter  # (the interpreter's shims, applied before any kernel runs)
from ..common.limits import DOT_PRECISIONS, MAX_CG_C, MAX_CG_K, MESA_CG_PRECISION
from ..common.util import pow2

Tensor = torch.Tensor

__all__ = ["mesa_cg", "mesa_cg_triton", "mesa_cg_torch", "cg_kernel_serves", "launches", "CG_LAUNCH", "MAX_CG_C",
           "MAX_CG_K"]

#: The launch: rows of a chunk per program (a power of two ≥ 16, tl.dot's tile; capped by the chunk's padded C),
#: whether Hsᵀ and kc are re-read every iteration (True) or held in registers (False), whether the row blocks take
#: kc tiles cut at their last row (`launches`), and num_warps by the key tile (BK ≤ 64, else). Chosen from sm_90
#: register counts (docs/kernel_notes.md, "MesaNet's CG at the LM shape"), then timed (scripts/gpu_mesa_cg.py, H200,
#: r4s10 call 2, one solve at M 2048, K 128, bf16): 16 rows at 4 warps 2.89 ms against 8 warps 4.27, 32 rows 3.18,
#: 64 rows 4.49, Hsᵀ/kc streamed 4.23–5.70; every variant the same error (1.2e-4 of the float64 solve).
CG_LAUNCH = {"rows": 16, "stream": False, "causal": True, "warps_k64": 4, "warps_k128": 4}


@triton.jit
def _tf32(x):
    """x (fp32) rounded to TF32's 10 mantissa bits (to nearest, ties away: cvt.rna.tf32's rounding; a tensor core
    handed raw fp32 bits truncates instead — the same order of error, up to 2× per operand)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, EMU: tl.constexpr):
    """tl.dot(a, b) at PREC; EMU (the interpreter, whose dot ignores the precision): "tf32" as operands rounded to
    TF32, then an fp32 product — TF32's error, not bit-for-bit the GPU's numbers (`_tf32`)."""
    if EMU:
        return tl.dot(_tf32(a), _tf32(b), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _matvec(X, d, HsT, kc, A, lam, PREC: tl.constexpr, EMU: tl.constexpr):
    """d ⊙ (X Hsᵀ) + ((X kcᵀ) ⊙ A) kc + λ ⊙ X for X [BR, BK] (the torch form's `_flat_matvec` on BR rows)."""
    y = lam[None, :] * X + _dot(d[:, None] * X, HsT, PREC, EMU)
    s = _dot(X, tl.trans(kc), PREC, EMU) * A
    return y + _dot(s, kc, PREC, EMU)


@triton.jit
def _cg_kernel(b_ptr, d_ptr, hs_ptr, k_ptr, a_ptr, lam_ptr, x_ptr, res_ptr, N, H, C, K, steps, blk0,
               BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
               STREAM: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    h = (m // N) % H
    r0 = (blk0 + tl.program_id(1)) * BR  # this program's rows r0 … r0 + BR − 1 of the chunk (r0 + BR ≤ BC)
    rt = r0 + tl.arange(0, BR)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    mt = rt < C
    mk = rk < K
    tk = mt[:, None] & mk[None, :]
    off = m * C * K + rt[:, None] * K + rk[None, :]
    # kc rows j < min(C, r0 + BR) ≤ BC: the later rows meet A_tj = 0 (j > t) in these rows' systems — left unread
    k_off = k_ptr + m * C * K + rc[:, None] * K + rk[None, :]
    k_mask = ((rc < C) & (rc < r0 + BR))[:, None] & mk[None, :]
    h_off = hs_ptr + m * K * K + rk[None, :] * K + rk[:, None]  # Hsᵀ[i, j] = Hs[j, i]
    h_mask = mk[:, None] & mk[None, :]
    b = tl.load(b_ptr + off, mask=tk, other=0.0)
    A = tl.load(a_ptr + m * C * C + rt[:, None] * C + rc[None, :], mask=mt[:, None] & (rc < C)[None, :], other=0.0)
    d = tl.load(d_ptr + m * C + rt, mask=mt, other=0.0)
    lam = tl.load(lam_ptr + h * K + rk, mask=mk, other=0.0)
    HsT = tl.load(h_off, mask=h_mask, other=0.0)
    kc = tl.load(k_off, mask=k_mask, other=0.0)

    x = tl.zeros((BR, BK), dtype=tl.float32)
    r = b
    p = b
    rr = tl.sum(r * r, axis=1)
    for it in range(steps):
        if STREAM:  # re-read Hsᵀ and kc (L1/L2-resident) each iteration instead of holding them in registers
            live = it < steps  # (always true: keeps the loads in the loop)
            HsT = tl.load(h_off, mask=h_mask & live, other=0.0)
            kc = tl.load(k_off, mask=k_mask & live, other=0.0)
        Ap = _matvec(p, d, HsT, kc, A, lam, PREC, EMU)
        alpha = rr / (tl.sum(p * Ap, axis=1) + 1e-30)
        x = x + alpha[:, None] * p
        r = r - alpha[:, None] * Ap
        rr_new = tl.sum(r * r, axis=1)
        p = r + (rr_new / (rr + 1e-30))[:, None] * p
        rr = rr_new
    if STREAM:
        HsT = tl.load(h_off, mask=h_mask, other=0.0)
        kc = tl.load(k_off, mask=k_mask, other=0.0)
    e = _matvec(x, d, HsT, kc, A, lam, PREC, EMU) - b
    res = tl.sqrt(tl.sum(e * e, axis=1)) / tl.maximum(tl.sqrt(tl.sum(b * b, axis=1)), 1e-30)
    tl.store(x_ptr + off, x, mask=tk)
    tl.store(res_ptr + m * C + rt, res, mask=mt)


def cg_kernel_serves(C: int, K: int, dtype: torch.dtype) -> str | None:
    """Why the CG kernel cannot solve chunks of C tokens with K-wide keys in `dtype` (None when it can): fp32 (the
    float64 checks stay on the torch CG), C ≤ MAX_CG_C, K ≤ MAX_CG_K (its register tiles)."""
    if dtype != torch.float32:
        return f"the Mesa CG kernel solves in fp32, not {dtype}"
    if C > MAX_CG_C:
        return f"the Mesa CG kernel takes chunks C ≤ {MAX_CG_C}, got {C}"
    if K > MAX_CG_K:
        return f"the Mesa CG kernel takes key dims K ≤ {MAX_CG_K}, got {K}"
    return None


def _flat(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor):
    """The contract's tensors (b, kc [B, H, N, C, K]; d [B, H, N, C, 1]; Hs [B, H, N, K, K]; A [B, H, N, C, C];
    λ [1, H, 1, 1, K], any broadcastable views) as the kernel reads them: contiguous [M, ...] and λ [H, K]."""
    B, H, N, C, K = b.shape
    M = B * H * N
    flat = (b.reshape(M, C, K), d.expand(B, H, N, C, 1).reshape(M, C), Hs.reshape(M, K, K),
            kc.reshape(M, C, K), A.expand(B, H, N, C, C).reshape(M, C, C), lam.expand(1, H, 1, 1, K).reshape(H, K))
    return tuple(t.contiguous() for t in flat)


def _check(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, steps: int) -> None:
    if b.dim() != 5:
        raise InputError(f"b must be [B, H, N, C, K], got {list(b.shape)}")
    B, H, N, C, K = b.shape
    for name, t, shape in (("kc", kc, (B, H, N, C, K)), ("Hs", Hs, (B, H, N, K, K))):
        if tuple(t.shape) != shape:
            raise InputError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    for name, t, shape in (("d", d, (B, H, N, C, 1)), ("A", A, (B, H, N, C, C)), ("lam", lam, (1, H, 1, 1, K))):
        if t.dim() != 5 or any(s not in (1, w) for s, w in zip(t.shape, shape)):
            raise InputError(f"{name} must broadcast to {list(shape)}, got {list(t.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InputError(f"steps must be an int ≥ 0, got {steps!r}")


def launches(C: int, BR: int, causal: bool) -> list[tuple[int, int, int]]:
    """The CG kernel's launches for chunks of C rows in blocks of BR: (first row block, blocks, kc tile BC) each.
    causal: row block i reads kc rows < (i + 1)·BR only (A_tj = 0 for j > t), so the blocks are grouped by the
    smallest power-of-two tile covering them (BR 16, C 64: tiles 16, 32, 64, 64 — three launches, 31% of the
    X kcᵀ and (·) kc products left out); else one launch with the whole chunk's tile."""
    nb = -(-C // BR)
    if not causal:
        return [(0, nb, pow2(C))]
    out: list[tuple[int, int, int]] = []
    for blk in range(nb):
        BC = min(pow2(C), pow2((blk + 1) * BR))
        if out and out[-1][2] == BC:
            out[-1] = (out[-1][0], out[-1][1] + 1, BC)
        else:
            out.append((blk, 1, BC))
    return out


def mesa_cg_triton(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, steps: int,
                   precision: str = MESA_CG_PRECISION):
    """(x [B, H, N, C, K], res [B, H, N, C]): `steps` CG iterations of (H_t + Λ) x_t = b_t for every token of every
    chunk in one launch, and each token's relative residual (see the module doc). b, kc [B, H, N, C, K]; d
    [B, H, N, C, 1]; Hs [B, H, N, K, K]; A [B, H, N, C, C]; λ [1, H, 1, 1, K]; fp32, C ≤ MAX_CG_C, K ≤ MAX_CG_K.
    precision: tl.dot's ("ieee", "tf32x3", "tf32"; `limits.mesa_cg_precision` picks by the call's dtype).
    Not differentiable itself (the caller's implicit backward solves again)."""
    _check(b, d, Hs, kc, A, lam, steps)
    if precision not in DOT_PRECISIONS:
        raise InputError(f"precision must be one of {DOT_PRECISIONS}, got {precision!r}")
    B, H, N, C, K = b.shape
    why = cg_kernel_serves(C, K, b.dtype)
    if why is not None:
        raise InputError(why)
    bf, df, Hf, kf, Af, lf = _flat(*(t.detach().to(torch.float32) for t in (b, d, Hs, kc, A, lam)))
    M = B * H * N
    x = empty_output(M, C, K, dtype=torch.float32, device=b.device)
    res = empty_output(M, C, dtype=torch.float32, device=b.device)
    if M > 0 and C > 0 and K > 0:
        BK = pow2(K)
        BR = min(pow2(C), pow2(CG_LAUNCH["rows"]))
        emu = precision == "tf32" and interpreter.interpreting()
        warps = CG_LAUNCH["warps_k64" if BK <= 64 else "warps_k128"]
        for blk0, count, BC in launches(C, BR, bool(CG_LAUNCH["causal"])):
            _cg_kernel[(M, count)](bf, df, Hf, kf, Af, lf, x, res, N, H, C, K, steps, blk0, BR=BR, BC=BC, BK=BK,
                                   PREC=precision, EMU=emu, STREAM=bool(CG_LAUNCH["stream"]), num_warps=warps)
    return x.view(B, H, N, C, K), res.view(B, H, N, C)


def mesa_cg_torch(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, steps: int):
    """The kernel's twin on the same contract: the torch CG of `chunkwise.mesa` (`_cg_flat`) and the relative
    residual by one more `_flat_matvec` (any dtype, any device)."""
    from ....chunkwise.mesa import _cg_flat, _flat_matvec

    _check(b, d, Hs, kc, A, lam, steps)
    B, H, N, C, K = b.shape
    with torch.no_grad():
        x = _cg_flat(b, d, Hs, kc, A, lam, steps)
        b3 = b.reshape(-1, C, K)
        e = _flat_matvec(d, Hs, kc, A, lam)(x.reshape(-1, C, K)) - b3
        res = e.norm(dim=-1) / b3.norm(dim=-1).clamp_min(1e-30)
    return x, res.view(B, H, N, C)


def mesa_cg(b: Tensor, d: Tensor, Hs: Tensor, kc: Tensor, A: Tensor, lam: Tensor, steps: int,
            precision: str = MESA_CG_PRECISION):
    """The glue: `mesa_cg_triton` on CUDA tensors or under Triton's interpreter (CPU tensors in the tests), else
    `mesa_cg_torch` (same contract; its fp32 products equal the kernel's "ieee" to rounding — the torch twin
    ignores `precision`)."""
    if b.is_cuda or interpreter.interpreting():
        return mesa_cg_triton(b, d, Hs, kc, A, lam, steps, precision)
    return mesa_cg_torch(b, d, Hs, kc, A, lam, steps)
