"""The layers' kv attention core (`fastweights.layers.kv.kv_extend`: SDPA, FoX/ALiBi bias,
DeltaFormer's solve, PaTH's WY form) against the library's reference forms
(`fastweights.recurrent` / `parallel`), float64, with and without a cache, grouped KV heads."""

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.layers.kv import empty_cache, kv_extend
from fastweights.state import KVCache
from tests.tolerances import EXACT_F64, KV_GRAD_F64

KV_MODELS = [n for n in fw.zoo.names() if fw.zoo.get(n).is_softmax]


def _case(name, B, T, H, Hkv, K, V, dtype=torch.float64):
    r = fw.zoo.get(name)
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, Hkv, K, dtype=dtype)
    v = torch.randn(B, T, Hkv, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, dtype=dtype) + 2.0) if r.retention.kind == "scalar" else None
    beta = torch.rand(B, T, Hkv, dtype=dtype) * (2.0 if r.retention.kind == "householder" else 1.0)
    w = F.normalize(torch.randn(B, T, Hkv, K, dtype=dtype), dim=-1)
    return r, q, k, v, g, beta, w


def _reference(r, q, k, v, g, beta, w, scale, cache=None, form="recurrent"):
    """fastweights.<form> with the kv heads repeated to the query heads (the reference has no GQA)."""
    G = q.shape[2] // k.shape[2]
    rep = lambda x: x.repeat_interleave(G, dim=2) if x is not None else None
    inputs = {}
    if "beta" in fw.inputs.accepted_inputs(r):
        inputs["beta"] = rep(beta)
    if r.retention.kind == "householder":
        inputs["w"] = rep(w)
    if r.retention.kind == "scalar":
        inputs["g"] = g
    if cache is not None:
        cache = KVCache(k=rep(cache.k), v=rep(cache.v), c=cache.c)
    return getattr(fw, form)(r, q, rep(k), rep(v), scale=scale, initial_state=cache, output_final_state=True,
                             **inputs)


@pytest.mark.parametrize("Hkv", [3, 1])
@pytest.mark.parametrize("name", KV_MODELS)
def test_extend_equals_reference(name, Hkv):
    B, T, H, K, V = 2, 9, 3, 4, 5
    r, q, k, v, g, beta, w = _case(name, B, T, H, Hkv, K, V)
    scale = K ** -0.5
    o, cache = kv_extend(r, q, k, v, scale=scale, cache=empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype), g=g,
                         beta=beta, w=w)
    for form in ("recurrent", "parallel"):
        o_ref, c_ref = _reference(r, q, k, v, g, beta, w, scale, form=form)
        assert (o - o_ref).abs().max().item() < EXACT_F64, form
        G = H // Hkv
        assert (cache.k.repeat_interleave(G, 2) - c_ref.k).abs().max().item() < EXACT_F64
        assert (cache.v.repeat_interleave(G, 2) - c_ref.v).abs().max().item() < EXACT_F64
        if r.retention.kind in ("scalar", "constant"):
            assert (cache.c - c_ref.c).abs().max().item() < EXACT_F64


@pytest.mark.parametrize("name", KV_MODELS)
def test_extend_in_pieces_equals_one_call(name):
    """Prefill in blocks, then token by token from the carried cache == one call (and the reference
    continuing from a cache made by the layer)."""
    B, T, H, Hkv, K, V = 2, 10, 2, 2, 4, 3
    r, q, k, v, g, beta, w = _case(name, B, T, H, Hkv, K, V)
    kw = dict(g=g, beta=beta, w=w)
    o, full = kv_extend(r, q, k, v, scale=0.7, cache=empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype), **kw)
    cache = empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype)
    outs = []
    for a, b in [(0, 4), (4, 7), (7, 8), (8, 9), (9, 10)]:
        sl = {key: (x[:, a:b] if x is not None else None) for key, x in kw.items()}
        oo, cache = kv_extend(r, q[:, a:b], k[:, a:b], v[:, a:b], scale=0.7, cache=cache, **sl)
        outs.append(oo)
    assert (torch.cat(outs, 1) - o).abs().max().item() < EXACT_F64
    for x, y in zip((cache.k, cache.v, cache.c), (full.k, full.v, full.c)):
        assert (x is None) == (y is None)
        if x is not None:
            assert (x - y).abs().max().item() < EXACT_F64
    # the reference continues from the layer's cache of the first 6 tokens
    _, c6 = kv_extend(r, q[:, :6], k[:, :6], v[:, :6], scale=0.7,
                      cache=empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype),
                      **{key: (x[:, :6] if x is not None else None) for key, x in kw.items()})
    rest = [x[:, 6:] if x is not None else None for x in (q, k, v, g, beta, w)]
    o_ref, _ = _reference(r, *rest, 0.7, cache=c6)
    assert (o_ref - o[:, 6:]).abs().max().item() < EXACT_F64


