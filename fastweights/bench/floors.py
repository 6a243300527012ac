"""`fastweights bench floors`: what one chunk-form step of a memory cannot go below — issue 36's floors of the deep
memories (TTT-Linear, TTT-MLP, Titans, MesaNet, OmegaNet, ATLAS) beside gated DeltaNet's, at the issue's two shapes.

FLOPs are counted, not derived by hand: torch's `FlopCounterMode` runs `fw.chunk` on the meta device (shapes only, no
data, no time), forward and forward + backward, on the torch chunk form — the maths every kernel row of the memory
computes (the mini-batch dual form; Mesa's 30 CG iterations; ATLAS's Newton–Schulz per token). It counts the matrix
products (mm, bmm, baddbmm, the convolutions), 2 FLOPs a multiply-add; elementwise work is not counted. One sequence
and one head are counted, at all T tokens (`count_len`: at T_c = min(T, count_len), scaled by T / T_c — the mini-batch
forms are linear in T, Mesa's chunk states are not quite), and scaled by B·H: every head and sequence costs the same
(tests/bench/test_floors.py holds the scalings).

Bytes are the DRAM traffic no implementation avoids (everything else recomputed or kept on chip): the forward reads
the inputs (q, k, v, the gates; as `example_inputs` gives them in `dtype`) and the initial state (fp32) and writes
o and the final state; the backward reads the inputs again, o's and the final state's gradients, and writes the
inputs' and the initial state's gradients:

    fwd   = inputs + o + 2 · state
    step  = fwd + inputs + o + 2 · state + inputs            (= 3 · inputs + 2 · o + 4 · state)

The floor in ms is max(FLOPs / peak, bytes / bandwidth), at the H200's dense bf16 tensor-core peak and HBM bandwidth
by default (989 TFLOP/s, 4.8 TB/s; the deep memories' forms run fp32 or TF32 products, whose peak is lower — so the
floor is optimistic for them, which is what a floor should be).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import api
from ..inputs import InputError, check_int
from ..state import state_tensors
from .speed import bench_inputs

__all__ = ["DEEP_MEMORIES", "SHAPES", "PEAK_FLOPS", "BANDWIDTH", "Floor", "count_step_flops", "step_floor",
           "floors_table", "run_floors", "NSCount", "count_newton_schulz", "newton_schulz_table"]

#: the deep memories of issue 36, and gated DeltaNet for the ratio
DEEP_MEMORIES = ("gated_deltanet", "ttt_linear", "ttt_mlp", "titans", "mesanet", "omeganet", "atlas")
#: issue 36's shapes: (B, T, H, D), D = K = V
SHAPES = {"small": (64, 512, 2, 64), "lm": (4, 4096, 16, 128)}
PEAK_FLOPS = 989e12  # the H200's dense bf16 tensor-core peak, FLOP/s
BANDWIDTH = 4.8e12  # the H200's HBM3e bandwidth, B/s


@dataclass
class Floor:
    """One memory at one shape: counted FLOPs and unavoidable bytes of a forward and of a forward + backward."""
    model: str
    shape: str
    B: int
    T: int
    H: int
    D: int
    fwd_flops: float
    step_flops: float
    fwd_bytes: float
    step_bytes: float
    floor_ms: float  # the step's: max(step_flops / peak, step_bytes / bandwidth) in ms
    bound: str  # "FLOPs" or "bytes": which term sets floor_ms


def _leaves(model: str, T: int, D: int, dtype, device: str, B: int = 1, H: int = 1):
    """(`bench.speed.bench_inputs` without the initial state, the initial state)."""
    inp = bench_inputs(model, B, T, H, D, dtype, device)
    return inp, inp.pop("initial_state", None)


def count_step_flops(model: str, T: int, D: int, *, B: int = 1, H: int = 1,
                     chunk_size: int = 64) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of `fw.chunk(model)` at B sequences of T tokens, H heads of D (fp32 on the
    meta device: counted, not run). The backward differentiates a random projection of o and of the final state's
    tensors, so every input's gradient is formed."""
    from torch.utils.flop_counter import FlopCounterMode

    inp, state = _leaves(model, T, D, torch.float32, "meta", B, H)
    with FlopCounterMode(display=False) as fwd:
        api.chunk(model, initial_state=state, check_values=False, chunk_size=chunk_size, **inp)
    with FlopCounterMode(display=False) as step:
        o, final = api.chunk(model, initial_state=state, output_final_state=True, check_values=False,
                             chunk_size=chunk_size, **inp)
        loss = o.float().sum() + sum(t.float().sum() for t in state_tensors(final))
        leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(loss, leaves, allow_unused=True)
    return float(fwd.get_total_flops()), float(step.get_total_flops())


