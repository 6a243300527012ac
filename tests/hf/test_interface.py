"""The HF interface a training or analysis script expects: output_hidden_states (HF's convention,
L + 1 tensors), return_dict=False, the flat config fields readable and writable, and
resize_token_embeddings with a tied or an untied head (both configs follow; the old tokens' logits are
unchanged; a new id trains; the checkpoint reloads at the new size)."""

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
import fastweights.hf as fh
from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.models.test_segments import documents, padded
from tests.tolerances import EXACT_F64, SEGMENTS_F64


@pytest.mark.parametrize("mixer", [("gated_deltanet", "softmax_attention"), ("ttt_linear", "fox")])
def test_output_hidden_states_are_the_embedding_the_blocks_and_the_heads_input(mixer):
    lm = LM(tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer), head_v_dim=8)).double()
    model = fh.from_lm(lm)
    ids, mask = padded(documents([3, 6]))
    out = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    assert len(hs) == lm.config.n_layers + 1 and all(h.shape == (2, 6, lm.config.d_model) for h in hs)
    assert torch.equal(hs[0], lm.embed(ids))
    assert torch.equal(F.linear(hs[-1], lm.embed.weight), out.logits)  # the last one is the head's input
    trunk = fh.FastWeightsModel(model.config).double()
    trunk.load_state_dict(model.state_dict())
    t = trunk(ids, attention_mask=mask, output_hidden_states=True)
    assert torch.equal(t.last_hidden_state, hs[-1]) and all(torch.equal(a, b) for a, b in zip(t.hidden_states, hs))
    # block 1's output, from the first document alone: the padded row's real tokens agree
    alone = lm.blocks[0](lm.embed(ids[:1, 3:]))[0]
    assert (hs[1][0, 3:] - alone[0]).abs().max() < SEGMENTS_F64
    # with the cache: the prefill and every decoding step report them too
    cached = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=True)
    assert (cached.hidden_states[-1][:, -1] - hs[-1][:, -1]).abs().max() < SEGMENTS_F64
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         output_hidden_states=True, return_dict_in_generate=True)
    assert len(gen.hidden_states) == 3 and gen.hidden_states[1][-1].shape == (2, 1, lm.config.d_model)
    assert model(ids, attention_mask=mask).hidden_states is None  # only when asked


def test_return_dict_false_gives_a_tuple():
    model = fh.from_lm(LM(tiny_config("deltanet")))
    ids = torch.randint(0, VOCAB, (2, 5))
    loss, logits = model(ids, labels=ids, return_dict=False)
    ref = model(ids, labels=ids)
    assert torch.equal(logits, ref.logits) and torch.equal(loss, ref.loss)
    (h,) = fh.FastWeightsModel(model.config)(ids, return_dict=False)
    assert h.shape == (2, 5, 16)


def test_flat_config_fields_read_and_write_the_lm_config():
    cfg = fh.FastWeightsConfig(tiny_config("deltanet"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (VOCAB, 16, 2, 2)
    cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads = 40, 32, 4, 4
    lc = cfg.lm_config
    assert (lc.vocab_size, lc.d_model, lc.n_layers, lc.num_heads) == (40, 32, 4, 4)
    assert fh.FastWeightsConfig.from_dict(cfg.to_dict()).lm_config == lc  # saved as the LMConfig
    with pytest.raises(fw.models.ConfigError, match="n_layers"):
        cfg.num_hidden_layers = 0
    assert cfg.num_hidden_layers == 4  # a refused value leaves the config as it was
    with pytest.raises(ValueError, match="vocab_size"):
        fh.FastWeightsConfig().vocab_size = 10


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_keeps_the_old_tokens_and_saves_the_new_vocabulary(tied, tmp_path):
    """Tied head (the embedding) and untied head (fla's layout, what `convert from-fla` makes) alike: both
    grow, the old tokens' logits stay, a new id trains, and the checkpoint reloads at the new size."""
    model = fh.from_lm(LM(tiny_config("gated_deltanet", tie_word_embeddings=tied)).double())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():  # (transformers resizes the Parameters in place: a graph recorded before would not fit)
        before, hidden, rows = model(ids).logits, model.lm.hidden(ids), model.lm.embed.weight.detach().clone()
    head = None if tied else model.get_output_embeddings().weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 6)
    assert model.config.vocab_size == model.lm.config.vocab_size == VOCAB + 6
    if tied:
        assert model.get_output_embeddings() is None and model.lm.lm_head is None
    else:
        assert model.get_output_embeddings() is model.lm.lm_head and model.lm.lm_head.weight.shape == (VOCAB + 6, 16)
        assert torch.equal(model.lm.lm_head.weight[:VOCAB], head)
    after = model(ids).logits
    # the old tokens' rows and the hidden states are kept bit for bit; the head's matmul over a wider vocabulary
    # may round differently (the BLAS picks its kernel by the output width: 5.6e-17 seen on an AVX-512 CPU)
    assert torch.equal(model.lm.embed.weight[:VOCAB], rows) and torch.equal(model.lm.hidden(ids), hidden)
    assert after.shape == (2, 5, VOCAB + 6)
    assert float((after[..., :VOCAB] - before).abs().max()) <= EXACT_F64 * float(before.abs().max())
    model.tie_weights()  # nothing to tie: the tied head is the embedding, the untied one stays its own
    assert (model.lm.lm_head is None) == tied and torch.equal(model(ids).logits, after)
    new = torch.tensor([[1, VOCAB + 5, VOCAB + 2]])
    assert model(new).logits.shape == (1, 3, VOCAB + 6)  # the new ids are tokens now
    model(new, labels=new).loss.backward()  # and they train: their rows of the head get a gradient
    grad = (model.lm.embed if tied else model.lm.lm_head).weight.grad
    assert bool(grad[VOCAB + 2].ne(0).any()) and bool(grad[VOCAB + 5].ne(0).any())
    model.save_pretrained(tmp_path)
    back = LM.from_pretrained(tmp_path)
    assert back.config.vocab_size == VOCAB + 6 and torch.equal(back(ids), after)
    hf = fh.FastWeightsForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert hf.config.vocab_size == VOCAB + 6 and torch.equal(hf(ids).logits, after)
    with pytest.raises(fw.inputs.InputError, match="nn.Embedding"):
        model.set_input_embeddings(torch.nn.Embedding(4, 3))
