"""pass_states' twin for the gated-linear class: the one sequential stage, chunk to chunk.

Forward, per sequence and head, with K̃_n = β k ⊙ e^{G_last − G} (rows of chunk n) and
a_n = e^{G_last} (G_last: the cumsum at the chunk's last real row):

    S_{n+1} = a_n ⊙ S_n + K̃_nᵀ V_n        (a_n on the key side; scalar or per channel)

stores S_n entering every chunk (h [B, NT, H, K, V], fp32, or bf16/fp16 for such inputs: see
`stored_state_dtype`) and the final state (fp32).

Backward (the transposed pass), with dS_{n+1} the gradient w.r.t. the state leaving chunk n
(the final state's gradient for the last chunk) and Q̃_n = scale q ⊙ e^{G}:

    dS_n = a_n ⊙ dS_{n+1} + Q̃_nᵀ dO_n

stores dS_{n+1} per chunk (dh [B, NT, H, K, V]: what dv and dk of chunk n need), dS_0 (the
initial state's gradient) and, with decay, the per-chunk term of dg: Σ_v S_{n+1} ⊙ dS_{n+1}
(∂L/∂G_last of chunk n), as partial sums per V tile.

Grid (⌈K/BK⌉, ⌈V/BV⌉, sequences·H): one [BK, BV] fp32 state tile per program, held in
registers across the sequence's chunks; each chunk is one tl.dot [BK, C] × [C, BV].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import empty_output
from ..common.layout import Layout
from ..common.util import dot_dtype, mm, pow2, seq_span, state_pass_launch, tile, varlen_args


@triton.jit
def _decays_t(g, rows, m_t, t_last, i_h, kk, m_kk, H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr):
    """(e^{G}ᵀ-shaped exponent source, G_last): the chunk's cumsum as [BK, C] (diagonal) or [C]
    (scalar) and its value at the last real row ([BK] or scalar)."""
    if GATE == 2:
        m = m_kk[:, None] & m_t[None, :]
        Gt = tl.load(g + (rows[None, :] * H + i_h) * K + kk[:, None], mask=m, other=0.0)
        G_last = tl.load(g + (t_last * H + i_h) * K + kk, mask=m_kk, other=0.0)
    else:
        Gt = tl.load(g + rows * H + i_h, mask=m_t, other=0.0)
        G_last = tl.load(g + t_last * H + i_h)
    return Gt, G_last


@triton.jit
def decayed_update(S, b_kt, b_x, g, rows, m_t, t_last, i_h, kk, m_kk, H: tl.constexpr, K: tl.constexpr,
                   GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    """One chunk of the forward state pass: S ← Diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ X, with
    b_kt the chunk's keys transposed [BK, C] and b_x its values [C, BV] (U for the delta class)."""
    if GATE != 0:
        Gt, G_last = _decays_t(g, rows, m_t, t_last, i_h, kk, m_kk, H, K, GATE)
        if GATE == 2:
            b_kt = b_kt * tl.exp(tl.where(m_t[None, :], G_last[:, None] - Gt, 0.0))  # exponent ≤ 0
            S = S * tl.exp(G_last)[:, None]
        else:
            b_kt = b_kt * tl.exp(tl.where(m_t, G_last - Gt, 0.0))[None, :]
            S = S * tl.exp(G_last)
    return S + mm(b_kt, b_x, DT, IEEE)


