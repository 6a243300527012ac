"""Segments.build: the documents and positions of a block from attention_mask, cu_seqlens,
position_ids and a carried state's offsets, alone or combined; a short convolution reading the
positions it gives never crosses a document start nor reads padding."""

import pytest
import torch

from fastweights.inputs import InputError
from fastweights.layers import ShortConv
from fastweights.layers.segments import Segments
from tests.tolerances import SHORT_CONV_F64


def conv_by_documents(conv, x, seg):
    """(y [B, T, C] of the conv over x with the segments' conv positions, [(row, cols, y alone)])."""
    y, _ = conv(x, None, seg.conv_positions)
    alone = []
    for b in range(x.shape[0]):
        for d in seg.doc[b].unique().tolist():
            if d < 0:
                continue
            cols = (seg.doc[b] == d).nonzero()[:, 0]
            alone.append((b, cols, conv(x[b:b + 1, cols])[0][0]))
    return y, alone


def test_padding_beside_cu_seqlens_is_no_position():
    """Padding inside the documents cu_seqlens marks (left padding in the first, right padding in the
    last): positions count the tokens only, and the conv reads no padding."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0]])
    seg = Segments.build(1, 8, attention_mask=mask, cu_seqlens=torch.tensor([0, 4, 8]))
    assert seg.doc.tolist() == [[-1, -1, 0, 0, 1, 1, 1, -1]]
    assert seg.pos.tolist() == [[0, 0, 0, 1, 0, 1, 2, 0]]
    conv = ShortConv(3, 4).double()
    x = torch.randn(1, 8, 3, dtype=torch.float64)  # padding holds values: nothing may read them
    y, alone = conv_by_documents(conv, x, seg)
    for b, cols, ref in alone:
        assert (y[b, cols] - ref).abs().max().item() < SHORT_CONV_F64


def test_empty_and_padding_only_segments_of_cu_seqlens():
    seg = Segments.build(1, 6, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]),
                         cu_seqlens=torch.tensor([0, 1, 1, 3, 3, 6]))
    assert seg.doc.tolist() == [[-1, 0, 0, 1, 1, 1]]
    assert seg.pos.tolist() == [[0, 0, 1, 0, 1, 2]]


def test_position_ids_beside_cu_seqlens_give_the_positions_or_are_refused():
    cu = torch.tensor([0, 3, 5])
    seg = Segments.build(1, 5, cu_seqlens=cu, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    assert seg.doc.tolist() == [[0, 0, 0, 1, 1]] and seg.pos.tolist() == [[0, 1, 2, 0, 1]]
    seg = Segments.build(1, 5, cu_seqlens=cu, position_ids=torch.tensor([[0, 2, 4, 0, 3]]))  # e.g. strided
    assert seg.pos.tolist() == [[0, 2, 4, 0, 3]] and seg.conv_positions.tolist() == [[0, 1, 2, 0, 1]]
    for bad in ([[0, 1, 2, 3, 4]], [[0, 1, 0, 0, 1]], [[1, 2, 3, 0, 1]]):
        with pytest.raises(InputError, match="^position_ids and cu_seqlens disagree"):
            Segments.build(1, 5, cu_seqlens=cu, position_ids=torch.tensor(bad))
    seg = Segments.build(1, 5, cu_seqlens=cu, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]),
                         position_ids=torch.tensor([[7, 0, 1, 0, 1]]))  # padding's position is never read
    assert seg.pos.tolist() == [[0, 0, 1, 0, 1]]


def test_the_conv_reads_its_own_document_whatever_position_ids_say():
    """A row that starts inside a document (positions 3, 4, …) and positions that jump: documents
    start at each 0, the conv reaches back over its own document's tokens only."""
    position_ids = torch.tensor([[3, 4, 0, 1, 0, 5, 6], [0, 1, 2, 0, 9, 9, 9]])
    mask = torch.tensor([[1] * 7, [0, 1, 1, 1, 1, 1, 0]])  # row 1: a padding 0 is no document start
    seg = Segments.build(2, 7, position_ids=position_ids, attention_mask=mask)
    assert seg.doc.tolist() == [[0, 0, 1, 1, 2, 2, 2], [-1, 0, 0, 1, 1, 1, -1]]
    assert seg.pos.tolist() == [[3, 4, 0, 1, 0, 5, 6], [0, 1, 2, 0, 9, 9, 0]]
    conv = ShortConv(2, 4).double()
    x = torch.randn(2, 7, 2, dtype=torch.float64)
    y, alone = conv_by_documents(conv, x, seg)
    assert len(alone) == 5
    for b, cols, ref in alone:
        assert (y[b, cols] - ref).abs().max().item() < SHORT_CONV_F64


def test_offsets_continue_each_row():
    seg = Segments.build(2, 4, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
                         offsets=torch.tensor([2, 0]))
    assert seg.continues and seg.doc.tolist() == [[-1, 0, 0, 0], [0, 0, 0, 0]]
    assert seg.pos.tolist() == [[0, 2, 3, 4], [0, 1, 2, 3]] and seg.conv_positions.tolist() == seg.pos.tolist()


