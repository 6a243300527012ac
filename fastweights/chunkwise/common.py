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

from dataclasses import dataclass

import torch

from ..inputs import InputError, check_tensor
from ..state import compute_dtype
from .varlen import ChunkLayout, make_layout, scan_chunks

Tensor = torch.Tensor

__all__ = ["Chunked", "chunk_inputs", "gate_kind", "scalar_or_diag", "chunk_cumsum", "decayed_scores",
           "pass_states", "chunk_outputs", "initial_state_or_zeros"]


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
    and, inside the 16×16 diagonal blocks, by recursive 2×2 splitting. Every exponent is ≤ 0 for
    any g — exact, no overflow, no data-dependent branch and no host synchronization.
    """
    C = x.shape[-2]
    ar = torch.arange(C, device=x.device)
    mask = (ar[:, None] > ar[None, :]) if strict else (ar[:, None] >= ar[None, :])  # [C, C]
    if gx is None:
        return torch.where(mask, x @ y.transpose(-1, -2), 0.0)
    if gx.dim() == x.dim() - 1:  # scalar decay: one C×C decay matrix
        diff = gx[..., :, None] - gy[..., None, :]  # [B, H, N, C, C]
        decay = torch.where(mask, diff, 0.0).exp()
        return torch.where(mask, (x @ y.transpose(-1, -2)) * decay, 0.0)
    return _diagonal_scores(x, y, gx, gy, strict)


DIAGONAL_BLOCK = 16
"""Rows per diagonal block of `_diagonal_scores` (the recursion runs inside these blocks only)."""


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


def _diagonal_scores(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, strict: bool) -> Tensor:
    """`decayed_scores` for a diagonal decay (see there), exact for any decay:

    1. the rows are cut into blocks of c = DIAGONAL_BLOCK; for query block s, every key row of the
       blocks before it in one batched matmul of rescaled rows, reference ρ_s = gx of the block's
       first row (both exponents ≤ 0);
    2. the c×c diagonal blocks by recursive 2×2 splitting (`_block_scores`).
    """
    *batch, C, K = x.shape
    c = min(DIAGONAL_BLOCK, 1 << max(C - 1, 0).bit_length())
    size = -(-C // c) * c
    x, y, gx, gy = _pad_rows(x, y, gx, gy, size)
    S = size // c
    # blocks by unbind, not slicing: a slice's backward fills a full-size zero gradient each time
    xb, yb, gxb, gyb = (t.reshape(*batch, S, c, K) for t in (x, y, gx, gy))  # [..., S, c, K]
    diags = _block_scores(xb, yb, gxb, gyb, strict).unbind(-3)  # S × [..., c, c]
    xs, ys, gxs, gys = (t.unbind(-3) for t in (xb, yb, gxb, gyb))  # S × [..., c, K]
    rows = []
    for s in range(S):
        diag = diags[s]
        blocks = []
        if s > 0:  # every earlier key row in one matmul, rescaled to ρ = gx of the block's first row
            rho = gxs[s][..., :1, :]  # [..., 1, K]
            keys = torch.cat(ys[:s], dim=-2) if s > 1 else ys[0]  # [..., s·c, K]
            gkeys = torch.cat(gys[:s], dim=-2) if s > 1 else gys[0]
            xq = xs[s] * (gxs[s] - rho).exp()  # exponent ≤ 0  [..., c, K]
            blocks.append(xq @ (keys * (rho - gkeys).exp()).transpose(-1, -2))  # exponent ≤ 0  [..., c, s·c]
        blocks.append(diag)
        if s < S - 1:
            blocks.append(x.new_zeros(*batch, c, size - (s + 1) * c))
        rows.append(torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0])  # [..., c, size]
    P = torch.cat(rows, dim=-2) if S > 1 else rows[0]  # [..., size, size]
    return P[..., :C, :C]  # [..., C, C]


def _block_scores(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, strict: bool) -> Tensor:
    """The scores inside blocks of c rows (c a power of two), x, y, gx, gy [..., c, K] → [..., c, c]:
    the diagonal entries and the 1×1 lower-left entries of level 1 elementwise (exponents
    gx_i − gy_j ≤ 0), then at each level b = 2, 4, … every lower-left b×b block — queries all after
    keys — as one batched matmul of rows rescaled to ρ = gx of the block's first query row
    (exponents gx_i − ρ ≤ 0 and ρ − gy_j ≤ 0)."""
    *batch, c, K = x.shape
    if strict:
        blocks = x.new_zeros(*batch, c, 1, 1)  # [..., c, 1, 1]
    elif gx is gy:  # e^{G_i − G_i} = 1
        blocks = (x * y).sum(-1)[..., None, None]
    else:
        blocks = (x * y * (gx - gy).exp()).sum(-1)[..., None, None]
    if c > 1:  # level 1: one entry per pair, (i, j) = (2p + 1, 2p), exponent gx_i − gy_j ≤ 0 directly
        xk, xq = x.reshape(*batch, c // 2, 2, K).unbind(-2)
        _, gq = gx.reshape(*batch, c // 2, 2, K).unbind(-2)
        yk, _ = y.reshape(*batch, c // 2, 2, K).unbind(-2)
        gk, _ = gy.reshape(*batch, c // 2, 2, K).unbind(-2)
        lower = (xq * yk * (gq - gk).exp()).sum(-1)[..., None, None]  # [..., c/2, 1, 1]
        upper, diag = blocks.reshape(*batch, c // 2, 2, 1, 1).unbind(-3)
        blocks = torch.cat([torch.cat([upper, torch.zeros_like(upper)], dim=-1),
                            torch.cat([lower, diag], dim=-1)], dim=-2)  # [..., c/2, 2, 2]
    b = 2
    while b < c:
        pairs = c // (2 * b)  # 2b-blocks at this level
        # key half and query half of every 2b-block by unbind (no full-size zero gradients)
        xk, xq = x.reshape(*batch, pairs, 2, b, K).unbind(-3)  # [..., pairs, b, K] each
        _, gq = gx.reshape(*batch, pairs, 2, b, K).unbind(-3)
        yk, _ = y.reshape(*batch, pairs, 2, b, K).unbind(-3)
        gk, _ = gy.reshape(*batch, pairs, 2, b, K).unbind(-3)
        rho = gq[..., :1, :]  # [..., pairs, 1, K]
        lower = (xq * (gq - rho).exp()) @ (yk * (rho - gk).exp()).transpose(-1, -2)  # [..., pairs, b, b]
        upper, diag = blocks.reshape(*batch, pairs, 2, b, b).unbind(-3)  # [..., pairs, b, b]
        top = torch.cat([upper, torch.zeros_like(upper)], dim=-1)  # [..., pairs, b, 2b]
        bottom = torch.cat([lower, diag], dim=-1)  # [..., pairs, b, 2b]
        blocks = torch.cat([top, bottom], dim=-2)  # [..., pairs, 2b, 2b]
        b *= 2
    return blocks[..., 0, :, :]  # [..., c, c]


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
