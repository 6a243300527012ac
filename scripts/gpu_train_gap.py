"""Where `fastweights train --cuda-graph` loses to `fastweights bench train --cuda-graph` (issue 32): the preset's
step taken apart, one factor at a time, on the product's own `GraphedLMStep`.

    python3 scripts/gpu_train_gap.py [--out DIR] [--data README.md docs BENCHMARKS.md] [--steps 8]
    python3 scripts/gpu_train_gap.py --smoke       # on the CPU: tiny shapes, every case eager (checks the script)

The model is `fastweights train --preset gpu-125m`'s (its config, the byte tokenizer's vocabulary, the preset's AdamW
and grad clip); the windows are the train command's (`read_stream` → `split_stream` → `Windows`, the run's sample
order). Each case is one GraphedLMStep, captured after its warm-up and replayed `--steps` times (device events,
median and min), on fresh windows each replay:

    bench        M 1, B 8: what `bench train --cuda-graph --shapes 8,2048` times (every next token supervised)
    joined       M 8, B 8: the preset's 8 micro-batches, documents joined (no varlen path)
    separate     M 8, B 8, packed documents: max_documents = the most any micro-batch of the windows packs (what
                 `train --cuda-graph` now uses), the position_ids copied in
    separate-1   M 1, B 8, packed documents (the varlen cost without the accumulation)

tokens/s = M·B·T / step time. Then (`--profile`) one eager micro-batch of "bench" and of "separate-1" under
torch.profiler, and the same for the transformer of the preset's shape (softmax_attention; --profile-mixers): GPU
time by kernel name and by class (GEMMs, attention, the conv, norms, the memory's kernels, copies and casts, ...;
kernel durations do not depend on the replay). Writes train_gap.json under --out ($OUT by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from fastweights.bench.speed import step_times  # noqa: E402
from fastweights.models import LM, LMConfig  # noqa: E402
from fastweights.pretrain import loop as ploop  # noqa: E402
from fastweights.pretrain.config import PretrainConfig  # noqa: E402
from fastweights.pretrain.data import Windows, load_tokenizer, read_stream, split_stream  # noqa: E402
from fastweights.training import step as training_step  # noqa: E402
from fastweights.training.graphed import GraphedLMStep  # noqa: E402


def setup(args):
    over = dict(preset="gpu-125m", data=args.data, device="cuda" if not args.smoke else "cpu")
    if args.smoke:
        over.update(model=dict(d_model=32, n_layers=2, num_heads=2, head_dim=16, head_v_dim=16,
                               mixer="gated_deltanet"), seq_len=64, batch_size=8, grad_accum=4, dtype="float32")
    cfg = PretrainConfig.build(over)
    tok = load_tokenizer(cfg.tokenizer)
    stream = read_stream(cfg.data, tok, cfg.text_key)
    tw = Windows(split_stream(stream, 0.01, tok.eos_id)[0], cfg.seq_len, tok.eos_id, seed=cfg.seed)
    return cfg, tok, tw


def windows(tw: Windows, cfg, M: int, B: int, s: int) -> dict:
    """Step s's M micro-batches of B windows, stacked: input_ids, labels, position_ids [M, B, T] (CPU)."""
    first = s * M * B
    bs = [tw.batch([tw.order(j) for j in range(first + m * B, first + (m + 1) * B)]) for m in range(M)]
    return {k: torch.stack([b[k] for b in bs]) for k in ("input_ids", "labels", "position_ids")}


def most_documents(tw: Windows, M: int, B: int, steps: int) -> int:
    per = tw.documents()
    idx = np.array([tw.order(j) for j in range(steps * M * B)], np.int64).reshape(steps * M, B)
    return int(per[idx].sum(1).max())


