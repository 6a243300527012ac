"""Stages shared by the chunk engines of the gated-linear class (gated.py) and the delta class
(delta.py). Every stage is a plain function with its maths and shapes here, tested on its own
(tests/chunkwise/test_common.py); a kernel backend mirrors them one to one.

    chunk_inputs    q, k, v [B, T, H, ·] → chunks [B, H, N, C, ·] in the compute dtype (+ S_0)
    chunk_cumsum    g → G, the chunk-local cumulative log-decay
    decayed_scores  P_ij = Σ_d x_id y_jd e^{gx_id − gy_jd} on the causal mask (QKᵀ, KKᵀ with decay)
    pass_states     S_{n+1} = M_n S_n + B_n from chunk to chunk: the one sequential stage
    chunk_outputs   o = o_intra + Q̃ S_n, back to [B, T, H, V]

Notation: chunks of C rows; N chunks per batch row; G_i = Σ_{s ≤ i} g_s counted from the chunk's
first row. Decays only ever appear as exponentials of differences of chunk-local cumsums that are
≤ 0, never of a global cumsum, so nothing overflows whatever g is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..inputs import InputError, check_tensor
from ..state import compute_dtype
from .varlen import ChunkLayout, make_layout, scan_chunks

Tensor = torch.Tensor

__all__ = ["autocast_off", "tf32_matmuls", "under_functorch", "Chunked", "chunk_inputs", "gate_kind", "scalar_or_diag",
           "chunk_cumsum", "decayed_scores", "exp", "pass_states", "chunk_outputs", "initial_state_or_zeros"]


def autocast_off(device_type: str):
    """torch.autocast(device_type, enabled=False): what a form runs in its own precision under; nothing on the meta
    device (shapes traced without data, e.g. the FLOP counts of `bench.floors`), which autocast does not know."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


@contextlib.contextmanager
def tf32_matmuls():
    """CUDA fp32 matmuls on TF32 tensor cores inside the block (cuBLAS's fp32 precision "tf32": operands rounded to
    10 mantissa bits, fp32 accumulation), the previous setting restored after; through the legacy
    `allow_tf32` flag where the process set TF32 that way (torch refuses to mix the two). Users: MesaNet's form
    (`chunkwise.mesa._TF32Region`), ATLAS's torch Newton–Schulz (`chunkwise.minibatch._TF32Product`)."""
    m = torch.backends.cuda.matmul
    try:
        prev, key = m.fp32_precision, "fp32_precision"
        m.fp32_precision = "tf32"
    except (AttributeError, RuntimeError):  # torch without the new API, or the legacy flag in use
        prev, key = m.allow_tf32, "allow_tf32"
        m.allow_tf32 = True
    try:
        yield
    finally:
        setattr(m, key, prev)


def gate_kind(g: Tensor | None, B: int, T: int, H: int, K: int) -> str:
    """'none', 'scalar' ([B, T, H]) or 'diagonal' ([B, T, H, K]); raises on any other shape."""
    if g is None:
        return "none"
    if not isinstance(g, Tensor) or not g.is_floating_point():
        raise InputError(f"g must be a floating-point tensor [B, T, H] or [B, T, H, K], got {type(g).__name__}"
                         f"{'' if not isinstance(g, Tensor) else ' of ' + str(g.dtype)}")
    if tuple(g.shape) == (B, T, H):
        return "scalar"
    if tuple(g.shape) == (B, T, H, K):
        return "diagonal"
    raise InputError(f"g must have shape [B, T, H] = {[B, T, H]} (scalar) or [B, T, H, K] = {[B, T, H, K]} "
                     f"(diagonal), got {list(g.shape)}")


