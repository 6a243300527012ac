"""LMConfig: frozen, keyword-only, validated with errors naming the field; hybrid patterns; the
JSON form of configs and recipes (zoo names by name, custom Recipes field by field)."""

import dataclasses
import json

import pytest

import fastweights as fw
from fastweights.models import ConfigError, LMConfig, recipe_from_json, recipe_to_json

BASE = dict(vocab_size=32, d_model=16, n_layers=2, mixer="gated_deltanet", num_heads=2, head_dim=8)


def test_frozen_and_keyword_only():
    cfg = LMConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 8
    with pytest.raises(TypeError):
        LMConfig(32, 16, 2, "gated_deltanet", 2)


@pytest.mark.parametrize("field,value,match", [
    ("vocab_size", 0, "LMConfig.vocab_size must be a positive int"),
    ("d_model", 2.5, "LMConfig.d_model"),
    ("n_layers", -1, "LMConfig.n_layers"),
    ("num_heads", True, "LMConfig.num_heads"),
    ("mlp", "gelu", "LMConfig.mlp"),
    ("norm_eps", 0.0, "LMConfig.norm_eps"),
    ("mixer", "gated_deltanett", "LMConfig.mixer: .*Did you mean 'gated_deltanet'"),
    ("mixer", 3, "LMConfig.mixer must be a zoo name or a Recipe"),
    ("mixer", (), "empty pattern"),
    ("mixer", ("gated_deltanet",) * 3, "n_layers=2 must be a multiple"),
    ("num_kv_heads", 1, "num_kv_heads is set but no layer is softmax-side"),
    ("head_v_dim", 0, "LMConfig.head_v_dim"),
    ("init_std", float("inf"), "LMConfig.init_std must be a finite number > 0, got inf"),  # built a nan model
    ("rope_theta", float("nan"), "LMConfig.rope_theta must be a finite number"),
    ("norm_eps", float("inf"), "LMConfig.norm_eps must be a finite number"),
    ("tie_word_embeddings", 1, "LMConfig.tie_word_embeddings must be a bool"),
])
def test_errors_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        LMConfig(**{**BASE, field: value})


def test_layer_errors_name_the_layer():
    with pytest.raises(ConfigError, match=r"LMConfig.mixer\[1\] \(ttt_linear\): .*head_v_dim == head_dim"):
        LMConfig(**{**BASE, "mixer": ("gated_deltanet", "ttt_linear"), "head_v_dim": 4})
    with pytest.raises(ConfigError, match="num_kv_heads=3 must divide"):
        LMConfig(**{**BASE, "mixer": ("gated_deltanet", "softmax_attention"), "num_kv_heads": 3})


def test_hybrid_pattern_and_canonical_recipes():
    cfg = LMConfig(**{**BASE, "n_layers": 8, "mixer": ["gated_deltanet"] * 3 + [fw.zoo.get("softmax_attention")]})
    assert cfg.mixer == ("gated_deltanet",) * 3 + ("softmax_attention",)  # list -> tuple, zoo Recipe -> name
    assert [fw.zoo.resolve(m).name for m in cfg.layer_mixers] == (["gated_deltanet"] * 3 + ["softmax_attention"]) * 2
    assert cfg.mixer_kwargs(3)["num_v_heads"] is None


def test_json_round_trip_zoo_and_custom():
    novel = fw.Recipe(name="novel", feature_map=fw.FeatureMap(kind="polynomial", degree=2),
                      objective=fw.Objective(kind="omega", window=3), optimizer=fw.Optimizer(kind="muon"),
                      retention=fw.Retention(kind="scalar", decay_first=False), scale=0.5, citation="none")
    assert recipe_to_json(fw.zoo.get("kda")) == "kda"
    assert recipe_from_json(json.loads(json.dumps(recipe_to_json(novel)))) == novel
    for mixer in ("gated_deltanet", novel, ("gated_deltanet", novel)):
        cfg = LMConfig(**{**BASE, "mixer": mixer, "head_dim": 4})
        back = LMConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back == cfg
    with pytest.raises(ConfigError, match="unknown LMConfig field"):
        LMConfig.from_dict({**LMConfig(**BASE).to_dict(), "depth": 3})
    with pytest.raises(ConfigError, match="serialized Recipe is invalid"):
        recipe_from_json({"recipe": {"name": "x", "memory": {"kind": "tree"}}})


def test_mixer_overrides_build_save_and_load(tmp_path):
    """Preset fields replaced in every layer travel with the config: the layers built, JSON, a checkpoint."""
    import torch

    from fastweights.models import LM

    cfg = LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer=("gated_deltanet", "softmax_attention"),
                   num_heads=2, mixer_overrides={"out_gate": "none", "conv": "qkv"})
    assert cfg.mixer_overrides == (("conv", "qkv"), ("out_gate", "none"))  # sorted pairs
    assert LMConfig.from_dict(cfg.to_dict()) == cfg
    lm = LM(cfg).eval()
    for block in lm.blocks:
        assert block.mixer.preset.out_gate == "none" and block.mixer.preset.conv == "qkv"
    lm.save_pretrained(tmp_path)
    back = LM.from_pretrained(tmp_path).eval()
    assert back.config == cfg
    ids = torch.randint(0, 32, (1, 7))
    assert torch.equal(lm(ids), back(ids))


@pytest.mark.parametrize("bad, match", [({"nope": 1}, "unknown preset field"), ("x", "dict or"),
                                        ({"conv": [3]}, "JSON scalar"), ({"out_gate": "bogus"}, "out_gate")])
def test_mixer_overrides_errors_name_the_field(bad, match):
    with pytest.raises(ConfigError, match=match):
        LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer="gated_deltanet", num_heads=2, mixer_overrides=bad)
