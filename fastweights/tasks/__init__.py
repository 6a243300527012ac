"""Seeded, pure data generators for the recall benchmarks (research/benchmarks.md §1, §3, §4).

* :mod:`fastweights.tasks.mqar` — multi-query associative recall as Zoology generates it.
* :mod:`fastweights.tasks.niah` — S-NIAH-1/2/3 after RULER, with a bundled filler-text generator
  and a byte-level tokenizer (nothing is downloaded).
* :mod:`fastweights.tasks.mad` — the six MAD tasks and the MAD score.

Every generator returns LongTensors whose labels are −100 where nothing is scored and are already
aligned with the prediction position (``labels[:, t]`` is the target of the output at t).
"""

from fastweights.tasks.mad import (
    MAD_TASKS,
    CompressionConfig,
    FuzzyInContextRecallConfig,
    InContextRecallConfig,
    MADTask,
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
from fastweights.tasks.mqar import MQARConfig, make_mqar, make_mqar_splits
from fastweights.tasks.niah import (
    NIAH_TASKS,
    ByteTokenizer,
    make_niah,
    niah_training_batch,
    string_match_all,
)

__all__ = [
    "MQARConfig",
    "make_mqar",
    "make_mqar_splits",
    "ByteTokenizer",
    "NIAH_TASKS",
    "make_niah",
    "niah_training_batch",
    "string_match_all",
    "MAD_TASKS",
    "MADTask",
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
    "make_mad",
    "make_mad_splits",
    "mad_settings",
    "mad_task_scores",
    "mad_score",
]
