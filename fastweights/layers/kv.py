"""The softmax-side memories (kv recipes) as the layers run them: one `kv_extend` that appends a
block of T tokens to a KVCache and attends, for prefill (T = the prompt) and decoding (T = 1).

Every kv recipe reads its cache through the exp kernel. With positions counted from the start of
the sequence, a query at position i sees the keys j ≤ i with logits

    s_ij = scale · q_iᵀ P_ij k_j + (c_i − c_j),     o_i = Σ_j softmax_j(s_ij) v_j

    c            cumulative log-retention, c_i = Σ_{τ≤i} g_τ (fp32): none (c = 0); constant
                 (ALiBi, c_i = i·log γ_h); scalar (FoX's forget gate, PaTH's optional one)
    P_ij         I, except PaTH (retention 'householder'): P_ij = H_i H_{i−1} ⋯ H_{j+1},
                 H_t = I − β_t w_t w_tᵀ (the empty product for j = i)
    v_j          the value, except DeltaFormer (objective 'l2'): the solved value u_j,
                 u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(scale · k_iᵀ k_j + c_i − c_j) u_j

The cache holds what a later query needs: DeltaFormer caches u; PaTH caches every key already
multiplied by all Householders seen so far (k̃_j = P_{L,j} k_j for a cache of length L), so a new
token only transforms the cache once; c is cached per position (per query head).

Algorithms (exact; no switching by length — PaTH's blocks longer than PATH_BLOCK run as sub-blocks through the
cache, the same maths in every case):
  * dot objective, no Householder: torch SDPA over [cache; block] with a boolean causal mask,
    or a float bias mask c_i − c_j (−inf above the diagonal) when there is retention.
  * DeltaFormer: the block's u solve a unit lower-triangular system
        (I + diag(β) W) u = v − β · (W_cache u_cache),  W = strictly causal softmax weights
    (rows of a first token, with no earlier keys, are 0), then SDPA with values [u_cache; u].
  * PaTH: the compact WY form of a product of Householders. With A = I + tril(diag(β) W Wᵀ, −1)
    and Tm = A⁻¹ (unit lower triangular; a contiguous diagonal block of Tm inverts the same block
    of A, so one inverse serves every segment (j, i]),
        H_i ⋯ H_{j+1} = I − Σ_{j<b≤a≤i} w_a Tm_ab β_b w_bᵀ,
    so s_ij = q_i·k_j − Σ_a [a ≤ i](q_i·w_a) Z_aj with Z = Tm · ([b > j] β_b w_b·k_j), and the
    new cache keys are K̃ − Zᵀ W. Decoding (T = 1) is fla's in-place update k_j ← k_j − β(k_j·w)w.

Documents (padding, packed sequences): `doc` [B, L + T] names the document of every cached and
new key (−1: padding); query i then sees key j only when j is in its document as well,
    visible_ij = [j ≤ i] · [doc_j = doc_i ≥ 0]   (a padding query sees itself, to stay finite),
and the products, retentions and solved values above only ever combine visible pairs.

GQA: k, v, w, β have Hkv heads (query head h uses kv head h // (H / Hkv)); g and c have H heads.
Stage-1 of DeltaFormer compares keys, so retention with GQA is not defined for it (an error).
Shapes: q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V], g [B, T, H] fp32 (fp64 with fp64 inputs), beta [B, T, Hkv],
w [B, T, Hkv, K] (unit), cache KVCache(k [B, L, Hkv, K], v [B, L, Hkv, V], c [B, L, H] | None).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constants import constant_log_gammas
from ..recipe import Recipe
from ..state import KVCache, compute_dtype

Tensor = torch.Tensor

__all__ = ["kv_extend", "empty_cache", "has_positions_bias"]


def empty_cache(recipe: Recipe, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                head_v_dim: int, *, dtype=torch.float32, device=None, forget_gate: bool = False) -> KVCache:
    """An empty cache: k [B, 0, Hkv, K], v [B, 0, Hkv, V], c [B, 0, H] fp32 (None without retention;
    PaTH has c only with its optional forget gate)."""
    kw = dict(dtype=dtype, device=device)
    c = None
    if has_positions_bias(recipe, forget_gate):
        cdt = compute_dtype(dtype)
        c = torch.zeros(batch_size, 0, num_heads, dtype=cdt, device=device)
    return KVCache(k=torch.zeros(batch_size, 0, num_kv_heads, head_dim, **kw),
                   v=torch.zeros(batch_size, 0, num_kv_heads, head_v_dim, **kw), c=c)


def has_positions_bias(recipe: Recipe, forget_gate: bool = False) -> bool:
    """Whether the cache carries c: constant or scalar retention, or PaTH with its forget gate."""
    kind = recipe.retention.kind
    return kind in ("constant", "scalar") or (kind == "householder" and forget_gate)


def _cumulative(recipe: Recipe, g: Tensor | None, cache: KVCache, B: int, T: int, H: int, device) -> Tensor | None:
    """c for the block's positions L, …, L + T − 1: [B, T, H] fp32, continuing the cached c."""
    ret = recipe.retention
    L = cache.length
    cdt = compute_dtype(cache.k)
    if ret.kind == "constant":  # c_i = (i + 1)·log γ_h, exact products instead of a long cumsum
        lg = constant_log_gammas(ret, H, cdt, device)  # [H] (cached on the device: no copy per call)
        pos = torch.arange(L + 1, L + T + 1, dtype=cdt, device=device)  # [T]
        return (pos[:, None] * lg[None, :]).expand(B, T, H)  # [B, T, H]
    if g is None:
        return None
    c0 = cache.c[:, -1:] if (cache.c is not None and L > 0) else torch.zeros(B, 1, H, dtype=cdt, device=device)
    return c0.to(cdt) + torch.cumsum(g.to(cdt), dim=1)  # [B, T, H]


