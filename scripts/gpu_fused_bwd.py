"""One GPU call for the delta class's fused backward (`fastweights.kernels.triton.fused.delta_fused_bwd`): compile,
check, time, profile, test — the staged, fused-forward and fused paths side by side, in one process.

    python3 scripts/gpu_fused_bwd.py --deadline 470          # on the H100; results under $OUT
    python3 scripts/gpu_fused_bwd.py --dry-run --deadline 200 # plumbing only: CPU, the interpreter, tiny sizes

Paths (`DeltaPipeline(forward, backward)` passed to `chunk_delta_triton` / LAUNCH["delta_prepass"]["WU"]):
    staged     staged / staged          the stage kernels (the default before this branch)
    fused-fwd  fused / staged           the fused forward of issue 23 with the staged backward
    fused      fused / fused            the fused forward and the fused backward
    fused-T    fused / fused, WU = 0    the same with the T-form forward (its pre-pass writes only T)
KDA has no fused backward (it routes to the staged one): its rows are staged and fused-fwd only.

Stages (each result written to $OUT as soon as it is measured: results.json, log.txt, fused_bwd.md,
profile.txt, cuda_tests.xml):
1. env: GPU, SMs, torch, triton.
2. warm: every kernel specialization the later stages launch (each path × model × check size, forward with and
   without a gradient, each launch config) compiled in parallel worker processes into Triton's cache, so the
   stages after it time and check, not compile (a cold check of one config took 333 s in one process).
3. check: every path under the default launch config against the fp32 torch chunk form at four sizes (the
   two timed specializations at short T, fp32 grouped heads + varlen with an empty and a length-1 sequence,
   and bf16 B1 T32768 Hq16 H32 itself); outputs, final states, every gradient; max relative errors printed.
   A path that fails is reported (FAILED) and not timed.
4. time: each passing path, fwd and fwd+bwd medians (CUDA events, 3 warm-ups, 20 reps), gated DeltaNet,
   DeltaNet, KDA at B=4 T=4096 H=16 K=V=128 and B=1 T=32768 Hq=16 H=32 K=V=128, bf16, unit-norm q, k, no
   initial or final state (as layers call it: no value checks, no host sync).
5. profile: torch.profiler of one fused fwd+bwd (and one staged) of gated DeltaNet at the anchor: the kernels'
   CUDA time, to profile.txt.
6. variants: each --configs launch config checked (the fused path, two sizes) then timed (the fused path).
7. tests: `pytest -m cuda tests/kernels/fused/test_triton_delta_fused_bwd.py` (after the timings).
8. table: the timing table, printed last (whatever the deadline) and written to fused_bwd.md.
(d256, only when named in --stages: the fused forward at K = V = 256 bf16 in a subprocess, BV 16 vs 32 — refused
while limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA < 256: the glue takes no argument that lifts the GPU limit.)

Needs only torch and triton. No stage starts past --deadline seconds; a failing stage records its error and
the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RESULTS: dict = {}
T_START = time.time()
DEVICE = "cuda"
ARGS = None
OUT = ""
MODELS = {"gated_deltanet": "scalar", "deltanet": "none", "kda": "diagonal"}
PATHS = {"staged": ("staged", "staged", 1), "fused-fwd": ("fused", "staged", 1), "fused": ("fused", "fused", 1),
         "fused-T": ("fused", "fused", 0)}
TOL_BF16 = 6e-2  # tests/tolerances.py TRITON_DELTA_LOW_REL[bf16]: bf16 inputs against the fp32 torch chunk form
TOL_F32 = 1e-4  # CHUNK_LONG_F32_REL


def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    with open(os.path.join(OUT, "log.txt"), "a") as f:
        f.write(msg + "\n")


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def past_deadline() -> bool:
    return time.time() - T_START > ARGS.deadline


def paths_of(model: str) -> list[str]:
    return ["staged", "fused-fwd"] if MODELS[model] == "diagonal" else list(PATHS)


# ----------------------------------------------------------------------------------------- inputs and runs
def inputs(gate, B, T, H, Hq, K, V, dtype, *, seed=0, N=None, S0=False):
    """q, k unit-norm [B, T, Hq, K], v [B, T, H, V], β = σ(·) [B, T, H], g log-sigmoid (scalar/diagonal),
    initial state [N or B, H, K, V] (S0=True), on DEVICE."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    x = {"q": torch.nn.functional.normalize(rnd(B, T, Hq, K), dim=-1).to(dtype),
         "k": torch.nn.functional.normalize(rnd(B, T, Hq, K), dim=-1).to(dtype),
         "v": rnd(B, T, H, V).to(dtype), "beta": torch.sigmoid(rnd(B, T, H)).to(dtype)}
    if gate == "scalar":
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H) + 3.0)
    elif gate == "diagonal":
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H, K) + 3.0)
    if S0:
        x["S0"] = 0.3 * rnd(N or B, H, K, V)
    return x


