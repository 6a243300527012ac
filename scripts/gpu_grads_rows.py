"""The delta class's gradient kernel with each chunk's rows split over programs (`_grads_rows_kernel`,
util.LAUNCH["delta_fused_grads_rows"], issue 32) against the one-program kernel (`_grads_kernel`, today's default) on
one GPU: each launch variant checked against the fp32 (and float64) torch chunk form on every gradient, then the fused
pipeline's forward + backward timed at the LM preset's shape, then one forward + backward profiled by kernel.

    python3 scripts/gpu_grads_rows.py --out $OUT/grads                       # launch files, check, time, profile
    python3 scripts/gpu_grads_rows.py --out $OUT/grads --phases time --variants off br16w4 --repeats 20
    TRITON_INTERPRET=1 python3 scripts/gpu_grads_rows.py --smoke --out /tmp/grads   # the check at tiny shapes, CPU

Variants (util.LAUNCH updates, VARIANTS; sm_90 registers / spills / shared memory at the preset, bf16, scalar gate,
from `scripts/sm90_report.py` with Triton 3.6 — docs/kernel_notes.md "The gradient kernel's rows over programs"):
off — `_grads_kernel`, one 8-warp program a chunk and q/k head (255 registers, 8 B spilled, 122 KB: one CTA an SM);
rowsums — the same kernel without its Q Kᵀ, K Qᵀ, K Kᵀ products (ROWSUMS 1: 13 → 11 products; 254 registers, none
spilled, 98 KB: still one CTA an SM);
br16w4 — 16 rows a program, 4 warps, 1 stage (249 registers, none spilled, 18 KB: two CTAs an SM); br16w8r128 —
16 rows, 8 warps, 2 stages, ptxas capped at 128 registers (28 B spilled, 28 KB: two CTAs of 8 warps an SM); br16w8 —
16 rows, 8 warps, 1 stage, no cap (one CTA an SM: more programs alone); br32w8 — 32 rows, 8 warps, 1 stage (one CTA).

Phases (each writes its JSON under --out after every row, so a killed call keeps what it did):
  launch   each variant's table as `launch_<variant>.json` (for `fastweights bench train --launch`);
  check    per case and variant: o, the final state and every gradient (q, k, v, g, β, S_0; a fixed random projection
           of o and S as the loss) against the torch chunk form on the same rounded values — in fp32 for bf16 inputs,
           in float64 for fp32 inputs (the fused pipeline forced: "auto" stages fp32) — as the largest relative error
           (max |diff| / max |ref|), next to the `off` variant's; ok: within tests/tolerances.py's
           TRITON_DELTA_LOW_REL (bf16) / CHUNK_LONG_F32_REL (fp32). Cases, in order: the preset (B 8, T 2048, H 6,
           K = V = 128, bf16, gated and ungated); varlen with an empty and a length-1 sequence and odd lengths, 16
           value heads over 4 q/k heads (bf16); two chained calls (split at an odd token) against one; the varlen
           cases with fp32 inputs (not with --no-fp32);
  time     per (model, variant): the fused pipeline's forward and forward + backward at --shape (default the preset's
           micro-batch, B 8, T 2048, H 6, D 128, bf16), median of --repeats after two warm calls;
  profile  per (model, variant): one forward + backward under torch.profiler, the device time by kernel name (the
           gradient kernels, the cumsum that finishes dg with the rows kernel, the rest of the backward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
#: Each variant's util.LAUNCH update (load_launch's table).
VARIANTS = {"off": {"delta_fused_grads_rows": {"ON": 0}, "delta_fused_grads": {"ROWSUMS": 0}},
            "rowsums": {"delta_fused_grads": {"ROWSUMS": 1}},
            "br16w4": {"delta_fused_grads_rows": {"ON": 1, "BR": 16, "num_warps": 4, "num_stages": 1,
                                                  "MAXNREG": 0}},
            "br16w8r128": {"delta_fused_grads_rows": {"ON": 1, "BR": 16, "num_warps": 8, "num_stages": 2,
                                                      "MAXNREG": 128}},
            "br16w8": {"delta_fused_grads_rows": {"ON": 1, "BR": 16, "num_warps": 8, "num_stages": 1,
                                                  "MAXNREG": 0}},
            "br32w8": {"delta_fused_grads_rows": {"ON": 1, "BR": 32, "num_warps": 8, "num_stages": 1,
                                                  "MAXNREG": 0}}}
MODELS = {"gated_deltanet": "scalar", "deltanet": "none"}
#: --smoke (the check phase on the CPU under the interpreter): tiny shapes and a chunk of 32 (16-row blocks: two)
RUN = {"dev": "cuda", "chunk": 64, "smoke": False, "no_fp32": False}


def _variant(name):
    """A context: util.LAUNCH updated with the variant's table, restored after."""
    import contextlib

    from fastweights.kernels.triton.common.util import LAUNCH, load_launch

    @contextlib.contextmanager
    def ctx():
        old = load_launch(VARIANTS[name])
        try:
            yield
        finally:
            LAUNCH.update(old)
    return ctx()


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _inputs(gate, B, T, H, Hq, D, dtype, seed, N=None):
    """q, k [B, T, H_q, D] (unit keys), v [B, T, H, D] rounded to `dtype`; β ∈ (0, 1), the log-decay g ≤ 0 (gate
    "scalar") [B, T, H] and S_0 [N or B, H, D, D] in fp32: CPU tensors, drawn from `seed`."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, Hq, D, generator=gen),
         "k": F.normalize(torch.randn(B, T, Hq, D, generator=gen), dim=-1),
         "v": torch.randn(B, T, H, D, generator=gen), "beta": torch.rand(B, T, H, generator=gen),
         "S0": 0.3 * torch.randn(N or B, H, D, D, generator=gen)}
    if gate == "scalar":
        x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    return x


def _leaves(x, dtype=None):
    """x on CUDA as gradient leaves (cast to `dtype`, or kept)."""
    return {n: t.to(device=RUN["dev"], dtype=dtype or t.dtype).detach().requires_grad_(True) for n, t in x.items()}


def _triton(d, *, cu=None, chunk=None):
    """(o, S) of the fused pipeline (`chunk_delta_triton`, forward and backward fused, as "auto" runs bf16)."""
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.delta import chunk_delta_triton

    D = d["q"].shape[-1]
    return chunk_delta_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], scale=D ** -0.5,
                              initial_state=d["S0"], output_final_state=True, chunk_size=chunk or RUN["chunk"],
                              cu_seqlens=cu, pipeline=DeltaPipeline("fused", "fused"))


def _torch(d, *, cu=None, chunk=None):
    """(o, S) of the torch chunk form (q, k repeated over the group's value heads)."""
    from fastweights.chunkwise import chunk_delta

    rep = d["v"].shape[2] // d["q"].shape[2]
    D = d["q"].shape[-1]
    return chunk_delta(d["q"].repeat_interleave(rep, 2), d["k"].repeat_interleave(rep, 2), d["v"], g=d.get("g"),
                       beta=d["beta"], scale=D ** -0.5, initial_state=d["S0"], output_final_state=True,
                       chunk_size=chunk or RUN["chunk"], cu_seqlens=cu, inverse="solve")


def _chained(d, *, split=1001):
    """(o, S) of two fused calls, [0, split) then [split, T) from the first's final state."""
    import torch

    split = 33 if RUN["smoke"] else split
    first = {n: (t if n == "S0" else t[:, :split]) for n, t in d.items()}
    o1, S1 = _triton(first)
    second = {n: (S1 if n == "S0" else t[:, split:]) for n, t in d.items()}
    o2, S2 = _triton(second)
    return torch.cat([o1, o2], dim=1), S2


def _grads(fn, d, seed, **kw):
    """(o, S, {leaf: gradient}) of fn(d) under a fixed random projection of o and S (float64 loss)."""
    import torch

    o, S = fn(d, **kw)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    ws = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device)
    loss = (o.double() * wo).sum() + (S.double() * ws).sum()
    names = list(d)
    gs = torch.autograd.grad(loss, [d[n] for n in names])
    return o.detach(), S.detach(), {n: g.detach() for n, g in zip(names, gs)}


