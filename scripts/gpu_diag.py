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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r'''
import sys, torch
sys.path.insert(0, {root!r})
import fastweights as fw
model, K, dt = {model!r}, {K}, getattr(torch, {dtype!r})
inp = fw.example_inputs(model, batch_size=2, seq_len=200, num_heads=2, head_dim=K, head_v_dim=2 * K, dtype=dt,
                        device="cuda", seed=0, requires_grad=True)
leaves = [x for k, x in inp.items() if k != "initial_state" and isinstance(x, torch.Tensor) and x.requires_grad]
def run(backend, cast):
    kw = {{k: (v.detach().to(cast).requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and k != "initial_state" else v) for k, v in inp.items()}}
    ls = [kw[k] for k in kw if isinstance(kw[k], torch.Tensor) and kw[k].requires_grad]
    o, _ = fw.chunk(model, backend=backend, check_values=False, **kw)
    g = torch.cos(torch.arange(o.numel(), device=o.device, dtype=torch.float32)).view(o.shape)
    (o.float() * g).sum().backward()
    torch.cuda.synchronize()
    return [o.detach().float()] + [x.grad.float() for x in ls]
got = run("triton", dt)
ref = run("torch", torch.float32)
err = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref))
print(f"max rel err {{err:.2e}}", "NaN" if any(torch.isnan(a).any() for a in got) else "")
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
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/diag.txt")
    a = ap.parse_args(argv)
    t_start = time.time()
    lines = []

    def report(line, tail=""):
        lines.append(line + ("\n    " + "\n    ".join(tail.strip().splitlines()[-12:]) if tail else ""))
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
    for model in a.models:
        for K in a.head_dims:
            for dt in a.dtypes:
                if time.time() - t_start > a.deadline:
                    report(f"chunk {model} K={K} {dt}: not run (deadline)")
                    continue
                code = CASE.format(root=str(ROOT), model=model, K=K, dtype=dt)
                rc, out, sec = sh([sys.executable, "-c", code], env=env, timeout=150)
                last = [ln for ln in out.strip().splitlines() if ln.startswith("max rel err")]
                report(f"chunk {model} K={K} V={2 * K} {dt}: " + (last[0] if rc == 0 and last else f"FAILED rc {rc}")
                       + f" ({sec:.0f} s)", "" if rc == 0 else out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
