"""One GPU call for the gated-linear class's fused pipeline (`fastweights.kernels.triton.gated_fused`, issue 23):
times first, then checks, then the cuda tests — staged against fused, side by side, in one process.

    timeout 470 python3 scripts/gpu_gated_fused.py --deadline 380   # on the H100; results under $OUT
    python3 scripts/gpu_gated_fused.py --dry-run --deadline 300  # plumbing only: CPU, the interpreter, tiny sizes

Stages (each result written under $OUT as soon as it is measured: results.json, log.txt, table.md, cuda_tests.txt):
1. env: GPU, SMs, torch, triton.
2. time: `fw.chunk(model, ..., backend="triton", check_values=False)` as layers call it (the benchmark's
   cases: `fastweights.bench.speed`), forward and forward + backward medians (CUDA events) of Mamba2, RetNet
   and GLA at B4 T4096 H16 D128 and B1 T32768 H16 D128, bf16: gated.PIPELINE "staged" against "fused".
3. check: the default fused config, forward and backward, against the fp32 torch
   chunk form (`chunkwise.chunk_gated`) on the same bf16/fp32 inputs: outputs, final states, every gradient
   (q, k, v, g, β, the initial state), no, scalar and diagonal decay (with β; at the first size also without,
   and the diagonal decay × 40, the exact path), at three sizes —
   bf16 B4 T300 H16 D128 (the anchor's specialization, BV 32), bf16 B1 T32768 H16 D128 (the long one's, BV 16),
   fp32 varlen T4075 H_q 4 | H 16 D128 with an empty and a length-1 sequence.
   Max relative errors printed; a failure is printed loudly, marked in the table, and the exit code is 1.
3b. variants: each --variants launch config (util.LAUNCH overrides, and "keep" = gated_fused.RECOMPUTE_STATES
   False) timed at the first shape (--long-variants, by default AQK = 1, at the second too), then checked as in 3
   at the first size (every gate, with β).
4. d256: K = V = 256 through the fused pipeline (FUSED_MAX_HEAD_DIM_CUDA lifted) in a subprocess (a fault there
   must not take this process down): bf16 B1 T4096 H4, against the fp32 torch form.
5. tests: `pytest -m cuda tests/kernels/test_triton_gated_fused.py` (after the timings: a timeout kills only
   pytest's main process).
The short table comes last in the output.

Pinned launch configs (util.LAUNCH), no autotuning. Needs only torch and triton. No stage starts past
--deadline seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RESULTS: dict = {"failed": []}
T_START = time.time()
DEVICE = "cuda"
ARGS = None
OUT = ""
MODELS = ("mamba2", "retnet", "gla")
TOL = {torch.bfloat16: 4e-2, torch.float32: 1e-4}  # tests/tolerances.py TRITON_LOW_REL[bf16], CHUNK_LONG_F32_REL


def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    with open(os.path.join(OUT, "log.txt"), "a") as f:
        f.write(msg + "\n")


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    write_table()


def past_deadline() -> bool:
    return time.time() - T_START > ARGS.deadline


# ----------------------------------------------------------------------------------------- configs
def variants(specs=None) -> list[tuple[str, dict]]:
    """(label, {"launch": util.LAUNCH overrides, "keep": bool}) of --variants (or `specs`), each
    "name:key=val,...;..." or "keep" (the forward keeps h: RECOMPUTE_STATES False)."""
    out = []
    for spec in ARGS.variants if specs is None else specs:
        cfg: dict = {"launch": {}, "keep": False}
        for part in spec.split(";"):
            if part == "keep":
                cfg["keep"] = True
                continue
            name, kv = part.split(":")
            cfg["launch"][name] = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
        out.append((spec, cfg))
    return out


class use:
    """Within the block: gated.PIPELINE = pipeline, util.LAUNCH updated, RECOMPUTE_STATES set (undone after)."""

    def __init__(self, pipeline: str, cfg: dict | None = None):
        self.pipeline, self.cfg = pipeline, cfg or {"launch": {}, "keep": False}

    def __enter__(self):
        from fastweights.kernels.triton import gated, gated_fused, util

        self.old_p, gated.PIPELINE = gated.PIPELINE, self.pipeline
        self.old_r, gated_fused.RECOMPUTE_STATES = gated_fused.RECOMPUTE_STATES, not self.cfg["keep"]
        self.old = util.load_launch(self.cfg["launch"])

    def __exit__(self, *exc):
        from fastweights.kernels.triton import gated, gated_fused, util

        gated.PIPELINE, gated_fused.RECOMPUTE_STATES = self.old_p, self.old_r
        util.LAUNCH.update(self.old)


# ----------------------------------------------------------------------------------------- env
def stage_env():
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if DEVICE == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
    RESULTS["env"] = env
    log("env", env)


# ----------------------------------------------------------------------------------------- time
def time_shapes():
    if ARGS.dry_run:
        return [("B1 T64 H2 D16", (1, 64, 2, 16)), ("B1 T96 H2 D16", (1, 96, 2, 16))]
    return [("B4 T4096 H16 D128", (4, 4096, 16, 128)), ("B1 T32768 H16 D128", (1, 32768, 16, 128))]


def time_case(model, shape, pipeline, cfg=None):
    from fastweights.bench.speed import _bench, _fastweights_case, _fwd_bwd

    B, T, H, D = shape
    if ARGS.dry_run:  # the Triton row asks for CUDA: call the kernels' glue directly (plumbing only)
        from fastweights.bench.speed import _inputs
        from fastweights.kernels.triton.gated import chunk_gated_triton

        inp = _inputs(model, B, T, H, D, torch.bfloat16, torch.device(DEVICE))

        def run():
            return chunk_gated_triton(inp["q"], inp["k"], inp["v"], g=inp.get("g"), beta=inp.get("beta"),
                                      scale=None)[0]

        tensors = [t for t in inp.values() if t.requires_grad]
    else:
        run, tensors = _fastweights_case(model, "chunk_triton", B, T, H, D, torch.bfloat16, torch.device(DEVICE), 64)
    fwd, fwdbwd = _fwd_bwd(run, tensors)
    warmup, reps = (1, 1) if ARGS.dry_run else (3, 20)
    with use(pipeline, cfg):
        return _bench(fwd, torch.device(DEVICE), warmup, reps), _bench(fwdbwd, torch.device(DEVICE), warmup, reps)


def time_row(label, shape, model, pipeline, cfg_label, cfg=None):
    from fastweights.kernels.triton.gated_fused import fused_programs
    from fastweights.kernels.triton.layout import make_layout

    try:
        ms = time_case(model, shape, pipeline, cfg)
    except Exception as e:  # e.g. out of shared memory for one variant: recorded, the rest go on
        log(f"time {label} {model} {pipeline} {cfg_label}: {type(e).__name__}: {str(e)[:300]}")
        RESULTS.setdefault("time_errors", []).append([label, model, pipeline, cfg_label, repr(e)[:1000]])
        return
    progs = ""
    if pipeline == "fused":
        with use(pipeline, cfg):
            B, T, H, D = shape
            p = fused_programs(make_layout(B, T, H, H, D, D, 64, None, DEVICE))
        progs = f"{p['sequential']} seq (BV {p['BV']}) / {p['chunk']} chunk"
    row = {"shape": label, "model": model, "pipeline": pipeline, "config": cfg_label, "programs": progs,
           "fwd_ms": ms[0], "fwdbwd_ms": ms[1]}
    RESULTS.setdefault("time", []).append(row)
    log(f"time {label} {model:7s} {pipeline:6s} {cfg_label:40s} {ms[0]:.3f} / {ms[1]:.3f} ms  {progs}")
    save()


def stage_time():
    for label, shape in time_shapes():
        for model in MODELS:
            for pipeline in ("staged", "fused"):
                if past_deadline():
                    log("time: deadline reached")
                    return
                time_row(label, shape, model, pipeline, "default")


def stage_variants():
    """Each --variants launch config: timed at the first shape (every model; --long-variants at the second shape
    too), then checked at the first check size (every gate, with β: the timed specialization)."""
    long = set(ARGS.long_variants)
    for cfg_label, cfg in variants(list(ARGS.variants) + [v for v in ARGS.long_variants if v not in ARGS.variants]):
        for label, shape in time_shapes()[:2 if cfg_label in long else 1]:
            for model in MODELS:
                if past_deadline():
                    log("variants: deadline reached")
                    return
                time_row(label, shape, model, "fused", cfg_label, cfg)
        RESULTS.setdefault("checked", {})[cfg_label] = check_config(cfg_label, cfg, check_sizes()[:1], full=False)


# ----------------------------------------------------------------------------------------- check
def inputs(gate, B, T, H, Hq, K, V, dtype, *, beta=True, seed=0, N=None, g_scale=1.0):
    """q, k [B, T, Hq, K] (k unit-norm), v [B, T, H, V], β = σ(·) [B, T, H] (or none), g = g_scale·logsigmoid(· + 3)
    [B, T, H] (scalar), [B, T, H, K] (diagonal) or none, initial state [N or B, H, K, V]; on DEVICE."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    x = {"q": rnd(B, T, Hq, K).to(dtype), "k": torch.nn.functional.normalize(rnd(B, T, Hq, K), dim=-1).to(dtype),
         "v": rnd(B, T, H, V).to(dtype), "S0": 0.3 * rnd(N or B, H, K, V)}
    if beta:
        x["beta"] = torch.sigmoid(rnd(B, T, H)).to(dtype)
    if gate == "scalar":
        x["g"] = g_scale * torch.nn.functional.logsigmoid(rnd(B, T, H) + 3.0)
    elif gate == "diagonal":
        x["g"] = g_scale * torch.nn.functional.logsigmoid(rnd(B, T, H, K) + 3.0)
    return x


