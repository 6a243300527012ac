"""fla checkpoints ↔ fastweights LMs without fla installed: every converted model type round-trips
through fla's layout (to-fla then from-fla gives the same layers, bit-identical weights and logits),
the converter reads and writes exactly the weight names and shapes fla 0.6.0 itself wrote
(tests/convert/data/fla_layouts.json, recorded by scripts/verify_fla_convert.py, which also checks the
logits against fla's own forward), the `fastweights convert` command works on directories, and what
has no exact counterpart raises ConversionError naming it."""

import json
from pathlib import Path

import pytest
import torch

import fastweights as fw
from fastweights.cli import main
from fastweights.convert import ConversionError, fla
from fastweights.models import LM, LMConfig

VOCAB = 40
LAYOUTS = json.loads((Path(__file__).parent / "data" / "fla_layouts.json").read_text())

_DP3 = fla._deltaproduct_recipe(3, False)
MODELS = {  # label -> LMConfig fields (d_model 32, 2 layers unless given)
    "gated_deltanet gva": dict(mixer="gated_deltanet", num_heads=2, head_dim=8, num_v_heads=4),
    "gated_deltanet hybrid 3:1 tied": dict(mixer=("gated_deltanet",) * 3 + ("softmax_attention",), n_layers=4,
                                           num_heads=4, head_dim=8, num_kv_heads=2, tie_word_embeddings=True),
    "gated_deltanet sigmoid gate, neg eigval": dict(mixer="gated_deltanet", num_heads=2, head_dim=8,
                                                    mixer_overrides={"out_gate": "sigmoid", "beta_scale": 2.0}),
    "deltanet gated": dict(mixer="deltanet", num_heads=2, head_dim=8, mixer_overrides={"out_gate": "swish"}),
    "gla": dict(mixer="gla", num_heads=2, head_dim=8),
    "gla conv": dict(mixer="gla", num_heads=2, head_dim=8, mixer_overrides={"conv": "qkv"}),
    "kda gva": dict(mixer="kda", num_heads=2, head_dim=8, num_v_heads=4),
    "mamba2": dict(mixer="mamba2", num_heads=1, head_dim=6, head_v_dim=8, num_v_heads=8, mlp="none"),
    "mamba2 norm before gate": dict(mixer="mamba2", num_heads=1, head_dim=6, head_v_dim=8, num_v_heads=8,
                                    mlp="none", mixer_overrides={"norm_before_gate": True}),
    "retnet hybrid": dict(mixer=("retnet", "softmax_attention"), num_heads=4, head_dim=8, head_v_dim=8),
    "comba": dict(mixer="comba", num_heads=2, head_dim=8),
    "deltaproduct": dict(mixer="deltaproduct", num_heads=2, head_dim=8),
    "deltaproduct n_h 3 ungated": dict(mixer=_DP3, num_heads=2, head_dim=8,
                                       mixer_overrides={"beta_scale": 1.0, "decay": "none"}),
    "linear attention elu+1": dict(mixer=fla._linear_attention_recipe("elu1"), num_heads=2, head_dim=8,
                                   mixer_overrides={"conv": "none", "out_gate": "none"}),
    "linear attention relu": dict(mixer=fla._linear_attention_recipe("relu"), num_heads=2, head_dim=8,
                                  mixer_overrides={"conv": "none", "out_gate": "none"}),
    "mesanet gated": dict(mixer="mesanet", num_heads=2, head_dim=8, mixer_overrides={"out_gate": "swish"}),
}


