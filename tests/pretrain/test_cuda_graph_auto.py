"""cuda_graph "auto" (the gpu-125m preset's): `resolve_cuda_graph` turns it on for one CUDA process without
grad_checkpoint or context parallelism and off elsewhere, in words, never refusing a run; an explicit True keeps every
refusal; `train` resolves it before its checks, prints the decision, keeps "auto" in config.json and the checkpoint
and re-decides on resume; --cuda-graph / --no-cuda-graph / a config file's true, false or "auto"."""

import dataclasses
import json

import pytest
import torch

from fastweights.cli import build_parser
from fastweights.pretrain import ConfigFileError, PretrainConfig, loop, train
from fastweights.pretrain.cli import config_from_args
from fastweights.pretrain.config import resolve_cuda_graph
from fastweights.training.distributed import DistInfo
from tests.pretrain.test_run_options import cfg_of, corpus, log

ON = "on (auto: one CUDA process; --no-cuda-graph turns it off)"
NOT_CUDA = "device cpu is not CUDA"
TWO = "2 processes under torchrun — DDP/FSDP hooks cannot be captured"
CKPT = "grad_checkpoint recomputes blocks in backward, which is not captured"
CP = "context_parallel 2 splits each sequence over processes"


def preset(**kw) -> PretrainConfig:
    return PretrainConfig.build({"preset": "gpu-125m", **kw})


# ------------------------------------------------------------------------------------------------- the resolver
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "cpu"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("grad_checkpoint", [None, False, True])
@pytest.mark.parametrize("context_parallel", [1, 2])
def test_auto_is_on_only_for_one_cuda_process_without_checkpointing_or_context_parallelism(
        device, world, grad_checkpoint, context_parallel):
    cfg = preset(device=device, grad_checkpoint=grad_checkpoint, context_parallel=context_parallel)
    assert cfg.cuda_graph == "auto"
    why = ([NOT_CUDA] if device == "cpu" else []) + ([TWO] if world == 2 else []) + \
        ([CKPT] if grad_checkpoint else []) + ([CP] if context_parallel == 2 else [])
    on, said = resolve_cuda_graph(cfg, world)
    assert (on, said) == ((True, ON) if not why else (False, f"off (auto: {'; '.join(why)})"))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_true_and_false_are_kept_as_asked(world, device):
    """The resolver decides "auto" alone: True stays True (its needs are refused elsewhere, as before), False False."""
    assert resolve_cuda_graph(preset(device=device, cuda_graph=True), world) == (
        True, "on (asked for: cuda_graph true / --cuda-graph)")
    assert resolve_cuda_graph(preset(device=device, cuda_graph=False), world) == (
        False, "off (not asked for: --cuda-graph turns it on)")


def test_the_defaults_stay_off_and_the_preset_is_auto():
    assert PretrainConfig().cuda_graph is False and PretrainConfig.build({}).cuda_graph is False  # (the cpu preset)
    assert preset().cuda_graph == "auto"
    assert preset(grad_checkpoint=True).grad_checkpoint and preset(context_parallel=2).context_parallel == 2


# ------------------------------------------------------------------------------------------------- the loop
@pytest.fixture
def until_the_run(monkeypatch):
    """train() up to the run itself in a simulated world of `world` processes on a CUDA device: (cfg, plan) as
    `_train` would receive them, after `_check_graph` and `_check_parallel` (the real ones)."""
    seen = {}

    def fake_train(cfg, out, device, prog, fresh, plan):
        seen.update(cfg=cfg, plan=plan)
        return {}

    def run(cfg, world):
        monkeypatch.setattr(loop, "_check_device", lambda cfg: None)  # (this machine's CUDA; the device is "cuda")
        monkeypatch.setattr(loop, "launch_world_size", lambda: world)
        monkeypatch.setattr(loop, "dist_info", lambda: DistInfo(0, world, 0))
        monkeypatch.setattr(loop, "_train", fake_train)
        seen.clear()
        train(cfg)
        return seen["cfg"], seen["plan"]

    return run


