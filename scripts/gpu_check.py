"""One GPU session's worth of checks and timings, written under $OUT (or --out).

    python3 scripts/gpu_check.py --stage ours    # peaks, correctness on CUDA, bf16 long-T numerics,
                                                 # chunk timings (+ SDPA), decode benchmark
    python3 scripts/gpu_check.py --stage peers   # side by side in one run: SDPA, fla 0.6.0, ours

Correctness: every gated-linear/delta zoo model, chunk (CUDA, fp32) against recurrent (CUDA, fp32)
and against recurrent in float64 on the CPU: outputs, final states and the gradients of every
input; relative errors. Long-T numerics: T = 65,536 in bf16 with strong decay (g = −5), no
decay and long runs of g = 0, chunk bf16 against chunk fp32. Everything lands in JSON files as it
is produced, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fastweights as fw  # noqa: E402
from fastweights import zoo  # noqa: E402
from fastweights.bench.speed import run_speed  # noqa: E402

LINEAR = [n for n in zoo.names() if fw.recipe_class(zoo.get(n)) in ("gated_linear", "delta")]


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


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def correctness(dev) -> list[dict]:
    recs = []
    for name in LINEAR:
        x = fw.example_inputs(name, batch_size=2, seq_len=300, num_heads=4, head_dim=64, dtype=torch.float64,
                              seed=0)
        x.pop("initial_state", None)
        S0 = torch.randn(2, 4, 64, 64, dtype=torch.float64) * 0.1 if not zoo.get(name).memory.normalize else None

        def grads(form, inputs, state, name=name, **kw):
            leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
            st = state.detach().clone().requires_grad_(True) if state is not None else None
            o, s = form(name, initial_state=st, output_final_state=True, **leaves, **kw)
            s_t = s if isinstance(s, torch.Tensor) else s.weights[0]
            gen = torch.Generator(device="cpu").manual_seed(1)
            wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
            ws = torch.randn(s_t.shape, generator=gen, dtype=torch.float64).to(s_t.device, s_t.dtype)
            ((o * wo).sum() + (s_t * ws).sum()).backward()
            gs = {k: v.grad for k, v in leaves.items()}
            if st is not None:
                gs["initial_state"] = st.grad
            return o.detach(), s_t.detach(), gs

        ref = grads(fw.recurrent, x, S0)  # float64, CPU: the exact reference
        on = {k: v.to(dev, torch.float32) for k, v in x.items()}
        s32 = S0.to(dev, torch.float32) if S0 is not None else None
        t0 = time.perf_counter()
        ch = grads(fw.chunk, on, s32)
        t_chunk = time.perf_counter() - t0
        rc = grads(fw.recurrent, on, s32)
        rec = {"model": name, "chunk_s": t_chunk,
               "chunk_vs_f64": {"o": rel(ch[0].cpu(), ref[0]), "state": rel(ch[1].cpu(), ref[1]),
                                **{f"d{k}": rel(v.cpu(), ref[2][k]) for k, v in ch[2].items()}},
               "recurrent_fp32_vs_f64": {"o": rel(rc[0].cpu(), ref[0]), "state": rel(rc[1].cpu(), ref[1]),
                                         **{f"d{k}": rel(v.cpu(), ref[2][k]) for k, v in rc[2].items()}}}
        recs.append(rec)
        worst = max(rec["chunk_vs_f64"].values())
        worst_r = max(rec["recurrent_fp32_vs_f64"].values())
        print(f"correctness {name:18s} chunk fp32 CUDA vs f64: worst rel {worst:.2e}   "
              f"(recurrent fp32 CUDA: {worst_r:.2e})", flush=True)
    return recs


def long_numerics(dev, T=65536) -> list[dict]:
    recs = []
    H, D = 2, 64
    for name in ("gated_deltanet", "gla", "mamba2", "kda"):
        for case in ("strong", "none", "zero_runs"):
            x = fw.example_inputs(name, batch_size=1, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float32,
                                  device=dev, seed=0)
            x.pop("initial_state", None)
            g = x["g"]
            if case == "strong":
                x["g"] = torch.full_like(g, -5.0)
            elif case == "none":
                x["g"] = torch.zeros_like(g)
            else:  # alternating runs of 1000 tokens without decay and with ordinary decay
                run = (torch.arange(T, device=dev) // 1000) % 2 == 0
                x["g"] = torch.where(run.view(1, T, *([1] * (g.dim() - 2))), torch.zeros_like(g), g)
            lo = {k: (v.to(torch.bfloat16) if k in ("q", "k", "v") else v) for k, v in x.items()}
            # the fp32 reference reads the same bf16-rounded q, k, v: what is left is the arithmetic
            o32, _ = fw.chunk(name, **{k: v.float() for k, v in lo.items()})
            o16, s16 = fw.chunk(name, output_final_state=True, **lo)
            r = {"model": name, "case": case, "T": T, "finite": bool(torch.isfinite(o16).all()),
                 "state_finite": bool(torch.isfinite(s16).all()), "rel_vs_fp32": rel(o16.float(), o32)}
            recs.append(r)
            print(f"long bf16 {name:15s} {case:9s} finite={r['finite']} rel vs fp32 = {r['rel_vs_fp32']:.2e}",
                  flush=True)
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["ours", "peers"], required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: check that the script itself runs")
    ap.add_argument("--models", nargs="+", default=["deltanet", "gated_deltanet", "gla", "kda"],
                    help="peers stage: the models timed beside fla (its first call of each op autotunes for minutes)")
    args = ap.parse_args()
    if args.smoke:
        global LINEAR
        LINEAR = LINEAR[:2] + ["kda"]
        correctness(torch.device("cpu"))
        long_numerics(torch.device("cpu"), T=300)
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
        dump(args.out, "correctness.json", correctness(dev))
        dump(args.out, "long_bf16.json", long_numerics(dev))
        run_speed(models=["gated_deltanet", "deltanet", "gla", "kda", "retnet", "mamba2", "linear_attention",
                          "comba", "deltaproduct"], forms=["chunk"], out_dir=os.path.join(args.out, "speed"),
                  peers=True, **shape)
        run_speed(models=["gated_deltanet", "gla", "kda"], forms=["chunk_compile"],
                  out_dir=os.path.join(args.out, "speed_compile"), peers=False, **shape)
        from fastweights.bench.decode import DecodeBenchConfig, run_decode
        run_decode(DecodeBenchConfig(contexts=(1024, 4096, 16384, 65536), d_model=1024, n_layers=4, num_heads=8,
                                     head_dim=128, vocab_size=4096, new_tokens=32, repeats=3, device="cuda",
                                     dtype="bfloat16", prefill_chunk=4096, out=os.path.join(args.out, "decode")))
    else:
        run_speed(models=args.models, forms=["chunk"], out_dir=args.out, peers=True, **shape)


if __name__ == "__main__":
    main()
