"""One GPU call for the Triton kernels (`fastweights.kernels.triton`): the CUDA tests, each launch
config checked and timed, the speed table beside the peers, the decode step, a per-kernel profile.

    python3 scripts/gpu_kernels.py --stages env tests sweep speed decode profile --deadline 540

Every result lands in $OUT (or --out) as soon as it is measured, in at most eight files (what the
device tool brings back): results.json (every stage's numbers), log.txt, cuda_tests.xml,
speed.md, profile.txt, triton_cache.tgz (Triton's compile cache, to carry into the next call:
`--cache path/to/triton_cache.tgz` unpacks it first). A stage that fails records its error and the
next stage runs; stages that would start past --deadline seconds are skipped and say so.

Correctness is the tests' job (`pytest -m "cuda or triton" tests/kernels tests/cuda`: the kernels
against their torch twins and the float64 recurrence, NaN-poisoned outputs, fresh random inputs).
The sweep stage adds what Triton 3.6 on Hopper asks for: every launch config checked against the
fp32 torch chunk form at several sizes before its time is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
import traceback

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RESULTS: dict = {}
T_START = time.time()


def log(*a):
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    with open(os.path.join(OUT, "log.txt"), "a") as f:
        f.write(msg + "\n")


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def bench_ms(fn, warmup=3, reps=20) -> float:
    """Median ms of fn() over `reps` calls, device events around each (`bench speed`'s timer)."""
    from fastweights.bench.speed import _bench

    return _bench(fn, torch.device("cuda"), warmup, reps)


# ----------------------------------------------------------------------------------------- stages
def stage_env():
    import triton

    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mm = bench_ms(lambda a=a, b=b: a @ b, warmup=3, reps=10)
    x = torch.randn(1 << 29, device=dev)
    y = torch.empty_like(x)
    cp = bench_ms(lambda x=x, y=y: y.copy_(x), warmup=3, reps=10)
    env = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "python": platform.python_version(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "bf16_matmul_tflops": 2 * n ** 3 / mm / 1e9, "copy_tbps": 2 * x.numel() * 4 / cp / 1e9}
    del a, b, x, y
    torch.cuda.empty_cache()
    RESULTS["env"] = env
    log(env)


def stage_tests():
    cmd = [sys.executable, "-m", "pytest", "-q", "-x" if ARGS.stop_first else "-q", "-m", "cuda or triton",
           "-p", "no:cacheprovider", "-n", str(ARGS.workers), "--timeout", "300",
           *(["-k", ARGS.test_k] if ARGS.test_k else []), *ARGS.test_paths,
           f"--junitxml={os.path.join(OUT, 'cuda_tests.xml')}"]
    log(" ".join(cmd))
    t = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ARGS.tests_timeout)
    tail = (p.stdout + p.stderr)[-6000:]
    log(tail)
    RESULTS["tests"] = {"exit": p.returncode, "seconds": time.time() - t, "tail": tail[-1500:]}


def _gated_inputs(model, B, T, H, D, dtype, seed):
    import fastweights as fw

    x = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float32,
                          device="cuda", seed=seed)
    x.pop("initial_state", None)
    return {k: (v.to(dtype) if k in ("q", "k", "v") else v) for k, v in x.items()}