def run_triton(x, cu=None):
    from fastweights.kernels.triton.gated import chunk_gated_triton

    return chunk_gated_triton(x["q"], x["k"], x["v"], g=x.get("g"), beta=x.get("beta"), scale=0.1,
                              initial_state=x["S0"], output_final_state=True, chunk_size=64, cu_seqlens=cu)


def run_torch(x, cu=None):
    """The fp32 torch chunk form, grouped heads repeated."""
    from fastweights.chunkwise import chunk_gated

    xf = {key: val.float() for key, val in x.items()}
    rep = xf["v"].shape[2] // xf["q"].shape[2]
    return chunk_gated(xf["q"].repeat_interleave(rep, 2), xf["k"].repeat_interleave(rep, 2), xf["v"], g=xf.get("g"),
                       beta=xf.get("beta"), scale=0.1, initial_state=xf["S0"], output_final_state=True, chunk_size=64,
                       cu_seqlens=cu)


def with_grads(fn, x, seed=7):
    """(o, S_T, {input: gradient}) of a random projection of o and S_T, fp32 copies."""
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = fn(leaves)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen, device=DEVICE)).sum()
    loss = loss + (S.float() * torch.randn(S.shape, generator=gen, device=DEVICE)).sum()
    gs = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach().float(), S.detach().float(), {key: g.float() for key, g in zip(leaves, gs)}


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def errors(got, want) -> dict:
    out = {"o": rel(got[0], want[0]), "S": rel(got[1], want[1])}
    out.update({f"d{name}": rel(got[2][name], want[2][name]) for name in want[2]})
    return out


