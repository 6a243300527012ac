"""The training harness: train one model on one (train, test) pair of token tensors, and run sweeps
of such cells with resumable results. Task-agnostic: MQAR, NIAH and MAD all feed it.

Data: a pair is ``(inputs [N, T] int64, labels [N, T] int64)`` with labels already shifted
(``labels[:, t]`` is the target of the prediction at position t) and −100 where nothing is
supervised — the convention of `fastweights.tasks`. The loss is the cross-entropy over the
supervised positions only; for an `LM` the head is applied to those positions alone (the
[B, T, vocab] logits are never built, which is most of the cost on CPU for sparse labels).

    accuracy = mean over supervised positions of 1[argmax logits == label]      ("positions")
             = mean over examples of that mean within the example                ("examples", Zoology)

Optimization (Zoology's `train.py`, research/benchmarks.md §1.2, with the usual refinements as
options): AdamW(lr, weight_decay) — `decay_filter="matrices"` decays only ≥2-D weights other than
embeddings (norms, biases, gates' vectors and the tied embedding are not decayed);
`decay_filter="all"` decays every parameter, as Zoology does — a per-step schedule with a linear
warmup (`warmup`: a fraction of all steps if < 1, else a number of steps) and a cosine to `min_lr`
(Zoology: per-epoch cosine to 0, no warmup), gradient clipping, evaluation after every epoch,
early stop when the accuracy exceeds `early_stop` (Zoology: 0.99), the best accuracy kept.

Resumption: `train_cell(..., checkpoint_path=p)` writes model + optimizer + scheduler + epoch +
RNG states + history + a signature of its settings after every epoch (to a temporary file of the
writer's own, then `os.replace`, so a kill never leaves a torn file and two writers never collide)
and resumes from it on start — only when the signature matches (else a TrainError names the
differing fields; `fresh=True` discards it): at most the running epoch is lost, and nothing when
the run was stopped by a stop request (SIGINT), which saves mid-epoch. Batches are drawn from a
generator seeded by (seed, epoch), so a resumed run replays exactly what an uninterrupted run
does. A finished cell's checkpoint says so and is returned without training.

Sweeps: `ResultStore` is a JSONL file (one record per finished cell, flushed and fsynced; torn and
malformed lines skipped and reported); `run_sweep(cells, store, run_fn)` skips the cells whose key
is already there, so re-running a sweep trains only what is missing, and holds a lock per cell so
that two processes on one store never train the same cell (`fastweights.lab.control`).
`best_over(records, over=("lr",))` keeps the best record of every configuration (the papers
report the max over the learning-rate sweep).

The step cycle (`fastweights.training.loop.run`: the stop check at each step boundary, the
optimizer step, the epoch's end as its evaluation and save hooks every steps_per_epoch steps), the
optimizer step, checkpoint writes, stop requests, the process group, the DDP wrapper and the
progress reporter are `fastweights.training`'s, shared with `fastweights train`; `train_cell`
gives the cycle its hooks (global step s = epoch · steps_per_epoch + the step in the epoch).

CUDA graphs: `train_cell(cuda_graph=True)` on a CUDA device captures one training step and
replays it (`fastweights.lab.graph`: the same maths, the losses read every few steps).

Distributed (torchrun; `fastweights.training.distributed`): `run_sweep(mode="ddp")` trains each
model with DistributedDataParallel on all ranks (rank 0 writes); `mode="spread"` runs cell i on
rank i % world_size, every rank appending its own records under a file lock.

Progress: `progress="auto"` draws tqdm bars (sweep and cell) when stdout is a terminal and prints
plain log lines otherwise; "tqdm", "plain" or "none" force one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..training import loop as training_loop
from ..training.checkpoint import atomic_save, rng_state, set_rng_state
from ..training.control import Interrupted, stop_on_sigint, stop_requested, training
from ..training.distributed import DistInfo, all_reduce_sum, barrier, dist_info, is_distributed, process_group
from ..training.progress import make_progress
from ..training.step import adamw, autocast, lr_factor
from . import graph
from .control import CellLock, worker_init

# run_sweep(mode="spread") sets this: the cells of a spread sweep train alone on their rank, so
# train_cell(ddp=None) must not wrap them in DDP although a process group is running
_SPREAD = contextvars.ContextVar("fastweights_spread_sweep", default=False)

__all__ = ["TrainConfig", "TrainError", "Interrupted", "accuracy", "train_cell", "ResultStore", "run_sweep",
           "cell_key", "best_over", "checkpoint_signature", "signature_diff", "IGNORE_INDEX", "CPU_NUMERICS",
           "pin_cpu_numerics", "cpu_numerics", "Supervised"]

IGNORE_INDEX = -100
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


#: The kernel choices `pin_cpu_numerics` fixes for CPU training: ATen's vectorized kernels at AVX2
#: (not the machine's best, AVX-512 where it has it) and MKL's conditional numerical
#: reproducibility at its AVX2 code path. Measured (torch 2.13, 1 thread, one machine): the
#: kernels the machine's ISA selects change a training run's bits from the first step, and the
#: quick preset's GLA d=32 cell ended anywhere in 0.41-0.55 across those choices.
CPU_NUMERICS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def pin_cpu_numerics(threads: int | None = 1) -> dict:
    """Make CPU training bit-reproducible across machines and worker layouts, as far as the
    process can: a fixed torch thread count (intra-op parallelism splits reductions by the thread
    count; default 1 whatever the core count) and, unless FASTWEIGHTS_CPU_NUMERICS=native, the
    kernel choices of `CPU_NUMERICS` (set in os.environ, overriding the machine's: ATen and MKL
    read them at their first CPU kernel, so this must run before the process's first tensor
    operation — a sweep's spawned workers and the lab commands do; later, the record shows what
    was really used). Returns `cpu_numerics()`."""
    if os.environ.get("FASTWEIGHTS_CPU_NUMERICS", "portable") != "native":
        os.environ.update(CPU_NUMERICS)
    if threads:
        torch.set_num_threads(int(threads))
    return cpu_numerics()


def cpu_numerics() -> dict:
    """What decides the bits of a CPU run here (recorded with every lab cell): torch's version, its
    thread count, the ATen kernel level in use and MKL's reproducibility mode."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR")}


