"""MQAR generator: determinism, Zoology layout (benchmarks.md §1.1), splits and validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastweights.tasks.mqar import (
    TEST_SEED_OFFSET,
    MQARConfig,
    make_mqar,
    make_mqar_splits,
    mqar_query_probs,
)
from tests.tolerances import MQAR_INCLUSION_FREQ, MQAR_SLOT0_P_RANGE, MQAR_UNIFORM_GAP_MEAN

SMALL = dict(vocab_size=512, seq_len=64, num_kv_pairs=4, num_examples=64)


def _check_layout(cfg: MQARConfig, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    n, T, V = cfg.num_kv_pairs, cfg.seq_len, cfg.vocab_size
    assert inputs.shape == labels.shape == (cfg.num_examples, T)
    assert inputs.dtype == labels.dtype == torch.long
    x, y = inputs.numpy(), labels.numpy()
    assert x.min() >= 0 and x.max() < V
    for row in range(cfg.num_examples):
        keys, values = x[row, 0 : 2 * n : 2], x[row, 1 : 2 * n : 2]
        assert np.all((keys >= 1) & (keys < V // 2))
        assert np.all((values >= V // 2) & (values < V))
        assert len(set(keys.tolist())) == n and len(set(values.tolist())) == n
        pair = dict(zip(keys.tolist(), values.tolist()))

        (pos,) = np.nonzero(y[row] != -100)
        assert pos.size == n  # one supervised position per kv pair
        assert np.all(pos >= 2 * n) and np.all((pos - 2 * n) % 2 == 0)
        queried = x[row, pos]
        # every key is queried exactly once, and the label is the value it was paired with
        assert sorted(queried.tolist()) == sorted(keys.tolist())
        assert [pair[k] for k in queried.tolist()] == y[row, pos].tolist()

        filler = np.ones(T, dtype=bool)
        filler[: 2 * n] = False
        filler[pos] = False
        if not cfg.random_non_queries:
            assert np.all(x[row, filler] == 0)


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_layout_matches_spec(random_non_queries: bool) -> None:
    cfg = MQARConfig(**SMALL, random_non_queries=random_non_queries, seed=3)
    _check_layout(cfg, *make_mqar(cfg))


def test_default_vocab_ranges() -> None:
    cfg = MQARConfig(seq_len=256, num_kv_pairs=16, num_examples=32, seed=1)
    assert cfg.vocab_size == 8192 and cfg.power_a == 0.01 and cfg.random_non_queries
    x, y = make_mqar(cfg)
    _check_layout(cfg, x, y)
    keys, values = x[:, 0:32:2], x[:, 1:32:2]
    assert keys.min() >= 1 and keys.max() < 4096
    assert values.min() >= 4096 and values.max() < 8192


def test_random_non_queries_fill_is_uniform_noise() -> None:
    cfg = MQARConfig(**SMALL, random_non_queries=True, seed=0)
    x, y = make_mqar(cfg)
    region = x[:, 2 * cfg.num_kv_pairs :][y[:, 2 * cfg.num_kv_pairs :] == -100]
    assert region.numel() > 0
    assert (region != 0).float().mean() > 0.9  # no longer blank
    assert region.float().mean() > cfg.vocab_size / 4  # spread over [0, V)


def test_full_query_region_when_n_equals_space() -> None:
    cfg = MQARConfig(vocab_size=300, seq_len=256, num_kv_pairs=64, num_examples=8, random_non_queries=False)
    assert cfg.num_query_slots == cfg.num_kv_pairs
    x, y = make_mqar(cfg)
    _check_layout(cfg, x, y)
    assert torch.all(y[:, 128::2] != -100)


def test_deterministic_per_seed() -> None:
    cfg = MQARConfig(**SMALL, seed=11)
    a, b = make_mqar(cfg), make_mqar(cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = make_mqar(dataclasses.replace(cfg, seed=12))
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[1], c[1])


def test_no_global_rng_use() -> None:
    cfg = MQARConfig(**SMALL, seed=5)
    torch.manual_seed(0)
    np.random.seed(0)
    a = make_mqar(cfg)
    torch.manual_seed(1)
    np.random.seed(1)
    b = make_mqar(cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _gaps(cfg: MQARConfig, labels: torch.Tensor) -> np.ndarray:
    pos = np.nonzero(labels.numpy() != -100)[1]
    return (pos - 2 * cfg.num_kv_pairs) // 2


def test_query_gaps_skew_short() -> None:
    cfg = MQARConfig(vocab_size=512, seq_len=128, num_kv_pairs=4, num_examples=2000, seed=0)
    space = cfg.num_query_slots  # 60
    gaps = _gaps(cfg, make_mqar(cfg)[1])
    counts = np.bincount(gaps, minlength=space)
    # power law a = 0.01: slot 0 is by far the most used, early slots dominate
    assert counts.argmax() == 0
    assert counts[0] > 0.5 * cfg.num_examples  # slot 0 is among the 4 gaps in most rows
    assert gaps.mean() < 0.8 * (space - 1) / 2
    assert counts[: space // 4].sum() > counts[-space // 4 :].sum() * 1.5
    # a = 1 is uniform: no such skew
    flat = _gaps(dataclasses.replace(cfg, power_a=1.0), make_mqar(dataclasses.replace(cfg, power_a=1.0))[1])
    assert abs(flat.mean() - (space - 1) / 2) < MQAR_UNIFORM_GAP_MEAN


def test_query_probs_law() -> None:
    cfg = MQARConfig(vocab_size=8192, seq_len=256, num_kv_pairs=16, num_examples=1)
    p = mqar_query_probs(cfg)
    assert p.shape == (cfg.num_query_slots,)
    assert np.isclose(p.sum(), 1.0)
    i = np.arange(1, p.size + 1)
    assert np.allclose(p / p[0], i ** (0.01 - 1))
    lo, hi = MQAR_SLOT0_P_RANGE
    assert lo < p[0] < hi  # benchmarks.md: "for L=256, n=16, slot 0 has p≈0.18"


def test_gap_sampling_matches_sequential_choice() -> None:
    """Gumbel-top-k equals numpy's choice(replace=False, p) in law: compare inclusion frequencies."""
    cfg = MQARConfig(vocab_size=256, seq_len=40, num_kv_pairs=3, num_examples=4000, seed=2)
    space, n = cfg.num_query_slots, cfg.num_kv_pairs
    ours = np.bincount(_gaps(cfg, make_mqar(cfg)[1]), minlength=space) / cfg.num_examples
    rng = np.random.default_rng(99)
    p = mqar_query_probs(cfg)
    ref = np.zeros(space)
    for _ in range(cfg.num_examples):
        ref[rng.choice(space, size=n, replace=False, p=p)] += 1
    ref /= cfg.num_examples
    assert np.max(np.abs(ours - ref)) < MQAR_INCLUSION_FREQ


