"""LM: a decoder-only language model over any recipe (or a per-layer hybrid pattern of recipes).

    h_0 = Embed(ids)                                                   [B, T, d]
    h_l = h_{l−1} + Mixer_l(RMSNorm(h_{l−1}));  h_l += SwiGLU(RMSNorm(h_l))   (pre-norm blocks)
    logits = RMSNorm(h_L) Eᵀ                                           [B, T, vocab] (tied head)
             (RMSNorm(h_L) W_headᵀ with a separate `lm_head` when config.tie_word_embeddings is False)

Forms: `forward` and `prefill` run every mixer in its training form (chunk, else parallel, else
recurrent: `fastweights.layers.training_form`); `step` decodes one token per call with the
recurrent form from the carried `LMState` — constant memory for fast-weight layers, a growing
KV cache for softmax-side layers. `generate` = prefill + steps; `generate(use_cache=False)`
decodes by repeated full forwards (the reference the tests hold the cache to).

Documents: `forward` takes `attention_mask` [B, T] (0 = padding), `cu_seqlens` (packed
documents, B = 1) and `position_ids` [B, T] (a document starts where the position is 0), alone or
together (`Segments.build`: the documents from cu_seqlens, else position_ids; the mask removes
padding from them; position_ids beside cu_seqlens must restart exactly at its documents);
`prefill` takes `attention_mask` (left padding, for batched generation). No state, convolution
tail or attention crosses a document boundary (`fastweights.layers.segments`): each document's
logits equal those of the document run alone. After a padded prefill the LMState carries each
row's own length (`lengths`), so decoding continues every row at its own position.

Training memory: `set_gradient_checkpointing(every_n_layers=1)` makes `forward` keep only each
checkpointed block's input and recompute its activations in backward (transformers'
`gradient_checkpointing_enable` and Trainer's `gradient_checkpointing=True` reach it through
`fastweights.hf`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..inputs import InputError, InputTypeError, check_data, check_flag, check_int, check_like
from ..layers.mixer import MemoryMixer
from ..layers.norm import RMSNorm
from ..layers.segments import RowStates, Segments
from ..layers.state import MixerState, state_bytes
from ..state import KVCache, state_map, state_tensors
from .config import LMConfig

Tensor = torch.Tensor

__all__ = ["LM", "LMState", "SwiGLU", "Block", "GenerationError", "sample_next"]


class GenerationError(InputError):
    """Bad arguments to forward/prefill/step/generate (an `fw.InputError`); the message names the argument."""


class SwiGLU(nn.Module):
    """y = W₂(SiLU(W₁x) ⊙ W₃x): [.., d] -> [.., d] with hidden width `hidden` (bias-free)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """x ← x + Mixer(RMSNorm(x)); x ← x + MLP(RMSNorm(x))."""

    def __init__(self, config: LMConfig, layer: int):
        super().__init__()
        spec = config.layer_mixers[layer]
        self.norm1 = RMSNorm(config.d_model, eps=config.norm_eps, backend=config.layer_ops)
        self.mixer = MemoryMixer(config.d_model, spec, config.num_heads, **config.mixer_kwargs(layer))
        self.norm2 = RMSNorm(config.d_model, eps=config.norm_eps, backend=config.layer_ops) \
            if config.mlp == "swiglu" else None
        self.mlp = SwiGLU(config.d_model, config.hidden) if config.mlp == "swiglu" else None

    def forward(self, x: Tensor, state: MixerState | None = None, *, output_state: bool = False,
                form: str | None = None, step: bool = False, segments: Segments | None = None,
                context=None) -> tuple[Tensor, MixerState | None]:
        h = self.norm1(x)
        if step:
            h, state = self.mixer.step(h, state, segments=segments)
        elif context is not None:
            h, state = self.mixer(h, form=form, segments=segments, context=context)
        else:
            h, state = self.mixer(h, state, output_state=output_state, form=form, segments=segments)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x, state


