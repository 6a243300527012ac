"""Pretraining data: text or token files -> one token stream -> packed windows in a fixed order.

Sources (nothing is downloaded):
  * text: UTF-8 files, or directories (every *.txt, *.md, *.rst, *.text file below, sorted); each
    file is one document, tokenized and followed by the end-of-text token;
  * JSON lines: `.jsonl` files (named, not found in directories), one JSON object per line, each
    object one document: its text under `text_key` ("text" by default), tokenized as a text file's
    document and followed by the end-of-text token (blank lines are skipped);
  * tokens: `.npy` (a 1-D integer array) or `.bin` (raw little-endian uint16, nanoGPT's format),
    already tokenized, documents separated by the tokenizer's end-of-text id.
Tokenizers: "bytes" (UTF-8 bytes 0–255, end-of-text 256: `fastweights.hf.ByteTokenizer`'s ids,
no dependency) or the path of a local Hugging Face tokenizer (`AutoTokenizer`, extra `hf`).

Windows: the stream x (N tokens) is cut into W = ⌊(N − 1) / T⌋ windows of T + 1 tokens, window i
= x[iT : iT + T + 1]; inputs are its first T tokens, labels its last T. Packing honours documents:
a token's position restarts at 0 after every end-of-text token (`position_ids`, so no layer
crosses the boundary: `fastweights.layers.segments`), and the end-of-text token predicts nothing
(label −100). Order: sample j of the run (j = 0, 1, …, over every step) is window
perm_e[j mod W] with e = ⌊j / W⌋ and perm_e a permutation drawn from (seed, e): a resumed run
reads exactly the samples an uninterrupted run reads.

Data key (`data_key`): what a run was trained on — every source file in order (its path, size in
bytes and SHA-256 of its bytes: the text that was tokenized or the token file), the tokenizer's
identity (name, vocabulary size, end-of-text id, a SHA-256 of its definition), the sequence
length and, when a .jsonl file is read, the key its text was read from. A run stores it in its
checkpoint and refuses to resume on other data (`data_key_diff` names what changed: files added,
removed or changed, the tokenizer, seq_len, the JSON text key).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DataError", "Tokenizer", "load_tokenizer", "check_tokenizer", "read_stream", "split_stream", "Windows",
           "TEXT_SUFFIXES", "JSONL_SUFFIX", "BYTE_EOS", "IGNORE_INDEX", "source_files", "data_key", "data_key_diff",
           "save_byte_tokenizer"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIX = ".jsonl"
BYTE_EOS = 256
IGNORE_INDEX = -100


class DataError(ValueError):
    """Bad pretraining data; the message names the file or the argument."""


@dataclass
class Tokenizer:
    """encode(text) -> ids; eos_id; vocab_size; `hf`: the transformers tokenizer (None for bytes)."""

    name: str
    eos_id: int
    vocab_size: int
    hf: object = None

    def encode(self, text: str) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def identity(self) -> dict:
        """name, vocab_size, eos_id and a SHA-256 of the definition (a fast tokenizer's JSON, else
        its sorted vocabulary and special tokens; for bytes, the word "bytes")."""
        if self.hf is None:
            definition = "bytes"
        else:
            backend = getattr(self.hf, "backend_tokenizer", None)
            definition = backend.to_str() if backend is not None else json.dumps(
                [sorted(self.hf.get_vocab().items()), sorted(map(str, self.hf.all_special_tokens))])
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "sha256": hashlib.sha256(definition.encode("utf-8")).hexdigest()}


#: what `fastweights.hf.ByteTokenizer().save_pretrained(dir)` writes (the same under transformers 5.17 and 5.24;
#: tests/hf/test_tokenizer.py holds these to what the installed transformers writes), so a run saves its byte
#: tokenizer without importing transformers (≈ 4 s a process) and without it installed
_EOS_TOKEN = "<|endoftext|>"  # the end-of-text token's text (id BYTE_EOS; the ids below it are the 256 bytes)
_BYTE_TOKENIZER_FILES = {
    "added_tokens.json": json.dumps({_EOS_TOKEN: BYTE_EOS}, indent=2) + "\n",
    "bytes.json": json.dumps({"bytes": BYTE_EOS}),
    "tokenizer_config.json": json.dumps({
        "added_tokens_decoder": {str(BYTE_EOS): {"content": _EOS_TOKEN, "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}},
        "backend": "custom", "bos_token": _EOS_TOKEN, "eos_token": _EOS_TOKEN, "model_max_length": int(1e30),
        "pad_token": _EOS_TOKEN, "padding_side": "left", "tokenizer_class": "ByteTokenizer"}, indent=2) + "\n",
}


def save_byte_tokenizer(directory: Path) -> None:
    """Write the byte tokenizer's files into `directory` (an existing directory): what
    `fastweights.hf.ByteTokenizer().save_pretrained(directory)` writes, without transformers."""
    for name, text in _BYTE_TOKENIZER_FILES.items():
        (Path(directory) / name).write_text(text, encoding="utf-8")


#: the files a Hugging Face tokenizer directory holds (one of them at least; save_pretrained writes
#: tokenizer_config.json); a fastweights checkpoint's config.json names its byte tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _fastweights_checkpoint(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type") == "fastweights"
    except (OSError, ValueError, AttributeError):
        return False


def check_tokenizer(spec: str) -> None:
    """"bytes" or an existing directory holding a tokenizer (what `load_tokenizer` reads: one of
    TOKENIZER_FILES, or a fastweights checkpoint's config.json), without loading it."""
    if spec == "bytes":
        return
    if not spec.strip():  # (Path("") is the current directory: a tokenizer found there would be taken)
        raise DataError("--tokenizer is empty; expected 'bytes' or a local tokenizer directory")
    path = Path(spec)
    if not path.is_dir():
        raise DataError(f"--tokenizer must be 'bytes' or a local tokenizer directory, got {spec!r} (not a directory)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not _fastweights_checkpoint(path):
        raise DataError(f"--tokenizer {spec}: holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); expected "
                        "a Hugging Face tokenizer directory (a tokenizer's save_pretrained, or a fastweights run's "
                        "model/), or 'bytes'")


def load_tokenizer(spec: str) -> Tokenizer:
    """"bytes", or a local directory holding a Hugging Face tokenizer (never downloaded)."""
    if spec == "bytes":
        return Tokenizer("bytes", eos_id=BYTE_EOS, vocab_size=BYTE_EOS + 1)
    check_tokenizer(spec)
    path = Path(spec)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("a Hugging Face tokenizer needs transformers: pip install 'fastweights[hf]'") from None
    import fastweights.hf  # noqa: F401  (a fastweights checkpoint directory resolves to ByteTokenizer)

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # (transformers' errors for a damaged or incomplete directory: one line naming it)
        msg = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"--tokenizer {spec}: transformers cannot load a tokenizer from it ({type(e).__name__}: "
                        f"{msg})") from None
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {spec}: it has no eos_token (documents are separated by it)")
    return Tokenizer(str(path), eos_id=int(eos), vocab_size=len(tok), hf=tok)


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no text files ({', '.join(TEXT_SUFFIXES)}) in this directory")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{path}: no such file or directory")


