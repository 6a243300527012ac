"""Stacked training (issue 37, "Cost"): the lr × seed variants of one cell trained together in one process.

A lab model is tiny (d_model 16–256, 2 layers): one run leaves a GPU mostly idle. The N variants of a cell — the
same model config, each its own lr and seed — are stepped together: their parameters stacked along a leading
variant axis (`torch.func.stack_module_state`), one vmapped forward + backward per step
(`torch.func.vmap(torch.func.grad_and_value(...))` over `torch.func.functional_call` of the cell's model) and one
vectorised AdamW (`StackedAdamW`) for all of them.

    train_stacked(lm_config, variants, ...)   variants: [(train_pair, test_pair, TrainConfig)] -> [result]
    StackedAdamW                              torch.optim.AdamW over [V, ...] tensors with an lr per variant
    stack_support(model_fn, lm_config, ...)   None when the model runs under vmap + grad, else why not

What every variant gets is what `train.train_cell` gives its (lr, seed) alone (equal to rounding: a vmapped
matmul sums in another order), step for step:

- init: `torch.manual_seed(seed)` then `model_fn(lm_config)` (`.double()` for float64), as train_cell;
- data: each variant its own (train, test) pair (an MQAR cell's data depend on its seed: `mqar.cell_data`) and
  its own order, the generator seeded by (seed, epoch) exactly as train_cell's;
- loss: the cross-entropy over the supervised positions, taken at fixed-shape [B, m] gathered positions
  (`graph.supervised_slots`, the spare slots' targets ignored: the same mean as train_cell's boolean indexing,
  padded to the most any variant has), on `logits.float()` as train_cell;
- optimizer: AdamW with the variant's lr, the cell's betas, eps 1e-8, weight decay per parameter as
  `training.step.param_groups` decides, the per-step schedule `lr_factor` (its floor min_lr / lr per variant),
  gradient clipping of each variant's own global norm when grad_clip is set;
- evaluation: after every epoch, each variant's weights are copied into its own model and scored by
  `train.accuracy` (the same function train_cell calls); early stopping, a non-finite loss (the variant stops
  after that step, its epoch's loss the mean of the steps before), the best accuracy: per variant. A finished
  variant leaves the stack (its tensors are dropped: it stops changing and costs nothing) and its result is
  handed to `on_result` at once, so a sweep records it before the others finish.

Returned per variant: train_cell's result keys ("accuracy", "final_accuracy", "best_epoch", "epochs_run",
"stopped_early", "history", "params", "state_bytes", "steps", "train_seconds", "resumed_from" 0, "cuda_graph"
False) and, in `models`, the trained nn.Module (its final weights).

Which models stack: those whose training forward runs under `torch.func` transforms (`stack_support`). Measured
with the zoo on CPU (torch paths): every zoo model but MesaNet. What it took: the chunk paths' `_Exp` and
`_ContiguousGrad` are in torch.func's form (`setup_context`, `generate_vmap_rule`); under torch.func the
recompute checkpoints (the mixer's gated output projection, the mini-batch memories' Newton–Schulz) are skipped
(`chunkwise.common.under_functorch`: saved-tensor hooks are not supported by `torch.func.grad`) and the diagonal
decay's scores (GLA, KDA) take a functional form (`chunkwise.common._diagonal_scores_functional`: its written-out
backward, `_DiagonalScores`, has no vmap rule). MesaNet's implicit-gradient CG solve (`chunkwise.mesa._CGSolve`)
has none either: its cells train one at a time (`run_stacked_sweep` says so per group).

Not here (train_cell has them): checkpoints (a killed stacked group loses the running group's unfinished variants
— the finished ones are recorded — and a re-run trains the missing variants again from the start), DDP, CUDA
graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..training.control import Interrupted, stop_on_sigint, stop_requested, training
from ..training.progress import make_progress
from ..training.step import autocast, lr_factor, param_groups
from .graph import supervised_slots
from .train import (
    _SPREAD,
    IGNORE_INDEX,
    Supervised,
    TrainConfig,
    TrainError,
    _check_pair,
    _default_model,
    _fields,
    _jsonish,
    _lm_state_bytes,
    _timed,
    accuracy,
    cell_key,
)

__all__ = ["StackedAdamW", "train_stacked", "stack_support", "run_stacked_sweep", "VARIANT_FIELDS"]

#: The TrainConfig fields in which the variants of one stacked group may differ.
VARIANT_FIELDS = ("lr", "seed")


class StackedAdamW:
    """AdamW (torch.optim.AdamW's update, amsgrad off) over stacked parameters: params {name: [V, ...]}, each
    variant v with its own lr (`lrs` [V], times the step's schedule factors), the shared betas and eps, and a
    weight decay per parameter name (`weight_decay`: {name: float}). `step(grads, factors)` updates in place;
    `keep(index)` drops the variants not in `index` from every tensor."""

    def __init__(self, params: dict[str, torch.Tensor], lrs: torch.Tensor, *, betas: tuple[float, float],
                 weight_decay: dict[str, float], eps: float = 1e-8):
        self.params, self.betas, self.eps, self.weight_decay = params, tuple(betas), float(eps), dict(weight_decay)
        if lrs.dtype != torch.float64:
            raise TrainError(f"StackedAdamW: lrs must be float64 (as AdamW's python floats), got {lrs.dtype}")
        self.lrs = lrs  # [V]
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], factors: torch.Tensor) -> None:
        """grads {name: [V, ...]}; factors [V]: the schedule's lr factor of each variant at this step."""
        b1, b2 = self.betas
        self.steps += 1
        bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        lr = self.lrs * factors.to(self.lrs.device, torch.float64)  # [V], float64 as AdamW's python floats
        for n, p in self.params.items():
            g = grads[n]
            shape = (-1,) + (1,) * (p.dim() - 1)
            wd = self.weight_decay.get(n, 0.0)
            if wd:
                p.mul_((1 - lr * wd).to(p.dtype).view(shape))
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
            p.addcmul_(m / denom, (-lr / bc1).to(p.dtype).view(shape))

    def keep(self, index: torch.Tensor) -> None:
        """Keep the variants `index` ([V'] positions into the current stack), in that order."""
        for d in (self.params, self.exp_avg, self.exp_avg_sq):
            for n in d:
                d[n] = d[n].index_select(0, index.to(d[n].device))
        self.lrs = self.lrs.index_select(0, index.to(self.lrs.device))


class _At(nn.Module):
    """(inputs [B, T], positions [B, m]) -> logits [B, m, vocab]: `Supervised.at`, as a forward for
    `functional_call`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.sup = Supervised(model)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.sup.at(inputs, positions)


def _build(model_fn, lm_config, cfg: TrainConfig, device) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = (model_fn or _default_model)(lm_config)
    if cfg.dtype == "float64":
        model = model.double()
    return model.to(device)


def _stacked_loss(base: _At, dtype: str, device):
    """loss(params, buffers, x [B, T], pos [B, m], tgt [B, m]) -> the cross-entropy of one variant (a scalar)."""

    def loss(params, buffers, x, pos, tgt):
        with autocast(dtype, device):
            logits = torch.func.functional_call(base, (params, buffers), (x, pos))  # [B, m, vocab]
            return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=IGNORE_INDEX)

    return loss


def _check_variants(variants) -> list[tuple]:
    if not isinstance(variants, (list, tuple)) or not variants:
        raise TrainError("variants must be a non-empty list of (train_pair, test_pair, TrainConfig)")
    out = []
    for i, v in enumerate(variants):
        if not (isinstance(v, (list, tuple)) and len(v) == 3 and isinstance(v[2], TrainConfig)):
            raise TrainError(f"variants[{i}] must be (train_pair, test_pair, TrainConfig)")
        out.append((_check_pair(v[0], f"variants[{i}] train_pair"), _check_pair(v[1], f"variants[{i}] test_pair"),
                    v[2]))
    ref = {k: w for k, w in out[0][2].to_dict().items() if k not in VARIANT_FIELDS}
    for i, (tr, _, cfg) in enumerate(out):
        diff = [k for k, w in cfg.to_dict().items() if k not in VARIANT_FIELDS and ref[k] != w]
        if diff:
            raise TrainError(f"variants[{i}]'s TrainConfig differs from variants[0]'s in {', '.join(diff)}: stacked "
                             f"variants may differ only in {', '.join(VARIANT_FIELDS)}")
        if tr[0].shape != out[0][0][0].shape:
            raise TrainError(f"variants[{i}] train_pair is {list(tr[0].shape)}, variants[0]'s "
                             f"{list(out[0][0][0].shape)}: stacked variants step through batches of one shape")
    return out


def stack_support(model_fn, lm_config, *, dtype: str = "float32", device="cpu", seq_len: int = 16) -> str | None:
    """None when a model of `lm_config` trains under `torch.func.vmap(grad(...))` (two variants, one example of
    length `seq_len`, one forward + backward), else the one-line reason it does not."""
    cfg = TrainConfig(dtype=dtype, device=str(device))
    models = [_build(model_fn, lm_config, dataclasses.replace(cfg, seed=s), device) for s in (0, 1)]
    base = _At(models[0])
    params, buffers = _stacked_state(models)
    vocab = int(getattr(getattr(models[0], "config", None), "vocab_size", 2))
    x = torch.randint(0, vocab, (2, 1, seq_len), device=device)
    pos = torch.arange(seq_len, device=device).expand(2, 1, seq_len)
    try:
        torch.func.vmap(torch.func.grad(_stacked_loss(base, dtype, device)))(params, buffers, x, pos, x)
    except Exception as e:  # noqa: BLE001 - whatever stops the transforms is the reason
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return None


def _stacked_state(models: Sequence[nn.Module]) -> tuple[dict, dict]:
    """({"sup.model.<name>": [V, ...]}, buffers alike) of the models, detached copies."""
    params, buffers = torch.func.stack_module_state(list(models))
    params = {"sup.model." + n: p.detach().clone() for n, p in params.items()}
    buffers = {"sup.model." + n: b for n, b in buffers.items()}
    return params, buffers


def train_stacked(lm_config, variants, *, model_fn: Callable[[Any], nn.Module] | None = None,
                  on_result: Callable[[int, dict, nn.Module], None] | None = None, progress=None,
                  desc: str = "stack") -> tuple[list[dict], list[nn.Module]]:
    """Train the variants [(train_pair, test_pair, TrainConfig)] of one model together (see the module doc); the
    TrainConfigs may differ only in `VARIANT_FIELDS`, the train sets only in their values. Returns (results,
    models): per variant train_cell's result and its trained model. on_result(i, result, model) is called as
    variant i finishes. A stop request (SIGINT under `stop_on_sigint`) raises `Interrupted` at the next step
    (the variants finished so far have been handed to on_result; the others are lost)."""
    variants = _check_variants(variants)
    cfg0 = variants[0][2]
    V = len(variants)
    device = torch.device(cfg0.device)
    prog = make_progress(progress)
    models = [_build(model_fn, lm_config, cfg, device) for _, _, cfg in variants]
    base = _At(_build(model_fn, lm_config, cfg0, device))
    base.train()
    names = {id(p): "sup.model." + n for n, p in models[0].named_parameters()}
    wd = {names[id(p)]: g["weight_decay"] for g in param_groups(models[0], cfg0.weight_decay, cfg0.decay_filter)
          for p in g["params"]}
    params, buffers = _stacked_state(models)
    lrs = torch.tensor([cfg.lr for _, _, cfg in variants], dtype=torch.float64, device=device)  # [V]
    opt = StackedAdamW(params, lrs, betas=cfg0.betas, weight_decay=wd)
    n_params = sum(p.numel() for p in models[0].parameters())
    state_bytes = _lm_state_bytes(models[0])

    # data: every variant's train set (on the host, as train_cell's: a step's batches are copied over) with its
    # supervised slots, padded to one m
    slots = [supervised_slots(tr[1]) for tr, _, _ in variants]
    m = max(s[0].shape[1] for s in slots)
    xs = [tr[0] for tr, _, _ in variants]  # V × [N, T]
    pos = [F.pad(p, (0, m - p.shape[1])) for p, _ in slots]  # V × [N, m]
    tgt = [F.pad(t, (0, m - t.shape[1]), value=IGNORE_INDEX) for _, t in slots]  # V × [N, m]
    n_train = xs[0].shape[0]
    bs = cfg0.batch_size
    steps_per_epoch = math.ceil(n_train / bs)
    total = steps_per_epoch * cfg0.epochs
    warm = cfg0.warmup_steps(total)
    floors = [cfg.min_lr / cfg.lr for _, _, cfg in variants]

    def factors(step: int, live: list[int]) -> torch.Tensor:  # [V'] the schedule's factor of each live variant
        return torch.tensor([lr_factor(step, total=total, warmup=warm, floor=floors[v], schedule=cfg0.schedule)
                             for v in live], dtype=torch.float64, device=device)

    grad_fn = torch.func.vmap(torch.func.grad_and_value(_stacked_loss(base, cfg0.dtype, device)))
    eval_bs = cfg0.eval_batch_size or cfg0.batch_size
    live = list(range(V))  # the variants still in the stack, in stack order
    hist: list[list[dict]] = [[] for _ in range(V)]
    best, best_epoch = [float("-inf")] * V, [-1] * V
    stopped, train_seconds = [False] * V, [0.0] * V
    results: list[dict | None] = [None] * V
    bar = prog.bar(total, desc)

    def finish(v: int, k: int) -> None:
        """Variant v (stack position k) is done: its weights into its model, its result out."""
        with torch.no_grad():
            for n, p in models[v].named_parameters():
                p.copy_(opt.params["sup.model." + n][k])
        h = hist[v]
        results[v] = {"accuracy": best[v] if h else float("nan"), "final_accuracy": h[-1]["accuracy"] if h else
                      float("nan"), "best_epoch": best_epoch[v], "epochs_run": len(h), "stopped_early": stopped[v],
                      "history": h, "params": n_params, "state_bytes": state_bytes, "steps": steps_per_epoch * len(h),
                      "train_seconds": round(train_seconds[v], 3), "resumed_from": 0, "cuda_graph": False}
        if on_result is not None:
            on_result(v, results[v], models[v])

    def end_epoch(v: int, k: int, epoch: int, sums: tuple[float, int], seconds: float, step: int) -> bool:
        """The epoch's end for variant v: evaluate, the history entry; True when v is finished."""
        with torch.no_grad():
            for n, p in models[v].named_parameters():
                p.copy_(opt.params["sup.model." + n][k])
        _, (x_te, y_te), cfg = variants[v]
        acc = accuracy(models[v], x_te, y_te, eval_bs, reduction=cfg.accuracy, device=device, dtype=cfg.dtype)
        if not math.isfinite(acc):
            acc = 0.0
        train_seconds[v] += seconds
        if acc > best[v]:
            best[v], best_epoch[v] = acc, epoch + 1
        lr_now = cfg.lr * lr_factor(step, total=total, warmup=warm, floor=floors[v], schedule=cfg.schedule)
        hist[v].append({"epoch": epoch + 1, "loss": sums[0] / max(1, sums[1]), "accuracy": acc, "lr": lr_now,
                        "seconds": round(seconds, 3)})
        if cfg.early_stop is not None and acc > cfg.early_stop:
            stopped[v] = True
        prog.log(f"{desc} [{v}] lr={cfg.lr:.3g} seed={cfg.seed}: epoch {epoch + 1}/{cfg.epochs} loss "
                 f"{hist[v][-1]['loss']:.4f} acc {acc:.4f} (best {best[v]:.4f})")
        return stopped[v] or epoch + 1 >= cfg.epochs

    with training():
        for epoch in range(cfg0.epochs):
            t0 = time.perf_counter()
            perms = {v: torch.randperm(n_train, generator=torch.Generator().manual_seed(
                variants[v][2].seed * 1_000_003 + epoch)) for v in live}
            sums = {v: (0.0, 0) for v in live}
            for i in range(steps_per_epoch):
                if stop_requested():
                    bar.close()
                    raise Interrupted(f"{desc}: stopped at epoch {epoch + 1} step {i}/{steps_per_epoch}; "
                                      f"{sum(r is not None for r in results)} of {V} variants finished")
                idx = [perms[v][i * bs:(i + 1) * bs] for v in live]
                x, p, t = (torch.stack([src[v][b] for v, b in zip(live, idx)]).to(device, non_blocking=True)
                           for src in (xs, pos, tgt))  # [V', b, T], [V', b, m], [V', b, m]
                grads, losses = grad_fn(opt.params, buffers, x, p, t)
                step = epoch * steps_per_epoch + i
                if cfg0.grad_clip is not None:
                    _clip(grads, cfg0.grad_clip)
                opt.step(grads, factors(step, live))
                bar.update(1)
                done = []
                for k, (v, lv) in enumerate(zip(live, losses.tolist())):
                    if not math.isfinite(lv):  # train_cell: the variant stops after this step, its epoch ends
                        prog.log(f"{desc} [{v}]: non-finite loss at epoch {epoch + 1} step {i + 1}; stopping it")
                        stopped[v] = True
                        end_epoch(v, k, epoch, sums[v], time.perf_counter() - t0, step + 1)
                        done.append(k)
                    else:
                        sums[v] = (sums[v][0] + lv, sums[v][1] + 1)
                live = _drop(live, done, opt, buffers, finish)
                if not live:
                    break
            if not live:
                break
            seconds = time.perf_counter() - t0
            step = (epoch + 1) * steps_per_epoch
            done = [k for k, v in enumerate(live) if end_epoch(v, k, epoch, sums[v], seconds, step)]
            live = _drop(live, done, opt, buffers, finish)
            if not live:
                break
    bar.close()
    return results, models


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ per variant: each variant's gradients scaled by min(1, max_norm / (its norm + 1e-6))."""
    norms = torch.stack([g.flatten(1).norm(2, dim=1) for g in grads.values()], dim=1).norm(2, dim=1)  # [V]
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.dtype).view((-1,) + (1,) * (g.dim() - 1)))


