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

Parallelism (torchrun, `fastweights.training.distributed`): "ddp" (DistributedDataParallel) or "fsdp"
(FSDP2: `fully_shard` on every block, then on the model). Checkpoints hold full (gathered)
model and optimizer states (`torch.distributed.checkpoint.state_dict`), written by rank 0 to
`checkpoint.pt.tmp` and renamed, so a kill at any moment leaves the previous checkpoint whole.
Resume: the run restarts from the checkpoint's step with its model, optimizer, schedule and
RNG states; the data order is a function of the step, so no sample is repeated or skipped, and
log lines written after that checkpoint (by the killed run) are dropped from log.jsonl.

Outputs in `out`: checkpoint.pt, model/ (`LM.save_pretrained` + the tokenizer: loads with
`LM.from_pretrained` and `AutoModelForCausalLM`), log.jsonl (train records {step, loss, lr,
tokens, tokens_per_s, samples: [first, end)}, validation records {step, val_loss, val_ppl}),
loss.png (train and validation loss against step).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models import LM, LMConfig
from ..training import step as training_step
from ..training.checkpoint import atomic_save, rng_state, set_rng_state
from ..training.distributed import all_reduce_sum, barrier, dist_info, init_distributed, is_distributed
from ..training.progress import make_progress
from .config import PretrainConfig
from .data import IGNORE_INDEX, DataError, Windows, load_tokenizer, read_stream, split_stream

__all__ = ["train", "lr_factor", "CHECKPOINT", "LOG", "PLOT", "MODEL_DIR"]

CHECKPOINT, LOG, PLOT, MODEL_DIR = "checkpoint.pt", "log.jsonl", "loss.png", "model"
# settings a resumed run must share with its checkpoint (they fix the data order and the model)
_RESUME_KEYS = ("data", "tokenizer", "model", "seq_len", "batch_size", "seed", "val_fraction", "steps", "lr",
                "min_lr", "warmup")


def lr_factor(cfg: PretrainConfig, step: int) -> float:
    """lr_step / lr of the run: linear warm-up over warmup_steps, then a cosine to min_lr at the last
    step (`fastweights.training.step.lr_factor`)."""
    return training_step.lr_factor(step, total=cfg.steps, warmup=cfg.warmup_steps(), floor=cfg.min_lr / cfg.lr)


