"""`fastweights train` under torchrun with two CPU processes (gloo): DDP and FSDP2 reach the
weights and validation loss of one process that accumulates the same global batch."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
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
    import json, sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from fastweights.pretrain import PretrainConfig, train
    out, settings = sys.argv[1], json.loads(sys.argv[2])
    for parallel in ("ddp", "fsdp"):
        r = train(PretrainConfig.build({**settings, "out": f"{out}/{parallel}", "parallel": parallel}))
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 2
        with open(f"{out}/{parallel}-rank{dist.get_rank()}.json", "w") as f:
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
    single = train(PretrainConfig.build({**SETTINGS, "out": str(tmp_path / "single"), "grad_accum": 2}))
    ref = load_file(tmp_path / "single" / "model" / "model.safetensors")
    scale = max(t.abs().max().item() for t in ref.values())
    for parallel in ("ddp", "fsdp"):
        ranks = [json.loads((tmp_path / f"{parallel}-rank{r}.json").read_text()) for r in range(2)]
        assert ranks[0]["val_loss"] == ranks[1]["val_loss"]
        assert abs(ranks[0]["val_loss"] - single["val_loss"]) < DIST_TRAIN_F32 * abs(single["val_loss"])
        got = load_file(tmp_path / parallel / "model" / "model.safetensors")
        assert got.keys() == ref.keys()
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < DIST_TRAIN_F32 * scale, (parallel, diff)
