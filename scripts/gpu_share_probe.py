"""How many MQAR cells one GPU trains at once: N worker processes each repeat one cell's training step
(eager, or captured in one CUDA graph) for a fixed wall time; the aggregate steps/s against N says whether
the sweep's `--workers` buys throughput (launch-bound eager steps leave the GPU idle between kernels; graphed
steps time-slice between processes' contexts without MPS).

    python3 scripts/gpu_share_probe.py --models gated_deltanet ttt_mlp --workers 1 2 4 8 --seconds 8

Prints one row per (model, mode, N): steps/s of each worker and their sum, and the speed-up over N = 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights


def _worker(model: str, L: int, graph: bool, seconds: float, start, q):
    import torch
    import torch.nn.functional as F

    from fastweights.lab.mqar import PRESETS, build_model, cell_data, make_cells
    from fastweights.lab.train import IGNORE_INDEX

    cell = next(c for c in make_cells(PRESETS["ceilings"], models=[model], lrs=[1e-3])
                if c.train_segments[-1][0] == L)
    n = cell.train_segments[-1][1]
    small = dataclasses.replace(cell, train_segments=((L, n, cell.batch_size),), test_segments=((L, n, 1),))
    (x, y), _ = cell_data(small)
    x, y = x.cuda(), y.cuda()
    torch.manual_seed(0)
    net = build_model(small).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=graph)

    def body():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x).float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        opt.step()
        return loss

    def eager():
        opt.zero_grad(set_to_none=True)
        body()

    for _ in range(3):
        eager()
    step = eager
    if graph:
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            body()
        step = g.replay
    torch.cuda.synchronize()
    start.wait()
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        count += 1
        if count % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    q.put(count / (time.perf_counter() - t0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gated_deltanet", "ttt_mlp"])
    ap.add_argument("--seq-len", type=int, default=256, help="the cell's L (a ceilings setting: 64 ... 1024)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    print("| model | L | mode | workers | steps/s each | steps/s total | × one worker |", flush=True)
    print("|---|---:|---|---:|---|---:|---:|", flush=True)
    for model in a.models:
        for mode in a.modes:
            base = None
            for n in a.workers:
                start, q = ctx.Barrier(n), ctx.Queue()
                procs = [ctx.Process(target=_worker, args=(model, a.seq_len, mode == "graph", a.seconds, start, q))
                         for _ in range(n)]
                for p in procs:
                    p.start()
                rates = [q.get() for _ in procs]
                for p in procs:
                    p.join()
                total = sum(rates)
                base = base or total
                each = " ".join(f"{r:.0f}" for r in sorted(rates))
                print(f"| {model} | {a.seq_len} | {mode} | {n} | {each} | {total:.0f} | {total / base:.2f}× |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
