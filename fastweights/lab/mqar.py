"""MQAR sweeps: train zoo models on multi-query associative recall and compare their recall against
d_model and against the bytes of their decoding state.

    fastweights mqar --preset quick --out runs/mqar          (or: python -m fastweights.lab.mqar ...)

Data: `fastweights.tasks.mqar` (Zoology's generator, research/benchmarks.md §1.1), one train and
one test segment per (seq_len, num_kv_pairs) setting, or a mixture of segments (the Based
"standard" sweep, §1.4). Segments of different lengths are right-padded to the longest with
token 0 and label −100: every model here is causal, so the padding changes nothing at the real
positions (unlike Zoology, a batch may mix segments).

Models: `LM(LMConfig(vocab_size, d_model, n_layers=2, mixer=<zoo name>, num_heads, mlp="none"))`,
Zoology's layout (no MLP, tied head; RMSNorm instead of LayerNorm, RoPE for softmax attention
instead of learned positions, no embedding dropout). `conv` picks the short causal conv of every
mixer: "preset" (each zoo preset's own: on for mamba2 and the delta family, off for
linear_attention, gla, retnet and softmax attention), "qkv" (a kernel-`conv_size` conv on q, k,
v in every layer — the Based sweep wraps every mixer in a short conv) or "none".

Training: `fastweights.lab.train.train_cell` (AdamW, cosine, evaluation every epoch, early stop
at 0.99, Zoology's per-example accuracy). The papers report the best accuracy over the learning
rate sweep; so does the table (`best_over`). The cells of a sweep that differ only in lr and seed
train together in one process (`fastweights.lab.stack`, `run_mqar(stack=...)`, `--no-stack`): the
same records, each as train_cell gives it alone.

Outputs in --out: results.jsonl (one record per cell; a re-run skips finished cells),
checkpoints/ (per-epoch, for resumption), mqar_d_model.png (accuracy vs d_model) and
mqar_state.png (accuracy vs state bytes), one line per model, one panel per setting.

Presets (`PRESETS`): `quick` (CPU, ~10 min on 2 cores with --workers 2), `zoology-fig2` (the
Zoology paper's Fig. 2 grid, with this library's mixers) and `based-standard` (the Based/Zoology
"standard" mixture sweep). The GPU presets are 100k-example, 32–64-epoch sweeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..tasks.mqar import IGNORE_INDEX, MQARConfig, make_mqar_splits
from .train import NUMBER, ResultStore, TrainConfig, best_over, pin_cpu_numerics, run_sweep, train_cell

__all__ = ["MQARCell", "MQARPreset", "PRESETS", "make_cells", "build_model", "lm_config", "cell_data", "run_cell",
           "run_mqar", "format_table", "plot_mqar", "add_cli", "cli_main", "main", "build_lm",
           "format_bytes"]

Segment = tuple[int, int, int]  # (seq_len, num_kv_pairs, num_examples)


@dataclass(frozen=True, kw_only=True)
class MQARCell:
    """One trained model: model × d_model × setting × lr (and the fixed knobs of its sweep).

    setting: panel label, "L{seq_len}-kv{n}" for a single segment, else the sweep's name.
    train_segments, test_segments: ((seq_len, num_kv_pairs, num_examples), ...).
    head_dim: every mixer's key and value head dim, K = V (None: each zoo preset's own — e.g. gated DeltaNet's keys
              of 0.75·d_model/H and values twice that; left out of the cell's key when None, so the records of
              sweeps made before the field existed keep theirs).
    """

    model: str
    d_model: int
    setting: str
    lr: float
    train_segments: tuple[Segment, ...]
    test_segments: tuple[Segment, ...]
    vocab_size: int = 8192
    num_heads: int = 1
    n_layers: int = 2
    conv: str = "preset"
    conv_size: int = 4
    out_gate: str = "preset"
    random_non_queries: bool = True
    epochs: int = 8
    batch_size: int = 64
    eval_batch_size: int | None = None
    weight_decay: float = 0.1
    decay_filter: str = "all"
    warmup: float = 0.0
    grad_clip: float | None = None
    early_stop: float | None = 0.99
    chunk_size: int = 64
    seed: int = 0
    head_dim: int | None = dataclasses.field(default=None, metadata={"key": "omit if None"})

    def __post_init__(self):
        if self.conv not in ("preset", "qkv", "none"):
            raise ValueError(f"conv must be 'preset', 'qkv' or 'none', got {self.conv!r}")
        if self.out_gate not in ("preset", "none"):
            raise ValueError(f"out_gate must be 'preset' or 'none', got {self.out_gate!r}")
        object.__setattr__(self, "train_segments", tuple(tuple(int(v) for v in s) for s in self.train_segments))
        object.__setattr__(self, "test_segments", tuple(tuple(int(v) for v in s) for s in self.test_segments))
        for name in ("train_segments", "test_segments"):
            segs = getattr(self, name)
            if not segs or any(len(s) != 3 for s in segs):
                raise ValueError(f"{name} must be a non-empty tuple of (seq_len, num_kv_pairs, num_examples)")

    @property
    def seq_len(self) -> int:
        """The longest test length (the state bytes of softmax attention are taken there)."""
        return max(s[0] for s in self.test_segments)

    @property
    def num_kv_pairs(self) -> int:
        return max(s[1] for s in self.test_segments)

    def train_config(self, device: str = "cpu", dtype: str = "float32") -> TrainConfig:
        return TrainConfig(epochs=self.epochs, batch_size=self.batch_size, eval_batch_size=self.eval_batch_size,
                           lr=self.lr, weight_decay=self.weight_decay, decay_filter=self.decay_filter,
                           warmup=self.warmup, grad_clip=self.grad_clip, early_stop=self.early_stop,
                           accuracy="examples", seed=self.seed, device=device, dtype=dtype)

    def describe(self) -> str:
        seed = f" seed={self.seed}" if self.seed else ""
        return f"{self.model} d={self.d_model} {self.setting} lr={self.lr:.3g}{seed}"


#: Recipe variants a cell's model may name as "<zoo name>+<variant>" (`model_spec`): the zoo model with these recipe
#: fields replaced. "poly2h": the degree-2 homogeneous polynomial feature map on q and k (K' = K(K+1)/2; claim 3 of
#: issue 37). A variant is a model name of its own: the cell's fields (and every record's key) stay as they are.
MODEL_VARIANTS: dict[str, dict] = {"poly2h": {"feature_map": ("polynomial", 2, True)}}


def model_spec(name: str):
    """The mixer spec of a cell's model: a zoo name as it is, or for "<zoo name>+<variant>" the zoo recipe with the
    variant's fields (`MODEL_VARIANTS`) and that name."""
    from .. import zoo

    if "+" not in name:
        return name
    base, variant = name.split("+", 1)
    if variant not in MODEL_VARIANTS:
        raise ValueError(f"model {name!r}: unknown variant {variant!r} (known: {', '.join(MODEL_VARIANTS)})")
    from ..recipe import FeatureMap

    fields = dict(MODEL_VARIANTS[variant])
    if "feature_map" in fields:
        kind, degree, homogeneous = fields["feature_map"]
        fields["feature_map"] = FeatureMap(kind=kind, degree=degree, homogeneous=homogeneous)
    return dataclasses.replace(zoo.get(base), name=name, **fields)


def model_names() -> list[str]:
    """Every model a cell may name: the zoo's, then each variant of every fast-weight model."""
    from .. import zoo

    return zoo.names() + [f"{m}+{v}" for m in zoo.names() if not zoo.get(m).is_softmax for v in MODEL_VARIANTS]


def lm_config(cell: MQARCell):
    from ..models import LMConfig

    return LMConfig(vocab_size=cell.vocab_size, d_model=cell.d_model, n_layers=cell.n_layers,
                    mixer=model_spec(cell.model),
                    num_heads=cell.num_heads, mlp="none", chunk_size=cell.chunk_size,
                    head_dim=cell.head_dim, head_v_dim=cell.head_dim,
                    mixer_overrides=mixer_overrides(cell))


def mixer_overrides(cell: MQARCell) -> dict:
    """MixerPreset fields the cell replaces in every layer ({} = the zoo presets as they are)."""
    ov = {}
    if cell.conv != "preset":
        ov.update(conv=cell.conv, conv_size=cell.conv_size)
    if cell.out_gate != "preset":
        ov.update(out_gate=cell.out_gate)
    return ov


