"""The six MAD synthetic tasks (Poli et al., mechanistic architecture design) and the MAD score.

Spec: research/benchmarks.md §4 (athms/mad-lab `configs/tasks/*.yml`, `mad/data/instances.py`,
`mad/configs.py`, `mad/analysis.py`). Every generator takes a frozen config and returns

    inputs: LongTensor [N, T]   labels: LongTensor [N, T]  (−100 where nothing is scored)

with labels already aligned to the prediction position.

Token layout per task (V = vocab_size):

* in-context recall (multi-query, the benchmark setting): keys from [0, V'/2), values from [V'/2, V')
  with V' = V − noise_vocab_size (− 1 for the copy-prefix token V − 1 when ``multi_query=False``).
  seq_len/2 − 1 key-value pairs (a key's value is fixed within a sequence; keys repeat), then a
  final probe pair whose key was presented before. The full sequence is autoregressively shifted:
  ``inputs = seq[:-1]`` and, for training, ``labels = seq[1:]`` (full next-token targets); for test
  (``train=False``) ``labels`` keep only the values of repeated keys (every repeat is a query) and
  the final probe value. Multi-query sequences therefore have T = seq_len − 1 (as in MAD).
* noisy in-context recall: the same, with each pair slot replaced with probability ``frac_noise`` by
  two tokens from the noise vocabulary [V', V' + noise_vocab_size) (never scored; with multi-query
  this is [V − noise_vocab_size, V)).
* fuzzy in-context recall: keys and values are motifs of 1..k_motif_size / 1..v_motif_size distinct
  tokens (test keys always have k_motif_size tokens), pad token V − 1 (V − 2 without multi-query),
  sequences left-padded to seq_len + 1 and shifted, T = seq_len.
* selective copying: num_tokens_to_copy tokens from [0, V − 2) scattered among blanks (V − 2), then the
  copy token (V − 1) and num_tokens_to_copy blanks; labels are the copied tokens, in order, at those
  final blank positions. T = seq_len.
* compression: seq_len − 1 tokens from [0, V − 1) and the compression token V − 1; labels = inputs
  (reconstruct the whole sequence; MAD trains it with an AutoEncoder backbone). T = seq_len.
* memorization: seq_len/2 (key, insert-token V − 1) pairs; the label at the insert token is the key's
  value under a key→value map that is fixed for a seed (the same for every example, train and test).
  Keys from [0, (V−1)//2), values from [(V−1)//2, V − 1). T = seq_len.

Seeds: each config carries ``seed`` and ``train``; the example stream is seeded by (seed, train), so
train and test sets of one seed differ, and the memorization map by (seed, "map") only.

Deviations from mad-lab's generator code (distribution-level, on purpose):
* in-context recall guarantees one kv slot among the seq_len/2 − 1 body slots (mad-lab draws the
  guaranteed slot among seq_len/2, which can leave no key to probe when every body slot is noise);
* fuzzy recall always presents the probe pair before the final query (mad-lab's probe index can fall
  past the end of the body, leaving the final query unanswerable);
* selective copying places the tokens to copy uniformly among the blanks with the seeded generator
  (mad-lab uses the global numpy RNG and never puts a blank after the last token to copy).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

__all__ = [
    "InContextRecallConfig",
    "NoisyInContextRecallConfig",
    "FuzzyInContextRecallConfig",
    "SelectiveCopyingConfig",
    "CompressionConfig",
    "MemorizationConfig",
    "make_in_context_recall",
    "make_noisy_in_context_recall",
    "make_fuzzy_in_context_recall",
    "make_selective_copying",
    "make_compression",
    "make_memorization",
    "memorization_kv_map",
    "MADTask",
    "MAD_TASKS",
    "MAD_LRS",
    "MAD_WEIGHT_DECAYS",
    "MAD_NUM_TEST_EXAMPLES",
    "make_mad",
    "make_mad_splits",
    "mad_settings",
    "mad_task_scores",
    "mad_score",
]

IGNORE_INDEX = -100
MAD_LRS = (1e-4, 5e-4, 1e-3)
MAD_WEIGHT_DECAYS = (0.0, 0.1)
MAD_NUM_TEST_EXAMPLES = 1_280

_STREAM_TRAIN, _STREAM_TEST, _STREAM_MAP = 0, 1, 2

Pair = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_noise(frac_noise: float, noise_vocab_size: int) -> None:
    _check_int("noise_vocab_size", noise_vocab_size, 0)
    if isinstance(frac_noise, bool) or not isinstance(frac_noise, (int, float)):
        raise ValueError(f"frac_noise must be a float, got {frac_noise!r}")
    if not 0.0 <= frac_noise < 1.0:
        raise ValueError(f"frac_noise must satisfy 0 <= frac_noise < 1, got {frac_noise}")
    if frac_noise > 0 and noise_vocab_size == 0:
        raise ValueError("noise_vocab_size must be > 0 when frac_noise > 0")


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), stream])


def _example_rng(config: Any) -> np.random.Generator:
    return _rng(config.seed, _STREAM_TRAIN if config.train else _STREAM_TEST)


def _to_tensors(inputs: np.ndarray, labels: np.ndarray) -> Pair:
    return (
        torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.int64)),
        torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)),
    )


# --------------------------------------------------------------------------------------------------
# Configs (defaults = MAD baselines, benchmarks.md §4)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class InContextRecallConfig:
    """In-context recall (MAD baseline: vocab 16, seq 128, 12,800 train examples, multi-query).

    vocab_size:       V, including noise tokens (and the copy prefix without multi-query).
    seq_len:          even; the sequence holds seq_len/2 pairs (the last one is the probe).
    num_examples:     N.
    multi_query:      every repeated key is scored (True, MAD's setting) or only the final probe,
                      preceded by a copy-prefix token V − 1 (False).
    noise_vocab_size: size of the noise vocabulary [V', V' + noise_vocab_size) (V' = content ids).
    frac_noise:       probability that a pair slot is noise, 0 <= frac_noise < 1.
    train:            full shifted next-token labels (True) or only the probed values (False).
    seed:             non-negative seed.
    """

    vocab_size: int = 16
    seq_len: int = 128
    num_examples: int = 12_800
    multi_query: bool = True
    noise_vocab_size: int = 0
    frac_noise: float = 0.0
    train: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 2)
        _check_int("seq_len", self.seq_len, 4)
        _check_int("num_examples", self.num_examples, 1)
        _check_int("seed", self.seed, 0)
        _check_bool("multi_query", self.multi_query)
        _check_bool("train", self.train)
        _check_noise(self.frac_noise, self.noise_vocab_size)
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even, got {self.seq_len}")
        if self.content_vocab_size < 2:
            raise ValueError(
                f"vocab_size too small: {self.vocab_size} leaves {self.content_vocab_size} key/value "
                f"ids after noise_vocab_size={self.noise_vocab_size} and special tokens (need >= 2)"
            )

    @property
    def content_vocab_size(self) -> int:
        """V' = V − noise_vocab_size (− 1 for the copy prefix without multi-query)."""
        return self.vocab_size - self.noise_vocab_size - (0 if self.multi_query else 1)


@dataclass(frozen=True, kw_only=True)
class NoisyInContextRecallConfig(InContextRecallConfig):
    """Noisy in-context recall (MAD baseline: vocab 32 incl. 16 noise tokens, noise fraction 0.2)."""

    vocab_size: int = 32
    noise_vocab_size: int = 16
    frac_noise: float = 0.2


@dataclass(frozen=True, kw_only=True)
class FuzzyInContextRecallConfig:
    """Fuzzy in-context recall (MAD baseline: vocab 16, seq 128, key/value motifs of up to 3 tokens).

    k_motif_size / v_motif_size: maximal tokens per key / value motif (motif tokens are distinct).
    Other fields as in :class:`InContextRecallConfig`; the pad token is V − 1 with multi-query.
    """

    vocab_size: int = 16
    seq_len: int = 128
    num_examples: int = 12_800
    k_motif_size: int = 3
    v_motif_size: int = 3
    multi_query: bool = True
    noise_vocab_size: int = 0
    frac_noise: float = 0.0
    train: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 3)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("num_examples", self.num_examples, 1)
        _check_int("k_motif_size", self.k_motif_size, 1)
        _check_int("v_motif_size", self.v_motif_size, 1)
        _check_int("seed", self.seed, 0)
        _check_bool("multi_query", self.multi_query)
        _check_bool("train", self.train)
        _check_noise(self.frac_noise, self.noise_vocab_size)
        content = self.content_vocab_size
        if content // 2 < self.k_motif_size or content - content // 2 < self.v_motif_size:
            raise ValueError(
                f"vocab_size too small: {content} key/value ids give {content // 2} keys and "
                f"{content - content // 2} values, fewer than k_motif_size={self.k_motif_size} / "
                f"v_motif_size={self.v_motif_size} distinct tokens"
            )
        if self.seq_len <= 2 * (self.k_motif_size + self.v_motif_size):
            raise ValueError(
                f"seq_len must be > 2 * (k_motif_size + v_motif_size) = "
                f"{2 * (self.k_motif_size + self.v_motif_size)}, got {self.seq_len}"
            )

    @property
    def content_vocab_size(self) -> int:
        """V' = V − noise_vocab_size − 1 (pad) − 1 (copy prefix, without multi-query only)."""
        return self.vocab_size - self.noise_vocab_size - (1 if self.multi_query else 2)


@dataclass(frozen=True, kw_only=True)
class SelectiveCopyingConfig:
    """Selective copying (MAD baseline: vocab 16, seq 256, 16 tokens to copy).

    Tokens to copy come from [0, V − 2); blank = V − 2, copy token = V − 1;
    seq_len > 2·num_tokens_to_copy + 1 (at least one blank among the tokens to copy).
    ``train`` only selects the random stream (train and test examples have the same form).
    """

    vocab_size: int = 16
    seq_len: int = 256
    num_tokens_to_copy: int = 16
    num_examples: int = 12_800
    train: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 3)
        _check_int("seq_len", self.seq_len, 4)
        _check_int("num_tokens_to_copy", self.num_tokens_to_copy, 1)
        _check_int("num_examples", self.num_examples, 1)
        _check_int("seed", self.seed, 0)
        _check_bool("train", self.train)
        if self.seq_len <= 2 * self.num_tokens_to_copy + 1:
            raise ValueError(
                f"seq_len must be > 2 * num_tokens_to_copy + 1 = {2 * self.num_tokens_to_copy + 1}, got {self.seq_len}"
            )


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Compression (MAD baseline: vocab 16, seq 32; AutoEncoder backbone).

    Tokens from [0, V − 1); compression token = V − 1 at the last position.
    ``train`` only selects the random stream.
    """

    vocab_size: int = 16
    seq_len: int = 32
    num_examples: int = 12_800
    train: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 2)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("num_examples", self.num_examples, 1)
        _check_int("seed", self.seed, 0)
        _check_bool("train", self.train)


@dataclass(frozen=True, kw_only=True)
class MemorizationConfig:
    """Memorization (MAD baseline: vocab 256, seq 32, 256 train examples, fixed key→value map).

    Insert token = V − 1; keys [0, (V−1)//2), values [(V−1)//2, V − 1); seq_len even.
    The map depends on ``seed`` only; ``train`` selects the example stream.
    """

    vocab_size: int = 256
    seq_len: int = 32
    num_examples: int = 256
    train: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 3)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("num_examples", self.num_examples, 1)
        _check_int("seed", self.seed, 0)
        _check_bool("train", self.train)
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even, got {self.seq_len}")

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - 1) // 2


# --------------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------------


def _check_config(config: Any, cls: type, fn: str) -> None:
    if not isinstance(config, cls):
        raise ValueError(f"{fn}: config must be a {cls.__name__}, got {type(config).__name__}")


def make_in_context_recall(config: InContextRecallConfig) -> Pair:
    """(Noisy) in-context recall (benchmarks.md §4).

    Returns inputs, labels: LongTensor [N, T], T = seq_len − 1 with multi-query, seq_len without.
    Train labels are ``seq[1:]``; test labels keep only probed values (−100 elsewhere).
    """
    _check_config(config, InContextRecallConfig, "make_in_context_recall")
    rng = _example_rng(config)
    n_rows, slots = config.num_examples, config.seq_len // 2 - 1
    content = config.content_vocab_size
    n_keys = content // 2
    rows = np.arange(n_rows)

    keys = rng.integers(0, n_keys, size=(n_rows, slots))
    table = rng.integers(n_keys, content, size=(n_rows, n_keys))  # each key's value in its sequence
    values = table[rows[:, None], keys]
    body = np.stack([keys, values], axis=-1)  # [N, S, 2]
    noise = np.zeros((n_rows, slots), dtype=bool)
    if config.frac_noise > 0:
        noise = rng.random((n_rows, slots)) < config.frac_noise
        noise[rows, rng.integers(0, slots, size=n_rows)] = False  # at least one kv pair
        noise_tokens = rng.integers(content, content + config.noise_vocab_size, size=(n_rows, slots, 2))
        body = np.where(noise[..., None], noise_tokens, body)

    seen = np.zeros((n_rows, n_keys), dtype=bool)
    scored = np.zeros((n_rows, slots), dtype=bool)
    for s in range(slots):
        k, valid = keys[:, s], ~noise[:, s]
        scored[:, s] = valid & seen[rows, k]
        seen[rows[valid], k[valid]] = True

    # Final probe: a uniformly chosen key among those presented.
    probe_key = np.argmax(np.where(seen, rng.random((n_rows, n_keys)), -1.0), axis=1)
    probe_value = table[rows, probe_key]

    tail = [probe_key, probe_value]
    if not config.multi_query:
        tail.insert(0, np.full(n_rows, config.vocab_size - 1))
    seq = np.concatenate([body.reshape(n_rows, 2 * slots), np.stack(tail, axis=1)], axis=1)

    if config.train:
        return _to_tensors(seq[:, :-1], seq[:, 1:])
    targets = np.full_like(seq, IGNORE_INDEX)
    if config.multi_query:
        value_targets = np.where(scored, values, IGNORE_INDEX)
        targets[:, 1 : 2 * slots : 2] = value_targets
    targets[:, -1] = probe_value
    return _to_tensors(seq[:, :-1], targets[:, 1:])


def make_noisy_in_context_recall(config: NoisyInContextRecallConfig) -> Pair:
    """Noisy in-context recall: :func:`make_in_context_recall` with noise pairs (benchmarks.md §4)."""
    _check_config(config, InContextRecallConfig, "make_noisy_in_context_recall")
    return make_in_context_recall(config)


class _Draws:
    """Fast scalar draws from blocks of a numpy Generator's uniforms (deterministic per generator)."""

    def __init__(self, rng: np.random.Generator, block: int = 8192) -> None:
        self._rng, self._block = rng, block
        self._buf: list[float] = []
        self._i = 0

    def uniform(self) -> float:
        if self._i == len(self._buf):
            self._buf, self._i = self._rng.random(self._block).tolist(), 0
        u = self._buf[self._i]
        self._i += 1
        return u

    def integer(self, n: int) -> int:
        """Uniform in range(n)."""
        return min(int(self.uniform() * n), n - 1)

    def distinct(self, low: int, high: int, size: int) -> tuple[int, ...]:
        """``size`` distinct uniform ids from range(low, high), in random order."""
        out: list[int] = []
        while len(out) < size:
            t = low + self.integer(high - low)
            if t not in out:
                out.append(t)
        return tuple(out)


def make_fuzzy_in_context_recall(config: FuzzyInContextRecallConfig) -> Pair:
    """Fuzzy in-context recall with multi-token key/value motifs (benchmarks.md §4).

    Returns inputs, labels: LongTensor [N, seq_len]. Train labels are the shifted sequence (left pads
    included, as in MAD); test labels keep the values of repeated keys and the final probe value.
    """
    _check_config(config, FuzzyInContextRecallConfig, "make_fuzzy_in_context_recall")
    d = _Draws(_example_rng(config))
    v, seq_len = config.vocab_size, config.seq_len
    km, vm, mq = config.k_motif_size, config.v_motif_size, config.multi_query
    content = config.content_vocab_size
    n_keys = content // 2
    pad = v - 1 if mq else v - 2
    copy_prefix = v - 1
    noise_low = content
    k_sizes = list(range(1, km + 1)) if config.train else [km]
    v_sizes = list(range(1, vm + 1))

    all_inputs = np.empty((config.num_examples, seq_len + 1), dtype=np.int64)
    all_targets = np.empty_like(all_inputs)
    for row in range(config.num_examples):
        k_probe = d.distinct(0, n_keys, k_sizes[d.integer(len(k_sizes))])
        v_probe = d.distinct(n_keys, content, v_sizes[d.integer(len(v_sizes))])
        kv_probe = len(k_probe) + len(v_probe)
        limit = seq_len - kv_probe - (km + vm)
        probe_idx = d.integer(seq_len - 2 * kv_probe)
        probe_added = False
        kv_map: dict[tuple[int, ...], tuple[int, ...]] = {}
        presented: set[tuple[int, ...]] = set()
        inputs: list[int] = []
        targets: list[int] = []
        while len(inputs) < limit:
            k_size = k_sizes[d.integer(len(k_sizes))]
            v_size = v_sizes[d.integer(len(v_sizes))]
            if not probe_added and (len(inputs) >= probe_idx or len(inputs) + km + vm >= limit):
                inputs += [*k_probe, *v_probe]
                targets += [IGNORE_INDEX] * kv_probe
                kv_map[k_probe] = v_probe
                presented.add(k_probe)
                probe_added = True
                continue
            if config.frac_noise > 0 and d.uniform() < config.frac_noise:
                inputs += [noise_low + d.integer(config.noise_vocab_size) for _ in range(k_size + v_size)]
                targets += [IGNORE_INDEX] * (k_size + v_size)
                continue
            k = d.distinct(0, n_keys, k_size)
            if k == k_probe:
                val = v_probe
                probe_added = True
            elif k in kv_map:
                val = kv_map[k]
            else:
                val = d.distinct(n_keys, content, v_size)
                kv_map[k] = val
            inputs += [*k, *val]
            targets += [IGNORE_INDEX] * len(k)
            targets += list(val) if (mq and k in presented) else [IGNORE_INDEX] * len(val)
            presented.add(k)
        if not mq:
            inputs.append(copy_prefix)
            targets.append(IGNORE_INDEX)
        inputs += [*k_probe, *v_probe]
        targets += [IGNORE_INDEX] * len(k_probe) + list(v_probe)
        n_pad = seq_len + 1 - len(inputs)
        all_inputs[row] = [pad] * n_pad + inputs
        all_targets[row] = [IGNORE_INDEX] * n_pad + targets

    if config.train:
        return _to_tensors(all_inputs[:, :-1], all_inputs[:, 1:])
    return _to_tensors(all_inputs[:, :-1], all_targets[:, 1:])


def make_selective_copying(config: SelectiveCopyingConfig) -> Pair:
    """Selective copying (benchmarks.md §4).

    Returns inputs, labels: LongTensor [N, seq_len]. Positions 0..n+B−1 hold the n tokens to copy in
    order, scattered among B = seq_len − 2n − 1 blanks; then the copy token and n blanks. Labels are −100
    except at the last n positions, which carry the tokens to copy in order.
    """
    _check_config(config, SelectiveCopyingConfig, "make_selective_copying")
    rng = _example_rng(config)
    n_rows, n = config.num_examples, config.num_tokens_to_copy
    blank, copy_token = config.vocab_size - 2, config.vocab_size - 1
    region = config.seq_len - n - 1  # tokens to copy + blanks before the copy token

    tokens = rng.integers(0, config.vocab_size - 2, size=(n_rows, n))
    positions = np.sort(np.argpartition(rng.random((n_rows, region)), n - 1, axis=1)[:, :n], axis=1)
    inputs = np.full((n_rows, config.seq_len), blank, dtype=np.int64)
    np.put_along_axis(inputs, positions, tokens, axis=1)
    inputs[:, region] = copy_token
    labels = np.full((n_rows, config.seq_len), IGNORE_INDEX, dtype=np.int64)
    labels[:, region + 1 :] = tokens
    return _to_tensors(inputs, labels)


def make_compression(config: CompressionConfig) -> Pair:
    """Compression (benchmarks.md §4).

    Returns inputs, labels: LongTensor [N, seq_len]; inputs = seq_len − 1 tokens from [0, V − 1) then
    the compression token V − 1; labels = inputs (every position is reconstructed).
    """
    _check_config(config, CompressionConfig, "make_compression")
    rng = _example_rng(config)
    body = rng.integers(0, config.vocab_size - 1, size=(config.num_examples, config.seq_len - 1))
    inputs = np.concatenate([body, np.full((config.num_examples, 1), config.vocab_size - 1)], axis=1)
    return _to_tensors(inputs, inputs.copy())


def memorization_kv_map(config: MemorizationConfig) -> torch.Tensor:
    """LongTensor [(V−1)//2]: the fixed value of each key (an injective map into [(V−1)//2, V − 1)),
    a function of ``config.vocab_size`` and ``config.seed`` only."""
    _check_config(config, MemorizationConfig, "memorization_kv_map")
    k = config.num_keys
    values = _rng(config.seed, _STREAM_MAP).permutation(np.arange(k, config.vocab_size - 1))[:k]
    return torch.from_numpy(values.astype(np.int64))


def make_memorization(config: MemorizationConfig) -> Pair:
    """Memorization of a fixed key→value map (benchmarks.md §4).

    Returns inputs, labels: LongTensor [N, seq_len]; inputs alternate key, insert token (V − 1);
    labels are −100 at keys and ``memorization_kv_map(config)[key]`` at the insert tokens.
    """
    _check_config(config, MemorizationConfig, "make_memorization")
    table = memorization_kv_map(config).numpy()
    rng = _example_rng(config)
    pairs = config.seq_len // 2
    keys = rng.integers(0, config.num_keys, size=(config.num_examples, pairs))
    inputs = np.stack([keys, np.full_like(keys, config.vocab_size - 1)], axis=-1)
    labels = np.stack([np.full_like(keys, IGNORE_INDEX), table[keys]], axis=-1)
    return _to_tensors(inputs.reshape(config.num_examples, -1), labels.reshape(config.num_examples, -1))


# --------------------------------------------------------------------------------------------------
# Registry and settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MADTask:
    """A MAD task: its generator, baseline config and one-variable-at-a-time changes.

    ``changes`` maps a config field to the values it takes (each with the other fields at baseline);
    ``num_examples`` here is the number of training examples.
    """

    name: str
    make: Callable[[Any], Pair]
    config: Any
    changes: Mapping[str, tuple] = field(default_factory=dict)

    def settings(self) -> list[tuple[str, Any]]:
        """[("baseline", config), ("vocab_size=32", config'), …]: every setting of the task."""
        out = [("baseline", self.config)]
        for name, values in self.changes.items():
            out += [(f"{name}={value}", replace(self.config, **{name: value})) for value in values]
        return out


_TRAIN_SIZES = (6_400, 3_200, 1_600, 800)

MAD_TASKS: dict[str, MADTask] = {
    "in-context-recall": MADTask(
        "in-context-recall",
        make_in_context_recall,
        InContextRecallConfig(),
        {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024), "num_examples": _TRAIN_SIZES},
    ),
    "fuzzy-in-context-recall": MADTask(
        "fuzzy-in-context-recall",
        make_fuzzy_in_context_recall,
        FuzzyInContextRecallConfig(),
        {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024), "num_examples": _TRAIN_SIZES},
    ),
    "noisy-in-context-recall": MADTask(
        "noisy-in-context-recall",
        make_noisy_in_context_recall,
        NoisyInContextRecallConfig(),
        {
            "vocab_size": (48, 80, 144),  # 16 noise tokens included
            "seq_len": (256, 512, 1024),
            "num_examples": _TRAIN_SIZES,
            "frac_noise": (0.4, 0.6, 0.8),
        },
    ),
    "selective-copying": MADTask(
        "selective-copying",
        make_selective_copying,
        SelectiveCopyingConfig(),
        {
            "vocab_size": (32, 64, 128),
            "seq_len": (512, 1024),
            "num_examples": _TRAIN_SIZES,
            "num_tokens_to_copy": (32, 64, 96),
        },
    ),
    "compression": MADTask(
        "compression",
        make_compression,
        CompressionConfig(),
        {"vocab_size": (32, 64, 128), "seq_len": (64, 128, 256), "num_examples": _TRAIN_SIZES},
    ),
    "memorization": MADTask(
        "memorization",
        make_memorization,
        MemorizationConfig(),
        {"vocab_size": (512, 1024, 2048, 4096, 8192)},
    ),
}
"""The six MAD tasks with their baselines and changes (mad-lab `configs/tasks/*.yml`)."""


