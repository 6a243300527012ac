"""The pretraining loop of `fastweights train` (one process, or every rank under torchrun).

Step s (s = 0 … steps − 1) reads the global samples j ∈ [sB, (s + 1)B) (B = batch_size,
`fastweights.pretrain.data.Windows` maps j to a window); rank r of R takes the contiguous block
[sB + rB/R, sB + (r + 1)B/R) and splits it into grad_accum micro-batches. The loss is the mean
cross-entropy over every supervised token of the global batch (each micro-batch's summed loss is
divided by the all-reduced token count), so the gradient does not depend on R or grad_accum.

    loss = Σ_{supervised t} −log p(label_t | document so far) / #supervised        (packed rows,
    position_ids restarting after each end-of-text token: no layer crosses a document)

The optimizer step is `fastweights.training.step`'s, the lab's sweeps' own: AdamW (no decay on
norms, biases, gate vectors, the embedding) with lr_s = lr · (s + 1)/warm for s < warm, then
min_lr + (lr − min_lr)·½(1 + cos πt), t = (s − warm)/(steps − warm); bf16 autocast (fp32
weights); clipping of the global grad norm.

The step cycle — micro-batches, the optimizer step, the stop check at the step boundary, validation every
val_every steps, a checkpoint every save_every, a record every step — is `fastweights.training.loop.run`, the
lab's cells' own; this module gives it its hooks (the batches, the loss, the stop's all-reduce and save, the
record, validation, the save).

Parallelism (torchrun, `fastweights.training.loop.wrap`, `fastweights.training.distributed`): "ddp"
(DistributedDataParallel) or "fsdp" (FSDP2: `fully_shard` on every block, then on the model). Checkpoints hold full
(gathered) model and optimizer states (`torch.distributed.checkpoint.state_dict`), written by rank 0 to a
temporary file and renamed, so a kill at any moment leaves the previous checkpoint whole.
Resume: the run restarts from the checkpoint's step with its model, optimizer, schedule and
RNG states; the data order is a function of the step, so no sample is repeated or skipped, and
log lines written after that checkpoint (by the killed run) are dropped from log.jsonl. A
checkpoint is resumed only by a run with the same settings (`_RESUME_KEYS`) and the same data
(`fastweights.pretrain.data.data_key`: files, sizes, content hashes, tokenizer, seq_len); either
mismatch is refused naming what changed, unless `fresh=True` (`--fresh`) discards the old run.
`steps` may grow: a run (finished or not) resumed with more steps goes on to the new last step, its
learning rate following the schedule of the new number of steps from the checkpoint's step on
(for a finished cosine: back up from min_lr to that schedule's value there); fewer steps than the
checkpoint holds is refused.

Gradient checkpointing (`grad_checkpoint`): `LM.set_gradient_checkpointing` on the model, so each
block keeps its input and recomputes its activations in backward (the same loss and gradients);
recorded in the run's config, and a resume that does not set it keeps the checkpoint's.

`init_from` (a `save_pretrained` directory, or a run directory's model/): a new run — step 0, a
fresh optimizer and schedule, its own `out` — from those weights, with the checkpoint's model
config (model fields that differ from it are refused, and so is a tokenizer with more ids than
the model embeds).

CUDA graphs (`cuda_graph`): True, False or "auto" (the gpu-125m preset's), decided once in `train` before any check
reads it (`config.resolve_cuda_graph`: "auto" is on for one CUDA process without grad_checkpoint or context
parallelism, off elsewhere, never an error; True keeps its refusals); the run uses that bool throughout, prints the
decision before its first step, and its config.json and checkpoint keep the value asked for ("auto" stays "auto":
a resume decides again, e.g. under another world size; a resume keeping the checkpoint's grad_checkpoint turns
"auto" off). The returned summary's "cuda_graph" says whether the steps were graphed.

Before any work: the device is usable, `out` is a writable directory (not a file) and its disk
holds a checkpoint; `out` is not empty, not the current directory, not a directory holding something
other than an earlier run (a saved model, a repository), and does not overlap `init_from`
(`fastweights.pretrain.rundir`). Stopping: SIGINT or SIGTERM during training
saves a checkpoint at the next step boundary — every rank stops at the same step (the stop flag
rides on the step's all-reduce) — and raises `Interrupted` (`fastweights train` prints one line
and exits 130). A write that fails mid-run (a full disk) raises `OutputError` on every rank, naming
the file and the step; the last good checkpoint is left whole and named.

Outputs in `out`: checkpoint.pt, model/ (`LM.save_pretrained` + the tokenizer: loads with
`LM.from_pretrained` and `AutoModelForCausalLM`), log.jsonl (train records {step, loss, lr,
tokens, tokens_per_s, tokens_per_s_steady, mfu, samples: [first, end)}, validation records {step,
val_loss, val_ppl}), loss.png (train and validation loss against step). tokens_per_s is the running
average since the process started (the first steps' compiles included); tokens_per_s_steady the rate
over the last ≤ 50 steps after this process's first `steady_skip(cfg)` (two; graphed also the graph's
eager warm-up steps and its capture: the figure is the replayed steps'; None before then), and mfu the model FLOPs
utilisation at that rate (None on the CPU, an unlisted GPU, or a mixer without a FLOP count):
`training.throughput`. The plain progress line shows both figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models import LM, LMConfig
from ..training import loop as training_loop
from ..training import step as training_step
from ..training.checkpoint import atomic_save, rng_state, set_rng_state
from ..training.control import Interrupted, resume_hint, stop_on_signals, stop_requested
from ..training.distributed import Layout, all_reduce_sum, dist_info, launch_world_size, process_group, rank_layout
from ..training.loop import wrap
from ..training.progress import make_progress
from ..training.throughput import StepClock, mfu, model_flops_per_token, peak_flops
from .config import ConfigFileError, PretrainConfig, resolve_cuda_graph
from .data import (
    IGNORE_INDEX,
    DataError,
    Windows,
    data_key,
    data_key_diff,
    load_tokenizer,
    read_stream,
    save_byte_tokenizer,
    split_stream,
)
from .rundir import (
    CHECKPOINT,
    LOG,
    MODEL_DIR,
    PLOT,
    OutputError,
    check_out,
    check_space,
    checkpoint_bytes,
    replace_dir,
    write_text,
)

__all__ = ["train", "lr_factor", "steady_skip", "run_lm_config"]
# settings a resumed run must share with its checkpoint (they fix the data order and the model); "steps"
# may grow (the run goes on to the new number of steps), never fall below the checkpoint's step
_RESUME_KEYS = ("data", "tokenizer", "model", "seq_len", "batch_size", "seed", "val_fraction", "steps", "lr",
                "min_lr", "warmup", "init_from", "text_key", "documents")


def lr_factor(cfg: PretrainConfig, step: int) -> float:
    """lr_step / lr of the run: linear warm-up over warmup_steps, then a cosine to min_lr at the last
    step (`fastweights.training.step.lr_factor`)."""
    return training_step.lr_factor(step, total=cfg.steps, warmup=cfg.warmup_steps(), floor=cfg.min_lr / cfg.lr)


def steady_skip(cfg: PretrainConfig) -> int:
    """The first steps of a process the steady tokens/s leaves out: 2 (the compiles and autotuning), and with
    cuda_graph the graph's WARMUP eager steps and the step that captures it (its rate is neither the eager nor the
    replayed one: counting them read 228k for a step that replays at 311k, r4s9 call 1). cfg as the run uses it:
    cuda_graph True or False ("auto" resolved by `resolve_cuda_graph`; ValueError otherwise)."""
    if cfg.cuda_graph == "auto":
        raise ValueError('steady_skip needs cuda_graph resolved to True or False (resolve_cuda_graph), got "auto"')
    if cfg.cuda_graph is not True:
        return 2
    from ..training.graphed import WARMUP

    return WARMUP + 1


def run_lm_config(cfg: PretrainConfig, tok) -> LMConfig:
    """The LMConfig a `fastweights train` run of `cfg` builds with tokenizer `tok`: the model fields, vocab_size the
    tokenizer's rounded up to a multiple of 64 unless given (DataError when given smaller)."""
    fields = dict(cfg.model)
    fields.setdefault("vocab_size", -(-tok.vocab_size // 64) * 64)
    if fields["vocab_size"] < tok.vocab_size:
        raise DataError(f"--model vocab_size={fields['vocab_size']} is smaller than the tokenizer's {tok.vocab_size} "
                        f"ids (--tokenizer {tok.name}: ids 0 … {tok.vocab_size - 1}, end-of-text {tok.eos_id}); "
                        "leave vocab_size out (the tokenizer's, rounded up to a multiple of 64) or raise it")
    return LMConfig.from_dict(fields)


def init_from_dir(spec) -> Path:
    """The model directory `--init-from` names: a `save_pretrained` directory (config.json and
    model.safetensors), or a `fastweights train` run directory, for its model/; ConfigFileError
    naming the flag otherwise."""
    from ..models.checkpoint import CONFIG_NAME, WEIGHTS_NAME

    p = Path(spec)
    if (p / WEIGHTS_NAME).is_file() and (p / CONFIG_NAME).is_file():
        return p
    if (p / MODEL_DIR / WEIGHTS_NAME).is_file() and (p / MODEL_DIR / CONFIG_NAME).is_file():
        return p / MODEL_DIR
    what = "no such directory" if not p.exists() else "not a directory" if not p.is_dir() else (
        f"holds no {CONFIG_NAME} and {WEIGHTS_NAME}, nor a {MODEL_DIR}/ with them")
    raise ConfigFileError(f"--init-from {spec}: {what}; expected a model directory written by save_pretrained "
                          f"({CONFIG_NAME} and {WEIGHTS_NAME}, e.g. a run's {MODEL_DIR}/) or a `fastweights train` "
                          "run directory")


def init_sources(init_from) -> tuple[Path, ...]:
    """The directories a run with `--init-from init_from` reads (the value, and the model directory it
    names): its --out may not overlap them (`rundir.check_out_use`)."""
    if init_from is None:
        return ()
    return (Path(init_from), init_from_dir(init_from))


def _init_model(cfg: PretrainConfig, tok) -> tuple[PretrainConfig, LM]:
    """--init-from: (cfg with the checkpoint's model fields, the loaded LM), after refusing model
    fields that differ from the checkpoint's and a tokenizer whose ids the model cannot embed."""
    from ..models import CheckpointError, ConfigError

    d = init_from_dir(cfg.init_from)
    try:
        src = LM.from_pretrained(d)
    except CheckpointError as e:
        raise ConfigFileError(f"--init-from {cfg.init_from}: {e}") from None
    theirs = src.config.to_dict()
    try:
        asked = LMConfig.from_dict({**theirs, **cfg.model}).to_dict()
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigFileError(f"--init-from {cfg.init_from}: --model {e}") from None
    conflict = [k for k in asked if asked[k] != theirs.get(k)]
    if conflict:
        k = conflict[0]
        raise ConfigFileError(f"--init-from {cfg.init_from}: the model comes from the checkpoint, but --model "
                              f"{k}={json.dumps(cfg.model.get(k, asked[k]))} conflicts with its {k}="
                              f"{json.dumps(theirs.get(k))}; leave --model out")
    V = src.config.vocab_size
    if tok.vocab_size > V:
        raise DataError(f"--init-from {cfg.init_from}: its model embeds {V} token ids, but --tokenizer {tok.name} "
                        f"has {tok.vocab_size} (end-of-text {tok.eos_id}); train with the tokenizer the model was "
                        "made for (--tokenizer DIR)")
    return dataclasses.replace(cfg, model=theirs), src


def _loss_sum(model, batch, device, autocast, layout: Layout) -> torch.Tensor:
    """Σ cross-entropy over the supervised tokens of `batch` ({input_ids, position_ids, labels}: [b, T] each;
    this rank's span of it under context parallelism: the spans' sums add up to the sequences')."""
    batch = layout.span(batch)
    extra = {"context": layout.context} if layout.context is not None else {}
    if batch.get("position_ids") is not None:  # (documents "joined": none, the window is one sequence)
        extra["position_ids"] = _to_device(batch["position_ids"], device)
    with autocast():
        logits = model(_to_device(batch["input_ids"], device), **extra)
    return F.cross_entropy(logits.float().flatten(0, 1), _to_device(batch["labels"], device).flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on `device` without a host–device sync: on CUDA copied from pinned memory with
    non_blocking (a copy from pageable memory returns only when it is done, i.e. after every kernel queued before
    it — one sync per tensor per micro-batch, which kept the host from running ahead of the GPU)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _full_states(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_states(model, opt, msd, osd):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))


def _read_log(path: Path, upto: int) -> list[dict]:
    """The records of log.jsonl with step ≤ upto (a torn last line, from a kill, is dropped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= upto:
            out.append(rec)
    return out


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss"]) for r in records if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        plt.close(fig)


@torch.no_grad()
def _validate(model, windows: Windows, cfg: PretrainConfig, device, autocast, layout: Layout) -> tuple[float, int]:
    per_rank = max(1, cfg.batch_size // (layout.dp * cfg.grad_accum))  # the micro-batch
    n = min(len(windows), cfg.val_batches * cfg.batch_size)  # the first windows, whatever the ranks
    n -= n % layout.dp  # every rank runs as many forwards (FSDP gathers in each one)
    total, count = 0.0, 0
    mine = list(range(layout.dp_rank, n, layout.dp))
    was = model.training
    model.eval()
    for i in range(0, len(mine), per_rank):
        batch = _windows_batch(windows, mine[i:i + per_rank], cfg)
        total += _loss_sum(model, batch, device, autocast, layout).item()
        count += int((layout.span(batch)["labels"] != IGNORE_INDEX).sum())
    model.train(was)
    total, count = all_reduce_sum([total, float(count)], device=_sync_device(device))
    return (total / count if count else float("nan")), int(count)


def _windows_batch(windows: Windows, idx: list[int], cfg: PretrainConfig) -> dict:
    """windows.batch(idx) ({input_ids, labels, position_ids} [len(idx), T]); documents "joined": position_ids None."""
    batch = windows.batch(idx)
    if cfg.documents == "joined":
        batch["position_ids"] = None
    return batch


def _sync_device(device: torch.device) -> torch.device:
    """Where the small all-reduces run: the training device on CUDA (NCCL has no CPU tensors)."""
    return device if device.type == "cuda" else torch.device("cpu")


def _check_device(cfg: PretrainConfig) -> None:
    try:
        dev = torch.device(cfg.device)
    except (RuntimeError, TypeError):
        raise ConfigFileError(f"--device {cfg.device!r} is not a device string (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigFileError(f"--device {cfg.device}: this machine has no usable CUDA device "
                              "(torch.cuda.is_available() is False); use --device cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigFileError(f"--device {cfg.device}: MPS is not available here; use --device cpu")


def _check_graph(cfg: PretrainConfig) -> None:
    """--cuda-graph captures CUDA work: a CUDA device (the config checked its other needs)."""
    if cfg.cuda_graph is True and torch.device(cfg.device).type != "cuda":
        raise ConfigFileError(f"--cuda-graph replays CUDA work: it needs --device cuda, got {cfg.device!r}")


def _check_parallel(cfg: PretrainConfig) -> None:
    """--parallel fsdp shards the model over the processes torchrun starts; with one process there is
    nothing to shard over, and running unsharded instead would be a silent change of what was asked.
    --context-parallel N needs a world that N divides, and a sequence of at least N tokens."""
    R = dist_info().world_size
    if cfg.cuda_graph is True and R > 1:
        raise ConfigFileError(f"--cuda-graph runs one process (DDP's and FSDP's hooks communicate inside the step, "
                              f"which the graph cannot capture); this run has {R}: leave out --cuda-graph or torchrun")
    if cfg.parallel == "fsdp" and R <= 1:
        raise ConfigFileError("--parallel fsdp shards the model over several processes, but this run has one "
                              "(not launched by torchrun, or WORLD_SIZE=1); launch it with torchrun "
                              "--nproc_per_node N, or leave out --parallel fsdp")
    N = cfg.context_parallel
    if N > 1 and R % N:
        raise ConfigFileError(f"--context-parallel {N} splits each sequence over {N} ranks, but this run has {R} "
                              f"process(es), not a multiple of {N}; launch it with torchrun --nproc_per_node "
                              f"{N} (or a multiple), or leave out --context-parallel")
    if N > cfg.seq_len:
        raise ConfigFileError(f"--context-parallel {N} is more ranks than --seq-len {cfg.seq_len} has tokens")


def _together(err: Exception | None, device, cls: type[Exception] = OutputError) -> None:
    """Every rank learns whether any rank failed (rank 0 checks and writes the run directory): this
    rank raises its own error; a rank without one raises `cls` pointing at rank 0's message, so
    every rank exits alike (one process: raises err if any)."""
    failed = all_reduce_sum([float(err is not None)], device=_sync_device(device))[0]
    if err is not None:
        raise err
    if failed:
        raise cls("another rank failed (rank 0 checks and writes the run directory: see its message)")


def _discard(out: Path) -> None:
    """--fresh: remove what an earlier run left in `out` (checkpoint, model, log, curve)."""
    for name in (CHECKPOINT, LOG, PLOT, "config.json"):
        (out / name).unlink(missing_ok=True)
    for name in (MODEL_DIR, MODEL_DIR + ".new", MODEL_DIR + ".old"):
        shutil.rmtree(out / name, ignore_errors=True)


def train(cfg: PretrainConfig, *, progress=None, fresh: bool = False) -> dict:
    """Train (or resume) the run of `cfg` (see the module doc); the summary of the finished run.

    fresh: discard the run directory's checkpoint, model, log and curve and start from step 0.
    Raises ConfigFileError / DataError (bad settings, data or --out, before any training),
    OutputError (the run directory could not be written mid-run; the last good checkpoint is
    kept) and `Interrupted` (SIGINT/SIGTERM: saved at the step boundary)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    _check_device(cfg)
    asked = cfg.cuda_graph  # (True, False or "auto": what config.json and the checkpoint keep)
    graphed, why = resolve_cuda_graph(cfg, launch_world_size())
    cfg = dataclasses.replace(cfg, cuda_graph=graphed)  # (from here on a bool: every check and use reads this)
    _check_graph(cfg)
    # (every rank raises these at one point: the group started here is still destroyed at exit after them)
    with process_group(cfg.device, together=(Interrupted, ConfigFileError, DataError, OutputError)):
        return _train_in_group(cfg, progress, fresh, _Graph(asked, why))


@dataclasses.dataclass(frozen=True)
class _Graph:
    """What the run was asked for (cuda_graph True, False or "auto": kept in config.json and the checkpoint, so a
    resume re-decides) and why it runs as it does (`resolve_cuda_graph`'s words, printed in the log header)."""

    asked: bool | str
    why: str


def _train_in_group(cfg: PretrainConfig, progress, fresh: bool, plan: _Graph) -> dict:
    _check_parallel(cfg)  # (after the group starts: dist_info() is 0/1 until it runs)
    info = dist_info()
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", info.local_rank)
    out = Path(cfg.out)
    err = None
    if info.is_main:  # (rank 0 writes the run directory)
        try:
            check_out(out, init_sources(cfg.init_from))
        except ConfigFileError as e:
            err = e
    _together(err, device, ConfigFileError)
    with stop_on_signals((signal.SIGINT, signal.SIGTERM), repeats="ignore" if info.world_size > 1 else "interrupt"):
        return _train(cfg, out, device, make_progress(cfg.progress if progress is None else progress), fresh, plan)


def _train(cfg: PretrainConfig, out: Path, device: torch.device, prog, fresh: bool, plan: _Graph) -> dict:
    info = dist_info()
    R = info.world_size
    layout = rank_layout(cfg.context_parallel)
    if cfg.batch_size % (layout.dp * cfg.grad_accum):
        raise DataError(f"batch_size={cfg.batch_size} must be a multiple of the data-parallel ranks × grad_accum = "
                        f"{layout.dp} × {cfg.grad_accum}" + (f" ({R} processes / --context-parallel {layout.cp})"
                                                            if layout.cp > 1 else ""))
    micro = cfg.batch_size // (layout.dp * cfg.grad_accum)
    sync = functools.partial(all_reduce_sum, device=_sync_device(device))

    tok = load_tokenizer(cfg.tokenizer)
    src = None
    if cfg.init_from is not None:
        cfg, src = _init_model(cfg, tok)
    stream = read_stream(cfg.data, tok, cfg.text_key)
    key = data_key(cfg.data, tok, cfg.seq_len, cfg.text_key)
    train_stream, val_stream = split_stream(stream, cfg.val_fraction, tok.eos_id)
    tw = Windows(train_stream, cfg.seq_len, tok.eos_id, seed=cfg.seed)
    vw = Windows(val_stream, cfg.seq_len, tok.eos_id, seed=cfg.seed)
    if len(tw) == 0:
        raise DataError(f"data: {len(train_stream)} training tokens hold no window of seq_len + 1 = "
                        f"{cfg.seq_len + 1} tokens; give more text or a smaller seq_len")
    lm_config = run_lm_config(cfg, tok)

    torch.manual_seed(cfg.seed)
    base = LM(lm_config)
    if src is not None:
        base.load_state_dict(src.state_dict())
        del src
    base = base.to(device)
    err = None
    if info.is_main:
        try:
            check_space(out, checkpoint_bytes(base.num_parameters()))
        except ConfigFileError as e:
            err = e
    _together(err, device, ConfigFileError)
    model = wrap(base, cfg.parallel, device, blocks=base.blocks)
    opt = training_step.adamw(base, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    autocast = functools.partial(training_step.autocast, cfg.dtype, device)

    ckpt_path, log_path = out / CHECKPOINT, out / LOG
    start = 0
    if fresh:
        if info.is_main:
            _discard(out)
    elif ckpt_path.is_file():
        try:
            ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise DataError(f"{ckpt_path} cannot be read ({e}); pass --fresh to start the run afresh") from None
        mine, theirs = cfg.to_dict(), ck["config"]
        diff = [k for k in _RESUME_KEYS if mine.get(k, PretrainConfig.__dataclass_fields__[k].default)
                != theirs.get(k, PretrainConfig.__dataclass_fields__[k].default) and k != "steps"]
        if diff:
            raise DataError(f"{ckpt_path} was written by a run with other settings ({', '.join(diff)}); "
                            "pass --fresh to discard it and start again, or use another --out")
        if cfg.steps < int(ck["step"]):
            raise DataError(f"{ckpt_path} holds step {ck['step']}, past --steps {cfg.steps}; give --steps ≥ "
                            f"{ck['step']} to go on, --fresh to discard it and start again, or another --out")
        changed = data_key_diff(ck["data_key"], key) if "data_key" in ck else [
            "the checkpoint records no data key (written before runs kept one)"]
        if changed:
            raise DataError(f"{ckpt_path} was trained on other data: {'; '.join(changed[:6])}"
                            f"{'; …' if len(changed) > 6 else ''}; pass --fresh to discard it and start again, "
                            "or use another --out")
        _load_states(model, opt, ck["model"], ck["optim"])
        sched.load_state_dict(ck["sched"])
        set_rng_state(ck["rng"])
        start = int(ck["step"])
        if cfg.steps != theirs.get("steps"):  # the schedule of the new number of steps from here on
            for g, base_lr in zip(opt.param_groups, sched.base_lrs):
                g["lr"] = base_lr * lr_factor(cfg, start)
            sched._last_lr = [g["lr"] for g in opt.param_groups]
            if info.is_main:
                prog.log(f"resuming {out} at step {start}, now for {cfg.steps} steps (it was run for "
                         f"{theirs.get('steps')}; the learning rate follows the schedule of {cfg.steps} steps from "
                         f"step {start} on)")
        else:
            prog.log(f"resuming {out} at step {start}")
        if cfg.grad_checkpoint is None:  # (a resume keeps the run's setting unless told otherwise)
            kept = bool(theirs.get("grad_checkpoint"))
            if kept and plan.asked == "auto" and cfg.cuda_graph:  # (decided again with the kept setting: off)
                plan = _Graph(plan.asked, "off (auto: the run being resumed uses grad_checkpoint, kept unless "
                                          "--no-grad-checkpoint, and its recomputation in backward is not captured)")
                cfg = dataclasses.replace(cfg, cuda_graph=False)
            cfg = dataclasses.replace(cfg, grad_checkpoint=kept)
    cfg = dataclasses.replace(cfg, grad_checkpoint=bool(cfg.grad_checkpoint))
    if info.is_main and (plan.asked is not False or cfg.cuda_graph):
        prog.log(f"cuda graph: {plan.why}")
    base.set_gradient_checkpointing(cfg.grad_checkpoint)
    stored = {**cfg.to_dict(), "cuda_graph": plan.asked}  # (config.json's and the checkpoint's: as asked)
    history = [] if fresh else _read_log(log_path, start)
    saved = {"checkpoint": start if start else None, "model": start if start else None}
    err = None
    if info.is_main:
        try:  # drop what a killed run logged after its checkpoint
            write_text(log_path, "".join(json.dumps(r) + "\n" for r in history))
            write_text(out / "config.json", json.dumps(stored, indent=2))
        except OSError as e:
            err = OutputError(f"--out {out}: cannot write {LOG} or config.json ({e.strerror or e}) before "
                              f"training; {_kept(ckpt_path, saved)}")
    _together(err, device)
    pending: list[OutputError] = []  # a failed log append on rank 0, raised on every rank at the next sync

    def failure(what: str, step: int, e: OSError, kept: dict) -> OutputError:
        return OutputError(f"--out {out}: writing {what} at step {step} failed ({e.strerror or e}); "
                           f"{_kept(ckpt_path, kept)}")

    def write(rec: dict):
        history.append(rec)
        if info.is_main and not pending:
            try:
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
            except OSError as e:
                pending.append(failure(LOG, rec["step"], e, saved))

    def save(step: int):
        """Every rank calls it; `saved` changes on every rank alike (it decides collective calls)."""
        msd, osd = _full_states(model, opt)  # (a collective under FSDP)
        if cfg.cuda_graph:  # saved as an eager run saves it, so that any run resumes it
            from ..training.graphed import eager_form

            osd = eager_form(osd)
        err = pending[0] if pending else None
        if info.is_main and err is None:
            what, now = CHECKPOINT, dict(saved)
            try:
                atomic_save({"step": step, "model": msd, "optim": osd, "sched": sched.state_dict(),
                             "config": stored, "lm_config": lm_config.to_dict(), "rng": rng_state(),
                             "data_key": key}, ckpt_path)
                now["checkpoint"], what = step, MODEL_DIR + "/"
                lm = LM(lm_config)
                lm.load_state_dict(msd)
                replace_dir(out / MODEL_DIR, lambda d: _save_model(lm, tok, d))
                now["model"], what = step, PLOT
                _plot(history, out / PLOT)
            except OSError as e:
                err = failure(what, step, e, now)
        _together(err, device)
        saved.update(checkpoint=step, model=step)

    def validate(step: int):
        if len(vw) == 0:
            return
        loss, _ = _validate(model, vw, cfg, device, autocast, layout)
        write({"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))})

    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = prog.bar(cfg.steps, "train", leave=True) if info.is_main and prog.mode == "tqdm" else None
    if bar is not None and start:
        bar.update(start)
    model.train()
    clock, speed = StepClock(tokens_per_step, skip=steady_skip(cfg)), _Speed(base, cfg, device, R)
    count = [1.0]  # the step's supervised tokens over all ranks (set at its boundary)

    def batches(s: int) -> list[dict]:
        """Step s's grad_accum micro-batches of this rank's block of the global samples (module doc)."""
        first = s * cfg.batch_size + layout.dp_rank * (cfg.batch_size // layout.dp)
        return [_windows_batch(tw, [tw.order(j) for j in range(first + m * micro, first + (m + 1) * micro)], cfg)
                for m in range(cfg.grad_accum)]

    def boundary(s: int, batches: list[dict]) -> bool:
        """One all-reduce: the step's token count, the stop flag, a failed log append (raised on every rank)."""
        local = sum(int((layout.span(b)["labels"] != IGNORE_INDEX).sum()) for b in batches)
        count[0], stop, failed = sync([float(local), float(stop_requested()), float(bool(pending))])
        if failed:
            _together(pending[0] if pending else None, device)
        return bool(stop)  # (every rank sees the same sum: all stop at step s)

    def interrupt(s: int):
        if s > (saved["checkpoint"] or 0):
            save(s)
        raise Interrupted(_stopped(s, cfg.steps, ckpt_path, saved))

    def loss(batch: dict) -> torch.Tensor:
        return _loss_sum(model, batch, device, autocast, layout) * (R / max(count[0], 1.0))

    def record(step: int, losses: list[float], lr: float):
        s = step - 1
        train_loss = sync([sum(v / R for v in losses)])[0]
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec = {"step": step, "loss": train_loss, "lr": lr, "tokens": step * tokens_per_step,
                   "tokens_per_s": clock.running, **speed.record(clock.steady),
                   "samples": [s * cfg.batch_size, step * cfg.batch_size]}
            write(rec)
            if bar is not None:
                bar.update(cfg.log_every if step % cfg.log_every == 0 else step % cfg.log_every)
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                steady=_speed_text(rec))
            elif prog.mode == "plain" and info.is_main:
                prog.log(f"step {step}/{cfg.steps} loss {train_loss:.4f} lr {lr:.2e} "
                         f"{rec['tokens_per_s']:.0f} tok/s (steady {_speed_text(rec)})")

    def most_documents() -> int:
        """The most documents any micro-batch of this run's steps (start … steps − 1) packs: the bound the graph's
        varlen sequences are sized by. micro × the most of one window is ≈ 3× more: 112 slots against 32 (14 steps)
        to 40 (20,000) at the gpu-125m preset on this repository's docs, each slot a program of every varlen launch
        and a state in its buffers. Each step's position_ids are still checked against it."""
        per, most = tw.documents(), 1
        for s in range(start, cfg.steps):
            first = s * cfg.batch_size
            idx = np.fromiter((tw.order(j) for j in range(first, first + cfg.batch_size)), np.int64, cfg.batch_size)
            most = max(most, int(per[idx].reshape(cfg.grad_accum, micro).sum(1).max()))
        return most

    graph = None
    if cfg.cuda_graph:  # packed documents: sized by the most any of the run's micro-batches holds
        docs = most_documents() if cfg.documents == "separate" else None
        graph = _GraphStep(cfg, base, opt, sched, micro, device, docs)
    hooks = training_loop.Hooks(batches=batches, loss=loss, boundary=boundary, interrupt=interrupt, record=record,
                                evaluate=validate, eval_every=cfg.val_every, save=save, save_every=cfg.save_every,
                                grad_clip=cfg.grad_clip, clock=clock, step=graph)
    clock.start()
    try:
        training_loop.run(hooks, model, opt, sched, start, cfg.steps)
    finally:
        if bar is not None:
            bar.close()
        if graph is not None:
            graph.close()
    if start >= cfg.steps and info.is_main:
        prog.log(f"{out}: already trained for {cfg.steps} steps")
    last = next((r for r in reversed(history) if "loss" in r), {})
    val = next((r for r in reversed(history) if "val_loss" in r), {})
    return {"out": str(out), "steps": cfg.steps, "loss": last.get("loss"), "val_loss": val.get("val_loss"),
            "val_ppl": val.get("val_ppl"), "tokens_per_s": last.get("tokens_per_s"),
            "tokens_per_s_steady": last.get("tokens_per_s_steady"), "mfu": last.get("mfu"),
            "parameters": base.num_parameters(), "cuda_graph": cfg.cuda_graph}


class _GraphStep:
    """`Hooks.step` of a --cuda-graph run: the step's micro-batches stacked into [M, b, T] and run by one
    `GraphedLMStep` (captured after its WARMUP eager steps, then replayed), the schedule advanced as
    `training.step.optimizer_step` does. The loss is `_loss_sum`'s over the step's supervised tokens. Documents
    "separate": the micro-batches' position_ids go in too, each packed into max_documents varlen sequences."""

    def __init__(self, cfg: PretrainConfig, lm: LM, opt, sched, micro: int, device: torch.device,
                 max_documents: int | None = None):
        from ..training.graphed import GraphedLMStep

        dt = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        self.g = GraphedLMStep(lm, opt, (cfg.grad_accum, micro, cfg.seq_len + 1), autocast_dtype=dt,
                               grad_clip=cfg.grad_clip, capture=device.type == "cuda", max_documents=max_documents)
        self.sched, self.pin = sched, device.type == "cuda"

    def __call__(self, s: int, batches: list[dict]) -> tuple[list[float], float]:
        def stacked(key):  # [M, b, T]; pinned on CUDA: its copy into the static buffer then does not wait on the GPU
            t = torch.stack([b[key] for b in batches])
            return t.pin_memory() if self.pin else t

        pos = stacked("position_ids") if self.g.max_documents is not None else None
        loss = self.g.step_labeled(stacked("input_ids"), stacked("labels"), pos)
        lr = self.sched.get_last_lr()[0]
        self.sched.step()
        return [float(loss)], lr

    def close(self) -> None:
        self.g.close()


class _Speed:
    """The steady-state speed fields of a train record (`training.throughput`): the model's FLOPs per token at
    the run's seq_len and the peak of its devices (world size × one device's, None on the CPU / unlisted)."""

    def __init__(self, lm: LM, cfg: PretrainConfig, device: torch.device, world_size: int):
        self.flops = model_flops_per_token(lm, cfg.seq_len)
        self.peak = peak_flops(device, cfg.dtype)
        self.devices = world_size

    def record(self, steady: float | None) -> dict:
        """{"tokens_per_s_steady": tokens/s after the first steps (None before), "mfu": fraction or None}."""
        return {"tokens_per_s_steady": steady, "mfu": mfu(steady, self.flops, self.peak, self.devices)}


def _speed_text(rec: dict) -> str:
    """'12345 tok/s, MFU 41.2%' / '12345 tok/s, MFU —' / '—' (the steady figure not yet known)."""
    if rec["tokens_per_s_steady"] is None:
        return "—"
    util = "—" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    return f"{rec['tokens_per_s_steady']:.0f} tok/s, MFU {util}"


def _save_model(lm: LM, tok, directory: Path) -> None:
    """`LM.save_pretrained` and the tokenizer (for bytes, ByteTokenizer's files, written without transformers)."""
    lm.save_pretrained(directory)
    if tok.hf is not None:
        tok.hf.save_pretrained(directory)
    else:
        save_byte_tokenizer(directory)


def _kept(ckpt_path: Path, saved: dict) -> str:
    """What a failed write left, and how to go on."""
    if saved["checkpoint"] is None:
        return "no checkpoint had been written yet (nothing to resume); free space and run the command again"
    model = "" if saved["model"] == saved["checkpoint"] else (
        f" ({MODEL_DIR}/ holds step {saved['model']})" if saved["model"] is not None else f" ({MODEL_DIR}/ was not "
                                                                                          "written)")
    return (f"the last good checkpoint is intact: {ckpt_path} holds step {saved['checkpoint']}{model}; free space "
            f"and run the same command again to resume")


def _stopped(step: int, steps: int, ckpt_path: Path, saved: dict) -> str:
    """The one line an interrupted run prints."""
    if saved["checkpoint"] is None:
        return f"interrupted before the first step of {steps}: nothing to save; run the same command again to start"
    return (f"interrupted at step {step} of {steps}: {ckpt_path} holds step {saved['checkpoint']}; "
            + resume_hint())