@triton.jit(do_not_specialize=["T", "NT"])
def _states_fwd_kernel(k, v, g, beta, h, h0, ht, cu, offsets, T, NT, H: tl.constexpr, HQ: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, HAS_BETA: tl.constexpr, HAS_H0: tl.constexpr,
                       STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    i_k, i_v, i_sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    kk = i_k * BK + tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kk, m_vv = kk < K, vv < V
    m_kv = m_kk[:, None] & m_vv[None, :]
    kv = kk[:, None] * V + vv[None, :]  # offsets inside one [K, V] state
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_s.to(tl.int64) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(0, n_chunks):  # a for loop (a while loop is not software-pipelined)
        tl.store(h + ((slot0 + c) * H + i_h) * K * V + kv, S.to(h.dtype.element_ty), mask=m_kv)
        rows = bos + c * C + tl.arange(0, C)
        m_t = rows < eos
        t_last = tl.minimum(bos + c * C + C, eos) - 1
        b_kt = tl.load(k + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kk[:, None] & m_t[None, :],
                       other=0.0).to(tl.float32)  # [BK, C]
        if HAS_BETA:
            b_kt = b_kt * tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)[None, :]
        b_v = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                      other=0.0)  # [C, BV]
        S = decayed_update(S, b_kt, b_v, g, rows, m_t, t_last, i_h, kk, m_kk, H, K, GATE, DT, IEEE)
    if STORE_FINAL:
        tl.store(ht + (i_s.to(tl.int64) * H + i_h) * K * V + kv, S, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT", "NB"])
def _states_bwd_kernel(q, g, do, h, ht, dht, dh, dh0, dgc, cu, offsets, scale, T, NT, NB,
                       H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, HAS_DHT: tl.constexpr,
                       HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    i_k, i_v, i_sh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_h = i_sh // H, i_sh % H
    i_hq = i_h // (H // HQ)
    bos, eos, n_chunks, slot0 = seq_span(i_s, T, C, NT, cu, offsets, IS_VARLEN)
    kk = i_k * BK + tl.arange(0, BK)
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
        b_qt = tl.load(q + (rows[None, :] * HQ + i_hq) * K + kk[:, None], mask=m_kk[:, None] & m_t[None, :],
                       other=0.0).to(tl.float32) * scale  # [BK, C]
        b_do = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_vv[None, :],
                       other=0.0)  # [C, BV]
        if GATE != 0:
            # ∂L/∂G_last of this chunk: Σ_v S_{n+1} ⊙ dS_{n+1} (S_{n+1}: the next entering state or the final one)
            if c == n_chunks - 1:
                S_next = tl.load(ht + fin + kv, mask=m_kv, other=0.0)
            else:
                S_next = tl.load(h + ((slot + 1) * H + i_h) * K * V + kv, mask=m_kv, other=0.0).to(tl.float32)
            tl.store(dgc + ((i_v * NT * NB + slot) * H + i_h) * K + kk, tl.sum(S_next * dS, axis=1), mask=m_kk)
            Gt, G_last = _decays_t(g, rows, m_t, t_last, i_h, kk, m_kk, H, K, GATE)
            if GATE == 2:
                b_qt = b_qt * tl.exp(tl.where(m_t[None, :], Gt, 0.0))
                dS = dS * tl.exp(G_last)[:, None]
            else:
                b_qt = b_qt * tl.exp(tl.where(m_t, Gt, 0.0))[None, :]
                dS = dS * tl.exp(G_last)
        dS += mm(b_qt, b_do, DT, IEEE)
    if HAS_H0:
        tl.store(dh0 + fin + kv, dS, mask=m_kv)


def _tiles(L: Layout, name: str):
    """(BK, BV, NK, NV): BV from util.LAUNCH[name]."""
    BK, BV = min(64, pow2(L.K)), min(tile(name, "BV"), pow2(L.V))
    return BK, BV, triton.cdiv(L.K, BK), triton.cdiv(L.V, BV)


def stored_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-chunk states h and dh: the inputs' bf16/fp16 (every product that reads
    them casts its operands to that dtype for the tensor cores anyway, so storing them rounded
    halves their bytes and changes only the elementwise Σ_v S ⊙ dS of dg by one rounding), else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def pass_states_fwd(k, v, G, beta, h0, L: Layout, *, output_final_state: bool):
    """(h [B, NT, H, K, V] in `stored_state_dtype(k.dtype)`: the state entering every chunk slot,
    final [NS, H, K, V] fp32 or None). Accumulation is fp32 throughout."""
    BK, BV, NK, NV = _tiles(L, "states_fwd")
    h = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=stored_state_dtype(k.dtype), device=k.device)
    ht = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=k.device) if output_final_state else None
    cu, _, _, offsets = varlen_args(L, k.device)
    DT, IEEE = dot_dtype(k.dtype)
    _states_fwd_kernel[(NK, NV, L.NS * L.H)](
        k, v, G if G is not None else k, beta if beta is not None else k, h, h0 if h0 is not None else k,
        ht if ht is not None else h, cu, offsets, L.T, L.NT, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), HAS_BETA=beta is not None, HAS_H0=h0 is not None,
        STORE_FINAL=output_final_state, IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE,
        **state_pass_launch("states_fwd", k.dtype, L.K))
    return h, ht


def pass_states_bwd(q, G, do, h, ht, dht, scale: float, L: Layout, *, need_dh0: bool):
    """(dh [B, NT, H, K, V] in `stored_state_dtype(q.dtype)`: the gradient of the state leaving each
    chunk slot, dh0 [NS, H, K, V] fp32 or None, dgc None or ∂L/∂G_last per chunk slot, fp32:
    [B·NT, H] (scalar) / [B·NT, H, K] (diagonal))."""
    BK, BV, NK, NV = _tiles(L, "states_bwd")
    dev = q.device
    dh = empty_output(L.B, L.NT, L.H, L.K, L.V, dtype=stored_state_dtype(q.dtype), device=dev)
    dh0 = empty_output(L.NS, L.H, L.K, L.V, dtype=torch.float32, device=dev) if need_dh0 else None
    dgc = empty_output(NV, L.B * L.NT, L.H, L.K, dtype=torch.float32, device=dev) if G is not None else None
    cu, _, _, offsets = varlen_args(L, dev)
    DT, IEEE = dot_dtype(q.dtype)
    _states_bwd_kernel[(NK, NV, L.NS * L.H)](
        q, G if G is not None else q, do, h, ht if ht is not None else h, dht if dht is not None else h, dh,
        dh0 if dh0 is not None else dh, dgc if dgc is not None else dh, cu, offsets, scale, L.T, L.NT,
        L.B if not L.varlen else 1, H=L.H, HQ=L.Hq, K=L.K, V=L.V, C=L.C, BK=BK, BV=BV,
        GATE=0 if G is None else (2 if G.dim() == 4 else 1), HAS_DHT=dht is not None, HAS_H0=need_dh0,
        IS_VARLEN=L.varlen, DT=DT, IEEE=IEEE, **state_pass_launch("states_bwd", q.dtype, L.K))
    if dgc is not None:
        dgc = dgc.sum(0)  # over the V tiles  [B·NT, H, K]
        if G.dim() == 3:
            dgc = dgc.sum(-1)  # scalar gate: over the channels too  [B·NT, H]
    return dh, dh0, dgc
