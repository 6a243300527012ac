"""The delta layer's per-token prologue in one pass: the L2 norm of q and k, β and the Mamba-style
log-retention (optionally already cut into chunks and cumsummed), forward and backward one kernel
each. These are the layer's own formulas (`layers/norm.l2norm`, `layers/gates.BetaGate` and
`MambaDecay`), which, as separate torch ops, each read and write the tensors once more.

Forward, per token t and head h (every output optional; arithmetic in fp32):

    q̂ = q / sqrt(Σ_d q_d² + eps),  k̂ the same                   [B, T, H_q, K], [B, T, H_k, K], in q's / k's dtype
    β = beta_max · σ(b)                                          [B, T, H_b]                     fp32
    x = a + dt_bias,  g = −exp(A_log[h]) · softplus(x) ≤ 0       "mamba": a [B, T, H_a], dt_bias [H_a]
                                                                 "kda":   a [B, T, H_a, K_a], dt_bias [H_a·K_a]
                                                                 A_log [H_a]; g fp32, a's shape
    G_i = Σ_{s ≤ i} g_s within each chunk of `chunk_size` rows   (optional: what the chunk pipeline
                                                                  consumes, as `cumsum.chunk_cumsum`)

softplus is torch's (threshold 20: x above it is returned as is), computed as
max(x, 0) + log1p(e^{−|x|}) with an accurate log1p, so a very negative x keeps its relative precision.

Backward (recomputes from the inputs; nothing but the inputs is saved):

    dq = r (dq̂ − q̂ (q̂ · dq̂)),  r = (Σ q² + eps)^{−1/2}         (the same for k)
    db = dβ · beta_max · σ(b)(1 − σ(b))
    dg = the chunk-local reverse cumsum of dG (with the cumsum), else dg itself
    da = dx = −exp(A_log) · σ(x) · dg
    d dt_bias = Σ_{b, t} dx,  dA_log = Σ_{b, t(, k)} dg · g     (per-program partial sums, then a torch sum)

Heads: each tensor has its own head count (H_q = H_k query/key heads and H_a = H_b value heads in a
grouped layer; DeltaProduct's k and b carry n·H_q and n·H); every row of each is independent.

Grid (chunk slots NT, B · max heads): program (n, b·h) holds the rows of chunk n of batch row b
(`chunk_size` rows, or 64 without the cumsum) and head h of every tensor that has h heads or more;
q and k in blocks of BR rows × K channels, the gate as C-row tiles (× 32 key channels per
block for "kda"), cumsummed in registers.
Varlen (`cu_seqlens`, B = 1) only changes where the chunks start (it matters for the cumsum only).

Status: interpreter tests in CI, and its cuda test passed on the H100 (tests/kernels/layer/test_triton_prologue.py).
`layers.mixer.MemoryMixer` calls it (without the cumsum) for layers with qk_norm "l2", β
"sigmoid"/"none" and a Mamba/KDA/no decay, through the "prologue" layer op of the dispatch table
(its Triton row, `kernels.rows.delta_prologue`: "auto" on CUDA; tests/layers/test_layer_ops.py:
the layer equals its torch ops; on the H100 too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....chunkwise.varlen import check_cu_seqlens
from ....inputs import InputError
from ... import empty_output
from ..common.layout import make_layout
from ..common.util import chunk_span, launch, row_view, varlen_args
from .conv import conv_recompute, conv_release, conv_source

Tensor = torch.Tensor

__all__ = ["delta_prologue", "l2_source", "l2_recompute"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 64  # rows per program without the cumsum


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), with log1p(e) = log(u)·e/(u − 1), u = 1 + e (exact to a few ulps)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    d = u - 1.0
    l1p = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _l2_rows(x, y, dy, dx, t0, eos, i_h, eps, NH: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
             BK: tl.constexpr, BR: tl.constexpr, BWD: tl.constexpr):
    """Rows [t0, min(t0 + C, eos)) of head i_h of x [·, NH, K]: y = x r (forward) or dx = r(dy − y(y·dy))."""
    cols = tl.arange(0, BK)
    for r0 in tl.static_range(0, C, BR):
        rows = t0 + r0 + tl.arange(0, BR)
        m = (rows < eos)[:, None] & (cols < K)[None, :]
        off = (rows[:, None] * NH + i_h) * K + cols[None, :]
        xv = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
        yv = xv * r[:, None]
        if BWD:
            dyv = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
            dxv = r[:, None] * (dyv - yv * tl.sum(yv * dyv, axis=1)[:, None])
            tl.store(dx + off, dxv.to(dx.dtype.element_ty), mask=m)
        else:
            tl.store(y + off, yv.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "NT"])
def _prologue_kernel(q, k, b, a, A_log, dt_bias, qo, ko, beta, gout,
                     dqo, dko, dbeta, dgin, dq, dk, db, da, dA_part, ddt_part,
                     cu, chunk_seq, chunk_local, T, NT, beta_max, eps, sb, sa,
                     HP: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, HB: tl.constexpr, HA: tl.constexpr,
                     K: tl.constexpr, KA: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKA: tl.constexpr,
                     BC: tl.constexpr, BR: tl.constexpr, DO_Q: tl.constexpr, DO_K: tl.constexpr, DO_B: tl.constexpr,
                     GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT: tl.constexpr, CUMSUM: tl.constexpr,
                     IS_VARLEN: tl.constexpr, BWD: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HP, i_bh % HP
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if DO_Q:
        if i_h < HQ:
            _l2_rows(q, qo, dqo, dq, t0, eos, i_h, eps, HQ, K, C, BK, BR, BWD)
    if DO_K:
        if i_h < HK:
            _l2_rows(k, ko, dko, dk, t0, eos, i_h, eps, HK, K, C, BK, BR, BWD)
    rows = t0 + tl.arange(0, C)
    m_t = rows < eos
    if DO_B:
        if i_h < HB:
            off = rows * HB + i_h  # beta, dbeta, db: contiguous; b: rows sb apart (a column view, read in place)
            s = _sigmoid(tl.load(b + rows * sb + i_h, mask=m_t, other=0.0).to(tl.float32))
            if BWD:
                dbv = tl.load(dbeta + off, mask=m_t, other=0.0) * beta_max * s * (1.0 - s)
                tl.store(db + off, dbv.to(db.dtype.element_ty), mask=m_t)
            else:
                tl.store(beta + off, beta_max * s, mask=m_t)
    if GATE != 0:
        if i_h < HA:
            if HAS_A_LOG:
                A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
            else:
                A = 1.0
            slot = i_b.to(tl.int64) * NT + i_n
            if GATE == 1:  # one gate per head: [C] rows
                dA = _gate_tile(a, dt_bias, i_h, i_h, gout, dgin, da, ddt_part + slot * HA + i_h, rows * HA + i_h,
                                rows * sa + i_h, m_t, A, HAS_DT, CUMSUM, BWD, False)
            else:  # per key channel: [C, BC] tiles, each column block cumsummed on its own
                dA = 0.0
                for c0 in tl.static_range(0, BKA, BC):
                    cols = c0 + tl.arange(0, BC)
                    m = m_t[:, None] & (cols < KA)[None, :]
                    dA += _gate_tile(a, dt_bias, i_h * KA + cols, cols < KA, gout, dgin, da,
                                     ddt_part + (slot * HA + i_h) * KA + cols,
                                     (rows[:, None] * HA + i_h) * KA + cols[None, :],
                                     rows[:, None] * sa + i_h * KA + cols[None, :], m, A, HAS_DT, CUMSUM, BWD, True)
            if BWD:
                tl.store(dA_part + slot * HA + i_h, dA)


@triton.jit
def _gate_tile(a, dt_bias, dt_off, dt_m, gout, dgin, da, ddt, off, a_off, m, A, HAS_DT: tl.constexpr,
               CUMSUM: tl.constexpr, BWD: tl.constexpr, DIAG: tl.constexpr):
    """One tile of the gate (rows [C], or rows × a column block [C, BC]): g / G (forward), or da,
    the partial d dt_bias stored at `ddt` and the partial dA_log returned (backward). off: the tile's offsets in
    the contiguous g, dg, da; a_off: in a (rows at a's row stride)."""
    x = tl.load(a + a_off, mask=m, other=0.0).to(tl.float32)
    if HAS_DT:
        if DIAG:
            x += tl.load(dt_bias + dt_off, mask=dt_m, other=0.0).to(tl.float32)[None, :]
        else:
            x += tl.load(dt_bias + dt_off).to(tl.float32)
    g = tl.where(m, -A * _softplus(x), 0.0)
    dA = 0.0
    if BWD:
        dg = tl.load(dgin + off, mask=m, other=0.0)
        if CUMSUM:
            dg = tl.cumsum(dg, axis=0, reverse=True)
        dx = tl.where(m, -A * _sigmoid(x) * dg, 0.0)
        tl.store(da + off, dx.to(da.dtype.element_ty), mask=m)
        if DIAG:
            tl.store(ddt, tl.sum(dx, axis=0), mask=dt_m)
            dA = tl.sum(tl.sum(dg * g, axis=1), axis=0)
        else:
            tl.store(ddt, tl.sum(dx, axis=0))
            dA = tl.sum(dg * g, axis=0)
    else:
        if CUMSUM:
            g = tl.cumsum(g, axis=0)
        tl.store(gout + off, g, mask=m)
    return dA


def _launch(x: dict, meta: dict, bwd: bool):
    """One launch of the forward (bwd False) or backward kernel; x names every pointer (None: absent)."""
    names = ("q", "k", "b", "a", "A_log", "dt_bias", "qo", "ko", "beta", "g", "dqo", "dko", "dbeta", "dg", "dq",
             "dk", "db", "da", "dA_part", "ddt_part")
    p = {name: (x[name] if x.get(name) is not None else meta["dummy"]) for name in names}
    if meta["NT"] * meta["B"] * meta["HP"] == 0:
        return
    _prologue_kernel[(meta["NT"], meta["B"] * meta["HP"])](
        p["q"], p["k"], p["b"], p["a"], p["A_log"], p["dt_bias"], p["qo"], p["ko"], p["beta"], p["g"],
        p["dqo"], p["dko"], p["dbeta"], p["dg"], p["dq"], p["dk"], p["db"], p["da"], p["dA_part"], p["ddt_part"],
        *meta["varlen"], meta["T"], meta["NT"], meta["beta_max"], meta["eps"], _row_stride(x["b"]), _row_stride(x["a"]),
        HP=meta["HP"], HQ=meta["HQ"], HK=meta["HK"], HB=meta["HB"], HA=meta["HA"], K=meta["K"], KA=meta["KA"],
        C=meta["C"], BK=meta["BK"], BKA=meta["BKA"], BC=min(meta["BKA"], 32), BR=meta["BR"], DO_Q=x["q"] is not None,
        DO_K=x["k"] is not None, DO_B=x["b"] is not None, GATE=meta["GATE"], HAS_A_LOG=x["A_log"] is not None,
        HAS_DT=x["dt_bias"] is not None, CUMSUM=meta["CUMSUM"], IS_VARLEN=meta["IS_VARLEN"], BWD=bwd,
        **launch("prologue"))


def _row_stride(x: Tensor | None) -> int:
    """The stride of x's [B·T] rows (x [B, T, H] or [B, T, H, K] as `_rows` leaves it); 0 for None."""
    return 0 if x is None else x.stride(1)


def _rows(x: Tensor | None) -> Tensor | None:
    """x [B, T, ...] itself when the kernel reads it in place: the B·T rows one stride apart and the rest contiguous
    (e.g. b or a a column view of the layer's joint projection), else a contiguous copy."""
    return None if x is None else row_view(x, 2)


def _out(x: Tensor | None, dtype=None):
    return None if x is None else empty_output(*x.shape, dtype=dtype or x.dtype, device=x.device)


class DeltaPrologue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, b, a, A_log, dt_bias, meta):
        x = dict(q=q, k=k, b=b, a=a, A_log=A_log, dt_bias=dt_bias, qo=_out(q), ko=_out(k),
                 beta=_out(b, torch.float32), g=_out(a, torch.float32))
        _launch(x, meta, bwd=False)
        # q, k straight from the short conv: keep what recomputes them (the conv's inputs), not a copy of them
        ctx.q_src, ctx.k_src = conv_source(q), conv_source(k)
        ctx.save_for_backward(None if ctx.q_src else q, None if ctx.k_src else k, b, a, A_log, dt_bias)
        ctx.meta = meta
        return x["qo"], x["ko"], x["beta"], x["g"]

    @staticmethod
    def backward(ctx, dqo, dko, dbeta, dg):
        q, k, b, a, A_log, dt_bias = ctx.saved_tensors
        q = conv_recompute(ctx.q_src) if ctx.q_src and ctx.needs_input_grad[0] else conv_release(ctx.q_src) or q
        k = conv_recompute(ctx.k_src) if ctx.k_src and ctx.needs_input_grad[1] else conv_release(ctx.k_src) or k
        ctx.q_src = ctx.k_src = None
        meta = ctx.meta
        need = ctx.needs_input_grad
        q, k, b = (t if need[i] else None for i, t in enumerate((q, k, b)))
        gate = a is not None and any(need[3:6])
        B, NT, HA, KA = meta["B"], meta["NT"], meta["HA"], meta["KA"]
        dev = (q if q is not None else k if k is not None else b if b is not None else a).device
        dA_part = empty_output(B * NT, HA, dtype=torch.float32, device=dev) if gate else None
        ddt_part = (empty_output(B * NT, HA, *((KA,) if meta["GATE"] == 2 else ()), dtype=torch.float32, device=dev)
                    if gate else None)
        x = dict(q=q, k=k, b=b, a=a if gate else None, A_log=A_log, dt_bias=dt_bias, qo=None, ko=None, beta=None,
                 g=None, dqo=_contig(dqo, q), dko=_contig(dko, k), dbeta=_contig(dbeta, b, torch.float32),
                 dg=_contig(dg, a if gate else None, torch.float32), dq=_out(q), dk=_out(k), db=_out(b),
                 da=_out(a) if gate else None, dA_part=dA_part, ddt_part=ddt_part)
        if not gate:
            x["A_log"] = x["dt_bias"] = None
        _launch(x, {**meta, "GATE": meta["GATE"] if gate else 0}, bwd=True)
        dA = dA_part.sum(0).to(A_log.dtype) if gate and A_log is not None and need[4] else None
        ddt = (ddt_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
               if gate and dt_bias is not None and need[5] else None)
        return x["dq"], x["dk"], x["db"], (x["da"] if need[3] else None), dA, ddt, None


