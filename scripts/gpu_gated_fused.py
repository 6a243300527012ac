"""One GPU call for the gated-linear class's fused pipeline (`fastweights.kernels.triton.fused.gated_fused`, issue 23):
fault diagnosis, then checks at every shape that is timed, then times of only what passed, a per-kernel profile,
the cuda tests — every GPU stage in subprocesses, so that one illegal memory access (which kills its CUDA context)
costs one case and hides nothing else.

    timeout 380 python3 scripts/gpu_gated_fused.py --deadline 300    # on the H100; results under $OUT (≤ 6 files)
    python3 scripts/gpu_gated_fused.py --dry-run --deadline 200     # plumbing only: CPU, the interpreter, tiny sizes

Stages (the parent process never touches the GPU; each case is `python3 <this file> --inner <stage> <case>` in its
own process, several at once, writing its JSON outside $OUT; the parent merges them):
1. env: GPU, torch, triton, and the GPU's other compute processes (`nvidia-smi`): call 3's times may have shared
   the GPU with the previous script's surviving pytest workers (its log stops in its test stage).
2. fault: call 3's illegal memory access at B1 T32768 H16 D128 (Mamba2: scalar decay + β, bf16) and the K = V = 256
   failures, kernel by kernel with CUDA_LAUNCH_BLOCKING=1 and a sync after each launch, each output against its
   fp32 torch twin (`chunkwise.chunk_gated`, `chunkwise.gated_bwd`): the call-3 kernels (MIN_BV 16, PREFETCH 0) at
   the long shape and at T = 1000 (the same compiled specialization: fault by size or by code?), with 8 warps, with
   1 stage; the new default (BV 32); K = V = 256 likewise — refused (logged, in results.json "refused" and the
   summary) while limits.GATED_FUSED_MAX_HEAD_DIM_CUDA < 256: no argument lifts that limit. Under
   `compute-sanitizer` too when one is installed and the call-3 case faulted. Details in fault.txt.
3. check: every config that is timed, at the very shapes it is timed at (B4 T4096 H16 D128 and B1 T32768 H16 D128,
   bf16, Mamba2/RetNet/GLA through `fw.chunk` as the benchmark calls them) against the staged Triton pipeline in
   fp32 on the same inputs (outputs, every gradient; and two fused runs bitwise equal): one process per (shape,
   config). Also the default at small sizes against the fp32 torch chunk form (every gate, with and without β,
   fp32 varlen with an empty and a length-1 sequence, GLA's exact path) and K = V = 256 (refused as in 2).
   The pipeline is an argument: `GatedPipeline` passed to `chunk_gated_triton`, and pinned on the Triton row
   (`rows.pinned`) for the calls through `fw.chunk`.
4. time: per shape, one process (sequential, nothing else on the GPU): staged, then every fused config that passed
   its check at that shape for that model: forward and forward + backward medians (CUDA events, 20 reps).
5. profile: GPU time per kernel (torch.profiler) of one forward + backward at the anchor, staged and fused default,
   against its event time (the rest is host gaps).
6. tests: `pytest -m cuda tests/kernels/fused/test_triton_gated_fused.py` if time is left, in its own process group
   (killed whole at the deadline: no worker survives into a later command).
Files under $OUT: log.txt, results.json, table.md (also printed last), fault.txt, profile.txt, cuda_tests.txt.

Pinned launch configs (util.LAUNCH overrides), no autotuning. No stage starts past --deadline seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RESULTS: dict = {"failed": []}
T_START = time.time()
ARGS = None
OUT = ""
WORK = ""  # the inner processes' JSON files (not under $OUT)
CHILDREN: set = set()  # running inner processes (killed with their groups if this script is stopped)
MODELS = ("mamba2", "retnet", "gla")

#: Launch configs: label -> (util.LAUNCH overrides, does the forward keep h? — `GatedPipeline(recompute_states=False)`).
#: "default" is the shipped table.
CONFIGS: dict[str, tuple[dict, bool]] = {
    "default": ({}, False),
    "call3": ({"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0}}, False),  # the kernels of call 3 (BV 16 at 16 rows)
    "bv16": ({"gated_fused_fwd": {"MIN_BV": 16}}, False),  # the old BV rule with the β prefetch
    "no-prefetch": ({"gated_fused_fwd": {"PREFETCH": 0}}, False),  # β loaded where used (call 3's forward, BV 32)
    "aqk": ({"gated_fused_fwd": {"AQK": 1}}, False),  # the scores once per chunk (_scores_kernel), read by the forward
    "stages3": ({"gated_fused_fwd": {"num_stages": 3}, "gated_fused_bwd_states": {"num_stages": 3}}, False),
    "fwd-8w": ({"gated_fused_fwd": {"num_warps": 8}}, False),
    "chunk-4w": ({"gated_fused_bwd_chunk": {"num_warps": 4}}, False),  # 2 programs an SM instead of 1
    "keep": ({}, True),  # the forward keeps h (GatedPipeline("fused", recompute_states=False))
}
#: The configs timed (and so checked) at each shape; "call3" only where its BV differs from the default's. Not
#: timed: chunk-4w (sm_90 compile: 1,944 B spilled scalar, 4,716 B GLA, against 148 / 520 at 8 warps). stages3
#: puts GLA's 8-warp forward at 252 KB of shared memory (> 227): its GLA check fails to compile, by design.
TIMED = {"anchor": ["default", "no-prefetch", "aqk", "stages3", "fwd-8w", "keep"],
         "long": ["default", "bv16", "call3", "no-prefetch", "aqk", "stages3"]}
SHAPES = {"anchor": ("B4 T4096 H16 D128", (4, 4096, 16, 128)), "long": ("B1 T32768 H16 D128", (1, 32768, 16, 128))}
DRY_SHAPES = {"anchor": ("B2 T80 H2 D16", (2, 80, 2, 16)), "long": ("B1 T150 H2 D16", (1, 150, 2, 16))}
#: tests/tolerances.py: TRITON_LOW_REL[bf16] (bf16 against fp32 on the same inputs) and CHUNK_LONG_F32_REL
TOL = {"bfloat16": 4e-2, "float32": 1e-4}
#: The head dim of the "d256" fault and check cases (K = V; in a dry run they run at 32, but are refused as at 256).
D256 = 256


def refused_d256() -> str | None:
    """Why the K = V = 256 cases cannot run (None once they can): the fused gated pipeline serves K, V ≤
    limits.GATED_FUSED_MAX_HEAD_DIM_CUDA on a GPU, and neither the glue (`chunk_gated_triton`, which refuses) nor
    the kernels (`gated_fused.forward`) take an argument that lifts it (it was lifted by setting gated_fused's module
    constant, which the pipelines refactor made a constant of limits.py, read by the rule)."""
    from fastweights.kernels.triton.common.limits import GATED_FUSED_MAX_HEAD_DIM_CUDA

    if D256 <= GATED_FUSED_MAX_HEAD_DIM_CUDA:
        return None
    return (f"refused: K = V = {D256} is beyond limits.GATED_FUSED_MAX_HEAD_DIM_CUDA = "
            f"{GATED_FUSED_MAX_HEAD_DIM_CUDA} and no argument of the glue or the kernels lifts it")


def refuse(stage: str, cases: list[str]) -> None:
    """Log and record (RESULTS["refused"], the summary) each case not run because of `refused_d256`."""
    why = refused_d256()
    for case in cases:
        RESULTS.setdefault("refused", {})[f"{stage} {case}"] = why
        log(f"{stage} {case}: *** {why} ***")


# ===================================================================================== parent: plumbing
def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    with open(os.path.join(OUT, "log.txt"), "a") as f:
        f.write(msg + "\n")


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write("\n".join(table_lines()) + "\n")


def left() -> float:
    return ARGS.deadline - (time.time() - T_START)


#: Each stage's end, as a fraction of --deadline D after the start (D = 300: fault by 90 s, checks by 225 s, times
#: by 330 s, the profile by 350 s, the tests by 360 s — inside `timeout 380`). A job is given what is left of its
#: stage's budget when it starts (at most its cap); one that would get under 5 s is not started.
STAGE_END = {"env": 0.1, "fault": 0.3, "check": 0.75, "time": 1.1, "profile": 1.17, "tests": 1.2}


def until(stage: str) -> float:
    return T_START + STAGE_END[stage] * ARGS.deadline


def budget(stage: str, cap: float) -> float:
    return min(cap, until(stage) - time.time())


def inner(stage: str, case: str, *, timeout: float, env: dict | None = None, prefix: list | None = None) -> dict:
    """Run `stage` for `case` in a fresh process (its own process group, killed whole on timeout); returns its
    JSON ({"error": ...} if it died) plus rc and the output's tail."""
    path = os.path.join(WORK, f"{stage}-{case}.json".replace("/", "_"))
    if os.path.exists(path):
        os.remove(path)
    cmd = (prefix or []) + [sys.executable, os.path.abspath(__file__), "--inner", stage, case, path]
    if ARGS.dry_run:
        cmd.append("--dry-run")
    e = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **(env or {})}
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                         start_new_session=True)
    CHILDREN.add(p)
    try:
        text, _ = p.communicate(timeout=max(timeout, 5))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        kill(p)
        text, _ = p.communicate()
        rc = "timeout"
    finally:
        CHILDREN.discard(p)
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            out = json.load(f)
    out.update(rc=rc, tail=(text or "")[-2500:])
    if rc != 0 and "error" not in out:
        out["error"] = f"process ended with rc {rc}: " + " | ".join((text or "").strip().splitlines()[-3:])[-600:]
    return out