def _nbytes(tensors) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


def step_floor(model: str, B: int, T: int, H: int, D: int, *, shape: str = "", dtype=torch.bfloat16,
               count_len: int | None = None, chunk_size: int = 64, peak_flops: float = PEAK_FLOPS,
               bandwidth: float = BANDWIDTH) -> Floor:
    """The floors of one `fw.chunk` step of `model` at [B, T, H, D] with inputs in `dtype` (see the module doc)."""
    for name, val in (("B", B), ("T", T), ("H", H), ("D", D)):
        check_int(name, val, low=1)
    check_int("count_len", count_len, low=1, optional=True)
    if count_len is not None and count_len < T and count_len % chunk_size:
        raise InputError(f"count_len must be a multiple of chunk_size={chunk_size}, got {count_len}")
    Tc = T if count_len is None else min(T, count_len)
    fwd, step = count_step_flops(model, Tc, D, chunk_size=chunk_size)
    scale = B * H * T / Tc
    inp, state = _leaves(model, T, D, dtype, "meta", B, H)
    inputs = _nbytes(inp.values())
    v = inp["v"]
    out = float(v.numel() * v.element_size())  # o has v's shape and dtype
    st = _nbytes(state_tensors(state)) if state is not None else float(B * H * D * D * 4)
    fwd_bytes = inputs + out + 2 * st
    step_bytes = 3 * inputs + 2 * out + 4 * st
    t_flops, t_bytes = step * scale / peak_flops, step_bytes / bandwidth
    return Floor(model, shape, B, T, H, D, fwd * scale, step * scale, fwd_bytes, step_bytes,
                 1e3 * max(t_flops, t_bytes), "FLOPs" if t_flops >= t_bytes else "bytes")


def floors_table(models=DEEP_MEMORIES, shapes=tuple(SHAPES), **kw) -> list[Floor]:
    """`step_floor` of every model at every named shape of SHAPES."""
    for s in shapes:
        if s not in SHAPES:
            raise InputError(f"shapes must be among {list(SHAPES)}, got {s!r}")
    return [step_floor(m, *SHAPES[s], shape=s, **kw) for s in shapes for m in models]


@dataclass
class NSCount:
    """Muon's Newton–Schulz in one `fw.chunk` step of a model at one shape, for one Gram side r: how many r × r
    iterations (one per token and weight matrix; `chunkwise.minibatch._newton_schulz_gram`) the forward runs, how many
    the forward + backward runs (the backward recomputes them: `_muon_step` checkpoints them), and their counted FLOPs
    (products only, as `count_step_flops`) in the forward and in the forward + backward."""
    model: str
    shape: str
    r: int
    steps: int
    fwd_calls: int  # r × r Gram matrices iterated in the forward (B·T·H per weight matrix of side r)
    step_calls: int  # … in the forward + backward (the forward's, then the backward's recompute)
    fwd_flops: float
    step_flops: float