def test_the_preset_under_torchrun_runs_eagerly_instead_of_refusing(tmp_path, until_the_run):
    """The FSDP-under-torchrun lesson: the preset with 2 processes (DDP or FSDP) reaches the run, graph off, saying why;
    with one process it is on."""
    for parallel in ("ddp", "fsdp"):
        cfg, plan = until_the_run(preset(data=[str(corpus(tmp_path))], out=str(tmp_path / "r"), parallel=parallel), 2)
        assert cfg.cuda_graph is False and plan.asked == "auto" and plan.why == f"off (auto: {TWO})"
    cfg, plan = until_the_run(preset(data=[str(corpus(tmp_path))], out=str(tmp_path / "r")), 1)
    assert cfg.cuda_graph is True and plan.why == ON


def test_an_explicit_cuda_graph_under_torchrun_is_still_refused(tmp_path, until_the_run):
    with pytest.raises(ConfigFileError) as e:
        until_the_run(preset(data=[str(corpus(tmp_path))], out=str(tmp_path / "r"), cuda_graph=True), 2)
    assert str(e.value) == ("--cuda-graph runs one process (DDP's and FSDP's hooks communicate inside the step, "
                            "which the graph cannot capture); this run has 2: leave out --cuda-graph or torchrun")
    with pytest.raises(ConfigFileError, match=r"^--cuda-graph replays CUDA work: it needs --device cuda, got 'cpu'$"):
        train(preset(data=[str(corpus(tmp_path))], out=str(tmp_path / "r"), cuda_graph=True, device="cpu"))
    with pytest.raises(ConfigFileError, match=r"cuda_graph \(--cuda-graph\) needs no grad_checkpoint"):
        preset(cuda_graph=True, grad_checkpoint=True)


def test_auto_on_a_cpu_trains_eagerly_and_says_so(tmp_path, capsys):
    """"auto" on the CPU: the plain loop, the decision in the log header, "auto" kept in config.json and the
    checkpoint, the summary saying what ran."""
    summary = train(cfg_of(tmp_path, cuda_graph="auto", progress="plain"))
    assert summary["cuda_graph"] is False
    assert f"cuda graph: off (auto: {NOT_CUDA})" in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["cuda_graph"] == "auto"
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["config"]["cuda_graph"] == "auto"


def test_a_plain_run_says_nothing_of_graphs(tmp_path, capsys):
    assert train(cfg_of(tmp_path, progress="plain"))["cuda_graph"] is False
    assert "cuda graph" not in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["cuda_graph"] is False


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The resolver as it decides for a CUDA device, and no CUDA device check: the CPU runs the graph's body (eager,
    as in test_run_options' graph tests); records the GraphedLMStep constructions."""
    from fastweights.training import graphed

    monkeypatch.setattr(loop, "_check_graph", lambda cfg: None)
    monkeypatch.setattr(loop, "resolve_cuda_graph",
                        lambda cfg, world: resolve_cuda_graph(dataclasses.replace(cfg, device="cuda"), world))
    made = []
    init = graphed.GraphedLMStep.__init__

    def spy(self, *a, **k):
        made.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(graphed.GraphedLMStep, "__init__", spy)
    return made


def test_auto_on_runs_the_graph_step_and_resumes_either_way(tmp_path, capsys, cpu_as_cuda):
    """"auto" deciding on: the graph's step, its steady skip, "auto" kept; the checkpoint resumes eagerly
    (--no-cuda-graph) and graphed again ("auto" re-decided)."""
    from fastweights.training.graphed import WARMUP

    steps = WARMUP + 2
    summary = train(cfg_of(tmp_path, cuda_graph="auto", steps=steps, save_every=steps, progress="plain"))
    assert summary["cuda_graph"] is True and cpu_as_cuda == [1]
    assert f"cuda graph: {ON}" in capsys.readouterr().out.splitlines()
    steady = [r["tokens_per_s_steady"] for r in log(tmp_path / "run") if "loss" in r]
    assert all(v is None for v in steady[:WARMUP + 1]) and steady[-1] is not None  # (the graph's skip)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["cuda_graph"] == "auto"
    assert train(cfg_of(tmp_path, cuda_graph=False, steps=steps + 1))["cuda_graph"] is False
    assert cpu_as_cuda == [1]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["cuda_graph"] is False
    assert train(cfg_of(tmp_path, cuda_graph="auto", steps=steps + 2))["cuda_graph"] is True
    assert cpu_as_cuda == [1, 1] and [r["step"] for r in log(tmp_path / "run") if "loss" in r][-1] == steps + 2


