"""The gated output RMSNorm of the layers (`layers.norm.GatedRMSNorm`) in one Triton pass each way.

Over rows of G channels (a group: one head, or the whole width), with the gate a = act(z)
(swish z·σ(z) or sigmoid σ(z)) and the affine weight w [G] shared by the groups:

    norm-then-gate:  u = o,       y = u r ⊙ w ⊙ a        r = (mean_G u² + eps)^{−1/2}
    gate-then-norm:  u = o ⊙ a,   y = u r ⊙ w
    no gate:         u = o,       y = u r ⊙ w

Backward (recomputed from o and z; nothing else saved), n = u r:

    dn = dy ⊙ w (⊙ a norm-then-gate),  du = r (dn − n · mean_G(dn ⊙ n))
    do = du (⊙ a gate-then-norm)
    dz = act'(z) ⊙ (dy ⊙ n ⊙ w   norm-then-gate  |  du ⊙ o   gate-then-norm)
    dw = Σ_rows dy ⊙ n (⊙ a norm-then-gate)

act' : swish σ(z)(1 + z(1 − σ(z))), sigmoid σ(z)(1 − σ(z)). Statistics and arithmetic in fp32; y,
do in o's dtype, dz in z's, dw in w's. Grid: blocks of BR rows × the whole group (G ≤ MAX_GROUP);
the backward runs a fixed number of programs over the row blocks, each keeping its dw partial sum
in registers, summed by torch afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....inputs import InputError
from ... import empty_output
from ..common import interpreter  # noqa: F401  (the interpreter's shims, applied before any kernel runs)
from ..common.limits import MAX_GROUP
from ..common.util import row_view

Tensor = torch.Tensor

__all__ = ["gated_rms_norm", "MAX_GROUP"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTS = {"swish": 0, "sigmoid": 1}
_TILE = 4096  # elements of one [BR, BG] tile
_BWD_PROGRAMS = 1024  # most programs of the backward (each sums dw over its row blocks)


@triton.jit
def _gate(z, ACT: tl.constexpr):
    """(act(z), act'(z)) in fp32."""
    sg = 1.0 / (1.0 + tl.exp(-z))
    if ACT == 0:
        return z * sg, sg * (1.0 + z * (1.0 - sg))
    else:
        return sg, sg * (1.0 - sg)


@triton.jit
def _z_offsets(rows, cols, off, sz, G: tl.constexpr, ZR: tl.constexpr):
    """The offsets of z's [BR, BG] tile: `off` (o's) when z is contiguous (ZR = 0), else z's rows of C = ZR·G
    channels at row stride sz (a column view of a wider tensor: the joint projection's z)."""
    if ZR == 0:
        return off
    else:
        return (rows // ZR)[:, None] * sz + ((rows % ZR) * G)[:, None] + cols[None, :]


@triton.jit
def _norm_fwd(o, z, w, y, N, eps, sz, G: tl.constexpr, BG: tl.constexpr, BR: tl.constexpr, HAS_Z: tl.constexpr,
              ACT: tl.constexpr, NORM_FIRST: tl.constexpr, ZR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BG)
    mc = cols < G
    m = (rows < N)[:, None] & mc[None, :]
    off = rows[:, None] * G + cols[None, :]
    u = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        a, _ = _gate(tl.load(z + _z_offsets(rows, cols, off, sz, G, ZR), mask=m, other=0.0).to(tl.float32), ACT)
        if not NORM_FIRST:
            u = u * a
    r = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / G + eps)
    out = u * r[:, None] * tl.load(w + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    if HAS_Z:
        if NORM_FIRST:
            out = out * a
    tl.store(y + off, out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd(o, z, w, dy, do, dz, dw_part, N, eps, n_blocks, P, sz, G: tl.constexpr, BG: tl.constexpr,
              BR: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, NORM_FIRST: tl.constexpr, ZR: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BG)
    mc = cols < G
    wv = tl.load(w + cols, mask=mc, other=0.0).to(tl.float32)
    dw = tl.zeros((BG,), dtype=tl.float32)
    blk = pid
    while blk < n_blocks:  # row blocks pid, pid + P, ... (a while loop: the interpreter cannot range() here)
        rows = blk.to(tl.int64) * BR + tl.arange(0, BR)
        m = (rows < N)[:, None] & mc[None, :]
        off = rows[:, None] * G + cols[None, :]
        ov = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
        g = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
        u = ov
        if HAS_Z:
            zv = tl.load(z + _z_offsets(rows, cols, off, sz, G, ZR), mask=m, other=0.0).to(tl.float32)
            a, da = _gate(zv, ACT)
            if not NORM_FIRST:
                u = ov * a
        r = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / G + eps)
        n = u * r[:, None]
        if HAS_Z:
            if NORM_FIRST:
                tl.store(dz + off, (g * n * wv[None, :] * da).to(dz.dtype.element_ty), mask=m)
                g = g * a
        dw += tl.sum(g * n, axis=0)
        dn = g * wv[None, :]
        du = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / G)[:, None])
        if HAS_Z:
            if not NORM_FIRST:
                tl.store(dz + off, (du * ov * da).to(dz.dtype.element_ty), mask=m)
                du = du * a
        tl.store(do + off, du.to(do.dtype.element_ty), mask=m)
        blk += P
    tl.store(dw_part + pid * G + cols, dw, mask=mc)


