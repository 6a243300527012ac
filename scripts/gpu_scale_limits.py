"""What limits data parallelism at the gpu-125m preset (issue 33: DDP 1.77× and FSDP2 1.16× on 2 GPUs, goal 1.9×):
the same optimizer step with its communication on and off, and with and without packed documents.

    torchrun --standalone --nproc_per_node 2 scripts/gpu_scale_limits.py --out $OUT     # the 2-rank rows
    python3 scripts/gpu_scale_limits.py --out $OUT                                       # the 1-GPU rows
    python3 scripts/gpu_scale_limits.py --smoke                                          # CPU, tiny: the script itself

The preset's LM (gated DeltaNet, d_model 768, 12 layers, 6 heads of 128, vocab 256, bf16 autocast, fused AdamW) takes
steps of 64 sequences of 2,048 tokens in micro-batches of 8, split over the ranks (8 micro-batches a step on one GPU,
4 on each of two), through the library's own `training.loop.wrap` and `no_sync` as `fastweights train` runs them.
Per rank count, the step's median time (device events, after a barrier) for:

    plain           one GPU (1 rank only)
    ddp             DDP, gradients all-reduced with the last micro-batch's backward (as `fastweights train`)
    ddp-nocomm      the same step with every micro-batch under no_sync: no all-reduce at all (compute + host only)
    fsdp            FSDP2 as `fastweights train --parallel fsdp` (reshard after forward: weights regathered per
                    micro-batch's forward and backward)
    fsdp-keep       FSDP2 with reshard_after_forward=False (weights gathered once per micro-batch's forward)

each with `docs` off (plain token windows, as `bench train`) and on (position_ids restarting at random document
starts, mean length 512, as `fastweights train`'s packed data: the layers then run their varlen path). The rows
say tokens/s of the whole step (all ranks) and, against `ddp-nocomm`, what the communication costs. Rank 0 writes
scale_limits_<world>.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from fastweights.bench.speed import step_times  # noqa: E402
from fastweights.models import LM, LMConfig  # noqa: E402
from fastweights.training.loop import no_sync, wrap  # noqa: E402


def _positions(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """position_ids [B, T] restarting at 0 at random document starts (geometric lengths, mean 512)."""
    starts = torch.rand(B, T, generator=gen) < 1 / 512
    starts[:, 0] = True
    idx = torch.arange(T).expand(B, T)
    last = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - last


def one(mode: str, docs: bool, args, device, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=args.d_model, n_layers=args.n_layers, num_heads=args.num_heads,
                   head_dim=args.head_dim, mixer="gated_deltanet")
    lm = LM(cfg).to(device)
    lm.train()
    if mode.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        keep = mode == "fsdp-keep"
        for block in lm.blocks:
            fully_shard(block, reshard_after_forward=not keep)
        model = fully_shard(lm, reshard_after_forward=not keep)
    elif mode.startswith("ddp"):
        model = wrap(lm, "ddp", device)
    else:
        model = lm
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    M = args.global_batch // args.micro_batch // world
    gen = torch.Generator().manual_seed(1 + rank)
    bf16 = device.type == "cuda"

    def micro():
        ids = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
        pos = _positions(args.micro_batch, args.seq_len, gen) if docs else None
        return ids.to(device), None if pos is None else pos.to(device)

    def step():
        for m in range(M):
            ids, pos = micro()
            last = m == M - 1 and mode != "ddp-nocomm"
            with no_sync(model, last):
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(ids[:, :-1], position_ids=pos)
                loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()) / M
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = step_times(step, device, args.steps, before=dist.barrier if world > 1 else None)
    ms = statistics.median(times)
    if world > 1:  # the slowest rank's median sets the pace
        t = torch.tensor([ms], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    tokens = args.global_batch * args.seq_len
    if device.type == "cuda":  # the model and optimizer go with this frame
        torch.cuda.empty_cache()
    return dict(world=world, mode=mode, docs=docs, step_ms=ms, tokens_per_s=tokens / ms * 1e3, micro_per_rank=M)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/scale_limits"))
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.d_model, args.n_layers, args.num_heads, args.head_dim = 32, 2, 2, 16
        args.seq_len, args.micro_batch, args.global_batch, args.warmup, args.steps = 64, 2, 4, 1, 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    modes = args.modes or (["plain"] if world == 1 else ["ddp", "ddp-nocomm", "fsdp", "fsdp-keep"])
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for docs in (False, True):
        for mode in modes:
            try:
                r = one(mode, docs, args, device, rank, world)
            except Exception as e:  # noqa: BLE001 — recorded, the run goes on
                r = dict(world=world, mode=mode, docs=docs, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(r)
            if rank == 0:
                print(json.dumps(r), flush=True)
                with open(os.path.join(args.out, f"scale_limits_{world}.json"), "w") as f:
                    json.dump(rows, f, indent=1)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
