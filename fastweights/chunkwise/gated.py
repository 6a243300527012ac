"""Chunkwise-parallel training form of the gated-linear class (linear attention, RetNet, Mamba2, GLA).

Recurrence, per (batch, head), state S [K, V], readout o_t = S_tᵀ(scale·q_t):

    S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ

with log-retention g_t ≤ 0 either a scalar (RetNet, Mamba2) or a vector in R^K acting on the
key side (GLA), β_t = 1 unless given.

Chunks of C tokens. Inside chunk n, with chunk-local cumulative log-gates G_i = Σ_{s ≤ i} g_s
(s counted from the chunk's first token) and S_n the state entering the chunk:

    o_i     = (scale·q_i ⊙ e^{G_i})ᵀ S_n  +  Σ_{j ≤ i} [Σ_d scale·q_id β_j k_jd e^{G_id − G_jd}] v_j
    S_{n+1} = Diag(e^{G_C}) S_n  +  Σ_j (β_j k_j ⊙ e^{G_C − G_j}) v_jᵀ

Everything is a batched matmul over all chunks at once except S_n → S_{n+1}, an elementwise
scan over N = T/C chunks; the cost is linear in T.

Numerics. Decays only ever appear as exponentials of differences of chunk-local cumsums that
are ≤ 0 (G_i, G_C − G_j, G_i − G_j for j ≤ i), never of a global cumsum, so nothing overflows
whatever g is. With a scalar gate the C×C decay matrix is masked with torch.where both before
the exp (so that the masked exponent is 0, finite, and its gradient is not inf·0) and after
it; no mask is ever multiplied into a possibly-infinite value. A diagonal gate
cannot use one matrix product for Σ_d q_id k_jd e^{G_id − G_jd}; it is split into sub-chunks
of c ≤ 16 rows (`decayed_scores`): for the keys before the query block, both factors are
rescaled to the query block's first row ρ, (q_i ⊙ e^{G_i − ρ})·(k_j ⊙ e^{ρ − G_j}), two
exponents ≤ 0, one matmul. The c×c diagonal block joins that matmul when the decay a block
accumulates stays ≤ 80 per channel (the key factor's exponent is then ≤ 80: finite, and the
query factor's ≥ −80: a normal number), which one reduction over the gates checks; otherwise
the diagonal blocks are computed column by column, elementwise over K, on the causal rows only
(exponent G_i − G_j ≤ 0). Both paths are exact; an underflow to 0 can only happen where the
true product is itself below the underflow threshold.

Precision: every input is cast to fp32 (float64 stays float64) before any arithmetic; the
state is carried in that precision; o is returned in v's dtype. The exponent G_i − G_j is a
difference of two cumsums, so its absolute rounding error is about eps·|G| ≤ eps·C·max|g|:
negligible unless a chunk mixes very strong decay (|G| in the hundreds) with weak, nonzero
decay after it (then ~1e-5 relative in fp32; exact zeros g = 0 stay exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .varlen import ChunkLayout, make_layout, scan_chunks

Tensor = torch.Tensor

__all__ = ["chunk_gated", "decayed_scores"]


# ---------------------------------------------------------------------------- shared helpers
def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs, fp32 for everything else."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_shape(name: str, x, shape: tuple, *, optional: bool = False):
    if x is None:
        if optional:
            return
        raise ValueError(f"{name} is required, shape {list(shape)}")
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def gate_kind(g: Tensor | None, B: int, T: int, H: int, K: int) -> str:
    """'none', 'scalar' ([B, T, H]) or 'diagonal' ([B, T, H, K]); raises on any other shape."""
    if g is None:
        return "none"
    if not isinstance(g, Tensor) or not g.is_floating_point():
        raise ValueError(f"g must be a floating-point tensor [B, T, H] or [B, T, H, K], got {type(g).__name__}"
                         f"{'' if not isinstance(g, Tensor) else ' of ' + str(g.dtype)}")
    if tuple(g.shape) == (B, T, H):
        return "scalar"
    if tuple(g.shape) == (B, T, H, K):
        return "diagonal"
    raise ValueError(f"g must have shape [B, T, H] = {[B, T, H]} (scalar) or [B, T, H, K] = {[B, T, H, K]} "
                     f"(diagonal), got {list(g.shape)}")


def initial_state_or_zeros(initial_state, layout: ChunkLayout, H: int, K: int, V: int, dtype, device) -> Tensor:
    """S_0 [B or S, H, K, V] in the compute dtype (zeros when not given)."""
    rows = layout.num_sequences
    if initial_state is None:
        return torch.zeros(rows, H, K, V, dtype=dtype, device=device)
    what = "number of sequences N (len(cu_seqlens) − 1)" if layout.varlen else "batch B"
    if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (rows, H, K, V):
        shape = list(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
        raise ValueError(f"initial_state must have shape [{what}, H, K, V] = {[rows, H, K, V]}, got {shape}")
    if not initial_state.is_floating_point():
        raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
    return initial_state.to(dtype)


def scalar_or_diag(G: Tensor, kind: str) -> Tensor:
    """A chunked log-decay [B, H, N, C] (scalar) or [B, H, N, C, K] (diagonal) made to broadcast
    against row vectors [B, H, N, C, K]."""
    return G.unsqueeze(-1) if kind == "scalar" else G


MAX_BLOCK_EXPONENT = 80.0
"""Largest decay (in log units, per channel) a diagonal sub-chunk may accumulate for the one-matmul path."""


def sub_chunk_size(C: int) -> int:
    """Rows per sub-chunk for diagonal decays: the largest divisor of C that is ≤ 16."""
    return max(d for d in range(1, min(C, 16) + 1) if C % d == 0)


def decayed_scores(x: Tensor, y: Tensor, gx: Tensor | None, gy: Tensor | None, *, strict: bool) -> Tensor:
    """P_ij = Σ_d x_id y_jd exp(gx_id − gy_jd) on the causal mask (j ≤ i, or j < i if strict), else 0.

    x, y: [B, H, N, C, K] rows of every chunk.
    gx, gy: None (no decay), [B, H, N, C] (scalar) or [B, H, N, C, K] (diagonal) chunk-local log
        decays, non-increasing along C, with gx_i − gy_j ≤ 0 on the mask and gx_i ≤ gx_n for
        n ≤ i (GDN/GLA/KDA: gx = gy = G; Comba: gx = G − g, the exclusive cumsum, with strict).
    Returns P [B, H, N, C, C] in x's dtype.
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
    # diagonal decay: sub-chunks of c rows. Query block s = rows [lo, hi) is rescaled to its first
    # row ρ = gx_lo: P_ij = (x_i ⊙ e^{gx_i − ρ})·(y_j ⊙ e^{ρ − gy_j}). The query factor's exponent
    # is ≤ 0; the key factor's is ≤ 0 for j < lo and at most ρ − gy_{hi−1} (the decay accumulated
    # across the block) inside it. When that never exceeds MAX_BLOCK_EXPONENT (e^80 ≈ 5.5e34, far
    # from fp32's 3.4e38 and its e^−80 counterpart far above the smallest normal 1.2e−38) one
    # matmul per block is exact; otherwise the diagonal blocks fall back to column-by-column sums
    # whose exponents gx_i − gy_j are all ≤ 0, whatever g is.
    B, H, N, _, K = x.shape
    c = sub_chunk_size(C)
    S = C // c
    gx_first = gx[..., ::c, :]  # ρ of every block  [B, H, N, S, K]
    gy_last = gy[..., c - 1::c, :]  # [B, H, N, S, K]
    fast = bool(((gx_first - gy_last).amax() <= MAX_BLOCK_EXPONENT).item()) if x.numel() else True
    rows = []
    for s in range(S):
        lo, hi = s * c, (s + 1) * c
        xs, gxs = x[..., lo:hi, :], gx[..., lo:hi, :]  # query block s  [B, H, N, c, K]
        rho = gxs[..., :1, :]  # [B, H, N, 1, K]
        x_ref = xs * (gxs - rho).exp()  # exponent ≤ 0  [B, H, N, c, K]
        upto = hi if fast else lo  # key rows taken by the matmul
        blocks = []
        if upto > 0:
            y_ref = y[..., :upto, :] * (rho - gy[..., :upto, :]).exp()  # [B, H, N, upto, K]
            blocks.append(x_ref @ y_ref.transpose(-1, -2))  # [B, H, N, c, upto]
        if not fast:  # the c×c diagonal block, column by column, exponents gx_i − gy_j ≤ 0
            first = 1 if strict else 0  # first row i ≥ j + first of column j
            ys, gys = y[..., lo:hi, :], gy[..., lo:hi, :]  # [B, H, N, c, K]
            cols = []
            for j in range(c):
                i0 = j + first
                decay = (gxs[..., i0:, :] - gys[..., j:j + 1, :]).exp()  # [B, H, N, c − i0, K]
                col = (xs[..., i0:, :] * decay * ys[..., j:j + 1, :]).sum(-1)  # [B, H, N, c − i0]
                cols.append(torch.nn.functional.pad(col, (i0, 0)))  # zeros above the diagonal  [B, H, N, c]
            blocks.append(torch.stack(cols, dim=-1))  # [B, H, N, c, c]
        if hi < C:
            blocks.append(x.new_zeros(B, H, N, c, C - hi))  # [B, H, N, c, C − hi]
        rows.append(torch.cat(blocks, dim=-1))  # [B, H, N, c, C]
    P = torch.cat(rows, dim=-2)  # [B, H, N, C, C]
    return torch.where(mask, P, 0.0) if fast else P


