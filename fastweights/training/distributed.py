"""Distributed helpers of the training step (`fastweights.lab.train`, `fastweights.pretrain`).

Under `torchrun` (the environment holds RANK and WORLD_SIZE) :func:`init_distributed` starts the
default process group: "nccl" when the processes use CUDA, "gloo" on CPU. The lab's sweeps use the
ranks in two ways (chosen by the caller, see `fastweights.lab.train.run_sweep(mode=...)`):

* "ddp":    every rank runs every cell; one model is wrapped in DistributedDataParallel, each rank
            trains on its shard of every batch (the global batch stays `TrainConfig.batch_size`),
            the evaluation is sharded and summed. Rank 0 alone writes checkpoints and results.
* "spread": cell i of a sweep runs on rank i % world_size, each rank training its own models
            alone; every rank appends its own records to the shared JSONL under an exclusive
            file lock (`fcntl.flock`), so lines never interleave.

`fastweights train` (`fastweights.pretrain.loop`) wraps one model in DDP or FSDP2 over all ranks.

Nothing here changes what a single process computes: without RANK/WORLD_SIZE every helper is a
no-op (rank 0 of a world of 1).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "dist_info", "launch_world_size", "init_distributed", "is_distributed", "barrier",
           "all_reduce_sum", "Layout", "rank_layout", "destroy_distributed", "process_group"]


@dataclass(frozen=True)
class DistInfo:
    """rank, world_size and local_rank of this process (0, 1, 0 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_info() -> DistInfo:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    return DistInfo()


def is_distributed() -> bool:
    """True when a default process group is running."""
    return dist.is_available() and dist.is_initialized()


def dist_info() -> DistInfo:
    """The rank/world of the running process group, else of the environment (else 0/1)."""
    if is_distributed():
        return DistInfo(dist.get_rank(), dist.get_world_size(), _env_info().local_rank)
    return DistInfo()


def launch_world_size() -> int:
    """The number of processes of this run: the running group's, else torchrun's WORLD_SIZE (known before
    `init_distributed` starts the group), else 1."""
    return dist_info().world_size if is_distributed() else _env_info().world_size


def init_distributed(device: str = "cpu") -> DistInfo:
    """Start the default process group when launched by torchrun (RANK/WORLD_SIZE set) and not
    started yet: backend "nccl" for a CUDA `device` (each rank on cuda:LOCAL_RANK), else "gloo".
    Returns this process's DistInfo; a no-op (0/1) outside torchrun."""
    env = _env_info()
    if env.world_size <= 1 and not is_distributed():
        return DistInfo()
    if not is_distributed():
        cuda = str(device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist_info()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(values: list[float], device="cpu") -> list[float]:
    """Sum a few floats over the ranks (identity outside a process group)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def destroy_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


_EXIT = {"hook": False, "clean": True}


def _destroy_at_exit() -> None:
    """(atexit) Destroy the group `process_group` started, unless a run in it ended on an error."""
    if _EXIT["clean"]:
        destroy_distributed()


@contextlib.contextmanager
def process_group(device: str = "cpu", together: tuple[type[BaseException], ...] = ()):
    """`init_distributed(device)` for the body; the group it starts is destroyed at the process's exit.

    A process that exits with a gloo group still alive can abort in interpreter teardown (SIGABRT,
    "terminate called without an active exception": gloo's threads still hold work whose tensors need
    the GIL); that failed `torchrun ... train --parallel ddp` once in CI. So a group started here is
    destroyed by an atexit hook, which runs while the interpreter is still whole. Not at the body's end:
    the group must outlive it, since a script may call `train()` again and a default group started
    anew under torchrun's rendezvous hangs. The hook is skipped once any body ends on an exception
    not in `together` (those every rank raises at one point, e.g. `Interrupted` at a step boundary):
    destroying a group while another rank waits in a collective can hang. A group the caller started
    is never touched. Yields this process's DistInfo."""
    started = not is_distributed() and _env_info().world_size > 1
    info = init_distributed(device)
    if started and not _EXIT["hook"]:
        atexit.register(_destroy_at_exit)
        _EXIT["hook"] = True
    try:
        yield info
    except together:
        raise
    except BaseException:
        _EXIT["clean"] = False
        raise


@dataclass(frozen=True)
class Layout:
    """How the ranks share a step: dp data-parallel groups of cp ranks each; this rank is span `cp_rank` of its
    group's sequences, its group the `dp_rank`-th of the batch. context: the group's
    `fastweights.distributed.ContextParallel` (None when cp = 1)."""

    dp: int
    dp_rank: int
    cp: int
    context: object = None

    def span(self, batch: dict) -> dict:
        """The batch as this rank sees it: its span of every [b, T] tensor under context parallelism."""
        if self.context is None:
            return batch
        return {k: self.context.shard(v) for k, v in batch.items()}


def rank_layout(context_parallel: int = 1) -> Layout:
    """The Layout of this process's world with each sequence split over `context_parallel` ranks (1: plain data
    parallelism, every rank its own share of the batch). Under context parallelism every rank creates every
    group's sub-group, in the same order (a collective); the caller checks that the world divides."""
    info = dist_info()
    N = context_parallel
    if N == 1:
        return Layout(dp=info.world_size, dp_rank=info.rank, cp=1)
    from ..distributed import ContextParallel

    mine = None
    for g in range(info.world_size // N):
        group = dist.new_group(list(range(g * N, (g + 1) * N)))
        if info.rank // N == g:
            mine = group
    return Layout(dp=info.world_size // N, dp_rank=info.rank // N, cp=N, context=ContextParallel(mine))
