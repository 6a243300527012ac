"""Multi-query associative recall (MQAR), generated the way Zoology generates it.

Spec: research/benchmarks.md §1.1 (Zoology `zoology/data/multiquery_ar.py`, logic as of `8700f46`,
i.e. without the later `num_passes` repeat). One example of length T = seq_len with n = num_kv_pairs:

    position  0 .. 2n−1 : the context  k_1 v_1 k_2 v_2 … k_n v_n
    position  2n .. T−1 : the query region; key k_i sits at 2n + 2·gap_i, everything else is filler

* keys   k_i are n distinct ids from [1, V/2)  (id 0 is reserved for blanks),
* values v_i are n distinct ids from [V/2, V),
* gaps are n distinct slots out of space = (T − 2n)/2, drawn without replacement (sequentially, as
  `numpy.random.choice(space, n, replace=False, p=p)` does) with p_i ∝ a·i^(a−1), i = 1..space;
  the default a = 0.01 gives p_i ∝ i^−0.99, so queries cluster right after the context,
* filler is 0, or with `random_non_queries=True` a uniform draw from [0, V) (it may collide with a key),
* labels are −100 everywhere except at the position of each query key, where the label is the value
  paired with that key. Zoology builds a length-(T+1) sequence, writes the value targets at
  2n + 2·gap + 1 and returns ``inputs = seq[:, :-1]``, ``labels = labels[:, 1:]``: labels are already
  shifted (``labels[:, t]`` is the target of the prediction made at position t) and only the n query
  positions are supervised (not full next-token LM).

Seeds: Zoology derives train seeds in [0, 2^31) and test seeds in [2^31, 2^32);
:func:`make_mqar_splits` does the same (test seed = 2^31 + ``test_config.seed``).

The random streams are a local ``numpy.random.Generator``; the tensors are not bit-identical to
Zoology's (which uses the legacy global numpy/torch RNGs), only identically distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["MQARConfig", "make_mqar", "make_mqar_splits", "mqar_query_probs", "TEST_SEED_OFFSET"]

IGNORE_INDEX = -100
TEST_SEED_OFFSET = 2**31
"""Test split seeds live in [2^31, 2^32), train split seeds in [0, 2^31) (Zoology's convention)."""

_CHUNK_ELEMENTS = 1 << 22  # rows are processed in chunks of at most this many random draws


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class MQARConfig:
    """One MQAR data segment (benchmarks.md §1.1; defaults of Zoology's configs).

    vocab_size:         V; keys come from [1, V/2), values from [V/2, V). Must exceed seq_len.
    seq_len:            T, even, with 4·num_kv_pairs <= T (context 2n plus at least n query slots).
    num_kv_pairs:       n, key-value pairs per example; each key is queried exactly once.
    num_examples:       N, examples in the segment.
    power_a:            a > 0 of the query-gap law p_i ∝ a·i^(a−1) (a = 1: uniform).
    random_non_queries: fill non-query positions of the query region with uniform ids from [0, V)
                        instead of 0.
    seed:               non-negative seed of the segment's local generator.
    """

    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 8
    num_examples: int = 1000
    power_a: float = 0.01
    random_non_queries: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _require_int("num_kv_pairs", self.num_kv_pairs, 1)
        _require_int("num_examples", self.num_examples, 1)
        _require_int("seq_len", self.seq_len, 4)
        _require_int("vocab_size", self.vocab_size, 4)
        _require_int("seed", self.seed, 0)
        if self.seq_len % 2 != 0:
            raise ValueError(f"seq_len must be even, got {self.seq_len}")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError(
                f"seq_len must be >= 4 * num_kv_pairs (context 2n + n query slots of 2), "
                f"got seq_len={self.seq_len}, num_kv_pairs={self.num_kv_pairs}"
            )
        if self.vocab_size <= self.seq_len:
            raise ValueError(
                f"vocab_size must be > seq_len (Zoology's assertion), "
                f"got vocab_size={self.vocab_size}, seq_len={self.seq_len}"
            )
        if self.vocab_size // 2 - 1 < self.num_kv_pairs:
            raise ValueError(
                f"vocab_size too small: {self.vocab_size // 2 - 1} key ids in [1, V/2) "
                f"for num_kv_pairs={self.num_kv_pairs}"
            )
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)):
            raise ValueError(f"power_a must be a float, got {self.power_a!r}")
        if not (self.power_a > 0 and math.isfinite(self.power_a)):
            raise ValueError(f"power_a must be a finite number > 0, got {self.power_a}")
        if not isinstance(self.random_non_queries, bool):
            raise ValueError(f"random_non_queries must be a bool, got {self.random_non_queries!r}")

    @property
    def num_query_slots(self) -> int:
        """space = (T − 2n) / 2, the number of slots a query can occupy."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2


def mqar_query_probs(config: MQARConfig) -> np.ndarray:
    """p [space]: the per-draw slot law p_i ∝ a·i^(a−1), i = 1..space (slot i−1 = gap i−1)."""
    i = np.arange(1, config.num_query_slots + 1, dtype=np.float64)
    w = config.power_a * i ** (config.power_a - 1.0)
    return w / w.sum()


def _sample_without_replacement(
    rng: np.random.Generator,
    rows: int,
    pool: int,
    k: int,
    log_weights: np.ndarray | None = None,
) -> np.ndarray:
    """[rows, k] ids from range(pool), distinct within a row, in draw order.

    Uses Gumbel-top-k: the k largest of log w_i + Gumbel noise, sorted descending, have the law of
    k successive weighted draws without replacement (what ``numpy`` ``choice(replace=False, p=w)``
    does). Without weights this is a uniformly random ordered k-subset.
    """
    out = np.empty((rows, k), dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMENTS // max(pool, 1))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        if log_weights is None:
            scores = rng.random((stop - start, pool))
        else:
            scores = log_weights[None, :] + rng.gumbel(size=(stop - start, pool))
        if k < pool:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        else:
            top = np.broadcast_to(np.arange(pool), (stop - start, pool)).copy()
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        out[start:stop] = np.take_along_axis(top, order, axis=1)
    return out


def _uniform_distinct(rng: np.random.Generator, rows: int, pool: int, k: int) -> np.ndarray:
    """[rows, k] uniformly random ordered k-subsets of range(pool) (distinct within a row).

    For k much smaller than the pool, draws with replacement and redraws every later duplicate until
    none is left. The procedure commutes with any relabelling of the pool, and relabellings act
    transitively on ordered distinct k-tuples, so the result is exactly uniform over them.
    """
    if 4 * k > pool:
        return _sample_without_replacement(rng, rows, pool, k)
    out = rng.integers(0, pool, size=(rows, k))
    todo = np.arange(rows)
    while todo.size:
        sub = out[todo]
        order = np.argsort(sub, axis=1, kind="stable")  # stable: first occurrence sorts first
        srt = np.take_along_axis(sub, order, axis=1)
        dup_sorted = np.zeros_like(sub, dtype=bool)
        dup_sorted[:, 1:] = srt[:, 1:] == srt[:, :-1]
        dup = np.zeros_like(dup_sorted)
        np.put_along_axis(dup, order, dup_sorted, axis=1)
        bad = dup.any(axis=1)
        todo, dup = todo[bad], dup[bad]
        if todo.size:
            r, c = np.nonzero(dup)
            out[todo[r], c] = rng.integers(0, pool, size=r.size)
    return out


def make_mqar(config: MQARConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one MQAR segment (benchmarks.md §1.1).

    Returns:
        inputs: LongTensor [N, T], token ids in [0, V).
        labels: LongTensor [N, T], −100 except at the n query-key positions of each row, where the
                label is the value paired with that key in the context (already shifted:
                ``labels[:, t]`` is the target of the prediction at position t).
    Same config (seed included) → identical tensors.
    """
    n, seq_len, vocab = config.num_kv_pairs, config.seq_len, config.vocab_size
    rows = config.num_examples
    half = vocab // 2
    rng = np.random.default_rng(config.seed)

    keys = _uniform_distinct(rng, rows, half - 1, n) + 1  # [N, n] in [1, V/2)
    values = _uniform_distinct(rng, rows, vocab - half, n) + half  # [N, n] in [V/2, V)
    log_p = np.log(mqar_query_probs(config))
    gaps = _sample_without_replacement(rng, rows, config.num_query_slots, n, log_weights=log_p)

    seq = np.zeros((rows, seq_len + 1), dtype=np.int64)
    seq[:, 0 : 2 * n : 2] = keys
    seq[:, 1 : 2 * n : 2] = values
    query_pos = 2 * n + 2 * gaps  # [N, n] positions of the query keys
    np.put_along_axis(seq, query_pos, keys, axis=1)
    targets = np.full((rows, seq_len + 1), IGNORE_INDEX, dtype=np.int64)
    np.put_along_axis(targets, query_pos + 1, values, axis=1)

    inputs = seq[:, :-1]
    labels = targets[:, 1:]
    if config.random_non_queries:
        blank = inputs == 0  # keys >= 1 and values >= V/2, so 0 marks exactly the filler
        inputs = inputs.copy()
        inputs[blank] = rng.integers(0, vocab, size=int(blank.sum()))
    return torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(np.ascontiguousarray(labels))