def pipeline_of(path: str):
    """The `DeltaPipeline` of a path of PATHS (its forward and backward; WU is a launch setting, `use`)."""
    from fastweights.kernels.pipelines import DeltaPipeline

    fwd, bwd, _ = PATHS[path]
    return DeltaPipeline(fwd, bwd)


def run_triton(x, path: str, *, cu=None, final=True):
    """chunk_delta_triton with the path's pipeline (`pipeline_of`)."""
    from fastweights.kernels.triton.delta import chunk_delta_triton

    return chunk_delta_triton(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], scale=None,
                              initial_state=x.get("S0"), output_final_state=final, chunk_size=64, cu_seqlens=cu,
                              pipeline=pipeline_of(path))


def run_torch(x, *, cu=None):
    """The fp32 torch chunk form, grouped heads repeated."""
    from fastweights.chunkwise import chunk_delta

    xf = {key: val.float() for key, val in x.items()}
    rep = xf["v"].shape[2] // xf["q"].shape[2]
    q, k = xf["q"].repeat_interleave(rep, 2), xf["k"].repeat_interleave(rep, 2)
    return chunk_delta(q, k, xf["v"], g=xf.get("g"), beta=xf["beta"], scale=None, initial_state=xf.get("S0"),
                       output_final_state=True, chunk_size=64, cu_seqlens=cu, inverse="solve")


def with_grads(fn, x, seed=7, *, final=True):
    """(o, S_T or None, {input: gradient}) of a random projection of o (and of S_T with `final`)."""
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = fn(leaves)
    S = S if final else None
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen, device=DEVICE)).sum()
    if S is not None:
        loss = loss + (S.float() * torch.randn(S.shape, generator=gen, device=DEVICE)).sum()
    gs = torch.autograd.grad(loss, list(leaves.values()))
    return (o.detach().float(), None if S is None else S.detach().float(),
            {key: g.float() for key, g in zip(leaves, gs)})


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def errors(got, want) -> dict:
    out = {"o": rel(got[0], want[0])}
    if want[1] is not None:
        out["S"] = rel(got[1], want[1])
    out.update({f"d{name}": rel(got[2][name], want[2][name]) for name in want[2]})
    return out


def bench_ms(fn, warmup=3, reps=20) -> float:
    from fastweights.bench.speed import median_ms

    return median_ms(fn, torch.device(DEVICE), warmup, reps)


# ----------------------------------------------------------------------------------------- launch configs
def parse_cfg(spec: str) -> dict:
    """ "site:key=val,key=val;site:..." → {site: {key: val}} (util.LAUNCH entries); "" → {} (the default)."""
    cfg: dict = {}
    for part in filter(None, spec.split(";")):
        name, kv = part.split(":")
        cfg[name] = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
    return cfg


def cfg_str(cfg: dict) -> str:
    return "default" if not cfg else ";".join(f"{n}:" + ",".join(f"{k}={v}" for k, v in c.items())
                                             for n, c in cfg.items())


class use:
    """Within the block: the path's WU and util.LAUNCH updated by cfg (undone after). (The path's forward and
    backward are the pipeline `run_triton` passes to the glue, `pipeline_of`.)"""

    def __init__(self, path: str, cfg: dict | None = None):
        self.path, self.cfg = path, cfg or {}

    def __enter__(self):
        from fastweights.kernels.triton.common import util

        self.old = util.load_launch(self.cfg)
        util.LAUNCH["delta_prepass"]["WU"] = PATHS[self.path][2]

    def __exit__(self, *exc):
        from fastweights.kernels.triton.common import util

        util.LAUNCH.clear()
        util.LAUNCH.update(self.old)


def configs() -> list[dict]:
    return [{}] + [parse_cfg(spec) for spec in ARGS.configs]