def initial_state_or_zeros(initial_state, layout: ChunkLayout, H: int, K: int, V: int, dtype, device) -> Tensor:
    """S_0 [B or N, H, K, V] in the compute dtype (zeros when not given)."""
    rows = layout.num_sequences
    if initial_state is None:
        return torch.zeros(rows, H, K, V, dtype=dtype, device=device)
    what = "number of sequences N (len(cu_seqlens) − 1)" if layout.varlen else "batch B"
    if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (rows, H, K, V):
        shape = list(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
        raise InputError(f"initial_state must have shape [{what}, H, K, V] = {[rows, H, K, V]}, got {shape}")
    check_tensor("initial_state", initial_state, (rows, H, K, V), values=False)
    return initial_state.to(dtype)


def scalar_or_diag(G: Tensor, kind: str) -> Tensor:
    """A chunked log-decay [B, H, N, C] (scalar) or [B, H, N, C, K] (diagonal) made to broadcast
    against row vectors [B, H, N, C, K]."""
    return G.unsqueeze(-1) if kind == "scalar" else G


@dataclass
class Chunked:
    """The inputs every chunk engine starts from: shapes, gate kind, compute dtype, layout, the
    initial state and q (scaled), k, v cut into chunks [B, H, N, C, ·] in the compute dtype."""

    B: int
    T: int
    H: int
    K: int
    V: int
    kind: str
    cdt: torch.dtype
    layout: ChunkLayout
    S0: Tensor
    qc: Tensor
    kc: Tensor
    vc: Tensor


def chunk_inputs(q: Tensor, k: Tensor, v: Tensor, *, beta, g, scale, initial_state, chunk_size,
                 cu_seqlens) -> Chunked:
    """Stage 0. Check q, k, v [B, T, H, ·], β [B, T, H] and g; cut them into chunks (see `Chunked`)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise InputError(f"q must be 4-D [B, T, H, K], got {list(q.shape) if isinstance(q, Tensor) else q!r}")
    B, T, H, K = q.shape
    V = v.shape[-1] if isinstance(v, Tensor) and v.dim() == 4 else -1
    check_tensor("k", k, (B, T, H, K), values=False)
    check_tensor("v", v, (B, T, H, V), values=False)
    if beta is not None:
        check_tensor("beta", beta, (B, T, H), values=False)
    kind = gate_kind(g, B, T, H, K)
    cdt = compute_dtype(q)
    scale = K ** -0.5 if scale is None else float(scale)
    layout = make_layout(B, T, chunk_size, cu_seqlens, device=q.device)
    S0 = initial_state_or_zeros(initial_state, layout, H, K, V, cdt, q.device)
    return Chunked(B=B, T=T, H=H, K=K, V=V, kind=kind, cdt=cdt, layout=layout, S0=S0,
                   qc=layout.to_chunks(q.to(cdt) * scale),  # [B, H, N, C, K]
                   kc=layout.to_chunks(k.to(cdt)),  # [B, H, N, C, K]
                   vc=layout.to_chunks(v.to(cdt)))  # [B, H, N, C, V]


def chunk_cumsum(gc: Tensor) -> Tensor:
    """Stage 1. G_i = Σ_{s ≤ i} g_s within each chunk: gc [B, H, N, C(, K)] → G, same shape.

    A cumsum of non-positive numbers is non-increasing in floating point too (adding a number
    ≤ 0 never rounds up), which the decayed scores rely on."""
    return gc.cumsum(dim=3)


def decayed_scores(x: Tensor, y: Tensor, gx: Tensor | None, gy: Tensor | None, *, strict: bool) -> Tensor:
    """Stage 2. P_ij = Σ_d x_id y_jd exp(gx_id − gy_jd) on the causal mask (j ≤ i, or j < i if strict), else 0.

    x, y: [B, H, N, C, K] rows of every chunk.
    gx, gy: None (no decay), [B, H, N, C] (scalar) or [B, H, N, C, K] (diagonal) chunk-local log
        decays with, on the mask, gx_i ≤ gy_j for j < i, gx_i ≤ gy_i on the diagonal, and gx
        non-increasing (GDN/GLA/KDA: gx = gy = G; Comba: gx = the exclusive cumsum, with strict).
    Returns P [B, H, N, C, C] in x's dtype.

    Scalar decay: one C×C decay matrix, masked with torch.where both before the exp (the masked
    exponent is 0: finite, and its gradient is not inf·0) and after it.
    Diagonal decay: Σ_d cannot be one matrix product with a per-channel decay, and the split
    e^{gx_i − gy_j} = e^{gx_i − ρ}·e^{ρ − gy_j} is only safe when both exponents are ≤ 0, i.e.
    ρ lies between every query's gx and every key's gy. That holds for a block of query rows that
    all come after a block of key rows, with ρ = gx of the first query row. `_diagonal_scores`
    uses it twice: for each block of 16 query rows against all earlier rows (one batched matmul),
    and, inside the 16×16 diagonal blocks, by 2×2 splitting, level by level. Every exponent is ≤ 0
    for any g — exact, no overflow, no data-dependent branch and no host synchronization.
    """
    C = x.shape[-2]
    ar = torch.arange(C, device=x.device)
    mask = (ar[:, None] > ar[None, :]) if strict else (ar[:, None] >= ar[None, :])  # [C, C]
    if gx is None:
        return torch.where(mask, x @ y.transpose(-1, -2), 0.0)
    if gx.dim() == x.dim() - 1:  # scalar decay: one C×C decay matrix
        diff = gx[..., :, None] - gy[..., None, :]  # [B, H, N, C, C]
        decay = exp(torch.where(mask, diff, 0.0))
        return torch.where(mask, (x @ y.transpose(-1, -2)) * decay, 0.0)
    return _diagonal_scores(x, y, gx, gy, strict)


DIAGONAL_BLOCK = 16
"""Rows per diagonal block c of `_diagonal_scores` (levels 1, 2, …, c/2 of the splitting run inside
these blocks only; a fixed constant, not chosen from the data)."""


def _pad_rows(x, y, gx, gy, size: int):
    """Pad the rows of x, y (zeros) and gx, gy to `size`; the padded log-decays repeat
    m = min(gx_last, gy_last), which keeps every exponent of `_diagonal_scores` ≤ 0."""
    *batch, C, K = x.shape
    if size == C:
        return x, y, gx, gy
    m = torch.minimum(gx[..., -1:, :], gy[..., -1:, :]).expand(*batch, size - C, K)  # [..., pad, K]
    zeros = x.new_zeros(*batch, size - C, K)
    return (torch.cat([x, zeros], dim=-2), torch.cat([y, zeros], dim=-2),
            torch.cat([gx, m], dim=-2), torch.cat([gy, m], dim=-2))


LOG2E = 1.4426950408889634
"""log₂ e: e^d = 2^{d·log₂ e}."""


def under_functorch() -> bool:
    """Whether a torch.func transform (vmap, grad) is running: a recompute checkpoint is skipped there (its
    saved-tensor hooks are not supported by `torch.func.grad`; the maths are the same, only memory differs)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _exp_(d: Tensor) -> Tensor:
    """e^d, in place on a freshly computed d (no autograd), as 2^{d·log₂ e}: the same value to
    rounding (rounding d·log₂ e changes the result by a relative eps·|d|, the size of the rounding
    error d itself carries). On the CPU, in torch's MKL builds, torch.exp goes through MKL's vector
    exp (ATen's vml.h), several times slower than torch.exp2 (Sleef) on some processors (AMD EPYC
    among them). Signs are kept: d ≤ 0 gives a value ≤ 1, and d = 0 exactly 1."""
    return d.mul_(LOG2E).exp2_()


class _Exp(torch.autograd.Function):
    """e^d as `_exp_` with exp's own backward, grad · e^d (differentiable again: e^d is saved as
    this function's output)."""

    generate_vmap_rule = True  # (torch.func transforms: a stacked run vmaps the training step, `lab.stack`)

    @staticmethod
    def forward(d):
        return (d * LOG2E).exp2_()  # [same shape as d]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def exp(d: Tensor) -> Tensor:
    """e^d, elementwise, differentiable (any order), computed as 2^{d·log₂ e} (see `_exp_`)."""
    return _Exp.apply(d)


def _diagonal_blocks(P: Tensor, c: int) -> Tensor:
    """The c×c diagonal blocks of P [..., S·c, S·c] as a view [..., S, c, c] (writable)."""
    *batch, size, _ = P.shape
    S = size // c
    return P.view(*batch, S, c, S, c).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _lower_blocks(D: Tensor, b: int) -> Tensor:
    """Level b of blocks D [..., S, c, c]: the lower-left b×b block of every 2b×2b diagonal block
    (rows 2b·m + b … 2b·m + 2b − 1, columns 2b·m … 2b·m + b − 1) as a view [..., S, c/2b, b, b]."""
    *batch, S, c, _ = D.shape
    m = c // (2 * b)
    return D.view(*batch, S, m, 2, b, m, 2, b)[..., 1, :, :, 0, :].diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _half_blocks(W: Tensor, b: int) -> Tensor:
    """The b×b diagonal blocks of W [..., S, h, h] (h = c/2 query rows × c/2 key rows of a level-b
    split: row p·b + r is row r of the p-th query half) as a view [..., S, h/b, b, b] (writable)."""
    *batch, S, h, _ = W.shape
    return W.view(*batch, S, h // b, b, h // b, b).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _diagonal_scores(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, strict: bool) -> Tensor:
    """`decayed_scores` for a diagonal decay (see there), exact for any decay; shapes as there.

    Rows are padded to S blocks of c = DIAGONAL_BLOCK (a power of two ≤ 16 for short chunks). Every
    pair (i, j), j < i, is covered once by a block product whose exponents are all ≤ 0:

    - level c: query block s (rows sc … sc + c − 1) against every earlier row j < sc, one matmul
      per s: P = X̃ Ỹᵀ with X̃_i = x_i ⊙ e^{gx_i − ρ}, Ỹ_j = y_j ⊙ e^{ρ − gy_j}, ρ = gx_{sc};
    - levels b = c/2, …, 2, inside each diagonal block: the lower-left b×b block of every 2b×2b
      block (queries all after keys), the same product with ρ = gx of its first query row. One
      batched matmul per level, [..., S, c/2, K] @ [..., S, K, c/2]: all c/2 query-half rows of a
      diagonal block against all c/2 key-half rows, of which the b×b diagonal blocks are kept (the
      other products mix factors of different ρ; each factor is ≤ 1, so they are finite, and dropped);
    - level 1: the pairs (2p + 1, 2p) elementwise, Σ_d x_id y_jd e^{gx_id − gy_jd};
    - the diagonal (unless strict): Σ_d x_id y_id e^{gx_id − gy_id} (factor 1 when gx is gy).

    The backward is written out (`_DiagonalScores`), reusing the forward's factors. With dX̃ = dP Ỹ
    and dỸ = dPᵀ X̃ per block: dx = Σ dX̃ ⊙ e^{gx − ρ}, dy = Σ dỸ ⊙ e^{ρ − gy}, and since
    ∂P_ij/∂gx_id = x_id ∂P_ij/∂x_id, ∂P_ij/∂gy_jd = −y_jd ∂P_ij/∂y_jd: dgx = x ⊙ dx,
    dgy = −y ⊙ dy. ρ gets no gradient: P does not depend on it. When nothing needs a gradient
    (no_grad, or no input requires one) the rows are rescaled in place and nothing is kept.
    Exponentials are `_exp_` (2^{d·log₂ e}). No host synchronization, no data-dependent branch;
    once differentiable.
    """
    if under_functorch():
        return _diagonal_scores_functional(x, y, gx, gy, strict)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, gx, gy))):
        return _diagonal_forward(x, y, gx, gy, strict, gx is gy, keep=False)[0]
    return _DiagonalScores.apply(x, y, gx, gy, strict, gx is gy)


