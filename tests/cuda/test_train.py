"""`fastweights train` on CUDA: one GPU, and two under torchrun (NCCL, whose collectives take no CPU
tensors): a run finishes, and a SIGTERM (one GPU) or a Ctrl-C to torchrun's process group (two
GPUs) saves at one step boundary, exits 130 on every rank, and the run resumes to its end.

Marked `cuda`: `python3 -m pytest -m cuda tests/cuda/test_train.py` on a GPU machine (the torchrun
test needs two GPUs: nvidia-h100-x2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 400
ARGS = ["--data", str(ROOT / "README.md"), "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "64",
        "--save-every", "1000", "--val-every", "1000", "--progress", "plain", "--device", "cuda", "--dtype", "bfloat16",
        "--model", "d_model=64", "--model", "n_layers=2", "--model", "num_heads=2", "--model", "head_dim=32"]
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from fastweights.cli import main
    out = sys.argv[1]
    rc = main(["train", *sys.argv[2:], "--out", f"{out}/run"])
    with open(f"{out}/rc-rank{dist.get_rank() if dist.is_initialized() else 0}", "w") as f:
        f.write(str(rc))
    sys.exit(rc)
    """
)


def _stop_when_past(proc, log: Path, step: int, send) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(x).get("step", 0) >= step for x in lines[:-1]):
            send()
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended or stalled before step {step}: {proc.communicate()[1][-3000:]}")


def _check_resumes(cmd, tmp_path, env, stopped):
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == stopped
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("world", [1, 2])
def test_a_stop_on_cuda_saves_at_one_step_on_every_rank_and_resumes(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices (nvidia-h100-x2)")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ([sys.executable, str(script)] if world == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(script)])
    cmd += [str(tmp_path), *ARGS]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    send = (lambda: proc.send_signal(signal.SIGTERM)) if world == 1 else (lambda: os.killpg(proc.pid, signal.SIGINT))
    _stop_when_past(proc, tmp_path / "run" / "log.jsonl", 20, send)
    out, err = proc.communicate(timeout=120)
    rcs = [(tmp_path / f"rc-rank{r}").read_text() if (tmp_path / f"rc-rank{r}").exists() else None
           for r in range(world)]
    assert rcs == ["130"] * world, (rcs, err[-4000:])
    stopped = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])["step"]
    assert 20 <= stopped < STEPS
    assert sum("interrupted at step" in ln for ln in (out + err).splitlines()) == 1, err[-3000:]
    _check_resumes(cmd, tmp_path, env, stopped)


def _spy_captures(monkeypatch, what) -> list:
    """Every `GraphedLMStep` capture of the test recorded as what(step), in the returned list."""
    from fastweights.training import graphed

    captured, capture = [], graphed.GraphedLMStep._capture

    def spy(self):
        captured.append(what(self))
        return capture(self)

    monkeypatch.setattr(graphed.GraphedLMStep, "_capture", spy)
    return captured


