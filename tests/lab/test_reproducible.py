"""CPU lab training is bit-reproducible across machines (issue 26 item 8): the same MQAR cells
trained in two processes that differ in everything a machine changes — the default torch thread
count (its cores), the CPU kernels its ISA selects (ATen's vector level, MKL's code path) and the
sweep's worker count — give bit-identical records and weights.

A machine's ISA is stood for by the variables through which ATen and MKL pick their kernels
(ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS): on one machine they select what another machine
selects on its own. Without `pin_cpu_numerics` the two runs below differ from the first step."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from fastweights.lab.mqar import PRESETS, make_cells, run_mqar
    out, workers = sys.argv[1], int(sys.argv[2])
    cells = make_cells(PRESETS["quick"], models=["gla"], d_models=[16], settings=[(32, 4)], lrs=[1e-2, 3e-3],
                       epochs=1, train_examples=96, test_examples=32)
    recs = run_mqar(cells, out, workers=workers, threads=None, progress="none", stack=False)  # (one cell a process)
    print(json.dumps([{"lr": r["lr"], "accuracy": r["accuracy"], "cpu_numerics": r.get("cpu_numerics"),
                       "history": [{k: v for k, v in h.items() if k != "seconds"} for h in r["history"]]}
                      for r in recs]))
""")


def _train(tmp_path, name: str, env: dict, workers: int) -> tuple[list, list[str]]:
    out = tmp_path / name
    full = {k: v for k, v in os.environ.items()
            if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OMP_NUM_THREADS",
                         "MKL_NUM_THREADS", "FASTWEIGHTS_CPU_NUMERICS")}
    full.update(env)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(workers)], env=full, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = json.loads(p.stdout.strip().splitlines()[-1])
    hashes = []
    for ck in sorted((out / "checkpoints").glob("*.pt")):
        state = torch.load(ck, map_location="cpu", weights_only=False)["model"]
        hashes.append(hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest())
    return recs, hashes


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the pinned kernels are x86 AVX2 ones")
def test_cpu_cells_bit_identical_across_threads_isa_and_workers(tmp_path):
    a = _train(tmp_path, "a", {"OMP_NUM_THREADS": "1"}, workers=1)
    b = _train(tmp_path, "b", {"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "default",
                               "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, workers=2)
    assert len(a[1]) == 2
    assert a[0] == b[0]  # accuracies and per-epoch losses, to the last bit (JSON floats round-trip)
    assert a[1] == b[1]  # every weight of both cells
    for r in a[0] + b[0]:  # each record says what decided its bits
        assert r["cpu_numerics"]["threads"] == 1 and r["cpu_numerics"]["cpu_capability"] == "AVX2"
        assert r["cpu_numerics"]["mkl_cbwr"] == "AVX2"