def _tiles(G: int):
    BG = triton.next_power_of_2(G)
    BR = max(1, _TILE // BG)
    return BG, BR, (4 if BG * BR <= 4096 else 8)


def _z_rows(z: Tensor | None, G: int) -> tuple[int, int]:
    """(row stride, groups per row) of z as the kernels read it: (0, 0) when z is None or contiguous (read at o's
    offsets), else (its row stride, C / G) for z a row view (`_rows_of`)."""
    if z is None or z.is_contiguous():
        return 0, 0
    return z.stride(-2), z.shape[-1] // G


def _rows_of(z: Tensor) -> Tensor:
    """z itself when the kernels can read it in place (rows of its last dim one stride apart: a column view [B, T, C]
    of a wider [B, T, N] projection), else a contiguous copy."""
    return row_view(z, max(z.dim() - 1, 1))


class GatedRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps, act, norm_first):
        G = weight.numel()
        N = o.numel() // G
        BG, BR, warps = _tiles(G)
        y = empty_output(*o.shape, dtype=o.dtype, device=o.device)
        if N > 0:
            sz, zr = _z_rows(z, G)
            _norm_fwd[(triton.cdiv(N, BR),)](o, z if z is not None else o, weight, y, N, eps, sz, G=G, BG=BG, BR=BR,
                                             HAS_Z=z is not None, ACT=act, NORM_FIRST=norm_first, ZR=zr,
                                             num_warps=warps)
        ctx.save_for_backward(o, z, weight)
        ctx.eps, ctx.act, ctx.norm_first = eps, act, norm_first
        return y

    @staticmethod
    def backward(ctx, dy):
        o, z, weight = ctx.saved_tensors
        G = weight.numel()
        N = o.numel() // G
        BG, BR, warps = _tiles(G)
        n_blocks = triton.cdiv(N, BR)
        P = max(1, min(n_blocks, _BWD_PROGRAMS))
        do = empty_output(*o.shape, dtype=o.dtype, device=o.device)
        dz = empty_output(*z.shape, dtype=z.dtype, device=z.device) if z is not None else None  # contiguous
        dw_part = empty_output(P, G, dtype=torch.float32, device=o.device)
        if N > 0:
            sz, zr = _z_rows(z, G)
            _norm_bwd[(P,)](o, z if z is not None else o, weight, dy.contiguous(), do, dz if dz is not None else do,
                            dw_part, N, ctx.eps, n_blocks, P, sz, G=G, BG=BG, BR=BR, HAS_Z=z is not None, ACT=ctx.act,
                            NORM_FIRST=ctx.norm_first, ZR=zr, num_warps=warps)
        else:
            dw_part.zero_()
        need = ctx.needs_input_grad
        dw = dw_part.sum(0).to(weight.dtype) if need[2] else None
        return (do if need[0] else None), (dz if need[1] else None), dw, None, None, None


def gated_rms_norm(o: Tensor, z: Tensor | None, weight: Tensor, *, eps: float = 1e-5, activation: str = "swish",
                   norm_before_gate: bool = True) -> Tensor:
    """y [..., C] in o's dtype: `GatedRMSNorm` over groups of G = weight.numel() channels (see the module
    doc). o [..., C] fp32/bf16/fp16 with G | C, G ≤ MAX_GROUP; z [..., C] (any of those dtypes) or None
    (no gate); weight [G]; activation "swish" or "sigmoid". Differentiable in o, z and weight."""
    if not isinstance(o, Tensor) or o.dim() < 1 or o.dtype not in _DTYPES:
        raise InputError(f"o must be an fp32/bf16/fp16 tensor [..., C], got "
                         f"{f'{list(o.shape)} {o.dtype}' if isinstance(o, Tensor) else type(o).__name__}")
    if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.dtype not in _DTYPES:
        raise InputError(f"weight must be a 1-D fp32/bf16/fp16 tensor [G], got "
                         f"{f'{list(weight.shape)} {weight.dtype}' if isinstance(weight, Tensor) else weight!r}")
    G = weight.numel()
    if not 1 <= G <= MAX_GROUP or o.shape[-1] % G:
        raise InputError(f"the group size G = weight.numel() must divide C = {o.shape[-1]} and be 1..{MAX_GROUP}, "
                         f"got {G}")
    if z is not None and (not isinstance(z, Tensor) or z.shape != o.shape or z.dtype not in _DTYPES):
        raise InputError(f"z must be None or an fp32/bf16/fp16 tensor of o's shape {list(o.shape)}, got "
                         f"{f'{list(z.shape)} {z.dtype}' if isinstance(z, Tensor) else type(z).__name__}")
    if activation not in _ACTS:
        raise InputError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise InputError(f"eps must be a number ≥ 0, got {eps!r}")
    if any(t.device != o.device for t in (z, weight) if t is not None):
        raise InputError("o, z and weight must be on one device")
    return GatedRMSNormFn.apply(o.contiguous(), _rows_of(z) if z is not None else None, weight.contiguous(),
                                float(eps), _ACTS[activation], bool(norm_before_gate))
