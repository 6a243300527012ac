"""Run under torchrun (gloo, CPU): every zoo model that context parallelism serves, in float64, odd T split
into spans that do not align to the chunk size: each rank's outputs, the final state and every gradient
(q, k, v, the per-token inputs, the initial state) against one process running the whole sequence.
argv: seed, out file (rank 0 writes one JSON line per model: the largest relative errors)."""

import json
import sys

import torch
import torch.distributed as dist

import fastweights as fw
from fastweights.distributed import ContextParallel, chunk, supports
from tests.helpers import make_case, rel_err

torch.set_num_threads(1)
dist.init_process_group("gloo")
seed, out = int(sys.argv[1]), sys.argv[2]
cp = ContextParallel()
results = []
for name in fw.zoo.names():
    r = fw.zoo.resolve(name)
    if supports(r) is not None:
        continue
    T, C = 23, 5
    inputs, state = make_case(name, T=T, B=2, H=2, K=4, V=3, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    o_ref, f_ref = fw.chunk(name, **inputs, initial_state=state, output_final_state=True, chunk_size=C)
    w_o = torch.randn(o_ref.shape, generator=g, dtype=o_ref.dtype)
    w_f = torch.randn(f_ref.shape, generator=g, dtype=f_ref.dtype)
    leaves = [x for x in inputs.values() if x.requires_grad] + [state]
    ref_grads = torch.autograd.grad((o_ref * w_o).sum() + (f_ref * w_f).sum(), leaves)

    mine = {n: cp.shard(x.detach()).requires_grad_(True) for n, x in inputs.items()}
    st = state.detach().requires_grad_(True)
    o, f = chunk(name, **mine, initial_state=st, output_final_state=True, chunk_size=C, context=cp)
    loss = (o * cp.shard(w_o)).sum() + ((f * w_f).sum() if cp.rank == cp.size - 1 else 0.0)
    grads = torch.autograd.grad(loss, [mine[n] for n in inputs if inputs[n].requires_grad] + [st])
    g_state = grads[-1].clone()
    dist.all_reduce(g_state)  # the initial state feeds every rank's scan: its gradient is the sum
    errs = {"o": rel_err(o, cp.shard(o_ref)), "final": rel_err(f, f_ref), "d_initial_state": rel_err(g_state,
                                                                                                   ref_grads[-1])}
    for n, gr, ref in zip([n for n, x in inputs.items() if x.requires_grad], grads[:-1], ref_grads[:-1]):
        errs["d" + n] = rel_err(gr, cp.shard(ref))
    errs = {k: torch.tensor(v, dtype=torch.float64) for k, v in errs.items()}
    for v in errs.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    results.append({"model": name, **{k: v.item() for k, v in errs.items()}})
if cp.rank == 0:
    with open(out, "w") as fh:
        fh.write("".join(json.dumps(x) + "\n" for x in results))
dist.destroy_process_group()