def build_model(cell: MQARCell):
    """The LM of a cell; its conv and out_gate choices are `LMConfig.mixer_overrides`."""
    return build_lm(lm_config(cell))


def build_lm(cfg):
    """LM(cfg), its parameters drawn as before `LMConfig.mixer_overrides` existed: the LM without
    the overrides, then every mixer rebuilt with them — so runs recorded earlier reproduce
    exactly. The model's config carries the overrides (a checkpoint rebuilds the same layers)."""
    from ..layers.mixer import MemoryMixer
    from ..models import LM

    if not cfg.mixer_overrides:
        return LM(cfg)
    model = LM(dataclasses.replace(cfg, mixer_overrides=()))
    for i, block in enumerate(model.blocks):
        block.mixer = MemoryMixer(cfg.d_model, cfg.layer_mixers[i], cfg.num_heads, **cfg.mixer_kwargs(i))
    model.config = cfg
    return model


@lru_cache(maxsize=8)
def _segments(segments: tuple[Segment, ...], vocab: int, rnq: bool, seed: int, test: bool):
    xs, ys = [], []
    T = max(s[0] for s in segments)
    for j, (L, n, N) in enumerate(segments):
        cfg = MQARConfig(vocab_size=vocab, seq_len=L, num_kv_pairs=n, num_examples=N, random_non_queries=rnq,
                         seed=seed * 1000 + j)
        train, tst = make_mqar_splits(cfg, cfg) if test else (make_mqar_splits(cfg, replace_n(cfg, 1))[0], None)
        x, y = tst if test else train
        if L < T:  # right-pad: causal models are unaffected at the real positions
            x = torch.cat([x, x.new_zeros(N, T - L)], dim=1)
            y = torch.cat([y, y.new_full((N, T - L), IGNORE_INDEX)], dim=1)
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def replace_n(cfg: MQARConfig, n: int) -> MQARConfig:
    return dataclasses.replace(cfg, num_examples=n)


def cell_data(cell: MQARCell):
    """((train_inputs, train_labels), (test_inputs, test_labels)) of a cell: segment j of the train
    (test) mixture is `make_mqar_splits`' train (test) split with seed = cell.seed·1000 + j."""
    train = _segments(cell.train_segments, cell.vocab_size, cell.random_non_queries, cell.seed, False)
    test = _segments(cell.test_segments, cell.vocab_size, cell.random_non_queries, cell.seed, True)
    return train, test


def run_cell(cell: MQARCell, *, progress=None, desc: str | None = None, device: str = "cpu",
             dtype: str = "float32", checkpoint_dir=None, fresh: bool = False, cuda_graph: bool = False) -> dict:
    """Train one cell; the result of `train_cell` plus "state_bytes" (the model's decoding state for
    one sequence of the longest test length, fp32 memories: constant for fast-weight layers, the KV
    cache for softmax attention) and "slices" (the final model's accuracy per test segment). The
    checkpoint's name hashes the cell, the dtype and the device type, and the checkpoint records
    them (`train_cell(signature=...)`); fresh=True discards it first. cuda_graph: train with CUDA-graphed
    steps (`train_cell(cuda_graph=...)`; recorded as "cuda_graph", not part of the cell or its checkpoint's
    name)."""
    from .train import accuracy

    train, test = cell_data(cell)
    ckpt = None
    if checkpoint_dir is not None:
        import hashlib

        from .train import cell_key

        h = hashlib.sha1((cell_key(cell) + f"|{dtype}|{torch.device(device).type}").encode()).hexdigest()[:16]
        ckpt = Path(checkpoint_dir) / f"{cell.model}-d{cell.d_model}-{h}.pt"
    box = {}

    def make(_cfg):
        m = build_model(cell)
        box["model"] = m
        return m

    res = train_cell(lm_config(cell), train, test, cell.train_config(device, dtype), checkpoint_path=ckpt,
                     progress=progress, model_fn=make, desc=desc or cell.describe(),
                     signature=dataclasses.asdict(cell), fresh=fresh, cuda_graph=cuda_graph)
    model = box["model"]
    res["state_bytes"] = int(model.state_size(1, cell.seq_len))
    if len(cell.test_segments) > 1:
        slices, start = {}, 0
        for L, n, N in cell.test_segments:
            x, y = test[0][start:start + N], test[1][start:start + N]
            start += N
            slices[f"L{L}-kv{n}"] = accuracy(model, x, y, cell.eval_batch_size or cell.batch_size,
                                             reduction="examples")
        res["slices"] = slices
    return res  # (a finished checkpoint is kept: it makes a re-run of the cell free even without the JSONL)


# ------------------------------------------------------------------------------------------ presets
@dataclass(frozen=True, kw_only=True)
class MQARPreset:
    """A sweep: models × d_models × settings × lrs, with the knobs shared by its cells.

    settings: ((seq_len, num_kv_pairs), ...) — each a single train/test segment of
              train_examples/test_examples — or, with `train_segments`, one mixture setting.
    d_models_for: per-model d_model grids overriding d_models.
    heads_for: per-model num_heads overriding num_heads (the ceilings preset picks them so that the state sizes
              are comparable).
    equal_heads: every mixer at key and value head dims K = V = d_model / num_heads (`MQARCell.head_dim`; the v2
              presets' equal footing); False: each zoo preset's own head dims.
    lrs_for: per-model lr sets overriding lrs.
    lr_pilot: the name of a pilot preset whose records choose each model's lrs (`pilot_lrs`:
              its `lr_pick` best); the sweep then needs those records (`--lrs-from`).
    batch_for_len: ((max_len, batch), ...): the batch of a setting is that of the first max_len ≥ L.
    examples_for_len: ((max_len, n), ...): the train examples of a setting, likewise (default
              train_examples; a `train_examples` override of `make_cells` applies to every setting).
    skip_unreachable: a cell is not trained when its model stayed below 0.5 at the two kv pairs just below
              it (`ceilings.unreachable`, asked as the cell comes up, from the records so far).
    seeds:    every cell trained once per seed (the lr × seed protocol, `fastweights.lab.protocol`; `--seed S`
              shifts them by S); () = the one `--seed`.
    followup_seeds, max_seeds: the protocol's follow-up (`protocol.run_protocol`): a cell whose accuracy along kv
              dips below both neighbours gets `followup_seeds` more seeds (every lr of its grid) per round, until
              its curve is monotone or it has `max_seeds` seeds; 0 = no follow-up.
    """

    name: str
    models: tuple[str, ...]
    d_models: tuple[int, ...]
    settings: tuple[tuple[int, int], ...] = ()
    lrs: tuple[float, ...] = (1e-3,)
    epochs: int = 8
    train_examples: int = 1000
    test_examples: int = 200
    batch_size: int = 64
    batch_for_len: tuple[tuple[int, int], ...] = ()
    examples_for_len: tuple[tuple[int, int], ...] = ()
    eval_batch_size: int | None = None
    vocab_size: int = 8192
    num_heads: int = 1
    conv: str = "preset"
    out_gate: str = "preset"
    random_non_queries: bool = True
    weight_decay: float = 0.1
    decay_filter: str = "all"
    warmup: float = 0.0
    grad_clip: float | None = None
    train_segments: tuple[Segment, ...] = ()
    test_segments: tuple[Segment, ...] = ()
    d_models_for: tuple[tuple[str, tuple[int, ...]], ...] = ()
    heads_for: tuple[tuple[str, int], ...] = ()
    equal_heads: bool = False
    skip_unreachable: bool = False
    lrs_for: tuple[tuple[str, tuple[float, ...]], ...] = ()
    lr_pilot: str | None = None
    lr_pick: int = 2
    seeds: tuple[int, ...] = ()
    followup_seeds: int = 0
    max_seeds: int = 0
    note: str = ""
    workers: int = 1
    threads: int | None = None

    def batch(self, L: int) -> int:
        for max_len, b in self.batch_for_len:
            if L <= max_len:
                return b
        return self.batch_size

    def examples(self, L: int) -> int:
        for max_len, n in self.examples_for_len:
            if L <= max_len:
                return n
        return self.train_examples