def _drop(live: list[int], done: list[int], opt: StackedAdamW, buffers: dict, finish) -> list[int]:
    """Finish the variants at stack positions `done` and take them out of the stack; the live variants left."""
    if not done:
        return live
    for k in done:
        finish(live[k], k)
    keep = [k for k in range(len(live)) if k not in done]
    if keep:
        index = torch.tensor(keep, dtype=torch.long)
        opt.keep(index)
        for n in buffers:
            buffers[n] = buffers[n].index_select(0, index.to(buffers[n].device))
    return [live[k] for k in keep]


# ------------------------------------------------------------------------------------------ sweeps
def group_key(cell) -> str:
    """The cell without its `VARIANT_FIELDS`: the cells of one key train stacked."""
    fields = {k: v for k, v in _fields(cell).items() if k not in VARIANT_FIELDS}
    return type(cell).__name__ + json.dumps(fields, sort_keys=True, default=str)


def run_stacked_sweep(cells: Sequence, store, *, run_fn, run_group, stackable, mode: str = "auto", progress=None,
                      describe: Callable[[Any], str] | None = None, device: str = "cpu", context: dict | None = None,
                      fresh: bool = False, skip=None) -> list[dict]:
    """`train.run_sweep` (local and spread modes) with the cells grouped by `group_key`: a group's missing
    cells train together, `run_group(cells, on_result, progress=...)` calling on_result(i, result) as cells[i]
    finishes, which writes its record at once (the record `run_sweep` writes: key, fields, context, result,
    rank, wall_seconds — the group's time until that cell finished). A group of one cell, or one whose model
    `stackable(cell)` refuses (it returns why: logged), runs cell by cell through `run_fn`. Keys, the store,
    locks (`control.CellLock`: a cell another process holds is waited for and then trained alone if still
    missing), `fresh`, `skip` and the SIGINT stop are run_sweep's; spread mode gives group g to rank
    g % world. Returns the store's records of `cells`."""
    from ..training.distributed import barrier, dist_info, process_group
    from .control import CellLock

    if mode not in ("auto", "local", "spread"):
        raise TrainError(f"stacked sweeps run in mode 'auto', 'local' or 'spread', got {mode!r}")
    group_ctx = contextlib.nullcontext(dist_info()) if mode == "local" else \
        process_group(device, together=(Interrupted,))
    with group_ctx as info:
        return _stacked(cells, store, run_fn, run_group, stackable, info,
                        "spread" if mode != "local" and info.world_size > 1 else "local",
                        make_progress(progress), describe or cell_key, _jsonish(dict(context or {})), fresh, skip,
                        CellLock, barrier)


