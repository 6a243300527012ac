"""Fused recurrent steps (decode) for the two linear classes, state updated in place.

Per token t, state S [K, V] of one (sequence, value head), a = e^{g_t} (scalar or per key channel):

    gated-linear:          S ← Diag(a) S + β k vᵀ
    delta, decay first:    S ← Diag(a) S;  S ← S + β k (v − Sᵀk)ᵀ            (gated DeltaNet, KDA)
    delta, decay after:    S ← Diag(a) S + β k (v − Sᵀk)ᵀ  with Sᵀk at the undecayed S
    then o_t = Sᵀ(scale q_t)

State pool: `state` [slots, H, K, V] (fp32, bf16 or fp16; arithmetic in fp32); batch row b uses
slot state_indices[b] (default b); −1 marks a padding row, whose output is zero and which touches
no state. Grid (⌈V/BV⌉, B·H): a program keeps the whole key side of one [K, BV] state tile in
registers over the T tokens (the delta read Sᵀk reduces over K inside the tile, so V tiles are
independent), reads and writes the state once per call: bytes ≈ 2·B·H·K·V·sizeof(state).
T is a run-time loop bound (decode runs T = 1, or a few draft tokens; any T works, one compile).
Inference only (no autograd; the recurrent dispatch row in kernels/rows.py adds a backward).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...inputs import InputError
from .. import empty_output
from .common.util import pow2

#: Launch settings of the step kernel, pinned (the GPU session sweeps them: docs/kernels.md):
#: block_v value columns of the state per program, num_warps, num_stages.
STEP_LAUNCH = dict(block_v=32, num_warps=4, num_stages=1)


@triton.jit
def _step_kernel(q, k, v, g, beta, state, idx, o, scale, T, H: tl.constexpr, HQ: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                 HAS_BETA: tl.constexpr, DELTA: tl.constexpr, DECAY_FIRST: tl.constexpr, HAS_IDX: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    if HAS_IDX:
        slot = tl.load(idx + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    live = slot >= 0
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m = (m_kk[:, None] & m_vv[None, :]) & live
    s_off = ((tl.maximum(slot, 0) * H + i_h) * K + kk[:, None]) * V + vv[None, :]
    S = tl.load(state + s_off, mask=m, other=0.0).to(tl.float32)  # [BK, BV]
    t = 0
    while t < T:  # a while loop: the interpreter cannot range() over a run-time bound
        row = i_b.to(tl.int64) * T + t
        b_q = tl.load(q + (row * HQ + i_hq) * K + kk, mask=m_kk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (row * HQ + i_hq) * K + kk, mask=m_kk, other=0.0).to(tl.float32)
        b_v = tl.load(v + (row * H + i_h) * V + vv, mask=m_vv, other=0.0).to(tl.float32)
        if HAS_BETA:
            b_beta = tl.load(beta + row * H + i_h).to(tl.float32)
        else:
            b_beta = 1.0
        if GATE == 2:
            a = tl.exp(tl.load(g + (row * H + i_h) * K + kk, mask=m_kk, other=0.0).to(tl.float32))[:, None]
        elif GATE == 1:
            a = tl.exp(tl.load(g + row * H + i_h).to(tl.float32))
        else:
            a = 1.0
        if DELTA:
            if DECAY_FIRST:
                S = S * a
                u = b_v - tl.sum(S * b_k[:, None], axis=0)  # v − Sᵀk  [BV]
                S += (b_beta * b_k)[:, None] * u[None, :]
            else:
                u = b_v - tl.sum(S * b_k[:, None], axis=0)
                S = S * a + (b_beta * b_k)[:, None] * u[None, :]
        else:
            S = S * a + (b_beta * b_k)[:, None] * b_v[None, :]
        b_o = tl.where(live, tl.sum(S * b_q[:, None], axis=0), 0.0)  # [BV]; a padding row reads zero
        tl.store(o + (row * H + i_h) * V + vv, b_o.to(o.dtype.element_ty), mask=m_vv)
        t += 1
    tl.store(state + s_off, S.to(state.dtype.element_ty), mask=m)


def fused_recurrent_step(q, k, v, state, *, g=None, beta=None, scale: float | None = None, delta: bool = False,
                         decay_first: bool = True, state_indices=None):
    """Run T (≥ 1, short) tokens of the recurrence, updating `state` in place; returns o [B, T, H, V]
    in v's dtype.

    q, k: [B, T, H_q, K]; v: [B, T, H, V] (H_q | H); g: None, [B, T, H] or [B, T, H, K] (log-decay);
    beta: None (1) or [B, T, H]; state: [slots, H, K, V], fp32/bf16/fp16, contiguous, modified in
    place; state_indices: None (slot b for row b) or int [B], −1 = padding (o = 0, no state touched);
    delta: the delta rule (else gated-linear); decay_first: see the module docstring (delta only).
    K, V ≤ 256."""
    B, T, Hq, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if not state.is_contiguous() or state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise InputError(f"state must be a contiguous [slots, H, K, V] = [·, {H}, {K}, {V}] tensor, "
                         f"got {list(state.shape)}")
    if state_indices is None and state.shape[0] != B:
        raise InputError(f"without state_indices the state must have B={B} slots, got {state.shape[0]}")
    if state_indices is not None and tuple(state_indices.shape) != (B,):
        raise InputError(f"state_indices must be an int tensor [B] = [{B}], got {list(state_indices.shape)}")
    if K > 256 or V > 256:
        raise InputError(f"head dims K={K}, V={V} must be ≤ 256")
    o = empty_output(B, T, H, V, dtype=v.dtype, device=v.device)
    scale = K ** -0.5 if scale is None else float(scale)
    launch = dict(STEP_LAUNCH)
    BK, BV = pow2(K), min(launch.pop("block_v"), pow2(V))
    gate = 0 if g is None else (2 if g.dim() == 4 else 1)
    _step_kernel[(triton.cdiv(V, BV), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else q,
        beta.contiguous() if beta is not None else q, state, state_indices if state_indices is not None else q,
        o, scale, T, H=H, HQ=Hq, K=K, V=V, BK=BK, BV=BV, GATE=gate, HAS_BETA=beta is not None, DELTA=delta,
        DECAY_FIRST=decay_first, HAS_IDX=state_indices is not None, **launch)
    return o
