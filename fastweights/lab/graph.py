"""CUDA-graphed training steps for `train_cell` (`train_cell(..., cuda_graph=True)`; on by default
in `fastweights mqar --device cuda`, `--no-cuda-graph` turns it off).

At the lab's sizes a GPU step is launch-bound: measured on an H100 (docs/results/gpu/
r3s3_call1_steps.log, the ceilings preset's cells), the same step captured in one CUDA graph ran
3–10× faster than eager for most zoo models (gated DeltaNet at L 64, B 64: 13.1 → 1.7 ms). Here
one optimizer step — forward, loss, backward, gradient clipping, AdamW — is captured once per
cell and replayed for every step.

The same training maths as the eager loop of `train_cell`:

- The loss. Eager picks the logits at the supervised positions by boolean indexing, whose size
  is data-dependent (a host sync, not capturable). Here every example's supervised positions are
  looked up once per cell (`supervised_slots`: [N, m] positions and targets, m the most any
  example has, the spare slots' targets ignored), so a batch's logits are taken at [B, m]
  gathered positions and the loss is the cross-entropy with ignore_index −100: the mean over the
  same supervised positions.
- The last, partial batch of an epoch is filled up to the batch size with copies of the epoch's
  own examples whose targets are all ignored: they add nothing to the loss or to the gradient
  (every model here treats the rows of a batch independently), so one graph serves every step.
- The lr schedule is the cell's LambdaLR on the optimizer's float lrs, stepped on the host as
  before; each group's lr is a device tensor, filled from it before every step, that AdamW
  (capturable=True) reads inside the graph.
- Gradients, as PyTorch's whole-network capture recipe: the first WARMUP steps of a run (also of
  a resumed run) are real steps run eagerly on a side stream, each after zero_grad(set_to_none);
  before the capture the gradients are set to None, so the captured backward allocates them from
  the graph's pool and every replay overwrites them.
- Autocast runs with cache_enabled=False (its cache of cast weights must not outlive a capture).

Capture safety. The capture runs under `torch.cuda.set_sync_debug_mode("error")`: an op that
would synchronize with the host (`.item()`, a pageable host → device copy, a data-dependent
shape) raises in PyTorch before it reaches the driver, so the capture ends cleanly instead of
leaving the stream invalidated. A capture that fails is logged and the cell goes on with the same
step run eagerly (the record says "cuda_graph": false and why, "cuda_graph_note"); if the
failure left the capture stream current (the driver's capture itself failed), the current stream
is restored and no later cell of this process tries to capture (`capture_blocked`).

Losses stay on the device: each step's loss is copied into a buffer that the host reads every
CHECK_EVERY steps, at a stop request and at the epoch's end (one sync each), accounting for the
steps in order as the eager loop does step by step: the epoch's loss is the mean of the steps
before the first non-finite one, where the cell stops. What differs from eager: up to
CHECK_EVERY − 1 more steps ran after a non-finite one (its non-finite gradient has already made
the weights non-finite by then).

Checkpoints are written in the eager optimizer form (`eager_state_dict`: capturable off, step
counts on the CPU), so a checkpoint of either mode resumes in either mode (`set_capturable`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..training.graphed import (  # set_capturable, eager_state_dict: this module's API before they moved
    CaptureFailure,
    capture,
    eager_state_dict,
    set_capturable,
    step_at,
    warm_step,
)
from ..training.step import AUTOCAST_DTYPES

__all__ = ["GraphedSteps", "supervised_slots", "set_capturable", "eager_state_dict", "capture_blocked",
           "WARMUP", "CHECK_EVERY"]

IGNORE_INDEX = -100
WARMUP = 3  #: eager steps of a run before the capture (PyTorch's recipe uses 3)
CHECK_EVERY = 16  #: graphed steps between the host's reads of the losses

# Run the graphed path on a CPU device without capturing (every step eager through the same
# body): the tests of its maths, loss accounting, stops and checkpoints on machines without a GPU.
_EMULATE_ON_CPU = False
_BLOCKED: list[str] = []  # why capture is off for the rest of this process


def capture_blocked() -> str | None:
    """Why this process no longer captures (a capture failed inside the driver), or None."""
    return _BLOCKED[0] if _BLOCKED else None


def supervised_slots(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [N, T] (−100 where nothing is supervised) -> (positions [N, m], targets [N, m]):
    each example's supervised positions in increasing order, then spare slots (position 0, target
    −100) up to m, the most supervised positions of any example."""
    mask = labels != IGNORE_INDEX
    counts = mask.sum(1)
    m = max(1, int(counts.max()))
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :m]  # supervised first
    keep = torch.arange(m)[None, :] < counts[:, None]
    targets = torch.where(keep, labels.gather(1, order), IGNORE_INDEX)
    return torch.where(keep, order, 0), targets