def _lm_config(cfg: PretrainConfig, vocab: int) -> LMConfig:
    fields = dict(cfg.model)
    fields.setdefault("vocab_size", -(-vocab // 64) * 64)
    if fields["vocab_size"] < vocab:
        raise DataError(f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {vocab}")
    return LMConfig.from_dict(fields)


def _wrap(model: nn.Module, cfg: PretrainConfig, device: torch.device) -> nn.Module:
    if not is_distributed() or dist_info().world_size == 1:
        return model
    if cfg.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _no_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch (DDP and FSDP2)."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)

        @contextlib.contextmanager
        def resync():
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return resync()
    return contextlib.nullcontext()


def _loss_sum(model, batch, device, autocast) -> torch.Tensor:
    with autocast():
        logits = model(batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].to(device).flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


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
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


@torch.no_grad()
def _validate(model, windows: Windows, cfg: PretrainConfig, device, autocast) -> tuple[float, int]:
    info = dist_info()
    per_rank = max(1, cfg.batch_size // (info.world_size * cfg.grad_accum))  # the micro-batch
    n = min(len(windows), cfg.val_batches * cfg.batch_size)  # the first windows, whatever the ranks
    n -= n % info.world_size  # every rank runs as many forwards (FSDP gathers in each one)
    total, count = 0.0, 0
    mine = list(range(info.rank, n, info.world_size))
    was = model.training
    model.eval()
    for i in range(0, len(mine), per_rank):
        batch = windows.batch(mine[i:i + per_rank])
        total += _loss_sum(model, batch, device, autocast).item()
        count += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was)
    total, count = all_reduce_sum([total, float(count)], device="cpu")
    return (total / count if count else float("nan")), int(count)


def train(cfg: PretrainConfig, *, progress=None) -> dict:
    """Train (or resume) the run of `cfg` (see the module doc); the summary of the finished run."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    init_distributed(cfg.device)
    info = dist_info()
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", info.local_rank)
    R = info.world_size
    if cfg.batch_size % (R * cfg.grad_accum):
        raise DataError(f"batch_size={cfg.batch_size} must be a multiple of world_size × grad_accum = "
                        f"{R} × {cfg.grad_accum}")
    micro = cfg.batch_size // (R * cfg.grad_accum)
    prog = make_progress(cfg.progress if progress is None else progress)

    tok = load_tokenizer(cfg.tokenizer)
    stream = read_stream(cfg.data, tok)
    train_stream, val_stream = split_stream(stream, cfg.val_fraction, tok.eos_id)
    tw = Windows(train_stream, cfg.seq_len, tok.eos_id, seed=cfg.seed)
    vw = Windows(val_stream, cfg.seq_len, tok.eos_id, seed=cfg.seed)
    if len(tw) == 0:
        raise DataError(f"data: {len(train_stream)} training tokens hold no window of seq_len + 1 = "
                        f"{cfg.seq_len + 1} tokens; give more text or a smaller seq_len")
    lm_config = _lm_config(cfg, tok.vocab_size)

    torch.manual_seed(cfg.seed)
    base = LM(lm_config).to(device)
    model = _wrap(base, cfg, device)
    opt = training_step.adamw(base, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    autocast = functools.partial(training_step.autocast, cfg.dtype, device)

    out = Path(cfg.out)
    ckpt_path, log_path = out / CHECKPOINT, out / LOG
    start = 0
    if ckpt_path.is_file():
        try:
            ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise DataError(f"{ckpt_path} cannot be read ({e}); delete it to start the run afresh") from None
        mine, theirs = cfg.to_dict(), ck["config"]
        diff = [k for k in _RESUME_KEYS if mine.get(k) != theirs.get(k)]
        if diff:
            raise DataError(f"{ckpt_path} was written by a run with other settings ({', '.join(diff)}); "
                            "use another --out to start a new run")
        _load_states(model, opt, ck["model"], ck["optim"])
        sched.load_state_dict(ck["sched"])
        set_rng_state(ck["rng"])
        start = int(ck["step"])
        prog.log(f"resuming {out} at step {start}")
    history = _read_log(log_path, start)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w", encoding="utf-8") as f:  # drop what a killed run logged after its checkpoint
            f.writelines(json.dumps(r) + "\n" for r in history)
            f.flush()
            os.fsync(f.fileno())
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
    barrier()

    def write(rec: dict):
        history.append(rec)
        if info.is_main:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def save(step: int):
        msd, osd = _full_states(model, opt)
        if info.is_main:
            atomic_save({"step": step, "model": msd, "optim": osd, "sched": sched.state_dict(),
                         "config": cfg.to_dict(), "lm_config": lm_config.to_dict(), "rng": rng_state()}, ckpt_path)
            lm = LM(lm_config)
            lm.load_state_dict(msd)
            lm.save_pretrained(out / MODEL_DIR)
            if tok.hf is not None:
                tok.hf.save_pretrained(out / MODEL_DIR)
            else:
                with contextlib.suppress(ImportError):
                    from ..hf import ByteTokenizer

                    ByteTokenizer().save_pretrained(out / MODEL_DIR)
            _plot(history, out / PLOT)
        barrier()

    def validate(step: int):
        if len(vw) == 0:
            return
        loss, _ = _validate(model, vw, cfg, device, autocast)
        write({"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))})

    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = prog.bar(cfg.steps, "train", leave=True) if info.is_main and prog.mode == "tqdm" else None
    if bar is not None and start:
        bar.update(start)
    model.train()
    t0, done = time.perf_counter(), 0
    for s in range(start, cfg.steps):
        first = s * cfg.batch_size + info.rank * (cfg.batch_size // R)
        batches = [tw.batch([tw.order(j) for j in range(first + m * micro, first + (m + 1) * micro)])
                   for m in range(cfg.grad_accum)]
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        count = all_reduce_sum([float(local)], device="cpu")[0]
        total = 0.0
        for m, batch in enumerate(batches):
            with _no_sync(model, m == len(batches) - 1):
                loss = _loss_sum(model, batch, device, autocast) * (R / max(count, 1.0))
                loss.backward()
            total += loss.item() / R
        lr = training_step.optimizer_step(opt, sched, model.parameters(), cfg.grad_clip)
        done += 1
        step = s + 1
        train_loss = all_reduce_sum([total], device="cpu")[0]
        if step % cfg.log_every == 0 or step == cfg.steps:
            elapsed = time.perf_counter() - t0
            rec = {"step": step, "loss": train_loss, "lr": lr, "tokens": step * tokens_per_step,
                   "tokens_per_s": done * tokens_per_step / max(elapsed, 1e-9),
                   "samples": [s * cfg.batch_size, step * cfg.batch_size]}
            write(rec)
            if bar is not None:
                bar.update(cfg.log_every if step % cfg.log_every == 0 else step % cfg.log_every)
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            elif prog.mode == "plain" and info.is_main:
                prog.log(f"step {step}/{cfg.steps} loss {train_loss:.4f} lr {lr:.2e} "
                         f"{rec['tokens_per_s']:.0f} tok/s")
        if step % cfg.val_every == 0 or step == cfg.steps:
            validate(step)
        if step % cfg.save_every == 0 or step == cfg.steps:
            save(step)
    if bar is not None:
        bar.close()
    if start >= cfg.steps and info.is_main:
        prog.log(f"{out}: already trained for {cfg.steps} steps")
    last = next((r for r in reversed(history) if "loss" in r), {})
    val = next((r for r in reversed(history) if "val_loss" in r), {})
    return {"out": str(out), "steps": cfg.steps, "loss": last.get("loss"), "val_loss": val.get("val_loss"),
            "val_ppl": val.get("val_ppl"), "tokens_per_s": last.get("tokens_per_s"),
            "parameters": base.num_parameters()}