# ----------------------------------------------------------------------------------------- sizes
def check_sizes(full: bool = True):
    """(label, size, varlen lengths or None, with initial and final states)."""
    if ARGS.dry_run:
        lengths = [20, 0, 1, 45]
        return [("bf16 B2 T40 H2 D16", dict(B=2, T=40, H=2, Hq=2, K=16, V=16, dtype=torch.bfloat16), None, False),
                ("bf16 B1 T70 Hq1 H2 D32", dict(B=1, T=70, H=2, Hq=1, K=32, V=32, dtype=torch.bfloat16), None,
                 False),
                ("fp32 varlen Hq1 H2 D16", dict(B=1, T=sum(lengths), H=2, Hq=1, K=16, V=16, dtype=torch.float32,
                                                N=len(lengths)), lengths, True)][:3 if full else 2]
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    out = [("bf16 B4 T300 H16 D128 (as timed)", dict(B=4, T=300, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16),
            None, False),
           ("bf16 B1 T1500 Hq16 H32 D128 (as timed)", dict(B=1, T=1500, H=32, Hq=16, K=128, V=128,
                                                           dtype=torch.bfloat16), None, False),
           ("fp32 varlen T4075 Hq4 H16 D128", dict(B=1, T=sum(lengths), H=16, Hq=4, K=128, V=128,
                                                   dtype=torch.float32, N=len(lengths)), lengths, True),
           ("bf16 B1 T32768 Hq16 H32 D128", dict(B=1, T=32768, H=32, Hq=16, K=128, V=128, dtype=torch.bfloat16),
            None, True)]
    return out if full else out[:2]


def time_shapes():
    if ARGS.dry_run:
        return [("B1 T64 H2 D16", dict(B=1, T=64, H=2, Hq=2, K=16, V=16)),
                ("B1 T64 Hq1 H2 D16", dict(B=1, T=64, H=2, Hq=1, K=16, V=16))]
    return [("B4 T4096 H16 D128", dict(B=4, T=4096, H=16, Hq=16, K=128, V=128)),
            ("B1 T32768 Hq16 H32 D128", dict(B=1, T=32768, H=32, Hq=16, K=128, V=128))]


# ----------------------------------------------------------------------------------------- stages
def stage_env():
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "cpus": os.cpu_count()}
    if DEVICE == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
    RESULTS["env"] = env
    log("env", env)


def _warm_groups() -> list[list[tuple]]:
    """Every (cfg index, path, model, size label, with gradient) the later stages run, grouped by (config, model,
    size) — the paths of one group share kernels (the staged backward, the fused forward), so one worker compiles
    them once —, the default config's groups first (the largest)."""
    groups = []
    for ci in range(len(configs())):
        sizes = check_sizes(full=True) if ci == 0 else check_sizes(full=False)
        for label, _, _, _ in sizes:
            for model in MODELS:
                if ci > 0 and MODELS[model] == "diagonal":
                    continue
                paths = paths_of(model) if ci == 0 else ["fused"]
                groups.append([(ci, path, model, label, grad) for path in paths for grad in (True, False)])
    return groups


def _warm_one(ci, path, model, label, grad):
    cfg = configs()[ci]
    _, size, lengths, states = next(s for s in check_sizes(full=True) if s[0] == label)
    size = dict(size)
    if lengths is None:
        size["T"] = min(size["T"], 130)
        cu = None
    else:
        cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    x = inputs(MODELS[model], S0=states, **size)
    with use(path, cfg):
        if grad:
            with_grads(lambda d: run_triton(d, path, cu=cu, final=states), x, final=states)
            if not states:  # the timing's form: no final state (the checks' is the same here)
                with_grads(lambda d: run_triton(d, path, cu=cu, final=False), x, final=False)
        else:
            with torch.no_grad():
                run_triton(x, path, cu=cu, final=False)
    torch.cuda.synchronize() if DEVICE == "cuda" else None


def warm_worker(i: int, n: int):
    for j, group in enumerate(_warm_groups()):
        if j % n != i:
            continue
        for case in group:  # (T only shortened: it is never a constexpr)
            try:
                _warm_one(*case)
            except Exception as e:  # the main process's checks report it
                print(f"warm {case}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def stage_warm():
    n = ARGS.workers or max(1, min(12, (os.cpu_count() or 2) - 2))
    t = time.time()
    cases = [case for group in _warm_groups() for case in group]
    procs = [subprocess.Popen([sys.executable, __file__, "--warm-worker", f"{i}/{n}", "--out", OUT]
                              + (["--dry-run"] if ARGS.dry_run else []) + ["--configs", *ARGS.configs],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(n)]
    left = max(30.0, ARGS.deadline * 0.45 - (time.time() - T_START))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, left - (time.time() - t)))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append((p.communicate()[0] or "") + "\n(killed: past the warm stage's share of the deadline)")
    errs = [line for out in outs for line in out.splitlines() if line.startswith("warm ") or "killed" in line]
    RESULTS["warm"] = {"workers": n, "cases": len(cases), "seconds": time.time() - t, "errors": errs[:20]}
    log(f"warm: {len(cases)} cases in {n} workers, {time.time() - t:.0f} s; {len(errs)} errors")
    for line in errs[:10]:
        log("  ", line)