def check_sizes():
    """(label, size, varlen lengths or None)."""
    if ARGS.dry_run:
        lengths = [20, 0, 1, 45]
        return [("bf16 B2 T40 H2 D16", dict(B=2, T=40, H=2, Hq=2, K=16, V=16, dtype=torch.bfloat16), None),
                ("bf16 B1 T70 H2 D16", dict(B=1, T=70, H=2, Hq=2, K=16, V=16, dtype=torch.bfloat16), None),
                ("fp32 varlen Hq1 H2 D16", dict(B=1, T=sum(lengths), H=2, Hq=1, K=16, V=16, dtype=torch.float32,
                                                N=len(lengths)), lengths)]
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    return [("bf16 B4 T300 H16 D128", dict(B=4, T=300, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16), None),
            ("bf16 B1 T32768 H16 D128", dict(B=1, T=32768, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16), None),
            ("fp32 varlen T4075 Hq4 H16 D128", dict(B=1, T=sum(lengths), H=16, Hq=4, K=128, V=128,
                                                    dtype=torch.float32, N=len(lengths)), lengths)]


def cases(first: bool):
    """(gate, β, g_scale, label) of a check size: every gate with β (as the models call it); at the first size
    also without β, and GLA's decay × 40 (≈ 90 nats a chunk: the exact path of the diagonal decay) in fp32 (in
    bf16 that decay's dg is at the tolerance for the staged pipeline too: a sum of large terms that cancel)."""
    out = [(gate, True, 1.0, f"{gate} decay + β") for gate in ("none", "scalar", "diagonal")]
    if first:
        out += [(gate, False, 1.0, f"{gate} decay") for gate in ("none", "scalar", "diagonal")]
        out += [("diagonal", True, 40.0, "fp32, diagonal decay × 40 + β (exact path)")]
    return out


