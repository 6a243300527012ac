"""FastWeightsForCausalLM: a fastweights `LM` as a transformers causal LM (`PreTrainedModel` +
`GenerationMixin`), and FastWeightsModel, its trunk for `AutoModel` (last hidden states): so
`AutoModelForCausalLM.from_pretrained(dir)`, `generate(...)` (greedy, sampling, beam search) and
lm-evaluation-harness's HFLM take it as they take any model.

The wrapper owns the LM's own modules (`embed`, `blocks`, `norm`: the same parameter names as
`LM.state_dict()`), so the safetensors file of `LM.save_pretrained` and of `save_pretrained`
here is one format. `forward`:

    input_ids [B, T] -> logits [B, T, vocab]            (CausalLMOutputWithPast)
    labels [B, T]   -> loss = mean CE(logits[:, t], labels[:, t + 1]) over labels ≠ −100
    attention_mask [B, T_past + T]   0 = padding (left padding for generation)
    past_key_values: a FastWeightsCache (the LMState); use_cache=True returns the updated one
    position_ids [B, T] / cu_seqlens [S+1] (B = 1): packed documents, without a cache

With a cache: the first call prefills (`LM.prefill`, padding removed from every layer), the later
calls decode one token (`LM.step`, the recurrent form) or prefill a continuation; each row's
position comes from the cache's per-row lengths, so `position_ids` are not read then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..inputs import InputError
from ..models.lm import LM
from .cache import FastWeightsCache
from .config import FastWeightsConfig

__all__ = ["FastWeightsForCausalLM", "FastWeightsModel", "FastWeightsPreTrainedModel"]

IGNORE_INDEX = -100


class FastWeightsPreTrainedModel(PreTrainedModel):
    """The LM's modules (`embed`, `blocks`, `norm`) under transformers; `.lm` is the LM itself
    (sharing every parameter), for `LM.generate`, `prefill`, `step` and `save_pretrained`."""

    config_class = FastWeightsConfig
    base_model_prefix = "fastweights"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: FastWeightsConfig):
        super().__init__(config)
        lm = LM(config.lm_config, backends=tuple(config.backends) if config.backends is not None else None)
        config.backends = list(lm.backends)  # saved with the model, as LM.save_pretrained does
        self.embed, self.blocks, self.norm = lm.embed, lm.blocks, lm.norm
        object.__setattr__(self, "_lm", lm)  # the same modules, not registered twice
        self.post_init()

    def _init_weights(self, module):
        """Weights are initialized by the LM's own modules (each layer's published init)."""

    @property
    def lm(self) -> LM:
        return self._lm

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value
        self._lm.embed = value


class FastWeightsModel(FastWeightsPreTrainedModel):
    """The trunk (`AutoModel`): last_hidden_state = RMSNorm(h_L) [B, T, d_model], no cache;
    attention_mask / position_ids / cu_seqlens as in FastWeightsForCausalLM without a cache."""

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cu_seqlens: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> BaseModelOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise InputError("FastWeightsModel takes input_ids [B, T] (inputs_embeds is not supported)")
        h = self._lm.hidden(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cu_seqlens=cu_seqlens)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h))


def _check_labels(labels, input_ids, vocab_size: int) -> None:
    """labels: None or integer ids [B, T] like input_ids, each in [0, vocab_size) or IGNORE_INDEX."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise InputError(f"labels must be an integer tensor [B, T] like input_ids, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != input_ids.shape:
        raise InputError(f"labels must have input_ids' shape {list(input_ids.shape)}, got {list(labels.shape)}")
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise InputError(f"labels must be token ids in [0, vocab_size={vocab_size}) or {IGNORE_INDEX} (ignored), "
                         f"got {int(labels[bad][0])}")


class FastWeightsForCausalLM(FastWeightsPreTrainedModel, GenerationMixin):
    """transformers' causal LM over `fastweights.models.LM` (see the module doc)."""

    _is_stateful = True  # no cropping of the state: assisted decoding is refused by generate

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own FastWeightsCache on the first forward

    def get_output_embeddings(self):
        return None  # the head is the embedding (tied inside the LM)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                logits_to_keep: int = 0, return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        if inputs_embeds is not None:
            raise InputError("inputs_embeds is not supported by FastWeightsForCausalLM; pass input_ids")
        if input_ids is None:
            raise InputError("input_ids [B, T] is required")
        lm = self._lm
        lm._check_ids(input_ids, values=False)  # type, rank, device (the forms read the values)
        _check_labels(labels, input_ids, lm.config.vocab_size)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise InputError(f"attention_mask must be a tensor [B, T] or None, got {type(attention_mask).__name__}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise InputError(f"logits_to_keep must be an int ≥ 0 (0: every position), got {logits_to_keep!r}")
        use_cache = use_cache if use_cache is not None else bool(getattr(self.config, "use_cache", True))
        cache = past_key_values
        if cache is not None and not isinstance(cache, FastWeightsCache):
            if isinstance(cache, Cache) and cache.get_seq_length() == 0:
                cache = None  # an empty cache of another kind (made by a caller): ours replaces it
            else:
                raise InputError(f"past_key_values must be a FastWeightsCache, got {type(cache).__name__}")
        B, T = input_ids.shape
        if cache is not None and cache.state is not None:
            block_mask = attention_mask[:, -T:] if attention_mask is not None else None
            if T == 1 and (block_mask is None or bool(block_mask.all())):
                logits, state = lm.step(input_ids[:, 0], cache.state)
                logits = logits[:, None]
            else:
                logits, state = lm.prefill(input_ids, cache.state, attention_mask=block_mask)
            cache.state = state
        elif use_cache and cu_seqlens is None and labels is None:
            logits, state = lm.prefill(input_ids, attention_mask=attention_mask)
            if cache is None:
                cache = FastWeightsCache(state, batch_size=B)
            else:
                cache.state, cache._batch = state, B
        else:
            logits = lm(input_ids, attention_mask=attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens)
            cache = None
        loss = None
        if labels is not None:
            x = logits[:, :-1].flatten(0, 1)
            x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # fp32 at least
            loss = F.cross_entropy(x, labels[:, 1:].flatten().to(logits.device), ignore_index=IGNORE_INDEX)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
