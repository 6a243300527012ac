"""Pretraining data: sources (text files and directories, .npy, .bin), the held-out split on a
document boundary, packed windows (positions restart after end-of-text, which predicts nothing),
a sample order that visits every window once per pass, and the data key a run resumes only on."""

import numpy as np
import pytest
import torch

from fastweights.pretrain.data import (
    BYTE_EOS,
    IGNORE_INDEX,
    DataError,
    Windows,
    data_key,
    data_key_diff,
    load_tokenizer,
    pack,
    read_stream,
    split_stream,
)


def test_sources_give_one_stream_with_an_end_of_text_after_each_document(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.md").write_text("é!", encoding="utf-8")
    (tmp_path / "d" / "a.txt").write_text("hi", encoding="utf-8")
    (tmp_path / "d" / "skip.png").write_bytes(b"\x89PNG")
    toks = np.random.randint(0, 257, size=9)
    np.save(tmp_path / "t.npy", toks)
    toks.astype("<u2").tofile(tmp_path / "t.bin")
    tok = load_tokenizer("bytes")
    s = read_stream([tmp_path / "d", tmp_path / "t.npy", tmp_path / "t.bin"], tok)
    expect = [104, 105, BYTE_EOS, *"é!".encode(), BYTE_EOS, *toks, *toks]
    assert s.tolist() == expect


def test_source_errors_name_the_file(tmp_path):
    tok = load_tokenizer("bytes")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match="bad.txt: not UTF-8"):
        read_stream([tmp_path / "bad.txt"], tok)
    with pytest.raises(DataError, match="no such file"):
        read_stream([tmp_path / "missing.txt"], tok)
    np.save(tmp_path / "big.npy", np.array([0, 300]))
    with pytest.raises(DataError, match="must lie in"):
        read_stream([tmp_path / "big.npy"], tok)
    with pytest.raises(DataError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def test_split_holds_out_whole_documents():
    s = np.array([1, 2, 9, 3, 4, 5, 9, 6, 7, 9])
    train, val = split_stream(s, 0.35, eos_id=9)
    assert train.tolist() == [1, 2, 9, 3, 4, 5, 9] and val.tolist() == [6, 7, 9]
    assert split_stream(s, 0.0, 9)[1].size == 0


def test_packing_restarts_positions_after_end_of_text():
    E = 50
    x = torch.tensor([[3, 4, E, 5, 6, 7, E, 8, 9]])
    b = pack(x, E)
    assert b["input_ids"].tolist() == [[3, 4, E, 5, 6, 7, E, 8]]
    assert b["labels"].tolist() == [[4, E, IGNORE_INDEX, 6, 7, E, IGNORE_INDEX, 9]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def test_every_window_once_per_pass_and_the_order_is_a_function_of_the_sample():
    stream = np.arange(1 + 7 * 4)
    w = Windows(stream, seq_len=4, eos_id=-1, seed=3)
    assert len(w) == 7 and w.window(2).tolist() == [8, 9, 10, 11, 12]
    for e in range(3):
        assert sorted(w.order(j) for j in range(7 * e, 7 * e + 7)) == list(range(7))
    again = Windows(stream, seq_len=4, eos_id=-1, seed=3)
    assert [again.order(j) for j in (15, 2, 9)] == [w.order(j) for j in (15, 2, 9)]


def test_one_token_file_stays_memory_mapped(tmp_path):
    toks = np.random.randint(0, 257, size=50)
    toks.astype("<u2").tofile(tmp_path / "t.bin")
    s = read_stream([tmp_path / "t.bin"], load_tokenizer("bytes"))
    assert isinstance(s, np.memmap) and s.tolist() == toks.tolist()
    w = Windows(s, seq_len=8, eos_id=BYTE_EOS)
    assert w.batch([1])["input_ids"].tolist() == [toks[8:16].tolist()]


def test_a_bin_token_file_of_odd_size_or_empty_is_refused_naming_it(tmp_path):
    tok = load_tokenizer("bytes")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(DataError, match=r"odd.bin: 5 bytes is not a whole number of tokens.*uint16"):
        read_stream([tmp_path / "odd.bin"], tok)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin: the .bin token file is empty"):
        read_stream([tmp_path / "empty.bin"], tok)
    (tmp_path / "bad.npy").write_bytes(b"not an array")
    with pytest.raises(DataError, match="bad.npy: not a readable .npy array"):
        read_stream([tmp_path / "bad.npy"], tok)


def test_the_data_key_names_every_change(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("alpha", encoding="utf-8")
    (d / "b.txt").write_text("beta", encoding="utf-8")
    tok = load_tokenizer("bytes")
    key = data_key([d], tok, 32)
    assert [f["path"] for f in key["files"]] == [str(d / "a.txt"), str(d / "b.txt")]
    assert key["files"][0]["bytes"] == 5 and key["seq_len"] == 32
    assert data_key_diff(key, data_key([d], tok, 32)) == []
    (d / "c.md").write_text("gamma", encoding="utf-8")
    assert data_key_diff(key, data_key([d], tok, 32)) == [f"1 file(s) added: {d / 'c.md'}"]
    (d / "c.md").unlink()
    (d / "a.txt").write_text("ALPHA", encoding="utf-8")  # same size, other content
    assert data_key_diff(key, data_key([d], tok, 32)) == [f"{d / 'a.txt'} changed (same size, other content)"]
    (d / "b.txt").unlink()
    assert data_key_diff(key, data_key([d], tok, 64)) == [
        f"1 file(s) removed: {d / 'b.txt'}", f"{d / 'a.txt'} changed (same size, other content)", "seq_len 32 -> 64"]
    (d / "a.txt").write_text("alpha!", encoding="utf-8")
    assert data_key_diff(key, data_key([d / "a.txt"], tok, 32))[1] == f"{d / 'a.txt'} changed (5 -> 6 bytes)"


def test_the_data_key_holds_the_tokenizer_identity(tmp_path):
    from fastweights.hf import ByteTokenizer  # (a Hugging Face tokenizer directory: the extra `hf`)

    ByteTokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    hf = load_tokenizer(str(tmp_path / "tok"))
    a = data_key([tmp_path / "a.txt"], load_tokenizer("bytes"), 8)
    b = data_key([tmp_path / "a.txt"], hf, 8)
    assert b["tokenizer"] == hf.identity() and len(b["tokenizer"]["sha256"]) == 64
    assert data_key_diff(a, b) == [f"tokenizer name 'bytes' -> {str(tmp_path / 'tok')!r}"]
    assert data_key_diff(b, data_key([tmp_path / "a.txt"], hf, 8)) == []


def test_windows_max_documents_is_the_most_any_window_packs():
    """Windows.documents / max_documents: the documents (the most) `pack` makes of each window's inputs (a document
    starts after every end-of-text input but the last: the token it starts is the window's label only)."""
    from fastweights.layers.segments import count_documents

    stream = np.random.randint(1, 9, 301)
    stream[np.random.rand(301) < 0.2] = 0  # end-of-text id 0
    w = Windows(stream, 16, 0)
    each = [int(count_documents(w.batch([i])["position_ids"])) for i in range(len(w))]
    assert w.documents().tolist() == each and w.max_documents() == max(each)
    last = np.ones(33, dtype=np.int64)
    last[15] = 0  # window 0's last input: no document starts in the window
    assert Windows(last, 16, 0).max_documents() == 1
    last[14] = 0
    assert Windows(last, 16, 0).max_documents() == 2