def _stacked(cells, store, run_fn, run_group, stackable, info, mode, prog, describe, context, fresh, skip, CellLock,
             barrier) -> list[dict]:
    suffix = ("|" + json.dumps(context, sort_keys=True)) if context else ""
    keys = [cell_key(c) + suffix for c in cells]
    start = store.size() if fresh else 0
    done = store.keys(start)
    if store.warning() and info.rank == 0:
        print(store.warning(), file=sys.stderr, flush=True)
    todo = [i for i, k in enumerate(keys) if k not in done]
    groups: dict[str, list[int]] = {}
    for i in todo:
        groups.setdefault(group_key(cells[i]), []).append(i)
    mine = [g for n, g in enumerate(groups.values()) if n % info.world_size == info.rank]
    n_mine = sum(len(g) for g in mine)
    prog.log(f"sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {n_mine} to run here in "
             f"{len(mine)} stacked group(s)"
             + (f" (rank {info.rank}/{info.world_size})" if info.world_size > 1 else ""))
    lock_dir = store.path.parent / f".{store.path.name}.locks"
    t_sweep = time.perf_counter()
    count, held, waiting = [0], {}, []

    def finish(i: int, result: dict, seconds: float) -> None:
        store.append({"key": keys[i], **_fields(cells[i]), **context, **result, "rank": info.rank,
                      "wall_seconds": round(seconds, 3)})
        count[0] += 1
        acc = result.get("accuracy")
        prog.log(f"[{count[0]}/{n_mine}] {describe(cells[i])}: "
                 + (f"accuracy {acc:.4f}" if isinstance(acc, float) else "done")
                 + f" ({seconds:.1f}s, sweep {time.perf_counter() - t_sweep:.0f}s)")

    def claim(i: int) -> bool | None:
        """True: this process holds cell i's lock and i has no record; False: another process holds it; None:
        recorded meanwhile or skipped."""
        lk = CellLock.acquire(lock_dir, keys[i])
        if lk is None:
            return False
        held[i] = lk
        if store.done(keys[i], start):
            release(i)
            return None
        if skip is not None:
            why = skip(cells[i], [r for r in store.records(start) if all(r.get(k) == v for k, v in context.items())])
            if why:
                prog.log(f"{describe(cells[i])}: skipped, {why}")
                release(i)
                return None
        return True

    def release(i: int) -> None:
        lk = held.pop(i, None)
        if lk is not None:
            lk.release()

    def alone(i: int) -> None:
        result, seconds = _timed(run_fn, cells[i], prog, describe(cells[i]))
        finish(i, result, seconds)

    def run(group: list[int]) -> None:
        if len(group) == 1:
            return alone(group[0])
        why = stackable(cells[group[0]])
        if why:
            prog.log(f"{describe(cells[group[0]])} and {len(group) - 1} more variant(s): trained one at a time, "
                     f"the model does not stack ({why})")
            for i in group:
                alone(i)
            return
        t0 = time.perf_counter()
        run_group([cells[i] for i in group], lambda j, res: finish(group[j], res, time.perf_counter() - t0),
                  progress=prog)

    guard = stop_on_sigint() if info.world_size == 1 else contextlib.nullcontext()
    token = _SPREAD.set(mode == "spread")
    try:
        with guard:
            try:
                for group in mine:
                    ours = []
                    for i in group:
                        got = claim(i)
                        if got:
                            ours.append(i)
                        elif got is False:
                            waiting.append(i)
                    try:
                        if ours:
                            run(ours)
                    finally:
                        for i in ours:
                            release(i)
                told = False
                while waiting:  # cells another process held: trained alone here if still missing once free
                    for i in list(waiting):
                        got = claim(i)
                        if got is False:
                            continue
                        waiting.remove(i)
                        if got:
                            try:
                                alone(i)
                            finally:
                                release(i)
                    if waiting:
                        if not told:
                            prog.log(f"sweep: {len(waiting)} cell(s) are being trained by another process; waiting")
                            told = True
                        time.sleep(0.5)
            except (Interrupted, KeyboardInterrupt) as e:
                from ..training.control import resume_hint

                raise Interrupted(f"interrupted: {count[0]} of {n_mine} cells finished in this run"
                                  + (f" ({e})" if isinstance(e, Interrupted) else "") + "; " + resume_hint()) from None
    finally:
        _SPREAD.reset(token)
        for i in list(held):
            release(i)
    if info.world_size > 1 and mode == "spread":
        barrier()
    by_key = {r["key"]: r for r in store.records(start)}
    return [by_key[k] for k in keys if k in by_key]

