"""One GPU session's worth of timings, written under $OUT (or --out), after the CUDA tests.

    python3 scripts/gpu_check.py --stage ours    # the CUDA tests, peaks, chunk timings (+ SDPA),
                                                 # chunk_compile timings, decode benchmark
    python3 scripts/gpu_check.py --stage peers   # side by side in one run: SDPA, fla 0.6.0, ours

Correctness is not measured here: it is the collected tests marked `cuda` (tests/cuda: chunk and
recurrent in fp32 on CUDA against the float64 recurrence, outputs, final states and gradients;
T = 65,536 in bf16 with strong, no and runs of zero decay), which run on their own with

    python3 -m pytest -m cuda tests/cuda

and which `--stage ours` runs first (pytest's JUnit XML lands in cuda_tests.xml; the script goes
on to the timings either way and exits non-zero if a test failed). Everything lands in files as
it is produced, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fastweights.bench.speed import run_speed  # noqa: E402


def dump(out, name, obj):
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1)


def peaks(dev) -> dict:
    """Measured bf16 matmul TFLOP/s and copy bandwidth (TB/s): the floors' denominators."""
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    tflops = 20 * 2 * n ** 3 / (time.perf_counter() - t) / 1e12
    x = torch.empty(1 << 29, device=dev, dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    tbps = 10 * 2 * x.numel() * 4 / (time.perf_counter() - t) / 1e12
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"bf16_matmul_tflops": tflops, "copy_tbps": tbps}


def cuda_tests(out) -> int:
    """`pytest -m cuda tests/cuda` from the repository root; its exit status (0: all passed)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/cuda",
           f"--junitxml={os.path.abspath(os.path.join(out, 'cuda_tests.xml'))}"]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=root).returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["ours", "peers"], required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: check that the script itself runs")
    ap.add_argument("--models", nargs="+", default=["deltanet", "gated_deltanet", "gla", "kda"],
                    help="peers stage: the models timed beside fla (its first call of each op autotunes for minutes)")
    args = ap.parse_args()
    if args.smoke:
        run_speed(models=["gated_deltanet", "gla"], forms=["chunk"], lengths=[128], B=1, H=2, D=16,
                  dtype="float32", device="cpu", out_dir=os.path.join(args.out, "smoke"), peers=False)
        return
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "python": platform.python_version()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env.update(peaks(dev))
    print(env, flush=True)
    dump(args.out, f"env_{args.stage}.json", env)
    shape = dict(B=4, H=16, D=128, lengths=[4096], dtype="bfloat16", device="cuda", chunk_size=64,
                 peak_tflops=env["bf16_matmul_tflops"], peak_tbps=env["copy_tbps"])
    if args.stage == "ours":
        failed = cuda_tests(args.out)
        run_speed(models=["gated_deltanet", "deltanet", "gla", "kda", "retnet", "mamba2", "linear_attention",
                          "comba", "deltaproduct"], forms=["chunk"], out_dir=os.path.join(args.out, "speed"),
                  peers=True, **shape)
        run_speed(models=["gated_deltanet", "gla", "kda"], forms=["chunk_compile"],
                  out_dir=os.path.join(args.out, "speed_compile"), peers=False, **shape)
        from fastweights.bench.decode import DecodeBenchConfig, run_decode
        run_decode(DecodeBenchConfig(contexts=(1024, 4096, 16384, 65536), d_model=1024, n_layers=4, num_heads=8,
                                     head_dim=128, vocab_size=4096, new_tokens=32, repeats=3, device="cuda",
                                     dtype="bfloat16", prefill_chunk=4096, out=os.path.join(args.out, "decode")))
        if failed:
            sys.exit(f"the CUDA tests failed (pytest exit status {failed}): see cuda_tests.xml")
    else:
        run_speed(models=args.models, forms=["chunk"], out_dir=args.out, peers=True, **shape)


if __name__ == "__main__":
    main()