def _run_with_grads(model, x, backend, dtype_compute=None):
    import fastweights as fw

    leaves = {k: v.detach().clone().to(dtype_compute or v.dtype).requires_grad_(True) for k, v in x.items()}
    o, S = fw.chunk(model, backend=backend, output_final_state=True, **leaves)
    S = S if isinstance(S, torch.Tensor) else S.weights[0]
    gen = torch.Generator(device="cuda").manual_seed(7)
    wo = torch.randn(o.shape, device="cuda", generator=gen)
    ws = torch.randn(S.shape, device="cuda", generator=gen)
    loss = (o.float() * wo).sum() + (S.float() * ws).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach().float(), S.detach().float(), {k: g.float() for k, g in zip(leaves, grads)}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def stage_sweep():
    """Each launch config × model × size: relative errors against the fp32 torch chunk form on the
    same (bf16-rounded) inputs, then the median fwd and fwd+bwd times at the anchor size."""
    import fastweights as fw
    from fastweights.kernels.triton import util

    configs = [tuple(int(v) for v in c.split(",")) for c in ARGS.configs]
    sizes = [(2, 1000, 4, 64), (1, 333, 3, 128), (4, 4096, 16, 128)]
    out = RESULTS.setdefault("sweep", [])
    default = dict(util.LAUNCH)
    for nw, ns in configs:
        util.LAUNCH.update(num_warps=nw, num_stages=ns)
        for model in ARGS.models:
            for size in sizes:
                if time.time() - T_START > ARGS.deadline:
                    log("sweep: deadline reached")
                    util.LAUNCH.update(default)
                    return
                rec = {"num_warps": nw, "num_stages": ns, "model": model, "size": size}
                try:
                    seed = int.from_bytes(os.urandom(4), "little")
                    rec["seed"] = seed
                    x = _gated_inputs(model, *size, torch.bfloat16, seed)
                    want = _run_with_grads(model, x, "torch", torch.float32)
                    got = _run_with_grads(model, x, "triton")
                    errs = {"o": _rel(got[0], want[0]), "S": _rel(got[1], want[1])}
                    errs.update({f"d{k}": _rel(got[2][k], want[2][k]) for k in want[2]})
                    rec["errors"] = errs
                    rec["finite"] = all(torch.isfinite(t).all().item() for t in (got[0], got[1], *got[2].values()))
                    if size == sizes[-1]:
                        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}

                        def fwd(model=model, leaves=leaves):
                            with torch.no_grad():
                                fw.chunk(model, backend="triton", **leaves)

                        def fwdbwd(model=model, leaves=leaves):
                            o = fw.chunk(model, backend="triton", **leaves)[0]
                            o.float().sum().backward()
                            for t in leaves.values():
                                t.grad = None

                        rec["fwd_ms"] = bench_ms(fwd)
                        rec["fwdbwd_ms"] = bench_ms(fwdbwd)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                out.append(rec)
                save()
                worst = max(rec.get("errors", {"-": float("nan")}).values())
                log(f"sweep nw={nw} ns={ns} {model} {size}: worst rel {worst:.2e} finite={rec.get('finite')} "
                    f"fwd {rec.get('fwd_ms')} fwdbwd {rec.get('fwdbwd_ms')} {rec.get('error', '')[:300]}")
                torch.cuda.empty_cache()
    util.LAUNCH.update(default)


def stage_speed():
    from fastweights.bench.speed import run_speed

    env = RESULTS.get("env", {})
    tmp = os.path.join(OUT, "speed")  # rows land here as they are timed
    rows = []
    for B, T in (tuple(int(x) for x in bt.split(",")) for bt in ARGS.lengths):
        if time.time() - T_START > ARGS.deadline:
            log("speed: deadline reached")
            break
        forms = ARGS.forms if T <= 16384 else ["chunk_triton"]
        r = run_speed(models=ARGS.models, forms=forms, lengths=[T], B=B, H=16, D=128, dtype="bfloat16",
                      device="cuda", out_dir=f"{tmp}/{B}x{T}", peers=ARGS.peers and T == 4096, chunk_size=64,
                      peak_tflops=env.get("bf16_matmul_tflops"), peak_tbps=env.get("copy_tbps"),
                      repeats=20, warmup=3, log=log)
        rows += r
        from dataclasses import asdict

        RESULTS["speed"] = [asdict(x) for x in rows]
        save()


