"""The deep memories' loop kernels (TTT-Linear, TTT-MLP, Titans) on one GPU: each launch variant — tl.dot precision
("ieee", "tf32x3", "tf32": `rows.pinned("generic", precision=)`) × num_warps (the sequential loop sites, SITES) —
compiled, checked and timed beside gated DeltaNet and fla's `chunk_ttt_linear` (issue 36).

    python3 scripts/gpu_memories.py --out runs/memories                       # every phase
    python3 scripts/gpu_memories.py --phases check time --variants ieee:4 tf32x3:8
    python3 scripts/gpu_memories.py --models titans --shapes small --phases check time --check-dtype bfloat16 \
        --check-dims 64 --variants ieee:8 ieee:8:titans_single_bwd.KEEP=1 ieee:8:titans_single_bwd.KEEP=2

Phases, in order (each writes its own file under --out, so a killed call keeps what it did):
  warm     fla's `chunk_ttt_linear` once per shape, one process per shape in parallel (fla autotunes for minutes on its
           first call; run with TRITON_CACHE_AUTOTUNING=1 so the time phase reads the tuned configs from the cache);
  compile  one process per variant (in parallel, each its own Triton cache entries) runs each model's kernels once
           at every timed shape's constexprs (D, H) on a few tokens: the timing phase then finds them compiled;
  check    per variant and model: `fw.chunk(..., backend="triton")` against the torch row in float64 on the same
           inputs (B 2, T --check-len (75: odd, a ragged last mini-batch), H 2, D 64 and 128; q, k, v in
           --check-dtype, the reference on the same rounded values): the largest relative error of the output, the
           final state and every input's gradient (NaN counts as an error of inf);
  peak     Titans, OmegaNet and ATLAS (`fw.chunk`, the rows "auto" picks) at each shape: forward + backward ms and
           torch.cuda.max_memory_allocated, with and without `minibatch.checkpoint_chain(k)` (--chain k), one process
           per (model, shape, k) so an out-of-memory row is a result and frees everything;
  time     `fw.chunk` forward and forward + backward per (shape, model, variant), bf16, median of --repeats after one
           warm call (bench.speed's cases), with gated DeltaNet's Triton row and fla's `chunk_ttt_linear` (when fla
           is importable; the peer, installed only on the GPU machine) on the same inputs in the same process.

Shapes: issue 36's small one (B 64, T 512, H 2, K = V = 64) and the LM's (B 4, T 4096, H 16, K = V = 128).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHAPES = {"small": (64, 512, 2, 64), "lm": (4, 4096, 16, 128)}
MODELS = ("ttt_linear", "ttt_mlp", "titans")
#: The sequential loop kernels' launch sites, whose num_warps a variant sets (TTT-Linear's and Titans' parallel readouts
#: and backward pre-passes keep util.LAUNCH's: scripts/gpu_kernels.py sweeps them)
SITES = {"ttt_linear": ("ttt_linear_fwd", "ttt_linear_bwd"), "ttt_mlp": ("ttt_mlp_fwd", "ttt_mlp_bwd"),
         "titans": ("titans_fwd", "titans_bwd", "titans_single_fwd", "titans_single_bwd")}


def _variant(text: str) -> tuple[str, int, dict, str]:
    """"precision:warps[:site.KEY=value…]" → (precision, warps, {site: {KEY: value}}, text): the launch-table keys
    after the warps (colon-separated, integers) hold around the variant's rows too, e.g.
    "ieee:8:titans_single_bwd.KEEP=2" (util.LAUNCH "titans_single_bwd" KEEP 2)."""
    prec, warps, *keys = text.split(":")
    table: dict = {}
    for item in keys:
        name, _, value = item.partition("=")
        site, _, key = name.partition(".")
        if not site or not key or not value:
            raise SystemExit(f"a variant's launch key must read site.KEY=value, got {item!r} in {text!r}")
        table.setdefault(site, {})[key] = int(value)
    return prec, int(warps or 4), table, text


def _apply(variant):
    """A context: the generic row pinned at the variant's precision, the loop kernels' launch sites at its warps."""
    import contextlib

    from fastweights.kernels import rows
    from fastweights.kernels.triton.common.util import LAUNCH, load_launch

    prec, warps, keys, _ = variant

    @contextlib.contextmanager
    def ctx():
        sites = {s: {"num_warps": warps} for pair in SITES.values() for s in pair}
        for site, cfg in keys.items():
            sites[site] = {**sites.get(site, {}), **cfg}
        old = load_launch(sites)
        try:
            with rows.pinned("generic", precision=prec):
                yield
        finally:
            LAUNCH.update(old)
    return ctx()


def _inputs(model, B, T, H, D, dtype, device, seed=0):
    """`fw.example_inputs` drawn in fp32 on the CPU (the same values for every dtype), as trainable leaves of `dtype`
    on `device`; the initial MemoryState moved there (fp32, or float64 for a float64 reference)."""
    import torch

    import fastweights as fw
    from fastweights.state import state_map

    gen = torch.Generator(device="cpu").manual_seed(seed)
    inp = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float32,
                            generator=gen)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    out = {}
    for name, x in inp.items():
        if isinstance(x, torch.Tensor):
            out[name] = x.detach().to(device=device, dtype=dtype).requires_grad_(True)
        else:
            out[name] = state_map(x, lambda t: t.detach().to(device=device, dtype=sdt))
    return out


def _run(model, inp, backend):
    import torch

    import fastweights as fw

    state = inp.get("initial_state")
    kw = {k: v for k, v in inp.items() if k != "initial_state"}
    o, S = fw.chunk(model, initial_state=state, output_final_state=True, backend=backend, check_values=False, **kw)
    leaves = [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(o.device)
    weights = [t for t in (S.weights if S is not None else ()) if isinstance(t, torch.Tensor)]
    loss = (o.double() * w).sum() + sum((t.double() ** 2).sum() * 1e-3 for t in weights)
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), [t.detach() for t in weights], [g.detach() for g in grads]


def warm_one(shape: str) -> None:
    """(the warm phase's worker) fla's chunk_ttt_linear forward + backward once at `shape`."""
    import torch

    from fastweights.bench.speed import fla_case, fwd_bwd

    run, leaves = fla_case("ttt_linear", *SHAPES[shape], torch.bfloat16, "cuda")
    fwd_bwd(run, leaves)[1]()
    torch.cuda.synchronize()


def phase_warm(out):
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--warm-one", s], cwd=ROOT) for s in SHAPES]
    codes = [p.wait() for p in procs]
    line = f"warm: fla chunk_ttt_linear at {list(SHAPES)} in {time.perf_counter() - t0:.0f} s, exit codes {codes}"
    print(line, flush=True)
    with open(os.path.join(out, "warm.txt"), "w") as f:
        f.write(line + "\n")


def compile_one(variant_text: str) -> None:
    """(the compile phase's worker) every model's kernels once at each timed shape's constexprs."""
    import torch

    variant = _variant(variant_text)
    with _apply(variant):
        for model in MODELS:
            for (_, _, H, D) in SHAPES.values():
                # bf16 q, k, v, the gates and the rest fp32 (as a layer passes them; fw.chunk refuses bf16 gates)
                inp = _rounded(_inputs(model, 1, 20, H, D, torch.float32, "cuda"), torch.bfloat16, torch.bfloat16)
                _run(model, inp, "triton")
    torch.cuda.synchronize()


def phase_compile(variants, out, launch=None):
    t0 = time.perf_counter()
    extra = ["--launch", launch] if launch else []
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-one", v, "--models", *MODELS,
                               "--shapes", *SHAPES, *extra], cwd=ROOT) for v in variants]
    codes = [p.wait() for p in procs]
    line = f"compile: {len(variants)} variants in {time.perf_counter() - t0:.0f} s, exit codes {codes}"
    print(line, flush=True)
    with open(os.path.join(out, "compile.txt"), "w") as f:
        f.write(line + "\n")


