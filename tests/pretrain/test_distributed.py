"""`fastweights train` under torchrun with two CPU processes (gloo): DDP and FSDP2 (also with
gradient checkpointing per block) reach the weights and validation loss of one process that
accumulates the same global batch; a Ctrl-C stops
every rank at one step boundary after one checkpoint."""

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
from safetensors.torch import load_file

from fastweights.pretrain import PretrainConfig, train
from tests.tolerances import DIST_TRAIN_F32

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(data=[str(ROOT / "README.md")], steps=4, batch_size=4, seq_len=32, save_every=2, val_every=2,
                val_batches=1, progress="none", threads=1,
                model=dict(d_model=16, n_layers=2, num_heads=2, head_dim=8,
                           mixer=["gated_deltanet", "softmax_attention"]))

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys
    import torch
    import torch.distributed as dist
    # (registered first, so it runs last: after train()'s hook, which destroys the group it started)
    atexit.register(lambda: open(f"{sys.argv[1]}/at-exit-rank{os.environ['RANK']}", "w").write(
        str(dist.is_initialized())))
    torch.set_num_threads(1)
    from fastweights.pretrain import PretrainConfig, train
    out, settings = sys.argv[1], json.loads(sys.argv[2])
    for name, parallel, ckpt in (("ddp", "ddp", False), ("fsdp", "fsdp", False), ("fsdp-ckpt", "fsdp", True)):
        r = train(PretrainConfig.build({**settings, "out": f"{out}/{name}", "parallel": parallel,
                                        "grad_checkpoint": ckpt}))
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 2
        with open(f"{out}/{name}-rank{dist.get_rank()}.json", "w") as f:
            json.dump(r, f)
    """
)


def test_ddp_and_fsdp2_equal_one_process_accumulating_the_same_batch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path), json.dumps(SETTINGS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "Address already in use" in proc.stderr:  # pragma: no cover - port race
        pytest.skip("torchrun could not bind a port")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # train() under torchrun started the group, kept it over the three runs, and destroyed it at exit
    assert [(tmp_path / f"at-exit-rank{r}").read_text() for r in range(2)] == ["False", "False"]
    single = train(PretrainConfig.build({**SETTINGS, "out": str(tmp_path / "single"), "grad_accum": 2}))
    ref = load_file(tmp_path / "single" / "model" / "model.safetensors")
    scale = max(t.abs().max().item() for t in ref.values())
    for parallel in ("ddp", "fsdp", "fsdp-ckpt"):
        ranks = [json.loads((tmp_path / f"{parallel}-rank{r}.json").read_text()) for r in range(2)]
        assert ranks[0]["val_loss"] == ranks[1]["val_loss"]
        assert abs(ranks[0]["val_loss"] - single["val_loss"]) < DIST_TRAIN_F32 * abs(single["val_loss"])
        got = load_file(tmp_path / parallel / "model" / "model.safetensors")
        assert got.keys() == ref.keys()
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < DIST_TRAIN_F32 * scale, (parallel, diff)


STOP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from fastweights.cli import main
    out = sys.argv[1]
    rc = main(["train", *sys.argv[2:], "--out", f"{out}/run"])
    rank = dist.get_rank() if dist.is_initialized() else "none"
    with open(f"{out}/rc-rank{rank}", "w") as f:
        f.write(str(rc))
    sys.exit(rc)
    """
)


@pytest.mark.distributed
def test_ctrl_c_under_torchrun_saves_once_and_every_rank_exits_130_at_one_step(tmp_path):
    """A terminal's Ctrl-C: SIGINT to the whole process group (torchrun and both ranks), which torchrun
    forwards to the ranks again. Every rank stops at the same step boundary, the checkpoint holds that
    step, one resume line is printed, every rank exits 130; the resumed run logs every step once."""
    script = tmp_path / "job.py"
    script.write_text(STOP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    steps = 40
    args = ["--data", str(ROOT / "README.md"), "--steps", str(steps), "--batch-size", "4", "--seq-len", "16",
            "--save-every", "1000", "--val-every", "1000", "--progress", "plain", "--threads", "1",
            "--model", "d_model=16", "--model", "n_layers=1", "--model", "num_heads=2", "--model", "head_dim=8"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(x).get("step", 0) >= 3 for x in lines[:-1]):
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.01)
    out, err = proc.communicate(timeout=120)
    if "Address already in use" in err:  # pragma: no cover - port race
        pytest.skip("torchrun could not bind a port")
    rcs = [(tmp_path / f"rc-rank{r}").read_text() if (tmp_path / f"rc-rank{r}").exists() else None for r in (0, 1)]
    assert rcs == ["130", "130"], (rcs, err[-4000:])
    stopped = json.loads(log.read_text().splitlines()[-1])["step"]
    assert 3 <= stopped < steps
    resume_lines = [ln for ln in (out + err).splitlines() if "interrupted at step" in ln]
    assert len(resume_lines) == 1 and f"interrupted at step {stopped} of {steps}" in resume_lines[0], err[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == stopped

    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, steps + 1))
    assert [r["samples"] for r in recs if "loss" in r] == [[4 * s, 4 * s + 4] for s in range(steps)]