@dataclass
class LMState:
    """The decoding state of an LM: one MixerState per layer (memory / KV cache, conv tails, position).

    mixers: the mixer of each layer of the model that made it (empty: not recorded); `LM.step` and
            `LM.prefill` refuse a state whose mixers are not theirs.
    lengths: [B] int64, the tokens each row's document holds (padding excluded) after a padded
             prefill; None when every row holds `position` tokens.
    """

    layers: tuple[MixerState, ...]
    mixers: tuple[str, ...] = ()
    lengths: Tensor | None = None

    @property
    def position(self) -> int:
        """Tokens consumed so far."""
        return self.layers[0].position if self.layers else 0


def sample_next(logits: Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """The next token [B] from logits [B, vocab]: argmax, or a sample from softmax(logits / temperature)
    restricted to the top_k tokens and to the smallest set whose probability reaches top_p."""
    if not check_flag("do_sample", do_sample):
        return logits.argmax(-1)
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # [B, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sx, idx = x.sort(dim=-1, descending=True)  # [B, vocab]
        probs = sx.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop = before >= top_p  # the top token is always kept (before = 0 < top_p)
        x = x.scatter(-1, idx, sx.masked_fill(drop, float("-inf")))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[:, 0]


class LM(nn.Module):
    """A language model from an LMConfig (see the module doc).

    forward(input_ids [B, T]) -> logits [B, T, vocab]   (or forward(inputs_embeds=[B, T, d_model]))
    prefill(input_ids, state=None) -> (logits, LMState);  step(ids [B] or [B, 1], state) -> (logits [B, vocab], LMState)
    generate(input_ids, max_new_tokens, ...) -> ids [B, T + max_new_tokens]
    save_pretrained(dir) / LM.from_pretrained(dir)
    """

    def __init__(self, config: LMConfig, *, backends: tuple[str, ...] | None = None):
        """backends: the requested backend of every layer's training form ("auto" or a name),
        overriding config.backend (what a checkpoint recorded); default: config.backend. Nothing is
        resolved here: every call is routed from what it is (`fastweights.dispatch`)."""
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"LM takes an LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.embed.weight, std=config.init_std)
        if backends is not None:
            if len(backends) != config.n_layers:
                raise ValueError(f"backends must name one backend per layer ({config.n_layers}), got {backends!r}")
            config = dataclasses.replace(config, backend=tuple(backends))
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps, backend=config.layer_ops)
        self.lm_head = None  # the head is the embedding (tied)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=config.init_std)
        self._checkpointed: frozenset[int] = frozenset()  # blocks whose activations backward recomputes
        self._checkpoint_fn = None

    def set_gradient_checkpointing(self, enable: bool = True, *, every_n_layers: int = 1, checkpoint_fn=None):
        """Gradient (activation) checkpointing per block in `forward` / `hidden` while gradients are
        recorded: blocks 0, n, 2n, … (n = every_n_layers) keep only their input and recompute their
        activations in backward. checkpoint_fn(function, tensor) -> output: default
        `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. Decoding (prefill, step) never
        checkpoints. enable=False turns it off (a bool only: InputTypeError otherwise)."""
        check_flag("enable", enable)
        check_int("every_n_layers", every_n_layers)
        if checkpoint_fn is not None and not callable(checkpoint_fn):
            raise InputTypeError(f"checkpoint_fn must be None or a callable (function, tensor) -> output, got "
                                 f"{type(checkpoint_fn).__name__}")
        if not enable:
            self._checkpointed, self._checkpoint_fn = frozenset(), None
            return
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        self._checkpointed = frozenset(range(0, len(self.blocks), every_n_layers))
        self._checkpoint_fn = checkpoint_fn or partial(checkpoint, use_reentrant=False)

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(self._checkpointed)

    @property
    def backends(self) -> tuple[str, ...]:
        """The requested backend of each layer's training form ("auto" or a name; what checkpoints
        record). What a call ran: each mixer's `routes`, shown by `repr`."""
        return tuple(b.mixer.backend for b in self.blocks)

    # ------------------------------------------------------------------ forward passes
    def _check_ids(self, ids: Tensor, name: str = "input_ids", *, values: bool = True):
        """An integer [B, T] tensor with B ≥ 1, T ≥ 1 and (values=True) every id in [0, vocab_size)
        — one host sync; skipped while a CUDA graph is being captured."""
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
            raise GenerationError(f"{name} must be an integer tensor [B, T], got "
                                  f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
        if ids.shape[0] == 0:
            raise GenerationError(f"{name} must hold at least one sequence (a batch of 0 rows: {list(ids.shape)})")
        if ids.shape[1] == 0:
            raise GenerationError(f"{name} must hold at least one token")
        check_like(name, ids, self.embed.weight, "the model", dtype=False)
        if values and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_data(name, ids, hint="")
            lo, hi = torch.aminmax(ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise GenerationError(f"{name} must be token ids in [0, vocab_size={self.config.vocab_size}), "
                                      f"got {bad}")

    def _check_state(self, state, batch: int, name: str = "state"):
        """`state` must be an LMState of this model for `batch` sequences: per layer the memory type
        and every tensor's shape of that layer's `init_state` (a KV cache's length excepted)."""
        if not isinstance(state, LMState) or len(state.layers) != len(self.blocks):
            got = f"an LMState of {len(state.layers)} layers" if isinstance(state, LMState) else type(state).__name__
            raise GenerationError(f"{name} must be the LMState of this model ({len(self.blocks)} layers: "
                                  f"{', '.join(self._mixer_names())}), got {got}")
        mine = self._mixer_names()
        if state.mixers and tuple(state.mixers) != mine:
            i = next(j for j, (a, b) in enumerate(zip(state.mixers, mine)) if a != b)
            raise GenerationError(f"{name} comes from another model: its layer {i} is {state.mixers[i]}, this "
                                  f"model's layer {i} is {mine[i]}")
        key = (batch, *(id(b.mixer) for b in self.blocks))
        cache = self.__dict__.setdefault("_state_templates", {})
        if key not in cache:  # (meta tensors: shapes only, nothing allocated)
            cache.clear()
            cache[key] = [b.mixer.init_state(batch, device="meta") for b in self.blocks]
        for i, (want, st) in enumerate(zip(cache[key], state.layers)):
            why = _mismatch(st, want, "")
            if why is not None:
                raise GenerationError(f"{name}.layers[{i}] is not a state of this model's layer {i} "
                                      f"({mine[i]}) for {batch} sequence(s): {why}")

    def _logits(self, h: Tensor) -> Tensor:
        if self.lm_head is not None:  # called as a module: an adapter or hook on the head applies
            return self.lm_head(self.norm(h))  # [B, T, vocab]
        return F.linear(self.norm(h), self.embed.weight)  # [B, T, vocab] (tied)

    def _embed(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, name: str = "input_ids",
               attention_mask: Tensor | None = None) -> Tensor:
        """h_0 [B, T, d_model]: Embed(input_ids), or inputs_embeds as given (exactly one of the two;
        checked: ids as `_check_ids`, embeddings as `_check_embeds`). Padding positions (attention_mask
        [B, T] == 0) are never read: their ids may be anything (a tokenizer's pad id past the vocabulary,
        e.g. the byte tokenizer's 256 with a 256-token model); one outside the vocabulary is embedded as id 0."""
        if isinstance(attention_mask, Tensor) and isinstance(input_ids, Tensor) and \
                attention_mask.shape == input_ids.shape:
            outside = (input_ids < 0) | (input_ids >= self.config.vocab_size)
            input_ids = input_ids.masked_fill((attention_mask.to(input_ids.device) == 0) & outside, 0)
        self._check_inputs(input_ids, inputs_embeds, name)
        return inputs_embeds if input_ids is None else self.embed(input_ids)

    def _check_inputs(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, name: str = "input_ids", *,
                      values: bool = True) -> tuple[int, int]:
        """(B, T) of exactly one of input_ids [B, T] (checked as `_check_ids`) and inputs_embeds
        [B, T, d_model] (as `_check_embeds`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise GenerationError(f"pass exactly one of {name} [B, T] and inputs_embeds [B, T, d_model="
                                  f"{self.config.d_model}], got {'both' if input_ids is not None else 'neither'}")
        if input_ids is not None:
            self._check_ids(input_ids, name, values=values)
            return tuple(input_ids.shape)
        self._check_embeds(inputs_embeds)
        return tuple(inputs_embeds.shape[:2])

    def _check_embeds(self, x: Tensor, name: str = "inputs_embeds") -> None:
        """A floating tensor [B, T, d_model] with B ≥ 1, T ≥ 1, in the embedding's dtype and device."""
        w = self.embed.weight
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 3 or x.shape[2] != w.shape[1]:
            raise GenerationError(f"{name} must be a floating tensor [B, T, d_model={w.shape[1]}], got "
                                  f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise GenerationError(f"{name} must hold at least one sequence and one position, got {list(x.shape)}")
        if x.dtype != w.dtype:  # also under autocast: the residual stream keeps the embedding's dtype
            raise GenerationError(f"{name} is {x.dtype}, the model's embedding {w.dtype}: convert one")
        check_like(name, x, w, "the model's embedding", dtype=False)

    def _hidden(self, h: Tensor, form: str | None, segments: Segments | None, context=None) -> Tensor:
        """The blocks over h_0 [B, T, d] (checkpointed as set)."""
        checkpointing = bool(self._checkpointed) and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if checkpointing and i in self._checkpointed:
                h = self._checkpoint_fn(lambda x, block=block: block(x, form=form, segments=segments,
                                                                     context=context)[0], h)
            else:
                h, _ = block(h, form=form, segments=segments, context=context)
        return h

    def forward(self, input_ids: Tensor | None = None, *, form: str | None = None,
                attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                cu_seqlens: Tensor | None = None, inputs_embeds: Tensor | None = None, context=None,
                max_documents: int | None = None) -> Tensor:
        """logits [B, T, vocab]; `form` forces one form on every layer (default: each layer's training form).

        attention_mask [B, T] (1: token, 0: padding), position_ids [B, T] (a document starts at
        position 0) and cu_seqlens [S+1] (packed documents, B = 1), any of them together (see the
        module doc): each document sees only itself.
        inputs_embeds [B, T, d_model] instead of input_ids: the embedding's output given directly
        (`forward(inputs_embeds=lm.embed(ids))` equals `forward(ids)`).
        context: a `fastweights.distributed.ContextParallel` — input_ids (and position_ids) are then this
        rank's span of sequences split over the ranks (`context.shard`), and the logits are the span's, as one
        process running the whole sequences would give them (no attention_mask or cu_seqlens).
        max_documents: with position_ids alone, a static bound on the documents of the whole block [B, T]: the
        documents are packed without reading a value on the host and with shapes that do not depend on them, so
        a CUDA graph can capture the forward and backward (`training.GraphedLMStep`); the caller checks the
        bound and position_ids ≥ 0 on its host batch (`layers.segments.check_documents`). The same logits as
        without it, up to rounding (the memories always run the varlen path then)."""
        return self._logits(self.hidden(input_ids, form=form, attention_mask=attention_mask,
                                        position_ids=position_ids, cu_seqlens=cu_seqlens, inputs_embeds=inputs_embeds,
                                        context=context, max_documents=max_documents))

    def hidden(self, input_ids: Tensor | None = None, *, form: str | None = None,
               attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
               cu_seqlens: Tensor | None = None, inputs_embeds: Tensor | None = None, context=None,
               max_documents: int | None = None) -> Tensor:
        """The last block's output h_L [B, T, d_model] (before the final norm); arguments as `forward`."""
        if context is not None and max_documents is not None:
            raise InputError("max_documents packs one process's block; context parallelism takes position_ids "
                             "without it")
        if context is not None:
            return self._hidden_context(input_ids, form, attention_mask, position_ids, cu_seqlens, inputs_embeds,
                                        context)
        h = self._embed(input_ids, inputs_embeds, attention_mask=attention_mask)
        B, T = h.shape[:2]
        seg = Segments.build(B, T, attention_mask=attention_mask, cu_seqlens=cu_seqlens, position_ids=position_ids,
                             device=h.device, max_documents=max_documents)
        return self._hidden(h, form, seg)

    def _hidden_context(self, input_ids, form, attention_mask, position_ids, cu_seqlens, inputs_embeds, context):
        """`hidden` of this rank's span under context parallelism (see `forward`)."""
        from ..distributed.context import ContextParallel, ContextParallelError, supports

        if not isinstance(context, ContextParallel):
            raise ContextParallelError(f"context must be a fastweights.distributed.ContextParallel, got "
                                       f"{type(context).__name__}")
        if attention_mask is not None or cu_seqlens is not None:
            raise ContextParallelError("context parallelism takes position_ids for packed documents, not "
                                       "attention_mask or cu_seqlens")
        for i, block in enumerate(self.blocks):
            why = supports(block.mixer.recipe)
            if why is not None:
                raise ContextParallelError(f"context parallelism: layer {i}: {why}")
        h = self._embed(input_ids, inputs_embeds)
        B, T = h.shape[:2]
        if context.lengths is None or context.lengths[context.rank] != T:
            raise ContextParallelError(f"this rank's span holds {T} tokens, but the context's span lengths are "
                                       f"{context.lengths}: cut the inputs with context.shard(x)")
        seg = Segments.span(position_ids, B, T, device=h.device)  # the span's documents
        return self._hidden(h, form, seg, context)

    def _state_segments(self, shape: tuple[int, int], device, state: LMState | None, attention_mask: Tensor | None):
        """(Segments | None, lengths after | None) of a block [B, T] continuing `state` (None: a new one)."""
        B, T = shape
        if attention_mask is None and (state is None or state.lengths is None):
            return None, None
        if attention_mask is not None:
            real = attention_mask.bool() if isinstance(attention_mask, Tensor) else attention_mask
            if isinstance(real, Tensor) and real.dim() == 2 and real.shape[1] > 1 and \
                    bool((real[:, 1:].int() < real[:, :-1].int()).any()):
                raise GenerationError("attention_mask: a state continues after the block, so padding must come "
                                      "before each row's tokens (left padding)")
            if state is not None and isinstance(real, Tensor) and not bool(real.all()):
                raise GenerationError("attention_mask: padding is allowed in the first block only (a block that "
                                      "continues a state must be all tokens)")
        if state is None:
            offsets = torch.zeros(B, dtype=torch.int64, device=device)
        elif state.lengths is not None:
            offsets = state.lengths
        else:
            offsets = torch.full((B,), state.position, dtype=torch.int64, device=device)
        seg = Segments.build(B, T, attention_mask=attention_mask, offsets=offsets, device=device)
        return seg, offsets + seg.lengths()

    def prefill(self, input_ids: Tensor | None = None, state: LMState | None = None, *,
                attention_mask: Tensor | None = None, inputs_embeds: Tensor | None = None) -> tuple[Tensor, LMState]:
        """Run input_ids [B, T] (or inputs_embeds [B, T, d_model]; continuing `state` when given) in
        the training forms; (logits [B, T, vocab], state after). attention_mask [B, T]: 0 marks
        (left) padding, which no layer sees; every row then decodes on from its own length."""
        h = self._embed(input_ids, inputs_embeds, attention_mask=attention_mask)
        B, T = h.shape[:2]
        if state is not None:
            self._check_state(state, B)
        seg, lengths = self._state_segments((B, T), h.device, state, attention_mask)
        layers = []
        for i, block in enumerate(self.blocks):
            h, st = block(h, state.layers[i] if state is not None else None, output_state=True, segments=seg)
            layers.append(st)
        return self._logits(h), LMState(layers=tuple(layers), mixers=self._mixer_names(), lengths=lengths)

    def step(self, token_ids: Tensor | None = None, state: LMState | None = None, *,
             inputs_embeds: Tensor | None = None) -> tuple[Tensor, LMState]:
        """One decoding step by the recurrent form: token_ids [B] or [B, 1] (or inputs_embeds
        [B, 1, d_model]) -> (logits [B, vocab], state)."""
        if isinstance(token_ids, Tensor) and token_ids.dim() == 1:
            token_ids = token_ids[:, None]  # [B, 1]
        h = self._embed(token_ids, inputs_embeds, "token_ids")
        if h.shape[1] != 1:
            name = "token_ids" if inputs_embeds is None else "inputs_embeds"
            raise GenerationError(f"step takes one token per sequence, got {name} {list(h.shape)}")
        if state is None:
            raise GenerationError("step needs the state to continue (prefill makes the first one)")
        self._check_state(state, h.shape[0])
        return self._step_hidden(h, state)

    def _step(self, token_ids: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """`step` without the checks (generate's own tokens and states are valid by construction)."""
        if token_ids.dim() == 1:
            token_ids = token_ids[:, None]
        return self._step_hidden(self.embed(token_ids), state)

    def _step_hidden(self, h: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """The step from h_0 [B, 1, d] (the embedding's output)."""
        seg, lengths = self._state_segments(tuple(h.shape[:2]), h.device, state, None)
        layers = []
        for block, st in zip(self.blocks, state.layers):
            h, st = block(h, st, step=True, segments=seg)
            layers.append(st)
        return self._logits(h)[:, 0], LMState(layers=tuple(layers), mixers=state.mixers, lengths=lengths)

    # ------------------------------------------------------------------ states
    def init_state(self, batch_size: int) -> LMState:
        """The state before any token (zeros, MLP memories' initial weights, empty KV caches)."""
        return LMState(layers=tuple(b.mixer.init_state(batch_size) for b in self.blocks), mixers=self._mixer_names())

    def _mixer_names(self) -> tuple[str, ...]:
        return tuple(getattr(m, "name", str(m)) for m in self.config.layer_mixers)

    def state_size(self, batch_size: int, seq_len: int = 0) -> int:
        """Bytes of the decoding state after seq_len tokens (fast-weight layers: constant; softmax: grows)."""
        return sum(b.mixer.state_size(batch_size, seq_len) for b in self.blocks)

    @staticmethod
    def state_bytes(state: LMState) -> int:
        """Bytes actually held by a state."""
        return state_bytes(state)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, *, use_cache: bool = True,
                 generator: torch.Generator | None = None, cuda_graph: bool = False,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None) -> Tensor:
        """input_ids [B, T] followed by the generated tokens: [B, T + n], n ≤ max_new_tokens.

        use_cache=True: prefill (training form) then one recurrent step per token from the carried
        state. use_cache=False: every token by a full forward over the sequence so far.
        Greedy unless do_sample; sampling draws from `generator` (None: torch's default generator).
        cuda_graph=True replays the decoding step from a CUDA graph (`fastweights.models.graphs`:
        fast-weight layers without RoPE, on a CUDA device; a GraphError says what stands in the way).
        eos_token_id: an id (or several) that ends a row: after a row's first end token it is filled
        with `pad_token_id` (default: the first end id), and generation stops as soon as every row
        has ended (then n < max_new_tokens). Without it, n = max_new_tokens. (With an end id, each
        step reads one flag back from the device.)
        """
        self._check_ids(input_ids)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be an int ≥ 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and 0 < temperature < math.inf):
            raise GenerationError(f"temperature must be a finite number > 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise GenerationError(f"top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
            raise GenerationError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")
        for flag, value in (("do_sample", do_sample), ("use_cache", use_cache), ("cuda_graph", cuda_graph)):
            check_flag(flag, value)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise GenerationError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
        if cuda_graph and not use_cache:
            raise GenerationError("cuda_graph=True replays the cached decoding step: it needs use_cache=True")
        ends = self._token_list(eos_token_id, "eos_token_id")
        pad = self._token_list(pad_token_id, "pad_token_id")
        if pad and not ends:
            raise GenerationError("pad_token_id fills rows after their eos_token_id: give eos_token_id too")
        if pad and len(pad) != 1:
            raise GenerationError(f"pad_token_id must be one token id, got {pad_token_id!r}")
        pick = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        out = input_ids
        if max_new_tokens == 0:
            return out
        if ends:
            end_ids = torch.tensor(ends, device=input_ids.device, dtype=input_ids.dtype)
            fill = (pad or ends)[0]
            ended = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def emit(nxt):
            """Append nxt [B]; True when every row has ended."""
            nonlocal out, ended
            if not ends:
                out = torch.cat([out, nxt[:, None]], dim=1)
                return False
            nxt = torch.where(ended, torch.full_like(nxt, fill), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            ended = ended | torch.isin(nxt, end_ids)
            return bool(ended.all())

        if use_cache:
            logits, state = self.prefill(input_ids)
            nxt = sample_next(logits[:, -1], **pick)
            if emit(nxt):
                return out
            step = self._step
            if cuda_graph and max_new_tokens > 1:
                from .graphs import GraphedDecoder

                step = GraphedDecoder(self, state, nxt).step
            for _ in range(max_new_tokens - 1):
                logits, state = step(nxt, state)
                nxt = sample_next(logits, **pick)
                if emit(nxt):
                    break
            return out
        for _ in range(max_new_tokens):
            if emit(sample_next(self(out)[:, -1], **pick)):
                break
        return out

    def _token_list(self, ids, name: str) -> list[int]:
        if ids is None:
            return []
        vals = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
        if not isinstance(vals, (list, tuple)) or not vals or any(
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.config.vocab_size for v in vals):
            raise GenerationError(f"{name} must be a token id (or a list of them) in [0, vocab_size="
                                  f"{self.config.vocab_size}), got {ids!r}")
        return list(vals)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, directory) -> None:
        """Write `config.json` and `model.safetensors` into `directory` (created if needed)."""
        from .checkpoint import save_pretrained

        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, device=None, backend: str | None = None) -> LM:
        """Load what save_pretrained wrote (weights in their saved dtype); CheckpointError if a file
        is missing or corrupt, InputError if `device` is not one this machine has. The layers request
        the backends the checkpoint recorded; `backend` ("auto" or a name) replaces them for every
        layer — e.g. "auto" for a checkpoint written before backends were routed per call, which
        recorded the resolved "torch" or "triton"."""
        from .checkpoint import load_pretrained

        return load_pretrained(cls, directory, device=device, backend=backend)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


_OPTIONAL_FIELDS = frozenset({"kv_doc"})


def _mismatch(got, want, path: str, grow: bool = False) -> str | None:
    """Why state `got` is not shaped like `want` (None: it is). Tensors compare by shape (with
    grow=True, inside a KV cache, except their length, dim 1); dataclasses field by field (of the
    same type); tuples item by item."""
    where = path or "the state"
    if isinstance(got, RowStates) and not isinstance(want, RowStates):  # per-row memories after a padded prefill
        first = next((x for x in state_tensors(want)), None)
        if first is not None and len(got.rows) != first.shape[0]:
            return f"{where} holds {len(got.rows)} rows, expected {first.shape[0]}"
        one = state_map(want, lambda x: x[:1])
        for b, row in enumerate(got.rows):
            why = _mismatch(row, one, f"{path}.rows[{b}]", grow)
            if why:
                return why
        return None
    if isinstance(want, Tensor):
        if not isinstance(got, Tensor):
            return f"{where} is {type(got).__name__}, expected a tensor of shape {list(want.shape)}"
        ws, gs = list(want.shape), list(got.shape)
        if grow and len(gs) == len(ws) and len(ws) > 1:
            gs[1] = ws[1]  # a cache's length grows with the tokens seen
        if gs != ws:
            return f"{where} has shape {list(got.shape)}, this layer's is {list(want.shape)}"
        return None
    if want is None:
        return f"{where} is a {type(got).__name__}, this layer has none" if got is not None else None
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"{where} is {type(got).__name__}, expected a tuple of {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            why = _mismatch(g, w, f"{path}[{j}]", grow)
            if why:
                return why
        return None
    if is_dataclass(want) and not isinstance(want, type):
        if type(got) is not type(want):
            return f"{where} is a {type(got).__name__}, this layer's is a {type(want).__name__}"
        for f in fields(want):
            if f.name in _OPTIONAL_FIELDS:  # present only after a padded prefill; shaped by the tokens seen
                continue
            why = _mismatch(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}" if path else f.name,
                            grow or isinstance(want, KVCache))
            if why:
                return why
    return None