def check_config(cfg_label, cfg, sizes, *, full=True) -> bool:
    ok = True
    for i, (label, size, lengths) in enumerate(sizes):
        cu = None if lengths is None else torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
        for gate, beta, g_scale, what in cases(full and i == 0):
            sz = {**size, "dtype": torch.float32} if g_scale != 1.0 else size
            case = f"{cfg_label} | {label} | {what}"
            x = inputs(gate, beta=beta, seed=len(label) + beta, g_scale=g_scale, **sz)
            try:
                want = with_grads(lambda d, cu=cu: run_torch(d, cu), x)
            except torch.cuda.OutOfMemoryError:  # the fp32 torch reference (GLA at T = 32768), not the kernels
                log(f"check {case}: NOT CHECKED — the torch reference ran out of GPU memory")
                RESULTS.setdefault("not_checked", []).append(case)
                del x
                torch.cuda.empty_cache()
                continue
            with use("fused", cfg):
                got = with_grads(lambda d, cu=cu: run_triton(d, cu), x)
            err = errors(got, want)
            worst = max(err, key=err.get)
            tol = TOL[sz["dtype"]]
            passed = all(v < tol for v in err.values())  # NaN fails too
            ok &= passed
            RESULTS.setdefault("check", []).append({"case": case, "errors": err, "passed": passed})
            log(f"check {case}: max rel {worst} {err[worst]:.2e} (o {err['o']:.2e}, S {err['S']:.2e}) "
                f"{'ok' if passed else '*** FAILED ***'}")
            if not passed:
                RESULTS["failed"].append(case)
            del x, want, got
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            save()
    return ok


def stage_check():
    RESULTS.setdefault("checked", {})["default"] = check_config("default", None, check_sizes())


# ----------------------------------------------------------------------------------------- K = V = 256
def stage_d256():
    if ARGS.dry_run:
        log("d256: skipped in a dry run")
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--stages", "d256_inner", "--out", os.path.join(OUT, "d256")]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
        RESULTS["d256"] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-2000:]}
    except subprocess.TimeoutExpired:
        RESULTS["d256"] = {"rc": "timeout"}
    log("d256:", RESULTS["d256"].get("rc"), RESULTS["d256"].get("tail", "")[-800:])


def stage_d256_inner():
    from fastweights.kernels.triton import gated_fused

    gated_fused.FUSED_MAX_HEAD_DIM_CUDA = 256
    size = dict(B=1, T=4096, H=4, Hq=4, K=256, V=256, dtype=torch.bfloat16)
    ok = check_config("d256", None, [("bf16 B1 T4096 H4 D256", size, None)])
    sys.exit(0 if ok else 1)


# ----------------------------------------------------------------------------------------- tests
def stage_tests():
    if ARGS.dry_run:
        log("tests: skipped in a dry run")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/kernels/test_triton_gated_fused.py"]
    left = max(30.0, ARGS.deadline + 60 - (time.time() - T_START))
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    with open(os.path.join(OUT, "cuda_tests.txt"), "w") as f:
        f.write(text)
    RESULTS["tests"] = {"rc": rc, "tail": text[-3000:]}
    log("tests:", rc, "\n" + text[-1500:])


