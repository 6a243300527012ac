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
RNG states + history after every epoch (to ``p.tmp`` then `os.replace`, so a kill never leaves a
torn file) and resumes from it on start: at most the running epoch is lost. Batches are drawn from
a generator seeded by (seed, epoch), so a resumed run replays exactly what an uninterrupted run
does. A finished cell's checkpoint says so and is returned without training.

Sweeps: `ResultStore` is a JSONL file (one record per finished cell, flushed and fsynced);
`run_sweep(cells, store, run_fn)` skips the cells whose key is already there, so re-running a
sweep trains only what is missing. `best_over(records, over=("lr",))` keeps the best record of
every configuration (the papers report the max over the learning-rate sweep).

Distributed (torchrun; `fastweights.lab.distributed`): `run_sweep(mode="ddp")` trains each
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
import random
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

from .distributed import DistInfo, all_reduce_sum, barrier, dist_info, init_distributed, is_distributed

# run_sweep(mode="spread") sets this: the cells of a spread sweep train alone on their rank, so
# train_cell(ddp=None) must not wrap them in DDP although a process group is running
_SPREAD = contextvars.ContextVar("fastweights_spread_sweep", default=False)

__all__ = ["TrainConfig", "TrainError", "accuracy", "train_cell", "ResultStore", "run_sweep", "cell_key",
           "best_over", "Progress", "make_progress", "param_groups", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


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
class _Supervised(nn.Module):
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


def param_groups(model: nn.Module, weight_decay: float, decay_filter: str = "matrices") -> list[dict]:
    """AdamW groups: with "matrices", weight decay on ≥2-D parameters that are not embeddings;
    norms, biases, 1-D gate vectors, embeddings (the tied head included) and parameters marked
    `_no_weight_decay` (Mamba's A_log, dt_bias) get none. "all": one
    group, every parameter decayed (Zoology)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_filter == "all":
        return [{"params": params, "weight_decay": weight_decay}]
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in params:
        skip = p.dim() < 2 or id(p) in emb or getattr(p, "_no_weight_decay", False)
        (no_decay if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _lr_lambda(cfg: TrainConfig, total: int):
    warm = min(cfg.warmup_steps(total), total)
    floor = cfg.min_lr / cfg.lr

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total - warm)
        t = min(1.0, (step - warm) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.dtype in ("bfloat16", "float16"):
        return torch.autocast(device_type=device.type, dtype=_DTYPES[cfg.dtype])
    return contextlib.nullcontext()


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
    sup = net if isinstance(net, _Supervised) else _Supervised(net)
    if device is None:
        p = next(net.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    info = dist_info() if distributed else DistInfo()
    idx = torch.arange(inputs.shape[0])[info.rank::info.world_size]
    was_training = sup.training
    sup.eval()
    cfg_dtype = TrainConfig(dtype=dtype)
    correct = count = 0.0
    try:
        for s in range(0, idx.numel(), batch_size):
            b = idx[s:s + batch_size]
            x, y = inputs[b].to(device), labels[b].to(device)
            with _autocast(cfg_dtype, device):
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


# ------------------------------------------------------------------------------------------ progress
class Progress:
    """A progress reporter: tqdm bars, plain log lines, or nothing.

    bar(total, desc) -> handle with update(n), set(**postfix), close(); log(msg)."""

    def __init__(self, mode: str = "auto", stream=None):
        if mode not in ("auto", "tqdm", "plain", "none"):
            raise TrainError(f"progress must be 'auto', 'tqdm', 'plain' or 'none', got {mode!r}")
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "tqdm" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        if dist_info().rank != 0 and mode == "tqdm":
            mode = "plain"  # bars from several ranks garble one terminal
        self.mode = mode

    def log(self, msg: str) -> None:
        if self.mode == "none":
            return
        if self.mode == "tqdm":
            from tqdm import tqdm

            tqdm.write(msg, file=self.stream)
        else:
            prefix = f"[rank {dist_info().rank}] " if is_distributed() else ""
            print(prefix + msg, file=self.stream, flush=True)

    def bar(self, total: int, desc: str, *, leave: bool = False, position: int | None = None):
        if self.mode == "tqdm":
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, leave=leave, position=position, file=self.stream,
                        dynamic_ncols=True)
        return _NullBar()


class _NullBar:
    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def set_description(self, *a, **k):
        pass

    def close(self):
        pass


def make_progress(progress) -> Progress:
    """A Progress from a mode string, an existing Progress, None ("auto") or False ("none")."""
    if isinstance(progress, Progress):
        return progress
    if progress is None:
        return Progress("auto")
    if progress is False:
        return Progress("none")
    return Progress(progress)


# ------------------------------------------------------------------------------------------ checkpoints
def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state_all(st["cuda"])


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def train_cell(lm_config, train_pair, test_pair, cfg: TrainConfig, *, checkpoint_path=None, progress=None,
               model_fn: Callable[[Any], nn.Module] | None = None, ddp: bool | None = None,
               on_epoch: Callable[[int, dict], None] | None = None, desc: str = "cell") -> dict:
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

    Returns {"accuracy": best eval accuracy, "final_accuracy", "best_epoch", "epochs_run",
    "stopped_early", "history": [{"epoch", "loss", "accuracy", "lr", "seconds"}...], "params",
    "state_bytes" (model.state_size(1) when the model has one), "steps", "train_seconds",
    "resumed_from" (epochs already done when the call started)}.
    """
    if not isinstance(cfg, TrainConfig):
        raise TrainError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
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
    sup = _Supervised(model)
    net: nn.Module = sup
    if use_ddp and world > 1:
        net = nn.parallel.DistributedDataParallel(sup, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay, cfg.decay_filter), lr=cfg.lr, betas=cfg.betas)

    n_train = x_tr.shape[0]
    per_rank_n = n_train // world  # every rank takes the same count (DDP needs equal step counts)
    per_rank_bs = max(1, cfg.batch_size // world)
    steps_per_epoch = math.ceil(per_rank_n / per_rank_bs)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg, total_steps))

    history: list[dict] = []
    start_epoch, best, best_epoch, finished, stopped, train_seconds = 0, float("-inf"), -1, False, False, 0.0
    if ckpt is not None and ckpt.exists():
        st = _load_checkpoint(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        _set_rng_state(st["rng"])
        history = list(st["history"])
        start_epoch = st["epoch"]
        best, best_epoch = st["best"], st["best_epoch"]
        finished, stopped = st["finished"], st["stopped_early"]
        train_seconds = st.get("train_seconds", 0.0)
        prog.log(f"{desc}: resumed from {ckpt} after epoch {start_epoch}")
    resumed_from = start_epoch

    eval_bs = cfg.eval_batch_size or cfg.batch_size
    bar = None if finished else prog.bar((cfg.epochs - start_epoch) * steps_per_epoch, desc)
    epoch = start_epoch
    while not finished and epoch < cfg.epochs:
        t0 = time.perf_counter()
        net.train()
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(n_train, generator=g)[: per_rank_n * world]
        mine = perm[rank::world]  # [per_rank_n] this rank's examples for the epoch
        loss_sum, loss_n = 0.0, 0
        for s in range(steps_per_epoch):
            b = mine[s * per_rank_bs:(s + 1) * per_rank_bs]
            x, y = x_tr[b].to(device, non_blocking=True), y_tr[b].to(device, non_blocking=True)
            with _autocast(cfg, device):
                logits, tgt, _ = net(x, y)
                loss = F.cross_entropy(logits.float(), tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            lv = loss.item()
            if not math.isfinite(lv) and not (use_ddp and world > 1):  # (under DDP every rank must go on)
                prog.log(f"{desc}: non-finite loss at epoch {epoch + 1} step {s + 1}; stopping the cell")
                stopped = True
                break
            loss_sum += lv
            loss_n += 1
            bar.update(1)
            if s % 10 == 0:
                bar.set_postfix(loss=f"{lv:.3f}", refresh=False)
        if use_ddp and world > 1:  # the epoch's mean loss over all ranks' batches
            loss_sum, loss_n = all_reduce_sum([loss_sum, loss_n], device=device if device.type == "cuda" else "cpu")
        acc = accuracy(sup, x_te, y_te, eval_bs, reduction=cfg.accuracy, device=device, dtype=cfg.dtype,
                       distributed=use_ddp and world > 1)
        if not math.isfinite(acc):
            acc = 0.0
        seconds = time.perf_counter() - t0
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
        if ckpt is not None:
            if rank == 0:
                _atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "scheduler": sched.state_dict(), "rng": _rng_state(), "epoch": epoch,
                              "history": history, "best": best, "best_epoch": best_epoch, "finished": finished,
                              "stopped_early": stopped, "train_seconds": train_seconds,
                              "train_config": cfg.to_dict()}, ckpt)
            if use_ddp and world > 1:
                barrier()
        if on_epoch is not None:
            on_epoch(epoch, entry)
    if bar is not None:
        bar.close()
    return {"accuracy": best if history else float("nan"),
            "final_accuracy": history[-1]["accuracy"] if history else float("nan"),
            "best_epoch": best_epoch, "epochs_run": len(history), "stopped_early": stopped,
            "history": history, "params": n_params, "state_bytes": state_bytes,
            "steps": steps_per_epoch * len(history), "train_seconds": round(train_seconds, 3),
            "resumed_from": resumed_from}


