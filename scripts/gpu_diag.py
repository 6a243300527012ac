"""Find which kernel faults, one subprocess per case (a fault kills only its own CUDA context):

1. each test of the given pytest files on its own (`pytest -m "cuda or triton" FILE::TEST`), pass/fail line;
2. `fw.chunk(model, backend="triton")` forward + backward per model × head dim × dtype with
   CUDA_LAUNCH_BLOCKING=1, so a fault names the launch that made it; the result against the fp32 torch chunk
   form (max relative error over the output and every gradient).

    python3 scripts/gpu_diag.py --tests tests/cuda/test_graph_train.py --models gated_deltanet deltanet \\
        --head-dims 16 32 64 --out $OUT/diag.txt

Prints one line per case, and the tail of each failing case's output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r'''
import sys, torch
sys.path.insert(0, {root!r})
import contextlib, dataclasses
import fastweights as fw
from fastweights.dispatch import Target, recipe_class
from fastweights.kernels import rows
from fastweights.kernels.pipelines import GatedPipeline
model, K, V, dt, path = {model!r}, {K}, {V}, getattr(torch, {dtype!r}), {path!r}
cls = recipe_class(fw.zoo.get(model))
pin = contextlib.nullcontext()
if path != "auto":  # the Triton chunk row runs `path` forward and backward (the delta class: fp32 copies as the rule)
    if cls == "delta":
        rule = rows.delta_chunk_pipeline(fw.zoo.get(model), Target("cuda", dt, K, V, 64))
        pin = rows.pinned(cls, pipeline=dataclasses.replace(rule, forward=path, backward=path))
    elif cls == "gated_linear":
        pin = rows.pinned(cls, pipeline=GatedPipeline(path))
    else:
        sys.exit(f"--paths {{path}}: {{model}} ({{cls}} class) has no Triton pipeline to pick (delta, gated_linear)")
inp = fw.example_inputs(model, batch_size=2, seq_len=200, num_heads=2, head_dim=K, head_v_dim=V, dtype=torch.float32,
                        device="cuda", seed=0, requires_grad=True)
LOW = ("q", "k", "v", "p")  # the inputs a layer hands over in the compute dtype; gates, beta stay fp32
def run(backend, cast):
    kw = {{k: (v.detach().to(cast if k in LOW else torch.float32).requires_grad_(True)
              if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "initial_state" else v)
          for k, v in inp.items()}}
    names = [k for k in kw if isinstance(kw[k], torch.Tensor) and kw[k].requires_grad]
    with pin if backend == "triton" else contextlib.nullcontext():
        o, _ = fw.chunk(model, backend=backend, check_values=False, **kw)
    g = torch.cos(torch.arange(o.numel(), device=o.device, dtype=torch.float32)).view(o.shape)
    (o.float() * g).sum().backward()
    torch.cuda.synchronize()
    return dict([("o", o.detach().float())] + [("d" + k, kw[k].grad.float()) for k in names])
got = run("triton", dt)
ref = run("torch", torch.float32)
errs = {{n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}}
print(f"max rel err {{max(errs.values()):.2e}}", " ".join(f"{{n}} {{e:.1e}}" for n, e in errs.items()),
      "NaN" if any(torch.isnan(a).any() for a in got.values()) else "")
'''


def sh(cmd, env=None, timeout=120):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr), time.time() - t0
    except subprocess.TimeoutExpired as e:
        return 124, ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), \
            time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="*", default=[])
    ap.add_argument("--models", nargs="*", default=[])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--v-dims", type=int, nargs="*", default=[], help="value head dims (default 2·K)")
    ap.add_argument("--paths", nargs="+", default=["auto"], choices=["auto", "staged", "fused"],
                    help="the Triton chunk row's pipeline, forward and backward (rows.pinned): the delta class "
                         "DeltaPipeline(path, path) (fp32 copies where the rule makes them), the gated-linear class "
                         "GatedPipeline(path); another class refuses a path (auto: the rule's choice)")
    ap.add_argument("--workers", type=int, default=1, help="cases run in parallel processes")
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/diag.txt")
    a = ap.parse_args(argv)
    t_start = time.time()
    lines = []

    def report(line, tail=""):
        lines.append(line + ("\n    " + "\n    ".join(tail.strip().splitlines()[-40:]) if tail else ""))
        print(lines[-1], flush=True)
        Path(a.out).write_text("\n".join(lines) + "\n")

    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    for f in a.tests:
        rc, out, _ = sh([sys.executable, "-m", "pytest", "--co", "-q", "-m", "cuda or triton", f])
        ids = [ln.strip() for ln in out.splitlines() if "::" in ln]
        for tid in ids:
            if time.time() - t_start > a.deadline:
                report(f"{tid}: not run (deadline)")
                continue
            rc, out, sec = sh([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
                               "cuda or triton", tid], env=env, timeout=150)
            report(f"{tid}: {'ok' if rc == 0 else f'FAILED rc {rc}'} ({sec:.0f} s)", "" if rc == 0 else out)
    cases = [(m, K, V, dt, path) for m in a.models for K in a.head_dims for V in (a.v_dims or [2 * K])
             for dt in a.dtypes for path in a.paths]

    def one(case):
        model, K, V, dt, path = case
        name = f"chunk {model} K={K} V={V} {dt} {path}"
        if time.time() - t_start > a.deadline:
            return name + ": not run (deadline)", ""
        code = CASE.format(root=str(ROOT), model=model, K=K, V=V, dtype=dt, path=path)
        rc, out, sec = sh([sys.executable, "-c", code], env=env, timeout=150)
        last = [ln for ln in out.strip().splitlines() if ln.startswith("max rel err")]
        return (name + ": " + (last[0] if rc == 0 and last else f"FAILED rc {rc}") + f" ({sec:.0f} s)",
                "" if rc == 0 else out)

    with ThreadPoolExecutor(max(1, a.workers)) as pool:
        for line, tail in pool.map(one, cases):
            report(line, tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