def case(name: str, cfg, tok, tw, M: int, B: int, docs: bool, args, device) -> dict:
    torch.manual_seed(0)
    lm = LM(ploop.run_lm_config(cfg, tok)).to(device)
    opt = training_step.adamw(lm, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    n_steps = args.warmup + args.steps + 2
    N = most_documents(tw, M, B, n_steps) if docs else None
    dt = torch.bfloat16 if cfg.dtype == "bfloat16" else None
    g = GraphedLMStep(lm, opt, (M, B, cfg.seq_len + 1), autocast_dtype=dt, grad_clip=cfg.grad_clip,
                      capture=device.type == "cuda", max_documents=N)
    batches = [windows(tw, cfg, M, B, s) for s in range(n_steps)]
    if device.type == "cuda":
        batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
    it = iter(range(n_steps))

    def one():
        b = batches[next(it)]
        return g.step_labeled(b["input_ids"], b["labels"], b["position_ids"] if docs else None)

    for _ in range(args.warmup):
        one()
    times = step_times(one, device, args.steps)
    med = statistics.median(times)
    tokens = M * B * cfg.seq_len
    row = dict(case=name, M=M, B=B, T=cfg.seq_len, max_documents=N, graphed=g.graphed, ms=med, min_ms=min(times),
               tokens_per_s=tokens / med * 1e3, loss=float(one()))
    g.close()
    return row


#: kernel-name fragments → class (first match wins), for the profiles' by-class sums
CLASSES = (("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce", "sm90_xmma")),
           ("attention", ("flash", "fmha", "attn")), ("conv", ("_conv_",)), ("norm", ("_norm_", "rms", "layer_norm")),
           ("prologue", ("_prologue",)), ("rope", ("_rope",)), ("copies and casts", ("copy", "Cat", "cat_")),
           ("elementwise", ("elementwise", "Functor", "silu", "where")), ("reductions", ("reduce",)))


def kernel_class(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return "memory kernels" if name.startswith("_") else "other"  # (our Triton kernels' names start with _)


def profile(name: str, cfg, tok, tw, docs: bool, device, mixer: str | None = None) -> dict:
    """GPU µs by kernel name over one eager micro-batch (forward + backward, bf16 autocast) of B 8, and by class
    (`kernel_class`). mixer: another mixer in the preset's LM (the transformer of its shape: softmax_attention)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.manual_seed(0)
    lcfg = ploop.run_lm_config(cfg, tok)
    if mixer is not None:
        lcfg = LMConfig.from_dict({**lcfg.to_dict(), "mixer": mixer})
    lm = LM(lcfg).to(device)
    b = {k: v.to(device) for k, v in windows(tw, cfg, 1, 8, 0).items()}
    N = most_documents(tw, 1, 8, 4) if docs else None
    kw = {"position_ids": b["position_ids"][0], "max_documents": N} if docs else {}

    def step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = lm(b["input_ids"][0], **kw)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b["labels"][0].flatten()).backward()

    for _ in range(2):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    by = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) or 0
        if t and e.device_type.name == "CUDA":
            by[e.key] = by.get(e.key, 0.0) + t
    classes: dict[str, float] = {}
    for k, v in by.items():
        classes[kernel_class(k)] = classes.get(kernel_class(k), 0.0) + v
    return dict(case=name, mixer=lcfg.mixer, total_us=sum(by.values()),
                classes=dict(sorted(classes.items(), key=lambda kv: -kv[1])),
                kernels=sorted(by.items(), key=lambda kv: -kv[1])[:40])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/train_gap"))
    p.add_argument("--data", nargs="+", default=["README.md", "docs", "BENCHMARKS.md"])
    p.add_argument("--cases", nargs="*", default=["bench", "joined", "separate", "separate-1"])
    p.add_argument("--profile-only", action="store_true", help="no timed cases: the profiles alone")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-mixers", nargs="*", default=["softmax_attention"],
                   help="other mixers profiled in the preset's LM beside its own (the transformer of its shape)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.warmup, args.steps = 1, 2
    cfg, tok, tw = setup(args)
    os.makedirs(args.out, exist_ok=True)
    shapes = {"bench": (1, False), "joined": (8, False), "separate": (8, True), "separate-1": (1, True)}
    rows = []

    def save():
        with open(os.path.join(args.out, "train_gap.json"), "w") as f:
            json.dump(rows, f, indent=1)

    micro = cfg.batch_size // cfg.grad_accum
    for name in ([] if args.profile_only else args.cases):
        M, docs = shapes[name]
        M = M if M == 1 else cfg.grad_accum
        try:
            r = case(name, cfg, tok, tw, M, micro, docs, args, device)
        except Exception as e:  # noqa: BLE001 — recorded, the run goes on
            r = dict(case=name, error=f"{type(e).__name__}: {e}"[:400])
        rows.append(r)
        print(json.dumps(r), flush=True)
        save()
        if device.type == "cuda":  # the case's model, optimizer and graph are gone with its frame
            torch.cuda.empty_cache()
    if args.profile:
        for name, docs, mixer in (("bench", False, None), ("separate-1", True, None),
                                  ("bench", False, "softmax_attention")):
            if mixer is not None and mixer not in args.profile_mixers:
                continue
            r = profile(name, cfg, tok, tw, docs, device, mixer)
            rows.append(r)
            print(json.dumps({k: r[k] for k in ("case", "mixer", "total_us", "classes")}), flush=True)
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