def _logspace(a: float, b: float, n: int) -> tuple[float, ...]:
    return tuple(float(f"{10 ** (a + (b - a) * i / (n - 1)):.4g}") for i in range(n))


def zoo_names() -> list[str]:
    from .. import zoo

    return zoo.names()


#: The ceilings grid: kv pairs 8..256, each at the shortest length that holds them, L = max(64, 4·kv).
CEILING_SETTINGS: tuple[tuple[int, int], ...] = tuple((max(64, 4 * n), n) for n in (8, 16, 32, 64, 128, 256))

#: num_heads per model at d_model 128 (head dims K = V = 128 / H), picked so that the decoding states are
#: comparable (2 layers, fp32): the matrix memories (K·V per head: d·K per layer) at H = 2 (K = 64, 73–140 KiB);
#: the MLP memories (K·4K + 4K·V per head: 8·d·K per layer) at H = 8 (K = 16, ~0.5 MiB); OmegaNet's
#: degree-2 features (K' = 1 + K + K(K+1)/2) at H = 8 (K = 16, K' = 153); ATLAS (features and an MLP) at
#: H = 16 (K = 8, K' = 45). The softmax side (its KV cache grows with L) at H = 2.
CEILING_HEADS: tuple[tuple[str, int], ...] = (("ttt_mlp", 8), ("titans", 8), ("omeganet", 8), ("atlas", 16))

#: The ceilings' training (v2, after the first H100 pilot: 252 steps at L 128, 32 kv pairs learned nothing for
#: 19 of 20 models, docs/results/gpu/r3s3_call2_*): 8 epochs of 2000 optimizer steps in all at every setting —
#: 16,000 examples in batches of 64 up to L = 256, 8000 in 32 at L = 512, 4000 in 16 at L = 1024 — vocab 8192
#: (Zoology's), early stop at 0.99.
_CEILING_TRAINING = dict(
    train_examples=16000, test_examples=500, batch_size=64, batch_for_len=((256, 64), (512, 32), (1024, 16)),
    examples_for_len=((256, 16000), (512, 8000), (1024, 4000)),
    vocab_size=8192, num_heads=2, conv="qkv", out_gate="none", random_non_queries=True, weight_decay=0.1,
    decay_filter="matrices", warmup=0.05, grad_clip=1.0)


#: The ceilings v2 protocol's lr grid: 5 values log-spaced over 3e-4 … 3e-2 (every lr the v1 pilot and checks found
#: best for some model — 1e-3, 3e-3, 1e-2 — within a factor 1.06 of a grid point, and one half-decade beyond each).
LR_GRID: tuple[float, ...] = _logspace(math.log10(3e-4), math.log10(3e-2), 5)

#: The v2 protocol (issue 37, `fastweights.lab.protocol`): every cell is the best of LR_GRID × 2 seeds; a cell whose
#: best accuracy dips along kv gets 2 seeds more per round, up to 6. Every memory at d_model 128 with 2 heads of
#: K = V = 64, the MLP memories included; no lr pilot and no skip rule (every cell of the grid is trained).
_V2_PROTOCOL = dict(lrs=LR_GRID, seeds=(0, 1), followup_seeds=2, max_seeds=6, **_CEILING_TRAINING, epochs=8,
                    equal_heads=True)

PRESETS: dict[str, MQARPreset] = {
    "quick": MQARPreset(
        name="quick",
        models=("softmax_attention", "deltanet", "gated_deltanet", "gla", "mamba2", "linear_attention"),
        d_models=(32, 64), settings=((64, 8),), lrs=(3e-3, 1e-2), epochs=10, train_examples=2000, test_examples=256,
        batch_size=32, vocab_size=128, num_heads=1, conv="qkv", out_gate="none", random_non_queries=True,
        weight_decay=0.1,
        decay_filter="matrices", warmup=0.05, grad_clip=1.0, workers=2, threads=1,
        note="CPU: 2 worker processes × 1 thread"),
    "zoology-fig2": MQARPreset(
        name="zoology-fig2",
        models=("softmax_attention", "linear_attention", "retnet", "mamba2", "gla", "deltanet", "gated_deltanet"),
        d_models=(64, 128, 256, 512), settings=((64, 4), (128, 8), (256, 16), (512, 64)),
        lrs=_logspace(-4, -2, 4), epochs=64, train_examples=100_000, test_examples=3_000,
        batch_for_len=((128, 512), (256, 256), (512, 128)), vocab_size=8192, num_heads=1, conv="preset",
        random_non_queries=False, weight_decay=0.1, decay_filter="all", warmup=0.0, grad_clip=None,
        note="Zoology ICLR'24 Fig. 2 grid (benchmarks.md §1.3) with this library's mixers"),
    "based-standard": MQARPreset(
        name="based-standard",
        models=("softmax_attention", "mamba2", "deltanet", "gated_deltanet", "gla"),
        d_models=(64, 128, 256), d_models_for=(("softmax_attention", (32, 64, 128)),),
        lrs=_logspace(-3, -1.5, 4), epochs=32, batch_size=256, eval_batch_size=32, vocab_size=8192, num_heads=2,
        conv="qkv", random_non_queries=True, weight_decay=0.1, decay_filter="all", warmup=0.0, grad_clip=None,
        train_segments=((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000)),
        test_segments=((64, 4, 1000), (64, 8, 1000), (64, 16, 1000), (128, 32, 1000), (256, 64, 1000),
                       (512, 128, 1000), (1024, 256, 1000)),
        note="Based / Zoology 'standard' mixture sweep (benchmarks.md §1.4); a short conv on q, k, v stands for "
             "Zoology's BaseConv(kernel 3) wrapper"),
    "ceilings-pilot": MQARPreset(
        name="ceilings-pilot", models=tuple(zoo_names()), d_models=(128,), settings=((128, 32),),
        lrs=(1e-3, 3e-3, 1e-2), heads_for=CEILING_HEADS,
        **{**_CEILING_TRAINING, "examples_for_len": (), "train_examples": 8000}, epochs=8,
        note="the ceilings' lr pilot: every zoo model at d_model 128, L 128 with 32 kv pairs, 3 lrs, 8 epochs of "
             "8000 examples (1000 steps)"),
    "ceilings": MQARPreset(
        name="ceilings", models=tuple(zoo_names()), d_models=(128,), settings=CEILING_SETTINGS,
        heads_for=CEILING_HEADS, lr_pilot="ceilings-pilot", lr_pick=1, **_CEILING_TRAINING, epochs=8,
        skip_unreachable=True, lrs_for=(("atlas", (3e-3,)),),
        note="capacity ceilings: every zoo model at d_model 128, kv 8..256 at L = max(64, 4·kv), 2000 steps a "
             "cell, the pilot's best lr per model (ATLAS, which has no pilot records, at 3e-3 as the sweep ran it)"),
    "ceilings-v2": MQARPreset(
        name="ceilings-v2", models=tuple(zoo_names()), d_models=(128,), settings=CEILING_SETTINGS, **_V2_PROTOCOL,
        note="ceilings v2: every zoo model at d_model 128, 2 heads of K = 64, kv 8..256 at L = max(64, 4·kv), "
             "2000 steps a run, 5 lrs × 2 seeds a cell, +2 seeds (≤ 6) where the curve dips"),
    "ceilings-v2-dk": MQARPreset(
        name="ceilings-v2-dk", models=("linear_attention", "gla", "deltanet", "gated_deltanet", "mesanet"),
        d_models=(32, 64, 128, 256), settings=CEILING_SETTINGS, **_V2_PROTOCOL,
        note="ceilings v2, claims 1, 2 and 4: the matrix memories at 2 heads of d_k 16, 32, 64, 128 (d_model 2·d_k), "
             "the v2 protocol (its d_model 128 cells are ceilings-v2's: one records file shares them)"),
    "ceilings-v2-poly": MQARPreset(
        name="ceilings-v2-poly",
        models=("linear_attention", "linear_attention+poly2h", "deltanet", "deltanet+poly2h"),
        d_models=(32, 64), settings=CEILING_SETTINGS, **_V2_PROTOCOL,
        note="ceilings v2, claim 3: linear attention and DeltaNet with and without the degree-2 homogeneous feature "
             "map at 2 heads of d_k 16 and 32, the v2 protocol (the plain models' runs are ceilings-v2-dk's)"),
    "ceilings-v2-tiny": MQARPreset(
        name="ceilings-v2-tiny", models=("deltanet", "ttt_mlp"), d_models=(16,), settings=((16, 2), (32, 4)),
        lrs=(3e-3, 1e-2), seeds=(0, 1), followup_seeds=2, max_seeds=4, epochs=1, train_examples=32, test_examples=16,
        batch_size=16, vocab_size=64, num_heads=2, conv="qkv", out_gate="none", random_non_queries=True,
        weight_decay=0.1, decay_filter="matrices", warmup=0.05, grad_clip=1.0, workers=1, threads=1, equal_heads=True,
        note="CPU check of the v2 protocol's code path: 2 models at d_model 16 (2 heads), kv 2 and 4, 2 lrs × 2 "
             "seeds, one epoch of 2 steps"),
    "ceilings-tiny": MQARPreset(
        name="ceilings-tiny",
        models=("softmax_attention", "linear_attention", "deltanet", "gated_deltanet", "ttt_linear", "ttt_mlp"),
        d_models=(32,), settings=((16, 2), (16, 4), (32, 8)), lrs=(1e-2,), heads_for=(("ttt_mlp", 4),),
        epochs=4, train_examples=768, test_examples=64, batch_size=32, vocab_size=64, num_heads=1, conv="qkv",
        out_gate="none", random_non_queries=True, weight_decay=0.1, decay_filter="matrices", warmup=0.05,
        grad_clip=1.0, workers=2, threads=1, skip_unreachable=True,
        note="CPU check of the ceilings code path (CI): 6 models at d_model 32, kv 2..8; 2 workers × 1 thread"),
}