def source_files(paths) -> list[tuple[Path, str]]:
    """(file, kind) of every source in order, kind "npy", "bin", "jsonl" or "text" (a directory gives
    its text files, sorted)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("data: give at least one text file, directory, .npy or .bin file")
    out = []
    for spec in paths:
        p = Path(spec)
        if p.suffix in (".npy", ".bin", JSONL_SUFFIX) and p.is_file():
            out.append((p, p.suffix[1:]))
        else:
            out.extend((f, "text") for f in _text_files(p))
    return out


def _bin_tokens(p: Path) -> np.ndarray:
    size = p.stat().st_size
    if size == 0:
        raise DataError(f"{p}: the .bin token file is empty")
    if size % 2:
        raise DataError(f"{p}: {size} bytes is not a whole number of tokens; a .bin token file holds raw "
                        "little-endian uint16 ids (2 bytes each), so its size must be even")
    return np.memmap(p, dtype="<u2", mode="r")


def _jsonl_documents(p: Path, text_key: str) -> list[str]:
    """The text of every line's JSON object (blank lines skipped); DataError naming file:line."""
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e})") from None
    docs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n}: not a JSON object ({e.msg}); a .jsonl file holds one JSON object per "
                            "line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{p}:{n}: a JSON {type(obj).__name__}, expected an object with its text under "
                            f"{text_key!r}")
        if text_key not in obj:
            keys = ", ".join(map(repr, list(obj)[:8])) or "none"
            raise DataError(f"{p}:{n}: no key {text_key!r} (the text key, --text-key) in this object; its keys: {keys}")
        if not isinstance(obj[text_key], str):
            raise DataError(f"{p}:{n}: {text_key!r} holds a {type(obj[text_key]).__name__}, expected a string of text")
        docs.append(obj[text_key])
    if not docs:
        raise DataError(f"{p}: no JSON lines in this .jsonl file")
    return docs


