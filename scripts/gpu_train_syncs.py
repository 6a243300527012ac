"""Where `fastweights train` makes the host wait for the GPU (issue 32): a short run of the gpu-125m preset's model
kind (gated DeltaNet, bf16 autocast; --d-model/--layers to shrink it) under `torch.cuda.set_sync_debug_mode("warn")`,
each synchronizing call counted by the fastweights lines that made it (innermost first).

    python3 scripts/gpu_train_syncs.py --out runs/syncs [--steps 6 --grad-accum 4]

A sync empties the queue of kernel launches the host had built up ahead of the GPU; a launch-bound fast-weight LM
then idles the GPU while the host launches again. The loop should make one a step (the losses, read after the
optimizer step is queued); the setup's (model build, first compiles) show as counts of 1. Writes syncs.json (and
prints the table): {"steps": n, "sites": [[count, "file:line <- file:line ..."], ...]}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import traceback
import warnings

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/syncs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import torch

    from fastweights.pretrain.config import PretrainConfig
    from fastweights.pretrain.loop import train

    os.makedirs(a.out, exist_ok=True)
    counts: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}fastweights{os.sep}" in f.filename]
        where = " <- ".join(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}" for f in frames[::-1][:4])
        counts[where or f"{filename}:{lineno}"] += 1

    heads = max(1, a.d_model // 128)
    with tempfile.TemporaryDirectory() as out:
        cfg = PretrainConfig(data=[os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs")], out=out,
                             model=dict(d_model=a.d_model, n_layers=a.layers, num_heads=heads, head_dim=128,
                                        head_v_dim=128, mixer="gated_deltanet"),
                             seq_len=a.seq_len, batch_size=2 * a.grad_accum, grad_accum=a.grad_accum, steps=a.steps,
                             lr=1e-3, warmup=0.0, val_every=10**6, save_every=10**6, val_fraction=0.05,
                             dtype="bfloat16", device=a.device, progress="none")
        warnings.showwarning = show
        warnings.simplefilter("always")
        if a.device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("warn")
        train(cfg, fresh=True)
        if a.device.startswith("cuda"):
            torch.cuda.set_sync_debug_mode(0)
    sites = counts.most_common()
    with open(os.path.join(a.out, "syncs.json"), "w") as f:
        json.dump({"steps": a.steps, "grad_accum": a.grad_accum, "sites": sites}, f, indent=1)
    print(f"{sum(counts.values())} syncs in {a.steps} steps of {a.grad_accum} micro-batches:")
    for where, n in sites:
        print(f"{n:6d}  {where}")


if __name__ == "__main__":
    main()
