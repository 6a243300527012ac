"""Compile (and autotune) every kernel the peers table launches before the table is timed, so that one
`fastweights bench speed` run holds every row within a device call. fla autotunes most of its kernels on first
call (minutes an op, call 5 of 2026-11-26 timed 3 of 8 ops in 9 minutes) and FlashQLA JIT-compiles through
TileLang; both cache on disk (TRITON_CACHE_DIR, TILELANG_CACHE_DIR: keep them on a path that survives between
calls on one warm machine, e.g. under the ignored runs/).

    python3 scripts/gpu_peers_warm.py --mode compile --workers 12   # every case in parallel processes
    python3 scripts/gpu_peers_warm.py --mode tune                   # one case at a time, the GPU to itself

`compile` runs each case's forward and forward+backward once in parallel worker processes (the CPU-bound
compiles overlap), then deletes Triton's cached autotune choices (`*.autotune.json`): they were benchmarked
with other processes on the GPU. `tune` then runs the cases again one process at a time, the compiled binaries
already cached, so the choices the timed run reads back are made with the GPU to themselves. Each case runs in
its own process (a fault kills one case, not the rest); its outcome is printed as it ends.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODELS_4K = ("gated_deltanet", "deltanet", "kda", "gla", "mamba2", "retnet", "comba", "deltaproduct")
DEEP = ("ttt_linear", "ttt_mlp", "titans", "mesanet")  # issue 36's memories with kernels (OmegaNet, ATLAS: torch)
# (impl, model, B, T, H, HV, D, form): the rows of the op tables (BENCHMARKS.md §1f) and of issue 36's (§1w); the
# peers first (their compiles take minutes), our deep memories last (only compiles, no autotune)
CASES = ([(impl, m, 4, 4096, 16, None, 128, "chunk_triton") for m in MODELS_4K for impl in ("fla", "fastweights")]
         + [("flashqla", "gated_deltanet", 4, 4096, 16, None, 128, "chunk_triton")]
         + [(impl, "gated_deltanet", 1, 32768, 16, 32, 128, "chunk_triton") for impl in ("fla", "flashqla",
                                                                                       "fastweights")]
         + [("fla", "ttt_linear", B, T, H, None, D, "chunk") for B, T, H, D in ((64, 512, 2, 64), (4, 4096, 16, 128))]
         + [("fastweights", m, B, T, H, None, D, "chunk") for m in DEEP
            for B, T, H, D in ((64, 512, 2, 64), (4, 4096, 16, 128))])

WORKER = r"""
import sys, torch
sys.path.insert(0, {root!r})
from fastweights.bench import speed
impl, model, B, T, H, HV, D, form = {case!r}
dev, dt = torch.device("cuda"), torch.bfloat16
if impl == "fastweights":
    run, tensors = speed.fastweights_case(model, form, B, T, H, D, dt, dev, 64, HV)
elif impl == "fla":
    run, tensors = speed.fla_case(model, B, T, H, D, dt, dev, HV)
else:
    run, tensors = speed.flashqla_case(model, B, T, H, D, dt, dev, HV)
fwd, fwdbwd = speed.fwd_bwd(run, tensors)
fwd()
fwdbwd()
torch.cuda.synchronize()
"""


def run_case(case, timeout: float) -> tuple[tuple, str, float]:
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", WORKER.format(root=ROOT, case=case)], capture_output=True,
                           text=True, timeout=max(timeout, 1.0))
        status = "ok" if p.returncode == 0 else "FAILED: " + (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
        status = "TIMEOUT"
    return case, status, time.time() - t0


def drop_autotune_choices() -> int:
    root = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".autotune.json"):
                os.remove(os.path.join(d, f))
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("compile", "tune"), required=True)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=400, help="seconds; no case starts after it")
    args = ap.parse_args()
    t0 = time.time()
    left = lambda: args.deadline - (time.time() - t0)  # noqa: E731
    workers = args.workers if args.mode == "compile" else 1

    def job(case):
        if args.mode == "tune" and case[0] == "fastweights":  # our launch configs are pinned: nothing to tune
            return case, "skipped (pinned)", 0.0
        if left() <= 0:
            return case, "not started (deadline)", 0.0
        return run_case(case, left())

    with ThreadPoolExecutor(workers) as pool:
        for case, status, sec in pool.map(job, CASES):
            print(f"{args.mode} {' '.join(map(str, case))}: {status} ({sec:.0f} s)", flush=True)
    if args.mode == "compile":
        print(f"dropped {drop_autotune_choices()} autotune choices made under contention", flush=True)
    print(f"{args.mode} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