# ----------------------------------------------------------------------------------------- summary
def table_lines() -> list[str]:
    lines = ["| shape | model | pipeline | config | programs | fwd ms | fwd+bwd ms | checked |",
             "|---|---|---|---|---|---:|---:|---|"]
    checked = RESULTS.get("checked", {})
    for r in RESULTS.get("time", []):
        ok = "—" if r["pipeline"] == "staged" else \
            {True: "ok", False: "FAILED", None: "not checked"}[checked.get(r["config"])]
        lines.append(f"| {r['shape']} | {r['model']} | {r['pipeline']} | {r['config']} | {r['programs']} | "
                     f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {ok} |")
    return lines


def write_table():
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write("\n".join(table_lines()) + "\n")


def summary():
    """The short table and one line of verdicts, last in the output (also on SIGTERM: `timeout` around the call)."""
    lines = table_lines()
    write_table()
    tests = RESULTS.get("tests", {})
    tail = [ln for ln in str(tests.get("tail", "")).splitlines() if ln.strip()][-1:] or ["not run"]
    print("\n" + "\n".join(lines))
    missing = RESULTS.get("not_checked", [])
    print(f"\nchecks: {'ALL PASSED' if not RESULTS['failed'] else 'FAILED: ' + '; '.join(RESULTS['failed'])}"
          f"{' | NOT CHECKED (reference OOM): ' + '; '.join(missing) if missing else ''}"
          f" | d256: rc {RESULTS.get('d256', {}).get('rc', 'not run')} | cuda tests: {tail[0]}"
          f" | {time.time() - T_START:.0f} s", flush=True)


STAGES = {"env": stage_env, "time": stage_time, "check": stage_check, "variants": stage_variants, "d256": stage_d256,
          "tests": stage_tests, "d256_inner": stage_d256_inner}


def main():
    global ARGS, OUT, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=["env", "time", "check", "variants", "d256", "tests"],
                    choices=list(STAGES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_gated_fused"))
    ap.add_argument("--deadline", type=float, default=420, help="seconds after which no new stage or row starts")
    ap.add_argument("--variants", nargs="*", default=["keep", "gated_fused_bwd_chunk:num_warps=4",
                                                      "gated_fused_bwd_chunk:BV=32", "gated_fused_fwd:num_warps=8",
                                                      "gated_fused_fwd:WARPS_DIAG=4", "gated_fused_fwd:PROGRAMS=1"],
                    help='launch variants timed at the first shape, each "site:key=val,...;..." (util.LAUNCH) or '
                         '"keep" (RECOMPUTE_STATES False); PROGRAMS=1 keeps BV at its cap (64)')
    ap.add_argument("--long-variants", nargs="*", default=["gated_fused_fwd:AQK=1"],
                    help="variants timed at the second (long) shape too; AQK=1: the scores once per chunk")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors under the interpreter, tiny sizes")
    ARGS = ap.parse_args()
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    if ARGS.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    if "d256_inner" not in ARGS.stages:
        def on_term(signum, frame):
            RESULTS["failed"].append(f"stopped by signal {signum} (a timeout around the call)")
            save()
            summary()
            os._exit(1)

        signal.signal(signal.SIGTERM, on_term)
    for name in ARGS.stages:
        if past_deadline() and name != "d256_inner":
            log(f"stage {name}: skipped, past the deadline")
            RESULTS.setdefault("skipped", []).append(name)
            continue
        log(f"=== stage {name} at {time.time() - T_START:.0f} s")
        t = time.time()
        try:
            STAGES[name]()
        except Exception as e:
            RESULTS.setdefault("stage_errors", {})[name] = traceback.format_exc()[-3000:]
            RESULTS["failed"].append(f"stage {name}: {type(e).__name__}: {e}")
            log(f"stage {name} failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        RESULTS.setdefault("stage_seconds", {})[name] = time.time() - t
        save()
    if "d256_inner" not in ARGS.stages:
        summary()
    sys.exit(1 if RESULTS["failed"] else 0)


if __name__ == "__main__":
    main()