def test_auto_resuming_a_checkpointed_run_keeps_checkpointing_and_turns_the_graph_off(tmp_path, capsys, cpu_as_cuda):
    """A resume keeps the run's grad_checkpoint unless told otherwise; "auto" then decides off (not an error), and
    with --no-grad-checkpoint on again. An explicit True there is refused as before."""
    assert train(cfg_of(tmp_path, cuda_graph="auto", grad_checkpoint=True))["cuda_graph"] is False
    capsys.readouterr()
    assert train(cfg_of(tmp_path, cuda_graph="auto", steps=3, progress="plain"))["cuda_graph"] is False
    out = capsys.readouterr().out
    assert "cuda graph: off (auto: the run being resumed uses grad_checkpoint" in out and cpu_as_cuda == []
    assert json.loads((tmp_path / "run" / "config.json").read_text())["grad_checkpoint"] is True
    with pytest.raises(ConfigFileError, match=r"cuda_graph \(--cuda-graph\) needs no grad_checkpoint"):
        train(cfg_of(tmp_path, cuda_graph=True, steps=4))
    assert train(cfg_of(tmp_path, cuda_graph="auto", grad_checkpoint=False, steps=4))["cuda_graph"] is True
    assert cpu_as_cuda == [1]


def test_steady_skip_needs_a_resolved_setting(tmp_path):
    with pytest.raises(ValueError, match="resolve_cuda_graph"):
        loop.steady_skip(cfg_of(tmp_path, cuda_graph="auto"))


# ------------------------------------------------------------------------------------------------- flags and files
@pytest.mark.parametrize("argv, value", [([], "auto"), (["--cuda-graph"], True), (["--no-cuda-graph"], False)])
def test_the_flags_with_the_preset(argv, value):
    args = build_parser().parse_args(["train", "--preset", "gpu-125m", "--data", "x", *argv])
    assert config_from_args(args).cuda_graph == value
    plain = build_parser().parse_args(["train", "--data", "x", *argv])
    assert config_from_args(plain).cuda_graph == (False if value == "auto" else value)


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ('"auto"', "auto")])
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_config_files_value(text, value, suffix, tmp_path):
    f = tmp_path / f"c{suffix}"
    f.write_text(f'{{"cuda_graph": {text}}}' if suffix == ".json" else f"cuda_graph = {text}\n", encoding="utf-8")
    assert config_from_args(build_parser().parse_args(["train", "--config", str(f), "--data", "x"])).cuda_graph == value
    flagged = build_parser().parse_args(["train", "--config", str(f), "--data", "x", "--no-cuda-graph"])
    assert config_from_args(flagged).cuda_graph is False  # (a flag beats the file)


