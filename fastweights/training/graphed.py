"""One language-model optimizer step — its micro-batches' forwards and backwards, clipping, AdamW — captured once in a
CUDA graph and replayed for every step (`GraphedLMStep`).

Why: a fast-weight LM's step is launch-bound on the host. At the gpu-125m preset's shape (d_model 768, 12 layers,
6 heads of 128, 8×2048 tokens, bf16) on an H100 the eager step took 135.1 ms and the same step replayed from one
graph 70.7 ms (the transformer of that shape: 62.9 → 58.0 ms): the Triton launches, autograd Functions and small
gate ops of every layer cost more host time than their GPU time (scripts/gpu_step_graph.py,
docs/results/gpu/r4s2/call3). A replay launches the whole step at once.

The maths is the eager step's, micro-batch by micro-batch, on inputs x and labels y [M, B, T] (`step(ids)`: x =
ids[..., :-1], y = ids[..., 1:]; `step_labeled(x, y)`: labels as given, IGNORE_INDEX (−100) where a token is not
supervised):

    n = #(y ≠ −100) over all M micro-batches (≥ 1; counted on the device)
    for m in range(M):  loss_m = Σ_t CE(LM(x[m])_t, y[m]_t) / n;  loss_m.backward()      (grads accumulate)
    clip_grad_norm_(params, clip)  (when clip);  AdamW.step() with each group's lr read from a device tensor

(with every label supervised, n = M·B·T: each micro-batch's mean loss / M.)

with bf16 autocast (cache off: a cast weight must not outlive the capture). PyTorch's whole-network recipe: WARMUP
eager steps on a side stream, gradients set to None before the capture so that the captured first backward
allocates them from the graph's pool (every replay overwrites them, the later micro-batches accumulate onto them),
AdamW with capturable=True. A replay reads the inputs and labels copied into static buffers [M, B, T] and the lrs copied
into device scalars; the loss stays on the device.

Packed documents (`max_documents`): with position_ids [M, B, T] (a document starts where the position is 0, as
`pretrain.data.pack` writes them) each micro-batch's forward packs its documents into a fixed number of varlen
sequences, max_documents, the rest empty (`Segments.build(max_documents=)`: no host read, no data-dependent
shape). What that packing does not read is checked on the host batch before it is copied into the static buffer
(`check_documents`: positions ≥ 0, at most max_documents documents in every micro-batch) — from CPU tensors, as
the loader gives them, that check costs no device synchronization.

Capture safety: the capture runs under `torch.cuda.set_sync_debug_mode("error")`, so an op that would synchronize
(`.item()`, a data-dependent shape) raises instead of corrupting the capture; a failed capture raises
`GraphCaptureError` naming the op's message, and the caller decides (the step is never silently run another way).
Not served: DDP/FSDP-wrapped models (their hooks communicate per bucket), varying shapes (one graph per shape).

On a CPU (`capture=False`) every step runs eagerly through the same body: the maths, the accumulation and the lr
handling are tested there against a plain loop.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..inputs import check_int
from ..layers.segments import check_documents

__all__ = ["GraphedLMStep", "GraphCaptureError", "set_capturable", "eager_state_dict", "eager_form", "capture",
           "CaptureFailure", "warm_step", "step_at", "WARMUP", "IGNORE_INDEX"]

WARMUP = 3  #: eager steps before the capture (PyTorch's recipe uses 3)
IGNORE_INDEX = -100  #: a label that is not supervised (`step_labeled`; cross_entropy's default ignore_index)


class GraphCaptureError(RuntimeError):
    """The step could not be captured in a CUDA graph; the message says which op refused."""


def set_capturable(opt: torch.optim.Optimizer, on: bool) -> None:
    """Every group's `capturable` flag, and the step counts where that form keeps them (on the
    parameter's device when capturable, else on the CPU)."""
    for group in opt.param_groups:
        group["capturable"] = on
    if on:  # (its warm-up steps run uncaptured by design: no "capturable=True can impair performance" warning)
        opt._warned_capturable_if_run_uncaptured = True
    for p, state in opt.state.items():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = step.to(p.device if on else torch.device("cpu"))