def graph_ms(fn, steps=20, reps=20) -> float:
    """Median ms of one fn() call, timed as replays of a CUDA graph of `steps` calls (what the
    CUDA-graph decoder does: no launch gaps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    return bench_ms(graph.replay, warmup=3, reps=reps) / steps


def stage_decode():
    """The fused step, in place: B=64, H=16, K=V=128, fp32 and bf16 state, gated-linear (GLA:
    diagonal decay) and delta (gated DeltaNet: scalar decay), every launch config of the sweep;
    bytes = the state read and written (the token vectors are 1% of it). Then the layer's path
    (fw.recurrent, T = 1: a copy of the state, then the kernel) and fla's fused recurrent step."""
    import fastweights as fw
    from fastweights.kernels.triton import decode

    B, H, K, V = 64, 16, 128, 128
    out = RESULTS.setdefault("decode", [])
    default = dict(decode.STEP_LAUNCH)
    for name, delta, gate in (("gla", False, "diagonal"), ("gated_deltanet", True, "scalar")):
        q, k, v = (torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, *((K,) if gate == "diagonal" else ()),
                                                       device="cuda"))
        beta = torch.rand(B, 1, H, device="cuda")
        for sdt in (torch.float32, torch.bfloat16):
            for cfg in ARGS.decode_configs:
                bv, nw, ns = (int(c) for c in cfg.split(","))
                decode.STEP_LAUNCH.update(block_v=bv, num_warps=nw, num_stages=ns)
                state = (0.1 * torch.randn(B, H, K, V, device="cuda")).to(sdt)
                # correctness of this config: one step against the float64 recurrence on the same state
                want_o, want_S = fw.recurrent(name, q.double(), k.double(), v.double(), g=g.double(),
                                              beta=beta.double(), initial_state=state.double(),
                                              output_final_state=True)
                o = decode.fused_recurrent_step(q, k, v, state, g=g, beta=beta, delta=delta)
                err = max(_rel(o.double(), want_o), _rel(state.double(), want_S))
                args, kw = (q, k, v, state), dict(g=g, beta=beta, delta=delta)
                ms = graph_ms(lambda args=args, kw=kw: decode.fused_recurrent_step(*args, **kw))
                nbytes = 2 * state.numel() * state.element_size()
                rec = {"model": name, "impl": "kernel in place", "state_dtype": str(sdt), "config": cfg,
                       "us": 1e3 * ms, "state_TBps": nbytes / ms / 1e9, "rel_err": err}
                out.append(rec)
                save()
                log(f"decode {name} state {sdt} cfg {cfg}: {1e3 * ms:.1f} µs, {rec['state_TBps']:.2f} TB/s, "
                    f"rel err {err:.1e}")
        decode.STEP_LAUNCH.update(default)
        S0 = 0.1 * torch.randn(B, H, K, V, device="cuda")
        with torch.no_grad():
            ms = graph_ms(lambda: fw.recurrent(name, q, k, v, g=g, beta=beta, initial_state=S0,  # noqa: B023
                                               output_final_state=True, check_values=False))
        rec = {"model": name, "impl": "fw.recurrent (auto → triton): copy + kernel", "state_dtype": "fp32",
               "us": 1e3 * ms, "state_TBps": 2 * S0.numel() * 4 / ms / 1e9}
        out.append(rec)
        log(f"decode {name} {rec['impl']}: {rec['us']:.1f} µs, {rec['state_TBps']:.2f} TB/s (of one read + write)")
        if ARGS.peers:
            try:
                import fla.ops as ops

                fn = ops.fused_recurrent_gla if name == "gla" else ops.fused_recurrent_gated_delta_rule
                kw = dict(gk=g) if name == "gla" else dict(g=g, beta=beta)
                with torch.no_grad():
                    ms = graph_ms(lambda fn=fn, kw=kw: fn(q, k, v, **kw, initial_state=S0, output_final_state=True))  # noqa: B023
                rec = {"model": name, "impl": "fla fused_recurrent (new final state)", "state_dtype": "fp32",
                       "us": 1e3 * ms, "state_TBps": 2 * S0.numel() * 4 / ms / 1e9}
            except Exception as e:
                rec = {"model": name, "impl": "fla", "error": f"{type(e).__name__}: {e}"[:500]}
            out.append(rec)
            log(f"decode {name} fla: {rec}")
        save()


def stage_profile():
    """Per-kernel CUDA times of one fwd+bwd at the anchor shape (B=4, T=4096, H=16, D=128, bf16)."""
    from torch.profiler import ProfilerActivity, profile

    import fastweights as fw

    lines = []
    for model in ARGS.models:
        x = _gated_inputs(model, 4, 4096, 16, 128, torch.bfloat16, 1)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}

        def step(model=model, leaves=leaves):
            o = fw.chunk(model, backend="triton", **leaves)[0]
            o.float().sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        lines.append(f"## {model} (5 fwd+bwd calls)\n{table}\n")
        with open(os.path.join(OUT, "profile.txt"), "w") as f:
            f.write("\n".join(lines))
    log("\n".join(lines)[-6000:])


