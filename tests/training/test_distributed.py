"""The distributed helpers outside torchrun are no-ops of a world of one (under torchrun:
tests/pretrain/test_torchrun.py and tests/pretrain/test_distributed.py)."""

from fastweights.training.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    dist_info,
    init_distributed,
    is_distributed,
    launch_world_size,
)


def test_one_process_is_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not is_distributed()
    assert init_distributed("cpu") == dist_info() == DistInfo(0, 1, 0) and dist_info().is_main
    assert all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    barrier()


def test_the_launch_world_size_is_torchruns_before_the_group_starts(monkeypatch):
    """`launch_world_size`: WORLD_SIZE (with RANK) before any group runs — what `fastweights train` decides its
    cuda_graph "auto" by — else 1 (dist_info says 1 until the group starts)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launch_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch_world_size() == 1  # (no RANK: not torchrun's environment; no group would start either)
    monkeypatch.setenv("RANK", "2")
    assert launch_world_size() == 4 and not is_distributed() and dist_info().world_size == 1
