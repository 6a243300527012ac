"""`fastweights mad`: the MAD synthetic benchmark (Poli et al., mechanistic architecture design) over
zoo models — train every (model × task × setting) over MAD's lr × wd grid and score as MAD does.

Spec: research/benchmarks.md §4 (athms/mad-lab: `configs/tasks/*.yml`, `mad/configs.py`,
`mad/model/auto_encoder.py`, `mad/analysis.py`); the data is :mod:`fastweights.tasks.mad`.

* **Tasks and settings.** The six tasks (in-context recall, fuzzy and noisy in-context recall,
  selective copying, compression, memorization), each as its baseline plus MAD's one-variable
  changes (:func:`~fastweights.tasks.mad.mad_settings`). 1,280 test examples per setting.
* **Models.** A zoo mixer in an :class:`~fastweights.models.LM` of width 128 with 2 blocks of
  (mixer, SwiGLU) — MAD's default 4-layer stack "mixer, swiglu, mixer, swiglu" — and the task's
  vocabulary. Compression uses MAD's AutoEncoder backbone (:class:`MADAutoEncoder`): the LM's blocks
  encode, the last position is the code, a 2-layer MLP decodes it at every position (sin-cos
  position embeddings) — a causal LM could otherwise copy its input. MAD normalizes models to equal
  state and parameter counts; here every mixer takes its zoo preset wiring at the same width.
* **Training** (MAD `mad/configs.py`): batch 128, 200 epochs, AdamW with decay on matrices only
  (MAD: all but biases and norms), cosine schedule to 1e-6, no early stop; grid lr {1e-4, 5e-4, 1e-3}
  × wd {0, 0.1}; through the shared harness :func:`fastweights.lab.train.train_cell` (per-epoch
  checkpoint and resume) and :func:`fastweights.lab.train.run_sweep` (JSONL store, finished cells
  skipped, ``torchrun`` spreads cells over ranks).
* **Score** (MAD `mad/analysis.py`): test accuracy of the final weights, torchmetrics'
  ``MulticlassAccuracy`` as MAD calls it (``average="macro"``: the mean over classes of the per-class
  recall over the scored positions; a class that is predicted but never a target counts 0), the best
  over the grid per setting, the mean over settings per task
  (:func:`~fastweights.tasks.mad.mad_task_scores`), the mean over tasks
  (:func:`~fastweights.tasks.mad.mad_score`). The pooled ("micro") accuracy is recorded beside it.

Outputs (``out``): ``mad.jsonl`` (one record per trained cell), ``mad.md`` (per-task tables, the
overall table, the published table beside it), ``mad.png``.

Presets: ``full`` is MAD as published (66 settings × 6 grid points = 396 trainings per model of
200 epochs each: a GPU job of days at this code's speed); ``gpu`` keeps each task's baseline
setting, MAD's model, 4 epochs and lr {5e-4, 1e-3} × wd {0, 0.1} (lr 1e-4 cannot move in 4 epochs):
96 trainings for four models, minutes on one GPU; ``small`` runs one MAD setting per task (its
800-example one, capped at 256 training rows; memorization's baseline), 128 test examples, a
32-wide one-block model, 8 epochs, lr 1e-3 × wd {0, 0.1} — end to end in minutes on 2 CPU cores,
an exercise of the pipeline rather than a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..tasks.mad import MAD_LRS, MAD_NUM_TEST_EXAMPLES, MAD_TASKS, MAD_WEIGHT_DECAYS, mad_settings, make_mad_splits
from ..tasks.mad import mad_score as _mad_score
from ..tasks.mad import mad_task_scores as _mad_task_scores

__all__ = [
    "MADRunConfig",
    "MADCell",
    "MADAutoEncoder",
    "PRESETS",
    "PUBLISHED",
    "TASK_SHORT",
    "preset",
    "cells",
    "macro_accuracy",
    "evaluate",
    "run_cell",
    "run_mad",
    "scores",
    "format_task_tables",
    "format_overall",
    "format_published",
    "plot_mad",
    "add_cli",
    "cli_main",
    "main",
]

TASKS = tuple(MAD_TASKS)
TASK_SHORT = {"compression": "Compress", "fuzzy-in-context-recall": "Fuzzy", "in-context-recall": "ICR",
              "memorization": "Memorize", "noisy-in-context-recall": "Noisy", "selective-copying": "SelCopy"}
_TABLE_ORDER = ("compression", "fuzzy-in-context-recall", "in-context-recall", "memorization",
                "noisy-in-context-recall", "selective-copying")  # the published table's column order

PUBLISHED: dict[str, dict[str, float]] = {
    "Transformer": dict(zip(_TABLE_ORDER, (51.6, 29.8, 94.1, 85.2, 86.8, 99.6)), avg=74.5),
    "Hyena": dict(zip(_TABLE_ORDER, (45.2, 7.9, 81.7, 89.5, 78.8, 93.1)), avg=66.0),
    "MH-Hyena": dict(zip(_TABLE_ORDER, (44.8, 14.4, 99.0, 89.4, 98.6, 93.0)), avg=73.2),
    "Mamba": dict(zip(_TABLE_ORDER, (52.7, 6.7, 90.4, 89.5, 90.1, 86.3)), avg=69.3),
    "GLA": dict(zip(_TABLE_ORDER, (38.8, 6.9, 80.8, 63.3, 81.6, 88.6)), avg=60.0),
    "DeltaNet": dict(zip(_TABLE_ORDER, (42.2, 35.7, 100.0, 52.8, 100.0, 100.0)), avg=71.8),
}
"""MAD scores (%) from DeltaNet (arXiv 2406.06484) Fig. 3; every row but DeltaNet is copied there from
Poli et al. (benchmarks.md §2.1). Models of width 128, iso-state/iso-parameter, full MAD protocol."""

PUBLISHED_ZOO = {"Transformer": "softmax_attention", "Mamba": "mamba2", "GLA": "gla", "DeltaNet": "deltanet"}
"""The zoo model nearest each published row (Mamba there is Mamba-1; Hyena has no zoo analogue)."""


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MADRunConfig:
    """One `fastweights mad` run (validated).

    models:        zoo names.
    tasks:         MAD task names (default: all six).
    settings:      setting names kept per task (None: all of MAD's), e.g. "baseline", "seq_len=256";
                   "task:name" applies to that task only; a name a task lacks is skipped for that
                   task, and a task left with none is an error.
    lrs, wds:      the grid (MAD: {1e-4, 5e-4, 1e-3} × {0, 0.1}).
    d_model, n_layers, num_heads, mlp: the LM (n_layers blocks of mixer + MLP).
    epochs, batch_size, min_lr, warmup: training (MAD: 200, 128, cosine to 1e-6, no warmup).
    test_examples: test set size per setting (MAD: 1,280); train_examples: cap on a setting's
                   training set (None: the setting's own size).
    accuracy:      "macro" (MAD's torchmetrics default) or "micro" (pooled positions) — the one scored.
    seed:          data and model seed (MAD: 12345).
    device, threads, dtype, out, mode (run_sweep's: "auto" | "local" | "spread" | "ddp").
    """

    models: tuple[str, ...] = ("softmax_attention", "deltanet", "gated_deltanet", "mamba2")
    tasks: tuple[str, ...] = TASKS
    settings: tuple[str, ...] | None = None
    lrs: tuple[float, ...] = MAD_LRS
    wds: tuple[float, ...] = MAD_WEIGHT_DECAYS
    d_model: int = 128
    n_layers: int = 2
    num_heads: int = 4
    mlp: str = "swiglu"
    epochs: int = 200
    batch_size: int = 128
    min_lr: float = 1e-6
    warmup: float = 0.0
    test_examples: int = MAD_NUM_TEST_EXAMPLES
    train_examples: int | None = None
    accuracy: str = "macro"
    seed: int = 12345
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 2
    mode: str = "auto"
    out: str = "runs/mad"

    def __post_init__(self):
        from .. import zoo

        for name in ("models", "tasks", "lrs", "wds"):
            v = getattr(self, name)
            if isinstance(v, (str, int, float)) or not isinstance(v, Sequence) or len(v) == 0:
                raise ValueError(f"{name} must be a non-empty sequence, got {v!r}")
            object.__setattr__(self, name, tuple(v))
        if self.settings is not None:
            if isinstance(self.settings, str) or len(self.settings) == 0:
                raise ValueError(f"settings must be None or a non-empty sequence of names, got {self.settings!r}")
            object.__setattr__(self, "settings", tuple(self.settings))
        for m in self.models:
            zoo.get(m)
        for t in self.tasks:
            if t not in MAD_TASKS:
                raise ValueError(f"tasks must be among {list(MAD_TASKS)}, got {t!r}")
            if not self.task_settings(t):
                raise ValueError(f"no setting of {t!r} among settings={list(self.settings)}; it has "
                                 f"{[n for n, _ in mad_settings(t)]}")
        for name in ("d_model", "n_layers", "num_heads", "epochs", "batch_size", "test_examples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.train_examples is not None and (not isinstance(self.train_examples, int) or self.train_examples < 1):
            raise ValueError(f"train_examples must be a positive int or None, got {self.train_examples!r}")
        if any(not (isinstance(x, (int, float)) and x > 0) for x in self.lrs):
            raise ValueError(f"lrs must be positive numbers, got {self.lrs!r}")
        if any(not (isinstance(x, (int, float)) and x >= 0) for x in self.wds):
            raise ValueError(f"wds must be non-negative numbers, got {self.wds!r}")
        if self.mlp not in ("none", "swiglu"):
            raise ValueError(f"mlp must be 'none' or 'swiglu', got {self.mlp!r}")
        if self.accuracy not in ("macro", "micro"):
            raise ValueError(f"accuracy must be 'macro' or 'micro', got {self.accuracy!r}")
        if self.mode not in ("auto", "local", "spread", "ddp"):
            raise ValueError(f"mode must be auto, local, spread or ddp, got {self.mode!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {self.threads!r}")

    def task_settings(self, task: str) -> list[tuple[str, Any]]:
        """The (name, train config) settings of ``task`` this run trains."""
        all_ = mad_settings(task)
        if self.settings is None:
            return all_
        keep = {s.split(":", 1)[1] if ":" in s else s for s in self.settings
                if ":" not in s or s.split(":", 1)[0] == task}
        return [(n, c) for n, c in all_ if n in keep]


_SMALL_SETTINGS = ("num_examples=800", "memorization:baseline")

PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(),
    # Each task's baseline setting, MAD's model, 4 epochs, lr {5e-4, 1e-3} x wd {0, 0.1}: minutes on one GPU.
    "gpu": dict(settings=("baseline",), lrs=(5e-4, 1e-3), epochs=4, device="cuda", threads=None),
    # One MAD setting per task (its 800-example one, capped at 256 rows; memorization's baseline),
    # 128 test examples, one 32-wide block, 8 epochs, lr 1e-3 x wd {0, 0.1}: minutes on 2 CPU cores.
    "small": dict(models=("softmax_attention", "deltanet", "mamba2"), settings=_SMALL_SETTINGS, lrs=(1e-3,),
                  wds=(0.0, 0.1), d_model=32, n_layers=1, num_heads=2, epochs=8, batch_size=32, train_examples=256,
                  test_examples=128, threads=1),
}


def preset(name: str, **overrides) -> MADRunConfig:
    """MADRunConfig of preset ``name`` with ``overrides`` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    if kw.get("settings") == ("all",):
        kw["settings"] = None
    return MADRunConfig(**kw)


@dataclass(frozen=True)
class MADCell:
    """One training run (its fields are the JSONL record's key)."""

    model: str
    task: str
    setting: str
    lr: float
    wd: float
    d_model: int
    n_layers: int
    num_heads: int
    mlp: str
    epochs: int
    batch_size: int
    min_lr: float
    warmup: float
    test_examples: int
    train_examples: int | None
    accuracy_metric: str
    seed: int


def cells(cfg: MADRunConfig) -> list[MADCell]:
    """Every cell of the run: models × tasks × settings × lrs × wds (in that nesting)."""
    out = []
    for m in cfg.models:
        for t in cfg.tasks:
            for name, _ in cfg.task_settings(t):
                for lr in cfg.lrs:
                    for wd in cfg.wds:
                        out.append(MADCell(model=m, task=t, setting=name, lr=float(lr), wd=float(wd),
                                           d_model=cfg.d_model, n_layers=cfg.n_layers, num_heads=cfg.num_heads,
                                           mlp=cfg.mlp, epochs=cfg.epochs, batch_size=cfg.batch_size,
                                           min_lr=cfg.min_lr, warmup=cfg.warmup, test_examples=cfg.test_examples,
                                           train_examples=cfg.train_examples, accuracy_metric=cfg.accuracy,
                                           seed=cfg.seed))
    return out


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _sincos(length: int, dim: int) -> torch.Tensor:
    """[length, dim] sin-cos position embeddings (first half sin, second half cos)."""
    half = dim // 2
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    omega = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / max(1, half - 1)))
    emb = torch.cat([torch.sin(pos * omega), torch.cos(pos * omega)], dim=1)
    return torch.nn.functional.pad(emb, (0, dim - emb.shape[1]))


class MADAutoEncoder(nn.Module):
    """MAD's AutoEncoder backbone (`mad/model/auto_encoder.py`) around an LM's blocks, for compression:

        code   = Blocks(Embed(ids))[:, -1]                                  [B, d] (last-position pool)
        h_t    = MLP(code + sincos_t),  MLP = Norm-Linear-GELU-Norm-Linear-GELU   [B, T, d]
        logits = Linear(Norm(h_t))                                         [B, T, vocab]
    """

    def __init__(self, lm_config, max_length: int = 1280):
        super().__init__()
        from ..layers.norm import RMSNorm
        from ..models import LM

        d = lm_config.d_model
        self.encoder = LM(lm_config)  # its embedding and blocks; the tied head is not used
        self.register_buffer("positions", _sincos(max_length, d), persistent=False)
        self.decoder = nn.Sequential(RMSNorm(d), nn.Linear(d, d), nn.GELU(), RMSNorm(d), nn.Linear(d, d), nn.GELU())
        self.unembed = nn.Sequential(RMSNorm(d), nn.Linear(d, lm_config.vocab_size))
        for mod in [*self.decoder, *self.unembed]:
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)
                nn.init.zeros_(mod.bias)
        self.vocab_size = lm_config.vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.positions.shape[0]:
            raise ValueError(f"sequence length {T} exceeds the autoencoder's max_length {self.positions.shape[0]}")
        h = self.encoder.embed(input_ids)
        for block in self.encoder.blocks:
            h, _ = block(h)
        code = h[:, -1]  # [B, d]
        x = code[:, None, :] + self.positions[:T]  # [B, T, d]
        return self.unembed(self.decoder(x))


def _vocab_size(task: str, config) -> int:
    return int(config.vocab_size)


def build_model(cell: MADCell, vocab_size: int) -> nn.Module:
    """The cell's model: an LM (mixer + MLP blocks), or the AutoEncoder for compression."""
    from ..models import LM, LMConfig

    lm_config = LMConfig(vocab_size=vocab_size, d_model=cell.d_model, n_layers=cell.n_layers, mixer=cell.model,
                         num_heads=cell.num_heads, mlp=cell.mlp)
    if cell.task == "compression":
        return MADAutoEncoder(lm_config)
    return LM(lm_config)


# --------------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------------


def macro_accuracy(preds: torch.Tensor, targets: torch.Tensor, num_classes: int) -> float:
    """torchmetrics ``MulticlassAccuracy(num_classes, ignore_index=-100)`` with its default
    ``average="macro"``, as MAD computes test accuracy: positions whose target is −100 are dropped;
    per class c, recall_c = tp_c / (tp_c + fn_c) (0 when c is never a target); classes with
    tp + fp + fn = 0 (never predicted nor a target) are left out of the mean, so a class predicted
    but never a target counts 0. preds, targets: integer tensors of one shape."""
    keep = targets != -100
    p, t = preds[keep].long(), targets[keep].long()
    if t.numel() == 0:
        return float("nan")
    tp = torch.bincount(t[p == t], minlength=num_classes).double()
    support = torch.bincount(t, minlength=num_classes).double()  # tp + fn
    predicted = torch.bincount(p, minlength=num_classes).double()  # tp + fp
    fn, fp = support - tp, predicted - tp
    recall = torch.where(support > 0, tp / support.clamp_min(1), torch.zeros_like(tp))
    used = (tp + fp + fn) > 0
    return float(recall[used].mean())


def micro_accuracy(preds: torch.Tensor, targets: torch.Tensor) -> float:
    """Pooled accuracy over the positions whose target is not −100."""
    keep = targets != -100
    return float((preds[keep] == targets[keep]).double().mean()) if keep.any() else float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int, *,
             batch_size: int = 256, device="cpu") -> dict[str, float]:
    """{"macro": MAD's accuracy, "micro": pooled accuracy} of ``model``'s argmax predictions."""
    was = model.training
    model.eval()
    preds = []
    try:
        for s in range(0, inputs.shape[0], batch_size):
            x = inputs[s:s + batch_size].to(device)
            preds.append(model(x).argmax(-1).cpu())
    finally:
        model.train(was)
    p = torch.cat(preds)
    return {"macro": macro_accuracy(p, labels, num_classes), "micro": micro_accuracy(p, labels)}


