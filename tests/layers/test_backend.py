"""A layer's backend: resolved once when it is built, shown in its repr, recorded in checkpoints,
never switched at run time; grouped value heads reach the op un-expanded."""

from __future__ import annotations

import json

import pytest
import torch

from fastweights import dispatch
from fastweights.dispatch import DISPATCH
from fastweights.layers import MemoryMixer
from fastweights.layers.mixer import MixerError
from fastweights.models import LM, LMConfig


def _spy_row(monkeypatch, key, record, *, delegate=True):
    row = DISPATCH[key] if key in DISPATCH else None

    def fn(call, **kw):
        record.append(call)
        return row.fn(call, **kw) if delegate else (_ for _ in ()).throw(AssertionError(f"{key} must not run"))

    monkeypatch.setitem(DISPATCH, key, dispatch.Impl(*key, fn))


def test_backend_is_resolved_at_construction_and_shown():
    layer = MemoryMixer(32, "gated_deltanet", 2)
    assert layer.backend == "torch" and layer.backends == {"recurrent": "torch", "parallel": "torch",
                                                           "chunk": "torch"}
    assert "backend=torch" in repr(layer)
    assert MemoryMixer(32, "gated_deltanet", 2, backend="compile").backend == "compile"
    with pytest.raises(MixerError, match="backends that can: auto, torch"):
        MemoryMixer(32, "mesanet", 2, backend="compile")
    with pytest.raises(MixerError, match="backend must be 'auto' or a backend name"):
        MemoryMixer(32, "gla", 2, backend=3)


def test_a_built_layer_never_switches(monkeypatch):
    """A backend registered after the layer was built (and preferred by "auto") is not used by it;
    a layer built afterwards picks it."""
    layer = MemoryMixer(32, "gated_deltanet", 2)
    x = torch.randn(1, 9, 32)
    y0, _ = layer(x)
    calls = []
    monkeypatch.setattr(dispatch, "AUTO_ORDER", ("triton", "torch"))
    monkeypatch.setitem(DISPATCH, ("delta", "chunk", "triton"),
                        dispatch.Impl("delta", "chunk", "triton", lambda call, **kw: calls.append(call)))
    y1, _ = layer(x)
    assert not calls and torch.equal(y0, y1)
    assert MemoryMixer(32, "gated_deltanet", 2).backend == "triton"


def test_grouped_value_heads_reach_the_op_unexpanded(monkeypatch):
    seen = []
    _spy_row(monkeypatch, ("delta", "chunk", "torch"), seen)
    layer = MemoryMixer(32, "gated_deltanet", 2, num_v_heads=4)
    layer(torch.randn(2, 7, 32))
    call = seen[0]
    assert call.q.shape[2] == 2 and call.k.shape[2] == 2 and call.v.shape[2] == 4


def test_checkpoints_record_the_resolved_backends(tmp_path):
    cfg = LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer=("gated_deltanet", "softmax_attention"),
                   num_heads=2)
    lm = LM(cfg)
    assert lm.backends == ("torch", "torch") and lm.config.backend == "auto"
    lm.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["backends"] == ["torch", "torch"]
    doc["backends"] = ["compile", "torch"]  # what a machine with another backend would have recorded
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert LM.from_pretrained(tmp_path).backends == ("compile", "torch")
    del doc["backends"]  # written before backends were recorded: they ran the torch backend
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert LM.from_pretrained(tmp_path).backends == ("torch", "torch")
    per_layer = LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer="gated_deltanet", num_heads=2,
                         backend=("compile", "torch"))
    assert LM(per_layer).backends == ("compile", "torch")
    assert LMConfig.from_dict(json.loads(json.dumps(per_layer.to_dict()))) == per_layer
