"""THE RULE at the model level: however an LM was made — built and then moved, built on meta,
loaded by `LM.from_pretrained`, loaded by transformers' `from_pretrained(...).to(...)`, or built
by `fastweights train` — its chunk form, its decoding step (recurrent form) and its layer ops
(conv, norm, prologue) take the rows a freshly built model takes for the same calls.

The GPU is faked (`tests/fake_cuda.py`): the Triton rows accept CPU calls and delegate to the torch
rows, recording which row ran. Installing the fake after a model is built or loaded stands for
"made where no GPU was, then moved to the GPU". Checkpoints store the requested backend: one saved
with backend="triton" loads on the CPU and raises only when called there; "auto" runs the torch
rows on the CPU. chunk_size=48 (which the Triton chunk kernels refuse) runs the torch chunk row
on the fake GPU."""

from __future__ import annotations

import json

import pytest
import torch

import fastweights as fw
from fastweights.models import LM, LMConfig
from tests.fake_cuda import FakeCuda

VOCAB = 64
CFG = dict(vocab_size=VOCAB, d_model=16, n_layers=2, mixer=("gated_deltanet", "softmax_attention"), num_heads=2,
           head_dim=8)
#: the rows a gated-DeltaNet layer takes on a GPU: the chunk form (prefill), the recurrent form (decoding
#: step), the short convs, the norms (gated output norm, the blocks' RMSNorms) and the prologue
ON_GPU = {("delta", "chunk", "triton"), ("delta", "recurrent", "triton"), ("layer", "conv", "triton"),
          ("layer", "norm", "triton"), ("layer", "prologue", "triton")}


def _routes(lm: LM, fake: FakeCuda) -> list[tuple[str, str, str]]:
    """The rows of a prefill of 9 tokens and one decoding step, in call order."""
    ids = torch.randint(0, VOCAB, (2, 9))
    fake.take()
    _, state = lm.prefill(ids)
    lm.step(ids[:, -1], state)
    return fake.take()


def _fresh(fake: FakeCuda, config: LMConfig) -> list[tuple[str, str, str]]:
    """What a model built on the (fake) GPU runs."""
    return _routes(LM(config), fake)


def _made(how: str, tmp_path, fake: FakeCuda) -> LM:
    config = LMConfig(**CFG)
    if how == "moved":  # LM(cfg).to("cuda"): built on the CPU, then moved
        lm = LM(config)
        fake.install()
        return lm.to("cpu")
    if how == "meta":  # built on meta (as transformers does), then materialized on the device
        fake.install()
        with torch.device("meta"):
            lm = LM(config)
        lm = lm.to_empty(device="cpu")
        lm.load_state_dict(LM(config).state_dict())
        return lm
    LM(config).save_pretrained(tmp_path)
    if how == "from_pretrained":
        lm = LM.from_pretrained(tmp_path)
        fake.install()
        return lm.to("cpu")
    from transformers import AutoModelForCausalLM

    import fastweights.hf  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    fake.install()
    return model.to("cpu").lm


@pytest.mark.parametrize("how", ["moved", "meta", "from_pretrained", "transformers"])
def test_every_way_of_making_an_lm_routes_as_a_fresh_one(how, tmp_path, monkeypatch):
    fake = FakeCuda(monkeypatch)
    lm = _made(how, tmp_path, fake)
    got = _routes(lm, fake)
    assert got == _fresh(fake, LMConfig(**CFG))
    assert ON_GPU <= set(got) and ("delta", "chunk", "torch") not in got, got
    assert lm.backends == ("auto", "auto")  # requested, never resolved
    assert ("backend=auto → prologue: triton on cpu, chunk: triton (staged forward, staged backward) on cpu, "
            "recurrent: triton on cpu") in repr(lm.blocks[0].mixer)  # (fp32: the staged pipeline)


def test_the_model_fastweights_train_builds(tmp_path, monkeypatch):
    """`fastweights train` builds the LM on the CPU and moves it to its device (`pretrain.loop`):
    its training steps take the rows a model built on the device takes."""
    from fastweights.pretrain import PretrainConfig, loop

    fake = FakeCuda(monkeypatch)

    class BuiltThenOnTheGpu(LM):  # what the loop builds; the (fake) GPU appears once it is built
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not fake.calls and not getattr(fake, "installed", False):
                fake.installed = True
                fake.install()

    monkeypatch.setattr(loop, "LM", BuiltThenOnTheGpu)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text("the cat sat on the mat. " * (1 + i % 3), encoding="utf-8")
    model = {**CFG, "mixer": list(CFG["mixer"])}
    del model["vocab_size"]
    cfg = PretrainConfig.build({"data": [str(text)], "out": str(tmp_path / "run"), "steps": 1, "batch_size": 2,
                                "seq_len": 16, "val_fraction": 0.2, "val_every": 1, "save_every": 1,
                                "progress": "none", "threads": 1, "model": model})
    loop.train(cfg)
    trained = set(fake.take())
    lm_config = LMConfig.from_dict(json.loads((tmp_path / "run" / "model" / "config.json").read_text())["config"])
    fresh = LM(lm_config)
    fresh(torch.randint(0, lm_config.vocab_size, (2, 16)))
    assert trained == set(fake.take())
    assert ON_GPU - {("delta", "recurrent", "triton")} <= trained, trained