# ------------------------------------------------------------------------------------------ results
def cell_key(cell) -> str:
    """A stable string key of a cell: the JSON of its fields (sorted), with its type name."""
    if dataclasses.is_dataclass(cell):
        fields = dataclasses.asdict(cell)
        name = type(cell).__name__
    elif isinstance(cell, dict):
        fields, name = dict(cell), "dict"
    else:
        raise TrainError(f"a cell must be a dataclass or a dict, got {type(cell).__name__}")
    return name + json.dumps(fields, sort_keys=True, default=str)


class ResultStore:
    """Results of a sweep as a JSONL file: one JSON object per finished cell, each with its "key".

    append(record): writes one line, flushed and fsynced, under an exclusive file lock (so several
    ranks may append to one file). records(): every complete record (a torn last line, from a kill
    mid-write, is ignored). done(key): whether a record with that key exists."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    def keys(self) -> set[str]:
        return {r["key"] for r in self.records() if "key" in r}

    def done(self, key) -> bool:
        if not isinstance(key, str):
            key = cell_key(key)
        return key in self.keys()

    def append(self, record: dict) -> None:
        line = json.dumps(record, default=_json_default) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            try:
                import fcntl

                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            except (ImportError, OSError):  # pragma: no cover - no flock on this platform
                fcntl = None
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            finally:
                if fcntl is not None:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)


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
              workers: int = 1) -> list[dict]:
    """Run every cell not yet in `store` and return all of the store's records for these cells.

    run_fn(cell, progress=Progress, desc=str) -> dict: trains one cell (typically through
    `train_cell`) and returns its result; the stored record is {"key", **fields of the cell,
    **result, "rank"}. Cells already in the store are skipped (re-running a finished sweep trains
    nothing).

    mode: "local" (one process), "ddp" (every rank runs every cell, the model data-parallel;
    rank 0 writes), "spread" (cell i on rank i % world_size; every rank writes its own records
    under the store's file lock), "auto" ("spread" under torchrun, else "local"). `device` picks the
    process group's backend under torchrun (nccl for CUDA, else gloo). `workers` > 1 (local mode
    only) runs that many cells at once in spawned worker processes (`run_fn` and the cells must
    pickle; set each worker's torch threads inside run_fn); the parent writes the records as
    cells finish, and the workers log plain lines (none when the parent draws tqdm bars).
    The sweep shows a progress bar over cells (tqdm) or one line per cell (plain)."""
    if mode not in ("auto", "local", "ddp", "spread"):
        raise TrainError(f"mode must be 'auto', 'local', 'ddp' or 'spread', got {mode!r}")
    info = init_distributed(device) if mode != "local" else dist_info()
    if mode == "auto":
        mode = "spread" if info.world_size > 1 else "local"
    prog = make_progress(progress)
    describe = describe or (lambda c: cell_key(c))
    keys = [cell_key(c) for c in cells]
    done = store.keys()
    todo = [i for i, k in enumerate(keys) if k not in done]
    if mode == "spread":
        mine = [i for i in todo if i % info.world_size == info.rank]
    else:
        mine = todo
    prog.log(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(mine)} to run here"
             + (f" (mode {mode}, rank {info.rank}/{info.world_size})" if info.world_size > 1 else ""))
    bar = prog.bar(len(mine), "sweep", leave=True, position=0)
    t_sweep = time.perf_counter()

    def finish(j, i, result, seconds):
        rec = {"key": keys[i], **_fields(cells[i]), **result, "rank": info.rank, "wall_seconds": round(seconds, 3)}
        if mode != "ddp" or info.rank == 0:
            store.append(rec)
        bar.update(1)
        acc = result.get("accuracy")
        msg = f"[{j}/{len(mine)}] {describe(cells[i])}: "
        msg += f"accuracy {acc:.4f}" if isinstance(acc, float) else "done"
        prog.log(msg + f" ({seconds:.1f}s, sweep {time.perf_counter() - t_sweep:.0f}s)")

    if workers > 1 and mode in ("local", "auto") and info.world_size == 1 and len(mine) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        sub = "none" if prog.mode in ("tqdm", "none") else "plain"
        with cf.ProcessPoolExecutor(max_workers=min(workers, len(mine)), mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(_timed, run_fn, cells[i], sub, describe(cells[i])): i for i in mine}
            for j, fut in enumerate(cf.as_completed(futs), 1):
                result, seconds = fut.result()
                finish(j, futs[fut], result, seconds)
    else:
        token = _SPREAD.set(mode == "spread")
        try:
            for j, i in enumerate(mine, 1):
                result, seconds = _timed(run_fn, cells[i], prog, describe(cells[i]))
                finish(j, i, result, seconds)
        finally:
            _SPREAD.reset(token)
    bar.close()
    if info.world_size > 1 and mode != "local":
        barrier()
    by_key = {r["key"]: r for r in store.records() if "key" in r}
    return [by_key[k] for k in keys if k in by_key]


def _timed(run_fn, cell, progress, desc):
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
                   "params", "state_bytes", "steps", "train_seconds", "resumed_from", "rank", "wall_seconds"}
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
