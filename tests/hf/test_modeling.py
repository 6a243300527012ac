"""transformers over every zoo model: a directory written by `LM.save_pretrained` loads with
`AutoModelForCausalLM.from_pretrained` (and back), the logits are the LM's, `generate` equals
`LM.generate`; left-padded batched generation equals each row alone; beam search with the cache
equals beam search by full forwards (reorder_cache); sampling, labels, packing and errors."""

import pytest
import torch
import torch.nn.functional as F
import transformers

import fastweights as fw
import fastweights.hf as fh
from fastweights.hf.cache_args import OUTPUT_STATE_FIELD
from fastweights.inputs import InputError
from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.models.test_segments import documents, padded
from tests.tolerances import SEGMENTS_F64

AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM

ZOO = fw.zoo.names()


@pytest.mark.parametrize("name", ZOO)
def test_lm_checkpoint_loads_in_transformers_and_generates_the_same(name, tmp_path):
    lm = LM(tiny_config(name))
    lm.save_pretrained(tmp_path / "a")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert isinstance(model, fh.FastWeightsForCausalLM) and model.config.lm_config == lm.config
    ids = torch.randint(0, VOCAB, (2, 6))
    assert torch.equal(model(ids).logits, lm(ids))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, lm.generate(ids, 5))
    model.save_pretrained(tmp_path / "b")  # and back: transformers' directory is a fastweights checkpoint
    back = LM.from_pretrained(tmp_path / "b")
    assert back.config == lm.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), lm.state_dict().values()))


@pytest.mark.parametrize("name", ZOO)
def test_left_padded_batched_generation_equals_each_row_alone(name):
    model = fh.from_lm(LM(tiny_config(name)).double())
    docs = documents([3, 7, 5])
    ids, mask = padded(docs)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for i, d in enumerate(docs):
        assert torch.equal(out[i, ids.shape[1]:], model.lm.generate(d[None], 4)[0, len(d):]), f"row {i}"
    # the scores too: the logits of the last prompt token of every row
    logits = model(ids, attention_mask=mask).logits
    for i, d in enumerate(docs):
        assert (logits[i, -1] - model.lm(d[None])[0, -1]).abs().max() < SEGMENTS_F64


@pytest.mark.parametrize("mixer", [("ttt_linear", "softmax_attention"), ("gated_deltanet", "mesanet", "fox")])
def test_beam_search_with_the_cache_equals_beam_search_by_full_forwards(mixer):
    cfg = tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer), head_v_dim=8)
    model = fh.from_lm(LM(cfg).double())
    ids, mask = padded(documents([4, 6]))
    kw = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    cached = model.generate(ids, use_cache=True, **kw)
    full = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached.sequences, full.sequences)
    assert (cached.sequences_scores - full.sequences_scores).abs().max() < SEGMENTS_F64


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = fh.from_lm(LM(tiny_config("gated_deltanet")))
    ids = torch.randint(0, VOCAB, (2, 4))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, temperature=0.8, top_p=0.9,
              pad_token_id=0)
    torch.manual_seed(5)
    a = model.generate(ids, **kw)
    torch.manual_seed(5)
    b = model.generate(ids, **kw)
    assert torch.equal(a, b) and a.shape == (2, 10) and int(a.max()) < VOCAB
    one = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, top_k=1,
                         pad_token_id=0)
    assert torch.equal(one, model.lm.generate(ids, 6))


def test_auto_classes_resolve_and_the_cache_is_typed(tmp_path):
    cfg = tiny_config("kda", mixer=("kda", "deltaformer"))
    lm = LM(cfg)
    lm.save_pretrained(tmp_path)
    hc = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(hc, fh.FastWeightsConfig) and hc.model_type == "fastweights"
    assert (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers) == (cfg.vocab_size, cfg.d_model, cfg.n_layers)
    assert transformers.AutoModelForCausalLM._model_mapping[fh.FastWeightsConfig] is fh.FastWeightsForCausalLM
    trunk = transformers.AutoModel.from_pretrained(tmp_path)
    assert isinstance(trunk, fh.FastWeightsModel)
    ids = torch.randint(0, VOCAB, (2, 5))
    h = trunk(ids).last_hidden_state  # [B, T, d]: the head's input
    assert torch.equal(torch.nn.functional.linear(h, lm.embed.weight), lm(ids))
    model = AutoModelForCausalLM.from_config(hc)
    ids = torch.randint(0, VOCAB, (3, 5))
    out = model(ids, use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, fh.FastWeightsCache) and isinstance(cache, transformers.Cache)
    assert cache.get_seq_length() == 5 and cache.batch_size == 3
    with pytest.raises(InputError, match="activate_past_recording"):  # not recording: nothing to roll back to
        cache.crop(2)
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 6
    nxt = model(torch.randint(0, VOCAB, (6, 1)), past_key_values=cache).logits
    assert nxt.shape == (6, 1, VOCAB) and cache.get_seq_length() == 6


def test_labels_give_the_shifted_cross_entropy_and_packing_is_honoured():
    model = fh.from_lm(LM(tiny_config("deltanet")).double())
    ids = torch.randint(0, VOCAB, (2, 7))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    ref = F.cross_entropy(model.lm(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert torch.allclose(out.loss, ref) and out.past_key_values is None
    docs = documents([3, 5])
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(3), torch.arange(5)])[None]
    logits = model(packed, position_ids=pos, use_cache=False).logits[0]
    assert (logits[3:] - model.lm(docs[1][None])[0]).abs().max() < SEGMENTS_F64