def count_newton_schulz(model: str, B: int, T: int, H: int, D: int, *, shape: str = "",
                        chunk_size: int = 64) -> list[NSCount]:
    """The Newton–Schulz iterations of one `fw.chunk` step of `model` at [B, T, H, D] by Gram side (empty for a model
    without Muon), counted on the meta device: calls by wrapping the torch iteration
    (`chunkwise.minibatch._newton_schulz_gram`, which the torch form runs for every G), FLOPs as the difference of
    `count_step_flops` with the iteration at that side replaced by a product-free stand-in of the same shape (so what
    autograd and the backward's recompute add is counted too). Counted at one sequence and head, scaled by B·H."""
    from ..chunkwise import minibatch

    real = minibatch._newton_schulz_gram
    seen: dict[tuple[int, int], int] = {}
    phase = {"name": "fwd"}

    def counting(G, steps, *args):
        key = (G.shape[-1], steps)
        seen[key] = seen.get(key, 0) + G.numel() // (G.shape[-1] ** 2)
        return real(G, steps, *args)

    inp, state = _leaves(model, T, D, torch.float32, "meta")
    counts: dict[tuple[int, int], list[int]] = {}
    try:
        minibatch._newton_schulz_gram = counting
        for phase["name"] in ("fwd", "step"):
            seen.clear()
            o, final = api.chunk(model, initial_state=state, output_final_state=True, check_values=False,
                                 chunk_size=chunk_size, **inp)
            if phase["name"] == "step":
                loss = o.float().sum() + sum(t.float().sum() for t in state_tensors(final))
                leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
                torch.autograd.grad(loss, leaves, allow_unused=True)
            for key, n in seen.items():
                counts.setdefault(key, [0, 0])[0 if phase["name"] == "fwd" else 1] = n
        full = count_step_flops(model, T, D, chunk_size=chunk_size)
        out = []
        for (r, steps), (nf, ns) in sorted(counts.items()):
            minibatch._newton_schulz_gram = lambda G, s, *args, r=r: G * 1.0 if G.shape[-1] == r else real(G, s, *args)
            less = count_step_flops(model, T, D, chunk_size=chunk_size)
            out.append(NSCount(model, shape, r, steps, nf * B * H, ns * B * H, (full[0] - less[0]) * B * H,
                               (full[1] - less[1]) * B * H))
    finally:
        minibatch._newton_schulz_gram = real
    return out


def newton_schulz_table(models=("atlas",), shapes=tuple(SHAPES)) -> str:
    """`count_newton_schulz` of `models` at the named shapes as a markdown table, beside each model's whole step."""
    lines = ["| model | shape | Gram side r | NS calls fwd | NS calls fwd+bwd | NS GFLOP fwd | NS GFLOP fwd+bwd | "
             "step GFLOP fwd+bwd | NS share |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in shapes:
        B, T, H, D = SHAPES[s]
        for m in models:
            step = count_step_flops(m, T, D)[1] * B * H
            for c in count_newton_schulz(m, B, T, H, D, shape=s):
                lines.append(f"| {m} | {s} {B}×{T}×{H}×{D} | {c.r} | {c.fwd_calls:,} | {c.step_calls:,} | "
                             f"{c.fwd_flops / 1e9:,.1f} | {c.step_flops / 1e9:,.1f} | {step / 1e9:,.1f} | "
                             f"{c.step_flops / step:.1%} |")
    return "\n".join(lines)


HEADER = ("| model | shape B×T×H×D | fwd GFLOP | fwd+bwd GFLOP | fwd+bwd MB | floor ms (fwd+bwd) | set by | "
          "× gated DeltaNet's floor |\n|---|---|---:|---:|---:|---:|---|---:|")


def _markdown(rows: list[Floor]) -> str:
    base = {r.shape: r.floor_ms for r in rows if r.model == "gated_deltanet"}
    lines = [HEADER]
    for r in rows:
        ratio = f"{r.floor_ms / base[r.shape]:.1f}×" if r.shape in base else "—"
        lines.append(f"| {r.model} | {r.shape} {r.B}×{r.T}×{r.H}×{r.D} | {r.fwd_flops / 1e9:,.1f} | "
                     f"{r.step_flops / 1e9:,.1f} | {r.step_bytes / 1e6:,.1f} | {r.floor_ms:.3f} | {r.bound} | "
                     f"{ratio} |")
    return "\n".join(lines)


def run_floors(models=None, shapes=None, out_dir: str | None = None, **kw) -> list[Floor]:
    """Print the floors table (and write floors.md / floors.json under out_dir); None: every deep memory and gated
    DeltaNet, both shapes."""
    rows = floors_table(tuple(models or DEEP_MEMORIES), tuple(shapes or SHAPES), **kw)
    text = _markdown(rows)
    print(text)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "floors.md").write_text(text + "\n")
        (path / "floors.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows
