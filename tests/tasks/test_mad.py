"""MAD task generators and score (benchmarks.md §4)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastweights.tasks.mad import (
    MAD_NUM_TEST_EXAMPLES,
    MAD_TASKS,
    CompressionConfig,
    FuzzyInContextRecallConfig,
    InContextRecallConfig,
    MemorizationConfig,
    NoisyInContextRecallConfig,
    SelectiveCopyingConfig,
    mad_score,
    mad_settings,
    mad_task_scores,
    make_compression,
    make_fuzzy_in_context_recall,
    make_in_context_recall,
    make_mad,
    make_mad_splits,
    make_memorization,
    make_noisy_in_context_recall,
    make_selective_copying,
    memorization_kv_map,
)
from tests.tolerances import MAD_NOISE_FRACTION

IGNORE = -100


def small(task: str, **kwargs):
    """The task's baseline with few examples (plus overrides)."""
    return dataclasses.replace(MAD_TASKS[task].config, num_examples=kwargs.pop("num_examples", 16), **kwargs)


# --------------------------------------------------------------------------------------------------
# Registry and defaults
# --------------------------------------------------------------------------------------------------


def test_registry_baselines_match_spec() -> None:
    assert set(MAD_TASKS) == {
        "in-context-recall",
        "fuzzy-in-context-recall",
        "noisy-in-context-recall",
        "selective-copying",
        "compression",
        "memorization",
    }
    icr = MAD_TASKS["in-context-recall"].config
    assert (icr.vocab_size, icr.seq_len, icr.num_examples, icr.multi_query) == (16, 128, 12_800, True)
    fz = MAD_TASKS["fuzzy-in-context-recall"].config
    assert (fz.vocab_size, fz.seq_len, fz.k_motif_size, fz.v_motif_size) == (16, 128, 3, 3)
    nz = MAD_TASKS["noisy-in-context-recall"].config
    assert (nz.vocab_size, nz.noise_vocab_size, nz.seq_len, nz.frac_noise) == (32, 16, 128, 0.2)
    sc = MAD_TASKS["selective-copying"].config
    assert (sc.vocab_size, sc.seq_len, sc.num_tokens_to_copy, sc.num_examples) == (16, 256, 16, 12_800)
    cp = MAD_TASKS["compression"].config
    assert (cp.vocab_size, cp.seq_len, cp.num_examples) == (16, 32, 12_800)
    mm = MAD_TASKS["memorization"].config
    assert (mm.vocab_size, mm.seq_len, mm.num_examples) == (256, 32, 256)
    assert MAD_NUM_TEST_EXAMPLES == 1_280


def test_settings_grid() -> None:
    counts = {task: len(mad_settings(task)) for task in MAD_TASKS}
    assert counts == {
        "in-context-recall": 11,
        "fuzzy-in-context-recall": 11,
        "noisy-in-context-recall": 14,
        "selective-copying": 13,
        "compression": 11,
        "memorization": 6,
    }
    names = dict(mad_settings("noisy-in-context-recall"))
    assert names["frac_noise=0.8"].frac_noise == 0.8 and names["frac_noise=0.8"].vocab_size == 32
    assert names["vocab_size=144"].noise_vocab_size == 16
    assert dict(mad_settings("memorization"))["vocab_size=8192"].vocab_size == 8192
    with pytest.raises(ValueError, match="task"):
        mad_settings("copying")


def test_every_setting_generates() -> None:
    for spec in MAD_TASKS.values():
        for _, cfg in spec.settings():
            x, y = spec.make(dataclasses.replace(cfg, num_examples=2))
            assert x.shape == y.shape and x.shape[0] == 2
            assert x.min() >= 0 and x.max() < cfg.vocab_size
            labelled = y[y != IGNORE]
            assert labelled.numel() > 0 and labelled.min() >= 0 and labelled.max() < cfg.vocab_size


@pytest.mark.parametrize("task", sorted(MAD_TASKS))
def test_deterministic_per_seed(task: str) -> None:
    cfg = small(task, seed=3)
    a, b = make_mad(task, cfg), make_mad(task, cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = make_mad(task, dataclasses.replace(cfg, seed=4))
    assert not torch.equal(a[0], c[0])
    d = make_mad(task, dataclasses.replace(cfg, train=False))
    assert not torch.equal(a[0], d[0])  # train and test use different streams


@pytest.mark.parametrize("task", sorted(MAD_TASKS))
def test_splits(task: str) -> None:
    cfg = small(task)
    (xtr, ytr), (xte, yte) = make_mad_splits(task, cfg, num_test_examples=8)
    assert xtr.shape[0] == 16 and xte.shape[0] == 8
    assert xtr.shape[1] == xte.shape[1]
    ref = make_mad(task, dataclasses.replace(cfg, train=False, num_examples=8))
    assert torch.equal(xte, ref[0]) and torch.equal(yte, ref[1])
    with pytest.raises(ValueError, match="num_test_examples"):
        make_mad_splits(task, cfg, num_test_examples=0)


# --------------------------------------------------------------------------------------------------
# In-context recall (plain and noisy)
# --------------------------------------------------------------------------------------------------


def _recall_checks(cfg: InContextRecallConfig, noise_low: int) -> None:
    x_tr, y_tr = make_in_context_recall(dataclasses.replace(cfg, train=True))
    assert x_tr.shape == (cfg.num_examples, cfg.seq_len - 1)  # multi-query: seq_len/2 pairs, shifted
    assert torch.equal(y_tr[:, :-1], x_tr[:, 1:])  # full next-token targets

    x, y = make_in_context_recall(dataclasses.replace(cfg, train=False))
    content = cfg.content_vocab_size
    half = content // 2
    for row in range(cfg.num_examples):
        seq = x[row].tolist() + [int(y[row, -1])]
        pairs = [tuple(seq[i : i + 2]) for i in range(0, len(seq), 2)]
        mapping: dict[int, int] = {}
        presented: set[int] = set()
        for s, (k, v) in enumerate(pairs):
            label = int(y[row, 2 * s])
            assert int(y[row, 2 * s + 1]) == IGNORE if 2 * s + 1 < y.shape[1] else True
            if k >= noise_low:  # noise pair: both noise tokens, never scored
                assert v >= noise_low and label == IGNORE
                continue
            assert 0 <= k < half <= v < content
            assert mapping.setdefault(k, v) == v  # a key's value is fixed within the sequence
            if s == len(pairs) - 1:
                assert k in presented and label == v  # final probe, key seen before
            else:
                assert label == (v if k in presented else IGNORE)  # every repeat is a query
            presented.add(k)


def test_in_context_recall_spec() -> None:
    cfg = InContextRecallConfig(num_examples=16, seq_len=64, seed=1)
    _recall_checks(cfg, noise_low=cfg.vocab_size)


def test_noisy_in_context_recall_spec() -> None:
    cfg = NoisyInContextRecallConfig(num_examples=16, seq_len=128, seed=2)
    _recall_checks(cfg, noise_low=cfg.vocab_size - cfg.noise_vocab_size)
    x, _ = make_noisy_in_context_recall(dataclasses.replace(cfg, num_examples=200))
    pairs = x[:, : cfg.seq_len - 2].reshape(200, -1, 2)
    is_noise = pairs[..., 0] >= 16
    assert torch.equal(is_noise, pairs[..., 1] >= 16)  # noise comes in whole pair slots
    assert abs(is_noise.float().mean().item() - 0.2) < MAD_NOISE_FRACTION
    assert x.max() < 32


def test_in_context_recall_single_query() -> None:
    cfg = InContextRecallConfig(num_examples=8, seq_len=32, multi_query=False, train=False, seed=0)
    x, y = make_in_context_recall(cfg)
    assert x.shape == (8, 32)
    assert (x[:, -2] == cfg.vocab_size - 1).all()  # copy prefix before the probe key
    assert ((y != IGNORE).sum(dim=1) == 1).all() and (y[:, -1] != IGNORE).all()


def test_in_context_recall_rejects_wrong_config_type() -> None:
    with pytest.raises(ValueError, match="config"):
        make_in_context_recall(CompressionConfig())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Fuzzy in-context recall
# --------------------------------------------------------------------------------------------------


def _contains(seq: list[int], sub: list[int], end: int) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(0, end - len(sub) + 1))


def test_fuzzy_in_context_recall_spec() -> None:
    cfg = FuzzyInContextRecallConfig(num_examples=24, seq_len=64, seed=0)
    x_tr, y_tr = make_fuzzy_in_context_recall(cfg)
    assert x_tr.shape == (24, 64)
    assert torch.equal(y_tr[:, :-1], x_tr[:, 1:])

    x, y = make_fuzzy_in_context_recall(dataclasses.replace(cfg, train=False))
    pad, half, content = cfg.vocab_size - 1, cfg.content_vocab_size // 2, cfg.content_vocab_size
    for row in range(cfg.num_examples):
        labels = y[row].tolist()
        seq = x[row].tolist() + [labels[-1]]
        # trailing labelled run = the probe value motif; the key motif (k_motif_size tokens) precedes it
        n_val = 0
        while labels[-1 - n_val] != IGNORE:
            n_val += 1
        assert 1 <= n_val <= cfg.v_motif_size
        value = seq[len(seq) - n_val :]
        key = seq[len(seq) - n_val - cfg.k_motif_size : len(seq) - n_val]
        assert all(0 <= t < half for t in key) and len(set(key)) == len(key)
        assert all(half <= t < content for t in value) and len(set(value)) == len(value)
        # the probe pair was presented earlier in the sequence
        assert _contains(seq, key + value, len(seq) - n_val - cfg.k_motif_size)
        # left padding only
        first = next(i for i, t in enumerate(seq) if t != pad)
        assert all(t != pad for t in seq[first:])


# --------------------------------------------------------------------------------------------------
# Selective copying, compression, memorization
# --------------------------------------------------------------------------------------------------


def test_selective_copying_spec() -> None:
    cfg = SelectiveCopyingConfig(num_examples=32, seq_len=64, num_tokens_to_copy=8, seed=0)
    x, y = make_selective_copying(cfg)
    n, blank, copy = 8, cfg.vocab_size - 2, cfg.vocab_size - 1
    assert x.shape == y.shape == (32, 64)
    region = 64 - n - 1
    assert (x[:, region] == copy).all()
    assert (x[:, region + 1 :] == blank).all()
    assert (y[:, : region + 1] == IGNORE).all()
    for row in range(32):
        content = x[row, :region]
        tokens = content[content != blank]
        assert tokens.numel() == n and (tokens < blank).all()
        assert torch.equal(y[row, region + 1 :], tokens)  # non-noise tokens, in order
    # positions of the tokens to copy are spread over the whole region
    positions = torch.nonzero(x[:, :region] != blank)[:, 1].float()
    assert positions.max() > region - 5 and positions.min() < 5


def test_compression_spec() -> None:
    cfg = CompressionConfig(num_examples=16, seed=0)
    x, y = make_compression(cfg)
    assert x.shape == (16, 32)
    assert torch.equal(x, y)
    assert (x[:, -1] == cfg.vocab_size - 1).all() and (x[:, :-1] < cfg.vocab_size - 1).all()


