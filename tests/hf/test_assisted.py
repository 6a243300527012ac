"""The croppable FastWeightsCache: `crop` puts every layer's state (fast-weight memory, short-conv
tails, KV cache, per-row states) back to never having seen the dropped tokens, and transformers'
assisted decoding (another small model drafts) and prompt-lookup decoding give token for token
what greedy decoding gives — with drafts actually rejected and cropped (counted)."""

import pytest
import torch
import transformers

import fastweights.hf as fh
from fastweights.hf.cache import FastWeightsCache
from fastweights.inputs import InputError
from fastweights.state import state_tensors
from tests.hf.test_generation import hybrid
from tests.models.test_lm import VOCAB

# convolution tails (gated DeltaNet, Mamba2), a KV cache (softmax attention, FoX), an MLP memory (TTT)
MIXERS = [("gated_deltanet",), ("mamba2", "softmax_attention"), ("ttt_linear", "fox")]
GREEDY = dict(do_sample=False, pad_token_id=VOCAB)


def same_state(a, b) -> bool:
    ta, tb = state_tensors(a), state_tensors(b)
    return a.position == b.position and len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.fixture
def rewinds(monkeypatch):
    """Every crop that dropped tokens: (tokens held, tokens kept), for the tests to check that drafts
    were rejected."""
    seen = []
    crop = FastWeightsCache.crop

    def counting(self, n):
        held = self.get_seq_length()
        crop(self, n)
        if self.get_seq_length() < held:
            seen.append((held, self.get_seq_length()))

    monkeypatch.setattr(FastWeightsCache, "crop", counting)
    return seen