def _task(task: str) -> MADTask:
    if task not in MAD_TASKS:
        raise ValueError(f"task must be one of {sorted(MAD_TASKS)}, got {task!r}")
    return MAD_TASKS[task]


def mad_settings(task: str) -> list[tuple[str, Any]]:
    """Every (setting name, train config) of ``task``: the baseline plus each one-variable change."""
    return _task(task).settings()


def make_mad(task: str, config: Any = None) -> Pair:
    """Generate ``task`` with ``config`` (default: the task's baseline config)."""
    t = _task(task)
    return t.make(t.config if config is None else config)


def make_mad_splits(
    task: str, config: Any = None, *, num_test_examples: int = MAD_NUM_TEST_EXAMPLES
) -> tuple[Pair, Pair]:
    """Train set (``config`` with train=True) and test set (train=False, ``num_test_examples``
    examples; MAD uses 1,280) of one setting; the two use different random streams of ``config.seed``.

    Returns ((train_inputs, train_labels), (test_inputs, test_labels)).
    """
    _check_int("num_test_examples", num_test_examples, 1)
    t = _task(task)
    cfg = t.config if config is None else config
    train = t.make(replace(cfg, train=True))
    test = t.make(replace(cfg, train=False, num_examples=num_test_examples))
    return train, test


