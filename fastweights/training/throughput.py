"""The speed a training run really has: steady-state tokens/s and the model FLOPs utilisation (MFU).

A run's first steps compile kernels and autotune (minutes on a GPU: Triton, torch.compile), so the running
average from the start understates the speed for a long while. `StepClock` keeps the wall time of each
optimizer step and reports, beside that running figure, the rate over a window of the last `window` steps after
the first `skip` ones (`steady`, None until a step past `skip` has run). The step must end synchronized with the
device (the training loop's `loss.item()` does) for the clock to see its real end.

MFU (PaLM's definition) = model FLOPs per token × steady tokens/s ÷ the devices' peak:

    model FLOPs per token = 6 · N + 3 · Σ_layers mixer forward FLOPs per token       (`model_flops_per_token`)

N counts the parameters every token multiplies (every matmul weight, the tied or untied output head included;
an untied input embedding is a lookup and is not counted); 6 = 2 FLOPs per multiply-add × (forward + a backward
twice the forward). The mixer's own work is counted per layer: causal softmax attention H·T·(K + V) (each query
against T/2 keys on average: QKᵀ and AV), the chunk form of the linear classes `chunkwise.flops.chunk_flops` per token
(the gated-linear and delta classes, n micro-steps for DeltaProduct). Other memories (MLP memories, Mesa, …) have no
count yet: their MFU is None, not a guess. The peak is per device from `PEAK_FLOPS` (dense, without sparsity) for
the run's compute dtype — None on the CPU or an unlisted device, and then the MFU is None too.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from ..chunkwise.flops import chunk_flops
from ..recipe import recipe_class

__all__ = ["StepClock", "PEAK_FLOPS", "peak_flops", "model_flops_per_token", "mixer_flops_per_token", "mfu"]

#: Dense peak FLOP/s per device, by (device name fragment, compute dtype): the vendor's datasheet figures without
#: sparsity. H100 SXM and H200: 989 TFLOP/s in bf16 / fp16 tensor-core math. A device or dtype not listed: None.
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("H100", "bfloat16"): 989e12,
    ("H100", "float16"): 989e12,
    ("H200", "bfloat16"): 989e12,
    ("H200", "float16"): 989e12,
}


def peak_flops(device: torch.device | str, dtype: str) -> float | None:
    """The peak FLOP/s of one `device` computing in `dtype` ("bfloat16", "float16", "float32": the run's autocast
    dtype) from PEAK_FLOPS, matched on the CUDA device's name; None on the CPU or a device / dtype not listed."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for (part, dt), peak in PEAK_FLOPS.items() if part in name and dt == dtype), None)


def mixer_flops_per_token(mixer, seq_len: int) -> float | None:
    """Forward FLOPs per token of one layer's mixer beyond its projections (see the module doc): softmax
    attention H·T·(K + V) at T = seq_len, the chunk form of the gated-linear and delta classes; None for the
    memories without a count."""

    if mixer.is_softmax:
        return float(mixer.H * seq_len * (mixer.K + mixer.V))
    cls = recipe_class(mixer.recipe)
    if cls not in ("gated_linear", "delta"):
        return None
    C = mixer.config.chunk_size
    n = mixer.n  # DeltaProduct's micro-steps per token (1 otherwise)
    return n * chunk_flops(1, C, mixer.H, mixer.K, mixer.V, C=C, delta=cls == "delta") / C


def model_flops_per_token(lm, seq_len: int) -> float | None:
    """Training FLOPs per token of `lm` (a models.LM) at sequences of `seq_len`: 6·N + 3·Σ mixer forward FLOPs per
    token (the module doc); None when a layer's mixer has no count."""
    n = lm.num_parameters()
    if lm.lm_head is not None:  # untied: the input embedding is a lookup
        n -= lm.embed.weight.numel()
    mixers = [mixer_flops_per_token(block.mixer, seq_len) for block in lm.blocks]
    if any(m is None for m in mixers):
        return None
    return 6.0 * n + 3.0 * sum(mixers)


def mfu(tokens_per_s: float | None, flops_per_token: float | None, peak: float | None,
        devices: int = 1) -> float | None:
    """The fraction of `devices` × `peak` FLOP/s that `tokens_per_s` × `flops_per_token` is (None if any is)."""
    if tokens_per_s is None or flops_per_token is None or peak is None:
        return None
    return tokens_per_s * flops_per_token / (peak * devices)


class StepClock:
    """Wall time of a run's optimizer steps: `running` tokens/s since `start` (every step) and `steady` tokens/s
    over the last `window` steps after the first `skip` (the compiles and autotuning) — None until step skip + 1
    has ended. Call `start()` before the first step and `step()` after each.

    tokens_per_step: tokens of one optimizer step (all ranks); clock: seconds (time.perf_counter)."""

    def __init__(self, tokens_per_step: int, *, skip: int = 2, window: int = 50, clock=time.perf_counter):
        if skip < 1 or window < 1:
            raise ValueError(f"skip and window must be ≥ 1, got skip={skip}, window={window}")
        self.tokens_per_step, self.skip, self.window, self.clock = tokens_per_step, skip, window, clock
        self.t0 = self.last = 0.0
        self.steps = 0
        self.ends: deque[float] = deque(maxlen=window + 1)  # the end of step skip, then of each later one

    def start(self) -> None:
        self.t0 = self.last = self.clock()
        self.steps = 0
        self.ends.clear()

    def step(self) -> None:
        self.last = self.clock()
        self.steps += 1
        if self.steps >= self.skip:
            self.ends.append(self.last)

    @property
    def running(self) -> float:
        """Tokens/s from `start` to the end of the last step (the first steps' compiles included)."""
        return self.steps * self.tokens_per_step / max(self.last - self.t0, 1e-9)

    @property
    def steady(self) -> float | None:
        """Tokens/s over the last ≤ `window` steps after the first `skip`; None before one has ended."""
        if len(self.ends) < 2:
            return None
        return (len(self.ends) - 1) * self.tokens_per_step / max(self.ends[-1] - self.ends[0], 1e-9)
