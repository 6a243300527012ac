"""save_pretrained / from_pretrained: exact round trip for every zoo model and a custom recipe
(weights, config, logits, dtype), and a clear CheckpointError for missing or corrupt files."""

import json
import re

import pytest
import torch

import fastweights as fw
from fastweights.models import LM, CheckpointError, LMConfig
from tests.models.test_lm import VOCAB, tiny_config


def assert_same(a: LM, b: LM):
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ids = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(a(ids), b(ids))


@pytest.mark.parametrize("name", fw.zoo.names())
def test_round_trip_every_zoo_model(name, tmp_path):
    model = LM(tiny_config(name))
    model.save_pretrained(tmp_path / "ckpt")
    written = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert written == ["config.json", "fastweights_auto.py", "model.safetensors"]  # (the file auto_map names)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["config"]["mixer"] == name
    assert_same(model, LM.from_pretrained(tmp_path / "ckpt"))


def test_round_trip_custom_recipe_hybrid_and_dtype(tmp_path):
    novel = fw.Recipe(name="novel", objective=fw.Objective(kind="l2"), retention=fw.Retention(kind="diagonal"))
    cfg = LMConfig(vocab_size=VOCAB, d_model=16, n_layers=2, num_heads=2, head_dim=8,
                   mixer=(novel, "path_attention"), num_kv_heads=1)
    model = LM(cfg).to(torch.float64)
    model.save_pretrained(str(tmp_path))
    back = LM.from_pretrained(str(tmp_path))
    assert back.embed.weight.dtype == torch.float64
    assert back.config.mixer[0] == novel
    assert_same(model, back)


def test_untied_head_is_its_own_weight_and_round_trips(tmp_path):
    model = LM(tiny_config("gated_deltanet", tie_word_embeddings=False))
    assert model.lm_head is not None and "lm_head.weight" in model.state_dict()
    assert LM(tiny_config("gated_deltanet")).lm_head is None  # tied by default: no head of its own
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        model.lm_head.weight.normal_()
        h = model.norm(model.hidden(ids))
        torch.testing.assert_close(model(ids), h @ model.lm_head.weight.T)  # the head, not the embedding
        assert not torch.allclose(model(ids), h @ model.embed.weight.T)
    model.save_pretrained(tmp_path)
    back = LM.from_pretrained(tmp_path)
    assert back.config.tie_word_embeddings is False
    assert_same(model, back)


def test_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        LM.from_pretrained(tmp_path / "nothing")
    model = LM(tiny_config("gated_deltanet"))
    model.save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    config = (tmp_path / "config.json").read_text()

    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        LM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        LM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        LM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(weights)

    (tmp_path / "config.json").write_text(config[:-20])
    with pytest.raises(CheckpointError, match="config.json: corrupt JSON"):
        LM.from_pretrained(tmp_path)
    doc = json.loads(config)
    doc["config"]["d_model"] = 0
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="LMConfig.d_model"):
        LM.from_pretrained(tmp_path)
    doc = json.loads(config)
    doc["config"]["d_model"] = 32
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="has shape"):
        LM.from_pretrained(tmp_path)
    doc = json.loads(config)
    doc["config"]["n_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="missing"):
        LM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(CheckpointError, match="not a fastweights LM config"):
        LM.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        LM.from_pretrained(tmp_path)
    assert issubclass(CheckpointError, OSError)


@pytest.mark.parametrize("device, message", [
    ("cuda", "device='cuda': CUDA is not available on this machine"),
    ("cuda:3", "device='cuda:3': CUDA is not available on this machine"),
    ("gpu", "device='gpu' is not a device"),
    ("mps", "device='mps': this torch build sees no mps device"),  # (was torch's raw RuntimeError)
])
def test_a_device_this_machine_lacks_is_an_input_error_naming_it(device, message, tmp_path, monkeypatch):
    """(It was torch's raw 'Torch not compiled with CUDA enabled' after reading the files.)"""
    from fastweights.inputs import InputError

    LM(tiny_config("gated_deltanet")).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (the same answer on a GPU machine)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(")):
        LM.from_pretrained(tmp_path, device=device)
    assert {p.device.type for p in LM.from_pretrained(tmp_path, device="cpu").parameters()} == {"cpu"}


def test_save_pretrained_onto_a_file_or_an_empty_name_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """save_pretrained('a_file') raised Python's FileExistsError from mkdir; '' wrote into the current directory."""
    lm = LM(tiny_config("gated_deltanet"))
    (tmp_path / "a_file").write_text("notes")
    with pytest.raises(CheckpointError, match="^save_pretrained: .*a_file is a file; expected a directory"):
        lm.save_pretrained(tmp_path / "a_file")
    assert (tmp_path / "a_file").read_text() == "notes"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^save_pretrained: the directory is empty \(''\)"):
        lm.save_pretrained("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    lm.save_pretrained(".")  # the current directory, said so
    assert (tmp_path / "config.json").is_file()


def test_a_bad_backend_or_an_empty_directory_is_named_as_the_argument(tmp_path, monkeypatch):
    """backend='bogus' was blamed on config.json ('fw/config.json: unknown backend'), backend=3 read as a
    damaged 'backends' list of the file; '' was the current directory."""
    from fastweights.inputs import InputError

    LM(tiny_config("gated_deltanet")).save_pretrained(tmp_path / "m")
    for backend in ("bogus", 3, ["torch"]):
        with pytest.raises(InputError, match=r"^backend must be None, 'auto' or one of \['compile', 'torch', "
                                             rf"'triton'\], got {re.escape(repr(backend))}$"):
            LM.from_pretrained(tmp_path / "m", backend=backend)
    assert set(LM.from_pretrained(tmp_path / "m", backend="torch").backends) == {"torch"}
    LM(tiny_config("gated_deltanet")).save_pretrained(tmp_path / "cwd")  # a checkpoint in the current directory
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(CheckpointError, match=r"^the checkpoint directory is empty \(''\)"):
        LM.from_pretrained("")