class _Buffer:
    """Storage shared by the successive caches of one decoding run: k [B, cap, Hkv, K],
    v [B, cap, Hkv, V], c [B, cap, H] or None, and `frontier`, the length of the newest cache
    written into it. A cache appends in place only when it is that newest cache (so a state that
    is decoded twice, e.g. two branches from one prefix, never overwrites the other's entries)."""

    __slots__ = ("k", "v", "c", "frontier")

    def __init__(self, k, v, c, frontier):
        self.k, self.v, self.c, self.frontier = k, v, c, frontier


def _append(cache: KVCache, k: Tensor, v: Tensor, c: Tensor | None) -> KVCache:
    """The cache with T entries appended: k [B, T, Hkv, K], v [B, T, Hkv, V], c [B, T, H] or None.

    With autograd recording (training through a cache) it concatenates (a new tensor; onto an empty cache it
    returns k, v, c themselves, in their own dtype). Without,
    entries are written into a buffer whose capacity doubles when full, and the returned cache
    holds views of its first L + T positions: O(T) work per append instead of an O(L) copy. The
    views are ordinary tensors; `fastweights.recurrent(initial_state=cache)` reads them as is."""
    L, T = cache.length, k.shape[1]
    tensors = [x for x in (cache.k, cache.v, cache.c, k, v, c) if x is not None]
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        if L == 0 and cache.k.device == k.device:  # training's call (an empty cache on k's device; another device is
            # refused by the cat below, and named by the layer): the new entries as they are — no copy, no cast (under
            # autocast k, v come in its dtype: a cast to the empty cache's fp32 and back was 4 casts and 2 cats a layer)
            return KVCache(k=k, v=v, c=c)
        return KVCache(k=torch.cat([cache.k, k.to(cache.k.dtype)], 1), v=torch.cat([cache.v, v.to(cache.v.dtype)], 1),
                       c=torch.cat([cache.c, c.to(cache.c.dtype)], 1) if c is not None else None)
    buf = getattr(cache, "_buffer", None)
    fits = (buf is not None and buf.frontier == L and L + T <= buf.k.shape[1] and (buf.c is None) == (c is None)
            and buf.k.dtype == cache.k.dtype)
    if not fits:
        cap = max(2 * (L + T), 16)
        B = k.shape[0]
        new = lambda x: x.new_empty(B, cap, *x.shape[2:])  # [B, cap, ...]
        buf = _Buffer(new(cache.k), new(cache.v), new(cache.c) if c is not None else None, L)
        buf.k[:, :L], buf.v[:, :L] = cache.k, cache.v
        if c is not None:
            buf.c[:, :L] = cache.c
    buf.k[:, L:L + T] = k
    buf.v[:, L:L + T] = v
    if c is not None:
        buf.c[:, L:L + T] = c
    buf.frontier = L + T
    out = KVCache(k=buf.k[:, :L + T], v=buf.v[:, :L + T], c=buf.c[:, :L + T] if c is not None else None)
    out._buffer = buf
    return out


