"""The distributed helpers outside torchrun are no-ops of a world of one (under torchrun:
tests/pretrain/test_torchrun.py and tests/pretrain/test_distributed.py)."""

from fastweights.training.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    dist_info,
    init_distributed,
    is_distributed,
)


def test_one_process_is_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not is_distributed()
    assert init_distributed("cpu") == dist_info() == DistInfo(0, 1, 0) and dist_info().is_main
    assert all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    barrier()