def _diagonal_scores_functional(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, strict: bool) -> Tensor:
    """`_diagonal_scores` without in-place writes or a written-out backward, for torch.func transforms (a stacked
    run vmaps the training step: `lab.stack`); the same P to rounding, differentiated by autograd. Per query
    block s of c = DIAGONAL_BLOCK rows: against every earlier row, the level-c product of `_diagonal_scores`
    (ρ = gx of the block's first row, every exponent ≤ 0); inside the c×c diagonal block, the masked sum
    Σ_d x_id y_jd e^{gx_id − gy_jd} over [..., c, c, K] (exponent ≤ 0 on the mask, 0 off it): c·C·K a chunk of
    memory, not C·C·K."""
    *batch, C, K = x.shape
    c = min(DIAGONAL_BLOCK, 1 << max(C - 1, 0).bit_length())
    size = -(-C // c) * c
    xp, yp, gxp, gyp = _pad_rows(x, y, gx, gy, size)  # [..., size, K]
    ar = torch.arange(c, device=x.device)
    mask = (ar[:, None] > ar[None, :]) if strict else (ar[:, None] >= ar[None, :])  # [c, c]
    rows = []
    for lo in range(0, size, c):
        xq, gq = xp[..., lo:lo + c, :], gxp[..., lo:lo + c, :]  # [..., c, K]
        d = torch.where(mask[..., None], gq[..., :, None, :] - gyp[..., None, lo:lo + c, :], 0.0)  # [..., c, c, K]
        blocks = [torch.where(mask, (xq[..., :, None, :] * yp[..., None, lo:lo + c, :] * exp(d)).sum(-1), 0.0)]
        if lo:
            rho = gq[..., :1, :]  # [..., 1, K]
            yk = yp[..., :lo, :] * exp(rho - gyp[..., :lo, :])  # [..., lo, K]
            blocks.insert(0, (xq * exp(gq - rho)) @ yk.transpose(-1, -2))  # [..., c, lo]
        rows.append(torch.nn.functional.pad(torch.cat(blocks, dim=-1), (0, size - lo - c)))  # [..., c, size]
    return torch.cat(rows, dim=-2)[..., :C, :C]


def _diagonal_forward(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, strict: bool, same: bool, keep: bool):
    """The forward of `_diagonal_scores`: (P [..., C, C], what the backward needs or None).
    keep=False (nothing needs a gradient) rescales the rows in place and keeps nothing."""
    *batch, C, K = x.shape
    c = min(DIAGONAL_BLOCK, 1 << max(C - 1, 0).bit_length())
    size = -(-C // c) * c
    S = size // c
    xp, yp, gxp, gyp = (t.contiguous() for t in _pad_rows(x, y, gx, gy, size))  # [..., size, K]
    P = xp.new_zeros(*batch, size, size)
    D = _diagonal_blocks(P, c)  # [..., S, c, c]
    top = []  # level c: (X̃, Ỹ, e^{gx − ρ}, e^{ρ − gy}) per query block s ≥ 1
    for s in range(1, S):
        lo = s * c
        gq = gxp[..., lo:lo + c, :]  # [..., c, K]
        rho = gq[..., :1, :]  # [..., 1, K]
        eq = _exp_(gq - rho)  # exponent ≤ 0  [..., c, K]
        ek = _exp_(rho - gyp[..., :lo, :])  # exponent ≤ 0  [..., sc, K]
        xq, yk = xp[..., lo:lo + c, :], yp[..., :lo, :]
        xr, yr = (xq * eq, yk * ek) if keep else (eq.mul_(xq), ek.mul_(yk))
        P[..., lo:lo + c, :lo] = xr @ yr.transpose(-1, -2)  # [..., c, sc]
        if keep:
            top.append((xr, yr, eq, ek))
    inner = []  # levels c/2, …, 2: (X̃, Ỹ, e^{gx − ρ}, e^{ρ − gy}) of the lower-left blocks
    b = c // 2
    while b >= 2:
        xq = xp.view(*batch, size // (2 * b), 2, b, K)[..., 1, :, :]  # [..., size/2b, b, K]
        yk = yp.view(*batch, size // (2 * b), 2, b, K)[..., 0, :, :]
        gq = gxp.view(*batch, size // (2 * b), 2, b, K)[..., 1, :, :]
        gk = gyp.view(*batch, size // (2 * b), 2, b, K)[..., 0, :, :]
        rho = gq[..., :1, :]  # [..., size/2b, 1, K]
        eq, ek = _exp_(gq - rho), _exp_(rho - gk)  # exponents ≤ 0
        xr, yr = (xq * eq, yk * ek) if keep else (eq.mul_(xq), ek.mul_(yk))
        xr, yr = xr.view(*batch, S, c // 2, K), yr.view(*batch, S, c // 2, K)
        wide = xr @ yr.transpose(-1, -2)  # every query half × every key half of a block  [..., S, c/2, c/2]
        _lower_blocks(D, b).copy_(_half_blocks(wide, b))
        if keep:
            inner.append((xr, yr, eq, ek))
        b //= 2
    e1 = y1 = None
    if c >= 2:  # level 1: pairs (2p + 1, 2p), exponent gx_{2p+1} − gy_{2p} ≤ 0
        xq = xp.view(*batch, size // 2, 2, K)[..., 1, :]
        gq = gxp.view(*batch, size // 2, 2, K)[..., 1, :]
        yk, gk = (t.view(*batch, size // 2, 2, K)[..., 0, :] for t in (yp, gyp))
        e1 = _exp_(gq - gk)  # [..., size/2, K]
        y1 = yk * e1 if keep else e1.mul_(yk)
        _lower_blocks(D, 1).copy_((xq * y1).sum(-1).view(*batch, S, c // 2, 1, 1))
    e0 = None
    if not strict:  # the diagonal, exponent gx_i − gy_i ≤ 0 (0 when gx is gy)
        e0 = None if same else _exp_(gxp - gyp)
        prod = xp * yp if e0 is None else (xp * yp).mul_(e0)
        D.diagonal(dim1=-2, dim2=-1).copy_(prod.sum(-1).view(*batch, S, c))
    if not keep:
        return P[..., :C, :C], None
    return P[..., :C, :C], ((strict, same, c, size, S, C), top, inner, (xp, yp, e1, y1, e0))


class _DiagonalScores(torch.autograd.Function):
    """P = `_diagonal_scores`(x, y, gx, gy) [..., C, C] with its backward written out (see there)."""

    @staticmethod
    def forward(ctx, x, y, gx, gy, strict: bool, same: bool):
        P, (ctx.meta, ctx.top, ctx.inner, saved) = _diagonal_forward(x, y, gx, gy, strict, same, keep=True)
        ctx.save_for_backward(*saved)
        return P

    @staticmethod
    @once_differentiable
    def backward(ctx, dP):
        strict, same, c, size, S, C = ctx.meta
        xp, yp, e1, y1, e0 = ctx.saved_tensors
        *batch, _, K = xp.shape
        if size != C:
            dP = torch.nn.functional.pad(dP, (0, size - C, 0, size - C))
        dP = dP.contiguous()  # views below; an upstream gradient may be expanded
        dD = _diagonal_blocks(dP, c)  # [..., S, c, c]
        if strict:
            dx, dy = torch.zeros_like(xp), torch.zeros_like(yp)  # [..., size, K]
        else:  # the diagonal first: dx_i = dP_ii y_i e^{gx_i − gy_i}, dy_i = dP_ii x_i e^{gx_i − gy_i}
            d0 = dD.diagonal(dim1=-2, dim2=-1).reshape(*batch, size, 1)  # [..., size, 1]
            if e0 is not None:
                d0 = d0 * e0  # [..., size, K]
            dx, dy = d0 * yp, d0 * xp
        for s, (xr, yr, eq, ek) in enumerate(ctx.top, start=1):
            lo = s * c
            dPs = dP[..., lo:lo + c, :lo]  # [..., c, sc]
            dx[..., lo:lo + c, :].addcmul_(dPs @ yr, eq)
            dy[..., :lo, :].addcmul_(dPs.transpose(-1, -2) @ xr, ek)
        b = c // 2
        for xr, yr, eq, ek in ctx.inner:
            dW = dP.new_zeros(*batch, S, c // 2, c // 2)  # the gradient of `wide`: zero off its b×b blocks
            _half_blocks(dW, b).copy_(_lower_blocks(dD, b))
            dxr = (dW @ yr).view(eq.shape)  # [..., size/2b, b, K]
            dyr = (dW.transpose(-1, -2) @ xr).view(ek.shape)
            dx.view(*batch, size // (2 * b), 2, b, K)[..., 1, :, :].addcmul_(dxr, eq)
            dy.view(*batch, size // (2 * b), 2, b, K)[..., 0, :, :].addcmul_(dyr, ek)
            b //= 2
        if c >= 2:
            d1 = _lower_blocks(dD, 1).reshape(*batch, size // 2, 1)  # [..., size/2, 1]
            xq = xp.view(*batch, size // 2, 2, K)[..., 1, :]
            dx.view(*batch, size // 2, 2, K)[..., 1, :].addcmul_(d1, y1)
            dy.view(*batch, size // 2, 2, K)[..., 0, :].addcmul_(d1 * xq, e1)
        dx, dy = dx[..., :C, :], dy[..., :C, :]
        x, y = xp[..., :C, :], yp[..., :C, :]
        if same:  # gx and gy are one tensor: return the sum x ⊙ dx − y ⊙ dy once
            return dx, dy, torch.addcmul(x * dx, y, dy, value=-1.0), None, None, None
        return dx, dy, x * dx, (y * dy).neg_(), None, None


def pass_states(layout: ChunkLayout, S0: Tensor, M: Tensor | None, Bn: Tensor) -> tuple[Tensor, Tensor]:
    """Stage 4, the one sequential stage: S_{n+1} = M_n S_n + B_n from chunk to chunk, restarting
    from each sequence's own initial state (varlen). Context parallelism replaces this stage.

    S0: [B or N_seq, H, K, V]; Bn: [B, H, N, K, V]; M: None (identity: no decay), [B, H, N, K', 1]
    with K' ∈ {1, K} (a decay, applied elementwise on the key side: gated-linear class) or
    [B, H, N, K, K] (a full transition, applied by a matmul: delta class).
    Returns (S_n entering every chunk [B, H, N, K, V], the final states [B or N_seq, H, K, V]).
    """
    w = Bn.unbind(2)
    if M is None:
        return scan_chunks(layout, S0, lambda n, S: S + w[n])
    a = M.unbind(2)
    if M.shape[-1] == 1:
        return scan_chunks(layout, S0, lambda n, S: torch.addcmul(w[n], a[n], S))
    K, V = Bn.shape[-2:]
    rows = Bn.shape[0] * Bn.shape[1]
    Mf = M.reshape(rows, M.shape[2], K, K).unbind(1)  # [B·H, K, K] each
    Bf = Bn.reshape(rows, Bn.shape[2], K, V).unbind(1)  # [B·H, K, V] each
    return scan_chunks(layout, S0, lambda n, S: torch.baddbmm(Bf[n], Mf[n], S.reshape(-1, K, V)).view(S.shape))


def chunk_outputs(layout: ChunkLayout, o_intra: Tensor, q_eff: Tensor, entering: Tensor, out_dtype) -> Tensor:
    """Stage 5. o = o_intra + Q̃ S_n per chunk ([B, H, N, C, V] + [B, H, N, C, K] @ [B, H, N, K, V]),
    back to tokens [B, T, H, V] in `out_dtype`."""
    o = o_intra + q_eff @ entering  # [B, H, N, C, V]
    return layout.from_chunks(o).to(out_dtype)  # [B, T, H, V]