def _errors(got, ref) -> dict:
    out = {"o": _rel(got[0], ref[0]), "S": _rel(got[1], ref[1])}
    out.update({f"d{n}": _rel(got[2][n], ref[2][n]) for n in ref[2]})
    return out


def _dump(out, name, rows):
    with open(os.path.join(out, name), "w") as f:
        json.dump(rows, f, indent=1)


def phase_launch(variants, out):
    for name in variants:
        with open(os.path.join(out, f"launch_{name}.json"), "w") as f:
            json.dump(VARIANTS[name], f)
        print("launch", name, json.dumps(VARIANTS[name]), flush=True)


def _cases():
    """(name, gate, dtype name, inputs, cu lengths or None, what: "one" or "chained") of the check."""
    import torch

    smoke = RUN["smoke"]
    preset = (2, 70, 2, 2, 16) if smoke else (8, 2048, 6, 6, 128)
    lengths = [20, 0, 1, 37, 9] if smoke else [1000, 0, 1, 2047, 64, 63, 900]
    grouped = (4, 2, 16) if smoke else (16, 4, 128)  # H, H_q, D
    cases = []
    for model, gate in MODELS.items():
        cases.append((f"{model} preset", gate, "bfloat16", _inputs(gate, *preset, torch.bfloat16, 1), None, "one"))
    for model, gate in MODELS.items():
        x = _inputs(gate, 1, sum(lengths), *grouped, torch.bfloat16, 2, N=len(lengths))
        cases.append((f"{model} varlen grouped", gate, "bfloat16", x, lengths, "one"))
    cases.append(("gated_deltanet chained", "scalar", "bfloat16", _inputs("scalar", *preset, torch.bfloat16, 3), None,
                  "chained"))
    if not RUN["no_fp32"]:  # last: fp32 compiles are the slowest (a timed-out call keeps the rows before them)
        for model, gate in MODELS.items():
            x = _inputs(gate, 1, sum(lengths), *grouped, torch.float32, 2, N=len(lengths))
            cases.append((f"{model} varlen grouped", gate, "float32", x, lengths, "one"))
    return cases