def _repeat_heads(x: Tensor, groups: int, dim: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def _bias_mask(L: int, T: int, c_all: Tensor | None, c_new: Tensor | None, device, strict: bool = False,
               doc: Tensor | None = None):
    """The additive mask [B, H, T, L + T] (or a boolean [T, L + T] / [B, 1, T, L + T]).

    Query i (position L + i) sees key j when j ≤ L + i (j < L + i when strict) and, with `doc`
    [B, L + T], when j is in i's document (a padding query sees itself unless strict)."""
    N = L + T
    qpos = torch.arange(L, N, device=device)[:, None]  # [T, 1]
    kpos = torch.arange(N, device=device)[None, :]  # [1, N]
    visible = kpos < qpos if strict else kpos <= qpos  # [T, N]
    if doc is not None:
        dq, dk = doc[:, L:, None], doc[:, None, :]  # [B, T, 1], [B, 1, N]
        visible = visible & (dq == dk) & (dk >= 0)  # [B, T, N]
        if not strict:
            visible = visible | (kpos == qpos)
        visible = visible[:, None]  # [B, 1, T, N]
    if c_all is None:
        return visible
    bias = c_new.transpose(1, 2)[..., :, None] - c_all.transpose(1, 2)[..., None, :]  # [B, H, T, N]
    return bias.masked_fill(~visible, float("-inf"))


def _masked_softmax(logits: Tensor) -> Tensor:
    """softmax over the last dim; rows with every entry −inf give zeros (not NaN)."""
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = (logits - m).exp()
    s = e.sum(-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA backends for calls with a cache. cuDNN's attention builds an execution plan for every new
shape, and a decoding step's key length is new at every call, so each step would pay a plan
build on the host many times the GPU work (measured: BENCHMARKS.md, decoding)."""


def _sdpa(q: Tensor, k_all: Tensor, v_all: Tensor, c_all, c_new, scale: float, groups: int,
          doc: Tensor | None = None) -> Tensor:
    """Attention of q [B, T, H, K] over k_all [B, N, Hkv, K], v_all [B, N, Hkv, V] -> [B, T, H, V].

    No retention: is_causal when the cache is empty, no mask for one token, else a boolean mask;
    with retention, the float bias c_i − c_j (−inf above the diagonal), cast to q's dtype."""
    T, N = q.shape[1], k_all.shape[1]
    qh = q.transpose(1, 2)  # [B, H, T, K]
    kh = _repeat_heads(k_all.transpose(1, 2), groups, 1)  # [B, H, N, K]
    vh = _repeat_heads(v_all.transpose(1, 2), groups, 1)  # [B, H, N, V]
    mask, causal = None, False
    if c_all is not None:
        mask = _bias_mask(N - T, T, c_all, c_new, q.device, doc=doc).to(qh.dtype)  # [B, H, T, N]
    elif doc is not None:
        mask = _bias_mask(N - T, T, None, None, q.device, doc=doc)  # [B, 1, T, N] bool
    elif N == T:
        causal = T > 1
    elif T > 1:
        mask = _bias_mask(N - T, T, None, None, q.device)  # [T, N] bool
    backends = sdpa_kernel(_NO_CUDNN) if q.is_cuda and N != T else nullcontext()  # N != T: a cache, new length
    with backends:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale)  # [B, H, T, V]
    return o.transpose(1, 2)  # [B, T, H, V]


def _deltaformer_values(k: Tensor, v: Tensor, beta: Tensor, cache: KVCache, c_all, c_new, scale: float,
                        doc: Tensor | None = None):
    """The block's solved values u [B, T, Hkv, V] (stage 1 of DeltaFormer), in fp32/fp64."""
    cdt = compute_dtype(k)
    B, T, Hk, K = k.shape
    L = cache.length
    k_all = torch.cat([cache.k, k], dim=1).to(cdt)  # [B, N, Hkv, K]
    kn = k.to(cdt).transpose(1, 2)  # [B, Hkv, T, K]
    logits = scale * kn @ k_all.transpose(1, 2).transpose(-1, -2)  # [B, Hkv, T, N]
    mask = _bias_mask(L, T, c_all, c_new, k.device, strict=True, doc=doc)
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask.to(cdt)
    W = _masked_softmax(logits)  # [B, Hkv, T, N]
    b = beta.to(cdt).transpose(1, 2)[..., None]  # [B, Hkv, T, 1]
    rhs = v.to(cdt).transpose(1, 2)  # [B, Hkv, T, V]
    if L > 0:
        rhs = rhs - b * (W[..., :L] @ cache.v.to(cdt).transpose(1, 2))  # [B, Hkv, T, V]
    A = torch.eye(T, dtype=cdt, device=k.device) + b * W[..., L:].tril(-1)  # [B, Hkv, T, T]
    u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, Hkv, T, V]
    return u.transpose(1, 2).to(v.dtype)  # [B, T, Hkv, V]


