"""ByteTokenizer: UTF-8 bytes round-trip, <|endoftext|> is one token, it saves and loads through
AutoTokenizer from a local directory, and left-pads batches."""

import random

from transformers import AutoTokenizer

import fastweights.hf as fh


def random_text(n):
    chars = "abc xyz\n" + "éü—日本" + "🙂"
    return "".join(random.choice(chars) for _ in range(n))


def test_bytes_round_trip_and_the_end_of_text_token():
    tok = fh.ByteTokenizer()
    text = random_text(40)
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    ids = tok(text + "<|endoftext|>" + text)["input_ids"]
    assert ids.count(256) == 1 and tok.eos_token_id == tok.pad_token_id == 256 and len(tok) == 257
    assert tok.decode(ids, skip_special_tokens=True) == text + text


def test_saves_and_loads_through_auto_tokenizer_and_left_pads(tmp_path):
    fh.ByteTokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tok, fh.ByteTokenizer)
    batch = tok(["a", "abc"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[256, 256, 97], [97, 98, 99]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]


def test_a_runs_byte_tokenizer_files_are_what_transformers_writes(tmp_path):
    """`fastweights train` writes the byte tokenizer's files without transformers (pretrain.data.save_byte_tokenizer):
    byte for byte what ByteTokenizer().save_pretrained writes with the installed transformers (CI: its newest and
    its floor), and they load through AutoTokenizer as a ByteTokenizer."""
    from fastweights.pretrain.data import save_byte_tokenizer

    (tmp_path / "hf").mkdir()
    (tmp_path / "run").mkdir()
    fh.ByteTokenizer().save_pretrained(tmp_path / "hf")
    save_byte_tokenizer(tmp_path / "run")
    want = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == want
    tok = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert isinstance(tok, fh.ByteTokenizer) and tok("é<|endoftext|>")["input_ids"] == [195, 169, 256]