def kill(p):
    """SIGKILL the process group of a child started with start_new_session (the child and whatever it started)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_many(jobs: list[tuple], workers: int, stage: str, cap: float) -> dict:
    """Inner (stage, case, env[, command prefix]) jobs, `workers` at a time, each within its stage's budget;
    {(stage, case): result} (a job that could not start in time: {"error": "not run: ...", "rc": "skipped"})."""
    def one(s, c, env, prefix=None):
        t = budget(stage, cap)
        if t < 5:
            return {"error": f"not run: the {stage} stage's time was up", "rc": "skipped"}
        return inner(s, c, timeout=t, env=env, prefix=prefix)

    with ThreadPoolExecutor(max_workers=workers) as ex:
        futs = {job[:2]: ex.submit(one, *job) for job in jobs}
        return {key: f.result() for key, f in futs.items()}


# ===================================================================================== parent: stages
def stage_env():
    env = {"python": platform.python_version(), "cpus": os.cpu_count()}
    r = inner("env", "env", timeout=120)
    env.update({k: v for k, v in r.items() if k not in ("tail",)})
    env["other_gpu_processes"] = gpu_processes()
    RESULTS["env"] = env
    log("env", {k: v for k, v in env.items() if k != "rc"})


def gpu_processes() -> str:
    """The GPU's compute processes (nvidia-smi), other than none: a shared GPU makes times meaningless."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or "none"
    except Exception as e:  # noqa: BLE001 — informational only
        return f"nvidia-smi failed: {e}"


