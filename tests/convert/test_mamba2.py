"""Whole Mamba2 checkpoints of transformers' own `Mamba2ForCausalLM` ↔ fastweights LMs: transformers'
config fields are read by their names and defaults (not fla's, whose layout shares model_type and
weight names), what fastweights cannot compute is refused naming transformers' field, every field of
both Mamba2 layouts is accounted for, and `fastweights convert to-transformers` writes a checkpoint
transformers loads and runs to the same logits."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, PretrainedConfig

from fastweights.cli import main
from fastweights.convert import ConversionError, fla
from fastweights.convert.mamba2 import MAMBA2_FIELDS, TRANSFORMERS_MAMBA2_DEFAULTS, mamba2_layout
from fastweights.models import LM, LMConfig
from tests.tolerances import CONVERT_MAMBA2_LM_REL

VOCAB = 40
LAYOUTS = json.loads((Path(__file__).parent / "data" / "fla_layouts.json").read_text())
# the keys every transformers config.json may carry whatever the model (written by save_pretrained)
GENERIC = {"architectures", "dtype", "model_type", "transformers_version"}


def tiny_config(**kw) -> Mamba2Config:
    """d 32, 8 heads of 8 (expand 2), state 6, n_groups 1 (what converts), 2 layers."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=6, expand=2, n_groups=1,
                  num_hidden_layers=2, chunk_size=16)
    return Mamba2Config(**{**fields, **kw})


def random_mamba2(**kw) -> Mamba2ForCausalLM:
    """A transformers Mamba2ForCausalLM with every weight redrawn (A = exp(A_log) in (0.4, 2.7)), float64."""
    model = Mamba2ForCausalLM(tiny_config(**kw)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-1.0, 1.0) if name.endswith("A_log") else p.normal_(0.0, 0.3)
    return model


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("kw,extra", [
    (dict(layer_norm_epsilon=1e-2), {}),  # transformers' name for the eps of every norm (fla's: norm_eps)
    (dict(tie_word_embeddings=True, use_conv_bias=False, conv_kernel=3), {}),
    (dict(), {"norm_before_gate": True}),  # a key transformers' Mamba2 never reads: it gates first
])
def test_a_transformers_mamba2_checkpoint_converts_to_the_same_logits(tmp_path, capsys, kw, extra):
    """transformers' Mamba2 computes its norms and scan in fp32 and returns fp32 logits (whatever the
    model's dtype): the converted float64 LM agrees to that rounding; a field read wrongly (the eps
    before it was read by transformers' name) is off by O(1). `extra`: keys added to its config.json."""
    model = random_mamba2(**kw)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    assert main(["convert", "from-fla", str(tmp_path / "hf"), str(tmp_path / "fw")]) == 0
    out = capsys.readouterr().out
    assert "converted the transformers Mamba2 checkpoint" in out and "2 layers (2 mamba2)" in out
    lm = LM.from_pretrained(tmp_path / "fw").double().eval()
    assert lm.config.norm_eps == model.config.layer_norm_epsilon
    assert lm.config.tie_word_embeddings == model.config.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        assert rel_err(lm(ids), model(ids).logits) < CONVERT_MAMBA2_LM_REL


def _hf_config(**changes) -> dict:
    """A transformers Mamba2 config.json (as save_pretrained writes it) with `changes` (None: key removed)."""
    c = json.loads(tiny_config().to_json_string())
    c.update(changes)
    return {k: v for k, v in c.items() if v is not None}


def _weights() -> dict:
    return {k: torch.randn(v.shape) for k, v in Mamba2ForCausalLM(tiny_config()).state_dict().items()}