def test_errors():
    with pytest.raises(InputError, match="^position_ids must be an integer tensor"):
        Segments.build(1, 3, position_ids=torch.zeros(1, 3))
    with pytest.raises(InputError, match="^position_ids must be ≥ 0"):
        Segments.build(1, 3, position_ids=torch.tensor([[0, -1, 2]]))
    with pytest.raises(InputError, match="between"):
        Segments.build(1, 4, attention_mask=torch.tensor([[1, 0, 0, 1]]), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(InputError, match="cannot continue"):
        Segments.build(1, 3, cu_seqlens=torch.tensor([0, 3]), offsets=torch.tensor([1]))


def test_packed_documents_are_laid_out_once_per_forward_not_per_layer(monkeypatch):
    """An LM forward over packed documents (position_ids) finds the documents' boundaries once (`Segments.packing`,
    a host read), not once in each of its layers; without padding nothing is gathered or scattered."""
    from fastweights.models import LM, LMConfig

    lm = LM(LMConfig(vocab_size=32, d_model=16, n_layers=3, num_heads=2, head_dim=8, mixer="gated_deltanet"))
    calls = []
    real = torch.unique_consecutive
    monkeypatch.setattr(torch, "unique_consecutive", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = torch.randint(0, 32, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    lm(ids, position_ids=pos)
    assert len(calls) == 1
    packing = Segments.build(2, 12, position_ids=pos).packing
    assert packing.idx is None and packing.cu.tolist() == [0, 4, 7, 12, 14, 21, 24]
    mask = torch.ones(2, 12, dtype=torch.long).index_fill_(1, torch.tensor([11]), 0)  # the rows' last token: padding
    padded = Segments.build(2, 12, position_ids=pos, attention_mask=mask)
    assert padded.packing.idx.tolist() == [i for i in range(24) if i not in (11, 23)]


# ----------------------------------------------------------------------------- max_documents: the capture-safe packing
def packed_positions(rows: list[list[int]], starts: list[int]) -> torch.Tensor:
    """position_ids [B, T] of rows given as their documents' lengths (each row's sum = T); starts[b]: the position
    row b's first document starts at (> 0: a window that cut a document, as `pretrain.data.pack` writes it)."""
    out = []
    for lengths, s in zip(rows, starts):
        out.append(torch.cat([torch.arange(L) + (s if i == 0 else 0) for i, L in enumerate(lengths)]))
    return torch.stack(out)


LAYOUTS = {  # B rows of T tokens each: (documents' lengths per row, the first document's start per row)
    "one document": ([[9]], [4]),
    "length-1 documents": ([[1] * 6, [1] * 6], [0, 3]),
    "mixed": ([[3, 1, 1, 4], [2, 5, 2], [9]], [2, 0, 0]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_max_documents_gives_the_exact_segments_and_packing_then_empty_sequences(layout):
    """Segments.build(max_documents=) over position_ids: the exact build's documents, positions and conv reach;
    its packing the exact one's boundaries followed by empty sequences up to the bound (B·T repeated), no
    gather (no padding). The bound may be the exact count."""
    rows, starts = LAYOUTS[layout]
    pos = packed_positions(rows, starts)
    B, T = pos.shape
    exact = Segments.build(B, T, position_ids=pos)
    S = sum(len(r) for r in rows)
    for extra in (0, 3):
        seg = Segments.build(B, T, position_ids=pos, max_documents=S + extra)
        assert torch.equal(seg.doc, exact.doc) and torch.equal(seg.pos, exact.pos)
        assert torch.equal(seg.conv_positions, exact.conv_positions)
        assert not seg.single and not seg.padded and not seg.continues
        pk = seg.packing
        assert pk.idx is None and pk.capacity == S + extra and pk.cu.dtype == exact.packing.cu.dtype
        assert pk.cu.tolist() == exact.packing.cu.tolist() + [B * T] * extra


def test_max_documents_reads_no_value_on_the_host(monkeypatch):
    """The build and its packing read nothing on the host (the exact build does: the guard catches it)."""
    from tests.helpers import HostRead, no_host_reads

    pos = packed_positions(*LAYOUTS["mixed"])
    with no_host_reads(monkeypatch):
        seg = Segments.build(*pos.shape, position_ids=pos, max_documents=12)
        cu = seg.packing.cu
        with pytest.raises(HostRead):
            _ = Segments.build(*pos.shape, position_ids=pos).packing
    assert cu.shape == (13,)


def test_check_documents_and_the_bound_refuse_by_name():
    from fastweights.layers.segments import check_documents, count_documents

    pos = packed_positions(*LAYOUTS["mixed"])  # 4 + 3 + 1 documents
    assert count_documents(pos).item() == 8
    assert count_documents(torch.stack([pos, torch.zeros_like(pos)])).tolist() == [8, 27]
    check_documents(pos, 8)
    with pytest.raises(InputError, match=r"position_ids: a block holds 8 documents, more than max_documents=7"):
        check_documents(pos, 7)
    with pytest.raises(InputError, match="position_ids must be ≥ 0"):
        check_documents(pos - 1, 8)
    with pytest.raises(InputError, match="max_documents must be a positive int"):
        check_documents(pos, 0)
    with pytest.raises(InputError, match="integer tensor"):
        check_documents(pos.float(), 8)
    with pytest.raises(RuntimeError, match="more documents than max_documents=7"):  # (unchecked: a device assert)
        _ = Segments.build(*pos.shape, position_ids=pos, max_documents=7).packing
    for kw in ({}, {"attention_mask": torch.ones_like(pos)}, {"offsets": torch.zeros(3, dtype=torch.long)}):
        with pytest.raises(InputError, match="max_documents bounds the documents of position_ids"):
            Segments.build(*pos.shape, max_documents=8, **({"position_ids": pos} if kw else {}), **kw)
