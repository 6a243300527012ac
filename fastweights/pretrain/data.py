"""Pretraining data: text or token files -> one token stream -> packed windows in a fixed order.

Sources (nothing is downloaded):
  * text: UTF-8 files, or directories (every *.txt, *.md, *.rst, *.text file below, sorted); each
    file is one document, tokenized and followed by the end-of-text token;
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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DataError", "Tokenizer", "load_tokenizer", "read_stream", "split_stream", "Windows", "TEXT_SUFFIXES",
           "BYTE_EOS", "IGNORE_INDEX"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
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


def load_tokenizer(spec: str) -> Tokenizer:
    """"bytes", or a local directory holding a Hugging Face tokenizer (never downloaded)."""
    if spec == "bytes":
        return Tokenizer("bytes", eos_id=BYTE_EOS, vocab_size=BYTE_EOS + 1)
    path = Path(spec)
    if not path.is_dir():
        raise DataError(f"tokenizer must be 'bytes' or a local tokenizer directory, got {spec!r} (not a directory)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("a Hugging Face tokenizer needs transformers: pip install 'fastweights[hf]'") from None
    import fastweights.hf  # noqa: F401  (a fastweights checkpoint directory resolves to ByteTokenizer)

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
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


def read_stream(paths, tokenizer: Tokenizer) -> np.ndarray:
    """Every source, in order, as one token stream [N] (documents end with eos_id). A single .npy
    or .bin source stays memory-mapped in its own dtype (windows are converted batch by batch);
    several sources are concatenated into int64."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataError("data: give at least one text file, directory, .npy or .bin file")
    parts: list[np.ndarray] = []
    for spec in paths:
        p = Path(spec)
        if p.suffix == ".npy" and p.is_file():
            arr = np.load(p, mmap_mode="r")
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"{p}: a token file must hold a 1-D integer array, got {arr.dtype} {list(arr.shape)}")
            parts.append(arr)
        elif p.suffix == ".bin" and p.is_file():
            parts.append(np.memmap(p, dtype="<u2", mode="r"))
        else:
            for f in _text_files(p):
                try:
                    text = f.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{f}: not UTF-8 text ({e})") from None
                parts.append(np.array(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64))
    if len(parts) == 1:
        stream = parts[0]  # one token file stays memory-mapped, as stored
    else:
        stream = np.concatenate([np.asarray(x, dtype=np.int64) for x in parts]) if parts else np.zeros(0, np.int64)
    if stream.size and (stream.min() < 0 or stream.max() >= tokenizer.vocab_size):
        raise DataError(f"data: token ids must lie in [0, {tokenizer.vocab_size}) for tokenizer {tokenizer.name!r}, "
                        f"got {int(stream.min())} … {int(stream.max())}")
    return stream


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
