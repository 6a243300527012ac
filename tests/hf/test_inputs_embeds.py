"""inputs_embeds: the embedding's output given in place of input_ids routes exactly as the ids do
(float64, torch.equal) — in `LM.forward` / `prefill`, in FastWeightsModel and FastWeightsForCausalLM
(with and without a cache, with padding, with labels), and in transformers' `generate`, which feeds
the embeddings in the first step and the new ids after."""

import pytest
import torch

import fastweights.hf as fh
from fastweights.inputs import InputError
from tests.hf.test_generation import MIXERS, hybrid
from tests.models.test_lm import VOCAB
from tests.models.test_segments import documents, padded


@pytest.mark.parametrize("mixer", MIXERS)
def test_lm_forward_and_prefill_take_the_embeddings_exactly_as_the_ids(mixer):
    lm = hybrid(mixer).double()
    ids = torch.randint(0, VOCAB, (2, 7))
    e = lm.embed(ids)
    assert torch.equal(lm(inputs_embeds=e), lm(ids))
    logits, state = lm.prefill(inputs_embeds=e[:, :4])
    ref_logits, ref_state = lm.prefill(ids[:, :4])
    assert torch.equal(logits, ref_logits)
    more, _ = lm.prefill(inputs_embeds=e[:, 4:], state=state)  # a continuation too
    assert torch.equal(more, lm.prefill(ids[:, 4:], ref_state)[0])
    with pytest.raises(InputError, match="exactly one of input_ids"):
        lm(ids, inputs_embeds=e)


@pytest.mark.parametrize("mixer", MIXERS)
def test_causal_lm_and_trunk_give_the_same_outputs_from_embeddings(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    docs = documents([3, 6])
    ids, mask = padded(docs)
    e = model.get_input_embeddings()(ids)
    labels = ids.masked_fill(mask == 0, -100)
    for kw in (dict(), dict(attention_mask=mask), dict(attention_mask=mask, labels=labels)):
        a, b = model(ids, **kw), model(inputs_embeds=e, **kw)
        assert torch.equal(a.logits, b.logits), kw
        if "labels" in kw:
            assert torch.equal(a.loss, b.loss)
    # with a cache: a padded prefill, then a step and a block of 2 continue it (each from embeddings)
    ids = torch.cat([ids, torch.randint(0, VOCAB, (2, 3))], 1)
    mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    e = model.get_input_embeddings()(ids)
    a = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    b = model(inputs_embeds=e[:, :6], attention_mask=mask[:, :6], use_cache=True)
    assert torch.equal(a.logits, b.logits)
    for sl in (slice(6, 7), slice(7, 9)):
        a = model(ids[:, sl], attention_mask=mask[:, :sl.stop], past_key_values=a.past_key_values)
        b = model(inputs_embeds=e[:, sl], attention_mask=mask[:, :sl.stop], past_key_values=b.past_key_values)
        assert torch.equal(a.logits, b.logits)
    trunk = fh.FastWeightsModel(model.config).double()
    trunk.load_state_dict(model.state_dict())
    a = trunk(ids, attention_mask=mask, output_hidden_states=True)
    b = trunk(inputs_embeds=e, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    assert len(b.hidden_states) == len(mixer) + 1 and all(torch.equal(x, y) for x, y in zip(a.hidden_states,
                                                                                            b.hidden_states))


@pytest.mark.parametrize("mixer", MIXERS)
def test_generate_from_embeddings_equals_generate_from_ids(mixer):
    model = fh.from_lm(hybrid(mixer).double())
    ids = torch.randint(0, VOCAB, (2, 6))
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=VOCAB)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    got = model.generate(inputs_embeds=model.embed(ids), attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, ref[:, ids.shape[1]:])  # generate returns the new tokens only
    docs = documents([2, 5])  # a left-padded batch
    pids, mask = padded(docs)
    ref = model.generate(pids, attention_mask=mask, **kw)
    got = model.generate(inputs_embeds=model.embed(pids), attention_mask=mask, **kw)
    assert torch.equal(got, ref[:, pids.shape[1]:])


def test_embedding_errors_name_the_argument():
    model = fh.from_lm(hybrid(MIXERS[0]))
    with pytest.raises(InputError, match="inputs_embeds is torch.float64"):
        model(inputs_embeds=torch.zeros(1, 2, 16, dtype=torch.float64))
    with pytest.raises(InputError, match=r"inputs_embeds must be a floating tensor \[B, T, d_model=16\]"):
        model(inputs_embeds=torch.zeros(1, 2, 8))
    with pytest.raises(InputError, match="exactly one of input_ids"):
        fh.FastWeightsModel(model.config)(torch.zeros(1, 2, dtype=torch.long), inputs_embeds=torch.zeros(1, 2, 16))
    with pytest.raises(InputError, match="labels"):
        model(inputs_embeds=torch.zeros(1, 2, 16), labels=torch.zeros(1, 3, dtype=torch.long))