@pytest.mark.parametrize("bad", ['"yes"', '"Auto"', "1", "null", '["auto"]'])
def test_a_bad_value_names_the_field(bad, tmp_path, capsys):
    f = tmp_path / "c.json"
    f.write_text(f'{{"cuda_graph": {bad}}}', encoding="utf-8")
    with pytest.raises(ConfigFileError, match=r'^cuda_graph must be true, false or "auto", got '):
        config_from_args(build_parser().parse_args(["train", "--config", str(f), "--data", "x"]))
    assert build_parser().parse_args(["train", "--data", "x"]).cuda_graph is None
    from fastweights.cli import main as cli_main

    assert cli_main(["train", "--config", str(f), "--data", str(corpus(tmp_path)), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: cuda_graph must be true, false or "auto", got '), err


def test_auto_graphed_run_stopped_and_resumed_equals_the_eager_run(tmp_path, cpu_as_cuda, monkeypatch):
    """The preset's features under "auto" (on): packed documents, validation and checkpoints between replays, a stop
    mid-run and a resume that captures again — the losses, validation losses and weights of one uninterrupted eager
    run (the CPU runs the graph's body: the bookkeeping, not the capture; tests/cuda/test_train.py's twin captures)."""
    from fastweights.models import LM
    from fastweights.training.control import Interrupted
    from fastweights.training.graphed import WARMUP
    from tests.tolerances import GRAPH_RUN_F32_ATOL, GRAPH_RUN_F32_RTOL, GRAPH_RUN_LOSS_REL

    steps, stop = 2 * WARMUP + 6, WARMUP + 3
    kw = dict(steps=steps, grad_accum=2, val_every=3, save_every=4)
    assert train(cfg_of(tmp_path, "eager", cuda_graph=False, **kw))["cuda_graph"] is False
    calls = [0]

    def stop_at():  # (the boundary of step `stop`: saved there, Interrupted)
        calls[0] += 1
        return calls[0] > stop

    requested = loop.stop_requested
    monkeypatch.setattr(loop, "stop_requested", stop_at)
    with pytest.raises(Interrupted):
        train(cfg_of(tmp_path, "graph", cuda_graph="auto", **kw))
    monkeypatch.setattr(loop, "stop_requested", requested)
    assert torch.load(tmp_path / "graph" / "checkpoint.pt", weights_only=False)["step"] == stop
    assert train(cfg_of(tmp_path, "graph", cuda_graph="auto", **kw))["cuda_graph"] is True
    assert len(cpu_as_cuda) == 2
    a, b = LM.from_pretrained(tmp_path / "eager" / "model"), LM.from_pretrained(tmp_path / "graph" / "model")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=GRAPH_RUN_F32_RTOL, atol=GRAPH_RUN_F32_ATOL, msg=k)
    for key in ("loss", "val_loss"):
        la, lb = ([(r["step"], r[key]) for r in log(tmp_path / run) if key in r] for run in ("eager", "graph"))
        assert [s for s, _ in la] == [s for s, _ in lb] and len(la) >= (4 if key == "val_loss" else steps)
        assert [v for _, v in la] == pytest.approx([v for _, v in lb], rel=GRAPH_RUN_LOSS_REL), key


@pytest.mark.parametrize("argv, rc, says", [
    ([], 0, f"cuda graph: off (auto: {NOT_CUDA})"),
    (["--no-cuda-graph"], 0, None),
    (["--cuda-graph"], 2, "error: --cuda-graph replays CUDA work: it needs --device cuda, got 'cpu'"),
])
def test_the_preset_on_a_cpu_from_the_command_line(argv, rc, says, tmp_path, capsys):
    """`fastweights train --preset gpu-125m --device cpu` (shrunk): "auto" trains eagerly and says so; --no-cuda-graph
    says nothing; --cuda-graph is refused in one line, as before."""
    from fastweights.cli import main as cli_main

    small = ["--model", "d_model=16", "--model", "n_layers=1", "--model", "num_heads=2", "--model", "head_dim=8",
             "--model", "head_v_dim=8", "--steps", "1", "--batch-size", "2", "--grad-accum", "1", "--seq-len", "16",
             "--dtype", "float32", "--progress", "plain", "--threads", "1"]
    assert cli_main(["train", "--preset", "gpu-125m", "--device", "cpu", "--data", str(corpus(tmp_path)),
                     "--out", str(tmp_path / "r"), *small, *argv]) == rc
    cap = capsys.readouterr()
    if rc:
        assert cap.err.strip() == says
        return
    headers = [ln for ln in cap.out.splitlines() if ln.startswith("cuda graph:")]
    assert headers == ([says] if says else [])
    assert json.loads(cap.out.splitlines()[-1])["cuda_graph"] is False
    assert json.loads((tmp_path / "r" / "config.json").read_text())["cuda_graph"] == ("auto" if says else False)
