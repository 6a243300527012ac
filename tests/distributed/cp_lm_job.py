"""Run under torchrun (gloo, CPU): an LM of every mixer that context parallelism serves, in float64, with its
short convolutions, its sequences split over the ranks into spans that do not align to the chunk size, packed
documents (position_ids restarting at 0, one restart exactly at a span boundary) and one row without: each
rank's logits and every parameter's gradient (summed over the ranks) against one process.
argv: seed, out file (rank 0 writes one JSON line per model: the largest relative errors)."""

import json
import sys

import torch
import torch.distributed as dist

import fastweights as fw
from fastweights.distributed import ContextParallel, span_bounds, supports
from fastweights.models import LM, LMConfig
from tests.helpers import rel_err

torch.set_num_threads(1)
dist.init_process_group("gloo")
seed, out = int(sys.argv[1]), sys.argv[2]
cp = ContextParallel()
N = cp.size
T = 29
bounds = span_bounds(T, N)
results = []
for name in fw.zoo.names():
    if supports(fw.zoo.resolve(name)) is not None:
        continue
    torch.manual_seed(seed)
    lm = LM(LMConfig(vocab_size=32, d_model=16, n_layers=2, num_heads=2, mixer=name, chunk_size=4)).double()
    ids = torch.randint(0, 32, (2, T))
    pos = torch.arange(T).repeat(2, 1)
    cut = [5, bounds[1], bounds[1] + 3]  # documents start at 5, at rank 1's first token, and 3 tokens later
    for c in cut:
        pos[0, c:] = torch.arange(T - c)
    w = torch.randn(2, T, 32, dtype=torch.float64)
    for rows, p in (("packed", pos), ("plain", None)):
        ref = lm(ids, position_ids=p)
        ref_grads = torch.autograd.grad((ref * w).sum(), list(lm.parameters()), allow_unused=True)
        got = lm(cp.shard(ids), position_ids=cp.shard(p) if p is not None else None, context=cp)
        grads = torch.autograd.grad((got * cp.shard(w)).sum(), list(lm.parameters()), allow_unused=True)
        errs = [rel_err(got, cp.shard(ref))]
        g_err = 0.0
        for g, gr in zip(grads, ref_grads):
            g = torch.zeros_like(gr) if g is None else g.clone()
            dist.all_reduce(g)
            g_err = max(g_err, rel_err(g, gr) if gr is not None else 0.0)
        e = torch.tensor([errs[0], g_err], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        results.append({"model": name, "rows": rows, "logits": e[0].item(), "grads": e[1].item()})
if cp.rank == 0:
    with open(out, "w") as fh:
        fh.write("".join(json.dumps(x) + "\n" for x in results))
dist.destroy_process_group()