# --------------------------------------------------------------------------------------------------
# Training a cell (through the shared harness)
# --------------------------------------------------------------------------------------------------


def _setting_config(cell: MADCell):
    for name, config in mad_settings(cell.task):
        if name == cell.setting:
            config = replace(config, seed=cell.seed)
            if cell.train_examples is not None and config.num_examples > cell.train_examples:
                config = replace(config, num_examples=cell.train_examples)
            return config
    raise ValueError(f"{cell.task!r} has no setting {cell.setting!r}")


def _cell_id(cell: MADCell, dtype: str = "float32", device: str = "cpu") -> str:
    """The checkpoint name of a cell: a hash of its fields, the dtype and the device type."""
    from .train import cell_key

    return hashlib.sha1((cell_key(cell) + f"|{dtype}|{torch.device(device).type}").encode()).hexdigest()[:16]


def run_cell(cell: MADCell, *, device: str = "cpu", dtype: str = "float32", checkpoint_dir: str | Path | None = None,
             progress="none", desc: str | None = None, fresh: bool = False) -> dict[str, Any]:
    """Train one cell with :func:`fastweights.lab.train.train_cell` and score its final weights.

    Returns {"accuracy": the scored test accuracy (0–1, macro or micro per the cell), "accuracy_macro",
    "accuracy_micro", "train_eval_best" (the harness's best per-epoch pooled accuracy), "epochs_run",
    "train_seconds", "params", "vocab_size", "history"}.
    """
    from .train import TrainConfig, train_cell

    config = _setting_config(cell)
    train_pair, test_pair = make_mad_splits(cell.task, config, num_test_examples=cell.test_examples)
    vocab = _vocab_size(cell.task, config)
    built: list[nn.Module] = []  # train_cell trains the model it builds in place: keep a handle on it

    def model_fn(_):
        built.append(build_model(cell, vocab))
        return built[-1]

    tcfg = TrainConfig(epochs=cell.epochs, batch_size=cell.batch_size, lr=cell.lr, weight_decay=cell.wd,
                       warmup=cell.warmup, schedule="cosine", min_lr=min(cell.min_lr, cell.lr), early_stop=None,
                       seed=cell.seed, device=device, dtype=dtype)
    ckpt = Path(checkpoint_dir) / f"{_cell_id(cell, dtype, device)}.pt" if checkpoint_dir is not None else None
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    result = train_cell(None, train_pair, test_pair, tcfg, checkpoint_path=ckpt, progress=progress,
                        model_fn=model_fn, desc=desc or f"{cell.model} {cell.task} {cell.setting}",
                        signature=asdict(cell), fresh=fresh)
    model = built[-1]
    dev = next(model.parameters()).device
    acc = evaluate(model, *test_pair, vocab, batch_size=max(cell.batch_size, 256), device=dev)
    return {"accuracy": acc[cell.accuracy_metric], "accuracy_macro": acc["macro"], "accuracy_micro": acc["micro"],
            "train_eval_best": result.get("accuracy"), "epochs_run": result.get("epochs_run"),
            "train_seconds": result.get("train_seconds"), "params": result.get("params"), "vocab_size": vocab,
            "history": result.get("history", [])}


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


