"""ByteTokenizer: UTF-8 bytes as tokens, for transformers and `fastweights train`.

    ids 0 … 255   the bytes of the UTF-8 text
    id  256       <|endoftext|>: end of a document (eos), also bos and pad

vocab_size = 257; nothing to download or train. Decoding joins the bytes and decodes them as
UTF-8 (an incomplete character becomes U+FFFD).
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizer

__all__ = ["ByteTokenizer", "BYTES", "EOS"]

BYTES = 256
EOS = "<|endoftext|>"


class ByteTokenizer(PreTrainedTokenizer):
    """A byte-level tokenizer (see the module doc); tokens are the characters U+0000 … U+00FF."""

    vocab_files_names = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        for name in ("eos_token", "bos_token", "pad_token"):
            kwargs.setdefault(name, EOS)
        kwargs.setdefault("padding_side", "left")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return BYTES

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(BYTES)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) == 1 and ord(token) < BYTES:
            return ord(token)
        return self.added_tokens_encoder.get(token, self.eos_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < BYTES:
            return chr(index)
        return self.added_tokens_decoder[index].content if index in self.added_tokens_decoder else ""

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, buf = [], bytearray()
        for t in tokens:
            if len(t) == 1 and ord(t) < BYTES:
                buf.append(ord(t))
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(t)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "bytes.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"bytes": BYTES}, f)
        return (path,)
