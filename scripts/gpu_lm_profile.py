"""Where one LM training step spends its GPU time: the preset's gated DeltaNet against the transformer of its shape
(issue 32, "the LM step, not only the op").

    python3 scripts/gpu_lm_profile.py [--out DIR] [--shapes 8x2048 4x4096] [--models gated_deltanet softmax_attention]
    python3 scripts/gpu_lm_profile.py --smoke        # tiny shapes on the CPU: checks the script itself

For each model and B×T it builds `LM(LMConfig(...)).to(device)` at the `gpu-125m` preset's shape (d_model 768,
12 layers, 6 heads of 128, bytes vocab 256; --d-model etc. change it), runs the step `fastweights bench train`
times (bf16 autocast forward, fp32 cross-entropy, backward, fused AdamW), `--warmup` untimed steps, then
`--steps` steps under `torch.profiler`, and reports per step:

    wall ms       host clock around the profiled steps, synchronized, divided by the steps
    gpu busy ms   the sum of the device kernels' durations (overlapping kernels would count twice; one stream here)
    idle %        1 − busy / wall: the share of the step the GPU waits on the host (launch-bound when large)
    launches      device kernels launched per step
    by class      the kernels' time summed by what they do (triton memory kernels named by their function,
                  GEMMs, attention, elementwise / reductions, copies, optimizer), and the top kernels by name

Writes lm_profile.json and lm_profile.txt under --out ($OUT by default).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

# --src DIR: import fastweights from DIR (an older tree timed side by side with this one)
_src = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.abspath(_src))

from fastweights.models import LM, LMConfig  # noqa: E402

#: (class, pattern on the kernel's name), first match wins
CLASSES = (
    ("attention (flash/sdpa)", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|sm90_xmma|sm80_xmma|nvjet|cublas|wgmma|matmul"),
    ("optimizer", r"adam|multi_tensor"),
    ("triton: fastweights", r"^_?(fw_|_fw|chunk|delta|gated|wy|conv|rms|norm|prologue|fused|stage|scan|kkt|solve"
                            r"|inter|intra|state|recur|grads|reverse|inverse|output)"),
    ("triton: other", r"^triton_|^_triton"),
    ("copy / cast", r"copy|cast|cat|memcpy|memset|fill"),
    ("softmax / loss", r"softmax|nll|log_softmax|cross_entropy"),
    ("reduction", r"reduce|sum|mean|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)


#: host-side calls that block on the device or stall the launch queue (synchronizations, allocator, scalar reads)
HOST_WAITS = ("Synchronize", "cudaMalloc", "cudaFree", "aten::item", "_local_scalar_dense", "aten::nonzero",
              "cudaMemcpy", "cudaHostAlloc", "cudaEventSynchronize")


def _classify(name: str) -> str:
    low = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, low):
            return cls
    return "other"


def _step_fn(lm, opt, vocab, B, T, device, bf16):
    def step():
        ids = torch.randint(0, vocab, (B, T + 1), device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = lm(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def profile_one(model, B, T, args, device) -> dict:
    cfg = LMConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers, num_heads=args.num_heads,
                   head_dim=args.head_dim, mixer=model)
    lm = LM(cfg).to(device)
    lm.train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=device.type == "cuda")
    step = _step_fn(lm, opt, args.vocab_size, B, T, device, device.type == "cuda")
    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if device.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name][0] += ev.device_time / 1e3 / args.steps
            kernels[ev.name][1] += 1
    host = collections.defaultdict(lambda: [0.0, 0])  # the host calls that wait on or stall the GPU
    for ev in prof.key_averages():
        if any(w in ev.key for w in HOST_WAITS):
            host[ev.key] = [ev.cpu_time_total / 1e3 / args.steps, ev.count // args.steps]
    busy = sum(v[0] for v in kernels.values())
    by_class = collections.Counter()
    for name, (ms, _) in kernels.items():
        by_class[_classify(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
    out = dict(model=model, label=args.label, B=B, T=T, wall_ms=wall, busy_ms=busy,
               idle=1 - busy / wall if wall else None,
               launches=sum(v[1] for v in kernels.values()) / args.steps,
               by_class={k: round(v, 3) for k, v in by_class.most_common()},
               host={k: (round(v[0], 3), v[1]) for k, v in sorted(host.items(), key=lambda kv: -kv[1][0])},
               top=[(n[:110], round(v[0], 3), v[1] // args.steps) for n, v in top],
               params=lm.num_parameters(), routes=sorted({str(r) for m in lm.modules() for r in
                                                          [getattr(m, "routes", None)] if r}))
    del lm, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _fmt(r: dict) -> str:
    tag = f" [{r['label']}]" if r.get("label") else ""
    lines = [f"## {r['model']}{tag} B={r['B']} T={r['T']}: wall {r['wall_ms']:.1f} ms, GPU busy {r['busy_ms']:.1f} ms "
             f"(idle {100 * (r['idle'] or 0):.0f} %), {r['launches']:.0f} kernels a step, "
             f"{r['params'] / 1e6:.1f}M params"]
    waits = ", ".join(f"{k} {v[0]:.1f} ({v[1]})" for k, v in r["host"].items())
    lines.append("  host waits (ms, calls a step): " + waits)
    lines.append("  by class: " + ", ".join(f"{k} {v:.1f}" for k, v in r["by_class"].items()))
    for name, ms, n in r["top"]:
        lines.append(f"  {ms:8.2f} ms  {n:5d}×  {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/lm_profile"))
    p.add_argument("--models", nargs="+", default=["gated_deltanet", "softmax_attention"])
    p.add_argument("--shapes", nargs="+", default=["8x2048", "4x4096"])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--src", help="import fastweights from this directory instead (an older tree, side by side)")
    p.add_argument("--label", default="", help="a tag written into each row (e.g. 'base' for --src)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.d_model, args.n_layers, args.num_heads, args.head_dim = ["2x32"], 32, 2, 2, 16
        args.warmup, args.steps = 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes:
        B, T = (int(x) for x in shape.lower().split("x"))
        for model in args.models:
            try:
                r = profile_one(model, B, T, args, device)
            except Exception as e:  # noqa: BLE001 — a failed row is recorded, the run goes on
                r = dict(model=model, B=B, T=T, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(r)
            text = r.get("error") or _fmt(r)
            print(text if "error" not in r else f"## {model} {B}x{T}: {text}", flush=True)
            with open(os.path.join(args.out, f"lm_profile{args.label and '_' + args.label}.json"), "w") as f:
                json.dump(rows, f, indent=1)
            with open(os.path.join(args.out, "lm_profile.txt"), "a") as f:
                f.write((text if "error" not in r else f"## {model} {B}x{T}: {text}") + "\n\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
