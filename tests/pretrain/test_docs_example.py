"""docs/hf.md's `fastweights train` example holds out real text: the held-out tail of the data its
first command reads (the preset's val_fraction, cut after a document, as `train` cuts it) comes
from the repository's Markdown documents, not from a measurement dump (docs/results); and the
numbers it quotes are those of the committed log of that run (docs/results/train_docs_example.jsonl)."""

import glob
import json
import re
import shlex
from pathlib import Path

from fastweights.pretrain import PretrainConfig
from fastweights.pretrain.data import load_tokenizer, read_stream, source_files, split_stream

ROOT = Path(__file__).resolve().parents[2]


def _example_data() -> list[str]:
    text = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")
    section = text.split("## `fastweights train`", 1)[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("python3 -m fastweights.cli train --data"))
    argv = shlex.split(line.split("#", 1)[0])
    data = argv[argv.index("--data") + 1:]
    data = data[:next((i for i, a in enumerate(data) if a.startswith("--")), len(data))]
    return [m for a in data for m in (sorted(glob.glob(a, root_dir=ROOT)) if glob.has_magic(a) else [a])]


def test_the_documented_example_holds_out_markdown_prose():
    data = _example_data()
    assert data and not any("results" in d for d in data), data
    tok = load_tokenizer("bytes")
    files = [p for p, _ in source_files([ROOT / d for d in data])]
    assert all(p.suffix == ".md" and "results" not in p.parts for p in files), files
    stream = read_stream([ROOT / d for d in data], tok)
    cfg = PretrainConfig.build({"data": data})  # (the preset "cpu", as the example runs)
    train, held_out = split_stream(stream, cfg.val_fraction, tok.eos_id)
    assert len(held_out) > 4 * cfg.val_batches * cfg.batch_size  # (enough for the validation batches)
    # the files the held-out tokens come from: one document per file, each followed by end-of-text
    ends, total = [], 0
    for p in files:
        total += len(p.read_bytes()) + 1
        ends.append((total, p))
    first_held_out = len(train)
    held = [p for end, p in ends if end > first_held_out]
    assert held and all(p.suffix == ".md" for p in held), held
    text = bytes(int(t) for t in held_out if t < 256).decode("utf-8")
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(" ".join(words)) > 0.4 * len(text), text[:500]  # prose, not a table of numbers


def test_the_documented_numbers_are_those_of_the_committed_run():
    recs = [json.loads(x) for x in (ROOT / "docs" / "results" / "train_docs_example.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 201)) and [r["step"] for r in val] == [50, 100, 150, 200]
    section = " ".join((ROOT / "docs" / "hf.md").read_text(encoding="utf-8").split("## `fastweights train`", 1)[1]
                       .split("\n## ", 1)[0].split())
    assert (f"The training loss fell from {train[0]['loss']:.2f} at step 1 to {train[-1]['loss']:.2f} at step "
            f"200; the validation loss was {val[0]['val_loss']:.2f} at step 50 and {val[-1]['val_loss']:.2f} nats "
            f"per byte at step 200 (perplexity {val[-1]['val_ppl']:.1f})") in section