@pytest.mark.parametrize("name", ["deltaformer", "path_attention", "fox"])
def test_gradients_equal_reference(name):
    B, T, H, K, V = 1, 7, 2, 3, 3
    r, q, k, v, g, beta, w = _case(name, B, T, H, H, K, V)
    leaves = [x for x in (q, k, v, g, beta, w) if x is not None]
    for x in leaves:
        x.requires_grad_(True)
    o, _ = kv_extend(r, q, k, v, scale=0.5, cache=empty_cache(r, B, H, H, K, V, dtype=q.dtype), g=g, beta=beta, w=w)
    o_ref, _ = _reference(r, q, k, v, g, beta, w, 0.5)
    proj = torch.randn_like(o)
    g1 = torch.autograd.grad((o * proj).sum(), leaves, allow_unused=True)
    g2 = torch.autograd.grad((o_ref * proj).sum(), leaves, allow_unused=True)
    for a, b in zip(g1, g2):
        if a is None or b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert (a - b).abs().max().item() < KV_GRAD_F64


def test_first_token_of_deltaformer_keeps_its_value():
    r = fw.zoo.get("deltaformer")
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 2)
    _, cache = kv_extend(r, q, k, v, scale=0.5, cache=empty_cache(r, 1, 1, 1, 4, 2), beta=torch.ones(1, 1, 1))
    assert torch.equal(cache.v, v)  # u_1 = v_1: no earlier key


def test_deltaformer_rejects_retention_with_grouped_kv():
    r = fw.Recipe(name="gated_deltaformer", memory=fw.Memory(kind="kv"), feature_map=fw.FeatureMap(kind="exp"),
                  objective=fw.Objective(kind="l2"), retention=fw.Retention(kind="scalar"))
    B, T = 1, 3
    with pytest.raises(ValueError, match="grouped kv"):
        kv_extend(r, torch.randn(B, T, 2, 4), torch.randn(B, T, 1, 4), torch.randn(B, T, 1, 4), scale=0.5,
                  cache=empty_cache(r, B, 2, 1, 4, 4), g=torch.zeros(B, T, 2), beta=torch.ones(B, T, 1))


@pytest.mark.parametrize("name", ["softmax_attention", "fox", "deltaformer"])
def test_in_place_appends_without_grad_are_safe_to_branch(name):
    """Without autograd the cache grows in a buffer (amortized appends); decoding one state twice
    (two branches) must not let one branch overwrite the other's entries."""
    B, T, H, K, V = 2, 6, 2, 4, 3
    r, q, k, v, g, beta, w = _case(name, B, T + 2, H, H, K, V)
    sl = lambda x, a, b: None if x is None else x[:, a:b]
    with torch.no_grad():
        _, base = kv_extend(r, q[:, :T], k[:, :T], v[:, :T], scale=0.5,
                            cache=empty_cache(r, B, H, H, K, V, dtype=q.dtype), g=sl(g, 0, T), beta=sl(beta, 0, T))
        o1, c1 = kv_extend(r, q[:, T:T + 1], k[:, T:T + 1], v[:, T:T + 1], scale=0.5, cache=base,
                           g=sl(g, T, T + 1), beta=sl(beta, T, T + 1))
        # branch 2 from the same prefix, with the other token's inputs
        o2, c2 = kv_extend(r, q[:, T + 1:], k[:, T + 1:], v[:, T + 1:], scale=0.5, cache=base,
                           g=sl(g, T + 1, T + 2), beta=sl(beta, T + 1, T + 2))
        o1b, _ = kv_extend(r, q[:, T + 1:], k[:, T + 1:], v[:, T + 1:], scale=0.5, cache=c1,
                           g=sl(g, T + 1, T + 2), beta=sl(beta, T + 1, T + 2))
    assert c1._buffer is base._buffer and c2._buffer is not base._buffer  # branch 2 copied
    assert torch.equal(c1.k[:, T], k[:, T]) and torch.equal(c2.k[:, T], k[:, T + 1])
    full = torch.cat([q[:, :T], q[:, T:T + 1]], 1)
    o_ref, _ = _reference(r, full, k[:, :T + 1], v[:, :T + 1], sl(g, 0, T + 1), sl(beta, 0, T + 1), None, 0.5)
    assert (o_ref[:, T:] - o1).abs().max().item() < EXACT_F64
    idx = list(range(T)) + [T + 1]
    o_ref2, _ = _reference(r, q[:, idx], k[:, idx], v[:, idx], g[:, idx] if g is not None else None,
                           beta[:, idx], None, 0.5)
    assert (o_ref2[:, T:] - o2).abs().max().item() < EXACT_F64
    o_ref3, _ = _reference(r, q, k, v, g, beta, None, 0.5)
    assert (o_ref3[:, T + 1:] - o1b).abs().max().item() < EXACT_F64


