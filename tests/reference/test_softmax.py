"""Reference forms of the softmax side (softmax attention, FoX, ALiBi, DeltaFormer, PaTH).

Fresh random inputs each run (the seed is in every failure message); float64, tolerance 1e-10
unless stated: recurrent == parallel on outputs, final caches and gradients; chaining; the
special cases that reduce to plain softmax; SDPA; hand-computed PaTH reflections.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from fastweights.recipe import Retention
from fastweights.reference.softmax import softmax_parallel, softmax_recurrent
from fastweights.state import KVCache
from tests.tolerances import EXACT_F64, F32, SOFTMAX_BF16

D = torch.float64
FORMS = {"recurrent": softmax_recurrent, "parallel": softmax_parallel}

#: variant -> (objective, retention, has g, beta kind)
VARIANTS = {
    "plain": ("dot", "none", False, None),
    "fox": ("dot", "scalar", True, None),
    "alibi": ("dot", "constant", True, None),
    "deltaformer": ("l2", "none", False, "unit"),
    "deltaformer_fox": ("l2", "scalar", True, "unit"),
    "path": ("dot", "householder", False, "double"),
    "path_fox": ("dot", "householder", True, "double"),
}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _make(variant, *, T, B=2, H=2, K=4, V=3, L=3, seed, dtype=D):
    """(kwargs for the forms incl. q, k, v, scale, options; initial cache or None), leaves require grad."""
    objective, retention, has_g, beta_kind = VARIANTS[variant]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def unif(*shape):
        return torch.rand(*shape, generator=gen, dtype=dtype)

    kw = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V))
    if has_g:
        if retention == "constant":
            lg = torch.tensor(Retention(kind="constant", schedule="alibi").log_gammas(H), dtype=dtype)  # [H]
            kw["g"] = lg.expand(B, T, H).clone()  # [B, T, H]
        else:
            kw["g"] = -unif(B, T, H)  # [B, T, H], in (−1, 0]
    if beta_kind == "unit":
        kw["beta"] = unif(B, T, H)  # (0, 1)
    elif beta_kind == "double":
        kw["beta"] = 2 * unif(B, T, H)  # (0, 2)
    if retention == "householder":
        kw["w"] = F.normalize(rnd(B, T, H, K), dim=-1)  # [B, T, H, K], unit rows
    for x in kw.values():
        x.requires_grad_(True)
    cache = None
    if L is not None:
        cache = KVCache(k=rnd(B, L, H, K).requires_grad_(), v=rnd(B, L, H, V).requires_grad_(),
                        c=(-unif(B, L, H)).cumsum(1).requires_grad_() if has_g else None)
    kw.update(scale=K ** -0.5, objective=objective, retention=retention)
    return kw, cache


def _cache_tensors(c: KVCache | None) -> list[torch.Tensor]:
    if c is None:
        return []
    return [c.k, c.v] + ([c.c] if c.c is not None else [])


def _err(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _cache_err(a: KVCache, b: KVCache) -> float:
    assert (a.c is None) == (b.c is None)
    return max(_err(x, y) for x, y in zip(_cache_tensors(a), _cache_tensors(b)))


def _run_with_grads(fn, kw, cache, seed):
    """(o, final cache, gradients of a random linear functional of both w.r.t. every leaf)."""
    o, st = fn(**kw, initial_state=cache, output_final_state=True)
    gen = torch.Generator().manual_seed(seed + 1)
    outs = [o] + _cache_tensors(st)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=x.dtype)).sum() for x in outs)
    leaves = [x for x in kw.values() if isinstance(x, torch.Tensor)] + _cache_tensors(cache)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)  # unused: zeros
    return o, st, grads


# ---------------------------------------------------------------------------- recurrent == parallel
@pytest.mark.parametrize("with_cache", [True, False])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_recurrent_equals_parallel(variant, T, with_cache):
    seed = _seed()
    kw, cache = _make(variant, T=T, seed=seed, L=3 if with_cache else None)
    o1, s1, g1 = _run_with_grads(softmax_recurrent, kw, cache, seed)
    o2, s2, g2 = _run_with_grads(softmax_parallel, kw, cache, seed)
    msg = f"{variant} T={T} seed={seed}"
    assert o1.shape == kw["v"].shape and o1.dtype == D
    assert _err(o1, o2) < EXACT_F64, msg
    assert s1.length == s2.length == T + (3 if with_cache else 0), msg
    assert _cache_err(s1, s2) < EXACT_F64, msg
    n_leaves = len(kw) - 3 + len(_cache_tensors(cache))  # minus scale, objective, retention
    assert len(g1) == len(g2) == n_leaves
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert torch.isfinite(a).all(), msg
        assert _err(a, b) < EXACT_F64, f"{msg}: gradient of leaf {i}"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chaining_equals_one_run(variant, form):
    seed = _seed()
    fn = FORMS[form]
    T = 13
    kw, cache = _make(variant, T=T, seed=seed)
    with torch.no_grad():
        o_full, s_full = fn(**kw, initial_state=cache, output_final_state=True)
        for t in (1, 6, 12):
            first = {n: (x[:, :t] if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
            second = {n: (x[:, t:] if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
            o_a, s_a = fn(**first, initial_state=cache, output_final_state=True)
            o_b, s_b = fn(**second, initial_state=s_a, output_final_state=True)
            msg = f"{variant} {form} split at {t} seed={seed}"
            assert _err(torch.cat([o_a, o_b], dim=1), o_full) < EXACT_F64, msg
            assert _cache_err(s_b, s_full) < EXACT_F64, msg


def test_final_state_only_when_asked():
    kw, cache = _make("path_fox", T=5, seed=_seed())
    for fn in FORMS.values():
        assert fn(**kw, initial_state=cache)[1] is None


# ---------------------------------------------------------------------------- reductions
def _plain_kwargs(kw):
    return {n: kw[n] for n in ("q", "k", "v", "scale")}


@pytest.mark.parametrize("form", list(FORMS))
def test_plain_equals_sdpa_fp32(form):
    gen = torch.Generator().manual_seed(_seed())
    B, T, H, K, V = 2, 17, 3, 8, 5
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    o, _ = FORMS[form](q, k, v, scale=0.3)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=0.3).transpose(1, 2)  # [B, T, H, V]
    assert o.dtype == torch.float32
    assert _err(o, ref) < F32


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("variant,zero", [("fox", "g"), ("deltaformer", "beta"), ("path", "beta")])
def test_zero_gate_reduces_to_plain(variant, zero, form):
    seed = _seed()
    fn = FORMS[form]
    kw, _ = _make(variant, T=9, seed=seed, L=None)
    kw[zero] = torch.zeros_like(kw[zero])
    with torch.no_grad():
        o, s = fn(**kw, output_final_state=True)
        o_ref, s_ref = fn(**_plain_kwargs(kw), output_final_state=True)
    assert _err(o, o_ref) < EXACT_F64, f"{variant} seed={seed}"
    assert _err(s.k, s_ref.k) < EXACT_F64 and _err(s.v, s_ref.v) < EXACT_F64


def test_alibi_bias_is_linear_in_distance():
    """Constant g = log γ_h: the bias is (i − j) log γ_h, checked against an explicit ALiBi matrix."""
    seed = _seed()
    kw, _ = _make("alibi", T=10, seed=seed, L=None)
    q, k, v, g = (kw[n].detach() for n in ("q", "k", "v", "g"))
    lg = g[0, 0]  # [H]
    T = q.shape[1]
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).to(D)  # [T, T]: i − j
    logits = kw["scale"] * torch.einsum("bihk,bjhk->bhij", q, k) + dist * lg[:, None, None]  # [B, H, T, T]
    logits = logits.masked_fill(dist < 0, float("-inf"))
    ref = torch.einsum("bhij,bjhv->bihv", logits.softmax(-1), v)  # [B, T, H, V]
    for fn in FORMS.values():
        with torch.no_grad():
            assert _err(fn(**kw)[0], ref) < EXACT_F64, f"seed={seed}"


# ---------------------------------------------------------------------------- brute force definitions
def test_deltaformer_matches_its_definition():
    """u_i = v_i − β_i Σ_{j<i} softmax_{j<i}(scale k_i·k_j + c_i − c_j) u_j, then causal softmax over u."""
    seed = _seed()
    kw, _ = _make("deltaformer_fox", T=8, seed=seed, L=None, B=1, H=1)
    q, k, v, g, beta = (kw[n].detach()[0, :, 0] for n in ("q", "k", "v", "g", "beta"))
    s, T = kw["scale"], q.shape[0]
    c = g.cumsum(0)
    u = []
    for i in range(T):
        if i == 0:
            u.append(v[0])
            continue
        a = torch.softmax(torch.stack([s * k[i] @ k[j] + c[i] - c[j] for j in range(i)]), 0)
        u.append(v[i] - beta[i] * sum(a[j] * u[j] for j in range(i)))
    o = []
    for i in range(T):
        a = torch.softmax(torch.stack([s * q[i] @ k[j] + c[i] - c[j] for j in range(i + 1)]), 0)
        o.append(sum(a[j] * u[j] for j in range(i + 1)))
    ref = torch.stack(o)  # [T, V]
    for fn in FORMS.values():
        with torch.no_grad():
            out, st = fn(**kw, output_final_state=True)
        assert _err(out[0, :, 0], ref) < EXACT_F64, f"seed={seed}"
        assert _err(st.v[0, :, 0], torch.stack(u)) < EXACT_F64, f"seed={seed}"


def test_path_matches_explicit_householder_products():
    """s_ij = scale q_iᵀ H_i ⋯ H_{j+1} k_j + c_i − c_j with explicit K×K matrices, cache included."""
    seed = _seed()
    L = 2
    kw, cache = _make("path_fox", T=6, seed=seed, L=L, B=1, H=1)
    q, k, v, g, beta, w = (kw[n].detach()[0, :, 0] for n in ("q", "k", "v", "g", "beta", "w"))
    s, (T, K) = kw["scale"], q.shape
    keys = torch.cat([cache.k.detach()[0, :, 0], k])  # [L + T, K]
    vals = torch.cat([cache.v.detach()[0, :, 0], v])  # [L + T, V]
    c = torch.cat([cache.c.detach()[0, :, 0], cache.c.detach()[0, -1, 0] + g.cumsum(0)])  # [L + T]
    Hs = [torch.eye(K, dtype=D) - beta[t] * torch.outer(w[t], w[t]) for t in range(T)]  # H of token L + t
    o = []
    for t in range(T):
        i = L + t
        logits = []
        for j in range(i + 1):
            P = torch.eye(K, dtype=D)
            for tau in range(t, max(j - L, -1), -1):  # H_i ⋯ H_{j+1}, new tokens only
                P = P @ Hs[tau]
            logits.append(s * q[t] @ P @ keys[j] + c[i] - c[j])
        a = torch.softmax(torch.stack(logits), 0)
        o.append(a @ vals[: i + 1])
    ref = torch.stack(o)  # [T, V]
    for fn in FORMS.values():
        with torch.no_grad():
            assert _err(fn(**kw, initial_state=cache)[0][0, :, 0], ref) < EXACT_F64, f"seed={seed}"


# ---------------------------------------------------------------------------- PaTH reflections
@pytest.mark.parametrize("form", list(FORMS))
def test_path_reflection_hand_case(form):
    """β = 2, w = e_1 at both tokens, scale 1: H = diag(−1, 1) flips k_1's first coordinate.

    q_2 = (1, 0), k_1 = (1, 0), k_2 = 0, v = (1, 0): s_21 = q_2ᵀ H_2 k_1 = −1, s_22 = 0, so
    o_2 = e^{−1} / (e^{−1} + 1) = 1 / (1 + e) (plain softmax would give e / (e + 1)); the
    final cache holds k_1 = (−1, 0) (flipped once, by H_2)."""
    q = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=D).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=D).view(1, 2, 1, 2)
    v = torch.tensor([1.0, 0.0], dtype=D).view(1, 2, 1, 1)
    w = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=D).view(1, 2, 1, 2)
    beta = torch.full((1, 2, 1), 2.0, dtype=D)
    o, st = FORMS[form](q, k, v, scale=1.0, retention="householder", beta=beta, w=w, output_final_state=True)
    assert abs(o[0, 0, 0, 0].item() - 1.0) < EXACT_F64
    assert abs(o[0, 1, 0, 0].item() - 1.0 / (1.0 + math.e)) < EXACT_F64
    assert _err(st.k[0, :, 0], torch.tensor([[-1.0, 0.0], [0.0, 0.0]], dtype=D)) < EXACT_F64


@pytest.mark.parametrize("form", list(FORMS))
def test_path_reflection_flips_first_coordinate(form):
    """β = 2, w = e_1 everywhere: key j seen from query i has its first coordinate times (−1)^{i−j}."""
    seed = _seed()
    kw, _ = _make("path", T=7, seed=seed, L=None)
    q, k, v = (kw[n].detach() for n in ("q", "k", "v"))
    B, T, H, K = q.shape
    w = torch.zeros(B, T, H, K, dtype=D)
    w[..., 0] = 1.0
    beta = torch.full((B, T, H), 2.0, dtype=D)
    o, st = FORMS[form](q, k, v, scale=kw["scale"], retention="householder", beta=beta, w=w,
                        output_final_state=True)
    for i in range(T):
        sign = torch.tensor([(-1.0) ** (i - j) for j in range(i + 1)], dtype=D)  # [i + 1]
        kk = k[:, : i + 1].clone()  # [B, i + 1, H, K]
        kk[..., 0] = kk[..., 0] * sign[None, :, None]
        a = torch.softmax(kw["scale"] * torch.einsum("bhk,bjhk->bhj", q[:, i], kk), -1)  # [B, H, i + 1]
        ref = torch.einsum("bhj,bjhv->bhv", a, v[:, : i + 1])  # [B, H, V]
        assert _err(o[:, i], ref) < EXACT_F64, f"row {i} seed={seed}"
    final_sign = torch.tensor([(-1.0) ** (T - 1 - j) for j in range(T)], dtype=D)  # [T]
    expect = k.clone()
    expect[..., 0] = expect[..., 0] * final_sign[None, :, None]
    assert _err(st.k, expect) < EXACT_F64


# ---------------------------------------------------------------------------- errors and dtypes
@pytest.mark.parametrize("form", list(FORMS))
def test_missing_inputs_name_the_argument(form):
    kw, _ = _make("path", T=3, seed=0, L=None)
    fn = FORMS[form]
    with pytest.raises(ValueError, match="w"):
        fn(**{**kw, "w": None})
    with pytest.raises(ValueError, match="beta"):
        fn(**{**kw, "beta": None})
    with pytest.raises(ValueError, match="g"):
        fn(**_plain_kwargs(kw), retention="scalar")
    with pytest.raises(ValueError, match="objective"):
        fn(**_plain_kwargs(kw), objective="omega")


@pytest.mark.parametrize("form", list(FORMS))
def test_low_precision_inputs(form):
    """bf16 inputs: computed in fp32, output in v's dtype, close to the fp32 result."""
    kw, _ = _make("path_fox", T=6, seed=_seed(), L=None, dtype=torch.float32)
    kw = {n: (x.detach() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    low = {n: (x.bfloat16() if n in ("q", "k", "v") else x) for n, x in kw.items()}
    o, st = FORMS[form](**low, output_final_state=True)
    o32, _ = FORMS[form](**{n: (x.bfloat16().float() if n in ("q", "k", "v") else x) for n, x in kw.items()})
    assert o.dtype == torch.bfloat16 and st.k.dtype == torch.float32
    assert _err(o.float(), o32) < SOFTMAX_BF16
