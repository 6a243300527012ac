"""lm-evaluation-harness for fastweights checkpoints (the optional extra `eval`).

Importing this module registers, besides transformers' Auto classes (`fastweights.hf`), the
harness model `fastweights`: lm-eval's own HFLM over `AutoModelForCausalLM.from_pretrained(DIR)`
(the causal backend), with the directory's tokenizer, or the byte-level `ByteTokenizer` when the
directory ships none. lm-eval has no plugin discovery for models, so its CLI is reached through
this module, which registers first and then hands every argument to lm-eval:

    python -m fastweights.cli eval --model fastweights --model_args pretrained=DIR --tasks TASK
    python -m fastweights.cli eval --model hf --model_args pretrained=DIR ...   # the same model by HFLM

or in Python: `import fastweights.hf.harness` and then `lm_eval.simple_evaluate(model="fastweights",
model_args="pretrained=DIR", ...)`.
"""

from __future__ import annotations

import sys

try:
    import lm_eval  # noqa: F401
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fastweights.hf.harness needs lm-evaluation-harness: pip install 'fastweights[eval]'") from e

from . import ByteTokenizer  # noqa: F401  (registers the Auto classes)

__all__ = ["FastWeightsHarnessLM", "main"]


@register_model("fastweights")
class FastWeightsHarnessLM(HFLM):
    """lm-eval's HFLM over a fastweights checkpoint directory (pretrained=DIR)."""

    def __init__(self, pretrained, tokenizer=None, **kwargs):
        from pathlib import Path

        if tokenizer is None and isinstance(pretrained, (str, Path)) and not _has_tokenizer(Path(pretrained)):
            tokenizer = ByteTokenizer()
        kwargs.pop("backend", None)
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, backend="causal", **kwargs)
        _stop_at_end_of_text(self.model, self.tokenizer)


def _stop_at_end_of_text(model, tokenizer) -> None:
    """Generation stops at the tokenizer's end-of-text token, at every batch size.

    lm-eval's generate_until hands transformers' generate no eos_token_id: only the model's
    generation config stops a row at end-of-text. Its own stop criterion sees the decoded
    "<|endoftext|>" but stops a batch only when every row has it, and the text it returns is decoded
    without special tokens — so without an eos_token_id a row of a batch of 4 ran on past its
    end-of-text where a batch of 1 stopped (found by tests/hf/test_harness.py in CI). A checkpoint
    whose generation config names an eos keeps it."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if gc is None or eos is None or gc.eos_token_id is not None:
        return
    if eos < model.config.vocab_size:
        gc.eos_token_id = eos


def _has_tokenizer(directory) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json"))


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (`lm_eval ...`) with the fastweights model registered."""
    from lm_eval.__main__ import cli_evaluate

    old = sys.argv
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = old


if __name__ == "__main__":  # pragma: no cover
    main()