FAULT_CASES = {  # name: (shape key, launch overrides, gates)
    "call3-long": ("long", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0}}, ["scalar+beta"]),
    "call3-short": ("short", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0}}, ["scalar+beta"]),
    "call3-long-8w": ("long", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0, "num_warps": 8},
                               "gated_fused_bwd_states": {"num_warps": 8}}, ["scalar+beta"]),
    "call3-long-1stage": ("long", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0, "num_stages": 1},
                                   "gated_fused_bwd_states": {"num_stages": 1}}, ["scalar+beta"]),
    "default-long": ("long", {}, ["scalar+beta"]),
    "call3-d256": ("d256", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0}}, ["none+beta", "scalar", "scalar+beta"]),
    "call3-d256-8w": ("d256", {"gated_fused_fwd": {"MIN_BV": 16, "PREFETCH": 0, "num_warps": 8},
                               "gated_fused_bwd_states": {"num_warps": 8}}, ["none+beta", "scalar", "scalar+beta"]),
    "default-d256": ("d256", {}, ["none+beta", "scalar", "scalar+beta"]),
}


def stage_fault():
    d256 = [name for name in FAULT_CASES if FAULT_CASES[name][0] == "d256"] if refused_d256() else []
    refuse("fault", d256)
    jobs = [("fault", name, {"CUDA_LAUNCH_BLOCKING": "1"}) for name in FAULT_CASES if name not in d256]
    res = run_many(jobs, ARGS.workers, "fault", cap=120)
    lines = []
    for (_, name), r in res.items():
        verdict = fault_verdict(r)
        RESULTS.setdefault("fault", {})[name] = {k: v for k, v in r.items() if k != "tail"}
        log(f"fault {name:18s} {verdict:5s} " + "; ".join(r.get("summary", [])) +
            (f" | error: {r['error'][:300]}" if r.get("error") else ""))
        lines += [f"=== {name}: {verdict}", json.dumps({k: v for k, v in r.items() if k != "tail"}, indent=1,
                                                      default=str), "--- output tail", r.get("tail", "")]
    san = sanitizer()
    if san and fault_verdict(RESULTS["fault"].get("call3-long", {})) == "FAULT":
        RESULTS["sanitizer_cmd"] = san  # run beside the checks (stage_check)
    lines.append(f"=== compute-sanitizer: {san or 'not found'}")
    with open(os.path.join(OUT, "fault.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def fault_verdict(r: dict) -> str:
    """ok, WRONG (ran, some output off its twin), FAULT (a CUDA error), TIMEOUT, or DIED (another error)."""
    if r.get("passed"):
        return "ok"
    err = str(r.get("error", ""))
    if not err:
        return "WRONG"
    if r.get("rc") in ("timeout", "skipped"):
        return str(r["rc"]).upper()
    return "FAULT" if ("CUDA" in err or "AcceleratorError" in err or "illegal" in err) else "DIED"


def sanitizer() -> str | None:
    for path in [shutil.which("compute-sanitizer") or "", "/usr/local/cuda/bin/compute-sanitizer",
                 *sorted(os.path.join("/usr/local", d, "bin", "compute-sanitizer") for d in os.listdir("/usr/local")
                         if d.startswith("cuda"))]:
        if path and os.path.exists(path):
            return path
    return None


def stage_check():
    d256 = ["d256/default", "d256/call3"] if refused_d256() else []
    refuse("check", d256)
    first = [("check", c, {}) for c in ("anchor/staged-warm", "long/staged-warm", "long/default", "anchor/default",
                                         "small/default", "d256/default", "d256/call3") if c not in d256]
    rest = [[("check", f"{shape}/{cfg}", {}) for cfg in TIMED[shape] if cfg != "default"] for shape in ("long",
                                                                                                        "anchor")]
    jobs = first + [job for pair in zip(*rest) for job in pair] + rest[0][len(rest[1]):] + rest[1][len(rest[0]):]
    # long and anchor jobs alternate: fewer long-shape processes (≈ 5–10 GB of GPU memory each) at once
    if RESULTS.get("sanitizer_cmd"):  # call 3's fault reproduced: its kernels under memcheck, beside the checks
        jobs.insert(0, ("fault", "call3-long-kernels", {"CUDA_LAUNCH_BLOCKING": "1"},
                        [RESULTS["sanitizer_cmd"], "--tool", "memcheck", "--print-limit", "6"]))
    res = run_many(jobs, ARGS.workers, "check", cap=150)
    san = res.pop(("fault", "call3-long-kernels"), None)
    if san is not None:
        RESULTS["sanitizer"] = san.get("tail", "")[-2500:]
        log("compute-sanitizer (call3-long kernels):", san.get("tail", "")[-800:])
        with open(os.path.join(OUT, "fault.txt"), "a") as f:
            f.write("=== compute-sanitizer memcheck, call3-long, kernels only\n" + san.get("tail", "") + "\n")
    for (_, case), r in sorted(res.items()):
        RESULTS.setdefault("check", {})[case] = {k: v for k, v in r.items() if k != "tail"}
        if r.get("error"):
            RESULTS["failed"].append(f"check {case}: {r['error'][:200]}")
            log(f"check {case}: *** DIED *** {r['error'][:400]}")
        for row in r.get("rows", []):
            if row.get("error"):
                log(f"check {case:20s} {row['case']:44s} *** FAILED *** {row['error'][:300]}")
                RESULTS["failed"].append(f"check {case} {row['case']}: {row['error'][:120]}")
                continue
            if case.endswith("staged-warm"):
                log(f"check {case:20s} {row['case']:44s} (staged kernels compiled, not a check)")
                continue
            worst = max(row["errors"], key=lambda k: row["errors"][k]) if row["errors"] else "-"
            ok = "ok" if row["passed"] else "*** FAILED ***"
            det = "" if row.get("deterministic", True) else " NOT DETERMINISTIC"
            log(f"check {case:20s} {row['case']:44s} worst {worst} {row['errors'].get(worst, float('nan')):.2e}"
                f" (o {row['errors'].get('o', float('nan')):.2e}){det} {ok}")
            if not row["passed"]:
                RESULTS["failed"].append(f"check {case} {row['case']}")
    save()


def passed(shape: str, cfg: str, model: str) -> bool:
    r = RESULTS.get("check", {}).get(f"{shape}/{cfg}", {})
    return any(row["case"] == model and row["passed"] for row in r.get("rows", [])) and not r.get("error")


def stage_time():
    log("gpu processes before timing:", gpu_processes())
    for shape in ("anchor", "long"):
        if budget("time", 200) < 20:
            log(f"time {shape}: skipped, deadline")
            continue
        plan = {m: [c for c in TIMED[shape] if passed(shape, c, m)] for m in MODELS}
        with open(os.path.join(WORK, f"plan-{shape}.json"), "w") as f:
            json.dump(plan, f)
        r = inner("time", shape, timeout=budget("time", 200) if shape == "long" else budget("time", 200) / 2 + 10)
        RESULTS.setdefault("time", []).extend(r.get("rows", []))
        for row in r.get("rows", []):
            log(f"time {row['shape']} {row['model']:7s} {row['pipeline']:6s} {row['config']:12s} "
                f"{row['fwd_ms']:.3f} / {row['fwdbwd_ms']:.3f} ms  {row.get('programs', '')}")
        if r.get("error"):
            RESULTS["failed"].append(f"time {shape}: {r['error'][:200]}")
            log(f"time {shape}: *** DIED *** {r['error'][:400]}")
        save()


def stage_profile():
    if budget("profile", 90) < 15:
        log("profile: skipped, deadline")
        return
    r = inner("profile", "anchor", timeout=budget("profile", 90))
    with open(os.path.join(OUT, "profile.txt"), "w") as f:
        f.write(r.get("text", "") + ("\n" + r["error"] if r.get("error") else "") + "\n")
    RESULTS["profile"] = r.get("summary", {})
    for line in r.get("summary_lines", []):
        log("profile", line)
    if r.get("error"):
        log("profile died:", r["error"][:300])


def stage_tests():
    if ARGS.dry_run:
        log("tests: skipped in a dry run")
        return
    t = budget("tests", 600)
    if t < 60:
        log(f"tests: skipped, {t:.0f} s left of their budget")
        RESULTS["tests"] = {"rc": "skipped"}
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/kernels/fused/test_triton_gated_fused.py"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    CHILDREN.add(p)
    try:
        text, _ = p.communicate(timeout=t)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        kill(p)  # the whole group: no pytest worker outlives this script
        text, _ = p.communicate()
        rc = "timeout"
    finally:
        CHILDREN.discard(p)
    with open(os.path.join(OUT, "cuda_tests.txt"), "w") as f:
        f.write(text or "")
    RESULTS["tests"] = {"rc": rc, "tail": (text or "")[-3000:]}
    log("tests:", rc, "\n" + (text or "")[-1200:])


# ===================================================================================== parent: summary
def table_lines() -> list[str]:
    lines = ["| shape | model | pipeline | config | programs | fwd ms | fwd+bwd ms |",
             "|---|---|---|---|---|---:|---:|"]
    for r in RESULTS.get("time", []):
        lines.append(f"| {r['shape']} | {r['model']} | {r['pipeline']} | {r['config']} | {r.get('programs', '')} | "
                     f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} |")
    return lines


def summary():
    save()
    print("\n" + "\n".join(table_lines()))
    fault = RESULTS.get("fault", {})
    fv = ", ".join(f"{k} {fault_verdict(v)}" for k, v in fault.items())
    checks = RESULTS.get("check", {})
    cv = ", ".join(f"{k} {'died' if v.get('error') else sum(r['passed'] for r in v.get('rows', []))}/"
                   f"{len(v.get('rows', []))}" for k, v in sorted(checks.items()))
    print(f"\nfault: {fv or 'not run'}\nchecks (passed/cases): {cv or 'not run'}\n"
          f"refused: {'none' if not RESULTS.get('refused') else ', '.join(RESULTS['refused'])} | "
          f"failures: {'none' if not RESULTS['failed'] else '; '.join(RESULTS['failed'])[:1500]}"
          f" | tests: {RESULTS.get('tests', {}).get('rc', 'not run')} | {time.time() - T_START:.0f} s", flush=True)


STAGES = {"env": stage_env, "fault": stage_fault, "check": stage_check, "time": stage_time, "profile": stage_profile,
          "tests": stage_tests}


# ===================================================================================== inner: shared
DEV = "cuda"


def gated_pipeline_of(pipeline: str, cfg: str | tuple = "default"):
    """The `GatedPipeline` of a pipeline name and a config (CONFIGS: "keep" keeps h in the forward)."""
    from fastweights.kernels.pipelines import GatedPipeline

    _, keep = CONFIGS[cfg] if isinstance(cfg, str) else cfg
    return GatedPipeline(pipeline, recompute_states=not keep)


class use:
    """Within the block: the gated-linear Triton chunk row runs `gated_pipeline_of(pipeline, cfg)` (`rows.pinned`:
    what `fw.chunk(..., backend="triton")` and the models call; a direct `chunk_gated_triton` call passes
    `self.pipeline` itself) and util.LAUNCH takes the config's overrides (both undone after)."""

    def __init__(self, pipeline: str, cfg: str | tuple = "default"):
        self.pipeline = gated_pipeline_of(pipeline, cfg)
        self.launch, _ = CONFIGS[cfg] if isinstance(cfg, str) else cfg

    def __enter__(self):
        from fastweights.kernels.rows import pinned
        from fastweights.kernels.triton.common import util

        self.old = util.load_launch(self.launch)
        self.pin = pinned("gated_linear", pipeline=self.pipeline)
        self.pin.__enter__()
        return self

    def __exit__(self, *exc):
        from fastweights.kernels.triton.common import util

        self.pin.__exit__(*exc)
        util.LAUNCH.update(self.old)


def rel(a, b) -> float:
    """max |a − b| / max |b| (NaN anywhere in a: NaN, which fails every tolerance)."""
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def shape_of(key: str):
    return (DRY_SHAPES if ARGS.dry_run else SHAPES)[key]


def model_inputs(model, shape, dtype, seed=0):
    """The benchmark's inputs of `model` (fastweights.bench.speed.bench_inputs: example_inputs as trainable leaves)."""
    import torch

    from fastweights.bench.speed import bench_inputs

    B, T, H, D = shape
    torch.manual_seed(seed)
    inp = bench_inputs(model, B, T, H, D, dtype, torch.device(DEV))
    inp.pop("initial_state", None)
    return inp


def call_model(model, inp):
    """o of `fw.chunk(model, ...)` as layers call it (in a dry run through tests/fake_cuda.py's routing: the same
    rows, on CPU tensors under the interpreter)."""
    import fastweights as fw

    return fw.chunk(model, inp["q"], inp["k"], inp["v"], backend="triton", check_values=False, chunk_size=64,
                    **{k: v for k, v in inp.items() if k not in ("q", "k", "v")})[0]


def fake_cuda():
    """Dry run: the dispatch table's Triton rows accept CPU tensors (tests/fake_cuda.py, kernels run)."""
    from tests.fake_cuda import FakeCuda

    class Patch:  # the two monkeypatch verbs FakeCuda uses, applied for the process's life
        @staticmethod
        def setitem(d, key, val):
            d[key] = val

    FakeCuda(Patch(), kernels=True).install()


def fwd_grads(model, inp, seed=7):
    """(o, {input: gradient}) of a random projection of o, fp32 copies."""
    import torch

    leaves = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in inp.items()}
    o = call_model(model, leaves)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen, device=DEV)).sum()
    names = [k for k, v in leaves.items() if v.requires_grad]
    gs = torch.autograd.grad(loss, [leaves[k] for k in names])
    return o.detach().float(), {k: g.float() for k, g in zip(names, gs)}