class GraphedSteps:
    """The training steps of one cell as replays of one captured step (see the module doc).

    sup: the cell's `Supervised` (its `at(inputs, positions)` gives the logits at positions);
    opt: its AdamW (set capturable by the caller when capturing); inputs, labels: the training set
    [N, T] (moved to the device once); batch: the batch size; steps_per_epoch: the steps of an
    epoch (the loss buffer's size); capture: capture on CUDA (False: every step eager through the
    same body — a failed capture, or `_EMULATE_ON_CPU`)."""

    def __init__(self, sup: nn.Module, opt: torch.optim.Optimizer, *, device: torch.device, dtype: str,
                 grad_clip: float | None, inputs: torch.Tensor, labels: torch.Tensor, batch: int,
                 steps_per_epoch: int, capture: bool):
        self.sup, self.opt, self.device, self.grad_clip = sup, opt, torch.device(device), grad_clip
        self.params = [p for p in sup.parameters()]
        self.autocast_dtype = AUTOCAST_DTYPES.get(dtype)
        self.x = inputs.to(self.device)
        pos, tgt = supervised_slots(labels)
        self.pos, self.tgt = pos.to(self.device), tgt.to(self.device)
        self.batch = batch
        self.sel = torch.zeros(2, batch, dtype=torch.long, device=self.device)  # rows, valid
        ldt = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        self.lrs = [torch.zeros((), dtype=ldt, device=self.device) for _ in opt.param_groups]
        self.losses = torch.zeros(steps_per_epoch, dtype=torch.float32, device=self.device)
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_loss: torch.Tensor | None = None
        self.graphed = False  # whether steps were replayed (stays True after close)
        self.warm = 0  # eager steps run since this object was made
        self.note: str | None = None  # why the steps are not (yet) graphed
        self.side = torch.cuda.Stream(self.device) if capture else None

    def why_not(self) -> str | None:
        """Why the steps were not graphed (None when they were)."""
        if self.graphed:
            return None
        if self.note is not None:
            return self.note
        if self.side is None:
            return "emulated on the CPU (no capture)"
        return f"not captured: fewer than {WARMUP + 1} steps ran in this call"

    def epoch(self, mine: torch.Tensor) -> torch.Tensor:
        """[steps, 2, B] on the device for an epoch's example order `mine` [n]: per step the rows of
        its batch and whether each row is real (the last batch filled up with ignored copies)."""
        n, B = mine.numel(), self.batch
        steps = -(-n // B)
        idx = torch.arange(steps * B)
        rows = mine[idx % n]
        valid = (idx < n).long()
        return torch.stack([rows.view(steps, B), valid.view(steps, B)], dim=1).to(self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _body(self) -> torch.Tensor:
        rows, valid = self.sel[0], self.sel[1]
        x = self.x.index_select(0, rows)
        pos = self.pos.index_select(0, rows)
        tgt = self.tgt.index_select(0, rows).masked_fill(valid.unsqueeze(1) == 0, IGNORE_INDEX)
        with self._autocast():
            logits = self.sup.at(x, pos)  # [B, m, vocab]
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        step_at(self.opt, self.lrs)
        return loss.detach()

    def step(self, s: int, selection: torch.Tensor, log=None) -> None:
        """Optimizer step s of the epoch on the batch `selection` [2, B] (a row of `epoch`); its
        loss goes to losses[s]. log(line): where a failed capture is reported."""
        self.sel.copy_(selection)
        for t, g in zip(self.lrs, self.opt.param_groups):
            t.fill_(g["lr"])
        if self.graph is None and self.capture and self.warm >= WARMUP:
            self._capture(log)
        if self.graph is not None:
            self.graph.replay()
            self.losses[s].copy_(self.static_loss)
            return
        self.opt.zero_grad(set_to_none=True)
        self.losses[s].copy_(warm_step(self._body, self.side, self.device) if self.capture else self._body())
        self.warm += 1

    def _capture(self, log) -> None:
        blocked = capture_blocked()
        if blocked is not None:
            self._give_up(f"not captured: {blocked}", log)
            return
        self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients
        try:
            graph, loss = capture(self._body, self.device)
        except CaptureFailure as e:  # any capture failure falls back, loudly
            self.opt.zero_grad(set_to_none=True)
            why = f"capture failed ({e})"
            if not e.clean:
                _BLOCKED.append(f"an earlier capture in this process failed inside the driver ({why})")
            torch.cuda.synchronize(self.device)
            self._give_up(why + "; training eagerly", log)
            return
        self.graph, self.static_loss, self.graphed = graph, loss, True

    def _give_up(self, why: str, log) -> None:
        self.capture = False
        self.note = why
        if log is not None:
            log(f"cuda_graph: {why}")

    def read(self, lo: int, hi: int) -> list[float]:
        """The losses of steps [lo, hi) of the epoch (one host sync)."""
        return self.losses[lo:hi].tolist() if hi > lo else []

    def close(self) -> None:
        """Free the graph and its pool (the gradients it allocated are dropped)."""
        if self.graph is not None:
            self.opt.zero_grad(set_to_none=True)
        self.graph = self.static_loss = None
        self.x = self.pos = self.tgt = None


def account(losses: list[float], first: int, loss_sum: float, loss_n: int) -> tuple[float, int, int | None]:
    """Add the losses of steps first, first + 1, … to (loss_sum, loss_n) in order, stopping at the
    first non-finite one: (loss_sum, loss_n, that step's index or None)."""
    for j, lv in enumerate(losses, first):
        if not math.isfinite(lv):
            return loss_sum, loss_n, j
        loss_sum += lv
        loss_n += 1
    return loss_sum, loss_n, None
