"""transformers' `generate` over the installed release, token for token against fastweights' own
decoding: greedy and seeded sampling = `LM.generate`; beam search = a beam search by full forwards
of each row alone (sequences and scores); a left-padded batch = each row alone;
`pipeline("text-generation")` = `LM.generate` on the tokenized prompt. And the state reaches the
model under every name a transformers release passes it (`past_key_values`, `cache`,
`cache_params`, with or without `cache_position`); anything else is an error."""

import pytest
import torch
import transformers

import fastweights.hf as fh
from fastweights.inputs import InputError
from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.models.test_segments import documents, padded
from tests.tolerances import BEAM_SCORE_F32, SEGMENTS_F64

# a fast-weight layer, a hybrid with a KV cache, and a memory whose rows are kept apart (RowStates)
MIXERS = [("gated_deltanet",), ("mamba2", "softmax_attention"), ("ttt_linear", "fox")]
BYTE_VOCAB = 257  # ByteTokenizer: bytes 0…255 and <|endoftext|> = 256


def hybrid(mixer, **kw) -> LM:
    return LM(tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer), head_v_dim=8, **kw))


@pytest.mark.parametrize("mixer", MIXERS)
def test_greedy_generation_equals_lm_generate(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    ids = torch.randint(0, VOCAB, (3, 5))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.lm.generate(ids, 8))
    # no attention_mask given: transformers makes one (every token real); the same tokens
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=VOCAB), out)


@pytest.mark.parametrize("mixer", MIXERS)
def test_seeded_sampling_equals_lm_generate_with_the_same_seed(mixer):
    # float32: transformers samples from float32 scores, as LM.generate does
    model = fh.from_lm(hybrid(mixer))
    ids = torch.randint(0, VOCAB, (3, 4))
    kw = dict(do_sample=True, temperature=0.7, top_k=10)
    torch.manual_seed(11)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, top_p=1.0, pad_token_id=0, **kw)
    torch.manual_seed(11)
    ref = model.lm.generate(ids, 8, **kw)
    assert torch.equal(out, ref)
    torch.manual_seed(11)
    again = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, top_p=1.0, pad_token_id=0,
                           **kw)
    assert torch.equal(again, out)


def beam_search_by_full_forwards(lm: LM, prompt: torch.Tensor, num_beams: int, n: int):
    """[(sequence [len(prompt) + n], Σ log p)] best first: every step extends each beam by every
    token (scored by a full forward of the beam alone) and keeps the num_beams best."""
    beams = [(prompt, 0.0)]
    for _ in range(n):
        cands = []
        for seq, score in beams:
            logp = lm(seq[None])[0, -1].double().log_softmax(-1)
            cands += [(torch.cat([seq, torch.tensor([tok])]), score + logp[tok].item()) for tok in range(len(logp))]
        beams = sorted(cands, key=lambda c: -c[1])[:num_beams]
    return beams


@pytest.mark.parametrize("mixer", MIXERS)
def test_beam_search_of_a_left_padded_batch_equals_beam_search_of_each_row_alone(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    docs = documents([3, 6])
    ids, mask = padded(docs)
    nb, n = 3, 4
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, num_beams=nb, num_return_sequences=nb,
                         do_sample=False, length_penalty=0.0, early_stopping=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    for i, d in enumerate(docs):
        ref = beam_search_by_full_forwards(model.lm, d, nb, n)
        for j, (seq, score) in enumerate(ref):
            assert torch.equal(out.sequences[i * nb + j, ids.shape[1]:], seq[len(d):]), f"row {i} beam {j}"
            assert abs(out.sequences_scores[i * nb + j].item() - score) < BEAM_SCORE_F32, f"row {i} beam {j}"


@pytest.mark.parametrize("mixer", MIXERS)
def test_left_padded_batch_greedy_and_sampling_equal_each_row_alone(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    docs = documents([2, 7, 4])
    ids, mask = padded(docs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, d in enumerate(docs):
        assert torch.equal(out[i, ids.shape[1]:], model.lm.generate(d[None], 6)[0, len(d):]), f"row {i}"
    # top_k = 1 sampling: the same tokens (the sampling path with the padded state)
    one = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=1, pad_token_id=0)
    assert torch.equal(one, out)


def byte_model(mixer=("gated_deltanet", "softmax_attention")):
    return fh.from_lm(LM(tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer), vocab_size=BYTE_VOCAB)).double())


