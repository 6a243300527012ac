"""How the installed transformers hands the decoding state to `forward` and reads it back: the one
place that knows.

What `generate` passes (read in each release's `transformers/generation/utils.py`:
`prepare_inputs_for_generation`, `_update_model_kwargs_for_generation`, `_prepare_cache_for_generation`,
and the output classes of `modeling_outputs.py`):

    release        forward receives the state as            the output class's field
    5.17 – 5.23    past_key_values=                         past_key_values
                   (cache_params= instead for a model class whose name contains "mamba": not ours)
    5.24           cache=   (past_key_values= / cache_params=  cache  (output.past_key_values still reads it,
                   are deprecated aliases, renamed to cache     with a deprecation warning)
                   by transformers until 6.0)

    cache_position (positions of the block's tokens): 5.17 – 5.24 build it only for remote-code
    models whose forward names it; a registered local model such as ours never gets it from
    `generate`. A caller may still pass it: it is checked, never ignored.

Releases checked: 5.17.0 and 5.24.0 (installed, tests run), 5.20.0 and 5.23.0 (source read).

`take_state(...)` returns the one state the call carries, whichever name it came under;
`OUTPUT_STATE_FIELD` is the field the installed output classes hold it in. A state under two
names, a `cache_position` that is not the positions after the state, or any state that is not a
`FastWeightsCache` (an empty cache another caller made is replaced) is an `InputError`.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..inputs import InputError
from .cache import FastWeightsCache

__all__ = ["STATE_NAMES", "OUTPUT_STATE_FIELD", "take_state", "check_cache_position"]

STATE_NAMES = ("past_key_values", "cache", "cache_params")

OUTPUT_STATE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} \
    else "past_key_values"


def take_state(past_key_values=None, cache=None, cache_params=None) -> FastWeightsCache | None:
    """The FastWeightsCache a forward call carries (None: none, or an empty cache of another kind,
    which the model replaces by its own)."""
    given = {name: value for name, value in zip(STATE_NAMES, (past_key_values, cache, cache_params))
             if value is not None}
    if len(given) > 1:
        raise InputError(f"the decoding state came under {' and '.join(given)}: pass it once (transformers "
                         f"≤ 5.23 names it past_key_values, 5.24 cache)")
    if not given:
        return None
    (name, state), = given.items()
    if isinstance(state, FastWeightsCache):
        return state
    if isinstance(state, Cache) and state.get_seq_length() == 0:
        return None  # an empty cache another caller made (e.g. a DynamicCache): ours replaces it
    raise InputError(f"{name} (the decoding state; past_key_values / cache / cache_params) must be a "
                     f"FastWeightsCache, got {type(state).__name__}")


def check_cache_position(cache_position: torch.Tensor | None, past: int, T: int) -> None:
    """cache_position [T] must be the positions past … past + T − 1 of the block's tokens (past:
    the tokens the state already holds, padding included; 0 without a state)."""
    if cache_position is None:
        return
    want = torch.arange(past, past + T, device=cache_position.device)
    if cache_position.dim() != 1 or cache_position.numel() != T or not torch.equal(cache_position.long(), want):
        shown = cache_position.tolist() if cache_position.numel() <= 8 else list(cache_position.shape)
        raise InputError(f"cache_position must be the positions {past} … {past + T - 1} of this block's {T} tokens "
                         f"after the {past} the state holds, got {shown}")
