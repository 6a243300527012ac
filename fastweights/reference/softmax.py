"""Exact reference forms of the softmax side: softmax attention, FoX, ALiBi, DeltaFormer, PaTH.

The memory is the unbounded key/value cache (`KVCache`); the "feature map" is the softmax kernel.
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log-retention ≤ 0; beta [B, T, H];
w [B, T, H, K]. Positions are absolute over the cache followed by the new tokens (a cache of
length L puts the new token t at position L + t).

Retention bias. c_i = Σ_{τ≤i} g_τ over the whole sequence including the cache (the cache stores
c per cached position, new tokens continue from the last cached c). Every logit is

    ℓ_ij = scale · q_iᵀ P_ij k_j + (c_i − c_j),         (no bias when g is None)

with P_ij = I except for PaTH. For ALiBi/constant retention the caller passes g filled with the
per-head constant log γ_h, so c_i − c_j = (i − j) log γ_h; FoX passes a data-dependent g.

objective "dot" (softmax attention, FoX, ALiBi): causal, inclusive of the current token,

    o_i = Σ_{j≤i} softmax_j(ℓ_ij) v_j.

objective "l2" (DeltaFormer, Zhong et al. 2025: the delta rule in the softmax kernel's feature
space). First the corrected values, softmax over STRICTLY previous positions (cache included):

    u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(scale · k_iᵀ k_j + c_i − c_j) u_j     (u_i = v_i if none),

then o_i = Σ_{j≤i} softmax_j(ℓ_ij) u_j. The cache stores (k, u): KVCache.v holds u.
We follow the paper and read stage 1 at the key k_i, κ(k_i, k_j). fla's implementation
(`fla/ops/deltaformer`) reads stage 1 with the query q_i instead (and uses the raw β without a
sigmoid); with q ≠ k the two differ.

retention "householder" (PaTH, Yang et al. 2025): H_t = I − β_t w_t w_tᵀ, P_ij = H_i H_{i−1} ⋯ H_{j+1}
for j < i and P_ii = I, plus the optional FoX bias c_i − c_j when g is given. The bias is added
after the scale, as in FoX (fla's kernel adds it before multiplying by 1/√d, i.e. scales it too).
w is used as given (the layer L2-normalizes it).

Two forms, equal up to rounding (outputs, final caches and gradients):

    softmax_recurrent: token-by-token decoding over the cache. PaTH updates every cached key in
        place on each new token, k_j ← k_j − β_t (k_j·w_t) w_t, before appending k_t, so its
        scores against the cache are plain dot products (plus the FoX bias).
    softmax_parallel:  the quadratic matrix form: all logits at once with a causal mask applied
        by torch.where (never multiplied into an exp); DeltaFormer's u by one unit lower-triangular
        solve, (I + diag(β) W_new) u = v − diag(β) W_cache u_cache; PaTH's logits by a loop over
        diagonal offsets d that carries all query rows at once (O(T²K)).

Precision: everything (logits, max-subtracted softmax, cumulative gates, solve) runs in the
promotion of the inputs' dtypes with float32 (float64 stays float64). The output is cast to v's
dtype; the final cache (k, v, c) is returned in that compute dtype.

Cache and gates: the final cache carries c whenever g is given or the initial cache has c. An
initial cache without c under a given g counts its entries as c = 0; a missing g under an initial
cache with c counts as g = 0 (no further forgetting), so the cached bias still applies.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..state import KVCache

Tensor = torch.Tensor

__all__ = ["softmax_recurrent", "softmax_parallel"]

_OBJECTIVES = ("dot", "l2")
_RETENTIONS = ("none", "constant", "scalar", "householder")


# ---------------------------------------------------------------------------- shared pieces
def _masked_softmax(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax over the last dim of x, only where mask is True (mask broadcasts against x).

    Masked logits are set to −inf with torch.where before the exp; the row maximum is
    subtracted; rows with no allowed entry give zeros (not NaN). Runs in x's dtype (≥ fp32)."""
    if mask is not None:
        x = torch.where(mask, x, float("-inf"))
    m = x.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def _prepare(q, k, v, objective, retention, g, beta, w, initial_state):
    """Check the options, fill defaults, cast to the compute dtype, unpack the cache.

    Returns a namespace with q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] or None;
    w [B, T, H, K] or None; k0 [B, L, H, K], v0 [B, L, H, V] (the cache); c0 [B, L, H] and
    cn [B, T, H] (cumulative log-retention of the cache and of the new tokens) or None."""
    if objective not in _OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {list(_OBJECTIVES)}")
    if retention not in _RETENTIONS:
        raise ValueError(f"retention={retention!r} is not one of {list(_RETENTIONS)}")
    path = retention == "householder"
    if path:
        if objective != "dot":
            raise ValueError("retention='householder' (PaTH) is defined with objective='dot' only")
        if w is None:
            raise ValueError("w is required for retention='householder' (PaTH): w [B, T, H, K]")
        if beta is None:
            raise ValueError("beta is required for retention='householder' (PaTH): beta [B, T, H]")
    if retention in ("constant", "scalar") and g is None:
        raise ValueError(f"g is required for retention={retention!r}: g [B, T, H] (log-retention ≤ 0)")
    if not path:
        w = None
        if objective == "dot":
            beta = None

    cache = initial_state
    dtypes = [q, k, v, g, beta, w]
    if cache is not None:
        dtypes += [cache.k, cache.v, cache.c]
    cdt = torch.float32
    for x in dtypes:
        if x is not None:
            cdt = torch.promote_types(cdt, x.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if objective == "l2" and beta is None:
        beta = torch.ones(B, T, H, dtype=cdt, device=dev)  # [B, T, H]
    beta = beta.to(cdt) if beta is not None else None
    w = w.to(cdt) if w is not None else None

    if cache is not None:
        k0, v0 = cache.k.to(cdt), cache.v.to(cdt)  # [B, L, H, K], [B, L, H, V]
    else:
        k0 = torch.zeros(B, 0, H, K, dtype=cdt, device=dev)  # [B, 0, H, K]
        v0 = torch.zeros(B, 0, H, V, dtype=cdt, device=dev)  # [B, 0, H, V]
    L = k0.shape[1]
    use_c = g is not None or (cache is not None and cache.c is not None)
    c0 = cn = None
    if use_c:
        if cache is not None and cache.c is not None:
            c0 = cache.c.to(cdt)  # [B, L, H]
        else:
            c0 = torch.zeros(B, L, H, dtype=cdt, device=dev)  # [B, L, H]
        gg = g.to(cdt) if g is not None else torch.zeros(B, T, H, dtype=cdt, device=dev)  # [B, T, H]
        c_last = c0[:, -1] if L > 0 else torch.zeros(B, H, dtype=cdt, device=dev)  # [B, H]
        cn = c_last[:, None] + gg.cumsum(dim=1)  # [B, T, H]
    return SimpleNamespace(q=q, k=k, v=v, beta=beta, w=w, k0=k0, v0=v0, c0=c0, cn=cn, L=L,
                           B=B, T=T, H=H, K=K, V=V, cdt=cdt, l2=objective == "l2", path=path)


def _attend(x: Tensor, keys: Tensor, vals: Tensor, cx: Tensor | None, ckeys: Tensor | None,
            scale: float) -> Tensor:
    """One read of the cache: Σ_j softmax_j(scale·x·k_j + cx − c_j) v_j over all N entries.

    x [B, H, K]; keys [B, N, H, K]; vals [B, N, H, V]; cx [B, H], ckeys [B, N, H] or None.
    Returns [B, H, V]."""
    logits = scale * torch.einsum("bhk,bnhk->bhn", x, keys)  # [B, H, N]
    if cx is not None:
        logits = logits + (cx[:, :, None] - ckeys.transpose(1, 2))  # [B, H, N]
    return torch.einsum("bhn,bnhv->bhv", _masked_softmax(logits), vals)  # [B, H, V]


# ---------------------------------------------------------------------------- recurrent form
def softmax_recurrent(q: Tensor, k: Tensor, v: Tensor, *, scale: float, objective: str = "dot",
                      retention: str = "none", g: Tensor | None = None, beta: Tensor | None = None,
                      w: Tensor | None = None, initial_state: KVCache | None = None,
                      output_final_state: bool = False) -> tuple[Tensor, KVCache | None]:
    """Token-by-token decoding over a KVCache (see the module docstring for the maths).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] (log-retention ≤ 0) or None; beta [B, T, H]
    (DeltaFormer, default ones; PaTH, required); w [B, T, H, K] (PaTH, required); initial_state:
    a KVCache of length L prepended to the sequence (DeltaFormer: its v holds u; PaTH: its keys
    already transformed by every Householder seen). objective "dot" | "l2"; retention "none" |
    "constant" | "scalar" | "householder" (g is used whenever given).

    Per token t, with c_t its cumulative log-retention:
        PaTH:        k_j ← k_j − β_t (k_j·w_t) w_t for every cached j (before appending k_t)
        DeltaFormer: u_t = v_t − β_t Σ_{j cached} softmax_j(scale k_t·k_j + c_t − c_j) u_j
        append (k_t, u_t or v_t, c_t);  o_t = Σ_{j cached} softmax_j(scale q_t·k_j + c_t − c_j) v_j

    Returns (o [B, T, H, V] in v's dtype, the cache after the last token or None).
    """
    p = _prepare(q, k, v, objective, retention, g, beta, w, initial_state)
    keys, vals, cs = p.k0, p.v0, p.c0  # [B, L, H, K], [B, L, H, V], [B, L, H] | None
    outs = []
    for t in range(p.T):
        qt, kt, vt = p.q[:, t], p.k[:, t], p.v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        ct = p.cn[:, t] if p.cn is not None else None  # [B, H] | None
        if p.path:
            wt, bt = p.w[:, t], p.beta[:, t]  # [B, H, K], [B, H]
            proj = torch.einsum("bnhk,bhk->bnh", keys, wt)  # [B, N, H]
            keys = keys - (bt[:, None] * proj)[..., None] * wt[:, None]  # [B, N, H, K]
        if p.l2 and keys.shape[1] > 0:
            vt = vt - p.beta[:, t, :, None] * _attend(kt, keys, vals, ct, cs, scale)  # [B, H, V]: u_t
        keys = torch.cat([keys, kt[:, None]], dim=1)  # [B, N + 1, H, K]
        vals = torch.cat([vals, vt[:, None]], dim=1)  # [B, N + 1, H, V]
        if cs is not None:
            cs = torch.cat([cs, ct[:, None]], dim=1)  # [B, N + 1, H]
        outs.append(_attend(qt, keys, vals, ct, cs, scale))  # [B, H, V]
    o = torch.stack(outs, dim=1) if outs else p.v[:, :0]  # [B, T, H, V]
    final = KVCache(k=keys, v=vals, c=cs) if output_final_state else None
    return o.to(v.dtype), final


# ---------------------------------------------------------------------------- parallel form
def _path_logits(q: Tensor, k: Tensor, kc: Tensor, beta: Tensor, w: Tensor) -> Tensor:
    """PaTH's raw scores q_iᵀ H_i ⋯ H_{j+1} k_j for every query i and key j ≤ i (unscaled).

    q, k, w [B, H, T, K]; beta [B, H, T]; kc [B, H, L, K] (cached keys, already transformed
    by the Householders before the new tokens; they sit before new token 0).
    Returns [B, H, T, L + T]; entries with j > i hold unspecified finite values (mask them).

    Since each H is symmetric, q_iᵀ H_i ⋯ H_{j+1} k_j = (H_{j+1} ⋯ H_i q_i)·k_j. The loop over
    diagonal offsets d carries every query row at once: before step d, row i holds
    Q_i = H_{i−d+1} ⋯ H_i q_i; it scores key i − d, then takes H_{i−d} on the left. After the
    last step, Q_i = H_0 ⋯ H_i q_i, which scores the cache."""
    B, H, T, K = q.shape
    Q = q
    diags = []
    for d in range(T):
        Qa = Q[:, :, d:]  # [B, H, T − d, K]: rows i ≥ d
        ks, ws, bs = k[:, :, : T - d], w[:, :, : T - d], beta[:, :, : T - d]  # key/H index i − d
        diags.append(F.pad((Qa * ks).sum(-1), (d, 0)))  # [B, H, T]: D[i] = Q_i·k_{i−d} (0 for i < d)
        Qa = Qa - (bs * (Qa * ws).sum(-1))[..., None] * ws  # [B, H, T − d, K]: apply H_{i−d}
        Q = torch.cat([Q[:, :, :d], Qa], dim=2)  # [B, H, T, K]
    D = torch.stack(diags, dim=-1)  # [B, H, T, T]: D[..., i, d] = score of row i with key i − d
    ar = torch.arange(T, device=q.device)
    offset = (ar[:, None] - ar[None, :]).clamp(min=0)  # [T, T]: i − j
    new = torch.gather(D, -1, offset.expand(B, H, T, T))  # [B, H, T, T]: new[i, j] = D[i, i − j]
    cached = Q @ kc.transpose(-1, -2)  # [B, H, T, L]
    return torch.cat([cached, new], dim=-1)  # [B, H, T, L + T]


def _path_final_keys(kall: Tensor, beta: Tensor, w: Tensor, L: int) -> Tensor:
    """Every key transformed by all later Householders: key j ends as H_{T−1} ⋯ H_{j+1} k_j.

    kall [B, H, L + T, K] (cache then new keys); beta [B, H, T]; w [B, H, T, K]. New token t
    sits at position L + t; its H_t acts on the keys before it (vectorized over those keys)."""
    T = w.shape[2]
    for t in range(T):
        n = L + t
        old = kall[:, :, :n]  # [B, H, n, K]
        wt = w[:, :, t, None]  # [B, H, 1, K]
        old = old - beta[:, :, t, None, None] * (old * wt).sum(-1, keepdim=True) * wt  # [B, H, n, K]
        kall = torch.cat([old, kall[:, :, n:]], dim=2)  # [B, H, L + T, K]
    return kall


def softmax_parallel(q: Tensor, k: Tensor, v: Tensor, *, scale: float, objective: str = "dot",
                     retention: str = "none", g: Tensor | None = None, beta: Tensor | None = None,
                     w: Tensor | None = None, initial_state: KVCache | None = None,
                     output_final_state: bool = False) -> tuple[Tensor, KVCache | None]:
    """The quadratic matrix form; same arguments, results and final cache as `softmax_recurrent`.

    With N = L + T keys (cache then new tokens) and query t at position L + t:
        logits [B, H, T, N] = scale·Q Kᵀ (PaTH: `_path_logits`) + (c_t − c_j), causal mask j ≤ L + t
        DeltaFormer: W = strictly causal softmax of scale·K_new Kᵀ + bias, split [W_c | W_n];
                     u = (I + diag(β) W_n)⁻¹ (v − diag(β) W_c u_cache)  (unit lower triangular)
        o = softmax(logits) [u_cache or v_cache; u or v]
    The final cache is (K, [v_cache; v or u], [c_cache; c]); for PaTH, K transformed by every
    Householder of the new tokens (`_path_final_keys`).
    """
    p = _prepare(q, k, v, objective, retention, g, beta, w, initial_state)
    T, L = p.T, p.L
    N = L + T
    qh, kh, vh = p.q.transpose(1, 2), p.k.transpose(1, 2), p.v.transpose(1, 2)  # [B, H, T, K|K|V]
    k0h, v0h = p.k0.transpose(1, 2), p.v0.transpose(1, 2)  # [B, H, L, K], [B, H, L, V]
    kall = torch.cat([k0h, kh], dim=2)  # [B, H, N, K]
    if p.cn is not None:
        call = torch.cat([p.c0, p.cn], dim=1).transpose(1, 2)  # [B, H, N]
        bias = p.cn.transpose(1, 2)[..., :, None] - call[..., None, :]  # [B, H, T, N]
    else:
        call, bias = None, 0.0
    pos_q = L + torch.arange(T, device=qh.device)  # [T]
    pos_k = torch.arange(N, device=qh.device)  # [N]
    causal = pos_k[None, :] <= pos_q[:, None]  # [T, N]
    strict = pos_k[None, :] < pos_q[:, None]  # [T, N]

    if p.l2:
        Wt = _masked_softmax(scale * kh @ kall.transpose(-1, -2) + bias, strict)  # [B, H, T, N]
        Wc, Wn = Wt[..., :L], Wt[..., L:]  # [B, H, T, L], [B, H, T, T] (strictly lower)
        bh = p.beta.transpose(1, 2)[..., None]  # [B, H, T, 1]
        rhs = vh - bh * (Wc @ v0h)  # [B, H, T, V]
        A = torch.eye(T, dtype=p.cdt, device=qh.device) + bh * Wn  # [B, H, T, T], unit lower triangular
        vnew = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, T, V]: u
    else:
        vnew = vh
    vall = torch.cat([v0h, vnew], dim=2)  # [B, H, N, V]

    if p.path:
        bh, wh = p.beta.transpose(1, 2), p.w.transpose(1, 2)  # [B, H, T], [B, H, T, K]
        raw = _path_logits(qh, kh, k0h, bh, wh)  # [B, H, T, N]
    else:
        raw = qh @ kall.transpose(-1, -2)  # [B, H, T, N]
    P = _masked_softmax(scale * raw + bias, causal)  # [B, H, T, N]
    o = (P @ vall).transpose(1, 2)  # [B, T, H, V]

    final = None
    if output_final_state:
        if p.path:
            kall = _path_final_keys(kall, bh, wh, L)  # [B, H, N, K]
        final = KVCache(k=kall.transpose(1, 2), v=vall.transpose(1, 2),  # [B, N, H, K], [B, N, H, V]
                        c=call.transpose(1, 2) if call is not None else None)  # [B, N, H]
    return o.to(v.dtype), final