def test_text_generation_pipeline_equals_lm_generate():
    model, tok = byte_model(), fh.ByteTokenizer()
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    eos = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = ["The cat sat", "A", "Fast weights are"]

    def reference(text, n):
        ids = torch.tensor([list(text.encode())])
        return model.lm.generate(ids, n, **eos)[0]

    got = pipe(prompts[0], max_new_tokens=7, do_sample=False, return_tensors=True, **eos)
    assert torch.equal(torch.as_tensor(got[0]["generated_token_ids"]), reference(prompts[0], 7))
    # a batch: the pipeline left-pads the prompts into one generate call
    outs = pipe(prompts, max_new_tokens=7, do_sample=False, batch_size=3, return_full_text=False, **eos)
    for text, o in zip(prompts, outs):
        new = reference(text, 7)[len(text.encode()):]
        assert o[0]["generated_text"] == tok.decode(new, skip_special_tokens=True), text


@pytest.mark.parametrize("name", ["past_key_values", "cache", "cache_params"])
def test_the_state_arrives_under_every_name_transformers_uses(name):
    model = fh.from_lm(hybrid(MIXERS[1]).double())
    ids = torch.randint(0, VOCAB, (2, 7))
    first = model(ids[:, :5], use_cache=True)
    cache = first.past_key_values
    assert isinstance(cache, fh.FastWeightsCache) and cache.get_seq_length() == 5
    step = model(ids[:, 5:6], **{name: cache}).logits  # one token
    block = model(ids[:, 6:], cache_position=torch.tensor([6]), **{name: cache}).logits  # and with its position
    full = model.lm(ids)
    assert (step[:, 0] - full[:, 5]).abs().max() < SEGMENTS_F64
    assert (block[:, 0] - full[:, 6]).abs().max() < SEGMENTS_F64
    assert cache.get_seq_length() == 7


def test_state_arguments_that_are_not_understood_are_errors():
    model = fh.from_lm(hybrid(MIXERS[0]))
    ids = torch.randint(0, VOCAB, (2, 4))
    cache = model(ids, use_cache=True).past_key_values
    nxt = torch.randint(0, VOCAB, (2, 1))
    with pytest.raises(InputError, match="cache_position"):  # the cache holds 4 tokens, not 6
        model(nxt, past_key_values=cache, cache_position=torch.tensor([6]))
    with pytest.raises(InputError, match="cache_position"):  # positions without a state to continue
        model(nxt, cache_position=torch.tensor([3]))
    with pytest.raises(InputError, match="cache_params"):  # one state under two names
        model(nxt, past_key_values=cache, cache_params=cache)
    with pytest.raises(InputError, match="past_key_values"):
        model(nxt, cache=object())
    with pytest.raises(InputError, match="not_an_argument"):
        model(nxt, not_an_argument=1)
    with pytest.raises(InputError, match="output_attentions"):
        model(nxt, output_attentions=True)
    assert cache.get_seq_length() == 4  # nothing above touched the state


@pytest.mark.parametrize("impl", ["static", "offloaded", "quantized", "paged", "sliding_window"])
def test_a_cache_implementation_other_than_the_models_own_state_is_refused(impl):
    model = fh.from_lm(hybrid(("gated_deltanet",)))
    ids = torch.randint(0, VOCAB, (1, 4))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(InputError, match=f"cache_implementation='{impl}' is not supported"):
        model.generate(ids, cache_implementation=impl, **kw)
    with pytest.raises(InputError, match=f"cache_implementation='{impl}' is not supported"):  # from a config too
        model.generate(ids, generation_config=transformers.GenerationConfig(cache_implementation=impl), **kw)
    # unset or "dynamic": the model's own state, as before
    assert torch.equal(model.generate(ids, cache_implementation="dynamic", **kw), model.lm.generate(ids, 2))