def check_paths(paths: list[str], cfg: dict, sizes, models) -> dict:
    """{path: passed} of each path under cfg against the fp32 torch chunk form (computed once per size and
    model), every given size and model; max relative errors logged."""
    ok = {path: True for path in paths}
    for label, size, lengths, states in sizes:
        cu = None if lengths is None else torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
        for model in models:
            if size["T"] > 10000 and MODELS[model] == "diagonal":
                continue  # KDA has no fused backward: its paths were checked on the H100 before (BENCHMARKS §1d)
            x = inputs(MODELS[model], S0=states, seed=len(label), **size)
            want = with_grads(lambda d, cu=cu: run_torch(d, cu=cu), x, final=states)
            tol = TOL_F32 if size["dtype"] == torch.float32 else TOL_BF16
            for path in paths:
                if path not in paths_of(model):
                    continue
                try:
                    with use(path, cfg):
                        got = with_grads(lambda d, cu=cu, st=states, path=path: run_triton(d, path, cu=cu, final=st),
                                         x, final=states)
                    err = errors(got, want)
                    del got
                except Exception as e:
                    err = {"error": float("inf")}
                    log(f"check {path} {cfg_str(cfg)} {model} {label}: {type(e).__name__}: {str(e)[:400]}")
                worst = max(err, key=err.get)
                passed = all(v < tol for v in err.values())
                ok[path] &= passed
                RESULTS.setdefault("check", []).append({"config": cfg_str(cfg), "path": path, "size": label,
                                                        "model": model, "errors": err, "passed": passed})
                log(f"check {path:9s} {cfg_str(cfg)} {model:15s} {label}: worst {worst} {err[worst]:.2e} "
                    f"o {err.get('o', float('nan')):.2e} {'ok' if passed else 'FAILED'}")
                save()
            del want, x
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return ok


def stage_check():
    """Every path under the default config, at the four check sizes."""
    ok = check_paths(list(PATHS), {}, check_sizes(full=True), list(MODELS))
    RESULTS["passed_paths"] = [p for p, good in ok.items() if good]
    failed = [p for p in PATHS if not ok[p]]
    log(f"check: passed {RESULTS['passed_paths']}" + (f"; FAILED {failed} (not timed)" if failed else ""))
    save()


def time_case(x, path: str, cfg: dict) -> tuple[float, float]:
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}

    def f():
        with torch.no_grad():
            run_triton(leaves, path, final=False)

    def fb():
        o = run_triton(leaves, path, final=False)[0]
        o.float().sum().backward()
        for t in leaves.values():
            t.grad = None

    with use(path, cfg):
        warmup, reps = (1, 1) if ARGS.dry_run else (3, 20)
        return bench_ms(f, warmup, reps), bench_ms(fb, warmup, reps)


def time_rows(paths: list[str], cfg: dict, models=None):
    for label, size in time_shapes():
        for model in models or MODELS:
            if past_deadline():
                log("time: deadline reached")
                return
            x = inputs(MODELS[model], dtype=torch.bfloat16, **size)
            for path in paths:
                if path not in paths_of(model):
                    continue
                try:
                    ms = time_case(x, path, cfg)
                except Exception as e:
                    log(f"time {label} {model} {path} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:300]}")
                    RESULTS.setdefault("time_errors", []).append([label, model, path, cfg_str(cfg), repr(e)[:800]])
                    continue
                RESULTS.setdefault("time", []).append({"shape": label, "model": model, "path": path,
                                                       "config": cfg_str(cfg), "fwd_ms": ms[0], "fwdbwd_ms": ms[1]})
                log(f"time {label} {model:15s} {path:9s} {cfg_str(cfg)}: {ms[0]:.3f} / {ms[1]:.3f} ms "
                    f"(bwd ≈ {ms[1] - ms[0]:.3f})")
                save()
            del x


def stage_time():
    paths = [p for p in PATHS if p in RESULTS.get("passed_paths", list(PATHS))]
    if "staged" not in paths:
        paths = ["staged"] + paths  # the baseline is timed whatever its check said (it is what runs today)
    time_rows(paths, {})


