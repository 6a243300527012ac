"""How much of an LM training step is the host's: the same step eager and replayed from one CUDA graph (issue 32).

    python3 scripts/gpu_step_graph.py [--out DIR] [--shapes 8x2048 4x4096] [--models gated_deltanet softmax_attention]
    python3 scripts/gpu_step_graph.py --smoke      # on the CPU: the eager half only (no CUDA graphs there)

For each model and B×T, `LM(LMConfig(...)).to(device)` at the gpu-125m preset's shape (d_model 768, 12 layers, 6 heads
of 128, vocab 256), the step `fastweights bench train` times (bf16 autocast forward, fp32 cross-entropy, backward, fused
AdamW), timed with device events, median of --steps after --warmup:

    eager ms     the step as `bench train` and `fastweights train` run it
    graphed ms   the same step captured once in a CUDA graph (PyTorch's whole-network recipe: warm-up steps on a
                 side stream, gradients set to None before the capture, AdamW capturable, autocast without its
                 cache) and replayed on fresh token ids copied into the static input
    host share   1 − graphed / eager: the part of the eager step in which the GPU waited for launches

A capture that fails (a host synchronization inside the step, ...) is recorded with its error. Writes step_graph.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

_src = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.abspath(_src))

from fastweights.bench.speed import step_times  # noqa: E402
from fastweights.models import LM, LMConfig  # noqa: E402


def one(model: str, B: int, T: int, args, device) -> dict:
    cfg = LMConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers, num_heads=args.num_heads,
                   head_dim=args.head_dim, mixer=model)
    lm = LM(cfg).to(device)
    lm.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=cuda, capturable=cuda)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)

    def body(cache: bool = True):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda, cache_enabled=cache):
            logits = lm(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss

    def eager():
        ids.copy_(torch.randint(0, cfg.vocab_size, ids.shape, device=device))
        body()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        eager()
    row = dict(model=model, B=B, T=T, eager_ms=statistics.median(step_times(eager, device, args.steps)))
    if cuda:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    opt.zero_grad(set_to_none=True)
                    body(cache=False)
            torch.cuda.current_stream().wait_stream(side)
            opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_loss = body(cache=False)

            def replay():
                ids.copy_(torch.randint(0, cfg.vocab_size, ids.shape, device=device))
                graph.replay()

            for _ in range(3):
                replay()
            row["graphed_ms"] = statistics.median(step_times(replay, device, args.steps))
            row["graphed_loss_finite"] = bool(torch.isfinite(static_loss).item())
            row["host_share"] = 1 - row["graphed_ms"] / row["eager_ms"]
        except Exception as e:  # noqa: BLE001 — recorded, the run goes on
            row["graph_error"] = f"{type(e).__name__}: {e}"[:400]
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if cuda:  # the model, optimizer and graph go with this frame
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/step_graph"))
    p.add_argument("--models", nargs="+", default=["gated_deltanet", "softmax_attention"])
    p.add_argument("--shapes", nargs="+", default=["8x2048", "4x4096"])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--src", help="import fastweights from this directory instead")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.shapes, args.d_model, args.n_layers, args.num_heads, args.head_dim = ["2x32"], 32, 2, 2, 16
        args.warmup, args.steps = 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes:
        B, T = (int(x) for x in shape.lower().split("x"))
        for model in args.models:
            try:
                r = one(model, B, T, args, device)
            except Exception as e:  # noqa: BLE001
                r = dict(model=model, B=B, T=T, error=f"{type(e).__name__}: {e}"[:400])
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "step_graph.json"), "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