def _same_weights(run_a: Path, run_b: Path, dtype: str) -> None:
    """The two runs' saved models (run/model) hold the same weights: fp32 to the reduction order, bf16 to its
    rounding (the graphed-train tolerances)."""
    from fastweights.models import LM
    from tests.tolerances import GRAPH_RUN_CUDA_BF16_REL, GRAPH_RUN_CUDA_F32_ATOL, GRAPH_RUN_F32_RTOL

    a, b = LM.from_pretrained(run_a / "model"), LM.from_pretrained(run_b / "model")
    rtol, atol = (GRAPH_RUN_F32_RTOL, GRAPH_RUN_CUDA_F32_ATOL) if dtype == "float32" else (GRAPH_RUN_CUDA_BF16_REL,) * 2
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_train_captures_and_equals_the_eager_run(dtype, tmp_path, monkeypatch):
    """`fastweights train --cuda-graph --documents joined` on CUDA: the step is captured once (after WARMUP eager
    steps) and replayed; losses and weights equal the eager run's (fp32: to the reduction order; bf16: both runs
    round the same products, the graph's autocast keeps no cast cache); its checkpoint resumes without the graph."""
    from fastweights.pretrain import PretrainConfig, train
    from tests.tolerances import GRAPH_RUN_CUDA_BF16_REL, GRAPH_RUN_LOSS_REL

    captured = _spy_captures(monkeypatch, lambda step: 1)

    def cfg(out, **kw):
        return PretrainConfig.build({"data": [str(ROOT / "README.md")], "out": str(tmp_path / out), "steps": 8,
                                     "batch_size": 8, "grad_accum": 2, "seq_len": 64, "save_every": 4,
                                     "val_every": 1000, "progress": "none", "device": "cuda", "dtype": dtype,
                                     "documents": "joined", "model": {"d_model": 64, "n_layers": 2, "num_heads": 2,
                                                                      "head_dim": 32}, **kw})

    train(cfg("eager"))
    train(cfg("graph", cuda_graph=True))
    assert captured == [1]
    _same_weights(tmp_path / "eager", tmp_path / "graph", dtype)
    la, lb = ([json.loads(x)["loss"] for x in (tmp_path / run / "log.jsonl").read_text().splitlines()
               if "loss" in json.loads(x)] for run in ("eager", "graph"))
    assert len(la) == 8 and la == pytest.approx(lb, rel=GRAPH_RUN_LOSS_REL if dtype == "float32"
                                                 else GRAPH_RUN_CUDA_BF16_REL)
    assert train(cfg("graph", steps=10))["steps"] == 10  # resumed eagerly from the graph run's checkpoint


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_graph_with_packed_documents_validation_and_a_resume_equals_the_eager_run(dtype, tmp_path, monkeypatch):
    """cuda_graph "auto" (the gpu-125m preset's) on one GPU: on, with the preset's features — packed documents
    (--documents separate: max_documents varlen sequences), validation and checkpoints between replays, a stop at a
    step boundary and a resume that captures again — against one uninterrupted eager run: its losses, validation
    losses and weights (tolerances as the joined test above)."""
    from fastweights.pretrain import PretrainConfig, loop, train
    from fastweights.training import graphed
    from fastweights.training.control import Interrupted
    from tests.tolerances import GRAPH_RUN_CUDA_BF16_REL, GRAPH_RUN_LOSS_REL

    captured = _spy_captures(monkeypatch, lambda step: step.max_documents)
    steps, stop = 2 * graphed.WARMUP + 6, graphed.WARMUP + 3

    def cfg(out, **kw):
        return PretrainConfig.build({"data": [str(ROOT / "README.md"), str(ROOT / "docs")], "out": str(tmp_path / out),
                                     "steps": steps, "batch_size": 8, "grad_accum": 2, "seq_len": 256,
                                     "save_every": 4, "val_every": 3, "val_fraction": 0.02, "progress": "none",
                                     "device": "cuda", "dtype": dtype, "model": {"d_model": 64, "n_layers": 2,
                                                                                 "num_heads": 2, "head_dim": 32}, **kw})

    assert train(cfg("eager", cuda_graph=False))["cuda_graph"] is False
    calls = [0]

    def stop_at():
        calls[0] += 1
        return calls[0] > stop

    requested = loop.stop_requested
    monkeypatch.setattr(loop, "stop_requested", stop_at)
    with pytest.raises(Interrupted):
        train(cfg("graph", cuda_graph="auto"))
    monkeypatch.setattr(loop, "stop_requested", requested)
    assert torch.load(tmp_path / "graph" / "checkpoint.pt", weights_only=False)["step"] == stop
    assert train(cfg("graph", cuda_graph="auto"))["cuda_graph"] is True
    assert len(captured) == 2 and all(n is not None and n > 1 for n in captured), captured
    _same_weights(tmp_path / "eager", tmp_path / "graph", dtype)
    rel = GRAPH_RUN_LOSS_REL if dtype == "float32" else GRAPH_RUN_CUDA_BF16_REL
    for key in ("loss", "val_loss"):
        la, lb = ([(r["step"], r[key]) for r in map(json.loads, (tmp_path / run / "log.jsonl").read_text().splitlines())
                   if key in r] for run in ("eager", "graph"))
        assert [s for s, _ in la] == [s for s, _ in lb] and len(la) >= (4 if key == "val_loss" else steps)
        assert [v for _, v in la] == pytest.approx([v for _, v in lb], rel=rel), key