RECORD_FIELDS = {"model": str, "task": str, "setting": str, "lr": (int, float), "wd": (int, float),
                 "accuracy": (int, float)}
"""What a mad.jsonl record must hold to be scored (others are skipped and reported)."""


def run_mad(cfg: MADRunConfig, *, progress="auto", fresh: bool = False) -> list[dict]:
    """Train every cell of ``cfg`` not yet in ``out/mad.jsonl`` and return the records of all its cells.

    Keys and records carry the dtype and the device type (`run_sweep(context=...)`); fresh: train
    every cell again (checkpoints discarded, the new records supersede the old)."""
    from .train import ResultStore, run_sweep

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads is not None and str(cfg.device).startswith("cpu"):
        torch.set_num_threads(cfg.threads)
    store = ResultStore(out / "mad.jsonl", required=RECORD_FIELDS)
    ckdir = out / "checkpoints"
    all_cells = cells(cfg)

    def run_fn(cell, progress=None, desc=None):
        return run_cell(cell, device=cfg.device, dtype=cfg.dtype, checkpoint_dir=ckdir, progress=progress,
                        desc=desc, fresh=fresh)

    def describe(c: MADCell) -> str:
        return f"{c.model} {c.task} {c.setting} lr={c.lr:g} wd={c.wd:g}"

    records = run_sweep(all_cells, store, run_fn, mode=cfg.mode, progress=progress, describe=describe,
                        device=cfg.device, context={"dtype": cfg.dtype, "device": torch.device(cfg.device).type},
                        fresh=fresh)
    # A finished cell's checkpoint is no longer needed once its record is stored.
    for c in all_cells:
        p = ckdir / f"{_cell_id(c, cfg.dtype, cfg.device)}.pt"
        if p.exists() and any(r["model"] == c.model and r["task"] == c.task and r["setting"] == c.setting
                              and r["lr"] == c.lr and r["wd"] == c.wd for r in records):
            p.unlink()
    return records