def phase_check(variants, out):
    import torch

    from tests.tolerances import CHUNK_LONG_F32_REL, TRITON_DELTA_LOW_REL

    rows = []
    for case, _gate, dtype_name, x, lengths, what in _cases():
        bf16 = dtype_name == "bfloat16"
        cu = None if lengths is None else torch.tensor([0] + lengths).cumsum(0).to(RUN["dev"], torch.int32)
        ref_dtype = torch.float32 if bf16 else torch.float64
        seed = 11
        ref = _grads(_torch, _leaves(x, ref_dtype), seed, cu=cu)
        tol = TRITON_DELTA_LOW_REL[torch.bfloat16] if bf16 else CHUNK_LONG_F32_REL
        base = None
        for name in variants:
            try:
                with _variant(name):
                    leaves = _leaves(x)
                    got = _grads(_chained if what == "chained" else _triton, leaves, seed,
                                 **({} if what == "chained" else {"cu": cu}))
                err = _errors(got, ref)
                row = dict(case=case, dtype=dtype_name, variant=name, ref=str(ref_dtype).split(".")[-1],
                           worst=max(err.values()), ok=max(err.values()) <= tol, tol=tol, errors=err)
                if base is None and name == "off":
                    base = got
                elif base is not None:
                    row["vs_off"] = max(_errors(got, base).values())
                del got
            except Exception as e:  # a variant that fails is a result
                row = dict(case=case, dtype=dtype_name, variant=name, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print("check", json.dumps(row), flush=True)
            _dump(out, "check.json", rows)
        del ref, base
        if RUN["dev"] == "cuda":
            torch.cuda.empty_cache()


def _case(model, shape, seed=5):
    """(run, leaves) of the fused pipeline at shape (B, T, H, D), bf16: run() returns o."""
    import torch

    B, T, H, D = shape
    d = _leaves(_inputs(MODELS[model], B, T, H, H, D, torch.bfloat16, seed))

    def run():
        return _triton(d)[0]

    return run, list(d.values())


def phase_time(variants, shape, out, repeats):
    import torch

    from fastweights.bench.speed import fwd_bwd, median_ms

    rows = []
    dev = torch.device("cuda")
    for model in MODELS:
        for name in variants:
            try:
                with _variant(name):
                    run, leaves = _case(model, shape)
                    fwd, fb = fwd_bwd(run, leaves)
                    row = dict(model=model, variant=name, shape=list(shape), fwd_ms=median_ms(fwd, dev, 2, repeats),
                               fwdbwd_ms=median_ms(fb, dev, 2, repeats))
                    row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
            except Exception as e:
                row = dict(model=model, variant=name, shape=list(shape), error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print("time", json.dumps(row), flush=True)
            _dump(out, "time.json", rows)
            torch.cuda.empty_cache()


def phase_profile(variants, shape, out):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastweights.bench.speed import fwd_bwd

    rows = []
    for model in MODELS:
        for name in variants:
            with _variant(name):
                run, leaves = _case(model, shape)
                _, fb = fwd_bwd(run, leaves)
                fb()
                fb()  # compiled and warm
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fb()
                    torch.cuda.synchronize()
            kernels = {}
            for ev in prof.key_averages():  # self time on the device: the kernels' own
                t = getattr(ev, "self_device_time_total", None)
                t = getattr(ev, "self_cuda_time_total", 0) if t is None else t
                if t:
                    kernels[ev.key] = dict(us=round(t, 1), count=ev.count)
            top = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:20])
            grads_us = sum(v["us"] for k, v in kernels.items() if "_grads" in k)
            row = dict(model=model, variant=name, shape=list(shape), grads_us=round(grads_us, 1),
                       total_us=round(sum(v["us"] for v in kernels.values()), 1), kernels=top)
            rows.append(row)
            print("profile", json.dumps(row)[:2000], flush=True)
            _dump(out, "profile.json", rows)
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/grads_rows")
    ap.add_argument("--phases", nargs="+", default=["launch", "check", "time", "profile"],
                    choices=["launch", "check", "time", "profile"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--shape", nargs=4, type=int, default=[8, 2048, 6, 128], metavar=("B", "T", "H", "D"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="the check phase only, tiny shapes, CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--no-fp32", action="store_true", help="the check without its fp32-input cases (their compiles)")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    RUN["no_fp32"] = a.no_fp32
    if a.smoke:
        RUN.update(dev="cpu", chunk=32, smoke=True)
        a.phases = ["launch", "check"]
    os.makedirs(a.out, exist_ok=True)
    variants = ["off"] + [v for v in a.variants if v != "off"]  # off first: the others' vs_off
    if "launch" in a.phases:
        phase_launch(variants, a.out)
    if "check" in a.phases:
        phase_check(variants, a.out)
    if "time" in a.phases:
        phase_time(variants, tuple(a.shape), a.out, a.repeats)
    if "profile" in a.phases:
        phase_profile(variants, tuple(a.shape), a.out)


if __name__ == "__main__":
    main()