def ref_grads(model, inp, seed=7):
    """(o, {input: gradient}) as `fwd_grads`, from the fp32 torch chunk form (`fw.chunk(..., backend="torch")`) on
    fp32 copies of the inputs — no Triton kernel, nothing to compile; GLA by groups of 4 heads (its diagonal-decay
    torch form at T = 32,768 ran out of memory in call 3; heads are independent) — Mamba2's too, RetNet's not (its
    decays are per head index)."""
    import torch

    import fastweights as fw

    leaves = {k: v.detach().float().requires_grad_(v.requires_grad) for k, v in inp.items()}
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = torch.randn(leaves["v"].shape, generator=gen, device=DEV)  # = fwd_grads' draw (o has v's shape)
    H = leaves["v"].shape[2]
    groups = [(h, min(h + 4, H)) for h in range(0, H, 4)] if model != "retnet" else [(0, H)]  # RetNet's decays
    # depend on the head's index: its heads cannot be sliced
    outs = []
    for h0, h1 in groups:
        part = {k: v[:, :, h0:h1] for k, v in leaves.items()}  # q, k, v, g, β: heads on dim 2
        o = fw.chunk(model, part.pop("q"), part.pop("k"), part.pop("v"), backend="torch", check_values=False,
                     chunk_size=64, **part)[0]
        (o.float() * r[:, :, h0:h1]).sum().backward()
        outs.append(o.detach().float())
    return torch.cat(outs, dim=2), {k: v.grad.float() for k, v in leaves.items() if v.requires_grad}


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