def scores(records: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Per model: {"tasks": {task: score %}, "settings": {task: {setting: best %}}, "mad": overall %,
    "best": {task: {setting: (lr, wd)}}} — best over the grid per setting, mean over settings, mean over
    tasks (:func:`~fastweights.tasks.mad.mad_task_scores` / :func:`~fastweights.tasks.mad.mad_score`)."""
    out: dict[str, dict[str, Any]] = {}
    models = list(dict.fromkeys(r["model"] for r in records))
    for m in models:
        rs = [dict(r, accuracy=100.0 * r["accuracy"]) for r in records if r["model"] == m
              and r.get("accuracy") is not None and math.isfinite(r["accuracy"])]
        if not rs:
            continue
        settings: dict[str, dict[str, float]] = {}
        best: dict[str, dict[str, tuple[float, float]]] = {}
        for r in rs:
            cur = settings.setdefault(r["task"], {}).get(r["setting"])
            if cur is None or r["accuracy"] > cur:
                settings[r["task"]][r["setting"]] = r["accuracy"]
                best.setdefault(r["task"], {})[r["setting"]] = (r["lr"], r["wd"])
        out[m] = {"tasks": _mad_task_scores(rs), "settings": settings, "mad": _mad_score(rs), "best": best}
    return out


# --------------------------------------------------------------------------------------------------
# Tables and plot
# --------------------------------------------------------------------------------------------------


def _f(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def format_task_tables(records: Sequence[dict]) -> str:
    """One markdown table per task: rows = models, columns = settings (best over the grid, %) and the
    task score (mean over settings)."""
    sc = scores(records)
    tasks = [t for t in TASKS if any(r["task"] == t for r in records)]
    parts = []
    for t in tasks:
        names = list(dict.fromkeys(r["setting"] for r in records if r["task"] == t))
        lines = [f"**{t}**", "", "| model | " + " | ".join(names) + " | task score |",
                 "|---|" + "---:|" * (len(names) + 1)]
        for m, s in sc.items():
            row = s["settings"].get(t, {})
            lines.append(f"| {m} | " + " | ".join(_f(row.get(n)) for n in names) + f" | {_f(s['tasks'].get(t))} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def format_overall(records: Sequence[dict]) -> str:
    """Rows = models, columns = the six tasks (the published table's order) and the MAD score (%)."""
    sc = scores(records)
    tasks = [t for t in _TABLE_ORDER if any(r["task"] == t for r in records)]
    lines = ["| model | " + " | ".join(TASK_SHORT[t] for t in tasks) + " | MAD score |",
             "|---|" + "---:|" * (len(tasks) + 1)]
    for m, s in sc.items():
        lines.append(f"| {m} | " + " | ".join(_f(s["tasks"].get(t)) for t in tasks) + f" | {_f(s['mad'])} |")
    return "\n".join(lines)


def format_published() -> str:
    """The published MAD table (DeltaNet paper Fig. 3 / Poli et al.), with each row's nearest zoo model."""
    lines = ["| model (published) | zoo analogue | " + " | ".join(TASK_SHORT[t] for t in _TABLE_ORDER) + " | Avg |",
             "|---|---|" + "---:|" * (len(_TABLE_ORDER) + 1)]
    for name, row in PUBLISHED.items():
        lines.append(f"| {name} | {PUBLISHED_ZOO.get(name, '–')} | "
                     + " | ".join(_f(row[t]) for t in _TABLE_ORDER) + f" | {_f(row['avg'])} |")
    return "\n".join(lines)


def plot_mad(records: Sequence[dict], path: str | Path, *, title: str = "") -> Path:
    """Grouped bars: per task (and the MAD score) one bar per model (ours); the published score of the
    nearest published model as a black tick on the bar. When only some tasks ran, the "MAD score"
    group is the mean over those tasks, ours and the published one alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sc = scores(records)
    tasks = [t for t in _TABLE_ORDER if any(r["task"] == t for r in records)]
    subset = len(tasks) < len(_TABLE_ORDER)
    groups = [TASK_SHORT[t] for t in tasks] + [f"mean of\n{len(tasks)} tasks" if subset else "MAD score"]
    models = list(sc)
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(1.3 * len(groups) + 2, 3.8))
    by_zoo = {z: n for n, z in PUBLISHED_ZOO.items()}
    for i, m in enumerate(models):
        vals = [sc[m]["tasks"].get(t, float("nan")) for t in tasks] + [sc[m]["mad"]]
        xs = [g + (i - (len(models) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, vals, width, label=m, color=f"C{i}")
        if m in by_zoo:
            pub = PUBLISHED[by_zoo[m]]
            pv = [pub[t] for t in tasks] + [sum(pub[t] for t in tasks) / len(tasks) if subset else pub["avg"]]
            ax.scatter(xs, pv, marker="_", s=200, color="black", zorder=3,
                       label="published (nearest model)" if i == min(j for j, mm in enumerate(models) if mm in by_zoo)
                       else None)
    ax.set_xticks(range(len(groups)), groups)
    ax.axvline(len(groups) - 1.5, color="0.6", lw=0.8)  # the tasks | their mean
    ax.set_ylabel("task score: test accuracy (%)\nMAD score: mean over tasks")
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ncol = min(len(labels), 4)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, (0.22 * -(-len(labels) // ncol) + 0.1) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(cfg: MADRunConfig, records: Sequence[dict], *, wall_s: float | None = None,
                 command: str | None = None, preset_name: str | None = None) -> Path:
    """Write ``out/mad.md``: the run, the overall table, the published one, the per-task tables."""
    out = Path(cfg.out)
    n_cells = len(records)
    lines = ["# MAD — fastweights mad", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Preset {preset_name or '?'}: models {', '.join(cfg.models)}; d_model={cfg.d_model}, {cfg.n_layers} "
        f"block(s) of mixer + {cfg.mlp}, {cfg.num_heads} heads; {cfg.epochs} epochs, batch {cfg.batch_size}, "
        f"grid lr {list(cfg.lrs)} × wd {list(cfg.wds)}; {cfg.test_examples} test examples per setting; "
        f"{n_cells} trained cells; accuracy = {cfg.accuracy} (scored ×100).",
        "",
        "## MAD score (best over the grid per setting → mean over settings → mean over tasks)",
        "",
        format_overall(records),
        "",
        "Published (DeltaNet paper Fig. 3, rows but DeltaNet from Poli et al.; width 128, full MAD protocol, "
        "iso-state/iso-parameter) — NOT the same budget as a small run:",
        "",
        format_published(),
        "",
        "## Per task (best over the grid, %)",
        "",
        format_task_tables(records),
        "",
    ]
    if wall_s is not None:
        lines += [f"Wall time: {wall_s:.1f} s.", ""]
    path = out / "mad.md"
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

_CLI_FIELDS = ("models", "tasks", "settings", "lrs", "wds", "d_model", "n_layers", "num_heads", "mlp", "epochs",
               "batch_size", "test_examples", "train_examples", "accuracy", "seed", "device", "dtype", "threads",
               "mode", "out")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", choices=sorted(PRESETS),
                   help="small: one setting per task, tiny models, 8 epochs (2 CPU cores, minutes); full: MAD")
    p.add_argument("--models", nargs="+", default=None, help="zoo names")
    p.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS))
    p.add_argument("--settings", nargs="+", default=None,
                   help="setting names kept per task, e.g. baseline 'seq_len=256' (or: all)")
    p.add_argument("--lrs", nargs="+", type=float, default=None)
    p.add_argument("--wds", nargs="+", type=float, default=None)
    for name in ("d_model", "n_layers", "num_heads", "epochs", "batch_size", "test_examples", "train_examples",
                 "seed", "threads"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--mlp", default=None, choices=["none", "swiglu"])
    p.add_argument("--accuracy", default=None, choices=["macro", "micro"])
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mode", default=None, choices=["auto", "local", "spread", "ddp"],
                   help="run_sweep mode; under torchrun 'auto' spreads cells over ranks")
    p.add_argument("--out", default=None, help="output directory (default runs/mad)")
    p.add_argument("--progress", default="auto", choices=["auto", "tqdm", "plain", "none"])
    p.add_argument("--fresh", action="store_true",
                   help="train every cell of this run again: its records in mad.jsonl are superseded (kept in the "
                        "file) and its checkpoints discarded")
    p.add_argument("--no-plot", action="store_true")


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add the `mad` subcommand to an argparse subparsers object (dispatches to :func:`cli_main`)."""
    p = subparsers.add_parser("mad", help="MAD's six synthetic tasks over the lr x wd grid, scored as MAD "
                              "(tables, PNG, resumable JSONL)", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    p.set_defaults(fn=cli_main)
    return p


def cli_main(args) -> int:
    """`fastweights mad`: run (resuming), print the overall, published and per-task tables, write mad.md/.png."""
    overrides = {k: getattr(args, k, None) for k in _CLI_FIELDS}
    for k in ("models", "tasks", "settings", "lrs", "wds"):
        if overrides[k] is not None:
            overrides[k] = tuple(overrides[k])
    name = getattr(args, "preset", "small") or "small"
    from .. import cliargs

    try:
        for flag in ("--d-model", "--n-layers", "--num-heads", "--epochs", "--batch-size", "--test-examples",
                     "--train-examples"):
            cliargs.positive(flag, getattr(args, flag[2:].replace("-", "_"), None))
        cliargs.threads("--threads", args.threads)
        cliargs.nonnegative("--seed", args.seed)
        cliargs.positive_numbers("--lrs", args.lrs)
        cliargs.positive_numbers("--wds", args.wds, allow_zero=True)
        cliargs.zoo_names("--models", args.models)
        cliargs.device("--device", args.device)
        if args.mode in ("ddp", "spread"):
            cliargs.under_torchrun(f"--mode {args.mode}", "mad")
        cfg = preset(name, **overrides)
        cliargs.preset_device(name, cfg.device, args.device)
        cliargs.writable_dir("--out", cfg.out)
    except ValueError as e:
        print(f"error: {cliargs.flag_message(e, _CLI_FIELDS)}", file=sys.stderr)
        return 2
    argv = getattr(args, "argv", None)
    t0 = time.perf_counter()
    records, status = cliargs.run_sweep_command(
        lambda: run_mad(cfg, progress=getattr(args, "progress", "auto"), fresh=getattr(args, "fresh", False)))
    if status is not None:
        return status
    wall = time.perf_counter() - t0
    from ..training.distributed import dist_info

    if dist_info().rank != 0:
        return 0
    print()
    print("MAD score, ours (%):")
    print(format_overall(records))
    print()
    print("published (DeltaNet Fig. 3 / Poli et al., width 128, full protocol):")
    print(format_published())
    print()
    print(format_task_tables(records))
    command = ("fastweights mad " + " ".join(shlex.quote(a) for a in argv)) if argv is not None else None
    md = write_report(cfg, records, wall_s=wall, command=command, preset_name=name)
    print(f"\ntable: {md}\nrecords: {Path(cfg.out) / 'mad.jsonl'}")
    if not getattr(args, "no_plot", False):
        png = plot_mad(records, Path(cfg.out) / "mad.png", title=f"MAD ({name} preset): ours vs published")
        print(f"plot: {png}")
    print(f"wall time: {wall:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from ..cliargs import Parser
    from .control import run_interruptible

    p = Parser(prog="python -m fastweights.lab.mad", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    return run_interruptible(cli_main, args, "mad")


if __name__ == "__main__":
    sys.exit(main())