@pytest.mark.parametrize("changes,match", [
    (dict(time_step_limit=[0.0, 1.0]), r"transformers' Mamba2Config: time_step_limit=\(0.0, 1.0\) clamps dt"),
    (dict(n_groups=None), "transformers' Mamba2Config: n_groups=8"),  # absent: transformers' default, not fla's 1
    (dict(n_groups=2), "n_groups=2"),
    (dict(use_bias=True), "use_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_heads=4), r"transformers' Mamba2Config: num_heads=4 but expand·hidden_size / head_dim = 8 heads"),
    (dict(dt_limit=[0.0, 1.0]), r"fields of fla's Mamba2Config \(dt_limit\) and of transformers' "
                                r"\(layer_norm_epsilon, time_step_limit"),
])
def test_transformers_mamba2_fields_without_a_counterpart_are_refused_by_name(changes, match):
    with pytest.raises(ConversionError, match=match):
        fla.from_fla(_hf_config(**changes), _weights())


@pytest.mark.parametrize("changes,match", [
    (dict(expand="2"), r"^transformers' Mamba2Config: expand='2', expected a number$"),  # was a raw TypeError
    (dict(n_groups="1"), r"^transformers' Mamba2Config: n_groups='1', expected a number$"),
    (dict(time_step_limit="x"), r"^transformers' Mamba2Config: time_step_limit='x', expected a list$"),
    (dict(time_step_limit=[0.0, "x"]), r"^time_step_limit holds 'x', expected a number$"),  # was float()'s ValueError
])
def test_transformers_mamba2_fields_of_the_wrong_type_are_named(changes, match):
    with pytest.raises(ConversionError, match=match):
        fla.from_fla(_hf_config(**changes), _weights())


def test_a_mamba2_config_of_neither_layout_is_refused():
    c = {k: v for k, v in _hf_config().items() if k in ("model_type", "vocab_size", "hidden_size", "head_dim",
                                                        "state_size", "expand", "num_hidden_layers")}
    with pytest.raises(ConversionError, match="cannot tell whose defaults apply"):
        fla.from_fla(c, _weights())
    assert mamba2_layout(LAYOUTS["mamba2 default"]["config"]) == "fla"
    assert mamba2_layout(_hf_config()) == "transformers"


def test_every_mamba2_config_field_is_carried_refused_or_without_effect():
    """Each field of transformers' Mamba2Config (the installed release) and of fla's (its recorded
    config.json) is in MAMBA2_FIELDS; the defaults written out are transformers' own."""
    generic = set(PretrainedConfig().to_dict()) | GENERIC
    ours = {f.name for f in dataclasses.fields(Mamba2Config)} - {f.name for f in dataclasses.fields(PretrainedConfig)}
    theirs_fla = set(LAYOUTS["mamba2 default"]["config"]) - GENERIC
    assert ours, "transformers' Mamba2Config declares its fields as dataclass fields"
    assert not (ours - set(MAMBA2_FIELDS)), sorted(ours - set(MAMBA2_FIELDS))
    assert not (theirs_fla - set(MAMBA2_FIELDS) - generic), sorted(theirs_fla - set(MAMBA2_FIELDS) - generic)
    assert set(MAMBA2_FIELDS.values()) == {"carried", "checked", "refused", "no effect"}
    default = Mamba2Config()
    for key, value in TRANSFORMERS_MAMBA2_DEFAULTS.items():
        have = tuple(getattr(default, key)) if key == "time_step_limit" else getattr(default, key)
        assert have == value, key
    assert math.isinf(default.time_step_limit[1])


def random_lm(**kw) -> LM:
    cfg = LMConfig(**{**dict(vocab_size=VOCAB, d_model=32, n_layers=2, mixer="mamba2", num_heads=1, head_dim=6,
                             head_v_dim=8, num_v_heads=8, mlp="none", tie_word_embeddings=False, norm_eps=1e-3),
                      **kw})
    lm = LM(cfg)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return lm.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_to_transformers_writes_a_checkpoint_transformers_loads_and_runs(tmp_path, capsys, tied):
    lm = random_lm(tie_word_embeddings=tied).double()
    lm.save_pretrained(tmp_path / "fw")
    assert main(["convert", "to-transformers", str(tmp_path / "fw"), str(tmp_path / "hf")]) == 0
    assert "transformers Mamba2ForCausalLM" in capsys.readouterr().out
    model = Mamba2ForCausalLM.from_pretrained(tmp_path / "hf").eval()  # transformers alone
    assert model.dtype == torch.float64 and model.config.layer_norm_epsilon == 1e-3
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        want = lm(ids)
        assert rel_err(model(ids).logits, want) < CONVERT_MAMBA2_LM_REL
    # and back: the same LM, bit for bit
    assert main(["convert", "from-fla", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    with torch.no_grad():
        assert torch.equal(LM.from_pretrained(tmp_path / "back").eval()(ids), want)


@pytest.mark.parametrize("kw,match", [
    (dict(mixer_overrides={"norm_before_gate": True}), "norm_before_gate=True"),
    (dict(mixer="gated_deltanet", num_heads=2, head_dim=8, head_v_dim=None, num_v_heads=None, mlp="swiglu"),
     "Mamba2 LMs only"),
])
def test_to_transformers_refuses_what_transformers_mamba2_cannot_compute(tmp_path, capsys, kw, match):
    random_lm(**kw).save_pretrained(tmp_path / "fw")
    assert main(["convert", "to-transformers", str(tmp_path / "fw"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1
