"""FastWeightsForCausalLM: a fastweights `LM` as a transformers causal LM (`PreTrainedModel` +
`GenerationMixin`), and FastWeightsModel, its trunk for `AutoModel` (last hidden states): so
`AutoModelForCausalLM.from_pretrained(dir)`, `generate(...)` (greedy, sampling, beam search, assisted
and prompt-lookup decoding: the cache crops, see `cache.py`) and
lm-evaluation-harness's HFLM take it as they take any model.

The wrapper owns the LM's own modules (`embed`, `blocks`, `norm`: the same parameter names as
`LM.state_dict()`), so the safetensors file of `LM.save_pretrained` and of `save_pretrained`
here is one format. `forward`:

    input_ids [B, T] -> logits [B, T, vocab]            (CausalLMOutputWithPast)
    inputs_embeds [B, T, d_model] instead of input_ids: the embedding's output given directly
                    (generate(inputs_embeds=...) feeds them in the first step, then the new ids)
    labels [B, T]   -> loss = mean CE(logits[:, t], labels[:, t + 1]) over labels ≠ −100
                       (Σ / num_items_in_batch when Trainer passes that count: gradient accumulation)
    attention_mask [B, T_past + T]   0 = padding (left padding for generation)
    past_key_values: a FastWeightsCache (the LMState); use_cache=True returns the updated one
    position_ids [B, T] / cu_seqlens [S+1] (B = 1): packed documents, without a cache

A right-padded forward without a cache object (scoring code: attention_mask with trailing zeros and
the config's use_cache=True) runs as without a cache and returns none: no state continues a row
past its padding (generate pads on the left).

With a cache: the first call prefills (`LM.prefill`, padding removed from every layer), the later
calls decode one token (`LM.step`, the recurrent form) or prefill a continuation; each row's
position comes from the cache's per-row lengths, so `position_ids` are not read then.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..inputs import InputError
from ..models.checkpoint import ROUTING, write_auto_module
from ..models.lm import LM
from .cache import FastWeightsCache
from .cache_args import OUTPUT_STATE_FIELD, STATE_NAMES, check_cache_position, take_state
from .config import FastWeightsConfig

__all__ = ["FastWeightsForCausalLM", "FastWeightsModel", "FastWeightsPreTrainedModel"]

IGNORE_INDEX = -100


_SHARED_MODULES = frozenset({"embed", "blocks", "norm", "lm_head"})


class FastWeightsPreTrainedModel(PreTrainedModel):
    """The LM's modules (`embed`, `blocks`, `norm`) under transformers; `.lm` is the LM itself
    (sharing every parameter), for `LM.generate`, `prefill`, `step` and `save_pretrained`."""

    config_class = FastWeightsConfig
    base_model_prefix = "fastweights"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config: FastWeightsConfig):
        super().__init__(config)
        lm = LM(config.lm_config, backends=tuple(config.requested_backends()))
        config.backends, config.routing = list(lm.backends), ROUTING  # saved as LM.save_pretrained does
        self.embed, self.blocks, self.norm = lm.embed, lm.blocks, lm.norm
        if lm.lm_head is not None:  # an untied head (LMConfig.tie_word_embeddings=False): saved and loaded too
            self.lm_head = lm.lm_head
        object.__setattr__(self, "_lm", lm)  # the same modules, not registered twice
        self.post_init()

    supports_gradient_checkpointing = True

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Nothing (see `FastWeightsConfig.register_for_auto_class`): the class is the installed package's."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the file config.json's `auto_map` names (`checkpoint.AUTO_MODULE`:
        the directory then loads with trust_remote_code=True without `import fastweights.hf`)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_auto_module(save_directory)
        return out

    def __setattr__(self, name: str, value) -> None:
        """A module set under one of the LM's names (`embed`, `blocks`, `norm`, `lm_head`) is set in the
        LM too, so the two never diverge: PEFT (`get_peft_model`, `merge_and_unload`) replacing the head
        by its adapter and back, `set_input_embeddings`, `set_output_embeddings`."""
        super().__setattr__(name, value)
        lm = self.__dict__.get("_lm")
        if lm is not None and name in _SHARED_MODULES and isinstance(value, nn.Module):
            setattr(lm, name, value)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1):
        """What `gradient_checkpointing_enable` / `activation_checkpointing_enable` (and Trainer's
        `gradient_checkpointing=True`) call: per-block checkpointing in the LM, with transformers'
        checkpoint function (its kwargs, e.g. use_reentrant, included)."""
        self._lm.set_gradient_checkpointing(enable, every_n_layers=every_n_layers,
                                            checkpoint_fn=gradient_checkpointing_func)

    @property
    def is_activation_checkpointing(self) -> bool:  # transformers 5.24's name
        return self._lm.gradient_checkpointing

    @property
    def is_gradient_checkpointing(self) -> bool:  # ≤ 5.23's name (a deprecated alias in 5.24)
        return self._lm.gradient_checkpointing

    def _init_weights(self, module):
        """Weights are initialized by the LM's own modules (each layer's published init)."""

    @property
    def lm(self) -> LM:
        return self._lm

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding):
        """The embedding [vocab, d_model] (also the head: tied). Another number of rows (what
        `resize_token_embeddings` hands over) becomes vocab_size in both configs, the LM's and ours."""
        if not isinstance(value, nn.Embedding) or value.embedding_dim != self._lm.config.d_model:
            raise InputError(f"set_input_embeddings takes an nn.Embedding [vocab, {self._lm.config.d_model}], got "
                             f"{type(value).__name__} {list(getattr(value, 'weight', torch.empty(0)).shape)}")
        self.embed = value  # (and the LM's: __setattr__)
        if value.num_embeddings != self._lm.config.vocab_size:
            self._lm.config = dataclasses.replace(self._lm.config, vocab_size=value.num_embeddings)
            self.config.vocab_size = value.num_embeddings

    @contextmanager
    def _hidden_states(self, wanted: bool, inputs_embeds: torch.Tensor | None = None):
        """hidden_states of the forward run inside the block (HF's convention, L + 1 tensors [B, T, d]):
        the embedding's output (inputs_embeds when given), the outputs of blocks 1 … L − 1, and
        RMSNorm(h_L) (the head's input); read from the LM's own modules (one call of each per forward,
        else an error). None unless wanted."""
        if not wanted:
            yield None
            return
        outs: list[torch.Tensor] = [] if inputs_embeds is None else [inputs_embeds]
        record = lambda module, args, out: outs.append(out[0] if isinstance(out, tuple) else out)  # noqa: E731
        hooks = [m.register_forward_hook(record) for m in ((self.embed,) if inputs_embeds is None else ())
                 + tuple(self.blocks)]
        got: list[torch.Tensor] = []
        try:
            yield got
        finally:
            for h in hooks:
                h.remove()
        if len(outs) != len(self.blocks) + 1:
            raise RuntimeError(f"output_hidden_states: the embedding and blocks ran {len(outs)} times for "
                               f"{len(self.blocks) + 1} modules")
        got.extend([*outs[:-1], self.norm(outs[-1])])