@pytest.mark.parametrize("name", [n for n in KV_MODELS if fw.zoo.get(n).retention.kind == "householder"])
def test_path_blocks_longer_than_path_block_run_as_sub_blocks_exactly(name, monkeypatch):
    """A PaTH block longer than PATH_BLOCK (set to 4 here; 256 by default) runs as sub-blocks through the cache:
    the same outputs and cache as the reference, from an empty cache and continuing one, and with packed
    documents (doc) the same as one unsplit block."""
    from fastweights.layers import kv

    B, T, H, Hkv, K, V = 2, 13, 2, 1, 4, 3
    r, q, k, v, g, beta, w = _case(name, B, T, H, Hkv, K, V)
    monkeypatch.setattr(kv, "PATH_BLOCK", 4)
    o, cache = kv_extend(r, q, k, v, scale=0.6, cache=empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype), g=g,
                         beta=beta, w=w)
    o_ref, c_ref = _reference(r, q, k, v, g, beta, w, 0.6)
    assert (o - o_ref).abs().max().item() < EXACT_F64
    assert (cache.k.repeat_interleave(H // Hkv, 2) - c_ref.k).abs().max().item() < EXACT_F64
    # continuing a cache of 3 tokens with 10 more (3 sub-blocks), packed documents
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1]])
    kw = dict(scale=0.6, g=g, beta=beta, w=w)
    first = {key: (x[:, :3] if x is not None and key != "scale" else x) for key, x in kw.items()}
    rest = {key: (x[:, 3:] if x is not None and key != "scale" else x) for key, x in kw.items()}
    _, c3 = kv_extend(r, q[:, :3], k[:, :3], v[:, :3], cache=empty_cache(r, B, H, Hkv, K, V, dtype=q.dtype),
                      doc=doc[:, :3], **first)
    o_b, c_b = kv_extend(r, q[:, 3:], k[:, 3:], v[:, 3:], cache=c3, doc=doc, **rest)
    monkeypatch.setattr(kv, "PATH_BLOCK", 1000)
    o_1, c_1 = kv_extend(r, q[:, 3:], k[:, 3:], v[:, 3:], cache=c3, doc=doc, **rest)
    assert (o_b - o_1).abs().max().item() < EXACT_F64 and (c_b.k - c_1.k).abs().max().item() < EXACT_F64
    assert torch.isfinite(o_b).all()


def test_training_on_an_empty_cache_keeps_the_new_entries_uncopied():
    """Autograd recording and an empty cache (a training forward): the returned cache holds the new k, v themselves —
    no cast to the empty cache's dtype and back, no concatenation (under autocast k, v are bf16 and the empty cache
    fp32: that round trip was 4 casts and 2 cats a layer) — and the output is bitwise the one a copying cache gives."""
    r, q, k, v, g, beta, w = _case("softmax_attention", 2, 9, 2, 2, 8, 8, dtype=torch.bfloat16)
    k.requires_grad_(True)
    cache = empty_cache(r, 2, 2, 2, 8, 8, dtype=torch.float32)
    o, new = kv_extend(r, q, k, v, scale=0.3, cache=cache)
    assert new.k is k and new.v is v
    with torch.no_grad():  # the in-place path: a buffer in the cache's dtype
        o2, new2 = kv_extend(r, q, k, v, scale=0.3, cache=cache)
    assert new2.k.dtype == torch.float32 and torch.equal(o.detach(), o2)