def test_splits_use_disjoint_seeds() -> None:
    train_cfg = MQARConfig(**SMALL, seed=7)
    test_cfg = MQARConfig(**{**SMALL, "num_examples": 16}, seed=7)
    (xtr, ytr), (xte, yte) = make_mqar_splits(train_cfg, test_cfg)
    assert xtr.shape == (64, 64) and xte.shape == (16, 64)
    assert torch.equal(xtr, make_mqar(train_cfg)[0])
    ref = make_mqar(dataclasses.replace(test_cfg, seed=TEST_SEED_OFFSET + 7))
    assert torch.equal(xte, ref[0]) and torch.equal(yte, ref[1])
    assert not torch.equal(xtr[:16], xte)
    train_rows = {tuple(r) for r in xtr.tolist()}
    assert not any(tuple(r) in train_rows for r in xte.tolist())
    again = make_mqar_splits(train_cfg, test_cfg)
    assert torch.equal(again[1][0], xte)


def test_splits_with_different_shapes() -> None:
    train_cfg = MQARConfig(vocab_size=512, seq_len=64, num_kv_pairs=4, num_examples=8)
    test_cfg = MQARConfig(vocab_size=512, seq_len=128, num_kv_pairs=16, num_examples=4)
    (xtr, _), (xte, yte) = make_mqar_splits(train_cfg, test_cfg)
    assert xtr.shape == (8, 64) and xte.shape == (4, 128)
    assert ((yte != -100).sum(dim=1) == 16).all()


@pytest.mark.parametrize(
    "which, kwargs",
    [
        ("train_config.seed", dict(train=dict(seed=2**31))),
        ("test_config.seed", dict(test=dict(seed=2**31))),
    ],
)
def test_splits_reject_seeds_outside_train_range(which: str, kwargs: dict) -> None:
    train_cfg = MQARConfig(**SMALL, **kwargs.get("train", {}))
    test_cfg = MQARConfig(**SMALL, **kwargs.get("test", {}))
    with pytest.raises(ValueError, match=which):
        make_mqar_splits(train_cfg, test_cfg)


def test_splits_reject_non_configs() -> None:
    with pytest.raises(ValueError, match="train_config"):
        make_mqar_splits(dict(SMALL), MQARConfig(**SMALL))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(seq_len=64, num_kv_pairs=17), "seq_len"),  # 4n > L
        (dict(seq_len=63, num_kv_pairs=4), "seq_len"),  # odd
        (dict(seq_len=2, num_kv_pairs=1), "seq_len"),  # too short
        (dict(vocab_size=64, seq_len=64), "vocab_size"),  # V must exceed L (Zoology's assert)
        (dict(vocab_size=3), "vocab_size"),
        (dict(num_kv_pairs=0), "num_kv_pairs"),
        (dict(num_examples=0), "num_examples"),
        (dict(power_a=0.0), "power_a"),
        (dict(power_a=float("nan")), "power_a"),
        (dict(seed=-1), "seed"),
        (dict(seq_len=64.0), "seq_len"),
        (dict(num_kv_pairs=True), "num_kv_pairs"),
        (dict(random_non_queries=1), "random_non_queries"),
    ],
)
def test_bad_configs_raise(kwargs: dict, name: str) -> None:
    base = dict(vocab_size=512, seq_len=64, num_kv_pairs=4, num_examples=2)
    with pytest.raises(ValueError, match=name):
        MQARConfig(**{**base, **kwargs})


def test_smallest_valid_config() -> None:
    cfg = MQARConfig(vocab_size=5, seq_len=4, num_kv_pairs=1, num_examples=3, random_non_queries=False)
    x, y = make_mqar(cfg)
    _check_layout(cfg, x, y)
    assert torch.equal(x[:, 2], x[:, 0]) and torch.equal(y[:, 2], x[:, 1])


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = MQARConfig(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        MQARConfig(8192, 64)  # type: ignore[misc]


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 6),
    extra_slots=st.integers(0, 6),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    random_fill=st.booleans(),
    power_a=st.sampled_from([0.01, 0.5, 1.0, 2.0]),
)
def test_layout_property(n: int, extra_slots: int, rows: int, seed: int, random_fill: bool, power_a: float) -> None:
    seq_len = 4 * n + 2 * extra_slots
    cfg = MQARConfig(
        vocab_size=max(2 * seq_len, 4 * n + 4),
        seq_len=seq_len,
        num_kv_pairs=n,
        num_examples=rows,
        power_a=power_a,
        random_non_queries=random_fill,
        seed=seed,
    )
    _check_layout(cfg, *make_mqar(cfg))