def test_memorization_fixed_map() -> None:
    cfg = MemorizationConfig(num_examples=64, seed=5)
    table = memorization_kv_map(cfg)
    k = (cfg.vocab_size - 1) // 2
    assert table.shape == (k,)
    assert table.min() >= k and table.max() < cfg.vocab_size - 1
    assert table.unique().numel() == k  # injective
    for train in (True, False):
        x, y = make_memorization(dataclasses.replace(cfg, train=train))
        assert x.shape == y.shape == (64, 32)
        keys, inserts = x[:, 0::2], x[:, 1::2]
        assert (inserts == cfg.vocab_size - 1).all() and (keys < k).all()
        assert (y[:, 0::2] == IGNORE).all()
        assert torch.equal(y[:, 1::2], table[keys])  # the same map in every example, train and test
    assert torch.equal(memorization_kv_map(dataclasses.replace(cfg, train=False)), table)
    assert not torch.equal(memorization_kv_map(dataclasses.replace(cfg, seed=6)), table)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, name",
    [
        (InContextRecallConfig, dict(seq_len=127), "seq_len"),
        (InContextRecallConfig, dict(seq_len=2), "seq_len"),
        (InContextRecallConfig, dict(vocab_size=1), "vocab_size"),
        (InContextRecallConfig, dict(vocab_size=17, noise_vocab_size=16), "vocab_size"),
        (InContextRecallConfig, dict(frac_noise=0.2), "noise_vocab_size"),
        (InContextRecallConfig, dict(frac_noise=1.0, noise_vocab_size=4), "frac_noise"),
        (InContextRecallConfig, dict(num_examples=0), "num_examples"),
        (InContextRecallConfig, dict(multi_query=1), "multi_query"),
        (NoisyInContextRecallConfig, dict(frac_noise=-0.1), "frac_noise"),
        (FuzzyInContextRecallConfig, dict(seq_len=12), "seq_len"),
        (FuzzyInContextRecallConfig, dict(k_motif_size=0), "k_motif_size"),
        (FuzzyInContextRecallConfig, dict(vocab_size=6), "vocab_size"),  # 2 keys < 3-token motifs
        (SelectiveCopyingConfig, dict(seq_len=33, num_tokens_to_copy=16), "seq_len"),
        (SelectiveCopyingConfig, dict(num_tokens_to_copy=0), "num_tokens_to_copy"),
        (SelectiveCopyingConfig, dict(vocab_size=2), "vocab_size"),
        (CompressionConfig, dict(seq_len=1), "seq_len"),
        (CompressionConfig, dict(seed=-2), "seed"),
        (MemorizationConfig, dict(seq_len=31), "seq_len"),
        (MemorizationConfig, dict(vocab_size=2), "vocab_size"),
        (MemorizationConfig, dict(train="yes"), "train"),
    ],
)
def test_bad_configs_raise(cls: type, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


def test_configs_frozen_and_keyword_only() -> None:
    cfg = SelectiveCopyingConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        CompressionConfig(16, 32)  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Score
# --------------------------------------------------------------------------------------------------


def _grid(task: str, setting: str, accs: list[float]) -> list[dict]:
    lrs_wds = [(lr, wd) for lr in (1e-4, 5e-4, 1e-3) for wd in (0.0, 0.1)]
    return [dict(task=task, setting=setting, lr=lr, wd=wd, accuracy=a) for (lr, wd), a in zip(lrs_wds, accs)]


def test_mad_score_best_then_means() -> None:
    results = (
        _grid("compression", "baseline", [0.1, 0.5, 0.2, 0.3, 0.0, 0.4])  # best 0.5
        + _grid("compression", "seq_len=64", [0.3, 0.1, 0.1, 0.1, 0.1, 0.1])  # best 0.3
        + _grid("memorization", "baseline", [0.9, 0.2, 0.2, 0.2, 0.2, 0.2])  # best 0.9
        + _grid("memorization", {"vocab_size": 512}, [0.1, 0.2, 0.3, 0.4, 0.5, 0.7])  # best 0.7
        + _grid("memorization", {"vocab_size": 1024}, [0.6, 0.2, 0.3, 0.4, 0.5, 0.1])  # best 0.6
    )
    per_task = mad_task_scores(results)
    assert per_task == pytest.approx({"compression": 0.4, "memorization": (0.9 + 0.7 + 0.6) / 3})
    assert mad_score(results) == pytest.approx((0.4 + 2.2 / 3) / 2)
    # order of records does not matter
    assert mad_score(list(reversed(results))) == pytest.approx(mad_score(results))
    assert mad_score([dict(task="t", setting="s", lr=1e-3, wd=0.0, accuracy=torch.tensor(0.25))]) == 0.25


def test_mad_score_validation() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        mad_score([])
    with pytest.raises(ValueError, match="accuracy"):
        mad_score([dict(task="t", setting="s", lr=1e-3, wd=0.0)])
    with pytest.raises(ValueError, match="accuracy"):
        mad_score([dict(task="t", setting="s", lr=1e-3, wd=0.0, accuracy=float("nan"))])
    with pytest.raises(ValueError, match="setting"):
        mad_score([dict(task="t", setting=["a"], lr=1e-3, wd=0.0, accuracy=0.5)])


def test_no_global_rng_use() -> None:
    cfg = small("noisy-in-context-recall")
    np.random.seed(0)
    torch.manual_seed(0)
    a = make_mad("noisy-in-context-recall", cfg)
    np.random.seed(1)
    torch.manual_seed(1)
    b = make_mad("noisy-in-context-recall", cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
