"""Where the plain-torch chunk form spends its time on a GPU, and what three variants buy.

    python3 scripts/gpu_profile.py [--out DIR]

At the anchor shape (B=4, T=4096, H=16, D=128, bf16 inputs, forward+backward) for
gated_deltanet, gla and kda: the median time of
  eager      fastweights.chunk as shipped (fp32 matmuls)
  tf32       the same with TF32 matmuls allowed (torch.backends.cuda.matmul.allow_tf32)
  compiled   torch.compile of the chunk core (chunkwise.chunk_delta / chunk_gated)
and the profiler's top CUDA kernels of one eager forward+backward. Writes profile.json and
profile.txt under --out ($OUT by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fastweights as fw  # noqa: E402
from fastweights import chunkwise  # noqa: E402

MODELS = ("gated_deltanet", "gla", "kda")


def median_ms(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def case(model, core=None):
    x = fw.example_inputs(model, batch_size=4, seq_len=4096, num_heads=16, head_dim=128, dtype=torch.bfloat16,
                          device="cuda", seed=0, requires_grad=True)
    x.pop("initial_state", None)
    leaves = [t for t in x.values() if t.requires_grad]
    if core is None:
        def run():
            return fw.chunk(model, **x)[0]
    else:
        kw = {k: v for k, v in x.items() if k not in ("q", "k", "v")}

        def run():
            return core(x["q"], x["k"], x["v"], scale=None, **kw)[0]

    def fwdbwd():
        run().float().sum().backward()
        for t in leaves:
            t.grad = None

    return run, fwdbwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/profile"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res, text = [], []

    def save():
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write("\n".join(text))

    for model in MODELS:
        core = chunkwise.chunk_delta if fw.recipe_class(fw.zoo.get(model)) == "delta" else chunkwise.chunk_gated
        run, fb = case(model)
        with torch.no_grad():
            f = median_ms(run)
        res.append({"model": model, "variant": "eager", "fwd_ms": f, "fwdbwd_ms": median_ms(fb)})
        print(res[-1], flush=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fb()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
        text.append(f"## {model} eager fwd+bwd\n{table}")
        print(table, flush=True)
        save()
        torch.backends.cuda.matmul.allow_tf32 = True
        run, fb = case(model)
        with torch.no_grad():
            f = median_ms(run)
        res.append({"model": model, "variant": "tf32", "fwd_ms": f, "fwdbwd_ms": median_ms(fb)})
        torch.backends.cuda.matmul.allow_tf32 = False
        print(res[-1], flush=True)
        save()
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(core)
            run, fb = case(model, compiled)
            fb()
            torch.cuda.synchronize()
            ct = time.perf_counter() - t0
            with torch.no_grad():
                f = median_ms(run)
            res.append({"model": model, "variant": "compiled", "fwd_ms": f, "fwdbwd_ms": median_ms(fb),
                        "compile_s": ct})
        except Exception as e:  # a failed variant is a result too
            res.append({"model": model, "variant": "compiled", "error": f"{type(e).__name__}: {e}"[:400]})
        print(res[-1], flush=True)
        save()


if __name__ == "__main__":
    main()