@dataclass
class Chunked:
    """The inputs every chunk form starts from: shapes, gate kind, compute dtype, layout, the
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
    """Check q, k, v [B, T, H, ·], β [B, T, H] and g; cut them into chunks (see `Chunked`)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, T, H, K], got {list(q.shape) if isinstance(q, Tensor) else q!r}")
    B, T, H, K = q.shape
    V = v.shape[-1] if isinstance(v, Tensor) and v.dim() == 4 else -1
    check_shape("k", k, (B, T, H, K))
    check_shape("v", v, (B, T, H, V))
    check_shape("beta", beta, (B, T, H), optional=True)
    kind = gate_kind(g, B, T, H, K)
    cdt = compute_dtype(q)
    scale = K ** -0.5 if scale is None else float(scale)
    layout = make_layout(B, T, chunk_size, cu_seqlens, device=q.device)
    S0 = initial_state_or_zeros(initial_state, layout, H, K, V, cdt, q.device)
    return Chunked(B=B, T=T, H=H, K=K, V=V, kind=kind, cdt=cdt, layout=layout, S0=S0,
                   qc=layout.to_chunks(q.to(cdt) * scale),  # [B, H, N, C, K]
                   kc=layout.to_chunks(k.to(cdt)),  # [B, H, N, C, K]
                   vc=layout.to_chunks(v.to(cdt)))  # [B, H, N, C, V]