class FastWeightsModel(FastWeightsPreTrainedModel):
    """The trunk (`AutoModel`): last_hidden_state = RMSNorm(h_L) [B, T, d_model], no cache;
    input_ids [B, T] or inputs_embeds [B, T, d_model], attention_mask / position_ids / cu_seqlens as
    in FastWeightsForCausalLM without a cache."""

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cu_seqlens: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, output_attentions: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        if kwargs:
            raise InputError(f"FastWeightsModel.forward does not take {', '.join(sorted(kwargs))}")
        if output_attentions:
            raise InputError("output_attentions=True: fast-weight layers have no attention weights to return")
        self._lm._check_inputs(input_ids, inputs_embeds, values=False)
        with self._hidden_states(_flag(output_hidden_states, self.config, "output_hidden_states"),
                                 inputs_embeds) as hidden:
            h = self._lm.hidden(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                cu_seqlens=cu_seqlens, inputs_embeds=inputs_embeds)
        out = BaseModelOutputWithPast(last_hidden_state=self.norm(h), hidden_states=_tuple(hidden))
        return out if _flag(return_dict, self.config, "return_dict") else out.to_tuple()


def _check_labels(labels, shape: tuple[int, int], vocab_size: int) -> None:
    """labels: None or integer ids [B, T] (the shape of input_ids / inputs_embeds' first two
    dimensions), each in [0, vocab_size) or IGNORE_INDEX."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise InputError(f"labels must be an integer tensor [B, T] like input_ids, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(shape):
        raise InputError(f"labels must be [B, T] = {list(shape)} like the inputs, got {list(labels.shape)}")
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise InputError(f"labels must be token ids in [0, vocab_size={vocab_size}) or {IGNORE_INDEX} (ignored), "
                         f"got {int(labels[bad][0])}")


class FastWeightsForCausalLM(FastWeightsPreTrainedModel, GenerationMixin):
    """transformers' causal LM over `fastweights.models.LM` (see the module doc)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # transformers makes no DynamicCache: `_prepare_cache_for_generation` makes ours

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """`generate`'s cache: the caller's, else (with use_cache) an empty FastWeightsCache, which
        the first forward fills; an assistant's records its past (its drafts get cropped), as
        transformers does for the caches it makes. Assisted decoding needs a cache before the first
        forward (it activates recording on it)."""
        _check_cache_implementation(generation_config.cache_implementation)
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.use_cache is False or model_kwargs.get("use_cache") is False:
            return
        if any(model_kwargs.get(name) is not None for name in STATE_NAMES):
            return
        cache = FastWeightsCache()
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
        model_kwargs[OUTPUT_STATE_FIELD] = cache

    def generate(self, *args, **kwargs):
        """transformers' generate; a cache_implementation other than the model's own state is refused
        (checked here for "paged", which transformers diverts before any cache is made, and again where
        the cache is made, for one set in a GenerationConfig)."""
        _check_cache_implementation(kwargs.get("cache_implementation"))
        return super().generate(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Linear | None:
        """The untied head `lm_head` [vocab, d_model] (LMConfig.tie_word_embeddings=False, fla's layout);
        None for a tied head, which is the embedding itself (the LM reads its weight: nothing to tie).
        `resize_token_embeddings` resizes the embedding, then (untied) this head to the same rows."""
        return self._lm.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        """The untied head: a module with in_features = d_model and out_features = the vocabulary
        (the embedding's rows); a tied LM has none to set."""
        lm = self._lm
        if lm.lm_head is None:
            raise InputError("set_output_embeddings: this model's head is its embedding (tie_word_embeddings=True); "
                             "resize or replace the embedding with set_input_embeddings")
        shape = (getattr(value, "out_features", None), getattr(value, "in_features", None))
        if not isinstance(value, nn.Module) or shape != (lm.config.vocab_size, lm.config.d_model):
            raise InputError(f"set_output_embeddings takes a Linear [vocab_size={lm.config.vocab_size}, "
                             f"d_model={lm.config.d_model}] (the embedding's rows), got {type(value).__name__} "
                             f"{list(shape)}")
        self.lm_head = value  # (and the LM's: __setattr__)

    def tie_weights(self, *args, **kwargs) -> None:
        """Nothing to tie, whatever the transformers config says: a tied head is the embedding by
        construction (the LM reads its weight), an untied head (LMConfig.tie_word_embeddings=False) is
        its own parameter and stays so."""

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                logits_to_keep: int = 0, return_dict: bool | None = None, cache: Cache | None = None,
                cache_params: Cache | None = None, cache_position: torch.LongTensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        if kwargs:
            raise InputError(f"FastWeightsForCausalLM.forward does not take {', '.join(sorted(kwargs))}")
        if output_attentions:
            raise InputError("output_attentions=True: fast-weight layers have no attention weights to return")
        lm = self._lm
        B, T = lm._check_inputs(input_ids, inputs_embeds, values=False)
        _check_labels(labels, (B, T), lm.config.vocab_size)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise InputError(f"attention_mask must be a tensor [B, T] or None, got {type(attention_mask).__name__}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise InputError(f"logits_to_keep must be an int ≥ 0 (0: every position), got {logits_to_keep!r}")
        use_cache = use_cache if use_cache is not None else bool(getattr(self.config, "use_cache", True))
        state = take_state(past_key_values, cache, cache_params)
        inputs = dict(ids=input_ids, embeds=inputs_embeds)
        with self._hidden_states(_flag(output_hidden_states, self.config, "output_hidden_states"),
                                 inputs_embeds) as hidden:
            if state is not None and state.state is not None:
                past = state.get_seq_length()
                check_cache_position(cache_position, past, T)
                block_mask = _block_mask(attention_mask, state, past, T)
                if T == 1 and (block_mask is None or bool(block_mask.all())):  # a step, from an id or an embedding
                    logits, after = lm.step(None if input_ids is None else input_ids[:, 0], state.state,
                                            inputs_embeds=inputs_embeds)
                    logits = logits[:, None]
                else:
                    logits, after = lm.prefill(input_ids, state.state, attention_mask=block_mask,
                                               inputs_embeds=inputs_embeds)
                state.update_state(after, lm, mask=block_mask, **inputs)
            elif use_cache and cu_seqlens is None and labels is None and not (
                    state is None and _right_padded(attention_mask)):
                # (a right-padded block without a cache object, e.g. scoring: no state can continue it,
                # so none is made; the plain forward below runs it)
                check_cache_position(cache_position, 0, T)
                logits, after = lm.prefill(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
                if state is None:
                    state = FastWeightsCache(after, batch_size=B)
                else:
                    state.update_state(after, lm, mask=attention_mask, **inputs)
                    state._batch = B
            else:
                check_cache_position(cache_position, 0, T)
                logits = lm(input_ids, attention_mask=attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
                            inputs_embeds=inputs_embeds)
                state = None
        loss = None if labels is None else shifted_cross_entropy(logits, labels, num_items_in_batch)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=_tuple(hidden),
                                     **{OUTPUT_STATE_FIELD: state})
        return out if _flag(return_dict, self.config, "return_dict") else out.to_tuple()


def _check_cache_implementation(value) -> None:
    """generate's cache_implementation: None or "dynamic" (the model's own FastWeightsCache, made by
    `_prepare_cache_for_generation`); "static", "offloaded", "quantized", "paged", … are caches of keys and
    values that a fixed-size memory does not have, refused rather than ignored."""
    if value not in (None, "dynamic"):
        raise InputError(f"cache_implementation={value!r} is not supported: a fastweights model decodes from its own "
                         "state (FastWeightsCache, made by generate); leave cache_implementation unset")


def _right_padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether some row of attention_mask [B, T] has padding (0) after a token (1)."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
        return False
    real = attention_mask.bool()
    return bool((real[:, :-1] & ~real[:, 1:]).any())


def _flag(value: bool | None, config, name: str) -> bool:
    """A forward flag: the argument, else the config's (transformers' defaults: return_dict True,
    output_hidden_states False)."""
    return bool(value) if value is not None else bool(getattr(config, name, name == "return_dict"))


def _tuple(hidden: list | None) -> tuple | None:
    return tuple(hidden) if hidden is not None else None


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                          num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Σ CE(logits[:, t], labels[:, t + 1]) over labels ≠ −100, divided by their count, or by
    num_items_in_batch when given (Trainer's count of such labels over all the micro-batches of one
    optimizer step, so that gradient accumulation sums to the loss of the whole batch)."""
    x = logits[:, :-1].flatten(0, 1)
    x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # fp32 at least
    target = labels[:, 1:].flatten().to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(x, target, ignore_index=IGNORE_INDEX)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return F.cross_entropy(x, target, ignore_index=IGNORE_INDEX, reduction="sum") / num_items_in_batch


def _block_mask(attention_mask: torch.Tensor | None, cache: FastWeightsCache, past: int, T: int):
    """The block's part [B, T] of attention_mask [B, past + T] (transformers' convention: the
    whole sequence so far), after checking that its first `past` columns are what the state saw:
    every row's count of real tokens equals the row's length in the state."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] != past + T:
        raise InputError(f"attention_mask must be [B, {past + T}] with a cache holding {past} tokens and {T} new "
                         f"ones (the whole sequence so far), got {list(attention_mask.shape)}")
    seen = attention_mask[:, :past].sum(1).to(torch.int64)
    lengths = cache.state.lengths
    want = lengths if lengths is not None else torch.full_like(seen, past)
    if not torch.equal(seen, want.to(seen.device)):
        raise InputError(f"attention_mask: its first {past} columns hold {seen.tolist()} tokens per row, but the "
                         f"cache's rows hold {want.tolist()} (a mask that does not belong to this cache)")
    return attention_mask[:, past:]