def make_mqar_splits(
    train_config: MQARConfig, test_config: MQARConfig
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Train and test segments with disjoint seed ranges (Zoology's ``prepare_data`` convention).

    The train segment is ``make_mqar(train_config)`` (its seed must be < 2^31); the test segment is
    ``make_mqar(replace(test_config, seed=2**31 + test_config.seed))`` (``test_config.seed`` < 2^31),
    so the two never share a random stream, even with equal seeds.

    Returns:
        ((train_inputs [N_tr, T_tr], train_labels [N_tr, T_tr]),
         (test_inputs [N_te, T_te], test_labels [N_te, T_te]))
    """
    if not isinstance(train_config, MQARConfig):
        raise ValueError(f"train_config must be an MQARConfig, got {type(train_config).__name__}")
    if not isinstance(test_config, MQARConfig):
        raise ValueError(f"test_config must be an MQARConfig, got {type(test_config).__name__}")
    if train_config.seed >= TEST_SEED_OFFSET:
        raise ValueError(f"train_config.seed must be < 2**31, got {train_config.seed}")
    if test_config.seed >= TEST_SEED_OFFSET:
        raise ValueError(f"test_config.seed must be < 2**31, got {test_config.seed}")
    train = make_mqar(train_config)
    test = make_mqar(replace(test_config, seed=TEST_SEED_OFFSET + test_config.seed))
    return train, test
