"""Each delta-class pipeline (`kernels.pipelines.DeltaPipeline`: staged, fused or split forward × staged or fused
backward) timed at the shapes an LM runs, few heads and long sequences included (issue 32: at the gpu-125m preset's
1×16384 the gated DeltaNet LM steps no faster than a transformer while its 8×2048 step is 1.5× cheaper; the sequential
kernels walk B·H·V/BV programs, 24 there for 132 SMs).

    python3 scripts/gpu_delta_pipelines.py [--out DIR] [--shapes 8x2048x6 1x16384x6 ...] [--model gated_deltanet]
    python3 scripts/gpu_delta_pipelines.py --shapes 8x2048x6 4x4096x16 --pipelines fused/fused split/fused \
        split/fused/kept --out $OUT       # issue 32: the fused forward against the split one (delta_split.py)
    python3 scripts/gpu_delta_pipelines.py --smoke     # on the CPU under TRITON_INTERPRET=1: tiny shapes

Per shape B×T×H (K = V = --dim, bf16, `fastweights.example_inputs` of --model: unit keys, its gates) and per pipeline
(--pipelines FORWARD/BACKWARD[/kept], kept: `recompute_states=False`; default every forward × backward):
the forward alone and forward + backward (a fixed random dO), the median of --repeats calls after --warmup, device
events around each (`bench.speed.step_times`), and the relative error of o and of every input gradient against the
rule's default pipeline on the same inputs (a launch config that miscompiles shows there). Writes pipelines.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from fastweights import example_inputs  # noqa: E402
from fastweights.bench.speed import step_times  # noqa: E402
from fastweights.kernels.pipelines import DELTA_FORWARDS, STAGES, DeltaPipeline, delta_pipeline, gate_kind  # noqa: E402
from fastweights.kernels.triton.common.util import LAUNCH, load_launch  # noqa: E402
from fastweights.kernels.triton.delta import chunk_delta_triton  # noqa: E402

PIPELINES = [DeltaPipeline(f, b) for f in DELTA_FORWARDS for b in STAGES]


def parse_pipeline(text: str) -> DeltaPipeline:
    """'split/fused' → DeltaPipeline("split", "fused"); a third field 'kept': the states kept
    (recompute_states=False)."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "kept"):
        raise argparse.ArgumentTypeError(f"FORWARD/BACKWARD[/kept], got {text!r}")
    return DeltaPipeline(parts[0], parts[1], recompute_states=len(parts) == 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def one_shape(model: str, B: int, T: int, H: int, D: int, args, device) -> list[dict]:
    inp = example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                         device=device, requires_grad=True, seed=0)
    inp.pop("initial_state", None)
    q, k, v = inp["q"], inp["k"], inp["v"]
    g, beta = inp.get("g"), inp.get("beta")
    leaves = [x for x in (q, k, v, g, beta) if x is not None and x.requires_grad]
    dO = torch.randn_like(v)
    default = delta_pipeline(gate=gate_kind(g), probe=False, decay_first=True, device_type=device.type,
                             dtype=q.dtype, K=D, V=D, C=64)

    def call(pipe):
        return chunk_delta_triton(q, k, v, g=g, beta=beta, scale=D ** -0.5, pipeline=pipe)[0]

    def grads(pipe):
        o = call(pipe)
        return [o, *torch.autograd.grad(o, leaves, dO)]

    ref = grads(default)
    rows = []
    # (pipeline, launch overrides): every pipeline at the table's launch, or with --launch-variants the rule's pipeline
    # under each variant (the first, {}, the table itself)
    cases = [(pipe, {}) for pipe in args.pipelines] if not args.launch_variants else \
        [(default, json.loads(v)) for v in ["{}", *args.launch_variants]]
    for pipe, variant in cases:
        row = dict(model=model, B=B, T=T, H=H, D=D, pipeline=pipe.name, default=pipe == default and not variant,
                   launch=variant)
        old = load_launch(variant)
        try:
            got = grads(pipe)
            row["rel_err"] = max(rel(a, b) for a, b in zip(got, ref))
            for _ in range(args.warmup):
                grads(pipe)
            with torch.no_grad():
                fwd = step_times(functools.partial(call, pipe), device, args.repeats)
            both = step_times(functools.partial(grads, pipe), device, args.repeats)
            row.update(fwd_ms=statistics.median(fwd), fwd_bwd_ms=statistics.median(both), fwd_min_ms=min(fwd),
                       fwd_bwd_min_ms=min(both))
        except Exception as e:  # noqa: BLE001 — a refusal or a failure is a result
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        finally:
            LAUNCH.update(old)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/delta_pipelines"))
    p.add_argument("--model", default="gated_deltanet")
    p.add_argument("--shapes", nargs="+", default=["8x2048x6", "4x4096x6", "1x16384x6", "4x4096x16", "1x32768x16"])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pipelines", nargs="+", type=parse_pipeline, default=PIPELINES, metavar="FWD/BWD[/kept]",
                   help="the pipelines timed (default: every forward × backward), e.g. fused/fused split/fused")
    p.add_argument("--launch-variants", nargs="+", default=None, metavar="JSON",
                   help="instead of --pipelines: the rule's pipeline under each launch override "
                        "(util.load_launch dicts, e.g. '{\"delta_fused_grads\": {\"num_warps\": 4}}'), each "
                        "checked against the table's")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shapes, args.dim, args.warmup, args.repeats = ["1x70x2"], 16, 0, 1
    device = torch.device("cpu" if args.smoke else "cuda")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes:
        B, T, H = (int(x) for x in shape.lower().split("x"))
        rows += one_shape(args.model, B, T, H, args.dim, args, device)
        with open(os.path.join(args.out, "pipelines.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