# --------------------------------------------------------------------------------------------------
# Score
# --------------------------------------------------------------------------------------------------

_RESULT_FIELDS = ("task", "setting", "lr", "wd", "accuracy")


def _setting_key(setting: Any) -> Any:
    if isinstance(setting, Mapping):
        return tuple(sorted((str(k), _setting_key(v)) for k, v in setting.items()))
    try:
        hash(setting)
    except TypeError:
        raise ValueError(f"setting must be hashable or a mapping, got {setting!r}") from None
    return setting


def mad_task_scores(results: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per-task MAD score: best accuracy over the lr × wd sweep per (task, setting), then the mean
    over the task's settings (benchmarks.md §4, mad-lab `mad/analysis.py`).

    results: records with keys task, setting, lr, wd, accuracy (a setting may be a name or a mapping
    of the changed fields). Several records of one (task, setting, lr, wd) also reduce by max.
    """
    best: dict[tuple[str, Any], float] = {}
    for i, record in enumerate(results):
        if not isinstance(record, Mapping):
            raise ValueError(f"results[{i}] must be a mapping, got {type(record).__name__}")
        missing = [f for f in _RESULT_FIELDS if f not in record]
        if missing:
            raise ValueError(f"results[{i}] lacks {', '.join(missing)}")
        acc = record["accuracy"]
        if isinstance(acc, torch.Tensor):
            acc = acc.item()
        if isinstance(acc, bool) or not isinstance(acc, (int, float, np.floating, np.integer)):
            raise ValueError(f"results[{i}] accuracy must be a number, got {acc!r}")
        if not math.isfinite(float(acc)):
            raise ValueError(f"results[{i}] accuracy must be finite, got {acc}")
        key = (str(record["task"]), _setting_key(record["setting"]))
        best[key] = max(best.get(key, -math.inf), float(acc))
    if not best:
        raise ValueError("results must be non-empty")
    per_task: dict[str, list[float]] = defaultdict(list)
    for (task, _), acc in best.items():
        per_task[task].append(acc)
    return {task: sum(accs) / len(accs) for task, accs in per_task.items()}


def mad_score(results: Iterable[Mapping[str, Any]]) -> float:
    """MAD score: mean over tasks of :func:`mad_task_scores` (best over lr × wd per setting, mean over
    settings, mean over tasks). Accuracies are averaged in whatever scale they come in (0–1 or %)."""
    scores = mad_task_scores(results)
    return sum(scores.values()) / len(scores)
