"""pass_states' twin for the delta class (either decay order: W carries the read key and decay,
delta_wy.py): the one sequential stage, fused with the new values U of each chunk, and its
transposed pass.

Forward, per sequence and head, chunk n entering with S_n [K, V] (fp32), W and U' from delta_wy.py,
K̃ = K ⊙ e^{G_last − G} and a = e^{G_last} (scalar, or per key channel: KDA):

    U_n     = U'_n − W_n S_n                 [C, V]  (stored, v's dtype: the output stage's values)
    S_{n+1} = a ⊙ S_n + K̃_nᵀ U_n            (a on the key side)

stores S_n entering every chunk slot (h [B, NT, H, K, V]: fp32 for fp32 inputs, else the inputs'
dtype, see `_stored`) and the final state (fp32).
W_n S_n needs the whole K of S_n, so a program holds a [K, BV] state tile (K ≤ 256).

Backward, last chunk first, with dS_{n+1} the gradient of the state leaving chunk n, dO_n the
output gradient, Q̃ = scale Q ⊙ e^{G} and dU_n^loc = Aqkᵀ dO_n (delta_output.py, in `du`):

    dU_n = dU_n^loc + K̃_n dS_{n+1}           (overwrites `du`, fp32: the gradient of U_n and of U'_n)
    dS_n = a ⊙ dS_{n+1} + Q̃_nᵀ dO_n − W_nᵀ dU_n

stores dS_{n+1} per chunk slot (dh), dS_0 and, with decay, ∂L/∂G_last = Σ_v S_{n+1} ⊙ dS_{n+1}
per chunk (partial sums per V tile), as the gated class's states.pass_states_bwd does.

Grid (⌈V/BV⌉, sequences·H); BV ≤ 64. Transposed operands (K̃ᵀ, Q̃ᵀ, Wᵀ) are loaded transposed
from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import dot_dtype, mm, pow2, seq_span, state_pass_launch, tile, varlen_args
from .states import _decays_t, decayed_update


@triton.jit(do_not_specialize=["T", "NT"])
def _delta_states_fwd_kernel(k, w, u1, g, h, h0, ht, u, cu, offsets, T, NT, H: tl.constexpr, HQ: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, GATE: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                             IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m_kv = m_kk[:, None] & m_vv[None, :]
    kv = kk[:, None] * V + vv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_s.to(tl.int64) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(0, n_chunks):  # a for loop (a while loop is not software-pipelined)
        tl.store(h + ((slot0 + c) * H + i_h) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        rows = bos + c * C + tl.arange(0, C)
        m_t = rows < eos
        t_last = tl.minimum(bos + c * C + C, eos) - 1
        m_tv = m_t[:, None] & m_vv[None, :]
        b_w = tl.load(w + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_kk[None, :],
                      other=0.0)  # [C, BK]
        off_u = (rows[:, None] * H + i_h) * V + vv[None, :]
        b_u = tl.load(u1 + off_u, mask=m_tv, other=0.0).to(tl.float32) - mm(b_w, S, DT, IEEE)  # [C, BV]
        tl.store(u + off_u, b_u.to(u.dtype.element_ty), mask=m_tv)
        b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kk[:, None] & m_t[None, :],
                       other=0.0).to(tl.float32)  # [BK, C]
        S = decayed_update(S, b_kt, b_u, g, rows, m_t, t_last, i_h, kk, m_kk, H, K, GATE, DT, IEEE)
    if STORE_FINAL:
        tl.store(ht + (i_s.to(tl.int64) * H + i_h) * K * V + kv, S, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT", "NB"])
def _delta_states_bwd_kernel(q, k, w, g, h, ht, dht, do, du, dh, dh0, dgc, cu, offsets, scale, T, NT, NB,
                             H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                             BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_DHT: tl.constexpr,
                             HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m_kv = m_kk[:, None] & m_vv[None, :]
    kv = kk[:, None] * V + vv[None, :]
    fin = (i_s.to(tl.int64) * H + i_h) * K * V
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + fin + kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_c in range(0, n_chunks):  # last chunk first (a for loop: pipelined)
        c = n_chunks - 1 - i_c
        slot = slot0 + c
        tl.store(dh + (slot * H + i_h) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_kv)
        rows = bos + c * C + tl.arange(0, C)
        m_t = rows < eos
        t_last = tl.minimum(bos + c * C + C, eos) - 1
        m_tk = m_t[:, None] & m_kk[None, :]
        m_kt = m_kk[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_vv[None, :]
        b_k = tl.load(k + (rows[:, None] * HQ + i_hq) * K + kk[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_qt = tl.load(q + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kt, other=0.0).to(tl.float32)
        b_qt = b_qt * scale  # [BK, C]
        if GATE != 0:
            # ∂L/∂G_last of this chunk: Σ_v S_{n+1} ⊙ dS_{n+1} (S_{n+1}: the next entering state or the final one)
            if c == n_chunks - 1:
                S_next = tl.load(ht + fin + kv, mask=m_kv, other=0.0)
            else:
                S_next = tl.load(h + ((slot + 1) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
            tl.store(dgc + ((i_v * NT * NB + slot) * H + i_h) * K + kk, tl.sum(S_next * dS, axis=1), mask=m_kk)
            Gt, G_last = _decays_t(g, rows, m_t, t_last, i_h, kk, m_kk, H, K, GATE)  # [BK, C] / [C]
            if GATE == 2:
                G = tl.load(g + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_tk, other=0.0)  # [C, BK]
                b_k = b_k * tl.exp(tl.where(m_tk, G_last[None, :] - G, 0.0))
                b_qt = b_qt * tl.exp(tl.where(m_kt, Gt, 0.0))
            else:
                b_k = b_k * tl.exp(tl.where(m_t, G_last - Gt, 0.0))[:, None]
                b_qt = b_qt * tl.exp(tl.where(m_t, Gt, 0.0))[None, :]
        off_u = (rows[:, None] * H + i_h) * V + vv[None, :]
        b_du = tl.load(du + off_u, mask=m_tv, other=0.0) + mm(b_k, dS, DT, IEEE)  # [C, BV]
        tl.store(du + off_u, b_du, mask=m_tv)
        b_do = tl.load(do + off_u, mask=m_tv, other=0.0)  # [C, BV]
        b_wt = tl.load(w + (rows[None, :] * H + i_h) * K + kk[:, None], mask=m_kt, other=0.0)  # Wᵀ  [BK, C]
        if GATE == 2:
            dS = dS * tl.exp(G_last)[:, None]
        elif GATE == 1:
            dS = dS * tl.exp(G_last)
        dS += mm(b_qt, b_do, DT, IEEE) - mm(b_wt, b_du, DT, IEEE)
    if HAS_H0:
        tl.store(dh0 + fin + kv, dS, mask=m_kv)


def _tiles(L: Layout, name: str):
    """(BK, BV): K whole; BV from util.LAUNCH[name], at most 32 for K > 128 (the [K, BV] fp32 state tile)."""
    bv = tile(name, "BV")
    return pow2(L.K), min(bv if L.K <= 128 else min(bv, 32), pow2(L.V))


def _stored(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-chunk states kept in memory (h, dh): the inputs' bf16/fp16, fp32 for fp32.
    Every reader uses them only as tensor-core operands, which `util.mm` rounds to that dtype anyway
    (the one exception, ∂L/∂G_last = Σ_v S_{n+1} ⊙ dS_{n+1}, reads them rounded); the state carried
    from chunk to chunk stays fp32 in registers."""
    return torch.float32 if dtype == torch.float32 else dtype