def eager_state_dict(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() in the eager form (capturable off, step counts on the CPU), whatever form
    the optimizer runs in (the live state is not touched)."""
    return eager_form(opt.state_dict())


def eager_form(sd: dict) -> dict:
    """An optimizer state dict ({"state": {key: {...}}, "param_groups": [...]}: torch's or torch.distributed's full
    one) in the eager form: capturable off, step counts on the CPU (what a run without the graph loads)."""
    state = {k: {n: (v.detach().cpu() if n == "step" and isinstance(v, torch.Tensor) else v) for n, v in st.items()}
             for k, st in sd["state"].items()}
    groups = [{**g, "capturable": False} if "capturable" in g else dict(g) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


class CaptureFailure(Exception):
    """`capture` failed: `error` is what the body or the driver raised, `clean` whether the capture stream ended
    (False: the driver's capture itself failed, and later captures in the process are unsafe)."""

    def __init__(self, error: BaseException, clean: bool):
        super().__init__(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}")
        self.error, self.clean = error, clean


def capture(body, device: torch.device):
    """(graph, body()'s result): `body` captured in a new CUDA graph on `device` under
    `torch.cuda.set_sync_debug_mode("error")` — an op that would synchronize with the host raises in PyTorch
    instead of invalidating the capture (the graph's entry synchronizes the device before the check turns on).
    Raises CaptureFailure with the current stream restored."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream(device)
    debug = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = body()
            finally:
                torch.cuda.set_sync_debug_mode(debug)
    except Exception as e:
        clean = torch.cuda.current_stream(device) == stream  # capture_end ran (else it raised)
        torch.cuda.set_stream(stream)
        raise CaptureFailure(e, clean) from e
    return graph, out


def warm_step(body, side: torch.cuda.Stream, device: torch.device):
    """body() run eagerly on the side stream `side`, ordered after and before the current stream's work (the
    warm-up steps of PyTorch's capture recipe: allocator and library set-up off the capture stream)."""
    cur = torch.cuda.current_stream(device)
    side.wait_stream(cur)
    with torch.cuda.device(device), torch.cuda.stream(side):
        out = body()
    cur.wait_stream(side)
    return out


def step_at(opt: torch.optim.Optimizer, lrs: list[torch.Tensor]) -> None:
    """opt.step() with each group's lr read from the device scalar lrs[i] (a captured step reads the lr a replay
    was given); the groups' float lrs are put back after."""
    groups = opt.param_groups
    floats = [g["lr"] for g in groups]
    for g, t in zip(groups, lrs):
        g["lr"] = t
    try:
        opt.step()
    finally:
        for g, v in zip(groups, floats):
            g["lr"] = v


class GraphedLMStep:
    """Optimizer steps of `model` (ids [B, T] -> logits [B, T, vocab]) on batches of token ids [M, B, T + 1] (M
    micro-batches), replayed from one CUDA graph after WARMUP eager steps (see the module doc).

    Args:
        model: the LM (not DDP/FSDP-wrapped).
        opt: its AdamW; made capturable here when capturing.
        shape: (M, B, T + 1), the batches every step takes.
        autocast_dtype: torch.bfloat16 / float16 for autocast, or None.
        grad_clip: the global gradient norm's bound, or None.
        capture: capture on CUDA; False runs every step eagerly through the same body (CPU tests).
        max_documents: packed documents: every step then takes position_ids [M, B, T], and each micro-batch
            [B, T] holds at most this many documents (see the module doc); None: one sequence per row.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, shape: tuple[int, int, int], *,
                 autocast_dtype: torch.dtype | None = torch.bfloat16, grad_clip: float | None = None,
                 capture: bool = True, max_documents: int | None = None):
        if any(type(m).__name__ in ("DistributedDataParallel", "FSDPModule") or hasattr(m, "_fsdp_param_group")
               for m in model.modules()):
            raise GraphCaptureError("GraphedLMStep: model is wrapped for DDP/FSDP, whose hooks cannot be captured "
                                    "here: train it eagerly")
        if len(shape) != 3 or min(shape) < 1 or shape[2] < 2:
            raise ValueError(f"GraphedLMStep: shape must be (micro-batches, batch, T + 1 ≥ 2), got {shape}")
        p0 = next(model.parameters())
        self.model, self.opt, self.shape, self.device = model, opt, tuple(shape), p0.device
        M, B, T1 = self.shape
        self.autocast_dtype, self.grad_clip = autocast_dtype, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.capture = bool(capture) and self.device.type == "cuda"
        self.inputs = torch.zeros((M, B, T1 - 1), dtype=torch.long, device=self.device)  # [M, B, T]
        self.labels = torch.zeros((M, B, T1 - 1), dtype=torch.long, device=self.device)  # [M, B, T]
        self.max_documents = check_int("max_documents", max_documents, optional=True)
        self.positions = None if max_documents is None else \
            torch.zeros((M, B, T1 - 1), dtype=torch.long, device=self.device)  # [M, B, T]
        ldt = torch.float64 if p0.dtype == torch.float64 else torch.float32
        self.lrs = [torch.zeros((), dtype=ldt, device=self.device) for _ in opt.param_groups]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_loss: torch.Tensor | None = None
        self.warm = 0
        self.side = torch.cuda.Stream(self.device) if self.capture else None
        if self.capture:
            set_capturable(opt, True)

    @property
    def graphed(self) -> bool:
        """Whether the steps now replay a captured graph."""
        return self.graph is not None

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _body(self) -> torch.Tensor:
        M = self.shape[0]
        total = None
        n = (self.labels != IGNORE_INDEX).sum().clamp_min(1)  # the step's supervised tokens (a device scalar)
        for m in range(M):
            docs = {} if self.positions is None else {"position_ids": self.positions[m],
                                                      "max_documents": self.max_documents}
            with self._autocast():
                logits = self.model(self.inputs[m], **docs)  # [B, T, vocab]
            logits = logits if logits.dtype == torch.float64 else logits.float()  # fp32 loss under autocast
            loss = F.cross_entropy(logits.flatten(0, 1), self.labels[m].flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / n
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        step_at(self.opt, self.lrs)
        return total

    def step(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on ids [M, B, T + 1] (any device: copied into the static buffers; every next token
        supervised) at the optimizer's current group lrs; returns the step's mean token loss, a device scalar (no
        host sync). position_ids [M, B, T]: with max_documents, and only then."""
        if tuple(ids.shape) != self.shape:
            raise ValueError(f"GraphedLMStep.step: ids must be {list(self.shape)}, got {list(ids.shape)}")
        self._positions("step", position_ids)
        self.inputs.copy_(ids[..., :-1], non_blocking=True)
        self.labels.copy_(ids[..., 1:], non_blocking=True)
        return self._run()

    def step_labeled(self, inputs: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on inputs and labels [M, B, T] (labels IGNORE_INDEX where not supervised); returns
        the step's mean loss over its supervised tokens, a device scalar (no host sync). position_ids [M, B, T]:
        with max_documents, and only then."""
        want = [self.shape[0], self.shape[1], self.shape[2] - 1]
        for name, x in (("inputs", inputs), ("labels", labels)):
            if list(x.shape) != want:
                raise ValueError(f"GraphedLMStep.step_labeled: {name} must be {want}, got {list(x.shape)}")
        self._positions("step_labeled", position_ids)
        self.inputs.copy_(inputs, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        return self._run()

    def _positions(self, method: str, position_ids: torch.Tensor | None) -> None:
        """position_ids [M, B, T] checked on the host (`check_documents`) and copied into the static buffer."""
        if (position_ids is None) != (self.positions is None):
            raise ValueError(f"GraphedLMStep.{method}: position_ids [M, B, T] come with max_documents, and only "
                             f"then (max_documents={self.max_documents}, position_ids "
                             f"{'missing' if position_ids is None else 'given'})")
        if position_ids is None:
            return
        if list(position_ids.shape) != list(self.positions.shape):
            raise ValueError(f"GraphedLMStep.{method}: position_ids must be {list(self.positions.shape)}, got "
                             f"{list(position_ids.shape)}")
        check_documents(position_ids, self.max_documents)
        self.positions.copy_(position_ids, non_blocking=True)

    def _run(self) -> torch.Tensor:
        for t, g in zip(self.lrs, self.opt.param_groups):
            t.fill_(float(g["lr"]))
        if self.graph is None and self.capture and self.warm >= WARMUP:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.static_loss.clone()
        self.opt.zero_grad(set_to_none=True)
        loss = warm_step(self._body, self.side, self.device) if self.capture else self._body()
        self.warm += 1
        return loss

    def _capture(self) -> None:
        self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients
        try:
            self.graph, self.static_loss = capture(self._body, self.device)
        except CaptureFailure as e:
            self.opt.zero_grad(set_to_none=True)
            raise GraphCaptureError(f"the LM step could not be captured in a CUDA graph ({e}); train without the "
                                    "graph") from e.error

    def close(self) -> None:
        """Free the graph and its pool (the gradients it allocated are dropped) and make the optimizer eager again."""
        if self.graph is not None:
            self.opt.zero_grad(set_to_none=True)
        self.graph = self.static_loss = None
        if self.capture:
            set_capturable(self.opt, False)