def _contig(grad, like, dtype=None):
    """The incoming gradient of an output whose input needs one, contiguous (zeros when undefined)."""
    if like is None:
        return None
    if grad is None:
        return torch.zeros(like.shape, dtype=dtype or like.dtype, device=like.device)
    return grad.contiguous()


def _check(name, x, dims, B, T, what):
    if x is None:
        return B, T
    if not isinstance(x, Tensor) or x.dim() != dims:
        got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(f"{name} must be {dims}-D {what}, got {got}")
    if x.dtype not in _DTYPES:
        raise InputError(f"{name} must be fp32, bf16 or fp16, got {x.dtype}")
    if B is not None and tuple(x.shape[:2]) != (B, T):
        raise InputError(f"{name} must have [B, T] = {[B, T]} like the other inputs, got {list(x.shape[:2])}")
    return x.shape[0], x.shape[1]


def delta_prologue(q: Tensor | None, k: Tensor | None, b: Tensor | None, a: Tensor | None,
                   A_log: Tensor | None = None, dt_bias: Tensor | None = None, *, l2norm: bool = True,
                   beta_max: float = 1.0, gate: str | None = "mamba", eps: float = 1e-6,
                   chunk_size: int | None = None, cu_seqlens: Tensor | None = None):
    """(q̂, k̂, β, g) of the delta layer in one Triton pass, differentiable (see the module doc).

    q [B, T, H_q, K], k [B, T, H_k, K] (None: absent; l2norm=False: returned as they are);
    b [B, T, H_b] → β = beta_max·σ(b) fp32 (None: absent; beta_max 2 allows negative eigenvalues);
    gate "mamba": a [B, T, H_a], A_log [H_a], dt_bias [H_a]; "kda": a [B, T, H_a, K_a], A_log [H_a],
    dt_bias [H_a·K_a] or [H_a, K_a] → g = −exp(A_log)·softplus(a + dt_bias) fp32 in a's shape
    (A_log None: A = 1; dt_bias None: no bias); gate None: no g (a, A_log and dt_bias must be None).
    chunk_size (a power of two ≥ 16): return G, the chunk-local cumsum of g, instead of g (chunks
    as `cumsum.chunk_cumsum`: of each batch row, or of each sequence of `cu_seqlens` with B = 1).
    eps: as `layers.norm.l2norm` (inside the square root). Inputs fp32, bf16 or fp16 on one device; b and a are
    read in place when their B·T rows are one stride apart with the rest contiguous (column views of the layer's
    joint projection), else copied."""
    B = T = None
    B, T = _check("q", q, 4, B, T, "[B, T, H_q, K]")
    B, T = _check("k", k, 4, B, T, "[B, T, H_k, K]")
    B, T = _check("b", b, 3, B, T, "[B, T, H_b]")
    if gate not in ("mamba", "kda", None):
        raise InputError(f"gate must be 'mamba', 'kda' or None, got {gate!r}")
    if gate is None and not (a is None and A_log is None and dt_bias is None):
        raise InputError("gate=None takes no a, A_log or dt_bias; pass gate='mamba' or 'kda' to compute g")
    if gate is not None and a is None:
        raise InputError(f"gate={gate!r} needs a (the gate's pre-activation), got None")
    B, T = _check("a", a, 3 if gate == "mamba" else 4, B, T, "[B, T, H_a]" if gate == "mamba" else "[B, T, H_a, K_a]")
    if B is None:
        raise InputError("delta_prologue needs at least one of q, k, b and a")
    if q is not None and k is not None and q.shape[-1] != k.shape[-1]:
        raise InputError(f"q and k must share the head dim K, got {q.shape[-1]} and {k.shape[-1]}")
    HA = a.shape[2] if a is not None else 1
    KA = a.shape[3] if gate == "kda" else 1
    for name, p, numel in (("A_log", A_log, HA), ("dt_bias", dt_bias, HA * KA)):
        if p is not None and (not isinstance(p, Tensor) or p.dtype not in _DTYPES or p.numel() != numel
                              or p.dim() > 2):
            got = f"{list(p.shape)} {p.dtype}" if isinstance(p, Tensor) else type(p).__name__
            raise InputError(f"{name} must be an fp32/bf16/fp16 tensor of {numel} elements "
                             f"({'[H_a]' if name == 'A_log' or gate == 'mamba' else '[H_a·K_a]'}), got {got}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise InputError(f"chunk_size must be None or a power of two ≥ 16, got {chunk_size!r}")
    if cu_seqlens is not None:
        if chunk_size is None:
            raise InputError("cu_seqlens only matters for the cumsum: give chunk_size with it")
        check_cu_seqlens(cu_seqlens, B, T)
    if not isinstance(beta_max, (int, float)) or isinstance(beta_max, bool) or not beta_max > 0:
        raise InputError(f"beta_max must be a positive number, got {beta_max!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise InputError(f"eps must be a number ≥ 0, got {eps!r}")
    given = [t for t in (q, k, b, a, A_log, dt_bias) if t is not None]
    dev = given[0].device
    if any(t.device != dev for t in given):
        raise InputError(f"q, k, b, a, A_log and dt_bias must be on one device, got {[str(t.device) for t in given]}")

    K = q.shape[-1] if q is not None else k.shape[-1] if k is not None else 1
    C = chunk_size if chunk_size is not None else _BLOCK
    L = make_layout(B, T, HA, 1, K, 1, C, cu_seqlens, dev)
    BK, BKA = triton.next_power_of_2(K), triton.next_power_of_2(KA)
    heads = [t.shape[2] for t in (q, k, b, a) if t is not None]
    meta = dict(B=L.B, T=T, NT=L.NT, HP=max(heads), HQ=q.shape[2] if q is not None else 1,
                HK=k.shape[2] if k is not None else 1, HB=b.shape[2] if b is not None else 1, HA=HA, K=K, KA=KA,
                C=C, BK=BK, BKA=BKA, BR=min(C, max(1, 2048 // BK)), GATE={"mamba": 1, "kda": 2, None: 0}[gate],
                CUMSUM=chunk_size is not None, IS_VARLEN=L.varlen, varlen=varlen_args(L, dev)[:3],
                beta_max=float(beta_max), eps=float(eps),
                dummy=torch.empty(1, dtype=torch.float32, device=dev))  # the absent inputs' pointer, never read
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    qk = (c(q), c(k)) if l2norm else (None, None)
    qo, ko, beta, g = DeltaPrologue.apply(*qk, _rows(b), _rows(a), c(A_log), c(dt_bias), meta)
    if l2norm:
        for out, src in ((qo, qk[0]), (ko, qk[1])):
            if out is not None:
                out._l2_source = (src, float(eps), out._version)  # `l2_source`: what the memory op may keep instead
    return (qo if l2norm else q), (ko if l2norm else k), beta, g


def l2_source(x: Tensor) -> Tensor | None:
    """The raw x (q or k before the L2 norm) when x is, unmodified, a q̂ or k̂ returned by `delta_prologue`,
    else None. The prologue keeps the raw tensor for its own backward; an op that needs x̂ in its backward
    (the delta memory op) can keep that same raw tensor and recompute x̂ = `l2_recompute(raw, eps)`,
    bitwise x̂ (the same kernel on the same rows), instead of keeping a second tensor of x's size."""
    src = getattr(x, "_l2_source", None)
    if src is None or src[2] != x._version:
        return None
    return conv_source(src[0]) or src[0], src[1]  # the raw x itself straight from the conv: what recomputes it


def l2_recompute(raw, eps: float) -> Tensor:
    """x̂ = raw / sqrt(Σ raw² + eps) per row, by the prologue's forward kernel (no autograd): bitwise what
    `delta_prologue` returned for raw (each row's sum is computed by one program, the same way). raw: the tensor,
    or its `conv.conv_source` (then the conv's output is recomputed first, bitwise)."""
    if not isinstance(raw, Tensor):
        raw = conv_recompute(raw)
    with torch.no_grad():
        return delta_prologue(raw, None, None, None, gate=None, eps=eps)[0]
