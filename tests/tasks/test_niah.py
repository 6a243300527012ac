"""S-NIAH generator (benchmarks.md §3): tokenizer, needle/answer, exact lengths, batches."""

from __future__ import annotations

import re

import pytest
import torch

from fastweights.tasks.niah import (
    NIAH_DEPTHS,
    NIAH_TASKS,
    NOISE_PARAGRAPH,
    ByteTokenizer,
    filler_text,
    make_niah,
    niah_training_batch,
    string_match_all,
)

TOK = ByteTokenizer()
TASKS = sorted(NIAH_TASKS)


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    text = "Plain ASCII, ünïcödé and emoji 🙂\n"
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    framed = TOK.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == TOK.bos_id and framed[-1] == TOK.eos_id
    assert TOK.decode(framed) == text
    assert TOK.decode(framed, skip_special=False) == f"<bos>{text}<eos>"
    assert TOK.decode(torch.tensor([TOK.pad_id, 104, 105, TOK.sep_id])) == "hi"
    assert TOK.vocab_size == 260
    assert len({TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.sep_id}) == 4
    with pytest.raises(ValueError, match="ids"):
        TOK.decode([260])


def _check_example(ex: dict, task: str, context_len: int) -> None:
    prompt = TOK.decode(ex["input_ids"])
    answer_text = TOK.decode(ex["answer_ids"])
    assert ex["task"] == task
    assert ex["input_ids"].dtype == ex["answer_ids"].dtype == torch.long
    # exact length: prompt + answer fill the context
    assert ex["input_ids"].numel() + ex["answer_ids"].numel() == context_len
    assert ex["input_ids"][0].item() == TOK.bos_id
    # the needle is in the haystack, once, and carries the answer for the asked key
    assert prompt.count(ex["needle"]) == 1
    assert ex["needle"] == f"One of the special magic {NIAH_TASKS[task].kind}s for {ex['key']} is: {ex['answer']}."
    assert TOK.decode(ex["input_ids"][ex["needle_position"] :]).startswith(ex["needle"])
    assert answer_text == " " + ex["answer"] and answer_text.strip() == ex["answer"]
    assert prompt.count(ex["answer"]) == 1  # only in the needle: the answer is recoverable from context
    kind = NIAH_TASKS[task].kind
    assert prompt.startswith(f"A special magic {kind} is hidden within the following text.")
    assert prompt.endswith(
        f"\nWhat is the special magic {kind} for {ex['key']} mentioned in the provided text? "
        f"The special magic {kind} for {ex['key']} mentioned in the provided text is"
    )
    assert re.fullmatch(r"[a-z]+-[a-z]+", ex["key"])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("context_len", [512, 1024, 2048])
def test_examples_match_spec(task: str, context_len: int) -> None:
    for ex in make_niah(task, context_len, num_examples=4, seed=1):
        _check_example(ex, task, context_len)


def test_passkey_noise_haystack() -> None:
    for ex in make_niah("passkey", 1024, num_examples=5, seed=0):
        assert re.fullmatch(r"[1-9]\d{6}", ex["answer"])
        prompt = TOK.decode(ex["input_ids"])
        body = prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat is the special", 1)[0]
        lines = body.split("\n")
        assert ex["needle"] in lines
        rest = [line for line in lines if line != ex["needle"]]
        # repeated noise paragraphs, the last possibly cut off to fill the window exactly
        assert all(line == NOISE_PARAGRAPH for line in rest[:-1])
        assert NOISE_PARAGRAPH.startswith(rest[-1])
        assert len(rest) >= 5


def test_number_in_essay_haystack() -> None:
    for ex in make_niah("s-niah-2", 1024, num_examples=5, seed=4):
        assert ex["task"] == "niah_single_2"
        assert re.fullmatch(r"[1-9]\d{6}", ex["answer"])
        assert ex["depth"] in NIAH_DEPTHS
        prompt = TOK.decode(ex["input_ids"])
        assert len(re.findall(r"\d", prompt)) == 7  # no digits in the filler text
        assert NOISE_PARAGRAPH not in prompt


def test_uuid_in_essay_haystack() -> None:
    for ex in make_niah("uuid", 1024, num_examples=5, seed=2):
        assert ex["task"] == "niah_single_3"
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", ex["answer"])


def test_needle_depth_follows_rule() -> None:
    exs = make_niah("niah_single_2", 2048, num_examples=40, seed=3)
    depths = {ex["depth"] for ex in exs}
    assert len(depths) > 10
    prompts = [TOK.decode(ex["input_ids"]) for ex in exs]
    rel = [ex["needle_position"] / ex["input_ids"].numel() for ex in exs]
    # deeper needles sit further into the prompt
    shallow = [r for r, ex in zip(rel, exs) if ex["depth"] <= 20]
    deep = [r for r, ex in zip(rel, exs) if ex["depth"] >= 80]
    assert shallow and deep and max(shallow) < min(deep)
    assert all(p.count(ex["needle"]) == 1 for p, ex in zip(prompts, exs))