def stage_lmprofile():
    """Per-kernel CUDA times of one LM optimizer step (the `bench train` row: d_model 1024, 8 layers,
    8 heads of 128, vocab 32768, B=4, T=4096, bf16 autocast) for each of --models, top 40 kernels,
    into lmprofile.txt: where a layer's time goes besides the memory kernel."""
    from torch.profiler import ProfilerActivity, profile

    from fastweights.bench.train import _config, _optimizer
    from fastweights.models import LM

    lines = []
    for model in ARGS.models:
        cfg = _config(model, vocab_size=32768, d_model=1024, n_layers=8, num_heads=8, head_dim=128,
                      backend=ARGS.lm_backend)
        with torch.device("cuda"):
            lm = LM(cfg)
        opt, _ = _optimizer(lm, torch.device("cuda"))
        ids = torch.randint(0, cfg.vocab_size, (4, 4097), device="cuda")

        def step(lm=lm, opt=opt, ids=ids):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = lm(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        lines.append(f"## {model} LM (2 optimizer steps, backends {sorted(set(lm.backends))})\n{table}\n")
        with open(os.path.join(OUT, "lmprofile.txt"), "w") as f:
            f.write("\n".join(lines))
        del lm, opt, step
        torch.cuda.empty_cache()
    log("\n".join(lines)[-5000:])


STAGES = {"env": stage_env, "tests": stage_tests, "sweep": stage_sweep, "speed": stage_speed,
          "decode": stage_decode, "profile": stage_profile, "lmprofile": stage_lmprofile}


def main():
    global OUT, ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    ap.add_argument("--deadline", type=float, default=540, help="seconds after which no new stage or row starts")
    ap.add_argument("--tests-timeout", type=float, default=300)
    ap.add_argument("--test-paths", nargs="+", default=["tests/kernels", "tests/cuda"])
    ap.add_argument("--test-k", default="", help="pytest -k expression for the tests stage")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--stop-first", action="store_true")
    ap.add_argument("--models", nargs="+", default=["gla", "mamba2", "retnet"])
    ap.add_argument("--configs", nargs="+", default=["4,2", "4,3", "8,2"], help="num_warps,num_stages")
    ap.add_argument("--decode-configs", nargs="+", default=["32,4,1"], help="block_v,num_warps,num_stages")
    ap.add_argument("--warm-flashqla", action="store_true",
                    help="compile FlashQLA's kernels (TileLang JIT, minutes) in a background process from the start")
    ap.add_argument("--lm-backend", default="triton", help="the fast-weight layers' backend in lmprofile")
    ap.add_argument("--peers", action="store_true", help="time torch SDPA and fla beside ours")
    ap.add_argument("--forms", nargs="+", default=["chunk", "chunk_triton"], help="bench speed forms at T ≤ 16384")
    ap.add_argument("--lengths", nargs="+", default=["4,4096", "1,16384", "1,65536"], help="B,T of the speed stage")
    ap.add_argument("--cache", default=None, help="a triton_cache.tgz from an earlier call, unpacked first")
    ARGS = ap.parse_args()
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    cache_dir = os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_cache")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if ARGS.cache and os.path.exists(ARGS.cache):
        with tarfile.open(ARGS.cache) as t:
            t.extractall(os.path.dirname(cache_dir.rstrip("/")) or "/")
        log(f"triton cache unpacked from {ARGS.cache}")
    warm = None
    if ARGS.warm_flashqla:
        code = ("import torch; from fastweights.bench.speed import _flashqla_case; "
                "run, ts = _flashqla_case('gated_deltanet', 4, 4096, 16, 128, torch.bfloat16, torch.device('cuda')); "
                "run().float().sum().backward(); torch.cuda.synchronize(); print('flashqla warm')")
        warm = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=open(os.path.join(OUT, "warm.log"), "w"),
                                stderr=subprocess.STDOUT)
        log("flashqla: compiling in the background")
    for name in ARGS.stages:
        if name == "speed" and warm is not None:
            try:
                warm.wait(timeout=max(1.0, ARGS.deadline - (time.time() - T_START) - 60))
            except subprocess.TimeoutExpired:
                log("flashqla: still compiling at the speed stage")
            log(f"flashqla warm-up exit {warm.poll()} at {time.time() - T_START:.0f} s")
        if time.time() - T_START > ARGS.deadline:
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
        if os.path.isdir(cache_dir):  # the small files only (autotune results, metadata): under the 16 MiB a file
            with tarfile.open(os.path.join(OUT, "triton_cache.tgz"), "w:gz") as tf:
                tf.add(cache_dir, arcname=os.path.basename(cache_dir.rstrip("/")),
                       filter=lambda ti: ti if (ti.isdir() or (ti.name.endswith(".json") and ti.size < 200_000))
                       else None)
    log(f"done in {time.time() - T_START:.0f} s")


if __name__ == "__main__":
    main()
