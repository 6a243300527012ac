"""One GPU call for the delta class's fused forward (`fastweights.kernels.triton.delta_fused`): checks,
then times, then tests — staged against fused, side by side, in one process.

    python3 scripts/gpu_fused.py --deadline 480            # on the H100; results under $OUT
    python3 scripts/gpu_fused.py --dry-run --deadline 300  # plumbing only: CPU, the interpreter, tiny sizes

Stages (each result written to $OUT as soon as it is measured: results.json, log.txt, fused.md,
cuda_tests.xml):
1. env: GPU, SMs, torch, triton.
2. check: the default launch config, fused forward (+ the staged backward: `DeltaPipeline(forward, "staged")`
   passed to `chunk_delta_triton`, the default rule's fused backward not mixed in) against the fp32 torch
   chunk form at three sizes (the two timed specializations, and fp32 grouped heads + varlen with an empty
   and a length-1 sequence), every gate; outputs, final states, every gradient. Triton 3.6 on Hopper
   miscompiles some patterns: a config that fails here is reported and not timed.
3. time: staged vs fused forward (each with the staged backward), forward and forward + backward medians
   (CUDA events), gated_deltanet, deltanet and kda at B=4 T=4096 H=16 K=V=128 and at B=1 T=32768 with 16
   q/k heads, 32 value heads, bf16, q and k unit-norm, no final state; the fused grids' program counts
   (`delta_fused.fused_programs`).
4. graph: a varlen fused forward + backward captured in a CUDA graph and replayed (no host sync inside);
   the compiled variants of the fused kernels over 21 packings.
5. variants: each --configs launch config checked as in 2, then timed as in 3.
6. tests: `pytest -m cuda tests/kernels/test_triton_delta_fused.py` (after the timings: a timeout kills only
   pytest's main process).

Needs only torch and triton (no fla). No stage starts past --deadline seconds; a failing stage records its
error and the next one runs.
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
from functools import partial

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RESULTS: dict = {}
T_START = time.time()
DEVICE = "cuda"
ARGS = None
OUT = ""
MODELS = {"gated_deltanet": "scalar", "deltanet": "none", "kda": "diagonal"}
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


def md(line: str):
    with open(os.path.join(OUT, "fused.md"), "a") as f:
        f.write(line + "\n")


def past_deadline() -> bool:
    return time.time() - T_START > ARGS.deadline


def bench_ms(fn, warmup=3, reps=20) -> float:
    from fastweights.bench.speed import _bench

    return _bench(fn, torch.device(DEVICE), warmup, reps)


# ----------------------------------------------------------------------------------------- inputs
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


def run_triton(x, forward: str, *, cu=None, final=True, scale=None):
    """chunk_delta_triton with `forward` ("staged" or "fused") and the staged backward (`DeltaPipeline`)."""
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.delta import chunk_delta_triton

    return chunk_delta_triton(x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], scale=scale,
                              initial_state=x.get("S0"), output_final_state=final, chunk_size=64, cu_seqlens=cu,
                              pipeline=DeltaPipeline(forward, "staged"))


def run_torch(x, *, cu=None, scale=None):
    """The fp32 torch chunk form, grouped heads repeated."""
    from fastweights.chunkwise import chunk_delta

    xf = {key: val.float() for key, val in x.items()}
    rep = xf["v"].shape[2] // xf["q"].shape[2]
    q, k = xf["q"].repeat_interleave(rep, 2), xf["k"].repeat_interleave(rep, 2)
    return chunk_delta(q, k, xf["v"], g=xf.get("g"), beta=xf["beta"], scale=scale, initial_state=xf.get("S0"),
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


# ----------------------------------------------------------------------------------------- launch configs
def configs() -> list[dict]:
    """The fused kernels' launch configs to check and time: util.LAUNCH entries, parsed from --configs
    "name:key=val,key=val;name:...", the default (empty) first."""
    out = [{}]
    for spec in ARGS.configs:
        cfg: dict = {}
        for part in spec.split(";"):
            name, kv = part.split(":")
            cfg[name] = {k: int(v) for k, v in (item.split("=") for item in kv.split(","))}
        out.append(cfg)
    return out


def cfg_str(cfg: dict) -> str:
    return "default" if not cfg else ";".join(f"{n}:" + ",".join(f"{k}={v}" for k, v in c.items())
                                             for n, c in cfg.items())


class use:
    """Within the block: util.LAUNCH updated by cfg (undone after). (`forward`, the pipeline's, is passed to the
    glue by `run_triton` itself; it is kept here as the label of the block.)"""

    def __init__(self, forward: str, cfg: dict | None = None):
        self.forward, self.cfg = forward, cfg or {}

    def __enter__(self):
        from fastweights.kernels.triton import util

        self.old = util.load_launch(self.cfg)

    def __exit__(self, *exc):
        from fastweights.kernels.triton import util

        util.LAUNCH.update(self.old)


# ----------------------------------------------------------------------------------------- stages
def stage_env():
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if DEVICE == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
    RESULTS["env"] = env
    log("env", env)
    md(f"# gpu_fused.py — {env}\n")


def check_sizes():
    """(label, inputs' size, varlen lengths or None, with an initial and a final state): the two timed
    specializations (H, H_q and the program rows B·H are constexprs or pick BV: checked as timed, at a
    shorter T, no initial or final state) and a general one (fp32, grouped heads, varlen with an empty and
    a length-1 sequence, initial and final state)."""
    if ARGS.dry_run:
        lengths = [20, 0, 1, 45]
        return [("bf16 B2 T40 H2 D16", dict(B=2, T=40, H=2, Hq=2, K=16, V=16, dtype=torch.bfloat16), None, False),
                ("bf16 B1 T70 Hq1 H2 D32", dict(B=1, T=70, H=2, Hq=1, K=32, V=32, dtype=torch.bfloat16), None,
                 False),
                ("fp32 varlen Hq1 H2 D16", dict(B=1, T=sum(lengths), H=2, Hq=1, K=16, V=16, dtype=torch.float32,
                                                N=len(lengths)), lengths, True)]
    lengths = [1000, 0, 1, 2047, 64, 63, 900]
    return [("bf16 B4 T300 H16 D128 (as timed)", dict(B=4, T=300, H=16, Hq=16, K=128, V=128, dtype=torch.bfloat16),
             None, False),
            ("bf16 B1 T1500 Hq16 H32 D128 (as timed)", dict(B=1, T=1500, H=32, Hq=16, K=128, V=128,
                                                            dtype=torch.bfloat16), None, False),
            ("fp32 varlen T4075 Hq4 H16 D128", dict(B=1, T=sum(lengths), H=16, Hq=4, K=128, V=128,
                                                    dtype=torch.float32, N=len(lengths)), lengths, True)]


def check_config(cfg: dict, *, staged: bool) -> bool:
    """The fused forward (+ staged backward) under cfg against the fp32 torch chunk form: every model, the
    three check sizes; with `staged` the staged forward beside it (a failing reference shows there too)."""
    ok = True
    for label, size, lengths, states in check_sizes():
        cu = None if lengths is None else torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
        for model, gate in MODELS.items():
            x = inputs(gate, S0=states, seed=len(label), **size)
            want = with_grads(lambda d, cu=cu: run_torch(d, cu=cu), x, final=states)
            tol = TOL_F32 if size["dtype"] == torch.float32 else TOL_BF16
            for fwd in ("fused", "staged") if staged else ("fused",):
                with use(fwd, cfg):
                    got = with_grads(partial(run_triton, forward=fwd, cu=cu, final=states), x, final=states)
                err = errors(got, want)
                worst = max(err, key=err.get)
                passed = all(v < tol for v in err.values())
                ok &= passed or fwd == "staged"
                RESULTS.setdefault("check", []).append({"config": cfg_str(cfg), "size": label, "model": model,
                                                        "forward": fwd, "errors": err, "passed": passed})
                log(f"check {cfg_str(cfg)} {fwd:6s} {model:15s} {label}: worst {worst} {err[worst]:.2e} "
                    f"o {err['o']:.2e} {'ok' if passed else 'FAILED'}")
        save()
    return ok


def check_and_record(cfg: dict) -> bool:
    t = time.time()
    ok = check_config(cfg, staged=not cfg)
    log(f"check {cfg_str(cfg)}: {'passed' if ok else 'FAILED — not timed'} ({time.time() - t:.0f} s)")
    RESULTS.setdefault("trusted" if ok else "rejected", []).append(cfg_str(cfg))
    save()
    return ok


def stage_check():
    """The default launch config (the other configs are checked in `variants`, each before it is timed)."""
    RESULTS["default_ok"] = check_and_record({})


def time_shapes():
    if ARGS.dry_run:
        return [("B1 T64 H2 D16", dict(B=1, T=64, H=2, Hq=2, K=16, V=16)),
                ("B1 T64 Hq1 H2 D16", dict(B=1, T=64, H=2, Hq=1, K=16, V=16))]
    return [("B4 T4096 H16 D128", dict(B=4, T=4096, H=16, Hq=16, K=128, V=128)),
            ("B1 T32768 Hq16 H32 D128", dict(B=1, T=32768, H=32, Hq=16, K=128, V=128))]


def time_case(x, fwd: str, cfg: dict) -> tuple[float, float]:
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}

    def f():
        with torch.no_grad():
            run_triton(leaves, fwd, final=False)

    def fb():
        o = run_triton(leaves, fwd, final=False)[0]
        o.float().sum().backward()
        for t in leaves.values():
            t.grad = None

    with use(fwd, cfg):
        warmup, reps = (1, 1) if ARGS.dry_run else (3, 20)
        return bench_ms(f, warmup, reps), bench_ms(fb, warmup, reps)


def time_rows(forwards: list[tuple[str, dict]]):
    """Time each (forward, config) at every shape and model (the md table's rows)."""
    from fastweights.kernels.triton.delta_fused import fused_programs
    from fastweights.kernels.triton.layout import make_layout

    for label, size in time_shapes():
        for model, gate in MODELS.items():
            if past_deadline():
                log("time: deadline reached")
                return
            x = inputs(gate, dtype=torch.bfloat16, **size)
            for fwd, cfg in forwards:
                try:
                    ms = time_case(x, fwd, cfg)
                except Exception as e:  # e.g. out of shared memory for one config: recorded, the rest go on
                    log(f"time {label} {model} {fwd} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:300]}")
                    RESULTS.setdefault("time_errors", []).append([label, model, fwd, cfg_str(cfg), repr(e)[:1000]])
                    continue
                progs = ""
                if fwd == "fused":
                    with use(fwd, cfg):
                        L = make_layout(size["B"], size["T"], size["H"], size["Hq"], size["K"], size["V"], 64, None,
                                        DEVICE)
                        p = fused_programs(L)
                    progs = f"{p['prepass']} / {p['sequential']}, BV {p['BV']}"
                RESULTS.setdefault("time", []).append({"shape": label, "model": model, "forward": fwd,
                                                       "config": cfg_str(cfg), "programs": progs,
                                                       "fwd_ms": ms[0], "fwdbwd_ms": ms[1]})
                log(f"time {label} {model:15s} {fwd:6s} {cfg_str(cfg)}: {ms[0]:.3f} / {ms[1]:.3f} ms  {progs}")
                md(f"| {label} | {model} | {fwd} | {cfg_str(cfg)} | {progs} | {ms[0]:.3f} | {ms[1]:.3f} |")
                save()


def stage_time():
    """Staged and fused (default config, if it passed its check) side by side."""
    md("| shape | model | forward | config | programs (pre-pass / sequential, BV) | fwd ms | fwd+bwd ms |")
    md("|---|---|---|---|---|---:|---:|")
    ok = RESULTS.get("default_ok")
    if not ok:
        log("time: the fused forward's default config did not pass (or was not checked) — staged only")
    time_rows([("staged", {})] + ([("fused", {})] if ok else []))


def stage_variants():
    """Each extra launch config (--configs): checked at the three sizes, then timed if it passed."""
    for cfg in configs()[1:]:
        if past_deadline():
            log("variants: deadline reached")
            return
        if check_and_record(cfg):
            time_rows([("fused", cfg)])


def stage_graph():
    """A varlen fused forward + backward captured in one CUDA graph and replayed against the eager result; and
    the fused kernels' compiled variants before and after 20 further packings (must not grow)."""
    from fastweights.kernels.triton import delta_fused

    def n_compiled():
        out = {}
        for name in ("_prepass_kernel", "_fused_fwd_kernel"):
            fn = getattr(delta_fused, name)
            caches = getattr(fn, "device_caches", None)
            out[name] = None if caches is None else sum(len(c[0]) for c in caches.values())
        return out

    gen = torch.Generator().manual_seed(1)
    with use("fused"):
        counts = []
        for i in range(21):
            n = int(torch.randint(1, 4 if ARGS.dry_run else 9, (1,), generator=gen))
            lengths = torch.randint(0, 40 if ARGS.dry_run else 700, (n,), generator=gen).tolist()
            T = max(1, sum(lengths))
            lengths[-1] += T - sum(lengths)
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(DEVICE)
            D = 16 if ARGS.dry_run else 64
            x = inputs("scalar", B=1, T=T, H=4, Hq=2, K=D, V=D, dtype=torch.bfloat16, N=n, S0=True, seed=i)
            with_grads(lambda d, cu=cu: run_triton(d, "fused", cu=cu), x)
            counts.append(n_compiled())
        RESULTS["compiles_over_packings"] = counts
        log(f"graph: compiled variants after packing 1: {counts[0]}, after 21: {counts[-1]}")
        if DEVICE != "cuda":
            return
        lengths = [300, 0, 1, 700, 23]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(DEVICE)
        x = inputs("scalar", B=1, T=sum(lengths), H=4, Hq=2, K=64, V=64, dtype=torch.bfloat16, N=len(lengths),
                   S0=True)
        leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
        do = torch.randn(x["v"].shape, device=DEVICE, dtype=torch.bfloat16)

        def step():
            o, S = run_triton(leaves, "fused", cu=cu)
            torch.autograd.backward([o, S], [do, torch.ones_like(S)])
            return o, S

        eager = [t.detach().clone() for t in step()]
        eager_g = {key: val.grad.detach().clone() for key, val in leaves.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                for val in leaves.values():
                    val.grad = None
                step()
        torch.cuda.current_stream().wait_stream(s)
        for val in leaves.values():
            val.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(out, eager))
        same_g = all(torch.equal(leaves[key].grad, eager_g[key]) for key in leaves)
        RESULTS["graph"] = {"captured": True, "outputs_equal": same, "grads_equal": same_g}
        log(f"graph: captured and replayed; outputs bitwise equal to eager: {same}, gradients: {same_g}")


def stage_tests():
    if ARGS.dry_run:
        log("tests: skipped in a dry run")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/kernels/test_triton_delta_fused.py", f"--junitxml={os.path.join(OUT, 'cuda_tests.xml')}"]
    left = max(30.0, ARGS.deadline + 60 - (time.time() - T_START))
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
        tail = (r.stdout + r.stderr)[-4000:]
        RESULTS["tests"] = {"rc": r.returncode, "tail": tail}
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-4000:]
        RESULTS["tests"] = {"rc": "timeout", "tail": tail}
    log("tests:", RESULTS["tests"]["rc"], "\n" + RESULTS["tests"]["tail"][-1500:])


STAGES = {"env": stage_env, "check": stage_check, "time": stage_time, "graph": stage_graph,
          "variants": stage_variants, "tests": stage_tests}


def main():
    global ARGS, OUT, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_fused"))
    ap.add_argument("--deadline", type=float, default=480, help="seconds after which no new stage or row starts")
    ap.add_argument("--configs", nargs="*", default=["delta_fused_fwd:num_warps=8", "delta_prepass:AQK=1",
                                                    "delta_fused_fwd:PROGRAMS=1", "delta_prepass:num_warps=8",
                                                    "delta_fused_fwd:PROGRAMS=512"],
        help='extra launch configs of the fused kernels, each "site:key=val,...;site:..." (util.LAUNCH); '
             'PROGRAMS=1 keeps BV at its cap (64), 512 halves it further; AQK=1: Aqk from the pre-pass')
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors under the interpreter, tiny sizes")
    ARGS = ap.parse_args()
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    if ARGS.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    for name in ARGS.stages:
        if past_deadline():
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


if __name__ == "__main__":
    main()
