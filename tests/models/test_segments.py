"""Documents through every layer of every zoo model (float64): a left-padded batch, a packed row
(cu_seqlens, and position_ids restarting at 0) and a right-padded batch give each document the
logits it has alone; decoding after a left-padded prefill continues each row as if it were alone.
A wrong boundary anywhere (a conv tap, a memory, an attention row, a RoPE position) breaks it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastweights as fw
from fastweights.inputs import InputError
from fastweights.models import LM, GenerationError
from tests.models.test_lm import VOCAB, tiny_config
from tests.tolerances import MAX_DOCUMENTS_F64, SEGMENTS_F64

ZOO = fw.zoo.names()


def documents(lengths):
    return [torch.randint(0, VOCAB, (L,)) for L in lengths]


def padded(docs, left=True):
    T = max(len(d) for d in docs)
    ids = torch.randint(0, VOCAB, (len(docs), T))  # padding holds random tokens: nothing may read them
    mask = torch.zeros(len(docs), T, dtype=torch.long)
    for i, d in enumerate(docs):
        sl = slice(T - len(d), T) if left else slice(0, len(d))
        ids[i, sl], mask[i, sl] = d, 1
    return ids, mask


def err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ZOO)
def test_padded_and_packed_batches_equal_each_document_alone(name):
    model = LM(tiny_config(name)).double()
    lengths = [5, 11, 2, 7]  # different offsets inside TTT/Titans' 16-token inner mini-batches too
    docs = documents(lengths)
    alone = [model(d[None])[0] for d in docs]
    T = max(lengths)

    ids, mask = padded(docs, left=True)
    out = model(ids, attention_mask=mask)
    for i, d in enumerate(docs):
        assert err(out[i, T - len(d):], alone[i]) < SEGMENTS_F64, f"left padding, row {i}"

    ids, mask = padded(docs, left=False)
    out = model(ids, attention_mask=mask.bool())
    for i, d in enumerate(docs):
        assert err(out[i, :len(d)], alone[i]) < SEGMENTS_F64, f"right padding, row {i}"

    packed = torch.cat(docs)[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    by_cu = model(packed, cu_seqlens=cu)[0]
    by_pos = model(packed, position_ids=torch.cat([torch.arange(L) for L in lengths])[None])[0]
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert err(by_cu[a:b], alone[i]) < SEGMENTS_F64, f"cu_seqlens, document {i}"
        assert err(by_pos[a:b], alone[i]) < SEGMENTS_F64, f"position_ids, document {i}"


@pytest.mark.parametrize("name", ZOO)
def test_decoding_after_a_left_padded_prefill_equals_each_row_alone(name):
    model = LM(tiny_config(name)).double()
    lengths = [3, 9, 6]
    docs = documents(lengths)
    ids, mask = padded(docs)
    logits, state = model.prefill(ids, attention_mask=mask)
    assert torch.equal(state.lengths, torch.tensor(lengths))
    new = torch.randint(0, VOCAB, (3, 4))
    steps = []
    for t in range(new.shape[1]):
        lt, state = model.step(new[:, t], state)
        steps.append(lt)
    assert torch.equal(state.lengths, torch.tensor(lengths) + 4)
    for i, d in enumerate(docs):
        ref = model(torch.cat([d, new[i]])[None])[0]
        assert err(logits[i, -1], ref[len(d) - 1]) < SEGMENTS_F64
        for t, lt in enumerate(steps):
            assert err(lt[i], ref[len(d) + t]) < SEGMENTS_F64, f"row {i}, step {t}"


def test_a_second_block_continues_each_row_of_a_padded_prefill():
    model = LM(tiny_config("ttt_linear", mixer=("ttt_linear", "alibi"), head_v_dim=8)).double()
    docs = documents([4, 2])
    more = torch.randint(0, VOCAB, (2, 5))
    ids, mask = padded(docs)
    _, state = model.prefill(ids, attention_mask=mask)
    logits, state = model.prefill(more, state, attention_mask=torch.ones(2, 5, dtype=torch.long))
    logits2, _ = model.prefill(more, model.prefill(ids, attention_mask=mask)[1])  # the mask is optional here
    for i in range(2):
        ref = model(torch.cat([docs[i], more[i]])[None])[0, -5:]
        assert err(logits[i], ref) < SEGMENTS_F64 and err(logits2[i], ref) < SEGMENTS_F64
    with pytest.raises(GenerationError, match="first block only"):
        model.prefill(more, state, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))


SOURCE_LEN = 7  # each drawn document is a prefix of one of the model's source sequences


@st.composite
def layouts(draw):
    """A random block of documents: B rows (1–2), each some documents (each a prefix of a distinct
    source sequence, 1–7 tokens) with padding before and after; described by any combination the
    forward takes — attention_mask (needed with padding; bool or 0/1), cu_seqlens (B = 1; padding
    in its own segments or inside the first / last document's), position_ids (needed for several
    documents in a row without cu_seqlens; padding's positions arbitrary)."""
    B = draw(st.sampled_from([1, 1, 2]), label="B")  # (weighted to the packed row, where descriptions combine)
    sources = iter(draw(st.permutations(range(4))))
    rows = [[(next(sources), draw(st.integers(1, SOURCE_LEN))) for _ in range(draw(st.integers(1, 4 // B)))]
            for _ in range(B)]
    left = [draw(st.sampled_from([0, 1, 2]), label="left padding") for _ in range(B)]
    T = max(a + sum(n for _, n in row) for a, row in zip(left, rows)) + draw(st.sampled_from([0, 1, 2]), label="right")
    packed = any(len(row) > 1 for row in rows)
    described = ["cu", "cu+pos", "pos"] if B == 1 else ["pos"]
    if not packed:
        described += ["none"]
    by = draw(st.sampled_from(described), label="documents by")
    padded = any(a > 0 or a + sum(n for _, n in row) < T for a, row in zip(left, rows))
    return dict(rows=rows, left=left, T=T, cu="cu" in by, pos="pos" in by,
                mask=draw(st.sampled_from([torch.long, torch.bool] + ([] if padded else [None])), label="mask"),
                pad_segments=draw(st.booleans(), label="padding in its own cu_seqlens segments"))


def build_block(layout, source):
    """(input_ids [B, T], forward kwargs, [(row, first column, source, length)]) of a layout."""
    rows, left, T = layout["rows"], layout["left"], layout["T"]
    ids = torch.randint(0, VOCAB, (len(rows), T))  # padding holds random tokens: nothing may read them
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    position_ids = torch.randint(0, 4, (len(rows), T))  # padding's positions: anything
    where = []
    for b, row in enumerate(rows):
        col = left[b]
        for s, n in row:
            ids[b, col:col + n], mask[b, col:col + n] = source[s, :n], 1
            position_ids[b, col:col + n] = torch.arange(n)
            where.append((b, col, s, n))
            col += n
    kw = {}
    if layout["mask"] is not None:
        kw["attention_mask"] = mask.to(layout["mask"])
    if layout["cu"]:  # B = 1: the documents' ends; padding its own segments or inside the first / last
        ends = list(torch.tensor([n for _, n in rows[0]]).cumsum(0) + left[0])
        bounds = [0] + ([left[0]] if layout["pad_segments"] and left[0] else []) + ends
        if bounds[-1] < T:
            bounds = bounds + [T] if layout["pad_segments"] else bounds[:-1] + [T]
        kw["cu_seqlens"] = torch.tensor(bounds)
    if layout["pos"]:
        kw["position_ids"] = position_ids
    return ids, kw, where


@pytest.mark.parametrize("name", ZOO)
def test_random_padding_packing_and_positions_give_each_document_its_logits_alone(name):
    """Property (hypothesis): any combination of left/right padding, packing (cu_seqlens, position_ids
    restarting at 0, both) and positions gives every document the logits it has alone (float64)."""
    model = LM(tiny_config(name)).double()
    source = torch.randint(0, VOCAB, (4, SOURCE_LEN))
    alone = model(source)  # [4, SOURCE_LEN, vocab]: a document that is a prefix has the prefix's logits

    @settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(layouts())
    def check(layout):
        ids, kw, where = build_block(layout, source)
        out = model(ids, **kw)
        for b, col, s, n in where:
            assert err(out[b, col:col + n], alone[s, :n]) < SEGMENTS_F64, \
                f"document of source {s} ({n} tokens) at row {b}, column {col}, with {sorted(kw)}"

    check()


def test_document_errors():
    model = LM(tiny_config("deltanet"))
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(InputError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(InputError, match="between"):
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6]))
    with pytest.raises(InputError, match="0 .padding. and 1"):
        model(ids, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(InputError, match="batch must be 1"):
        model(ids, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(InputError, match="position_ids"):
        model(ids, position_ids=torch.zeros(2, 6))
    with pytest.raises(GenerationError, match="left padding"):
        model.prefill(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]))


def test_a_hybrid_with_grouped_value_heads_honours_documents():
    cfg = tiny_config("gated_deltanet", mixer=("gated_deltanet", "titans", "fox"), n_layers=3, num_v_heads=4)
    model = LM(cfg).double()
    docs = documents([6, 3, 9])
    alone = [model(d[None])[0] for d in docs]
    ids, mask = padded(docs)
    out = model(ids, attention_mask=mask)
    packed = model(torch.cat(docs)[None], cu_seqlens=torch.tensor([0, 6, 9, 18]))[0]
    for i, (d, (a, b)) in enumerate(zip(docs, [(0, 6), (6, 9), (9, 18)])):
        assert err(out[i, ids.shape[1] - len(d):], alone[i]) < SEGMENTS_F64
        assert err(packed[a:b], alone[i]) < SEGMENTS_F64


# ----------------------------------------------------------------------------- max_documents: the capture-safe packing
def _logits_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, **kw)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ZOO)
def test_max_documents_gives_the_exact_packings_logits_and_gradients(name):
    """LM.forward(position_ids, max_documents=N) — the documents packed into N varlen sequences, the rest empty —
    gives the logits and parameter gradients of the exact packing: a block of one document, a block of length-1
    documents, a mixed block with cut first documents; N above the count (trailing empty sequences; N equal to it
    gives the same packing without them: tests/layers/test_segments.py)."""
    from tests.layers.test_segments import LAYOUTS, packed_positions

    model = LM(tiny_config(name)).double()
    for layout, (rows, starts) in LAYOUTS.items():
        pos = packed_positions(rows, starts)
        ids = torch.randint(0, VOCAB, tuple(pos.shape))
        want, want_g = _logits_and_grads(model, ids, position_ids=pos)
        got, got_g = _logits_and_grads(model, ids, position_ids=pos, max_documents=sum(len(r) for r in rows) + 3)
        assert err(got, want) < MAX_DOCUMENTS_F64, layout
        assert got_g.keys() == want_g.keys()
        for n in want_g:
            assert err(got_g[n], want_g[n]) < MAX_DOCUMENTS_F64, (layout, n)


def test_max_documents_errors():
    model = LM(tiny_config("gated_deltanet")).double()
    ids = torch.randint(0, VOCAB, (1, 6))
    pos = torch.tensor([[0, 1, 0, 1, 2, 0]])
    with pytest.raises(InputError, match="max_documents bounds the documents of position_ids"):
        model(ids, max_documents=3)
    with pytest.raises(InputError, match="max_documents bounds the documents of position_ids"):
        model(ids, position_ids=pos, attention_mask=torch.ones_like(pos), max_documents=3)
    with pytest.raises(InputError, match="max_documents must be a positive int"):
        model(ids, position_ids=pos, max_documents=0)


@pytest.mark.triton
def test_max_documents_runs_the_triton_kernels_without_a_host_read(monkeypatch):
    """The packed path a CUDA graph captures, structurally on the CPU: a gated DeltaNet LM on its Triton rows
    (`FakeCuda`, kernels under TRITON_INTERPRET=1) runs forward and backward over max_documents' packing — the
    layer ops, the staged delta kernels on cu_seqlens with trailing empty sequences — with every host read of a
    tensor refused (`no_host_reads`; the ids' range check is the capture's to skip, so the embeddings go in);
    its logits and gradients are the torch rows' over the exact packing."""
    from tests.fake_cuda import FakeCuda
    from tests.helpers import no_host_reads
    from tests.layers.test_segments import packed_positions
    from tests.tolerances import MAX_DOCUMENTS_TRITON_F32

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = LM(tiny_config("gated_deltanet", n_layers=1, num_heads=1, head_dim=16, chunk_size=16))
    pos = packed_positions([[1, 1, 1, 5], [3, 5]], [2, 0])  # 6 documents, 2 of them cut, 3 of length 1
    ids = torch.randint(0, VOCAB, tuple(pos.shape))
    want, want_g = _logits_and_grads(model, ids, position_ids=pos)
    fake = FakeCuda(monkeypatch, kernels=True).install()
    model.zero_grad(set_to_none=True)
    with no_host_reads(monkeypatch):
        out = model(inputs_embeds=model.embed(ids), position_ids=pos, max_documents=8)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert ("delta", "chunk", "triton") in fake.take()
    assert err(out.detach(), want) < MAX_DOCUMENTS_TRITON_F32
    for n, p in model.named_parameters():
        assert err(p.grad, want_g[n]) < MAX_DOCUMENTS_TRITON_F32 * (1 + want_g[n].abs().max().item()), n