# ===================================================================================== inner: stages
def inner_env(case, path):
    import torch
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__}
    if not ARGS.dry_run:
        out.update(gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
    write(path, out)


def inner_fault(case, path):
    """Kernel by kernel (a sync after each), each output against its fp32 torch twin; the first exception ends it."""
    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.common.util import load_launch
    from fastweights.kernels.triton.fused import gated_fused

    kernels_only = case.endswith("-kernels")  # under compute-sanitizer: the kernels, no twins
    name = case[: -len("-kernels")] if kernels_only else case
    shape_key, launch, gates = FAULT_CASES[name]
    B, T, H, D = {"long": (1, 32768, 16, 128), "short": (1, 1000, 16, 128), "d256": (1, 4096, 4, 256)}[shape_key]
    if ARGS.dry_run:
        B, T, H, D = {"long": (1, 150, 2, 16), "short": (1, 70, 2, 16), "d256": (1, 90, 1, 32)}[shape_key]
    if shape_key == "d256" and refused_d256():
        raise RuntimeError(f"fault {case}: {refused_d256()}")
    load_launch(launch)
    out = {"shape": [B, T, H, D], "launch": launch, "steps": [], "summary": [], "passed": True}
    L = make_layout(B, T, H, H, D, D, 64, None, DEV)
    out["programs"] = gated_fused.fused_programs(L)
    write(path, out)
    for gate in gates:
        _fault_gate(gate, (B, T, H, D), L, out, path, twins=not kernels_only)
    write(path, out)


def _fault_gate(gate, shape, L, out, path, *, twins):
    import torch

    from fastweights.chunkwise import chunk_gated
    from fastweights.chunkwise.gated_bwd import chunk_gated_bwd
    from fastweights.kernels.triton.fused import gated_fused

    B, T, H, D = shape
    gen = torch.Generator(device=DEV).manual_seed(1)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=DEV)

    q = rnd(B, T, H, D).bfloat16()
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).bfloat16()
    v = rnd(B, T, H, D).bfloat16()
    beta = torch.sigmoid(rnd(B, T, H)).bfloat16() if "beta" in gate else None
    g = torch.nn.functional.logsigmoid(rnd(B, T, H) + 3.0) if gate.startswith("scalar") else None
    S0 = 0.3 * rnd(B, H, D, D)
    do = rnd(B, T, H, D).bfloat16()
    dht = rnd(B, H, D, D)
    want, tw = None, None
    if twins:
        f = {"q": q.float(), "k": k.float(), "v": v.float(), "beta": None if beta is None else beta.float()}
        want = chunk_gated(f["q"], f["k"], f["v"], g=g, beta=f["beta"], scale=0.1, initial_state=S0,
                           output_final_state=True, chunk_size=64)
        tw = chunk_gated_bwd(f["q"], f["k"], f["v"], g=g, beta=f["beta"], scale=0.1, initial_state=S0,
                             do=do.float(), dht=dht, chunk_size=64)

    def step(label, fn, compare):
        t = time.time()
        try:
            res = fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # the fault: recorded, the process ends (its context is gone)
            out["steps"].append({"gate": gate, "kernel": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            out["error"] = f"{gate} {label}: {type(e).__name__}: {str(e)[:300]}"
            out["passed"] = False
            out["summary"].append(f"{gate} {label} raised")
            write(path, out)
            raise
        errs = compare(res) if twins else {}
        bad = any(not (e < TOL["bfloat16"]) for e in errs.values())
        parts = res if isinstance(res, tuple) else (res,)
        out["steps"].append({"gate": gate, "kernel": label, "errors": errs, "seconds": round(time.time() - t, 3),
                             "nan": any(bool(torch.isnan(x).any()) for x in parts if x is not None)})
        out["summary"].append(f"{gate} {label} {'WRONG' if bad else 'ok'}" + (f" {max(errs.values()):.1e}" if errs
                                                                                else ""))
        out["passed"] &= not bad
        write(path, out)
        return res

    step("fwd", lambda: gated_fused.forward(q, k, v, g, beta, S0, 0.1, L, output_final_state=True),
         lambda r: {"o": rel(r[0].float(), want[0]), "S": rel(r[2], want[1])})
    _, h, _ = step("fwd states", lambda: gated_fused.forward(q, k, v, g, beta, S0, 0.1, L, write_o=False,
                                                             store_states=True),
                   lambda r: {"h": rel(r[1].float().transpose(1, 2), tw["entering"])})
    dh, _ = step("bwd states", lambda: gated_fused.states_bwd(q, g, do, dht, 0.1, L, need_dh0=True),
                 lambda r: {"dh": rel(r[0].float().transpose(1, 2), tw["dleaving"]), "dS0": rel(r[1], tw["dS0"])})

    def chunk_errs(r):
        errs = {"dq": rel(r[0].float(), tw["q"]), "dk": rel(r[1].float(), tw["k"]), "dv": rel(r[2].float(), tw["v"])}
        if g is not None:
            errs["dg"] = rel(r[3], tw["g"])
        if beta is not None:
            errs["dbeta"] = rel(r[4], tw["beta"])
        return errs

    step("bwd chunk", lambda: gated_fused.chunk_bwd(q, k, v, g, beta, h, dh, do, 0.1, L), chunk_errs)


def check_small_rows(sizes, cfg):
    """The default at small sizes (and K = V = 256) against the fp32 torch chunk form: every gate, with β; at the
    first size also without β, and GLA's decay × 40 in fp32 (the exact path)."""
    import torch

    from fastweights.chunkwise import chunk_gated
    from fastweights.kernels.triton.gated import chunk_gated_triton

    rows = []
    for i, (label, sz, lengths) in enumerate(sizes):
        cu = None if lengths is None else torch.tensor([0] + lengths, device=DEV).cumsum(0).to(torch.int32)
        cases = [(gate, True, 1.0) for gate in ("none", "scalar", "diagonal")]
        if i == 0:
            cases += [(gate, False, 1.0) for gate in ("none", "scalar", "diagonal")] + [("diagonal", True, 40.0)]
        for gate, with_beta, g_scale in cases:
            dtype = torch.float32 if g_scale != 1.0 else sz["dtype"]
            B, T, H, Hq, K, V, N = sz["B"], sz["T"], sz["H"], sz["Hq"], sz["K"], sz["V"], sz.get("N")
            gen = torch.Generator(device=DEV).manual_seed(i * 10 + with_beta)

            def rnd(*s, gen=gen):
                return torch.randn(*s, generator=gen, device=DEV)

            x = {"q": rnd(B, T, Hq, K).to(dtype), "v": rnd(B, T, H, V).to(dtype), "S0": 0.3 * rnd(N or B, H, K, V),
                 "k": torch.nn.functional.normalize(rnd(B, T, Hq, K), dim=-1).to(dtype)}
            if with_beta:
                x["beta"] = torch.sigmoid(rnd(B, T, H)).to(dtype)
            if gate != "none":
                x["g"] = g_scale * torch.nn.functional.logsigmoid(rnd(B, T, H, *((K,) if gate == "diagonal" else ()))
                                                                  + 3.0)

            def grads_of(fn, x=x):
                leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
                o, S = fn(leaves)
                gg = torch.Generator(device=DEV).manual_seed(3)
                loss = (o.float() * torch.randn(o.shape, generator=gg, device=DEV)).sum() + \
                    (S.float() * torch.randn(S.shape, generator=gg, device=DEV)).sum()
                gs = torch.autograd.grad(loss, list(leaves.values()))
                return o.detach().float(), S.detach().float(), {key: g.float() for key, g in zip(leaves, gs)}

            def tri(d, cu=cu):
                return chunk_gated_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d.get("beta"), scale=0.1,
                                          initial_state=d["S0"], output_final_state=True, chunk_size=64, cu_seqlens=cu,
                                          pipeline=gated_pipeline_of("fused", cfg))

            def ref(d, cu=cu, rep=H // Hq):
                f = {key: val.float() for key, val in d.items()}
                return chunk_gated(f["q"].repeat_interleave(rep, 2), f["k"].repeat_interleave(rep, 2), f["v"],
                                   g=f.get("g"), beta=f.get("beta"), scale=0.1, initial_state=f["S0"],
                                   output_final_state=True, chunk_size=64, cu_seqlens=cu)

            what = f"{label} {gate}{' + β' if with_beta else ''}{' × 40' if g_scale != 1.0 else ''}"
            want = grads_of(ref)
            with use("fused", cfg):
                got = grads_of(tri)
            errs = {"o": rel(got[0], want[0]), "S": rel(got[1], want[1])}
            errs.update({f"d{key}": rel(got[2][key], want[2][key]) for key in want[2]})
            tol = TOL[str(dtype).split(".")[-1]]
            rows.append({"case": what, "errors": errs, "passed": all(e < tol for e in errs.values())})
            del x, want, got
    return rows


def inner_check(case, path):
    """One (shape, config): every model through fw.chunk, fused bf16 against the fp32 torch chunk form on the same
    inputs (`ref_grads`); the fused forward run twice, bitwise equal. "staged-warm": the staged kernels compiled."""
    import torch

    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.fused import gated_fused

    shape_key, cfg = case.split("/")
    out = {"rows": []}
    write(path, out)
    if shape_key in ("small", "d256"):
        if shape_key == "small":
            lengths = [1000, 0, 1, 2047, 64, 63, 900] if not ARGS.dry_run else [20, 0, 1, 45]
            sizes = [("bf16 B4 T300 H16 D128", dict(B=4, T=300, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16), None),
                     ("bf16 B1 T1000 H16 D128", dict(B=1, T=1000, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16),
                      None),
                     ("fp32 varlen Hq4 H16 D128", dict(B=1, T=sum(lengths), H=16, Hq=4, K=128, V=128,
                                                       dtype=torch.float32, N=len(lengths)), lengths)]
            if ARGS.dry_run:
                sizes = [(a, {**b, "B": min(b["B"], 2), "T": 40 if b.get("N") is None else b["T"], "H": 2,
                              "Hq": 1 if b.get("N") else 2, "K": 16, "V": 16}, c) for a, b, c in sizes]
        else:
            if refused_d256():
                raise RuntimeError(f"check {case}: {refused_d256()}")
            D = 32 if ARGS.dry_run else D256
            T = 90 if ARGS.dry_run else 4096
            sizes = [(f"bf16 B1 T{T} H4 D{D}", dict(B=1, T=T, H=4, Hq=4, K=D, V=D, dtype=torch.bfloat16), None)]
        for row in check_small_rows(sizes, cfg):
            out["rows"].append(row)
            write(path, out)
        return
    label, shape = shape_of(shape_key)
    B, T, H, D = shape
    if cfg == "staged-warm":  # the staged bf16 kernels compiled at this shape before the time stage needs them
        for model in MODELS:
            inp = model_inputs(model, shape, torch.bfloat16)
            with use("staged"):
                fwd_grads(model, inp)
            out["rows"].append({"case": model, "errors": {}, "passed": True})
            write(path, out)
        return
    with use("fused", cfg):
        out["programs"] = gated_fused.fused_programs(make_layout(B, T, H, H, D, D, 64, None, DEV))
    for model in MODELS:
        inp = model_inputs(model, shape, torch.bfloat16)
        want = ref_grads(model, inp)
        try:  # a config that cannot compile for one model (e.g. out of shared memory) fails that model alone
            with use("fused", cfg):
                got = fwd_grads(model, inp)
                with torch.no_grad():
                    det = torch.equal(call_model(model, inp), call_model(model, inp))
        except Exception as e:  # a CUDA fault fails the models after it too (their context is gone)
            out["rows"].append({"case": model, "errors": {}, "passed": False,
                                "error": f"{type(e).__name__}: {str(e)[:300]}"})
            write(path, out)
            continue
        errs = {"o": rel(got[0], want[0])}
        errs.update({f"d{k}": rel(got[1][k], want[1][k]) for k in want[1]})
        out["rows"].append({"case": model, "errors": errs, "deterministic": det,
                            "passed": det and all(e < TOL["bfloat16"] for e in errs.values())})
        write(path, out)
        del inp, want, got
        if DEV == "cuda":
            torch.cuda.empty_cache()


def inner_time(case, path):
    import torch

    from fastweights.bench.speed import fwd_bwd, median_ms
    from fastweights.kernels.triton.common.layout import make_layout
    from fastweights.kernels.triton.fused import gated_fused

    with open(os.path.join(os.path.dirname(path), f"plan-{case}.json")) as f:
        plan = json.load(f)
    label, shape = shape_of(case)
    B, T, H, D = shape
    out = {"rows": []}
    warmup, reps = (1, 1) if ARGS.dry_run else (3, 20)
    for model in MODELS:
        inp = model_inputs(model, shape, torch.bfloat16)
        tensors = [t for t in inp.values() if t.requires_grad]
        fwd, fwdbwd = fwd_bwd(lambda model=model, inp=inp: call_model(model, inp), tensors)
        for pipeline, cfg in [("staged", "default")] + [("fused", c) for c in plan[model]]:
            with use(pipeline, cfg):
                try:
                    ms = (median_ms(fwd, torch.device(DEV), warmup, reps), median_ms(fwdbwd, torch.device(DEV), warmup,
                                                                              reps))
                except Exception as e:  # recorded with its config; a CUDA fault ends the process at the next call
                    out.setdefault("errors", []).append(f"{model} {pipeline} {cfg}: {type(e).__name__}: {e}"[:400])
                    out["error"] = out["errors"][0]
                    write(path, out)
                    continue
                progs = ""
                if pipeline == "fused":
                    p = gated_fused.fused_programs(make_layout(B, T, H, H, D, D, 64, None, DEV))
                    progs = f"{p['sequential']} seq (BV {p['BV']}) / {p['chunk']} chunk"
            out["rows"].append({"shape": label, "model": model, "pipeline": pipeline, "config": cfg,
                                "programs": progs, "fwd_ms": ms[0], "fwdbwd_ms": ms[1]})
            write(path, out)
        del inp, tensors
    write(path, out)


def inner_profile(case, path):
    """GPU time per kernel of one forward + backward (mean of 5, after warm-up) at the anchor: staged and the fused
    default (only where its check passed), and the event-timed wall time of the same step."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fastweights.bench.speed import fwd_bwd, median_ms

    label, shape = shape_of(case)
    with open(os.path.join(os.path.dirname(path), "profile-plan.json")) as f:
        checked = json.load(f)
    n = 1 if ARGS.dry_run else 5
    text, lines, summary = [f"GPU time per kernel, one forward + backward, {label} bf16 (mean of {n})"], [], {}
    for model in MODELS:
        inp = model_inputs(model, shape, torch.bfloat16)
        tensors = [t for t in inp.values() if t.requires_grad]
        _, fwdbwd = fwd_bwd(lambda model=model, inp=inp: call_model(model, inp), tensors)
        for pipeline in ("staged", "fused"):
            if pipeline == "fused" and model not in checked:
                continue
            with use(pipeline):
                for _ in range(1 if ARGS.dry_run else 3):
                    fwdbwd()
                if DEV == "cuda":
                    torch.cuda.synchronize()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
                with profile(activities=acts) as prof:
                    for _ in range(n):
                        fwdbwd()
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                wall = median_ms(fwdbwd, torch.device(DEV), 2, 10 if n > 1 else 1)
            kern = {}
            for ev in prof.key_averages():  # the kernels themselves (device events), not the CPU ops around them
                if getattr(ev, "device_type", None) != DeviceType.CUDA:
                    continue
                t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0) or 0
                if t > 0:
                    kern[ev.key] = kern.get(ev.key, 0.0) + t / n
            total = sum(kern.values()) / 1000.0
            summary[f"{model} {pipeline}"] = {"gpu_ms": total, "wall_ms": wall}
            lines.append(f"{model} {pipeline}: GPU {total:.3f} ms of kernels, {wall:.3f} ms event-timed")
            text.append(f"\n== {model} {pipeline}: {total:.3f} ms of GPU kernels, {wall:.3f} ms event-timed fwd+bwd")
            for key, us in sorted(kern.items(), key=lambda kv: -kv[1])[:14]:
                text.append(f"  {us:9.1f} us  {key[:110]}")
        del inp, tensors
    write(path, {"text": "\n".join(text), "summary": summary, "summary_lines": lines})


INNER = {"env": inner_env, "fault": inner_fault, "check": inner_check, "time": inner_time, "profile": inner_profile}


def main():
    global ARGS, OUT, WORK, DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_gated_fused"))
    ap.add_argument("--deadline", type=float, default=300,
                    help="seconds; each stage ends by a fixed fraction of it (STAGE_END: the tests by 1.2×)")
    ap.add_argument("--workers", type=int, default=8, help="inner processes at once (fault and check stages)")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors under the interpreter, tiny sizes")
    ap.add_argument("--inner", nargs=3, metavar=("STAGE", "CASE", "JSON"), help=argparse.SUPPRESS)
    ARGS = ap.parse_args()
    if ARGS.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV = "cpu"
    if ARGS.inner:
        stage, case, path = ARGS.inner
        try:
            if ARGS.dry_run:
                fake_cuda()
            INNER[stage](case, path)
        except Exception as e:
            prev = json.load(open(path)) if os.path.exists(path) else {}
            prev.setdefault("error", f"{type(e).__name__}: {str(e)[:500]}")
            prev["traceback"] = traceback.format_exc()[-2500:]
            write(path, prev)
            print(traceback.format_exc(), flush=True)
            sys.exit(1)
        return
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    WORK = tempfile.mkdtemp(prefix="gpu_gated_fused_")

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once
        for p in list(CHILDREN):  # no inner process outlives the call (it would share the GPU with the next one)
            kill(p)
        RESULTS["failed"].append(f"stopped by signal {signum} (a timeout around the call)")
        summary()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    for name in ARGS.stages:
        if name != "env" and time.time() > until(name) - 5:
            log(f"stage {name}: skipped, past the deadline")
            RESULTS.setdefault("skipped", []).append(name)
            continue
        log(f"=== stage {name} at {time.time() - T_START:.0f} s")
        if name == "profile":
            write(os.path.join(WORK, "profile-plan.json"), [m for m in MODELS if passed("anchor", "default", m)])
        try:
            STAGES[name]()
        except Exception as e:
            RESULTS["failed"].append(f"stage {name}: {type(e).__name__}: {e}")
            log(f"stage {name} failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        RESULTS.setdefault("stage_seconds", {})[name] = round(time.time() - T_START, 1)
        save()
    summary()
    sys.exit(1 if RESULTS["failed"] else 0)


if __name__ == "__main__":
    main()