def read_stream(paths, tokenizer: Tokenizer, text_key: str = "text") -> np.ndarray:
    """Every source, in order, as one token stream [N] (documents end with eos_id). A single .npy
    or .bin source stays memory-mapped in its own dtype (windows are converted batch by batch);
    several sources are concatenated into int64. text_key: the key of a .jsonl object's text."""
    parts: list[np.ndarray] = []
    for p, kind in source_files(paths):
        if kind == "npy":
            try:
                arr = np.load(p, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise DataError(f"{p}: not a readable .npy array ({e})") from None
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"{p}: a token file must hold a 1-D integer array, got {arr.dtype} {list(arr.shape)}")
            parts.append(arr)
        elif kind == "bin":
            parts.append(_bin_tokens(p))
        elif kind == "jsonl":
            ids: list[int] = []
            for doc in _jsonl_documents(p, text_key):
                ids += tokenizer.encode(doc)
                ids.append(tokenizer.eos_id)
            parts.append(np.array(ids, dtype=np.int64))
        else:
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p}: not UTF-8 text ({e})") from None
            parts.append(np.array(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64))
    if len(parts) == 1:
        stream = parts[0]  # one token file stays memory-mapped, as stored
    else:
        stream = np.concatenate([np.asarray(x, dtype=np.int64) for x in parts]) if parts else np.zeros(0, np.int64)
    if stream.size and (stream.min() < 0 or stream.max() >= tokenizer.vocab_size):
        raise DataError(f"data: token ids must lie in [0, {tokenizer.vocab_size}) for tokenizer {tokenizer.name!r}, "
                        f"got {int(stream.min())} … {int(stream.max())}")
    return stream


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def data_key(paths, tokenizer: Tokenizer, seq_len: int, text_key: str = "text") -> dict:
    """What a run is trained on (see the module doc): {"files": [{"path", "bytes", "sha256"}, ...]
    in stream order, "tokenizer": Tokenizer.identity(), "seq_len"} and "text_key" when a .jsonl
    file is among the sources. Reads every source file once."""
    sources = source_files(paths)
    files = [{"path": str(p), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p, _ in sources]
    key = {"files": files, "tokenizer": tokenizer.identity(), "seq_len": int(seq_len)}
    if any(kind == "jsonl" for _, kind in sources):
        key["text_key"] = text_key
    return key


def data_key_diff(old: dict, new: dict) -> list[str]:
    """What changed from the data key `old` to `new`, one phrase each (empty: the same data)."""
    out = []
    a = {f["path"]: f for f in old.get("files", [])}
    b = {f["path"]: f for f in new.get("files", [])}
    added, removed = [p for p in b if p not in a], [p for p in a if p not in b]
    if added:
        out.append(f"{len(added)} file(s) added: {', '.join(added[:3])}{' …' if len(added) > 3 else ''}")
    if removed:
        out.append(f"{len(removed)} file(s) removed: {', '.join(removed[:3])}{' …' if len(removed) > 3 else ''}")
    for p in (p for p in b if p in a):
        if a[p]["bytes"] != b[p]["bytes"]:
            out.append(f"{p} changed ({a[p]['bytes']} -> {b[p]['bytes']} bytes)")
        elif a[p]["sha256"] != b[p]["sha256"]:
            out.append(f"{p} changed (same size, other content)")
    if not (added or removed) and list(a) != list(b):
        out.append("the files are read in another order")
    ta, tb = old.get("tokenizer", {}), new.get("tokenizer", {})
    if ta != tb:
        what = [k for k in ("name", "vocab_size", "eos_id") if ta.get(k) != tb.get(k)]
        out.append("tokenizer " + (", ".join(f"{k} {ta.get(k)!r} -> {tb.get(k)!r}" for k in what) if what
                                   else f"{tb.get('name')!r} has another definition"))
    if old.get("seq_len") != new.get("seq_len"):
        out.append(f"seq_len {old.get('seq_len')} -> {new.get('seq_len')}")
    if "text_key" in old and "text_key" in new and old["text_key"] != new["text_key"]:
        out.append(f"text_key {old['text_key']!r} -> {new['text_key']!r} (the .jsonl text key)")
    return out


def split_stream(stream: np.ndarray, val_fraction: float, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last `val_fraction` of the stream held out, the cut moved to just
    after the next end-of-text token when there is one (whole documents on each side)."""
    if val_fraction <= 0:
        return stream, stream[:0]
    cut = int(len(stream) * (1.0 - val_fraction))
    after = np.nonzero(stream[cut:] == eos_id)[0]
    if len(after) and cut + after[0] + 1 < len(stream):
        cut = cut + int(after[0]) + 1
    return stream[:cut], stream[cut:]


class Windows:
    """The packed windows of a stream (see the module doc): W windows of T + 1 tokens."""

    def __init__(self, stream: np.ndarray, seq_len: int, eos_id: int, seed: int = 0):
        self.stream, self.T, self.eos_id, self.seed = stream, seq_len, eos_id, seed
        self.count = max(0, (len(stream) - 1) // seq_len)
        self._perm: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.count

    def window(self, i: int) -> np.ndarray:
        return self.stream[i * self.T:i * self.T + self.T + 1]

    def order(self, j: int) -> int:
        """The window of sample j (a fresh permutation every pass over the windows)."""
        e, r = divmod(j, self.count)
        if e not in self._perm:
            self._perm = {e: np.random.default_rng([self.seed, e]).permutation(self.count)}
        return int(self._perm[e][r])

    def documents(self) -> np.ndarray:
        """[count] int64: the documents each window's inputs hold, 1 + its end-of-text tokens before the last input
        (`pack` starts a document after each; one pass over the stream, 16M tokens at a time)."""
        T, out = self.T, np.ones(self.count, dtype=np.int64)
        per = max(1, (1 << 24) // T)  # windows a pass
        for a in range(0, self.count, per):
            b = min(self.count, a + per)
            x = np.asarray(self.stream[a * T:b * T]).reshape(b - a, T)[:, :T - 1]
            out[a:b] += (x == self.eos_id).sum(1)
        return out

    def max_documents(self) -> int:
        """The most documents any window's inputs hold (`documents`), so b windows hold at most b × this."""
        return int(self.documents().max(initial=1))

    def batch(self, samples) -> dict[str, torch.Tensor]:
        """input_ids, labels, position_ids [len(samples), T] of the given window indices."""
        x = torch.from_numpy(np.stack([self.window(i) for i in samples]).astype(np.int64))  # [b, T + 1]
        return pack(x, self.eos_id)


def pack(x: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """Windows x [b, T + 1] -> input_ids = x[:, :T], labels = x[:, 1:] (−100 where the input is
    end-of-text), position_ids restarting at 0 after every end-of-text input."""
    ids, labels = x[:, :-1], x[:, 1:].clone()
    eos = ids == eos_id
    labels[eos] = IGNORE_INDEX
    T = ids.shape[1]
    t = torch.arange(T).expand_as(ids)
    start = torch.zeros_like(eos)
    start[:, 1:] = eos[:, :-1]  # a document starts after an end-of-text token
    last_start = torch.where(start, t, torch.zeros_like(t)).cummax(1).values
    return {"input_ids": ids, "labels": labels, "position_ids": t - last_start}