def _rel(a, b):
    import torch

    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


PEAK_MODELS = ("titans", "omeganet", "atlas")


def peak_one(spec: str) -> None:
    """(the peak phase's worker) "model:shape:k": one fwd+bwd row, printed as one JSON line."""
    import torch

    from fastweights.bench.speed import fastweights_case, fwd_bwd, median_ms
    from fastweights.chunkwise import minibatch

    model, shape, k = spec.split(":")
    row = dict(model=model, shape=shape, chain=int(k))
    try:
        minibatch.checkpoint_chain(int(k))
        run, leaves = fastweights_case(model, "chunk", *SHAPES[shape], torch.bfloat16, "cuda", 64)
        _, fb = fwd_bwd(run, leaves)
        fb()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row["fwdbwd_ms"] = median_ms(fb, torch.device("cuda"), 1, 3)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
    except Exception as e:  # a row that fails is a result
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print("PEAK " + json.dumps(row), flush=True)


def phase_peak(out, chains, models=PEAK_MODELS):
    results = []
    for model in models:
        for shape in SHAPES:
            for k in chains:
                p = subprocess.run([sys.executable, __file__, "--peak-one", f"{model}:{shape}:{k}"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=900)
                rows = [json.loads(line[5:]) for line in p.stdout.splitlines() if line.startswith("PEAK ")]
                row = rows[0] if rows else dict(model=model, shape=shape, chain=k,
                                                error=f"exit {p.returncode}: {p.stderr[-300:]}")
                results.append(row)
                print("peak", json.dumps(row), flush=True)
                with open(os.path.join(out, "peak.json"), "w") as f:
                    json.dump(results, f, indent=1)


def _rounded(inp, dtype, like):
    """`inp` with q, k, v rounded to `dtype` and stored as `like` (trainable leaves): the same rounded values for the
    kernels' low-precision run and the float64 reference."""
    out = dict(inp)
    for name in ("q", "k", "v"):
        out[name] = inp[name].detach().to(dtype).to(like).requires_grad_(True)
    return out


def phase_check(variants, out, dtype_name="float32", T=75, dims=(64, 128)):
    """Per D (of `dims`), model and variant: the Triton row against the torch row in float64 on the same inputs (q, k,
    v rounded to `dtype_name` for both; the kernels get them in that dtype, the other tensors fp32), B 2, T, H 2."""
    import torch

    dtype = getattr(torch, dtype_name)
    results = []
    for D in dims:
        for model in MODELS:
            ref_in = _rounded(_inputs(model, 2, T, 2, D, torch.float64, "cuda", seed=D), dtype, torch.float64)
            ref = _run(model, ref_in, "torch")
            for variant in variants:
                inp = _rounded(_inputs(model, 2, T, 2, D, torch.float32, "cuda", seed=D), dtype, dtype)
                try:
                    with _apply(variant):
                        got = _run(model, inp, "triton")
                    errs = {"o": _rel(got[0], ref[0]),
                            "state": max((_rel(a, b) for a, b in zip(got[1], ref[1])), default=0.0),
                            "grads": max(_rel(a, b) for a, b in zip(got[2], ref[2]))}
                    row = dict(model=model, D=D, T=T, dtype=dtype_name, variant=variant[3], **errs)
                except Exception as e:  # a variant that fails is a result
                    row = dict(model=model, D=D, T=T, dtype=dtype_name, variant=variant[3],
                               error=str(e)[:300])
                results.append(row)
                print("check", json.dumps(row), flush=True)  # after each row: a killed call keeps it
                with open(os.path.join(out, f"check_{dtype_name}_T{T}.json"), "w") as f:
                    json.dump(results, f, indent=1)


def phase_time(variants, out, repeats):
    import importlib.util

    import torch

    from fastweights.bench.speed import fastweights_case, fla_case, fwd_bwd, median_ms

    have_fla = importlib.util.find_spec("fla") is not None
    results = []

    def record(shape, model, impl, make):  # make(B, T, H, D) -> a case (run, leaves)
        try:
            run, leaves = make(*SHAPES[shape])
            fwd, fb = fwd_bwd(run, leaves)
            row = dict(shape=shape, model=model, impl=impl, fwd_ms=median_ms(fwd, torch.device("cuda"), 1, repeats),
                       fwdbwd_ms=median_ms(fb, torch.device("cuda"), 1, repeats))
        except Exception as e:
            row = dict(shape=shape, model=model, impl=impl, error=f"{type(e).__name__}: {e}"[:300])
        results.append(row)
        print("time", json.dumps(row), flush=True)
        with open(os.path.join(out, "time.json"), "w") as f:
            json.dump(results, f, indent=1)
        torch.cuda.empty_cache()

    def ours(model):
        return lambda B, T, H, D: fastweights_case(model, "chunk_triton", B, T, H, D, torch.bfloat16, "cuda", 64)

    for shape in SHAPES:
        record(shape, "gated_deltanet", "triton", ours("gated_deltanet"))
        if have_fla:
            record(shape, "ttt_linear", "fla chunk_ttt_linear",
                   lambda B, T, H, D: fla_case("ttt_linear", B, T, H, D, torch.bfloat16, "cuda"))
        for model in MODELS:
            for variant in variants:
                # the pin and the launch table are process state: the variant holds around the whole row
                with _apply(variant):
                    record(shape, model, variant[3], ours(model))


def main():
    global MODELS, SHAPES  # narrowed to the run's selection (--models, --shapes) for every phase
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/memories")
    ap.add_argument("--phases", nargs="+", default=["compile", "check", "time"],
                    choices=["warm", "compile", "check", "time", "peak"])
    ap.add_argument("--chain", nargs="+", type=int, default=[0, 4],
                    help="the peak phase's checkpoint_chain values (0: off)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--peak-models", nargs="+", default=list(PEAK_MODELS), choices=list(PEAK_MODELS),
                    help="the peak phase's models")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["ieee:4", "ieee:8", "tf32x3:4", "tf32x3:8", "tf32:8"],
                    help="precision:num_warps[:site.KEY=value…] of the loop kernels (the launch-table keys after "
                    "the warps hold around the variant's rows: e.g. ieee:8:titans_single_bwd.KEEP=2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the check phase's q, k, v dtype (the float64 reference takes the same rounded values)")
    ap.add_argument("--check-len", type=int, default=75, help="the check phase's sequence length T")
    ap.add_argument("--check-dims", nargs="+", type=int, default=[64, 128], help="the check phase's head dims")
    ap.add_argument("--launch", metavar="PATH", help="a launch table (JSON, util.load_launch) applied first, e.g. "
                    '{"titans_bwd": {"READ_TERMS": 1}} (a variant still sets the sequential sites\' warps)')
    ap.add_argument("--compile-one", metavar="VARIANT", help=argparse.SUPPRESS)
    ap.add_argument("--warm-one", metavar="SHAPE", help=argparse.SUPPRESS)
    ap.add_argument("--peak-one", metavar="SPEC", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    MODELS, SHAPES = tuple(a.models), {s: SHAPES[s] for s in a.shapes}
    if a.launch:
        from fastweights.kernels.triton.common.util import load_launch

        load_launch(a.launch)
    if a.compile_one:
        return compile_one(a.compile_one)
    if a.warm_one:
        return warm_one(a.warm_one)
    if a.peak_one:
        return peak_one(a.peak_one)
    os.makedirs(a.out, exist_ok=True)
    variants = [_variant(v) for v in a.variants]
    for phase in a.phases:
        if phase == "warm":
            phase_warm(a.out)
        elif phase == "peak":
            phase_peak(a.out, a.chain, a.peak_models)
        elif phase == "compile":
            phase_compile(a.variants, a.out, a.launch)
        elif phase == "check":
            phase_check(variants, a.out, a.check_dtype, a.check_len, tuple(a.check_dims))
        else:
            phase_time(variants, a.out, a.repeats)


if __name__ == "__main__":
    main()