@pytest.mark.parametrize("mixer", MIXERS)
def test_crop_then_continuing_equals_never_having_seen_the_dropped_tokens(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    ids = torch.randint(0, VOCAB, (2, 12))
    cache = FastWeightsCache()
    cache.activate_past_recording()
    model(ids[:, :5], past_key_values=cache)  # a prefill
    model(ids[:, 5:9], past_key_values=cache)  # a block of 4 draft tokens
    model(ids[:, 9:10], past_key_values=cache)  # and a step
    assert cache.get_seq_length() == 10 and cache.is_croppable
    cache.crop(-3)  # keeps 2 of the block: its state before + those 2 again
    ref = model(ids[:, :5], use_cache=True).past_key_values
    model(ids[:, 5:7], past_key_values=ref)
    if mixer[0] in ("gated_deltanet", "mamba2"):  # the short-conv tails are part of what is compared
        assert cache.state.layers[0].conv_k is not None
    assert cache.get_seq_length() == 7 and same_state(cache.state, ref.state)
    a = model(ids[:, 7:10], past_key_values=cache).logits
    b = model(ids[:, 7:10], past_key_values=ref).logits
    assert torch.equal(a, b)
    # steps, cropped at a call boundary (the recorded state, no recomputation) and by the older
    # absolute convention crop(n > 0): n tokens kept
    cache.activate_past_recording()
    held = cache.get_seq_length()  # 10
    for t in range(10, 12):
        model(ids[:, t:t + 1], past_key_values=cache)
    cache.crop(held + 1)
    model(ids[:, 10:11], past_key_values=ref)
    assert cache.get_seq_length() == 11 and same_state(cache.state, ref.state)
    cache.crop(0)  # drops nothing
    assert same_state(cache.state, ref.state)


def test_crop_errors_name_what_is_missing():
    model = fh.from_lm(hybrid(MIXERS[0]).double())
    ids = torch.randint(0, VOCAB, (1, 6))
    cache = model(ids, use_cache=True).past_key_values  # not recording (plain generation)
    assert not cache.is_croppable
    with pytest.raises(InputError, match="activate_past_recording"):
        cache.crop(-1)
    cache.activate_past_recording()
    model(ids[:, :2], past_key_values=cache)
    with pytest.raises(InputError, match="token 6 at the earliest"):
        cache.crop(-3)  # only the 2 tokens fed since can be dropped
    with pytest.raises(InputError, match="holds only 8 tokens"):
        cache.crop(-9)
    with pytest.raises(InputError, match="crop"):
        cache.crop(1.5)


@pytest.mark.parametrize("mixer", MIXERS)
def test_assisted_generation_with_another_model_equals_greedy(mixer, rewinds):
    model = fh.from_lm(hybrid(mixer).double())
    assistant = fh.from_lm(hybrid(("gla", "softmax_attention")).double())  # other layers, other weights
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = model.generate(ids, max_new_tokens=16, **GREEDY)
    got = model.generate(ids, max_new_tokens=16, assistant_model=assistant, **GREEDY)
    assert torch.equal(got, ref)
    assert rewinds, "no draft was rejected: the test did not crop"
    # the model as its own assistant: every draft accepted
    assert torch.equal(model.generate(ids, max_new_tokens=16, assistant_model=model, **GREEDY), ref)


@pytest.mark.parametrize("mask", [False, True])
def test_an_assistant_is_fed_only_what_its_cache_does_not_hold(mask, monkeypatch):
    """Every forward of the assistant (and of the model) continues its cache with tokens the cache has not seen: past +
    T never exceeds the sequence so far. transformers 5.24 re-fed an assistant its whole sequence every round when the
    cache did not say it was positional (`FastWeightsCache.is_linear`): drafts from a corrupted state (past 41 and 43
    new tokens of a 43-token sequence) — the answer still greedy's, since the model checks every draft — and, with an
    attention mask, an InputError on the mask's width. Both with and without a mask, several draft rounds."""
    from fastweights.hf import modeling

    seen = []
    block = modeling._block_mask

    def spy(attention_mask, cache, past, T):
        seen.append((past, T))
        return block(attention_mask, cache, past, T)

    monkeypatch.setattr(modeling, "_block_mask", spy)
    model = fh.from_lm(hybrid(MIXERS[0]).double())
    assistant = fh.from_lm(hybrid(("gla", "softmax_attention")).double())
    ids = torch.randint(0, VOCAB, (1, 9))
    kw = dict(attention_mask=torch.ones_like(ids)) if mask else {}
    ref = model.generate(ids, max_new_tokens=12, **kw, **GREEDY)
    seen.clear()
    got = model.generate(ids, max_new_tokens=12, assistant_model=assistant, **kw, **GREEDY)
    assert torch.equal(got, ref)
    assert len(seen) > 4 and all(past + T <= got.shape[1] for past, T in seen), seen


def test_a_transformers_model_can_assist(rewinds):
    model = fh.from_lm(hybrid(MIXERS[1]).double())
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)
    assistant = transformers.LlamaForCausalLM(llama).double()
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = model.generate(ids, max_new_tokens=12, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=12, assistant_model=assistant, **GREEDY), ref)
    assert rewinds, "no draft was rejected: the test did not crop"


@pytest.mark.parametrize("mixer", MIXERS)
def test_prompt_lookup_generation_equals_greedy(mixer, rewinds):
    model = fh.from_lm(hybrid(mixer).double())
    part = torch.randint(0, VOCAB, (1, 4))
    ids = torch.cat([part, part, part, part[:, :2]], 1)  # repeats: the lookup finds drafts
    ref = model.generate(ids, max_new_tokens=16, **GREEDY)
    got = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(got, ref)
    assert rewinds, "no draft was rejected: the test did not crop"


def test_plain_generation_keeps_no_history(monkeypatch):
    model = fh.from_lm(hybrid(MIXERS[1]).double())
    kept = []
    update = FastWeightsCache.update_state

    def watching(self, *a, **kw):
        update(self, *a, **kw)
        kept.append((self.record_past, len(self._calls)))

    monkeypatch.setattr(FastWeightsCache, "update_state", watching)
    ids = torch.randint(0, VOCAB, (2, 5))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, **GREEDY)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=2, **GREEDY)
    assert kept and all(k == (False, 0) for k in kept)