def random_lm(fields) -> LM:
    cfg = LMConfig(**{"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "tie_word_embeddings": False, **fields})
    lm = LM(cfg)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return lm.eval()


def layers(cfg: LMConfig) -> list:
    lm = fla._meta_lm(cfg)
    return [fla._signature(b.mixer) for b in lm.blocks]


@pytest.mark.parametrize("label", MODELS)
def test_round_trip_through_fla_layout_is_exact(label):
    lm = random_lm(MODELS[label])
    c, sd = fla.to_fla(lm.config, lm.state_dict())
    assert c["model_type"] in fla.FLA_MODEL_TYPES and c["architectures"] == [fla.FLA_MODEL_TYPES[c["model_type"]]]
    assert ("lm_head.weight" in sd) != lm.config.tie_word_embeddings
    back_cfg, back = fla.from_fla(json.loads(json.dumps(c)), sd)  # through JSON, as a config.json
    assert layers(back_cfg) == layers(lm.config)
    assert back.keys() == lm.state_dict().keys()
    for k, v in lm.state_dict().items():
        assert torch.equal(back[k], v), k
    lm2 = LM(back_cfg)
    lm2.load_state_dict(back)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert torch.equal(lm2.eval()(ids), lm(ids))


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_reads_and_writes_fla_own_layout(case):
    """fla's own config.json and weight names/shapes (recorded from fla 0.6.0's save_pretrained)
    convert with every weight used, and converting back writes exactly fla's names and shapes."""
    rec = LAYOUTS[case]
    sd = {k: torch.randn(shape) for k, shape in rec["weights"].items()}
    cfg, weights = fla.from_fla(rec["config"], sd)
    LM(cfg).load_state_dict(weights, strict=True)
    c, out = fla.to_fla(cfg, weights, fuse_norm=rec["config"]["fuse_norm"])
    assert {k: list(v.shape) for k, v in out.items()} == rec["weights"]
    for k, v in out.items():
        assert torch.equal(v, sd[k]), k
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings"):
        assert c[key] == rec["config"][key], key


def test_cli_converts_directories_both_ways(tmp_path, capsys):
    lm = random_lm(MODELS["gated_deltanet hybrid 3:1 tied"])
    lm.save_pretrained(tmp_path / "fw")
    assert main(["convert", "to-fla", str(tmp_path / "fw"), str(tmp_path / "fla")]) == 0
    assert "fla gated_deltanet" in capsys.readouterr().out
    config = json.loads((tmp_path / "fla" / "config.json").read_text())
    assert config["attn"]["layers"] == [3] and config["attn"]["num_kv_heads"] == 2
    assert main(["convert", "from-fla", str(tmp_path / "fla"), str(tmp_path / "back")]) == 0
    assert "3 gated_deltanet, 1 softmax_attention" in capsys.readouterr().out
    assert json.loads((tmp_path / "back" / "config.json").read_text())["backends"] == ["auto"] * 4
    back = LM.from_pretrained(tmp_path / "back")
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids), lm(ids))
    # an existing checkpoint is not overwritten unless asked; a missing source is one line
    assert main(["convert", "from-fla", str(tmp_path / "fla"), str(tmp_path / "back")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", "from-fla", str(tmp_path / "fla"), str(tmp_path / "back"), "--overwrite"]) == 0
    assert main(["convert", "to-fla", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_a_converted_untied_checkpoint_loads_in_transformers(tmp_path):
    import transformers

    import fastweights.hf  # noqa: F401  (registers the fastweights model type)

    lm = random_lm(MODELS["kda gva"])
    c, sd = fla.to_fla(lm.config, lm.state_dict())
    from safetensors.torch import save_file

    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "config.json").write_text(json.dumps(c))
    save_file(sd, str(tmp_path / "fla" / "model.safetensors"))
    fla.convert_from_fla(tmp_path / "fla", tmp_path / "fw")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fw")
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, lm(ids))


def test_reads_sharded_safetensors_and_a_saved_tied_head(tmp_path):
    from safetensors.torch import save_file

    rec = LAYOUTS["kda gva"]
    sd = {k: torch.randn(shape) for k, shape in rec["weights"].items()}
    config = {**rec["config"], "tie_word_embeddings": True}
    sd["lm_head.weight"] = sd["model.embeddings.weight"].clone()  # tied, yet saved
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:10]}, str(tmp_path / "a.safetensors"))
    save_file({k: sd[k] for k in keys[10:]}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {k: ("a" if i < 10 else "b") + ".safetensors" for i, k in enumerate(keys)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = fla.convert_from_fla(tmp_path, tmp_path / "fw")
    assert cfg.tie_word_embeddings and LM.from_pretrained(tmp_path / "fw").lm_head is None
    sd["lm_head.weight"] += 1.0
    with pytest.raises(ConversionError, match="lm_head.weight differs from the embedding"):
        fla.from_fla(config, sd)


def _fla(case, **changes):
    rec = LAYOUTS[case]
    return {**rec["config"], **changes}, {k: torch.randn(s) for k, s in rec["weights"].items()}


@pytest.mark.parametrize("case,changes,match", [
    ("gla fused norm", dict(feature_map="relu"), "feature_map='relu' has no counterpart"),
    ("gla fused norm", dict(num_kv_heads=1), "num_kv_heads=1 < num_heads"),
    ("gla fused norm", dict(clamp_min=-1.0), "clamp_min"),
    ("mamba2 default", dict(n_groups=2), "n_groups=2"),
    ("mamba2 default", dict(dt_limit=[0.0, 2.0]), "dt_limit"),
    ("mamba2 default", dict(num_heads=4), r"num_heads=4 but expand·hidden_size / head_dim = 8 heads"),
    ("mamba2 default", dict(use_l2warp=True), "use_l2warp=True"),
    ("linear_attn elu", dict(norm_feature_map=True), r"1e-10.*1e-6"),
    ("linear_attn elu", dict(feature_map="hedgehog"), "learned maps"),
    ("kda gva", dict(safe_gate=True, lower_bound=-5.0), "safe_gate"),
    ("delta_net tied", dict(qk_norm="sum"), "qk_norm='sum'"),
    ("gated_deltanet gva+neg", dict(use_short_conv=False), "use_short_conv=False"),
    ("gated_deltanet hybrid", dict(attn={"layers": [1], "num_heads": 4, "qkv_bias": True}), "qkv_bias"),
    ("gated_deltanet hybrid", dict(attn={"layers": [1], "num_heads": 4, "window_size": 8}), "window_size=8"),
    ("gated_deltanet hybrid", dict(attn={"layers": [1], "num_heads": 2}), r"\[2, 4\] query heads"),
    ("mesa_net default", dict(lambda_lower_bound=0.5), "lambda_lower_bound=0.5"),
    ("comba default", dict(model_type="rwkv7"), "model_type 'rwkv7' is not converted"),
    ("retnet default", dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_fla_options_without_a_counterpart_raise(case, changes, match):
    config, sd = _fla(case, **changes)
    with pytest.raises(ConversionError, match=match):
        fla.from_fla(config, sd)


def test_fla_weights_missing_or_extra_raise():
    config, sd = _fla("comba default")
    extra = {**sd, "model.layers.0.attn.extra.weight": torch.zeros(1)}
    with pytest.raises(ConversionError, match="no counterpart: \\['model.layers.0.attn.extra.weight'\\]"):
        fla.from_fla(config, extra)
    sd.pop("model.layers.1.attn.D")
    with pytest.raises(ConversionError, match="model.layers.1.attn.D is missing"):
        fla.from_fla(config, sd)
    config, sd = _fla("comba default")
    sd["model.layers.0.attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ConversionError, match="q_proj.weight: the converted weight has shape \\[3, 3\\]"):
        fla.from_fla(config, sd)


@pytest.mark.parametrize("fields,match", [
    (dict(mixer="titans", num_heads=2, head_dim=8), "'titans' has no fla model"),
    (dict(mixer=("gated_deltanet", "kda"), num_heads=2, head_dim=8), "different linear-attention layers"),
    (dict(mixer=("gated_deltanet", "fox"), num_heads=2, head_dim=8), "plain softmax attention"),
    (dict(mixer="gated_deltanet", num_heads=2, head_dim=8, mlp="none"), "SwiGLU MLP"),
    (dict(mixer="gated_deltanet", num_heads=2, head_dim=8, mixer_overrides={"qk_norm": "rms"}),
     "qk_norm='rms' \\(fla: 'l2'\\)"),
    (dict(mixer="mamba2", num_heads=2, head_dim=8, num_v_heads=4, mlp="none"), "n_groups"),
    (dict(mixer="softmax_attention", num_heads=2, head_dim=16), "every layer is softmax attention"),
])
def test_models_without_an_fla_counterpart_raise(fields, match):
    lm = random_lm(fields)
    with pytest.raises(ConversionError, match=match):
        fla.to_fla(lm.config, lm.state_dict())


def test_every_fla_model_type_is_covered():
    """The round trips and the recorded layouts cover every model type the converter takes."""
    covered = {fla.to_fla(random_lm(f).config, random_lm(f).state_dict())[0]["model_type"] for f in MODELS.values()}
    assert covered == set(fla.FLA_MODEL_TYPES)
    assert {case.split(" ")[0] for case in LAYOUTS} == set(fla.FLA_MODEL_TYPES)
    assert fw.zoo.resolve("deltaproduct").optimizer.householder_steps == 2  # the zoo's n_h the default maps to


def _fla_dir(d, case="kda gva"):
    from safetensors.torch import save_file

    config, sd = _fla(case)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file(sd, str(d / "model.safetensors"))
    return sd


@pytest.mark.parametrize("damage, message", [
    ("truncated safetensors", "{d}/model.safetensors: a corrupt or truncated safetensors file"),
    ("corrupt bin", "{d}/pytorch_model.bin: a corrupt or truncated PyTorch weights file"),
    ("index without weight_map", "{d}/model.safetensors.index.json: no 'weight_map' (expected {{tensor name: shard "
                                 "file}})"),
    ("index naming a missing shard", "{d}/model.safetensors.index.json: names the shard b.safetensors, which is not "
                                     "in {d}"),
    ("index naming a shard outside", "{d}/model.safetensors.index.json: names the shard '../outside.safetensors', "
                                     "which is not a file name in {d}"),
    ("config not JSON", "{d}/config.json: not JSON"),
])
def test_cli_names_the_damaged_file_of_a_source(damage, message, tmp_path, capsys):
    """A damaged fla checkpoint: one line naming the file, status 2, nothing written."""
    from safetensors.torch import save_file

    d = tmp_path / "fla"
    sd = _fla_dir(d)
    w = d / "model.safetensors"
    if damage == "truncated safetensors":
        w.write_bytes(w.read_bytes()[:-7])
    elif damage == "corrupt bin":
        w.unlink()
        torch.save(sd, d / "pytorch_model.bin")
        (d / "pytorch_model.bin").write_bytes((d / "pytorch_model.bin").read_bytes()[:200])
    elif damage == "index naming a shard outside":  # a complete checkpoint, but outside the directory: not read
        w.rename(tmp_path / "outside.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: "../outside.safetensors" for k in sd}}))
    elif damage.startswith("index"):
        w.rename(d / "a.safetensors")
        index = {"metadata": {}} if damage == "index without weight_map" else {
            "weight_map": {k: ("a" if i % 2 else "b") + ".safetensors" for i, k in enumerate(sorted(sd))}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        save_file({}, str(d / "unused.safetensors"))
    else:
        (d / "config.json").write_text('{"model_type": "kda",')
    assert main(["convert", "from-fla", str(d), str(tmp_path / "fw")]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + message.format(d=d)) and "Traceback" not in cap.err, err
    assert not (tmp_path / "fw" / "config.json").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(num_hidden_layers=None), "fla kda config: num_hidden_layers=None, expected a number"),
    (dict(num_hidden_layers=1.5), "fla kda config: num_hidden_layers=1.5, expected a positive integer"),
    (dict(vocab_size=None), "fla kda config: vocab_size=None, expected a positive integer"),
    (dict(num_heads="2"), "fla kda config: num_heads='2', expected a number"),
    (dict(use_short_conv="yes"), "fla kda config: use_short_conv='yes', expected true or false"),
    (dict(attn={"layers": "0"}), "fla kda: attn must be {'layers': [layer indices]"),
    (dict(attn={"layers": [0]}), "fla kda: attn's num_heads=None, expected a positive integer"),
])
def test_cli_names_config_fields_of_the_wrong_type(changes, message, tmp_path, capsys):
    """A config.json field of the wrong JSON type (null layers, a string for a number or a bool, a malformed attn):
    one line naming config.json and the field, status 2 (was a raw TypeError from deep in the converter)."""
    d = tmp_path / "fla"
    _fla_dir(d)
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **changes}))
    assert main(["convert", "from-fla", str(d), str(tmp_path / "fw")]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {d}/config.json: {message}"), err
    assert "Traceback" not in cap.err and not (tmp_path / "fw" / "config.json").exists()


def test_cli_names_integer_weights(tmp_path, capsys):
    """Integer weights (a damaged or quantised file): one line naming the weight (was torch's raw load_state_dict
    RuntimeError, status 1)."""
    from safetensors.torch import save_file

    d = tmp_path / "fla"
    sd = _fla_dir(d)
    save_file({k: v.to(torch.int32) for k, v in sd.items()}, str(d / "model.safetensors"))
    assert main(["convert", "from-fla", str(d), str(tmp_path / "fw")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("is torch.int32, expected a floating dtype"), err


@pytest.mark.parametrize("direction", ["from-fla", "to-fla"])
def test_cli_refuses_an_empty_src_or_dst(direction, tmp_path, capsys, monkeypatch):
    """DST '' converted into the current directory (exit 0), writing config.json and model.safetensors there."""
    src = tmp_path / "src"
    if direction == "from-fla":
        _fla_dir(src)
    else:
        random_lm(MODELS["gla"]).save_pretrained(src)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for argv, flag in (([str(src), ""], "DST"), (["  ", "out"], "SRC")):
        assert main(["convert", direction, *argv]) == 2
        cap = capsys.readouterr()
        assert cap.err.strip().splitlines() == [f"error: {flag} is empty; expected a checkpoint directory"], cap.err
    assert not list((tmp_path / "cwd").iterdir())


@pytest.mark.parametrize("direction", ["from-fla", "to-fla"])
def test_cli_never_writes_over_its_source(direction, tmp_path, capsys):
    d = tmp_path / "src"
    if direction == "from-fla":
        _fla_dir(d)
    else:
        random_lm(MODELS["gla"]).save_pretrained(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for dst in (d, tmp_path / "." / "src"):
        assert main(["convert", direction, str(d), str(dst), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: DST {dst}: is SRC {d}; the conversion would write over its source, give another "
                       "directory"], err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_help_keeps_the_commands_on_their_own_lines(capsys):
    """`fastweights convert --help` reflowed the module doc's table of commands into one paragraph."""
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for direction in ("from-fla SRC DST", "to-fla SRC DST", "to-transformers SRC DST"):
        assert any(ln.strip().startswith(f"fastweights convert {direction}") for ln in lines), direction
