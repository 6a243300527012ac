"""Context parallelism (`fastweights.distributed`) on the CPU: 3 processes under torchrun (gloo) against one
process, float64, for every zoo model it serves — the functional op (outputs, final state, every gradient,
the initial state's included) and an LM with short convolutions and packed documents (logits, every
parameter's gradient). The spans (odd T over 3 ranks) do not align to the chunk size. Refusals name what
context parallelism does not serve."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastweights as fw
from fastweights.distributed import ContextParallelError, span_bounds, supports
from tests.tolerances import CONTEXT_PARALLEL_F64_REL

ROOT = Path(__file__).resolve().parents[2]
SERVED = [n for n in fw.zoo.names() if supports(fw.zoo.resolve(n)) is None]


def _run_job(job: str, tmp_path: Path) -> list[dict]:
    seed = torch.seed() % 2**31
    out = tmp_path / f"{job}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(ROOT / "tests" / "distributed" / f"{job}.py"), str(seed), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "Address already in use" in proc.stderr:  # pragma: no cover - port race
        pytest.skip("torchrun could not bind a port")
    assert proc.returncode == 0, (seed, proc.stderr[-4000:])
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_served_models_are_the_linear_state_classes():
    assert {"deltanet", "gated_deltanet", "mamba2", "gla", "retnet", "kda", "comba", "deltaproduct"} <= set(SERVED)
    for name in ("softmax_attention", "ttt_mlp", "titans", "mesanet", "atlas"):
        if name in fw.zoo.names():
            assert name not in SERVED and name in supports(fw.zoo.resolve(name))


@pytest.mark.distributed
def test_op_spans_equal_one_process_float64(tmp_path):
    rows = _run_job("cp_ops_job", tmp_path)
    assert [r["model"] for r in rows] == SERVED
    for r in rows:
        errs = {k: v for k, v in r.items() if k != "model"}
        assert {"o", "final", "d_initial_state", "dq", "dk", "dv"} <= set(errs)
        assert max(errs.values()) < CONTEXT_PARALLEL_F64_REL, r


@pytest.mark.distributed
def test_lm_spans_with_convs_and_packed_documents_equal_one_process_float64(tmp_path):
    rows = _run_job("cp_lm_job", tmp_path)
    assert sorted({r["model"] for r in rows}) == sorted(SERVED) and {r["rows"] for r in rows} == {"packed", "plain"}
    for r in rows:
        assert max(r["logits"], r["grads"]) < CONTEXT_PARALLEL_F64_REL, r


def test_span_bounds_cover_the_sequence():
    for T in (1, 7, 29, 64):
        for n in (1, 2, 3, 4):
            if T < n:
                continue
            b = span_bounds(T, n)
            sizes = [b[i + 1] - b[i] for i in range(n)]
            assert b[0] == 0 and b[-1] == T and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_no_process_group_is_refused_by_name():
    from fastweights.distributed import ContextParallel

    with pytest.raises(ContextParallelError, match="process group"):
        ContextParallel()