# ---------------------------------------------------------------------------- the gated-linear class
def chunk_gated(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None, beta: Tensor | None = None,
                scale: float | None, initial_state: Tensor | None = None, output_final_state: bool = False,
                chunk_size: int = 64, cu_seqlens: Tensor | None = None):
    """Chunkwise gated linear attention: S_t = Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ(scale·q_t).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (one floating dtype: fp32, bf16, fp16 or float64).
        g: log-retention ≤ 0, None (no decay), [B, T, H] (scalar: RetNet, Mamba2) or
            [B, T, H, K] (diagonal on the key side of S: GLA).
        beta: [B, T, H] write strength (default 1).
        scale: query multiplier (None: K^-0.5).
        initial_state: S_0 [B, H, K, V] (with cu_seqlens: [N, H, K, V], one row per sequence).
        output_final_state: also return S_T.
        chunk_size: tokens per chunk C (any positive int; 16, 32, 64 usual). T needs not be a multiple.
        cu_seqlens: int [N+1] with B = 1: N packed sequences (flash-attention convention).
    Returns:
        o [B, T, H, V] in v's dtype; final state [B (or N), H, K, V] in fp32 (float64 for float64
        inputs) when output_final_state, else None.
    """
    c = chunk_inputs(q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     cu_seqlens=cu_seqlens)
    kind, cdt, layout, S0, qc, kc, vc = c.kind, c.cdt, c.layout, c.S0, c.qc, c.kc, c.vc
    out_dtype = v.dtype
    if beta is not None:
        kc = kc * layout.to_chunks(beta.to(cdt)).unsqueeze(-1)  # β_j k_j  [B, H, N, C, K]

    if kind == "none":
        A = decayed_scores(qc, kc, None, None, strict=False)  # [B, H, N, C, C]
        q_dec, k_dec, decay = qc, kc, None
    else:
        G = layout.to_chunks(g.to(cdt)).cumsum(dim=3)  # chunk-local cumsum  [B, H, N, C(, K)]
        A = decayed_scores(qc, kc, G, G, strict=False)  # [B, H, N, C, C]
        Gb = scalar_or_diag(G, kind)  # [B, H, N, C, 1 or K]
        G_last = Gb[:, :, :, -1:]  # [B, H, N, 1, 1 or K]
        q_dec = qc * Gb.exp()  # q_i ⊙ e^{G_i}                      [B, H, N, C, K]
        k_dec = kc * (G_last - Gb).exp()  # β_j k_j ⊙ e^{G_C − G_j}    [B, H, N, C, K]
        decay = G_last.exp().transpose(-1, -2)  # e^{G_C} on the key side  [B, H, N, 1 or K, 1]

    o_intra = A @ vc  # [B, H, N, C, V]
    writes = k_dec.transpose(-1, -2) @ vc  # Σ_j k̃_j v_jᵀ  [B, H, N, K, V]
    w = writes.unbind(2)
    if decay is None:
        entering, final = scan_chunks(layout, S0, lambda n, S: S + w[n])
    else:
        a = decay.unbind(2)
        entering, final = scan_chunks(layout, S0, lambda n, S: torch.addcmul(w[n], a[n], S))
    o = o_intra + q_dec @ entering  # [B, H, N, C, V]
    o = layout.from_chunks(o).to(out_dtype)  # [B, T, H, V]
    return o, (final if output_final_state else None)