def test_deterministic_per_seed() -> None:
    a = make_niah("niah_single_3", 700, num_examples=3, seed=9)
    b = make_niah("niah_single_3", 700, num_examples=3, seed=9)
    c = make_niah("niah_single_3", 700, num_examples=3, seed=10)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and x["answer"] == y["answer"]
    assert [x["answer"] for x in a] != [x["answer"] for x in c]
    assert not all(torch.equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))


def test_aliases_resolve() -> None:
    for alias, name in [("passkey", "niah_single_1"), ("S-NIAH-2", "niah_single_2"), ("s_niah_3", "niah_single_3")]:
        assert make_niah(alias, 512, num_examples=1, seed=0)[0]["task"] == name


class PairTokenizer:
    """A non-byte tokenizer: two characters per id (tests that lengths stay exact)."""

    bos_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(text[i]) * 65536 + (ord(text[i + 1]) if i + 1 < len(text) else 0) for i in range(0, len(text), 2)]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            out.append(chr(int(i) // 65536))
            if int(i) % 65536:
                out.append(chr(int(i) % 65536))
        return "".join(out)


@pytest.mark.parametrize("task", TASKS)
def test_custom_tokenizer_exact_length(task: str) -> None:
    tok = PairTokenizer()
    for ex in make_niah(task, 500, num_examples=3, seed=0, tokenizer=tok):
        assert ex["input_ids"].numel() + ex["answer_ids"].numel() == 500
        assert ex["needle"] in tok.decode(ex["input_ids"].tolist())
        assert tok.decode(ex["answer_ids"].tolist()).strip() == ex["answer"]


def test_training_batch() -> None:
    exs = make_niah("uuid", 600, num_examples=3, seed=0)
    inputs, labels = niah_training_batch(exs)
    assert inputs.shape == labels.shape == (3, 600)
    for b, ex in enumerate(exs):
        p, a = ex["input_ids"].numel(), ex["answer_ids"].numel()
        assert torch.equal(inputs[b, :p], ex["input_ids"])
        assert torch.equal(inputs[b, p:], ex["answer_ids"])
        (pos,) = torch.nonzero(labels[b] != -100, as_tuple=True)
        assert pos.tolist() == list(range(p - 1, p - 1 + a))
        assert torch.equal(labels[b, pos], inputs[b, pos + 1])  # shifted next-token targets
        assert TOK.decode(labels[b, pos]).strip() == ex["answer"]
    _, with_eos = niah_training_batch(exs, eos_id=TOK.eos_id)
    assert (with_eos[:, -1] == TOK.eos_id).all()


def test_training_batch_pads_ragged_rows() -> None:
    exs = make_niah("passkey", 500, num_examples=1, seed=0) + make_niah("passkey", 540, num_examples=1, seed=0)
    inputs, labels = niah_training_batch(exs, pad_id=TOK.pad_id)
    assert inputs.shape == (2, 540)
    assert (inputs[0, 500:] == TOK.pad_id).all() and (labels[0, 499:] == -100).all()
    assert (labels[0] != -100).sum() == exs[0]["answer_ids"].numel()
    with pytest.raises(ValueError, match="examples"):
        niah_training_batch([])


def test_filler_text_is_deterministic_english_like() -> None:
    a, b, c = filler_text(30, seed=0), filler_text(30, seed=0), filler_text(30, seed=1)
    assert a == b and a != c
    sentences = re.findall(r"[^.]+\.", a)
    assert len(sentences) == 30
    assert all(s.strip()[0].isupper() for s in sentences)
    words = re.findall(r"[A-Za-z]+", a)
    assert len(set(w.lower() for w in words)) > 60
    assert not re.search(r"\d", a) and "magic" not in a
    assert filler_text(0, seed=0) == ""
    with pytest.raises(ValueError, match="num_sentences"):
        filler_text(-1, seed=0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(task="niah_single_9"), "task"),
        (dict(context_len=200), "context_len"),
        (dict(context_len=0), "context_len"),
        (dict(context_len=512.0), "context_len"),
        (dict(num_examples=0), "num_examples"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, name: str) -> None:
    args = dict(task="passkey", context_len=512, num_examples=1, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        make_niah(**args)


def test_string_match_all() -> None:
    assert string_match_all([" 1234567.", "no idea"], ["1234567", "7654321"]) == 50.0
    assert string_match_all(["The UUID is ABC-def"], [["abc-DEF", "zzz"]]) == 50.0
    with pytest.raises(ValueError, match="same length"):
        string_match_all(["a"], [])
