"""A layer's backend: the *requested* one ("auto" or a name) is stored, shown in its repr and
recorded in checkpoints; every call is routed afresh from what it is (THE RULE of
`fastweights.dispatch`), and `repr` shows what each form and layer op last ran on which device;
an explicit backend that cannot serve the call raises there, naming those that can; grouped value
heads reach the op un-expanded."""

from __future__ import annotations

import json

import pytest
import torch

import fastweights as fw
from fastweights import dispatch
from fastweights.dispatch import DISPATCH
from fastweights.layers import MemoryMixer
from fastweights.layers.mixer import MixerError
from fastweights.models import LM, LMConfig
from tests.fake_cuda import FakeCuda


def _spy_row(monkeypatch, key, record, *, delegate=True):
    row = DISPATCH[key] if key in DISPATCH else None

    def fn(call, **kw):
        record.append(call)
        return row.fn(call, **kw) if delegate else (_ for _ in ()).throw(AssertionError(f"{key} must not run"))

    monkeypatch.setitem(DISPATCH, key, dispatch.Impl(*key, fn))


def test_the_requested_backend_is_stored_and_the_routes_shown():
    layer = MemoryMixer(32, "gated_deltanet", 2)
    assert layer.backend == "auto" and layer.layer_ops == "auto"
    assert layer.backends == {"recurrent": "auto", "parallel": "auto", "chunk": "auto"}
    assert repr(layer).count("backend=auto") >= 1 and "→" not in repr(layer)  # nothing has run yet
    y, st = layer(torch.randn(1, 5, 32), output_state=True)
    layer.step(torch.randn(1, 1, 32), st)
    assert layer.routes == {"prologue": ("torch", "cpu"), "chunk": ("torch", "cpu"), "recurrent": ("torch", "cpu")}
    assert "backend=auto → prologue: torch on cpu, chunk: torch on cpu, recurrent: torch on cpu" in repr(layer)
    assert "backend=auto → conv: torch on cpu" in repr(layer.q_conv)
    assert "backend=auto → norm: torch on cpu" in repr(layer.o_norm)
    compiled = MemoryMixer(32, "gated_deltanet", 2, backend="compile", layer_ops="torch")
    assert compiled.backends["chunk"] == "compile" and compiled.backends["recurrent"] == "auto"
    assert "layer_ops=torch" in repr(compiled) and compiled.q_conv.backend == compiled.o_norm.backend == "torch"
    with pytest.raises(MixerError, match="backend='compile' serves .* no chunk form for mesanet .*; "
                       "backends with a row: auto, torch"):
        MemoryMixer(32, "mesanet", 2, backend="compile")
    with pytest.raises(MixerError, match="unknown backend 'trition'"):
        MemoryMixer(32, "gla", 2, backend="trition")
    with pytest.raises(MixerError, match="^layer_ops: backend='compile' serves .*; it has no conv layer op"):
        MemoryMixer(32, "gla", 2, layer_ops="compile")
    with pytest.raises(MixerError, match="^layer_ops: unknown backend 'bogus'"):  # (the argument was not named)
        MemoryMixer(32, "gla", 2, layer_ops="bogus")
    with pytest.raises(MixerError, match="backend must be 'auto' or a backend name"):
        MemoryMixer(32, "gla", 2, backend=3)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_explicit_backend_is_checked_at_the_call_not_at_the_build(device):
    """backend="triton" builds anywhere (on meta too, as transformers builds); a call on the CPU
    raises BackendNotAvailable naming the backends that can — it never switches silently."""
    with torch.device(device):
        layer = MemoryMixer(32, "gated_deltanet", 2, backend="triton", layer_ops="triton")
    layer = layer.to_empty(device="cpu") if device == "meta" else layer
    x = torch.randn(1, 5, 32)
    with pytest.raises(fw.BackendNotAvailable, match="backend 'triton' cannot serve the conv layer op: the Triton "
                       "kernels run on CUDA devices, not cpu; backends that can: auto, torch"):
        layer(x)
    layer = MemoryMixer(32, "gated_deltanet", 2, backend="triton")
    with pytest.raises(fw.BackendNotAvailable, match="backend 'triton' cannot serve the chunk form of "
                       "gated_deltanet: .*not cpu; backends that can: auto, torch, compile"):
        layer(x)


def test_a_built_layer_routes_every_call_afresh(monkeypatch):
    """A layer built before a GPU (here: the fake one) could serve it takes the GPU rows from its next
    call on — each form and each layer op, exactly the rows of a layer built afterwards."""
    layer = MemoryMixer(32, "gated_deltanet", 2)
    x = torch.randn(1, 9, 32)
    layer(x)
    assert layer.routes["chunk"] == ("torch", "cpu")
    fake = FakeCuda(monkeypatch).install()

    def run(mixer):
        fake.take()
        _, st = mixer(x, output_state=True)
        mixer.step(x[:, :1], st)
        return fake.take()

    got = run(layer)
    assert got == run(MemoryMixer(32, "gated_deltanet", 2))
    assert {("delta", "chunk", "triton"), ("delta", "recurrent", "triton"), ("layer", "conv", "triton"),
            ("layer", "norm", "triton"), ("layer", "prologue", "triton")} == set(got)
    assert layer.routes["chunk"] == ("triton", "cpu")
    # the Triton row's pipeline, from the call's facts (fp32: the staged kernels), in the record and in repr
    assert layer.pipelines["chunk"] == "staged forward, staged backward" and layer.pipelines["recurrent"] is None
    assert "chunk: triton (staged forward, staged backward) on cpu, recurrent: triton on cpu" in repr(layer)


def test_grouped_value_heads_reach_the_op_unexpanded(monkeypatch):
    seen = []
    _spy_row(monkeypatch, ("delta", "chunk", "torch"), seen)
    layer = MemoryMixer(32, "gated_deltanet", 2, num_v_heads=4)
    layer(torch.randn(2, 7, 32))
    call = seen[0]
    assert call.q.shape[2] == 2 and call.k.shape[2] == 2 and call.v.shape[2] == 4


def test_checkpoints_record_the_requested_backends(tmp_path):
    cfg = LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer=("gated_deltanet", "softmax_attention"),
                   num_heads=2)
    lm = LM(cfg)
    assert lm.backends == ("auto", "auto") and lm.config.backend == "auto"
    lm.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["backends"] == ["auto", "auto"]
    doc["backends"] = ["compile", "torch"]  # requested by name
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert LM.from_pretrained(tmp_path).backends == ("compile", "torch")
    assert LM.from_pretrained(tmp_path, backend="auto").backends == ("auto", "auto")
    per_layer = LMConfig(vocab_size=32, d_model=32, n_layers=2, mixer="gated_deltanet", num_heads=2,
                         backend=("compile", "torch"), layer_ops="torch")
    assert LM(per_layer).backends == ("compile", "torch")
    assert LMConfig.from_dict(json.loads(json.dumps(per_layer.to_dict()))) == per_layer
    assert LM(per_layer).norm.backend == "torch"