def test_errors_name_the_argument():
    model = fh.from_lm(LM(tiny_config("deltanet")))
    for bad in (torch.zeros(1, 2, 15), torch.zeros(1, 2, 16, dtype=torch.float64), torch.zeros(1, 2),
                torch.zeros(1, 2, 16, dtype=torch.long), torch.zeros(1, 0, 16)):
        with pytest.raises(InputError, match="inputs_embeds"):
            model(inputs_embeds=bad)
    with pytest.raises(InputError, match="exactly one of input_ids .* and inputs_embeds"):
        model(torch.zeros(1, 2, dtype=torch.long), inputs_embeds=torch.zeros(1, 2, 16))
    with pytest.raises(InputError, match="exactly one of input_ids .* and inputs_embeds"):
        model()
    with pytest.raises(InputError, match="past_key_values"):
        model(torch.zeros(1, 2, dtype=torch.long), past_key_values=object())
    with pytest.raises(fw.models.ConfigError, match="vocab_size"):
        fh.FastWeightsConfig({**tiny_config("deltanet").to_dict(), "vocab_size": 0})
    with pytest.raises(ValueError, match="format"):
        fh.FastWeightsConfig(tiny_config("deltanet"), format="other")


def test_the_config_constructs_without_arguments():
    """transformers builds `config_class()` to learn the defaults and validates it (5.17 – 5.19 read
    vocab_size in validate_token_ids): an empty config is valid until a model needs its LMConfig."""
    empty = fh.FastWeightsConfig()
    assert empty.config is None and empty.vocab_size is None and empty.num_hidden_layers is None
    full = fh.FastWeightsConfig(tiny_config("deltanet"))
    assert full.to_diff_dict()["config"] == tiny_config("deltanet").to_dict()  # builds FastWeightsConfig()
    with pytest.raises(ValueError, match="LMConfig"):
        _ = empty.lm_config


def test_an_untied_head_is_saved_and_loaded_by_transformers(tmp_path):
    """LMConfig(tie_word_embeddings=False): the HF model registers the LM's lm_head, so its weights are
    saved and loaded, and the logits equal the LM's."""
    from transformers import AutoModelForCausalLM

    from fastweights.models import LMConfig

    cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, mixer="gated_deltanet", num_heads=2, head_dim=16,
                   tie_word_embeddings=False)
    lm = LM(cfg).double()
    lm.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert "lm_head.weight" in hf.state_dict()
    assert torch.equal(hf.lm.lm_head.weight, lm.lm_head.weight)
    ids = torch.randint(0, 64, (2, 9))
    assert torch.equal(hf(ids).logits, lm(ids))  # the same modules and weights: the same computation


@pytest.mark.parametrize("mixer", [("gated_deltanet", "softmax_attention"), ("mamba2",), ("ttt_linear", "fox")])
@pytest.mark.parametrize("use_cache", [None, True])
def test_a_right_padded_forward_scores_each_row_as_alone_without_a_cache(mixer, use_cache):
    """Scoring code pads on the right and calls the model as it is (use_cache from the config: True):
    the logits at the real positions are each row's alone, and no cache comes back (none could continue
    a right-padded row; generate pads on the left)."""
    cfg = tiny_config(mixer[0], mixer=mixer, n_layers=len(mixer), head_v_dim=8)
    model = fh.from_lm(LM(cfg).double())
    docs = documents([3, 7, 5])
    ids, mask = padded(docs, left=False)
    out = model(ids, attention_mask=mask, use_cache=use_cache)
    assert getattr(out, OUTPUT_STATE_FIELD) is None
    for i, d in enumerate(docs):
        assert (out.logits[i, :len(d)] - model.lm(d[None])[0]).abs().max() < SEGMENTS_F64, f"row {i}"


def test_a_sharded_checkpoint_loads_in_lm_from_pretrained(tmp_path):
    """transformers' save_pretrained(max_shard_size=...) writes model.safetensors.index.json and shards;
    LM.from_pretrained reads them all (and names a missing shard)."""
    from fastweights.models.checkpoint import CheckpointError

    lm = LM(tiny_config("gated_deltanet", mixer=("gated_deltanet", "softmax_attention")))
    fh.from_lm(lm).save_pretrained(tmp_path, max_shard_size="8KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 1
    assert not (tmp_path / "model.safetensors").exists()
    back = LM.from_pretrained(tmp_path)
    assert back.state_dict().keys() == lm.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), lm.state_dict().values()))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=shards[-1].name):
        LM.from_pretrained(tmp_path)


@pytest.mark.parametrize("writer", ["lm", "transformers"])
def test_a_checkpoint_loads_with_trust_remote_code_without_importing_fastweights_hf(writer, tmp_path, monkeypatch):
    """config.json's auto_map names fastweights_auto.py, written next to it: with fastweights.hf's Auto
    registrations taken away (as in a process that never imported it), AutoModelForCausalLM loads the
    directory with trust_remote_code=True; saving it again writes the same two entries, no package file."""
    import json

    from transformers import dynamic_module_utils
    from transformers.models.auto import configuration_auto, modeling_auto

    lm = LM(tiny_config("gated_deltanet", mixer=("gated_deltanet", "softmax_attention"))).double()
    (lm.save_pretrained if writer == "lm" else fh.from_lm(lm).save_pretrained)(tmp_path / "a")
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.delitem(configuration_auto.CONFIG_MAPPING._extra_content, fh.MODEL_TYPE)
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        monkeypatch.setattr(mapping, "_extra_content", {})
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # not without consent
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", trust_remote_code=True, dtype=torch.float64)
    assert isinstance(model, fh.FastWeightsForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 6))
    assert torch.equal(model(ids).logits, lm(ids))
    model.save_pretrained(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").glob("*.py")) == ["fastweights_auto.py"]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["auto_map"] == \
        json.loads((tmp_path / "a" / "config.json").read_text())["auto_map"]