def _path_attend(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, cache: KVCache, c_all, c_new,
                 scale: float, groups: int, doc: Tensor | None = None):
    """PaTH over [cache; block]: (o [B, T, H, V], all keys transformed to the block's end [B, N, Hkv, K])."""
    cdt = compute_dtype(q)
    B, T, H, K = q.shape
    L = cache.length
    N = L + T
    Wt = w.to(cdt).transpose(1, 2)  # [B, Hkv, T, K]
    bt = beta.to(cdt).transpose(1, 2)  # [B, Hkv, T]
    WW = (bt[..., :, None] * (Wt @ Wt.transpose(-1, -2))).tril(-1)  # [B, Hkv, T, T]
    A = torch.eye(T, dtype=cdt, device=q.device) + WW  # unit lower triangular
    k_all = torch.cat([cache.k, k], dim=1).to(cdt).transpose(1, 2)  # [B, Hkv, N, K]
    after = torch.arange(L, N, device=q.device)[:, None] > torch.arange(N, device=q.device)[None, :]  # [T, N]
    Y = (bt[..., None] * (Wt @ k_all.transpose(-1, -2))).masked_fill(~after, 0.0)  # [B, Hkv, T(b), N(j)]
    # Z = A⁻¹ Y by one triangular solve (no explicit inverse: T·T·N flops instead of T³/3 + 2·T·T·N)
    Z = torch.linalg.solve_triangular(A, Y, upper=False, unitriangular=True)  # [B, Hkv, T(a), N(j)]
    new_keys = k_all - Z.transpose(-1, -2) @ Wt  # [B, Hkv, N, K]
    qh = q.to(cdt).transpose(1, 2)  # [B, H, T, K]
    X = (qh @ _repeat_heads(Wt, groups, 1).transpose(-1, -2)).tril()  # [B, H, T(i), T(a)], a ≤ i
    S = qh @ _repeat_heads(k_all, groups, 1).transpose(-1, -2) - X @ _repeat_heads(Z, groups, 1)  # [B, H, T, N]
    logits = scale * S
    mask = _bias_mask(L, T, c_all, c_new, q.device, doc=doc)
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask.to(cdt)
    P = torch.softmax(logits, dim=-1)  # [B, H, T, N]
    v_all = _repeat_heads(torch.cat([cache.v, v], dim=1).to(cdt).transpose(1, 2), groups, 1)  # [B, H, N, V]
    o = (P @ v_all).transpose(1, 2).to(v.dtype)  # [B, T, H, V]
    return o, new_keys.transpose(1, 2).to(k.dtype)  # [B, N, Hkv, K]


