"""The named pipelines of the Triton chunk rows, and the rule that picks one per call (importable without triton).

A Triton chunk row runs one of several pipelines — the stage kernels one by one ("staged"), or fused kernels that
keep the state in registers ("fused"); the backward recomputing the states or the forward keeping them; bf16 /
fp16 inputs computed on fp32 copies. Which one a call runs is a pure function of the call's facts — the recipe's
gate kind, probe key and decay order, the device type, dtype, head dims and chunk size — never of data or the
sequence length (DESIGN.md, "No hidden global state"), and it is made here, not in the kernel modules: the row
(`kernels.rows.delta_chunk`, `gated_linear_chunk`) asks `delta_pipeline` / `gated_pipeline` and passes the answer
to the glue (`chunk_delta_triton(..., pipeline=)`, `chunk_gated_triton(..., pipeline=)`) as an argument; a caller
of the glue may pass any other pipeline (an A/B measurement). `dispatch.rows(pipelines=True)` lists the named
pipelines of each row, `fastweights.pipeline(...)` says which one a call takes, and a layer's `repr` shows the last
call's.

The tables below are the measured facts the rule reads (moved here from the kernel modules' globals):
`FUSED_CHECKED_HEAD_DIMS_CUDA` and `LOW_PRECISION_MIN_HEAD_DIM_CUDA` (from kernels/triton/delta.py); the head-dim
and chunk limits of the fused kernels live in `kernels/triton/common/limits.py` (the kernels refuse beyond them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .triton.common.limits import (
    DELTA_FUSED_BWD_MAX_C,
    DELTA_FUSED_BWD_MAX_K,
    DELTA_FUSED_MAX_HEAD_DIM_CUDA,
    GATED_FUSED_MAX_HEAD_DIM_CUDA,
)

__all__ = ["DeltaPipeline", "GatedPipeline", "delta_pipeline", "gated_pipeline", "gate_kind", "DELTA_PIPELINES",
           "DELTA_FORWARDS", "GATED_PIPELINES", "FUSED_CHECKED_HEAD_DIMS_CUDA", "LOW_PRECISION_MIN_HEAD_DIM_CUDA",
           "STAGES"]

Stage = Literal["staged", "fused"]
STAGES: tuple[str, ...] = ("staged", "fused")
#: The delta class's forwards: the stages, and "split" (delta_split.py: the fused forward's pre-pass, a states-only
#: sequential pass, a chunk-parallel output kernel; never picked by the rule until a GPU times it — issue 32)
DeltaForward = Literal["staged", "fused", "split"]
DELTA_FORWARDS: tuple[str, ...] = STAGES + ("split",)
GateKind = Literal["none", "scalar", "diagonal"]

#: The head dims (K, V) at which the delta class's fused kernels run on a GPU: the specializations a GPU has checked
#: against the fp32 torch chunk form (2026-11-26, H100, `scripts/gpu_fused_bwd.py`: bf16 K = V = 128 at B4 T300, B1
#: T1500 Hq16 H32 and B1 T32768 Hq16 H32, fp32 grouped varlen; BENCHMARKS §1e). Every other head dim compiles other
#: kernels (BK = K, another BV) that no GPU has run yet, so the rule keeps them staged there until a GPU call checks
#: them (add them here then); `DeltaPipeline(forward="fused", ...)` passed to the glue still runs them. (On the CPU,
#: under the interpreter, every head dim is checked by the tests.) K = 128, V = 256 (the LM preset's gated DeltaNet)
#: was added on 2026-11-26 with its GPU check (H200, Triton 3.6: tests/kernels/fused/test_triton_delta_fused_bwd.py::
#: test_cuda_head_dims; BENCHMARKS §1f); its forward stays staged (V > DELTA_FUSED_MAX_HEAD_DIM_CUDA), the backward
#: is fused.
FUSED_CHECKED_HEAD_DIMS_CUDA = frozenset({(128, 128), (128, 256)})

#: The smallest head dim (K and V) at which the delta class's kernels take bf16 / fp16 inputs on a GPU. Below it the
#: call runs the same kernels on fp32 copies of q, k, v (and p) and casts the output back, with a warning: on the
#: H200 with Triton 3.6 (2026-11-26, `scripts/gpu_diag.py`, docs/results/gpu/r3s4_call7_diag.txt) bf16 at K = 16 and
#: K = 32 gave wrong outputs and gradients (relative errors 0.1–1.4 against the fp32 torch form where fp32 inputs
#: give 5e-7; the fused forward NaN at K = 16) and an illegal memory access in the WY backward at K = 16; K = 64 and
#: above pass the cuda tests. (The interpreter, on the CPU, passes every head dim.)
LOW_PRECISION_MIN_HEAD_DIM_CUDA = 64

_LOW = (torch.bfloat16, torch.float16)


def _stage(name: str, value, allowed: tuple[str, ...] = STAGES) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True)
class DeltaPipeline:
    """The delta class's Triton pipeline for one call (kernels/triton/delta.py).

    forward:  "staged" (cumsum → scores → inverse → WY → state pass → outputs, one kernel each), "fused"
              (delta_fused.py: a chunk-parallel pre-pass and one sequential kernel, the state in registers) or
              "split" (delta_split.py: the pre-pass, a sequential pass writing the states h and U alone, a
              chunk-parallel output kernel; the calls "fused" takes; off unless asked for)
    backward: "staged" (the stage kernels' backward) or "fused" (delta_fused_bwd.py: three kernels)
    recompute_states: the backward recomputes the forward's state pass (h, U, S_T) instead of the forward keeping
              them (−(K·V/C + V)·H elements per token of saved memory; bitwise the same gradients)
    fp32:     bf16 / fp16 inputs run the kernels on fp32 copies (the output cast back), with a warning
              (`LOW_PRECISION_MIN_HEAD_DIM_CUDA`); `forward` and `backward` then are the fp32 call's"""

    forward: DeltaForward = "staged"
    backward: Stage = "staged"
    recompute_states: bool = True
    fp32: bool = False

    def __post_init__(self):
        _stage("forward", self.forward, DELTA_FORWARDS)
        _stage("backward", self.backward)

    @property
    def name(self) -> str:
        """'fused forward, fused backward' (+ ', states kept', + ', in fp32')."""
        parts = [f"{self.forward} forward", f"{self.backward} backward"]
        if not self.recompute_states:
            parts.append("states kept")
        if self.fp32:
            parts.append("in fp32")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class GatedPipeline:
    """The gated-linear class's Triton pipeline for one call (kernels/triton/gated.py).

    pipeline: "staged" (cumsum → scores → state pass → outputs; the backward recomputes G, h and A) or "fused"
              (gated_fused.py: one sequential kernel forward; backward a states recompute, one reverse sequential
              kernel and one chunk-parallel kernel)
    recompute_states: the fused pipeline's backward recomputes h (one states-only run of the forward kernel)
              instead of the forward keeping it (the staged pipeline always recomputes)"""

    pipeline: Stage = "staged"
    recompute_states: bool = True

    def __post_init__(self):
        _stage("pipeline", self.pipeline)

    @property
    def name(self) -> str:
        """'staged' / 'fused' (+ ', states kept')."""
        return self.pipeline + ("" if self.recompute_states else ", states kept")

    def __str__(self) -> str:
        return self.name


#: The named pipelines of each row, as `dispatch.rows(pipelines=True)` lists them (the rule picks among these; the
#: recompute and fp32 flags are shown beside a name when set).
DELTA_PIPELINES = tuple(DeltaPipeline(f, b).name for f in DELTA_FORWARDS for b in STAGES) + (
    DeltaPipeline(fp32=True).name,)
GATED_PIPELINES = tuple(GatedPipeline(p).name for p in STAGES)


def gate_kind(g) -> GateKind:
    """The gate kind of a log-decay tensor: None → "none", [B, T, H] → "scalar", [B, T, H, K] → "diagonal"."""
    return "none" if g is None else ("diagonal" if g.dim() == 4 else "scalar")


def delta_pipeline(*, gate: GateKind, probe: bool, decay_first: bool, device_type: str, dtype: torch.dtype,
                   K: int, V: int, C: int, split: bool = False) -> DeltaPipeline:
    """The pipeline a delta-class call runs (the rule; a pure function of the facts):

    - bf16 / fp16 on a GPU with K or V < LOW_PRECISION_MIN_HEAD_DIM_CUDA: fp32 copies (then the fp32 call's stages);
    - the fused forward: no probe key, the decay first (or none), no or a scalar decay, bf16 / fp16 (the H100 timed
      it faster there; KDA's diagonal decay lost, fp32 was not timed) and, on a GPU, (K, V) in
      FUSED_CHECKED_HEAD_DIMS_CUDA with K, V ≤ DELTA_FUSED_MAX_HEAD_DIM_CUDA;
    - the fused backward: no probe key, the decay first (or none), no or a scalar decay, K ≤ DELTA_FUSED_BWD_MAX_K,
      C ≤ DELTA_FUSED_BWD_MAX_C, bf16 / fp16 and, on a GPU, (K, V) in FUSED_CHECKED_HEAD_DIMS_CUDA;
    - the backward recomputes the states;
    - split: the split forward where the fused one would run (util.LAUNCH["delta_split_out"]["ON"], opt-in).

    gate: "none" | "scalar" | "diagonal" (constant retention is a scalar decay); probe: a probe key p (Comba);
    device_type "cuda" | "cpu" | …; dtype: q's; K, V: head dims; C: the chunk size."""
    if device_type == "cuda" and dtype in _LOW and min(K, V) < LOW_PRECISION_MIN_HEAD_DIM_CUDA:
        inner = delta_pipeline(gate=gate, probe=probe, decay_first=decay_first, device_type=device_type,
                               dtype=torch.float32, K=K, V=V, C=C, split=split)
        return DeltaPipeline(inner.forward, inner.backward, inner.recompute_states, fp32=True)
    fusable = (not probe and (decay_first or gate == "none") and gate in ("none", "scalar")
               and dtype != torch.float32 and (device_type != "cuda" or (K, V) in FUSED_CHECKED_HEAD_DIMS_CUDA))
    forward = fusable and (device_type != "cuda" or max(K, V) <= DELTA_FUSED_MAX_HEAD_DIM_CUDA)
    backward = fusable and K <= DELTA_FUSED_BWD_MAX_K and C <= DELTA_FUSED_BWD_MAX_C
    return DeltaPipeline(("split" if split else "fused") if forward else "staged", "fused" if backward else "staged")


def gated_pipeline(*, gate: GateKind, device_type: str, dtype: torch.dtype, K: int, V: int) -> GatedPipeline:
    """The pipeline a gated-linear call runs (the rule): "staged" everywhere — the fused pipeline is not chosen
    until a GPU call has checked it at the shapes it times (docs/kernels.md, "Checklist": call 3 faulted at BV 16);
    pass `GatedPipeline("fused")` to `chunk_gated_triton` to run it. Its reach once chosen: every gate kind, and
    on a GPU K, V ≤ GATED_FUSED_MAX_HEAD_DIM_CUDA (`gated_fused_serves`)."""
    return GatedPipeline("staged")


def gated_fused_serves(device_type: str, K: int, V: int, *, gate: GateKind, dtype: torch.dtype) -> bool:
    """Whether the fused gated-linear pipeline serves a call. On the CPU (the interpreter): everything. On a GPU:
    K, V ≤ GATED_FUSED_MAX_HEAD_DIM_CUDA (an illegal memory access at 256 on the H100), and not 16-bit inputs with no
    or a scalar decay — on an H200 (Triton 3.6, 2026-11-28, docs/results/gpu/r4s7/call4) their outputs were wrong in
    bf16 at every checked shape (B2 T1024 H4 D64 to B1 T65536 H4 D128) and a graph-captured varlen call hit an illegal
    memory access, while fp32 and the diagonal decay passed: refused until a GPU check passes again."""
    if device_type != "cuda":
        return True
    if max(K, V) > GATED_FUSED_MAX_HEAD_DIM_CUDA:
        return False
    return not (dtype in (torch.bfloat16, torch.float16) and gate in ("none", "scalar"))
