"""The split forward of the delta class with the decay first (`DeltaPipeline(forward="split")`; issue 32): the fused
forward's pre-pass, a sequential pass that carries the states alone, and a chunk-parallel output kernel — the
peers' (fla, FlashQLA) division of the work, where the fused forward (delta_fused.py) writes the outputs inside its
sequential loop (255 registers, 9 % occupancy on the H200).

1. `delta_fused.prepass`: T (and, beyond the states kernel's scope, W, U' — and KDA's Aqk from the scores kernel).
2. The states, sequential, grid (⌈V/BV⌉, sequences·H), S [K, BV] fp32 in registers:
   - no or a scalar decay, K ≤ 128, C ≤ 64 (`delta_fused_bwd.supports`): the backward's recompute kernel
     (`delta_fused_bwd._states_kernel` through `states_forward`, launch site "delta_split_states"), the pre-pass
     writing T only: U_n = T diag(β)(V − diag(Γ) K S_n), S_{n+1} = a S_n + Kᵀ diag(e^{G_last − G}) U_n;
   - else (KDA, K = 256, C = 128): `delta_fused._fused_fwd_kernel` with OUTPUT 0 on the pre-pass's W, U'
     (U_n = U'_n − W_n S_n; no q, Aqk or o in the loop);
   (the GPU's head-dim limit of the fused forward, K, V ≤ 128, holds only on that second path: at K 128, V 256 the
   split forward runs where the fused one is refused); writing the entering states h [B, NT, H, K, V] (the inputs'
   dtype for bf16 / fp16, fp32 for fp32), U [B, T, H, V] (v's dtype) and the final state.
3. `_output_kernel`, chunk-parallel, grid (chunk slots NT, ⌈V/BV⌉, B·H): per chunk, with Γ = e^{G},

       o = diag(scale Γ) Q h_n + (scale Q Kᵀ ⊙ E ⊙ causal) U_n,   E_ij = e^{G_i − G_j}

   q and k to the tensor cores as stored (the scale and decays on the [C, BV] and [C, C] sides, as the fused
   forward's RAW_QK 1), Aqk computed in registers for no or a scalar decay (or read, where the pre-pass wrote it:
   LAUNCH["delta_prepass"]["AQK"] beyond the states kernel's scope), read from the scores kernel's for KDA (then
   Q̃ = q ⊙ e^{G}, G the per-channel chunk-local cumsum, formed in fp32).

The same roundings as the fused forward: the state and U are tensor-core operands in the inputs' dtype in both (there
rounded in registers, here stored so), fp32 accumulation. The extra memory traffic against the fused forward — h and U
written by the states pass and read by the output kernel, q and k read a second time — is counted in
docs/kernel_notes.md ("the split forward"). h and U are the backward's inputs: with `recompute_states=False` the
backward keeps them at no extra cost (the glue, delta.py).

Every constexpr depends on the head dims, the dtype, the gate kind, the chunk size and the flags only; T and NT are
not specialized, so a new varlen packing compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import chunk_span, dot_dtype, launch, mm, pow2, tile, varlen_args
from .delta_fused import check_head_dims, prepass, sequential
from .delta_fused_bwd import states_forward, supports

__all__ = ["split_forward", "split_outputs"]


@triton.jit(do_not_specialize=["T", "NT"])
def _output_kernel(q, k, g, A, h, u, o, cu, chunk_seq, chunk_local, scale, T, NT, H: tl.constexpr, HQ: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, A_IN: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
                   IEEE: tl.constexpr):
    # GATE 0 none, 1 scalar [B, T, H], 2 diagonal [B, T, H, K] (the raw log-decay; its chunk-local cumsum here);
    # A_IN: Aqk [B, T, H, C] fp32 read (scaled, decayed, causal), else formed from Q Kᵀ (GATE 0 / 1 only)
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hq = i_h // (H // HQ)
    t0, eos = chunk_span(i_n, i_b, T, C, cu, chunk_seq, chunk_local, IS_VARLEN)
    if IS_VARLEN:
        if t0 >= eos:  # an unused slot (`common.layout`): exit before any load
            return
    slot = i_b.to(tl.int64) * NT + i_n
    oc = tl.arange(0, C)
    rows = t0 + oc
    m_t = rows < eos
    vv = i_v * BV + tl.arange(0, BV)
    m_vv = vv < V
    causal = oc[:, None] >= oc[None, :]
    p_h = h + (slot * H + i_h) * K * V
    acc = tl.zeros([C, BV], dtype=tl.float32)  # Q h_n (Q̃ h_n for KDA)
    if not A_IN:
        b_A = tl.zeros([C, C], dtype=tl.float32)  # Q Kᵀ
    for i_k in range(0, tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m_kk = kk < K
        m_tk = m_t[:, None] & m_kk[None, :]
        b_q = tl.load(q + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_tk, other=0.0)  # [C, BK]
        b_h = tl.load(p_h + kk[:, None] * V + vv[None, :], mask=m_kk[:, None] & m_vv[None, :], other=0.0)  # [BK, BV]
        if GATE == 2:
            Gk = tl.cumsum(tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_tk, other=0.0)
                           .to(tl.float32), axis=0)  # [C, BK]
            acc += mm(b_q.to(tl.float32) * tl.exp(Gk), b_h, DT, IEEE)
        else:
            acc += mm(b_q, b_h, DT, IEEE)
        if not A_IN:
            b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kk[:, None] & m_t[None, :],
                           other=0.0)  # Kᵀ [BK, C]
            b_A += mm(b_q, b_kt, DT, IEEE)
    if GATE == 1:
        G = tl.cumsum(tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)  # [C]
        acc = acc * (scale * tl.exp(G))[:, None]
        if not A_IN:
            b_A = b_A * (scale * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)))  # exponent ≤ 0
    else:
        acc = acc * scale
        if not A_IN:
            b_A = b_A * scale
    if A_IN:
        b_A = tl.load(A + (rows[:, None] * H + i_h) * C + oc[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
    else:
        b_A = tl.where(causal, b_A, 0.0)
    off = (rows[:, None] * H + i_h) * V + vv[None, :]
    m = m_t[:, None] & m_vv[None, :]
    acc += mm(b_A, tl.load(u + off, mask=m, other=0.0), DT, IEEE)
    tl.store(o + off, acc.to(o.dtype.element_ty), mask=m)


def split_outputs(q, k, g, A, h, u, scale: float, L: Layout) -> torch.Tensor:
    """`_output_kernel`: o [B, T, H, V] in u's dtype from q, k [B, T, H_q, K], g None / [B, T, H] / [B, T, H, K] (raw),
    Aqk [B, T, H, C] fp32 or None (required for the diagonal decay), the entering states h [B, NT, H, K, V] and U
    [B, T, H, V]. BV: LAUNCH["delta_split_out"]["BV"] (one V block at V ≤ BV: Q Kᵀ formed once per chunk)."""
    gate = 0 if g is None else (2 if g.dim() == 4 else 1)
    assert gate != 2 or A is not None  # KDA's Aqk comes from the scores kernel
    BV = min(tile("delta_split_out", "BV"), pow2(L.V))
    o = empty_output(L.B, L.T, L.H, L.V, dtype=u.dtype, device=u.device)
    DT, IEEE = dot_dtype(q.dtype)
    _output_kernel[(L.NT, triton.cdiv(L.V, BV), L.B * L.H)](
        q, k, g if g is not None else q, A if A is not None else u, h, u, o, *varlen_args(L, u.device)[:3], scale,
        L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=min(tile("delta_split_out", "BK"), pow2(L.K)), BV=BV,
        GATE=gate, A_IN=A is not None, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **launch("delta_split_out"))
    return o


def split_forward(q, k, v, g, beta, h0, scale: float, L: Layout, *, output_final_state: bool, store_T: bool):
    """The decay-first delta rule's forward in three kernels (see the module docstring). Inputs as
    `delta_fused.fused_forward`'s: q, k [B, T, H_q, K], v [B, T, H, V] (one dtype), g None / [B, T, H] / [B, T, H, K]
    (raw), β [B, T, H], h0 None or [NS, H, K, V] fp32. Returns (o [B, T, H, V] in v's dtype, T [B, T, H, C] in q's
    dtype or None (`store_T`), h [B, NT, H, K, V] and U [B, T, H, V] (always: the output kernel's inputs, the
    backward's if it keeps them), the final state [NS, H, K, V] fp32 or None (`output_final_state`))."""
    t_form = supports(g, L)  # the backward's states kernel takes the call: the pre-pass writes T alone
    if not t_form:  # (the states kernel serves V = 256 at K ≤ 128 — the LM preset's gated DeltaNet — on a GPU too)
        check_head_dims(q, L, "split")
    chosen, w, u1, Ti, A = prepass(q, k, v, g, beta, scale, L, store_T=store_T, t_form=t_form)
    if t_form:
        _, h, u, ht = states_forward(q, k, v, g, beta, Ti, h0, scale, L, output=False, store_states=True,
                                     output_final_state=output_final_state, name="delta_split_states")
    else:
        _, h, u, ht = sequential(q, k, v, g, w, u1, None, h0, scale, L, output=False, store_states=True,
                                 output_final_state=output_final_state, raw_qk=chosen.raw_qk)
    del w, u1
    o = split_outputs(q, k, g, A, h, u, scale, L)
    return o, (Ti if store_T else None), h, u, ht