def make_cells(preset: MQARPreset, *, models: Sequence[str] | None = None, d_models: Sequence[int] | None = None,
               settings: Sequence[tuple[int, int]] | None = None, lrs: Sequence[float] | None = None,
               epochs: int | None = None, seed: int = 0, train_examples: int | None = None,
               test_examples: int | None = None,
               lrs_for: dict[str, Sequence[float]] | None = None) -> list[MQARCell]:
    """The cells of a preset (with optional overrides), ordered setting → d_model → model → lr → seed.

    Seeds: the preset's `seeds` shifted by `seed`, or `seed` alone when the preset has none.

    A model's lrs: `lrs` when given, else `lrs_for[model]` (e.g. `pilot_lrs` of the pilot's
    records), else the preset's `lrs_for`, else its `lrs`."""
    models = tuple(models or preset.models)
    model_lrs = {**dict(preset.lrs_for), **{m: tuple(v) for m, v in (lrs_for or {}).items()}}
    if lrs:
        model_lrs = {}
    lrs = tuple(lrs or preset.lrs)
    heads = dict(preset.heads_for)
    epochs = epochs or preset.epochs
    n_tr = train_examples  # None: each setting's own (`MQARPreset.examples`)
    n_te = test_examples or preset.test_examples
    per_model = dict(preset.d_models_for)
    common = dict(vocab_size=preset.vocab_size, conv=preset.conv, out_gate=preset.out_gate,
                  random_non_queries=preset.random_non_queries, epochs=epochs, weight_decay=preset.weight_decay,
                  decay_filter=preset.decay_filter, warmup=preset.warmup, grad_clip=preset.grad_clip,
                  eval_batch_size=preset.eval_batch_size)
    seeds = tuple(seed + s for s in preset.seeds) or (seed,)
    groups: list[tuple[str, tuple, tuple, int]] = []
    if preset.train_segments and settings is None:
        L = max(s[0] for s in preset.train_segments)
        groups.append((preset.name, preset.train_segments, preset.test_segments, preset.batch(L)))
    else:
        for L, n in (preset.settings if settings is None else settings):
            groups.append((f"L{L}-kv{n}", ((L, n, n_tr or preset.examples(L)),), ((L, n, n_te),), preset.batch(L)))
    dms_all = tuple(d_models) if d_models else None
    cells = []
    for setting, tr, te, batch in groups:
        ds = sorted({d for m in models for d in (dms_all or per_model.get(m, preset.d_models))})
        for d in ds:
            for m in models:
                if d not in (dms_all or per_model.get(m, preset.d_models)):
                    continue
                for lr in model_lrs.get(m, lrs):
                    for sd in seeds:
                        H = heads.get(m, preset.num_heads)
                        cells.append(MQARCell(model=m, d_model=d, setting=setting, lr=float(lr), train_segments=tr,
                                              test_segments=te, batch_size=batch, seed=sd, num_heads=H,
                                              head_dim=d // H if preset.equal_heads else None, **common))
    return cells


#: A pilot cell at this accuracy has solved its setting (the lab's early stop): among such lrs, the earliest wins.
SOLVED = 0.99
#: Below this best accuracy a pilot cell has learned nothing to rank by (MQAR's chance level is ~1 / 4096 at vocab
#: 8192; a model that has not yet found the lookup sits at 0.00–0.03): its lrs rank by their last training loss.
LEARNED = 0.05


def pilot_lrs(records: Sequence[dict], models: Sequence[str], pick: int = 2) -> dict[str, tuple[float, ...]]:
    """Each model's `pick` best lrs in a pilot's records, ascending: the lrs that solved the pilot
    (best accuracy ≥ `SOLVED`, the early stop) first, the earlier solved the better; then the others by best
    accuracy where it is above chance (≥ `LEARNED`), else — nothing learned yet — by the last epoch's training
    loss (lower: further along); ties to the smaller lr. A model without pilot records raises ValueError."""
    out, missing = {}, []
    for m in models:
        by_lr: dict[float, tuple] = {}
        for r in records:
            if r.get("model") == m:
                acc, lr = r["accuracy"], -float(r["lr"])
                hist = r.get("history") or [{}]
                loss = hist[-1].get("loss", math.inf)
                loss = loss if isinstance(loss, (int, float)) and math.isfinite(loss) else math.inf
                score = ((2, -r.get("best_epoch", 0), acc, lr) if acc >= SOLVED else
                         (1, acc, r.get("final_accuracy", acc), lr) if acc >= LEARNED else
                         (0, -loss, acc, lr))
                by_lr[float(r["lr"])] = max(score, by_lr.get(float(r["lr"]), score))
        if not by_lr:
            missing.append(m)
            continue
        ranked = sorted(by_lr, key=lambda lr: by_lr[lr], reverse=True)
        out[m] = tuple(sorted(ranked[:pick]))
    if missing:
        raise ValueError(f"the pilot's records have no cell of {', '.join(missing)}")
    return out


def cell_state_bytes(cell: MQARCell) -> int:
    """The decoding state of the cell's model for one sequence of its longest test length (what `run_cell` records
    as "state_bytes"), from the model built on the meta device: no weights are allocated."""
    with torch.device("meta"):
        model = build_model(cell)
    return int(model.state_size(1, cell.seq_len))


def cell_steps(cell: MQARCell) -> int:
    """Optimizer steps of a cell when it runs every epoch (early stopping only shortens it)."""
    n = sum(s[2] for s in cell.train_segments)
    return cell.epochs * -(-n // cell.batch_size)


def cost_estimate(cells: Sequence[MQARCell], step_ms: dict, *, graphed: bool = False,
                  sources: dict | None = None) -> dict[str, float]:
    """Seconds per model if every cell runs all its epochs: steps × the measured ms of a training
    step of that model at the cell's (seq_len, batch), `step_ms[model]["L{L}-B{batch}"]` (what
    `scripts/step_costs.py --lm` writes), plus the evaluations (forward only, taken as 1/3 of an
    eager step per batch of test examples, every epoch).

    graphed: the steps replay a CUDA graph (`train_cell(cuda_graph=True)`), at the time
    `step_ms[model + "+graph"]["L{L}-B{batch}"]` (`step_costs.py --lm --graph`) where it was measured
    and finite (a failed capture is NaN: that model's steps stay eager), plus per cell its
    `graph.WARMUP` eager steps and the capture (taken as one more eager step). `sources`, when given,
    gets {model: "graphed" | "eager"}: what each model's estimate used."""
    from .graph import WARMUP

    out: dict[str, float] = {}
    for c in cells:
        L = max(s[0] for s in c.train_segments)
        key = f"L{L}-B{c.batch_size}"
        try:
            ms = step_ms[c.model][key]
        except KeyError:
            raise ValueError(f"--step-costs has no step time of {c.model} at {key}") from None
        evals = c.epochs * -(-sum(s[2] for s in c.test_segments) // (c.eval_batch_size or c.batch_size))
        gms = step_ms.get(c.model + "+graph", {}).get(key) if graphed else None
        if isinstance(gms, (int, float)) and math.isfinite(gms):
            warm = min(WARMUP + 1, cell_steps(c))
            sec = ((cell_steps(c) - warm) * gms + (warm + evals / 3) * ms) / 1e3
        else:
            sec = (cell_steps(c) + evals / 3) * ms / 1e3
        if sources is not None:
            sources[c.model] = "graphed" if gms is not None and math.isfinite(gms) else "eager"
        out[c.model] = out.get(c.model, 0.0) + sec
    return out


# ------------------------------------------------------------------------------------------ running
def _cell_runner(cell: MQARCell, *, progress=None, desc=None, device="cpu", dtype="float32",
                 checkpoint_dir=None, threads=None, fresh=False, cuda_graph=False, notes=None):
    """One cell of `run_mqar`. On a CPU device the numerics are pinned first (`pin_cpu_numerics`:
    `threads` torch threads, default 1, and fixed ATen/MKL kernel choices), so that a cell's bits
    depend on (code, torch build, cell, seed) and not on the machine's cores, ISA or the number of
    workers; the record carries what was used ("cpu_numerics"). notes: {cell: dict} added to the cell's record as
    "followup" (why the protocol's follow-up trains it: `protocol.run_protocol`)."""
    numerics = _numerics(device, threads)
    res = run_cell(cell, progress=progress, desc=desc, device=device, dtype=dtype, checkpoint_dir=checkpoint_dir,
                   fresh=fresh, cuda_graph=cuda_graph)
    if numerics is not None:
        res["cpu_numerics"] = numerics
    if notes and cell in notes:
        res["followup"] = notes[cell]
    return res


RECORD_FIELDS = {"model": str, "d_model": int, "setting": str, "lr": NUMBER, "accuracy": NUMBER}
"""What a results.jsonl record must hold to enter a table (others are skipped and reported)."""


def results_store(out, records=None) -> ResultStore:
    """The sweep's records: `records` (a path) or out/results.jsonl."""
    return ResultStore(Path(records) if records is not None else Path(out) / "results.jsonl", required=RECORD_FIELDS)


def _numerics(device, threads) -> dict | None:
    """`_cell_runner`'s pinning: the CPU numerics (returned, for the record), or the thread count on a GPU."""
    if torch.device(device).type == "cpu":
        return pin_cpu_numerics(threads or 1)
    if threads:
        torch.set_num_threads(threads)
    return None


def _group_runner(cells: Sequence[MQARCell], on_result, *, progress=None, device="cpu", dtype="float32",
                  threads=None, notes=None) -> None:
    """The lr × seed variants `cells` of one cell trained together (`stack.train_stacked`); on_result(j, result)
    as cells[j] finishes, its result completed as `run_cell` and `_cell_runner` complete train_cell's
    ("state_bytes", "slices", "cpu_numerics", "followup")."""
    from .stack import train_stacked
    from .train import accuracy

    numerics = _numerics(device, threads)
    data = [cell_data(c) for c in cells]
    first = cells[0]

    def done(j: int, res: dict, model) -> None:
        cell, (_, test) = cells[j], data[j]
        res["state_bytes"] = int(model.state_size(1, cell.seq_len))
        if len(cell.test_segments) > 1:
            slices, start = {}, 0
            for L, n, N in cell.test_segments:
                slices[f"L{L}-kv{n}"] = accuracy(model, test[0][start:start + N], test[1][start:start + N],
                                                 cell.eval_batch_size or cell.batch_size, reduction="examples")
                start += N
            res["slices"] = slices
        if numerics is not None:
            res["cpu_numerics"] = numerics
        if notes and cell in notes:
            res["followup"] = notes[cell]
        on_result(j, res)

    desc = f"{first.model} d={first.d_model} {first.setting} ×{len(cells)}"
    cfg = stacked_lm_config(first)
    train_stacked(cfg, [(tr, te, c.train_config(device, dtype)) for c, (tr, te) in zip(cells, data)],
                  model_fn=build_lm, on_result=done, progress=progress, desc=desc)


def stacked_lm_config(cell: MQARCell):
    """The cell's LMConfig with every layer on the torch backend (training form and layer ops): a stacked run
    vmaps the training step, which the Triton/CUDA rows' kernels do not support. The same parameters as
    `lm_config`'s model (the backend is routing only); on a CPU "auto" is the torch backend already."""
    return dataclasses.replace(lm_config(cell), backend="torch", layer_ops="torch")


_SUPPORT: dict[str, str | None] = {}


def stack_support(cell: MQARCell, device="cpu", dtype="float32") -> str | None:
    """None when the cell's model trains stacked (`stack.stack_support`, probed once per model config, dtype
    and device type in this process), else why not."""
    import json

    from .stack import stack_support as probe

    cfg = stacked_lm_config(cell)
    key = json.dumps([dataclasses.asdict(cfg), dtype, torch.device(device).type], default=str)
    if key not in _SUPPORT:
        _SUPPORT[key] = probe(build_lm, cfg, dtype=dtype, device=device, seq_len=min(16, cell.seq_len))
    return _SUPPORT[key]


def stack_group(cell: MQARCell) -> str:
    """The cells of one group key are the lr × seed variants of one cell (`stack.group_key`)."""
    from .stack import group_key

    return group_key(cell)


def run_mqar(cells: Sequence[MQARCell], out, *, device="cpu", dtype="float32", mode="auto", workers: int = 1,
             threads: int | None = None, progress=None, fresh: bool = False, records=None,
             cuda_graph: bool = False, skip=None, notes=None, stack: bool | None = None) -> list[dict]:
    """Run (or resume) the cells, writing out/results.jsonl (or `records`: e.g. a committed file,
    so that a run on another machine skips the cells recorded there) and out/checkpoints/; returns the
    records of these cells. workers > 1: that many local processes (threads each), cell by cell.
    Every key and record carries the dtype and the device type (a bfloat16 run never takes the
    float32 results for its own). fresh: train every cell again (its checkpoints discarded; the
    new records supersede the old ones). cuda_graph: CUDA-graphed training steps (`train_cell`); each
    record says whether its steps were graphed ("cuda_graph"), and the setting is no part of the keys:
    a sweep resumed with or without graphs skips the same finished cells. skip: `run_sweep`'s (e.g.
    `unreachable_skip`). notes: `_cell_runner`'s (the protocol's follow-up reasons, per cell).
    stack: train the lr × seed variants of each cell together (`stack.run_stacked_sweep`: the same records; a
    model that does not stack trains cell by cell, and says so; no checkpoints, no CUDA graphs for a stacked
    group); None (default): stacked unless mode is "ddp" or workers > 1 (those keep one cell per model/worker);
    True with either is refused."""
    import functools

    out = Path(out)
    store = results_store(out, records)
    fn = functools.partial(_cell_runner, device=device, dtype=dtype, checkpoint_dir=str(out / "checkpoints"),
                           threads=threads, fresh=fresh, cuda_graph=cuda_graph, notes=notes)
    context = {"dtype": dtype, "device": torch.device(device).type}
    if stack is None:
        stack = mode != "ddp" and workers <= 1
        if not stack and len({stack_group(c) for c in cells}) < len(cells):
            from ..training.progress import make_progress

            make_progress(progress).log(f"sweep: the lr × seed variants train one cell at a time "
                                        f"({'mode ddp' if mode == 'ddp' else f'{workers} workers'}; stacking needs "
                                        "one process per group)")
    elif stack and (mode == "ddp" or workers > 1):
        raise ValueError("stack=True trains a cell's variants in one process: not with mode 'ddp' or workers > 1 "
                         f"(got mode {mode!r}, workers {workers}); pass --no-stack")
    if stack:
        from .stack import run_stacked_sweep

        _numerics(device, threads)  # (before the first kernel: `stack_support` probes a model before any group trains)

        group = functools.partial(_group_runner, device=device, dtype=dtype, threads=threads, notes=notes)
        return run_stacked_sweep(list(cells), store, run_fn=fn, run_group=group, mode=mode, progress=progress,
                                 stackable=functools.partial(stack_support, device=device, dtype=dtype),
                                 describe=MQARCell.describe, device=device, context=context, fresh=fresh, skip=skip)
    return run_sweep(list(cells), store, fn, mode=mode, progress=progress, describe=MQARCell.describe,
                     device=device, workers=workers, context=context, fresh=fresh, skip=skip)


def unreachable_skip(cells: Sequence[MQARCell]):
    """`run_sweep`'s skip for a preset with `skip_unreachable`: `ceilings.unreachable` over the cells' kv grid."""
    from .ceilings import unreachable

    grid = sorted({c.num_kv_pairs for c in cells})
    return lambda cell, records: unreachable(cell.model, cell.d_model, cell.num_kv_pairs, grid, records)


def format_bytes(b) -> str:
    """A byte count for a table: "512 B", "1.5 KiB", "2.0 MiB", ... up to GiB (one decimal above B); None -> "—"."""
    if b is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)  # pragma: no cover


def format_table(records: Sequence[dict]) -> str:
    """Best-over-lr accuracy: one block per setting, one row per model, one column per d_model
    (each entry: accuracy, and the state bytes and best lr in the legend rows)."""
    best = best_over(records, over=("lr",), fields=("model", "d_model", "setting"))
    lines = []
    for setting in dict.fromkeys(r["setting"] for r in best):
        rows = [r for r in best if r["setting"] == setting]
        ds = sorted({r["d_model"] for r in rows})
        models = list(dict.fromkeys(r["model"] for r in rows))
        get = {(r["model"], r["d_model"]): r for r in rows}
        w = max(18, *(len(m) for m in models))
        lines.append(f"[{setting}] accuracy (best over lr), state bytes per sequence, best lr")
        lines.append("model".ljust(w) + "".join(f"{'d=' + str(d):>30}" for d in ds))
        for m in models:
            cells = []
            for d in ds:
                r = get.get((m, d))
                if r is None:
                    cells.append(f"{'—':>30}")
                else:
                    s = f"{r['accuracy']:.3f}  {format_bytes(r.get('state_bytes'))}  {r['lr']:.2g}"
                    cells.append(f"{s:>30}")
            lines.append(m.ljust(w) + "".join(cells))
        slices = [r for r in rows if r.get("slices")]
        if slices:
            keys = list(slices[0]["slices"])
            lines.append("per test segment (the best-lr model's final accuracy):")
            lines.append("model".ljust(w) + "d".rjust(5) + "".join(f"{k:>13}" for k in keys))
            for r in slices:
                lines.append(r["model"].ljust(w) + f"{r['d_model']:>5}"
                             + "".join(f"{r['slices'].get(k, float('nan')):>13.3f}" for k in keys))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _setting_title(setting: str, rows: Sequence[dict]) -> str:
    """"L64-kv8" -> "seq_len 64, 8 key-value pairs"; a mixture: its name and test lengths."""
    import re

    m = re.fullmatch(r"L(\d+)-kv(\d+)", setting)
    if m:
        return f"seq_len {m.group(1)}, {m.group(2)} key-value pairs"
    segs = next((r.get("test_segments") for r in rows if r.get("test_segments")), None)
    if segs:
        Ls = sorted({int(s[0]) for s in segs})
        return f"{setting} mixture (test seq_len {Ls[0]}–{Ls[-1]})"
    return setting


def _chance_lines(rows: Sequence[dict]) -> list[tuple[float, str, str]]:
    """Reference accuracies: a uniform guess among the V/2 value ids, and (one segment) a guess
    among the n values of the context — what a model that knows the format but not the pairs gets."""
    out = []
    vocab = next((r.get("vocab_size") for r in rows if r.get("vocab_size")), None)
    if vocab:
        out.append((2 / vocab, ":", "chance: uniform over the V/2 value ids"))
    segs = next((r.get("test_segments") for r in rows if r.get("test_segments")), None)
    if segs and len(segs) == 1:
        out.append((1 / int(segs[0][1]), "--", "1/n: any value of the context"))
    return out


def plot_mqar(records: Sequence[dict], out) -> list[Path]:
    """Two PNGs in `out`: mqar_d_model.png (accuracy vs d_model) and mqar_state.png (accuracy vs
    state bytes, log x), best over lr, one line per model, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    best = best_over(records, over=("lr",), fields=("model", "d_model", "setting"))
    settings = list(dict.fromkeys(r["setting"] for r in best))
    from .. import zoo

    order = {m: i for i, m in enumerate(zoo.names())}  # stable colours whatever order the cells finished in
    models = sorted(dict.fromkeys(r["model"] for r in best), key=lambda m: order.get(m, len(order)))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    paths = []
    for xkey, fname, xlabel in (("d_model", "mqar_d_model.png", "d_model"),
                                ("state_bytes", "mqar_state.png", "decoding state per sequence (bytes, log scale)")):
        width = max(6.4, 4.4 * len(settings))
        fig, axes = plt.subplots(1, len(settings), figsize=(width, 3.9), squeeze=False)
        for ax, setting in zip(axes[0], settings):
            rows = [r for r in best if r["setting"] == setting]
            for m in models:
                pts = sorted((r[xkey], r["accuracy"]) for r in rows if r["model"] == m and r.get(xkey) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=4, color=colors[m], label=m)
            ax.set_xscale("log", base=2)
            if xkey == "d_model":
                ds = sorted({r["d_model"] for r in rows})
                ax.set_xticks(ds, [str(d) for d in ds])
                ax.minorticks_off()
            else:
                from matplotlib.ticker import FuncFormatter, NullFormatter

                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v).replace(".0 ", " ")))
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("accuracy (best over lr)")
            ax.set_title(_setting_title(setting, rows), fontsize=10)
            for y, style, label in _chance_lines(rows):
                ax.axhline(y, color="0.4", ls=style, lw=0.9, label=label)
            ax.grid(alpha=0.3)
        handles, labels = [], []
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        longest = max((len(lab) for lab in labels), default=1)
        ncol = max(1, min(len(labels), int(width // (0.065 * longest + 0.6))))  # (≈ inches per legend entry)
        rows_ = -(-len(labels) // ncol)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.06 * rows_ + 0.02, 1, 1))
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------ command line
def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add the `mqar` subcommand to an argparse subparsers object; dispatches to cli_main."""
    p = subparsers.add_parser("mqar", help="MQAR sweeps: accuracy vs d_model and state size per zoo model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=cli_main)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="quick", choices=list(PRESETS), help="the sweep (default: quick)")
    p.add_argument("--models", nargs="+", default=None, help="zoo names (default: the preset's)")
    p.add_argument("--d-models", nargs="+", type=int, default=None)
    p.add_argument("--seq-lens", nargs="+", type=int, default=None,
                   help="with --kv-pairs: the settings (seq_len × kv_pairs, pairs with 4·kv > L dropped)")
    p.add_argument("--kv-pairs", nargs="+", type=int, default=None)
    p.add_argument("--lrs", nargs="+", type=float, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--train-examples", type=int, default=None,
                   help="per setting (single-segment presets; a mixture keeps its own counts)")
    p.add_argument("--test-examples", type=int, default=None, help="per setting (single-segment presets)")
    p.add_argument("--seed", type=int, default=0, help="the seed (a preset with seeds, e.g. ceilings-v2: shifts them)")
    p.add_argument("--followup-seeds", type=int, default=None,
                   help="protocol presets (ceilings-v2*): seeds added per round to a cell whose accuracy dips along "
                        "kv (default: the preset's; 0: no follow-up)")
    p.add_argument("--max-seeds", type=int, default=None,
                   help="protocol presets: the follow-up's cap on a cell's seeds (default: the preset's)")
    p.add_argument("--out", default="runs/mqar", help="results.jsonl, checkpoints/, PNGs")
    p.add_argument("--records", default=None,
                   help="the results file (default OUT/results.jsonl); e.g. a committed docs/results/*.jsonl: "
                        "a run on any machine skips the cells recorded there and appends its own")
    p.add_argument("--lrs-from", default=None,
                   help="presets with an lr pilot (ceilings): the pilot's records, whose best lrs per model the "
                        "sweep runs (default the committed docs/results/mqar_<pilot>.jsonl of the package's "
                        "checkout, from any directory); refused on other presets and beside --lrs")
    p.add_argument("--step-costs", default=None,
                   help="with --dry-run: a JSON of measured step times (scripts/step_costs.py --lm) for a cost "
                        "estimate per model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--workers", type=int, default=None, help="local worker processes (default: the preset's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: the preset's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ddp", action="store_true", help="under torchrun: every model data-parallel over the ranks")
    g.add_argument("--spread", action="store_true", help="under torchrun: cell i on rank i %% world (default)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture each cell's training step in a CUDA graph and replay it (CUDA only; default off "
                        "until its GPU tests pass on the H100, see docs/mqar.md; recorded per cell as cuda_graph, "
                        "not part of the cell keys)")
    p.add_argument("--stack", action=argparse.BooleanOptionalAction, default=None,
                   help="train the lr × seed variants of each cell together in one process (torch.func over "
                        "stacked parameters, `fastweights.lab.stack`; the same records; a model that does not stack "
                        "trains cell by cell and says so). Default: on, except with --ddp or --workers > 1")
    p.add_argument("--progress", default="auto", choices=["auto", "tqdm", "plain", "none"])
    p.add_argument("--fresh", action="store_true",
                   help="train every cell of this run again: its records in results.jsonl are superseded (kept in "
                        "the file) and its checkpoints discarded")
    p.add_argument("--dry-run", action="store_true", help="list the cells and exit")


def _settings(args, preset: MQARPreset):
    """The (L, kv) settings the flags ask for: --kv-pairs alone on a preset whose grid has those kv takes the grid's
    own settings of them (the ceilings' kv 128 is L 512 only); otherwise every L × kv with 4·kv ≤ L."""
    if args.seq_lens is None and args.kv_pairs is None:
        return None
    if args.seq_lens is None and any(n in args.kv_pairs for _, n in preset.settings):
        return [(L, n) for L, n in preset.settings if n in args.kv_pairs]
    Ls = args.seq_lens or sorted({L for L, _ in preset.settings}) or [64]
    ns = args.kv_pairs or sorted({n for _, n in preset.settings}) or [4]
    return [(L, n) for L in Ls for n in ns if 4 * n <= L]


def _check_args(args) -> None:
    """Every flag checked before any work starts (ArgError naming the flag)."""
    from .. import cliargs as ca

    for flag, v in (("--epochs", args.epochs), ("--train-examples", args.train_examples),
                    ("--test-examples", args.test_examples), ("--d-models", args.d_models),
                    ("--seq-lens", args.seq_lens), ("--kv-pairs", args.kv_pairs), ("--workers", args.workers)):
        ca.positive(flag, v)
    ca.nonnegative("--seed", args.seed)
    ca.nonnegative("--followup-seeds", args.followup_seeds)
    ca.positive("--max-seeds", args.max_seeds)
    if (args.followup_seeds is not None or args.max_seeds is not None) and not PRESETS[args.preset].seeds:
        with_seeds = sorted(n for n, p in PRESETS.items() if p.seeds)
        raise ca.ArgError(f"--followup-seeds/--max-seeds: the preset {args.preset} has no lr × seed protocol "
                          f"(presets with one: {', '.join(with_seeds)})")
    ca.threads("--threads", args.threads)
    ca.positive_numbers("--lrs", args.lrs)
    ca.zoo_names("--models", args.models, allowed=model_names())
    ca.device("--device", args.device)
    for flag, path in (("--records", args.records), ("--lrs-from", args.lrs_from), ("--step-costs", args.step_costs)):
        ca.file_path(flag, path)
    ca.records_file("--records", args.records)  # appended to: never a file of another kind
    if args.lrs_from is not None:  # (read only by a preset with an lr pilot, and only without --lrs)
        if args.lrs:
            raise ca.ArgError("--lrs-from and --lrs both set the lrs; give one")
        if PRESETS[args.preset].lr_pilot is None:
            with_pilot = sorted(n for n, p in PRESETS.items() if p.lr_pilot is not None)
            raise ca.ArgError(f"--lrs-from: the preset {args.preset} has no lr pilot (presets with one: "
                              f"{', '.join(with_pilot)}); leave --lrs-from out")
    if args.step_costs is not None and not args.dry_run:
        raise ca.ArgError("--step-costs goes with --dry-run (it estimates the cost of the listed cells)")
    if args.ddp or args.spread:
        ca.under_torchrun("--ddp" if args.ddp else "--spread", "mqar")


#: Whether a CUDA run graphs its steps unless told: off. The graphed path (lab/graph.py) equals eager steps in fp32
#: on the H100 (tests/cuda/test_graph_train.py, 4 models, 2026-11-26), but its bf16-autocast test hit an illegal
#: memory access there and the tests after it did not run; until those tests pass on a GPU, `--cuda-graph` is an
#: explicit request (the ceilings pilot's records of 2026-11-26 were made with it, and say so per record).
CUDA_GRAPH_BY_DEFAULT = False


def cuda_graph_default(args) -> bool:
    """--cuda-graph / --no-cuda-graph, else `CUDA_GRAPH_BY_DEFAULT` on a CUDA --device (never on a CPU)."""
    if args.cuda_graph is not None:
        return bool(args.cuda_graph)
    return CUDA_GRAPH_BY_DEFAULT and torch.device(args.device).type == "cuda"


def _capacity_records() -> list[dict]:
    """The capacity probe's committed records (docs/results/capacity.json), or [] outside the repository."""
    import json

    path = committed_results("capacity.json")
    return json.loads(path.read_text()) if path.exists() else []


def _pilot_lrs(args, preset: MQARPreset) -> dict[str, tuple[float, ...]] | None:
    """A preset with an lr pilot: each model's lrs from the pilot's records (None: --lrs given, or no pilot)."""
    if preset.lr_pilot is None or args.lrs:
        return None
    default = f"mqar_{preset.lr_pilot.replace('-', '_')}.jsonl"
    path = Path(args.lrs_from) if args.lrs_from else committed_results(default)
    if args.records is not None and Path(args.records).resolve() == path.resolve():
        from ..cliargs import ArgError

        raise ArgError(f"--records {args.records}: is the pilot's records (--lrs-from {path}), which the sweep reads "
                       "its lrs from; its own records would be appended there: give --records another file")
    if not path.exists():
        raise ValueError(f"--lrs-from {path}: no such file. The {preset.name} preset runs each model at the "
                         f"{preset.lr_pick} best lrs of its pilot: run `fastweights mqar --preset {preset.lr_pilot} "
                         f"--records {path} ...` first (or give --lrs)")
    store = ResultStore(path, required=RECORD_FIELDS)
    own = dict(preset.lrs_for)  # models with lrs of the preset's own need no pilot records
    return pilot_lrs(store.records(), [m for m in args.models or preset.models if m not in own], preset.lr_pick)


def committed_results(name: str) -> Path:
    """docs/results/<name> of the checkout this package lives in, whatever the working directory (a fresh clone
    run from anywhere finds the committed pilot and capacity records)."""
    return Path(__file__).resolve().parents[2] / "docs" / "results" / name


def _check_cells(cells) -> None:
    """Every model config and every data segment of the cells builds (bad combinations fail here)."""
    from ..tasks.mqar import MQARConfig

    seen = set()
    for c in cells:
        lm_config(c)
        for L, n, N in (*c.train_segments, *c.test_segments):
            if (L, n, c.vocab_size) not in seen:
                seen.add((L, n, c.vocab_size))
                try:
                    MQARConfig(vocab_size=c.vocab_size, seq_len=L, num_kv_pairs=n, num_examples=max(1, N))
                except ValueError as e:
                    raise ValueError(f"--seq-lens/--kv-pairs: seq_len {L} with {n} kv pairs (vocab {c.vocab_size}): "
                                     f"{e}") from None


def _followup(args, preset: MQARPreset) -> tuple[int, int]:
    """(seeds added per follow-up round, the cap on a cell's seeds): the flags, else the preset's."""
    extra = preset.followup_seeds if args.followup_seeds is None else args.followup_seeds
    cap = preset.max_seeds if args.max_seeds is None else args.max_seeds
    return extra, max(cap, len(preset.seeds))


def _print_protocol(args, preset: MQARPreset, cells, known: list[dict]) -> None:
    """The dry run of a protocol preset: the grid per cell, the follow-up's bound, every model's decoding state
    and the follow-up runs the records so far already call for."""
    from .protocol import cell_id, followup_cells

    extra, cap = _followup(args, preset)
    per_cell = len(cells) // len({cell_id(c) for c in cells})
    lrs = sorted({c.lr for c in cells})
    print(f"protocol: {per_cell} runs a cell ({len(lrs)} lrs {', '.join(f'{x:g}' for x in lrs)} × "
          f"{len(preset.seeds)} seeds); a cell that dips along kv gets +{extra} seeds (every lr) per round up to "
          f"{cap} seeds: ≤ {(cap - len(preset.seeds)) * len(lrs)} more runs a dipping cell")
    seen = {}
    for c in cells:
        seen.setdefault((c.model, c.d_model, c.seq_len), c)
    state = {}
    for (m, d, L), c in seen.items():
        state.setdefault((m, d), []).append(f"{format_bytes(cell_state_bytes(c))}" + (f" (L {L})" if
                                                                                     zoo_is_softmax(m) else ""))
    print("decoding state per sequence: " + "; ".join(
        f"{m} d={d}: {v[0] if len(set(v)) == 1 and not zoo_is_softmax(m) else ', '.join(v)}"
        for (m, d), v in state.items()))
    if extra:
        new, _, capped = followup_cells(cells, known, extra=extra, cap=cap)
        print(f"follow-up the records call for now: {len(new)} runs" + (f", {len(capped)} cell(s) capped"
                                                                         if capped else ""))


def zoo_is_softmax(name: str) -> bool:
    from .. import zoo

    return zoo.get(name.split("+", 1)[0]).is_softmax


def cli_main(args) -> int:
    """`fastweights mqar`: run (or resume) a sweep, print the best-over-lr table, write the PNGs."""
    from .. import cliargs
    from ..training.distributed import process_group

    preset = PRESETS[args.preset]
    try:
        _check_args(args)
        lrs_for = _pilot_lrs(args, preset)
        cells = make_cells(preset, models=args.models, d_models=args.d_models, settings=_settings(args, preset),
                           lrs=args.lrs, epochs=args.epochs, seed=args.seed, train_examples=args.train_examples,
                           test_examples=args.test_examples, lrs_for=lrs_for)
        if not cells:
            raise ValueError("no cell to run (check --seq-lens/--kv-pairs: 4·kv ≤ seq_len)")
        _check_cells(cells)
        for c in cells[:1]:
            c.train_config(args.device, args.dtype)
        if args.stack and (args.ddp or (args.workers if args.workers is not None else preset.workers) > 1):
            raise ValueError("--stack trains a cell's variants in one process: not with --ddp or --workers > 1 "
                             "(pass --workers 1, or --no-stack)")
        if not args.dry_run:
            cliargs.writable_dir("--out", args.out)
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    skip = unreachable_skip(cells) if preset.skip_unreachable else None
    if args.dry_run:
        context = {"dtype": args.dtype, "device": torch.device(args.device).type}  # run_sweep's, as the run would
        known = [r for r in results_store(args.out, args.records).records()
                 if all(r.get(k) == v for k, v in context.items())]
        done = {(r["model"], r["d_model"], r["setting"]) for r in known}
        for c in cells:
            why = skip(c, known) if skip and (c.model, c.d_model, c.setting) not in done else None
            print(f"{c.describe()}  heads {c.num_heads}, batch {c.batch_size}, ≤ {cell_steps(c)} steps"
                  + (f"  (skipped: {why})" if why else ""))
        print(f"{len(cells)} cells, ≤ {sum(cell_steps(c) for c in cells)} optimizer steps")
        if lrs_for:
            print("lrs from the pilot: " + "; ".join(f"{m} {', '.join(f'{x:g}' for x in v)}"
                                                     for m, v in lrs_for.items()))
        own = {m: v for m, v in preset.lrs_for if m in {c.model for c in cells} and not args.lrs}
        if own:
            print("lrs of the preset's own: " + "; ".join(f"{m} {', '.join(f'{x:g}' for x in v)}"
                                                          for m, v in own.items()))
        if preset.seeds:
            _print_protocol(args, preset, cells, known)
        if args.step_costs:
            import json

            graphed, sources = cuda_graph_default(argparse.Namespace(cuda_graph=args.cuda_graph, device="cuda")), {}
            try:
                est = cost_estimate(cells, json.loads(Path(args.step_costs).read_text()), graphed=graphed,
                                    sources=sources)
            except (OSError, ValueError) as e:
                print(f"error: --step-costs {args.step_costs}: {e}", file=sys.stderr)
                return 2
            print("estimated seconds if every cell runs all its epochs (early stopping only shortens it), "
                  + ("CUDA-graphed steps where the step costs have them (--no-cuda-graph: all eager):" if graphed
                     else "eager steps:"))
            for m, sec in sorted(est.items(), key=lambda kv: -kv[1]):
                print(f"  {m:<20} {sec:8.0f} s  ({sources[m]})")
            print(f"  {'total':<20} {sum(est.values()):8.0f} s ({sum(est.values()) / 60:.1f} min)")
        return 0
    # (the group a torchrun launch starts is destroyed at exit: see training.distributed.process_group)
    with process_group(args.device) as info:
        mode = "ddp" if args.ddp else "spread" if args.spread else "auto"
        workers = args.workers if args.workers is not None else preset.workers
        threads = args.threads if args.threads is not None else preset.threads
        if info.world_size > 1:
            workers = 1
        t0 = time.perf_counter()
        run_kw = dict(device=args.device, dtype=args.dtype, mode=mode, workers=workers, threads=threads,
                      progress=args.progress, fresh=args.fresh, records=args.records,
                      cuda_graph=cuda_graph_default(args), stack=args.stack)
        capped = {}
        if preset.seeds:
            from .protocol import run_protocol

            extra, cap = _followup(args, preset)

            def run():
                recs, capped_ = run_protocol(cells, args.out, extra=extra, cap=cap, **run_kw)
                capped.update(capped_)
                return recs
        else:
            def run():
                return run_mqar(cells, args.out, skip=skip, **run_kw)
        records, status = cliargs.run_sweep_command(run)
        if status is not None:
            return status
        wall = time.perf_counter() - t0
        if info.rank != 0:
            return 0
        print(f"\nMQAR, preset {preset.name}: {len(cells)} cells ({preset.note}; dtype {args.dtype}, "
              f"device {args.device})\n")
        print(format_table(records))
        pngs = plot_mqar(records, args.out)
        if preset.name in ("ceilings", "ceilings-tiny"):  # the reading: ceilings per model, four-axis pairs
            from .ceilings import format_ceilings, format_four_axis, plot_ceilings

            print(format_ceilings(records, _capacity_records()))
            print(format_four_axis(records))
            pngs += plot_ceilings(records, args.out)
        if preset.seeds:  # the v2 protocol's reading: best and median per cell, the state plot, the claims
            from . import protocol

            summaries = protocol.summarize(records)
            print(protocol.format_table(summaries))
            print(protocol.format_claims(summaries, _capacity_records()))
            for (m, d, st), why in capped.items():
                print(f"follow-up capped: {m} d={d} {st}: {why}")
            pngs.append(protocol.plot_state(summaries, args.out))
        print("plots: " + ", ".join(str(p) for p in pngs))
        print(f"results: {args.records or Path(args.out) / 'results.jsonl'}")
        print(f"sweep time: {wall:.1f} s (this invocation; finished cells are not re-run)")
        return 0


def main(argv=None) -> int:
    from ..cliargs import Parser
    from .control import run_interruptible

    p = Parser(prog="python -m fastweights.lab.mqar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_interruptible(cli_main, p.parse_args(argv), "mqar")


if __name__ == "__main__":
    sys.exit(main())