def _checkpoint(tmp_path, backend) -> LM:
    lm = LM(LMConfig(**CFG, backend=backend))  # built on the CPU: a backend's name is all that is checked
    lm.save_pretrained(tmp_path)
    return lm


def test_a_checkpoint_saved_with_triton_loads_on_the_cpu_and_raises_only_when_called(tmp_path):
    from transformers import AutoModelForCausalLM

    import fastweights.hf  # noqa: F401

    _checkpoint(tmp_path, ("triton", "auto"))
    assert json.loads((tmp_path / "config.json").read_text())["backends"] == ["triton", "auto"]
    ids = torch.randint(0, VOCAB, (1, 5))
    for lm in (LM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path).lm):
        assert lm.backends == ("triton", "auto")
        with pytest.raises(fw.BackendNotAvailable, match=r"backend 'triton' cannot serve the chunk form of "
                           r"gated_deltanet: the Triton kernels run on CUDA devices, not cpu; backends that can: "
                           r"auto, torch, compile"):
            lm(ids)
    lm = LM.from_pretrained(tmp_path, backend="auto")  # the recorded request replaced
    lm(ids)
    assert lm.blocks[0].mixer.routes["chunk"] == ("torch", "cpu")


def test_an_auto_checkpoint_runs_the_torch_rows_on_the_cpu(tmp_path):
    _checkpoint(tmp_path, "auto")
    lm = LM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 5))
    _, state = lm.prefill(ids)
    lm.step(ids[:, -1], state)
    mixer = lm.blocks[0].mixer
    assert mixer.routes == {"prologue": ("torch", "cpu"), "chunk": ("torch", "cpu"), "recurrent": ("torch", "cpu")}
    assert mixer.q_conv.routes == {"conv": ("torch", "cpu")} and lm.norm.routes == {"norm": ("torch", "cpu")}


def test_an_old_checkpoint_with_resolved_names_requests_its_configs_backend(tmp_path, monkeypatch):
    """Checkpoints written while backends were fixed at build time have no "routing" key and recorded the
    resolved names ("torch" for every model built on a CPU): those names are not trusted as requests; the
    layers request the config's own backend ("auto" here), so the old CPU-built checkpoint runs the Triton
    rows on a GPU. A checkpoint of this version (routing "per-call") keeps an explicit "torch"."""
    _checkpoint(tmp_path, "auto")
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["routing"] == "per-call"
    fake = FakeCuda(monkeypatch).install()
    doc["backends"] = ["torch", "torch"]  # an explicit request, written by this version
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert ("delta", "chunk", "torch") in _routes(LM.from_pretrained(tmp_path), fake)
    del doc["routing"]  # the same names written by an older version: what "auto" resolved to on a CPU
    (tmp_path / "config.json").write_text(json.dumps(doc))
    for lm in (LM.from_pretrained(tmp_path), _hf_load(tmp_path)):
        assert lm.backends == ("auto", "auto")
        assert ("delta", "chunk", "triton") in _routes(lm, fake)
    del doc["backends"]  # written before backends were recorded: the config's request
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert LM.from_pretrained(tmp_path).backends == ("auto", "auto")


def _hf_load(path):
    from transformers import AutoModelForCausalLM

    import fastweights.hf  # noqa: F401

    return AutoModelForCausalLM.from_pretrained(path).lm


def test_chunk_size_48_runs_the_torch_chunk_row_on_the_gpu(monkeypatch):
    """The Triton chunk kernels take powers of two ≥ 16: "auto" routes chunk_size=48 to the torch row
    (the layer ops and the decoding step stay on Triton); an explicit "triton" raises, naming the
    backends that can."""
    fake = FakeCuda(monkeypatch).install()
    routes = _routes(LM(LMConfig(**CFG, chunk_size=48)), fake)
    assert ("delta", "chunk", "torch") in routes and ("delta", "chunk", "triton") not in routes
    assert ON_GPU - {("delta", "chunk", "triton")} <= set(routes)
    x = fw.example_inputs("gated_deltanet", seq_len=20)
    fake.take()
    fw.chunk("gated_deltanet", chunk_size=48, **x)
    fw.chunk("gated_deltanet", chunk_size=32, **x)
    assert fake.take() == [("delta", "chunk", "torch"), ("delta", "chunk", "triton")]
    with pytest.raises(fw.BackendNotAvailable, match="a chunk size that is a power of two ≥ 16, got 48; "
                       "backends that can: auto, torch, compile"):
        fw.chunk("gated_deltanet", chunk_size=48, backend="triton", **x)
