"""One training loop: the step cycle that `fastweights train` (`fastweights.pretrain.loop`) and the lab's cells
(`fastweights.lab.train.train_cell`) both run. What differs between them — where a step's batches come from, the
loss, what a stop saves, what is evaluated, logged and saved — is passed in as `Hooks`; the cycle, gradient
accumulation over micro-batches, the optimizer step, the stop check at the step boundary and the throughput clock
are written here once, and so are the model wrappers of the ranks (`wrap`: DDP or FSDP2; `no_sync`).

    run(hooks, model, opt, sched, start, steps):               (s: the 0-based optimizer step; step = s + 1 once done)
        for s in range(start, steps):
            micro = hooks.batches(s)                            this rank's micro-batches of step s (any objects)
            if hooks.boundary(s, micro):                        a stop was requested (default: control.stop_requested)
                hooks.interrupt(s); return s                    ... save at step s and raise Interrupted
            losses = hooks.step(s, micro)                       (when given: the whole step, e.g. a CUDA graph replay)
                  or for m, b in enumerate(micro):              (else) accumulate, no_sync on all but the last:
                         loss_m = hooks.loss(b); loss_m.backward()      loss_m: a scalar tensor (already scaled)
                     lr = training.step.optimizer_step(...)             clip, AdamW, zero the grads, lr schedule
            clock.step()                                        steady-rate tokens/s (training.throughput.StepClock)
            if hooks.record(step, losses, lr) is False: return step     the per-step log record; False ends the run
            end = due(step, eval_every) and hooks.evaluate(step) is False      periodic evaluation
            if due(step, save_every): hooks.save(step)                          periodic checkpoint
            if end: return step
        return steps

    due(step, every) = every > 0 and (step % every == 0 or step == steps)

Every rank runs the same cycle: the hooks that talk to the other ranks (a stop flag riding on an all-reduce, the
loss's token count) are the caller's. `run` marks the loop as training (`control.training()`), so that the first
SIGINT under `control.stop_on_signals` only requests a stop, seen at the next boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import step as training_step
from .control import stop_requested, training
from .distributed import dist_info, is_distributed

__all__ = ["Hooks", "run", "no_sync", "wrap"]


def _no_hook(*args) -> None:
    return None


@dataclass
class Hooks:
    """What a training loop does at each point of the cycle (module doc); every hook gets 0-based `s` (the step
    about to run) or 1-based `step` (the steps done).

    batches(s) -> micro: this rank's micro-batches of step s (a sequence of any objects; len ≥ 1).
    loss(b) -> scalar tensor whose backward gives b's share of the step's gradient (e.g. a summed loss divided
        by the step's token count); `step`'s losses hold loss(b).item() of each micro-batch, in order.
    boundary(s, micro) -> bool: stop before step s (default: `control.stop_requested()`).
    interrupt(s): the stop: save at step s and raise `Interrupted` (if it returns, `run` returns s).
    step(s, micro) -> (losses: list[float], lr: float): replaces accumulation + optimizer step (None: those).
    record(step, losses, lr) -> False to end the run after this step (anything else goes on).
    evaluate(step) -> False to end the run after this step's save; called every eval_every steps and after the
        last (eval_every 0: never).
    save(step): called every save_every steps and after the last (save_every 0: never), after evaluate.
    grad_clip: the max global grad norm of the optimizer step (None: no clipping).
    clock: a `throughput.StepClock` (or anything with step()) ticked after each optimizer step, or None.
    """

    batches: Callable[[int], Sequence[Any]]
    loss: Callable[[Any], torch.Tensor] | None = None
    boundary: Callable[[int, Sequence[Any]], bool] = lambda s, micro: stop_requested()
    interrupt: Callable[[int], None] = _no_hook
    step: Callable[[int, Sequence[Any]], tuple[list[float], float]] | None = None
    record: Callable[[int, list[float], float], bool | None] = _no_hook
    evaluate: Callable[[int], bool | None] = _no_hook
    eval_every: int = 0
    save: Callable[[int], None] = _no_hook
    save_every: int = 0
    grad_clip: float | None = None
    clock: Any = None


def _due(step: int, every: int, steps: int) -> bool:
    return every > 0 and (step % every == 0 or step == steps)


def accumulate(hooks: Hooks, model: nn.Module, opt: torch.optim.Optimizer, sched,
               micro: Sequence[Any]) -> tuple[list[float], float]:
    """One optimizer step over the micro-batches `micro`: backward of hooks.loss(b) for each (the gradient sync of
    DDP / FSDP2 skipped on all but the last), then `training.step.optimizer_step` (clip to hooks.grad_clip, step,
    clear, schedule). Returns ([loss(b).item() for b in micro], the learning rate the step used).

    The losses are read once, after the optimizer step is queued: one host–device sync a step, not one a
    micro-batch (a sync empties the queue of launches the host had built up ahead of the GPU, and a
    launch-bound fast-weight LM then waits on the host at every micro-batch's start)."""
    losses = []
    for m, b in enumerate(micro):
        with no_sync(model, m == len(micro) - 1):
            loss = hooks.loss(b)
            loss.backward()
        losses.append(loss.detach())
    lr = training_step.optimizer_step(opt, sched, model.parameters(), hooks.grad_clip)
    return torch.stack(losses).tolist(), lr


def run(hooks: Hooks, model: nn.Module, opt: torch.optim.Optimizer, sched, start: int, steps: int) -> int:
    """Run steps start … steps − 1 of the cycle in the module doc; the number of steps done when it returned
    (`steps`, or fewer when a hook ended the run). model: the trained module as the ranks see it (DDP / FSDP2
    wrapped, `wrap`); opt, sched: its optimizer and LambdaLR-like schedule."""
    if hooks.step is None and hooks.loss is None:
        raise TypeError("Hooks needs loss (or step, which replaces the accumulation and the optimizer step)")
    with training():
        for s in range(start, steps):
            micro = hooks.batches(s)
            if hooks.boundary(s, micro):
                hooks.interrupt(s)
                return s
            if hooks.step is not None:
                losses, lr = hooks.step(s, micro)
            else:
                losses, lr = accumulate(hooks, model, opt, sched, micro)
            if hooks.clock is not None:
                hooks.clock.step()
            step = s + 1
            if hooks.record(step, losses, lr) is False:
                return step
            end = _due(step, hooks.eval_every, steps) and hooks.evaluate(step) is False
            if _due(step, hooks.save_every, steps):
                hooks.save(step)
            if end:
                return step
    return max(start, steps)


def no_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch (DDP's no_sync, FSDP2's
    set_requires_gradient_sync; a no-op context for any other module and for the last one)."""
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


def wrap(model: nn.Module, parallel: str, device: torch.device, blocks: Sequence[nn.Module] = ()) -> nn.Module:
    """`model` as the ranks of the running process group train it: "ddp" — DistributedDataParallel (on CUDA, over
    this rank's device); "fsdp" — FSDP2, `fully_shard` on each of `blocks`, then on the model (sharded in place:
    the model itself is returned). Unwrapped outside a process group of more than one rank."""
    if not is_distributed() or dist_info().world_size == 1:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if parallel != "ddp":
        raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {parallel!r}")
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