def stage_profile():
    from torch.profiler import ProfilerActivity, profile

    label, size = time_shapes()[0]
    x = inputs("scalar", dtype=torch.bfloat16, **size)
    lines = []
    for path in ("fused", "staged"):
        if path != "staged" and path not in RESULTS.get("passed_paths", []):
            continue
        leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
        with use(path):
            for _ in range(2):
                run_triton(leaves, path, final=False)[0].float().sum().backward()
            torch.cuda.synchronize() if DEVICE == "cuda" else None
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
            with profile(activities=acts) as prof:
                run_triton(leaves, path, final=False)[0].float().sum().backward()
                torch.cuda.synchronize() if DEVICE == "cuda" else None
        sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        lines.append(f"## gated DeltaNet {label} bf16, one fwd+bwd, path {path}\n\n{table}\n")
        log(f"profile {path}:\n" + "\n".join(table.splitlines()[:22]))
    with open(os.path.join(OUT, "profile.txt"), "w") as f:
        f.write("\n".join(lines))


def stage_variants():
    """Each extra launch config: the fused path checked at the two timed specializations (no/scalar decay), then
    timed (fused path, both shapes, gated DeltaNet and DeltaNet)."""
    for cfg in configs()[1:]:
        if past_deadline():
            log("variants: deadline reached")
            return
        t = time.time()
        ok = check_paths(["fused"], cfg, check_sizes(full=False), ["gated_deltanet", "deltanet"])["fused"]
        log(f"variant {cfg_str(cfg)}: {'passed' if ok else 'FAILED — not timed'} ({time.time() - t:.0f} s)")
        RESULTS.setdefault("trusted" if ok else "rejected", []).append(cfg_str(cfg))
        if ok:
            time_rows(["fused"], cfg, ["gated_deltanet", "deltanet"])


def stage_table():
    rows = RESULTS.get("time", [])
    lines = ["| shape | model | path | config | fwd ms | fwd+bwd ms | bwd ms (difference) |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['model']} | {r['path']} | {r['config']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {r['fwdbwd_ms'] - r['fwd_ms']:.3f} |")
    head = f"# gpu_fused_bwd.py — {RESULTS.get('env')}\n\nchecks passed: {RESULTS.get('passed_paths')}; " \
           f"variants trusted: {RESULTS.get('trusted', [])}, rejected: {RESULTS.get('rejected', [])}\n"
    text = head + "\n" + "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "fused_bwd.md"), "w") as f:
        f.write(text)
    log("\n" + text)


def stage_tests():
    if ARGS.dry_run:
        log("tests: skipped in a dry run")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-n", str(ARGS.test_workers),
           "tests/kernels/fused/test_triton_delta_fused_bwd.py", f"--junitxml={os.path.join(OUT, 'cuda_tests.xml')}"]
    left = max(30.0, ARGS.deadline + 50 - (time.time() - T_START))
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left, start_new_session=True)
        RESULTS["tests"] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-4000:]}
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-4000:]
        RESULTS["tests"] = {"rc": "timeout", "tail": tail}
    log("tests:", RESULTS["tests"]["rc"], "\n" + RESULTS["tests"]["tail"][-1500:])


_D256 = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from fastweights.kernels.pipelines import DeltaPipeline
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.delta import chunk_delta_triton
util.LAUNCH["delta_fused_fwd"]["PROGRAMS"] = int(sys.argv[2])  # 1: BV at its K > 128 cap (32); 132: 16 here
g = torch.Generator(device="cuda").manual_seed(0)
B, T, H, D = 1, 4096, 4, 256
q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, device="cuda"), dim=-1).bfloat16()
v = torch.randn(B, T, H, D, generator=g, device="cuda").bfloat16()
gg = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g, device="cuda") + 3)
beta = torch.sigmoid(torch.randn(B, T, H, generator=g, device="cuda")).bfloat16()
with torch.no_grad():  # (the fused backward takes K <= 128: staged, and no gradient is asked for)
    o, S = chunk_delta_triton(q, k, v, g=gg, beta=beta, scale=None, output_final_state=True, chunk_size=64,
                              pipeline=DeltaPipeline("fused", "staged"))
    torch.cuda.synchronize()
    o2, S2 = chunk_delta_triton(q, k, v, g=gg, beta=beta, scale=None, output_final_state=True, chunk_size=64,
                                pipeline=DeltaPipeline("staged", "staged"))
