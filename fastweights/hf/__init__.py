"""fastweights in Hugging Face transformers (the optional extra `hf`: pip install "fastweights[hf]").

Importing this module registers the model with the Auto classes:

    AutoConfig                 "fastweights" -> FastWeightsConfig
    AutoModelForCausalLM       FastWeightsConfig -> FastWeightsForCausalLM
    AutoModel                  FastWeightsConfig -> FastWeightsModel (the trunk: last hidden states)
    AutoTokenizer              FastWeightsConfig -> ByteTokenizer (a directory may ship any other)

so a directory written by `LM.save_pretrained` (or by `FastWeightsForCausalLM.save_pretrained`:
one format) loads with `AutoModelForCausalLM.from_pretrained(dir)`, and `generate` works with
greedy, sampling, beam search, assisted decoding (`assistant_model=`) and prompt-lookup decoding
(`prompt_lookup_num_tokens=`) over the model's own state (`FastWeightsCache`, croppable while it
records its past), from input_ids or inputs_embeds.

    import fastweights.hf  # registers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("ckpt")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20)
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fastweights.hf needs transformers: pip install 'fastweights[hf]'") from e

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from ..models.checkpoint import ROUTING
from .cache import FastWeightsCache
from .config import MODEL_TYPE, FastWeightsConfig
from .modeling import FastWeightsForCausalLM, FastWeightsModel
from .tokenizer import ByteTokenizer

__all__ = ["FastWeightsConfig", "FastWeightsForCausalLM", "FastWeightsModel", "FastWeightsCache", "ByteTokenizer",
           "from_lm", "MODEL_TYPE"]


def from_lm(lm) -> FastWeightsForCausalLM:
    """The transformers model of an existing `LM`, sharing its parameters (no copy)."""
    model = FastWeightsForCausalLM(FastWeightsConfig(lm.config, backends=list(lm.backends), routing=ROUTING))
    model.embed, model.blocks, model.norm = lm.embed, lm.blocks, lm.norm
    if lm.lm_head is not None:
        model.lm_head = lm.lm_head
    object.__setattr__(model, "_lm", lm)
    return model.to(lm.embed.weight.device)


AutoConfig.register(MODEL_TYPE, FastWeightsConfig, exist_ok=True)
AutoModelForCausalLM.register(FastWeightsConfig, FastWeightsForCausalLM, exist_ok=True)
AutoModel.register(FastWeightsConfig, FastWeightsModel, exist_ok=True)
AutoTokenizer.register(FastWeightsConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)
