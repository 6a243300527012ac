"""Where the plain-torch chunk form and the decoding step spend their time on a GPU.

    python3 scripts/gpu_profile.py [--out DIR] [--models ...] [--smoke]

1. At the anchor shape (B=4, T=4096, H=16, D=128, bf16 inputs) for each model: the median
   forward and forward+backward time of `fastweights.chunk` in several variants, side by side:
     c64        as shipped (chunk_size 64, fp32 matmuls)
     c32, c128  chunk_size 32 / 128
     c64-tf32   TF32 matmuls allowed (torch.backends.cuda.matmul.allow_tf32): a ceiling, not shipped
   and the profiler's kernels (self CUDA time) of one c64 forward+backward.
2. One decoding step (`LM.step`, bf16, d_model 1024, 4 layers, 8 heads × 128, 4,096 tokens of
   context) of a gated_deltanet and a softmax_attention LM: median step time and the profiler's
   top ops by self CPU and self CUDA time.
Writes profile.json and profile.txt under --out ($OUT by default); --smoke runs tiny shapes on
the CPU to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

# --src DIR: import fastweights from DIR instead (an older checkout timed side by side with this one)
_src = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.abspath(_src))

import fastweights as fw  # noqa: E402

MODELS = ("deltanet", "gated_deltanet", "gla", "kda")
VARIANTS = {"c64": dict(chunk_size=64), "c32": dict(chunk_size=32), "c128": dict(chunk_size=128),
            "c64-tf32": dict(chunk_size=64, tf32=True)}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn, dev, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def case(model, shape, dev, dtype, chunk_size):
    B, T, H, D = shape
    x = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=dtype, device=dev,
                          seed=0, requires_grad=True)
    x.pop("initial_state", None)
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        return fw.chunk(model, chunk_size=chunk_size, **x)[0]

    def fwdbwd():
        run().float().sum().backward()
        for t in leaves:
            t.grad = None

    return run, fwdbwd


def profile_table(fn, dev, sort, rows=22):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    fn()
    sync(dev)
    with profile(activities=acts) as prof:
        fn()
        sync(dev)
    ka = prof.key_averages()
    n_kernels = sum(e.count for e in ka if getattr(e, "device_type", None) is not None
                    and str(e.device_type).endswith("CUDA"))
    return ka.table(sort_by=sort, row_limit=rows), n_kernels


def decode_case(name, dev, dtype, smoke):
    from fastweights.models import LM, LMConfig
    torch.manual_seed(0)
    d, L, H, Dh, ctx = (64, 2, 2, 32, 64) if smoke else (1024, 4, 8, 128, 4096)
    lm = LM(LMConfig(vocab_size=4096, d_model=d, n_layers=L, mixer=name, num_heads=H, head_dim=Dh))
    lm = lm.to(device=dev, dtype=dtype).eval()
    ids = torch.randint(0, 4096, (1, ctx), device=dev)
    with torch.no_grad():
        logits, state = lm.prefill(ids, None)
        tok = logits[:, -1].argmax(-1)
        box = {"state": state, "tok": tok}

        def step():
            lg, box["state"] = lm.step(box["tok"], box["state"])
            box["tok"] = lg.argmax(-1)

        ms = median_ms(step, dev, reps=20, warmup=5)
        cpu_table, _ = profile_table(step, dev, "self_cpu_time_total", rows=25)
        cuda_table, nk = profile_table(step, dev, "self_cuda_time_total" if dev.type == "cuda"
                                       else "self_cpu_time_total", rows=15)
    return ms, cpu_table, cuda_table, nk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/profile"))
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--profile-models", nargs="*", default=["deltanet", "gla", "kda"])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--src", default=None, help="import fastweights from this folder (e.g. an older checkout)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decoding-step profiles")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    shape = (1, 64, 2, 16) if args.smoke else (4, 4096, 16, 128)
    res, text = [], []
    print(f"fastweights from {fw.__file__}", flush=True)

    def save():
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write("\n\n".join(text))

    if dev.type == "cuda":
        res.append({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "src": fw.__file__})
    for model in args.models:
        for vname in args.variants:
            spec = VARIANTS[vname]
            torch.backends.cuda.matmul.allow_tf32 = bool(spec.get("tf32"))
            try:
                run, fb = case(model, shape, dev, dtype, spec["chunk_size"])
                with torch.no_grad():
                    f = median_ms(run, dev)
                row = {"model": model, "variant": vname, "fwd_ms": f, "fwdbwd_ms": median_ms(fb, dev)}
            except Exception as e:  # a failed variant is a result too
                row = {"model": model, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]}
            torch.backends.cuda.matmul.allow_tf32 = False
            res.append(row)
            print(row, flush=True)
            save()
        if model in args.profile_models:
            run, fb = case(model, shape, dev, dtype, 64)
            table, nk = profile_table(fb, dev, "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total")
            text.append(f"## {model} c64 forward+backward ({nk} kernel launches)\n{table}")
            res.append({"model": model, "variant": "c64-profile", "kernels": nk})
            print(text[-1], flush=True)
            save()
    for name in () if args.no_decode else ("gated_deltanet", "softmax_attention"):
        ms, cpu_table, cuda_table, nk = decode_case(name, dev, dtype, args.smoke)
        res.append({"decode": name, "ms_per_step": ms, "kernels": nk})
        text.append(f"## decode step {name}: {ms:.2f} ms median, {nk} kernels\n### by self CPU\n{cpu_table}\n"
                    f"### by self CUDA\n{cuda_table}")
        print(text[-1], flush=True)
        save()


if __name__ == "__main__":
    main()