print("ok", ((o.float() - o2.float()).abs().max() / o2.float().abs().max()).item())
"""


def stage_d256():
    """(Not in the default stages.) The fused forward's illegal memory access at K = V = 256 bf16 (2026-11-25):
    run in a subprocess (a fault breaks the CUDA context) with the sequential kernel's BV at 16 (the grid rule at
    B·H = 4) and at 32 (PROGRAMS = 1): the hypothesis read from the code is the BV = 16 (N = 16) products with
    a 256-row operand, a shape the staged passes (BV ≥ 32 at K = 256) never compiled.

    Refused (the stage fails, saying why) while limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA < 256: the fused forward
    refuses these head dims on a GPU and the glue takes no argument that lifts the limit (it was lifted by setting a
    module constant, which the pipelines refactor made a constant of limits.py)."""
    from fastweights.kernels.triton.common.limits import DELTA_FUSED_MAX_HEAD_DIM_CUDA

    if DELTA_FUSED_MAX_HEAD_DIM_CUDA < 256:
        why = (f"d256 refused: the fused delta forward takes K, V <= {DELTA_FUSED_MAX_HEAD_DIM_CUDA} on a GPU "
               "(limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA) and chunk_delta_triton has no argument that lifts it")
        RESULTS["d256"] = {"refused": why}
        log(why)
        raise RuntimeError(why)
    for programs in (132, 1):
        try:
            r = subprocess.run([sys.executable, "-c", _D256, ROOT, str(programs)], capture_output=True, text=True,
                               timeout=240)
            out = (r.stdout + r.stderr)[-1200:]
        except subprocess.TimeoutExpired:
            out = "timeout"
        RESULTS.setdefault("d256", {})[f"PROGRAMS={programs}"] = out
        log(f"d256 PROGRAMS={programs}: {out[-600:]}")


STAGES = {"env": stage_env, "warm": stage_warm, "check": stage_check, "time": stage_time, "profile": stage_profile,
          "variants": stage_variants, "tests": stage_tests, "table": stage_table, "d256": stage_d256}


def main():
    global ARGS, OUT, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=[s for s in STAGES if s != "d256"], choices=list(STAGES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_fused_bwd"))
    ap.add_argument("--deadline", type=float, default=470, help="seconds after which no new stage or row starts")
    ap.add_argument("--configs", nargs="*",
                    default=["delta_fused_rev:AQK=1", "delta_fused_rev:PROGRAMS=128;delta_fused_rec:PROGRAMS=128",
                             "delta_fused_grads:BV=32", "delta_fused_rev:num_stages=3;delta_fused_rec:num_stages=3",
                             "delta_fused_grads:num_warps=4"],
                    help='extra launch configs of the fused backward, each "site:key=val,...;site:..." (util.LAUNCH); '
                         'AQK=1: Aqk handed from the recompute to the reverse kernel; PROGRAMS=128: BV 64 at the '
                         'anchor, 32 at B1 H32 (fewer, wider value blocks)')
    ap.add_argument("--workers", type=int, default=0, help="compile workers of the warm stage (0: CPUs − 2, ≤ 12)")
    ap.add_argument("--test-workers", type=int, default=3)
    ap.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors under the interpreter, tiny sizes")
    ARGS = ap.parse_args()
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    if ARGS.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    if ARGS.warm_worker:
        i, n = map(int, ARGS.warm_worker.split("/"))
        warm_worker(i, n)
        return
    for name in ARGS.stages:
        if past_deadline() and name not in ("table",):
            log(f"stage {name}: skipped, past the deadline")
            RESULTS.setdefault("skipped", []).append(name)
            continue
        t = time.time()
        log(f"=== stage {name} at {t - T_START:.0f} s")
        try:
            STAGES[name]()
        except Exception as e:
            RESULTS.setdefault("stage_errors", {})[name] = traceback.format_exc()[-3000:]
            log(f"stage {name} failed: {type(e).__name__}: {e}")
        RESULTS.setdefault("stage_seconds", {})[name] = time.time() - t
        save()
    log(f"done in {time.time() - T_START:.0f} s")
    failed = [c for c in RESULTS.get("check", []) if not c["passed"]]
    if failed or RESULTS.get("stage_errors"):
        log("!" * 100)
        for c in failed:
            log(f"CHECK FAILED: {c['path']} {c['config']} {c['model']} {c['size']}: {c['errors']}")
        for name in RESULTS.get("stage_errors", {}):
            log(f"STAGE FAILED: {name} (results.json: stage_errors)")
        log("!" * 100)
        sys.exit(1)


if __name__ == "__main__":
    main()
