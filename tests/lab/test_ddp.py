"""Distributed harness on CPU (gloo), launched for real with torchrun (2 processes): DDP training keeps
the ranks' parameters identical and learns; a spread sweep runs cell i on rank i % 2, each cell once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # two processes over gloo

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from dataclasses import dataclass
    from pathlib import Path

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from fastweights.training.distributed import dist_info, init_distributed
    from fastweights.lab.train import ResultStore, TrainConfig, run_sweep, train_cell
    from fastweights.models import LM, LMConfig
    from fastweights.tasks.mqar import MQARConfig, make_mqar_splits

    out = Path(sys.argv[1])
    info = init_distributed("cpu")
    assert dist.is_initialized() and dist.get_backend() == "gloo" and info.world_size == 2

    mq = MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_examples=1024, seed=7)
    train, test = make_mqar_splits(mq, MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4, num_examples=128, seed=7))
    lm = LMConfig(vocab_size=64, d_model=32, n_layers=2, mixer="deltanet", num_heads=1, mlp="none")
    box = {}

    def make(cfg):
        box["m"] = LM(cfg)
        return box["m"]

    cfg = TrainConfig(epochs=6, batch_size=32, lr=1e-2, warmup=0.05, seed=3, accuracy="examples")
    res = train_cell(lm, train, test, cfg, model_fn=make, ddp=True, checkpoint_path=out / "ddp.pt", progress="none")
    flat = torch.cat([p.detach().flatten() for p in box["m"].parameters()])
    both = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    accs = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(accs, torch.tensor([res["accuracy"]], dtype=torch.float64))

    @dataclass(frozen=True)
    class Cell:
        i: int
        lr: float

    def run(cell, progress=None, desc=None):
        return {"accuracy": cell.i / 10, "pid": os.getpid()}

    store = ResultStore(out / "spread.jsonl")
    recs = run_sweep([Cell(i, 1e-3) for i in range(5)], store, run, mode="spread", progress="none")
    (out / f"rank{info.rank}.json").write_text(json.dumps({
        "rank": info.rank, "max_param_diff": (both[0] - both[1]).abs().max().item(),
        "accuracy": res["accuracy"], "accs": [a.item() for a in accs], "history": res["history"],
        "steps": res["steps"], "sweep_records": len(recs)}))
    """
)


def test_ddp_training_and_spread_sweep(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and "Address already in use" in proc.stderr:  # pragma: no cover - port race
        pytest.skip("torchrun could not bind a port")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    # DDP: identical parameters after training, the same (all-reduced) evaluation on both ranks
    assert r[0]["max_param_diff"] == 0.0 and r[1]["max_param_diff"] == 0.0
    assert r[0]["accs"][0] == r[0]["accs"][1]
    drop = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
    assert drop(r[0]["history"]) == drop(r[1]["history"])  # loss and accuracy reduced over the ranks
    assert r[0]["steps"] == 6 * 32  # 1024 examples, global batch 32 = 16 per rank
    assert r[0]["accuracy"] > 10 / 32, r[0]["history"]  # learns (chance 1/32; measured ≈0.9)
    assert (tmp_path / "ddp.pt").exists()
    # spread: cell i ran on rank i % 2, each once, both ranks see all records
    recs = [json.loads(ln) for ln in (tmp_path / "spread.jsonl").read_text().splitlines()]
    assert sorted(rec["i"] for rec in recs) == list(range(5))
    assert all(rec["rank"] == rec["i"] % 2 for rec in recs)
    assert len({rec["pid"] for rec in recs}) == 2
    assert r[0]["sweep_records"] == r[1]["sweep_records"] == 5