PATH_BLOCK = 256
"""PaTH's block: a longer block is run as consecutive sub-blocks of at most this many tokens, each appended to
the cache the one before left (the same maths as a prefill in pieces; its solve costs T·T·N flops a block, so a
whole 4,096-token prompt in one block would cost T³ ≈ 7·10¹⁰ a head, in sub-blocks 16× less)."""


def _path_blocks(recipe: Recipe, q, k, v, *, scale, cache: KVCache, g, beta, w, doc):
    """kv_extend of PaTH for T > PATH_BLOCK: consecutive sub-blocks, each extending the cache (o [B, T, H, V])."""
    L, T, outs = cache.length, q.shape[1], []
    for s in range(0, T, PATH_BLOCK):
        e = min(T, s + PATH_BLOCK)
        o, cache = kv_extend(recipe, q[:, s:e], k[:, s:e], v[:, s:e], scale=scale, cache=cache,
                             g=None if g is None else g[:, s:e], beta=beta[:, s:e], w=w[:, s:e],
                             doc=None if doc is None else doc[:, :L + e])
        outs.append(o)
    return torch.cat(outs, dim=1), cache


def kv_extend(recipe: Recipe, q: Tensor, k: Tensor, v: Tensor, *, scale: float, cache: KVCache,
              g: Tensor | None = None, beta: Tensor | None = None, w: Tensor | None = None,
              doc: Tensor | None = None) -> tuple[Tensor, KVCache]:
    """Append a block of T tokens to `cache` and attend from each of them (see the module doc).
    doc [B, L + T] int: the document of every cached and new key (−1: padding); None: one document.

    Returns (o [B, T, H, V] in v's dtype, the cache of length L + T).
    """
    if not recipe.is_softmax:
        raise ValueError(f"kv_extend serves kv-memory recipes; {recipe.name} has memory.kind={recipe.memory.kind!r}")
    B, T, H, K = q.shape
    Hk = k.shape[2]
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hk})")
    groups = H // Hk
    ret, obj = recipe.retention, recipe.objective
    if ret.kind == "householder" and T > PATH_BLOCK and w is not None and beta is not None:
        # sub-blocks through the cache (each computes its own retention sums): T·N·PATH_BLOCK flops instead of T²·N
        return _path_blocks(recipe, q, k, v, scale=scale, cache=cache, g=g, beta=beta, w=w, doc=doc)
    if ret.kind == "scalar" and g is None:
        raise ValueError(f"{recipe.name} needs g (log forget gate) [B, T, H]")
    c_new = _cumulative(recipe, g, cache, B, T, H, q.device)  # [B, T, H] or None
    if c_new is not None and cache.c is None:  # a cache made without c counts its entries as c = 0
        cache = KVCache(k=cache.k, v=cache.v, c=c_new.new_zeros(B, cache.length, H))
    c_all = None
    if c_new is not None and (ret.kind == "householder" or obj.kind == "l2"):
        c_all = torch.cat([cache.c, c_new], dim=1)  # [B, N, H]
    if ret.kind == "householder":
        if w is None or beta is None:
            raise ValueError(f"{recipe.name} needs w [B, T, Hkv, K] and beta [B, T, Hkv]")
        o, keys = _path_attend(q, k, v, w, beta, cache, c_all, c_new, scale, groups, doc)
        return o, KVCache(k=keys, v=torch.cat([cache.v, v], dim=1), c=c_all)
    if obj.kind == "l2":
        if beta is None:
            raise ValueError(f"{recipe.name} needs beta [B, T, Hkv]")
        if c_new is not None and groups > 1:
            raise ValueError("DeltaFormer's stage 1 compares keys per kv head: retention with grouped kv heads "
                             "is not defined; use num_kv_heads = num_heads")
        v = _deltaformer_values(k, v, beta, cache, c_all, c_new, scale, doc)
    new = _append(cache, k, v, c_new)  # k [B, N, Hkv, K], v [B, N, Hkv, V], c [B, N, H]
    o = _sdpa(q, new.k.to(q.dtype), new.v.to(q.dtype), new.c, c_new, scale, groups, doc)
    return o.to(v.dtype), new
