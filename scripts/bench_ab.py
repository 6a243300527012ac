"""Side-by-side CPU timing of two source trees of fastweights (e.g. before and after a refactor),
interleaved in one run on one machine so both see the same load.

    git worktree add --detach /tmp/before <commit>
    python3 scripts/bench_ab.py --trees /tmp/before . --models gated_deltanet gla --lengths 1024 4096

Each (tree, round) runs in its own subprocess (a tree's `fastweights` is the one imported from
its root) with one intra-op thread, times the chunk form's forward+backward of every model at
every length (fresh random inputs, B=1, H=4, D=64, fp32; `--forward-only`: the forward alone
with gradients off), and prints per tree and row the
fastest and the median of all repeats over all rounds, and the ratio of the fastest times
(tree 2 / tree 1). The fastest is the figure least disturbed by other load on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
import fastweights as fw
models, lengths, repeats, form, forward_only = json.loads(sys.argv[1])
out = {}
for m in models:
    for T in lengths:
        x = fw.example_inputs(m, batch_size=1, seq_len=T, num_heads=4, head_dim=64, requires_grad=not forward_only)
        state = x.pop("initial_state", None)
        def run():
            with torch.set_grad_enabled(not forward_only):
                o, _ = getattr(fw, form)(m, initial_state=state, **x)
            if not forward_only:
                o.sum().backward()
        run()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter(); run(); times.append(1e3 * (time.perf_counter() - t0))
        out[f"{m} T={T}"] = times
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, help="two source trees (repository roots)")
    ap.add_argument("--models", nargs="+", default=["gated_deltanet", "deltanet", "gla", "kda", "retnet", "mamba2"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--form", default="chunk", choices=["chunk", "recurrent", "parallel"])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per row and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two trees")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone, gradients off")
    ap.add_argument("--out", default=None, help="also write the table (Markdown) here")
    a = ap.parse_args(argv)
    for t in a.trees:
        if not (Path(t) / "fastweights" / "__init__.py").is_file():
            ap.error(f"--trees: {t} is not a fastweights source tree")
    if a.repeats < 1 or a.rounds < 1:
        ap.error("--repeats and --rounds must be ≥ 1")
    arg = json.dumps([a.models, a.lengths, a.repeats, a.form, a.forward_only])
    times: list[dict[str, list[float]]] = [{}, {}]
    for r in range(a.rounds):
        for i, tree in enumerate(a.trees):
            res = subprocess.run([sys.executable, "-c", CHILD, arg], cwd=tree, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{tree}: {res.stderr.strip().splitlines()[-1]}")
            for row, ts in json.loads(res.stdout.strip().splitlines()[-1]).items():
                times[i].setdefault(row, []).extend(ts)
            print(f"round {r + 1}: {tree} done", file=sys.stderr)
    what = "fwd (no grad)" if a.forward_only else "fwd+bwd"
    lines = [f"| {a.form} {what}, CPU, 1 thread | {a.trees[0]} fastest / median ms | {a.trees[1]} fastest / median ms "
             "| ratio of fastest |", "|---|---:|---:|---:|"]
    for row in times[0]:
        t0, t1 = times[0][row], times[1][row]
        lines.append(f"| {row} | {min(t0):.1f} / {statistics.median(t0):.1f} | {min(t1):.1f} / "
                     f"{statistics.median(t1):.1f} | {min(t1) / min(t0):.2f} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