def pass_states_fwd(k, w, u1, G, h0, L: Layout, *, output_final_state: bool):
    """(h [B, NT, H, K, V] (`_stored` dtype): the state entering every chunk slot, final [NS, H, K, V] fp32 or None,
    U [B, T, H, V] in U''s dtype). k [B, T, H_q, K]; W [B, T, H, K], U' [B, T, H, V] from delta_wy."""
    BK, BV = _tiles(L, "delta_states_fwd")
    h = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=_stored(k.dtype), device=k.device)
    ht = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=k.device) if output_final_state else None
    u = empty_output(L.B, L.T, L.H, L.V, dtype=u1.dtype, device=k.device)
    cu, _, _, offsets = varlen_args(L, k.device)
    DT, IEEE = dot_dtype(k.dtype)
    _delta_states_fwd_kernel[(triton.cdiv(L.V, BV), L.NS * L.H)](
        k, w, u1, G if G is not None else k, h, h0 if h0 is not None else k, ht if ht is not None else h, u, cu,
        offsets, L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), HAS_H0=h0 is not None, STORE_FINAL=output_final_state,
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **state_pass_launch("delta_states_fwd", k.dtype, L.K))
    return h, ht, u


def pass_states_bwd(q, k, w, G, h, ht, dht, do, du, scale: float, L: Layout, *, need_dh0: bool):
    """(dh [B, NT, H, K, V] (`_stored` dtype): the gradient of the state leaving each chunk slot, dh0 [NS, H, K, V] or
    None, dgc None or ∂L/∂G_last per chunk slot [B·NT, H] (scalar) / [B·NT, H, K] (diagonal)).
    du: fp32 [B, T, H, V] holding Aqkᵀ dO on entry and the whole gradient of U on return."""
    BK, BV = _tiles(L, "delta_states_bwd")
    NV = triton.cdiv(L.V, BV)
    dev = q.device
    dh = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=_stored(q.dtype), device=dev)
    dh0 = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if need_dh0 else None
    dgc = empty_output(NV, L.B * L.NT, L.H, L.K, dtype=torch.float32, device=dev) if G is not None else None
    cu, _, _, offsets = varlen_args(L, dev)
    DT, IEEE = dot_dtype(q.dtype)
    _delta_states_bwd_kernel[(NV, L.NS * L.H)](
        q, k, w, G if G is not None else q, h, ht if ht is not None else h, dht if dht is not None else h, do, du,
        dh, dh0 if dh0 is not None else dh, dgc if dgc is not None else dh, cu, offsets, scale, L.T, L.NT,
        L.B if not L.varlen else 1, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), HAS_DHT=dht is not None, HAS_H0=need_dh0,
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **state_pass_launch("delta_states_bwd", q.dtype, L.K))
    if dgc is not None:
        dgc = dgc.sum(0)  # over the V tiles  [B·NT, H, K]
        if G.dim() == 3:
            dgc = dgc.sum(-1)  # scalar gate: over the channels too  [B·NT, H]
    return dh, dh0, dgc