class TrainError(ValueError):
    """A bad training configuration or data; the message names the argument."""


def _num(value, name, *, lo=None, hi=None, lo_open=False, integer=False, allow_none=False):
    if value is None and allow_none:
        return
    ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float))) and not isinstance(value, bool)
    if not ok_type or (not integer and not math.isfinite(value)):
        raise TrainError(f"TrainConfig.{name} must be {'an int' if integer else 'a finite number'}"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise TrainError(f"TrainConfig.{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise TrainError(f"TrainConfig.{name} must be <= {hi}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How one cell is trained (validated; all fields keyword-only).

    epochs:          passes over the training set (≥ 1).
    batch_size:      global batch (split over the ranks under DDP); eval_batch_size (default: the same).
    lr, betas, weight_decay: AdamW. decay_filter: "matrices" (≥2-D weights except embeddings are
                     decayed) or "all" (every parameter, as Zoology).
    warmup:          linear warmup: a fraction of all steps when < 1 (0 = none), else a step count.
    schedule:        "cosine" (to min_lr at the last step) or "constant" (after warmup).
    min_lr:          the cosine's floor.
    grad_clip:       max global gradient norm (None: no clipping).
    early_stop:      stop after an evaluation whose accuracy is > early_stop (None: never).
    accuracy:        "positions" (pooled over supervised positions) or "examples" (mean of the
                     per-example accuracies: Zoology's `valid/accuracy`).
    seed:            model init and batch order.
    device:          "cpu", "cuda", "cuda:1", ...; under DDP on CUDA each rank uses cuda:LOCAL_RANK.
    dtype:           "float32"; "bfloat16"/"float16" (autocast, fp32 weights); "float64" (weights too).
    """

    epochs: int = 10
    batch_size: int = 64
    eval_batch_size: int | None = None
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.1
    decay_filter: str = "matrices"
    warmup: float = 0.0
    schedule: str = "cosine"
    min_lr: float = 0.0
    grad_clip: float | None = 1.0
    early_stop: float | None = 0.99
    accuracy: str = "positions"
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self):
        _num(self.epochs, "epochs", lo=1, integer=True)
        _num(self.batch_size, "batch_size", lo=1, integer=True)
        _num(self.eval_batch_size, "eval_batch_size", lo=1, integer=True, allow_none=True)
        _num(self.lr, "lr", lo=0, lo_open=True)
        _num(self.weight_decay, "weight_decay", lo=0)
        _num(self.warmup, "warmup", lo=0)
        if self.warmup >= 1 and not float(self.warmup).is_integer():
            raise TrainError(f"TrainConfig.warmup must be a fraction < 1 or a whole number of steps, got {self.warmup}")
        _num(self.min_lr, "min_lr", lo=0)
        if self.min_lr > self.lr:
            raise TrainError(f"TrainConfig.min_lr={self.min_lr} must be <= lr={self.lr}")
        _num(self.grad_clip, "grad_clip", lo=0, lo_open=True, allow_none=True)
        _num(self.early_stop, "early_stop", lo=0, hi=1, allow_none=True)
        _num(self.seed, "seed", lo=0, integer=True)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise TrainError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        for name, allowed in (("decay_filter", ("matrices", "all")), ("schedule", ("cosine", "constant")),
                              ("accuracy", ("positions", "examples")), ("dtype", tuple(_DTYPES))):
            if getattr(self, name) not in allowed:
                raise TrainError(f"TrainConfig.{name}={getattr(self, name)!r} is not one of {list(allowed)}")
        if not isinstance(self.device, str) or not self.device:
            raise TrainError(f"TrainConfig.device must be a device string, got {self.device!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    def warmup_steps(self, total_steps: int) -> int:
        return int(round(self.warmup * total_steps)) if self.warmup < 1 else int(self.warmup)


# ------------------------------------------------------------------------------------------ data checks
def _check_pair(pair, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TrainError(f"{name} must be a pair (inputs [N, T], labels [N, T]), got {type(pair).__name__}")
    x, y = pair
    for t, what in ((x, "inputs"), (y, "labels")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            raise TrainError(f"{name} {what} must be an integer tensor [N, T], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    if x.shape != y.shape:
        raise TrainError(f"{name}: inputs {list(x.shape)} and labels {list(y.shape)} differ in shape")
    if x.shape[0] == 0:
        raise TrainError(f"{name} holds no examples")
    if not bool((y != IGNORE_INDEX).any()):
        raise TrainError(f"{name} has no supervised position (every label is {IGNORE_INDEX})")
    return x.long(), y.long()


# ------------------------------------------------------------------------------------------ model glue
class Supervised(nn.Module):
    """(inputs [B, T], labels [B, T]) -> (logits [P, vocab], targets [P], rows [P]) over the P
    supervised positions. For an LM-shaped model (embed, blocks, _logits) the head is applied to
    those positions only; any other model is called as model(inputs) -> [B, T, vocab]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        m = model
        self._lm = all(hasattr(m, a) for a in ("embed", "blocks", "_logits"))

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor):
        mask = labels != IGNORE_INDEX  # [B, T]
        if self._lm:
            h = self.model.embed(inputs)  # [B, T, d]
            for block in self.model.blocks:
                h, _ = block(h)
            logits = self.model._logits(h[mask])  # [P, vocab]
        else:
            logits = self.model(inputs)[mask]  # [P, vocab]
        rows = mask.nonzero()[:, 0]  # [P] example index of each supervised position
        return logits, labels[mask], rows

    def at(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(inputs [B, T], positions [B, m]) -> the logits at those positions [B, m, vocab]: the
        fixed-shape form of `forward` (no data-dependent size, so a CUDA graph can capture it;
        `fastweights.lab.graph`)."""
        if self._lm:
            h = self.model.embed(inputs)  # [B, T, d]
            for block in self.model.blocks:
                h, _ = block(h)
            h = torch.gather(h, 1, positions.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [B, m, d]
            return self.model._logits(h)
        logits = self.model(inputs)  # [B, T, vocab]
        return torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def _lr_lambda(cfg: TrainConfig, total: int):
    warm, floor = cfg.warmup_steps(total), cfg.min_lr / cfg.lr
    return lambda step: lr_factor(step, total=total, warmup=warm, floor=floor, schedule=cfg.schedule)


def _resolve_device(cfg: TrainConfig) -> torch.device:
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and is_distributed() and dev.index is None:
        dev = torch.device("cuda", dist_info().local_rank)
    return dev


@torch.no_grad()
def accuracy(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int = 256, *,
             reduction: str = "positions", device=None, dtype: str = "float32", distributed: bool = False) -> float:
    """Argmax accuracy over the positions whose label is not −100, as a float.

    reduction "positions": pooled over all supervised positions; "examples": the mean over
    examples of the per-example accuracy (Zoology; examples without a supervised position are
    left out). distributed=True (every rank of the process group calls it, as in DDP training):
    each rank scores its shard of the examples and the sums are all-reduced (every rank gets the
    same number)."""
    if reduction not in ("positions", "examples"):
        raise TrainError(f"reduction must be 'positions' or 'examples', got {reduction!r}")
    inputs, labels = _check_pair((inputs, labels), "accuracy data")
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    sup = net if isinstance(net, Supervised) else Supervised(net)
    if device is None:
        p = next(net.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    info = dist_info() if distributed else DistInfo()
    idx = torch.arange(inputs.shape[0])[info.rank::info.world_size]
    was_training = sup.training
    sup.eval()
    TrainConfig(dtype=dtype)  # (validates dtype)
    correct = count = 0.0
    try:
        for s in range(0, idx.numel(), batch_size):
            b = idx[s:s + batch_size]
            x, y = inputs[b].to(device), labels[b].to(device)
            with autocast(dtype, device):
                logits, tgt, rows = sup(x, y)
            hit = (logits.argmax(-1) == tgt).double()  # [P]
            if reduction == "positions":
                correct += hit.sum().item()
                count += hit.numel()
            else:
                n = torch.bincount(rows, minlength=b.numel()).double()  # [B] supervised per example
                h = torch.bincount(rows, weights=hit, minlength=b.numel())  # [B] hits per example
                keep = n > 0
                correct += (h[keep] / n[keep]).sum().item()
                count += keep.sum().item()
    finally:
        sup.train(was_training)
    if info.world_size > 1:
        correct, count = all_reduce_sum([correct, count], device=device if device.type == "cuda" else "cpu")
    return correct / count if count else float("nan")


# ------------------------------------------------------------------------------------------ checkpoints
def _load_checkpoint(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: say so, do not silently restart
        raise TrainError(f"checkpoint {path} cannot be read ({e}); delete it to restart the cell") from None


# ------------------------------------------------------------------------------------------ training
def _default_model(lm_config):
    from ..models import LM

    return LM(lm_config)


def _lm_state_bytes(model: nn.Module) -> int | None:
    fn = getattr(model, "state_size", None)
    if fn is None:
        return None
    try:
        return int(fn(1))
    except Exception:  # pragma: no cover - a model without a decoding state
        return None


def _jsonish(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=_json_default))


def checkpoint_signature(lm_config, cfg: TrainConfig, extra: dict | None = None) -> dict:
    """What a checkpoint must match to be resumed: the TrainConfig (device reduced to its type:
    "cuda:1" resumes "cuda"), the model config when it is a dataclass, and the caller's `extra`."""
    sig = {"train": {**cfg.to_dict(), "device": torch.device(cfg.device).type}}
    if dataclasses.is_dataclass(lm_config) and not isinstance(lm_config, type):
        sig["model"] = dataclasses.asdict(lm_config)
    if extra:
        sig["cell"] = dict(extra)
    return _jsonish(sig)


def _flat(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def signature_diff(old: dict, new: dict) -> list[str]:
    """'field: old -> new' for every field that differs between two signatures."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "(absent)") != b.get(k, "(absent)")]


def _check_resumable(st: dict, sig: dict, path: Path) -> None:
    if "signature" in st:
        diffs = signature_diff(st["signature"], sig)
    elif "train_config" in st:  # written before signatures: its TrainConfig is all it says
        old = dict(st["train_config"])
        old["device"] = torch.device(old.get("device", "cpu")).type
        diffs = signature_diff({"train": _jsonish(old)}, {"train": sig["train"]})
    else:
        diffs = ["(the checkpoint records no settings)"]
    if diffs:
        raise TrainError(f"checkpoint {path} was written with other settings ({'; '.join(diffs[:6])}"
                         f"{'; ...' if len(diffs) > 6 else ''}): pass --fresh (fresh=True) to discard it and "
                         "start the cell again, or use another output directory")


def train_cell(lm_config, train_pair, test_pair, cfg: TrainConfig, *, checkpoint_path=None, progress=None,
               model_fn: Callable[[Any], nn.Module] | None = None, ddp: bool | None = None,
               on_epoch: Callable[[int, dict], None] | None = None, desc: str = "cell",
               signature: dict | None = None, fresh: bool = False, cuda_graph: bool = False) -> dict:
    """Train one model and return its result.

    lm_config:   what `model_fn` builds the model from (default model_fn: `LM(lm_config)`).
    train_pair, test_pair: (inputs [N, T], labels [N, T]) int64, labels −100 where unsupervised.
    cfg:         TrainConfig.
    checkpoint_path: resume from / save to this file after every epoch (None: no checkpoint).
    progress:    "auto" | "tqdm" | "plain" | "none" | a Progress.
    ddp:         wrap the model in DistributedDataParallel (default: when a process group with
                 more than one rank is running, except inside a run_sweep(mode="spread"), whose
                 cells train alone on their rank). Under DDP all ranks must call train_cell.
    on_epoch:    called as on_epoch(epoch, history_entry) after each epoch's checkpoint is written.
    signature:   extra fields a checkpoint must match (with the TrainConfig and the model config:
                 `checkpoint_signature`); a checkpoint written with other settings is refused with
                 a TrainError naming the differing fields.
    fresh:       discard an existing checkpoint and train from the start.
    cuda_graph:  on CUDA (not under DDP), capture one training step in a CUDA graph and replay
                 it for every step (`fastweights.lab.graph`: the same maths; the losses are read
                 every `graph.CHECK_EVERY` steps and at the epoch's end, so a non-finite loss
                 stops the cell up to that many steps late; a failed capture trains on eagerly and
                 says so). Not part of the checkpoint's signature: a checkpoint resumes in either
                 mode.

    Stopping: when a stop is requested (`fastweights.training.control`: the first SIGINT under
    `stop_on_sigint`, or `request_stop()`), the cell saves its checkpoint at the current step
    (mid-epoch: the step, the epoch's partial loss sums and the RNG states) and raises
    `Interrupted`; a resumed run continues at that step and its history is the uninterrupted one.

    Returns {"accuracy": best eval accuracy, "final_accuracy", "best_epoch", "epochs_run",
    "stopped_early", "history": [{"epoch", "loss", "accuracy", "lr", "seconds"}...], "params",
    "state_bytes" (model.state_size(1) when the model has one), "steps", "train_seconds",
    "resumed_from" (epochs already done when the call started), "cuda_graph" (whether this
    call's steps were replays of a captured graph) and, when cuda_graph was asked for but not
    used, "cuda_graph_note" (why)}.
    """
    if not isinstance(cfg, TrainConfig):
        raise TrainError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if not isinstance(cuda_graph, bool):
        raise TrainError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    x_tr, y_tr = _check_pair(train_pair, "train_pair")
    x_te, y_te = _check_pair(test_pair, "test_pair")
    prog = make_progress(progress)
    info = dist_info()
    use_ddp = (info.world_size > 1 and not _SPREAD.get()) if ddp is None else bool(ddp)
    if use_ddp and info.world_size > 1 and not is_distributed():
        raise TrainError("ddp=True needs a running process group (call init_distributed under torchrun)")
    world = info.world_size if use_ddp else 1
    rank = info.rank if use_ddp else 0
    device = _resolve_device(cfg)
    ckpt = Path(checkpoint_path) if checkpoint_path is not None else None

    torch.manual_seed(cfg.seed)
    model = (model_fn or _default_model)(lm_config)
    if cfg.dtype == "float64":
        model = model.double()
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = _lm_state_bytes(model)
    sup = Supervised(model)
    net: nn.Module = sup
    if use_ddp and world > 1:
        net = training_loop.wrap(sup, "ddp", device)
    opt = adamw(model, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, decay_filter=cfg.decay_filter)

    n_train = x_tr.shape[0]
    per_rank_n = n_train // world  # every rank takes the same count (DDP needs equal step counts)
    per_rank_bs = max(1, cfg.batch_size // world)
    steps_per_epoch = math.ceil(per_rank_n / per_rank_bs)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total_steps))

    history: list[dict] = []
    start_epoch, best, best_epoch, finished, stopped, train_seconds = 0, float("-inf"), -1, False, False, 0.0
    start_step, carry = 0, (0.0, 0, 0.0)  # inside start_epoch: steps done, (loss sum, loss count, seconds)
    sig = checkpoint_signature(lm_config, cfg, signature)
    if ckpt is not None and fresh and rank == 0:
        ckpt.unlink(missing_ok=True)
    if ckpt is not None and ckpt.exists():
        st = _load_checkpoint(ckpt)
        _check_resumable(st, sig, ckpt)
        try:
            model.load_state_dict(st["model"])
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise TrainError(f"checkpoint {ckpt} holds another model ({first}): pass --fresh (fresh=True) to "
                             "discard it, or use another output directory") from None
        opt.load_state_dict(st["optimizer"])
        if any(g.get("capturable") for g in opt.param_groups):  # (checkpoints are written in the eager form)
            graph.set_capturable(opt, False)
        sched.load_state_dict(st["scheduler"])
        set_rng_state(st["rng"])
        history = list(st["history"])
        start_epoch = st["epoch"]
        best, best_epoch = st["best"], st["best_epoch"]
        finished, stopped = st["finished"], st["stopped_early"]
        train_seconds = st.get("train_seconds", 0.0)
        if st.get("step"):
            start_step = int(st["step"])
            carry = (st["loss_sum"], st["loss_n"], st["epoch_seconds"])
        prog.log(f"{desc}: resumed from {ckpt} after epoch {start_epoch}"
                 + (f" step {start_step}" if start_step else ""))
    resumed_from = start_epoch
    stoppable = not (use_ddp and world > 1)  # (every DDP rank would have to stop at the same step)
    runner, graph_note = None, None
    if cuda_graph and not finished:
        if use_ddp and world > 1:
            graph_note = "not used under DDP"
        elif device.type != "cuda" and not graph._EMULATE_ON_CPU:
            graph_note = f"CUDA only (device {device})"
        else:
            capture = device.type == "cuda"
            if capture:
                graph.set_capturable(opt, True)
            runner = graph.GraphedSteps(sup, opt, device=device, dtype=cfg.dtype, grad_clip=cfg.grad_clip,
                                        inputs=x_tr, labels=y_tr, batch=per_rank_bs,
                                        steps_per_epoch=steps_per_epoch, capture=capture)
        if graph_note is not None:
            prog.log(f"{desc}: cuda_graph: {graph_note}; training eagerly")

    def save(epoch_done: int, **mid):
        if ckpt is not None and rank == 0:
            atomic_save({"model": model.state_dict(),
                         "optimizer": opt.state_dict() if runner is None else graph.eager_state_dict(opt),
                         "scheduler": sched.state_dict(), "rng": rng_state(), "epoch": epoch_done,
                         "history": history, "best": best, "best_epoch": best_epoch, "finished": finished,
                         "stopped_early": stopped, "train_seconds": train_seconds,
                         "train_config": cfg.to_dict(), "signature": sig, **mid}, ckpt)

    def interrupted(where: str) -> Interrupted:
        saved = f"saved to {ckpt}" if ckpt is not None else "nothing saved (no checkpoint path)"
        return Interrupted(f"{desc}: stopped {where}; {saved}")

    def log_line(line: str) -> None:
        prog.log(f"{desc}: {line}")

    eval_bs = cfg.eval_batch_size or cfg.batch_size
    bar = None if finished else prog.bar((cfg.epochs - start_epoch) * steps_per_epoch - start_step, desc)
    epoch = start_epoch
    # the running epoch (set as its first step's batches are asked for): its examples, its loss sums and time, and
    # (graphed) the replays' selection, the first step whose loss the host has not read, the first non-finite one
    mine = selection = None
    loss_sum, loss_n, carried_s, t0, read, bad = 0.0, 0, 0.0, 0.0, 0, None

    def begin(first: int) -> None:
        nonlocal mine, selection, loss_sum, loss_n, carried_s, t0, read, bad, start_step, carry
        t0 = time.perf_counter()
        net.train()
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n_train, generator=g)[: per_rank_n * world]
        mine = perm[rank::world]  # [per_rank_n] this rank's examples for the epoch
        (loss_sum, loss_n, carried_s), read, bad = carry, first, None
        start_step, carry = 0, (0.0, 0, 0.0)
        selection = runner.epoch(mine) if runner is not None else None

    def batches(s: int) -> list:
        """Step s of the cell (epoch s // steps_per_epoch): [(inputs [b, T], labels [b, T])] on the device, or
        (graphed) [the step's index in its epoch]."""
        i = s % steps_per_epoch
        if mine is None or i == 0:
            begin(i)
        if runner is not None:
            return [i]
        b = mine[i * per_rank_bs:(i + 1) * per_rank_bs]
        return [(x_tr[b].to(device, non_blocking=True), y_tr[b].to(device, non_blocking=True))]

    def boundary(s: int, micro) -> bool:
        nonlocal loss_sum, loss_n, bad, read
        if not (stoppable and stop_requested()):
            return False
        if runner is not None:  # (account for the steps run so far)
            i = s % steps_per_epoch
            loss_sum, loss_n, bad = graph.account(runner.read(read, i), read, loss_sum, loss_n)
            read = i
        return True

    def interrupt(s: int) -> None:
        if bad is not None:  # (graphed: a non-finite loss among those read; the run ends with this epoch)
            return
        i = s % steps_per_epoch
        save(epoch, step=i, loss_sum=loss_sum, loss_n=loss_n, epoch_seconds=carried_s + time.perf_counter() - t0)
        bar.close()
        raise interrupted(f"at epoch {epoch + 1} step {i}/{steps_per_epoch}")

    def loss(b) -> torch.Tensor:
        x, y = b
        with autocast(cfg.dtype, device):
            logits, tgt, _ = net(x, y)
            return F.cross_entropy(logits.float(), tgt)

    def graphed_step(s: int, micro) -> tuple[list[float], None]:
        i = micro[0]
        runner.step(i, selection[i], log=log_line)
        sched.step()
        return [], None

    def record(step: int, losses: list[float], lr) -> bool:
        """The step's loss into the epoch's sums; False (the cell stops with this epoch) at a non-finite one."""
        nonlocal loss_sum, loss_n, bad, read, stopped
        i = (step - 1) % steps_per_epoch
        if runner is not None:
            bar.update(1)
            if (i + 1 - read) >= graph.CHECK_EVERY or i + 1 == steps_per_epoch:
                read_losses = runner.read(read, i + 1)
                loss_sum, loss_n, bad = graph.account(read_losses, read, loss_sum, loss_n)
                read = i + 1
                if bad is not None:
                    return False
                bar.set_postfix(loss=f"{read_losses[-1]:.3f}", refresh=False)
            return True
        lv = losses[0]
        if not math.isfinite(lv) and not (use_ddp and world > 1):  # (under DDP every rank must go on)
            prog.log(f"{desc}: non-finite loss at epoch {epoch + 1} step {i + 1}; stopping the cell")
            stopped = True
            return False
        loss_sum += lv
        loss_n += 1
        bar.update(1)
        if i % 10 == 0:
            bar.set_postfix(loss=f"{lv:.3f}", refresh=False)
        return True

    def evaluate(step: int) -> bool:
        """The epoch's end: its mean loss, the test accuracy, the history entry; False when the cell is done."""
        nonlocal loss_sum, loss_n, stopped, train_seconds, best, best_epoch, epoch, finished
        if bad is not None:  # (graphed: seen when the losses were read, at most CHECK_EVERY steps later)
            prog.log(f"{desc}: non-finite loss at epoch {epoch + 1} step {bad + 1} (read after step {read}); "
                     "stopping the cell")
            stopped = True
        if use_ddp and world > 1:  # the epoch's mean loss over all ranks' batches
            loss_sum, loss_n = all_reduce_sum([loss_sum, loss_n], device=device if device.type == "cuda" else "cpu")
        acc = accuracy(sup, x_te, y_te, eval_bs, reduction=cfg.accuracy, device=device, dtype=cfg.dtype,
                       distributed=use_ddp and world > 1)
        if not math.isfinite(acc):
            acc = 0.0
        seconds = carried_s + time.perf_counter() - t0
        train_seconds += seconds
        if acc > best:
            best, best_epoch = acc, epoch + 1
        entry = {"epoch": epoch + 1, "loss": loss_sum / max(1, loss_n), "accuracy": acc,
                 "lr": sched.get_last_lr()[0], "seconds": round(seconds, 3)}
        history.append(entry)
        epoch += 1
        if cfg.early_stop is not None and acc > cfg.early_stop:
            stopped = True
        finished = stopped or epoch >= cfg.epochs
        bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=f"{acc:.3f}", refresh=True)
        prog.log(f"{desc}: epoch {epoch}/{cfg.epochs} loss {entry['loss']:.4f} acc {acc:.4f} "
                 f"(best {best:.4f}) {seconds:.1f}s")
        return not finished

    def saved(step: int) -> None:
        """After the epoch's end: its checkpoint, on_epoch, and a stop requested meanwhile."""
        if ckpt is not None:
            save(epoch)
            if use_ddp and world > 1:
                barrier()
        if on_epoch is not None:
            on_epoch(epoch, history[-1])
        if stoppable and not finished and stop_requested():
            bar.close()
            raise interrupted(f"after epoch {epoch}")

    total = steps_per_epoch * cfg.epochs
    start = total if finished else start_epoch * steps_per_epoch + start_step
    hooks = training_loop.Hooks(batches=batches, loss=loss, boundary=boundary, interrupt=interrupt,
                                step=graphed_step if runner is not None else None, record=record,
                                evaluate=evaluate, eval_every=steps_per_epoch, save=saved,
                                save_every=steps_per_epoch, grad_clip=cfg.grad_clip)
    with training(), (contextlib.nullcontext() if runner is None else contextlib.closing(runner)):
        if training_loop.run(hooks, net, opt, sched, start, total) < total and not finished:
            evaluate(0)  # (stopped mid-epoch by a non-finite loss: the epoch ends here)
            saved(0)
    if bar is not None:
        bar.close()
    return {"accuracy": best if history else float("nan"),
            "final_accuracy": history[-1]["accuracy"] if history else float("nan"),
            "best_epoch": best_epoch, "epochs_run": len(history), "stopped_early": stopped,
            "history": history, "params": n_params, "state_bytes": state_bytes,
            "steps": steps_per_epoch * len(history), "train_seconds": round(train_seconds, 3),
            "resumed_from": resumed_from, "cuda_graph": runner is not None and runner.graphed,
            **({"cuda_graph_note": note} if (note := graph_note or (runner and runner.why_not())) else {})}


# ------------------------------------------------------------------------------------------ results
def cell_key(cell) -> str:
    """A stable string key of a cell: the JSON of its fields (sorted), with its type name. A dataclass field with
    metadata {"key": "omit if None"} is left out while it is None (a field added later keeps the keys of the records
    made before it)."""
    if dataclasses.is_dataclass(cell):
        fields = dataclasses.asdict(cell)
        for f in dataclasses.fields(cell):
            if f.metadata.get("key") == "omit if None" and fields[f.name] is None:
                del fields[f.name]
        name = type(cell).__name__
    elif isinstance(cell, dict):
        fields, name = dict(cell), "dict"
    else:
        raise TrainError(f"a cell must be a dataclass or a dict, got {type(cell).__name__}")
    return name + json.dumps(fields, sort_keys=True, default=str)


class ResultStore:
    """Results of a sweep as a JSONL file: one JSON object per finished cell, each with its "key".

    append(record): writes one line, flushed and fsynced, under an exclusive file lock (so several
    processes may append to one file); when the file does not end with a newline (a kill tore the
    last append), the record starts a new line, so the torn line never swallows it.
    records(): every well-formed record. A line that is not a JSON object (a torn write) or lacks
    one of `required` (field -> type or tuple of types; numbers exclude bool) is skipped and listed
    in `skipped` as (line number, reason) — the file itself is left as it is. done(key): whether a
    record with that key exists. `warning()`: one line naming the skipped lines, or None."""

    def __init__(self, path, required: dict[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.required = {"key": str, **(required or {})}
        self.skipped: list[tuple[int, str]] = []

    def _problem(self, rec) -> str | None:
        if not isinstance(rec, dict):
            return f"not a JSON object ({type(rec).__name__})"
        for name, typ in self.required.items():
            if name not in rec:
                return f"no {name!r}"
            v = rec[name]
            if isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
                return f"{name} is {v!r}, not {_type_name(typ)}"
            if not isinstance(v, typ):
                return f"{name} is {v!r}, not {_type_name(typ)}"
        return None

    def records(self, start: int = 0) -> list[dict]:
        """The well-formed records (from byte offset `start`: see `size()`)."""
        self.skipped = []
        if not self.path.exists():
            return []
        out = []
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read().decode("utf-8", errors="replace")
        for no, line in enumerate(data.split("\n"), 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                self.skipped.append((no, "not complete JSON (a write cut short?)"))
                continue
            why = self._problem(rec)
            if why is not None:
                self.skipped.append((no, why))
                continue
            out.append(rec)
        return out

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def warning(self) -> str | None:
        """A one-line summary of the lines the last records() skipped (None: none skipped)."""
        if not self.skipped:
            return None
        shown = "; ".join(f"line {n}: {why}" for n, why in self.skipped[:3])
        more = f"; {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
        return (f"warning: {self.path}: skipped {len(self.skipped)} malformed line(s) ({shown}{more}); "
                "they stay in the file and are left out of the results")

    def keys(self, start: int = 0) -> set[str]:
        return {r["key"] for r in self.records(start)}

    def done(self, key, start: int = 0) -> bool:
        if not isinstance(key, str):
            key = cell_key(key)
        return key in self.keys(start)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, default=_json_default) + "\n").encode("utf-8")
        with open(self.path, "a+b") as f:
            try:
                import fcntl

                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            except (ImportError, OSError):  # pragma: no cover - no flock on this platform
                fcntl = None
            try:
                end = f.seek(0, os.SEEK_END)
                if end > 0:
                    f.seek(end - 1)
                    if f.read(1) != b"\n":
                        line = b"\n" + line  # the last append was torn: do not extend its line
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            finally:
                if fcntl is not None:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _type_name(typ) -> str:
    typs = typ if isinstance(typ, tuple) else (typ,)
    names = {int: "a number", float: "a number", str: "a string", dict: "an object", list: "a list"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in typs))


NUMBER = (int, float)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def run_sweep(cells: Sequence, store: ResultStore, run_fn: Callable[..., dict], *, mode: str = "auto",
              progress=None, describe: Callable[[Any], str] | None = None, device: str = "cpu",
              workers: int = 1, context: dict | None = None, fresh: bool = False,
              skip: Callable[[Any, list[dict]], str | None] | None = None) -> list[dict]:
    """Run every cell not yet in `store` and return all of the store's records for these cells.

    run_fn(cell, progress=Progress, desc=str) -> dict: trains one cell (typically through
    `train_cell`) and returns its result; the stored record is {"key", **fields of the cell,
    **context, **result, "rank", "wall_seconds"}. Cells already in the store are skipped
    (re-running a finished sweep trains nothing).

    context: settings shared by the run that change a cell's result without being fields of the
    cell (dtype, device type): they are part of every key and record, so a run with other
    settings never takes these records for its own. fresh: run every cell again, ignoring the
    records already in the store (the new ones are appended after them and supersede them);
    discarding checkpoints is `run_fn`'s part (`train_cell(fresh=True)`).

    skip(cell, records) -> reason | None: asked as each cell comes up to run, with the store's records of this
    run's context so far; a cell it gives a reason for is not trained (the reason is logged; it gets no record,
    so a later run asks again).

    mode: "local" (one process), "ddp" (every rank runs every cell, the model data-parallel;
    rank 0 writes), "spread" (cell i on rank i % world_size; every rank writes its own records
    under the store's file lock), "auto" ("spread" under torchrun, else "local"). `device` picks the
    process group's backend under torchrun (nccl for CUDA, else gloo). `workers` > 1 (local mode
    only) runs that many cells at once in spawned worker processes (`run_fn` and the cells must
    pickle; set each worker's torch threads inside run_fn); the parent writes the records as
    cells finish, and the workers log plain lines (none when the parent draws tqdm bars). Workers
    die with the parent, even when it is SIGKILLed (`fastweights.lab.control.worker_init`).

    Concurrency (local and spread modes): a process runs a cell only while holding the cell's
    lock (`control.CellLock`, under ``.<store name>.locks/`` beside the store) and after checking,
    with the lock held, that no record of it has appeared meanwhile. A second process on the same
    store therefore takes the cells nobody holds and then waits for the ones another process is
    training (saying so), recording nothing twice.

    Stopping (one process, not under torchrun): the first SIGINT asks every running cell to save
    its checkpoint where it is and stop (workers are sent SIGINT too); the finished cells' records
    are written and `Interrupted` is raised with a one-line message saying how to resume. A second
    SIGINT stops the workers at once. The sweep shows a progress bar over cells (tqdm) or one line
    per cell (plain)."""
    if mode not in ("auto", "local", "ddp", "spread"):
        raise TrainError(f"mode must be 'auto', 'local', 'ddp' or 'spread', got {mode!r}")
    kw = dict(mode=mode, progress=progress, describe=describe, workers=workers, context=context, fresh=fresh,
              skip=skip)
    if mode == "local":
        return _sweep(cells, store, run_fn, dist_info(), **kw)
    # (a group started here under torchrun is destroyed at exit; every rank stops at one point)
    with process_group(device, together=(Interrupted,)) as info:
        return _sweep(cells, store, run_fn, info, **kw)


def _sweep(cells, store: ResultStore, run_fn, info: DistInfo, *, mode, progress, describe, workers, context, fresh,
           skip) -> list[dict]:
    if mode == "auto":
        mode = "spread" if info.world_size > 1 else "local"
    prog = make_progress(progress)
    describe = describe or (lambda c: cell_key(c))
    context = _jsonish(dict(context or {}))
    suffix = ("|" + json.dumps(context, sort_keys=True)) if context else ""
    keys = [cell_key(c) + suffix for c in cells]
    start = store.size() if fresh else 0  # fresh: only records appended from now on count as done
    done = store.keys(start)
    if store.warning() and info.rank == 0:
        print(store.warning(), file=sys.stderr, flush=True)
    todo = [i for i, k in enumerate(keys) if k not in done]
    mine = [i for i in todo if i % info.world_size == info.rank] if mode == "spread" else todo
    prog.log(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(mine)} to run here"
             + (f" (mode {mode}, rank {info.rank}/{info.world_size})" if info.world_size > 1 else ""))
    bar = prog.bar(len(mine), "sweep", leave=True, position=0)
    t_sweep = time.perf_counter()
    use_locks = mode != "ddp"
    lock_dir = store.path.parent / f".{store.path.name}.locks"
    queue, waiting, held = list(mine), [], {}
    count = [0]
    told = [False]

    def finish(i, result, seconds):
        rec = {"key": keys[i], **_fields(cells[i]), **context, **result, "rank": info.rank,
               "wall_seconds": round(seconds, 3)}
        if mode != "ddp" or info.rank == 0:
            store.append(rec)
        count[0] += 1
        bar.update(1)
        acc = result.get("accuracy")
        msg = f"[{count[0]}/{len(mine)}] {describe(cells[i])}: "
        msg += f"accuracy {acc:.4f}" if isinstance(acc, float) else "done"
        prog.log(msg + f" ({seconds:.1f}s, sweep {time.perf_counter() - t_sweep:.0f}s)")

    def release(i):
        lk = held.pop(i, None)
        if lk is not None:
            lk.release()

    def claim(i) -> bool:
        if use_locks:
            lk = CellLock.acquire(lock_dir, keys[i])
            if lk is None:
                return False
            held[i] = lk
            if store.done(keys[i], start):  # finished by another process since we looked
                release(i)
                count[0] += 1
                bar.update(1)
                prog.log(f"{describe(cells[i])}: recorded by another process meanwhile, skipped")
                return None
        return True

    def skipped(i) -> bool:
        if skip is None:
            return False
        ours = [r for r in store.records(start) if all(r.get(k) == v for k, v in context.items())]
        why = skip(cells[i], ours)
        if why:
            count[0] += 1
            bar.update(1)
            prog.log(f"{describe(cells[i])}: skipped, {why}")
        return bool(why)

    def take():
        """The next cell this process may run now (its lock held), or None."""
        while queue:
            i = queue.pop(0)
            if skipped(i):
                continue
            got = claim(i)
            if got:
                return i
            if got is False:
                waiting.append(i)
        for i in list(waiting):
            got = claim(i)
            if got is False:
                continue
            waiting.remove(i)
            if got:
                return i
        return None

    def wait_note():
        if not told[0]:
            pids = sorted({p for i in waiting if (p := CellLock.holder(lock_dir, keys[i])) is not None})
            prog.log(f"sweep: {len(waiting)} cell(s) are being trained by another process"
                     + (f" (pid {', '.join(map(str, pids))})" if pids else "")
                     + f" on {store.path.parent}; waiting for them (Ctrl-C stops this process only)")
            told[0] = True

    def stopped(saved: list[str]) -> Interrupted:
        from ..training.control import resume_hint

        what = f"{len(saved)} running cell(s) saved where they were" if saved else "no cell was running"
        return Interrupted(f"interrupted: {count[0]} of {len(mine)} cells finished in this run, {what}; "
                           + resume_hint())

    pool = workers > 1 and mode in ("local", "auto") and info.world_size == 1 and len(mine) > 1
    guard = stop_on_sigint() if info.world_size == 1 else contextlib.nullcontext()
    token = _SPREAD.set(mode == "spread")
    try:
        with guard:
            if pool:
                _run_pool(cells, run_fn, describe, prog, workers, len(mine), take, waiting, finish, release,
                          wait_note, stopped)
            else:
                while True:
                    i = take()
                    if i is None:
                        if not waiting:
                            break
                        wait_note()
                        time.sleep(0.5)
                        continue
                    try:
                        result, seconds = _timed(run_fn, cells[i], prog, describe(cells[i]))
                        finish(i, result, seconds)
                    except Interrupted as e:
                        raise stopped([str(e)]) from None
                    except KeyboardInterrupt:
                        raise stopped([]) from None
                    finally:
                        release(i)
    finally:
        _SPREAD.reset(token)
        for i in list(held):
            release(i)
        bar.close()
    if info.world_size > 1 and mode != "local":
        barrier()
    by_key = {r["key"]: r for r in store.records(start)}
    return [by_key[k] for k in keys if k in by_key]


def _run_pool(cells, run_fn, describe, prog, workers, n_mine, take, waiting, finish, release, wait_note, stopped):
    """run_sweep's worker-process loop: at most `workers` cells submitted at a time (each holding
    its lock), records written by this process as cells finish."""
    import concurrent.futures as cf
    import multiprocessing as mp

    sub = "none" if prog.mode in ("tqdm", "none") else "plain"
    ex = cf.ProcessPoolExecutor(max_workers=min(workers, n_mine), mp_context=mp.get_context("spawn"),
                                initializer=worker_init, initargs=(os.getpid(),))
    running: dict = {}
    try:
        while True:
            while len(running) < workers:
                i = take()
                if i is None:
                    break
                running[ex.submit(_timed, run_fn, cells[i], sub, describe(cells[i]))] = i
            if not running:
                if not waiting:
                    break
                wait_note()
                time.sleep(0.5)
                continue
            done, _ = cf.wait(running, timeout=1.0, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                i = running.pop(fut)
                try:
                    result, seconds = fut.result()
                    finish(i, result, seconds)
                finally:
                    release(i)
    except (KeyboardInterrupt, Interrupted) as e:
        saved = [str(e)] if isinstance(e, Interrupted) else []
        saved += _stop_workers(ex, running, finish, release)
        raise stopped(saved) from None
    except BaseException:
        _kill_workers(ex)
        raise
    finally:
        _join_at_exit(getattr(ex, "_executor_manager_thread", None))
        ex.shutdown(wait=False, cancel_futures=True)


_UNJOINED: list = []  # manager threads of pools shut down without waiting
_EXIT_HOOK = [False]  # whether _join_unjoined is registered


def _join_at_exit(manager) -> None:
    """Join a pool's manager thread at interpreter exit, before concurrent.futures' own exit hook.

    The pool is shut down without waiting (a Ctrl-C's closing line must not wait for the workers'
    interpreters to end). At exit, CPython ≤ 3.11's `concurrent.futures.process._python_exit` wakes
    every live manager thread through a pipe that the thread may be closing at that moment ("OSError:
    Bad file descriptor" printed from threading._shutdown: one run in six of the Ctrl-C test in CI on
    3.11.7). A manager joined first has closed its pipe and marked it closed, so the wake-up is skipped.
    threading's exit hooks run in reverse order of registration, so this one, registered after
    concurrent.futures.process's (imported by the pool), runs first."""
    import threading

    if manager is None:
        return
    if not _EXIT_HOOK[0]:
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # (not CPython: nothing to work around)
            return
        register(_join_unjoined)
        _EXIT_HOOK[0] = True
    _UNJOINED.append(manager)


def _join_unjoined() -> None:
    while _UNJOINED:
        _UNJOINED.pop().join()


def _worker_pids(ex) -> list[int]:
    return [p.pid for p in list((getattr(ex, "_processes", None) or {}).values()) if p.pid]


def _stop_workers(ex, running: dict, finish, release) -> list[str]:
    """Send SIGINT to every worker, then collect the running cells: the finished ones are recorded,
    the interrupted ones return what they saved. A second SIGINT kills the workers at once."""
    import signal

    for pid in _worker_pids(ex):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)
    saved = []
    try:
        for fut, i in list(running.items()):
            try:
                result, seconds = fut.result()
                finish(i, result, seconds)
            except Interrupted as e:
                saved.append(str(e))
            except Exception as e:  # noqa: BLE001 - a broken cell must not hide the interruption
                saved.append(f"a cell failed while stopping ({type(e).__name__}: {e})")
            finally:
                release(i)
                running.pop(fut, None)
    except KeyboardInterrupt:
        _kill_workers(ex)
    return saved


def _kill_workers(ex) -> None:
    for p in list((getattr(ex, "_processes", {}) or {}).values()):
        with contextlib.suppress(Exception):
            p.kill()


def _timed(run_fn, cell, progress, desc):
    if stop_requested():  # (a worker asked to stop before this cell began)
        raise Interrupted(f"{desc}: not started")
    t0 = time.perf_counter()
    result = run_fn(cell, progress=progress, desc=desc)
    return result, time.perf_counter() - t0


def _fields(cell) -> dict:
    return dataclasses.asdict(cell) if dataclasses.is_dataclass(cell) else dict(cell)


def best_over(records: Iterable[dict], over: Sequence[str] = ("lr",), fields: Sequence[str] | None = None,
              metric: str = "accuracy") -> list[dict]:
    """The best record (max `metric`) of every configuration, a configuration being the values of
    `fields` (default: every field of the records' cells except those in `over`, and except the
    results). Keeps the first-seen order of configurations; the winning record gets
    "best_<over[0]>" set to its value of over[0]."""
    records = list(records)
    if not records:
        return []
    result_keys = {"key", "accuracy", "final_accuracy", "best_epoch", "epochs_run", "stopped_early", "history",
                   "params", "state_bytes", "steps", "train_seconds", "resumed_from", "rank", "wall_seconds",
                   "cpu_numerics", "cuda_graph", "cuda_graph_note", "followup"}
    if fields is None:
        fields = [k for k in records[0] if k not in result_keys and k not in over]
    def score(r):
        v = r.get(metric)
        return float("-inf") if v is None or (isinstance(v, float) and math.isnan(v)) else v

    best: dict[tuple, dict] = {}
    for r in records:
        k = tuple(json.dumps(r.get(f), sort_keys=True) for f in fields)
        if k not in best or score(r) > score(best[k]):
            best[k] = r
    out = []
    for r in best.values():
        r = dict(r)
        if over:
            r[f"best_{over[0]}"] = r.get(over[0])
        out.append(r)
    return out
