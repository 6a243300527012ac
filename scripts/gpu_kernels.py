"""One GPU call for the Triton kernels (`fastweights.kernels.triton`): the CUDA tests, each launch
config checked and timed, the speed table beside the peers, the decode step, a per-kernel profile.

    python3 scripts/gpu_kernels.py --stages env tests sweep speed decode profile --deadline 540
    python3 scripts/gpu_kernels.py --stages env sweep-kernels --models gated_deltanet --deadline 500

sweep-kernels (not in the default --stages) checks and times each kernel's launch configs alone and
writes best_launch.json (util.load_launch(path), `fastweights bench speed|train --launch path`) and
sweep_kernels.md; its plumbing runs on a CPU with --dry-run (the interpreter, tiny sizes, made-up times).

Every result lands in $OUT (or --out) as soon as it is measured, in at most eight files (what the
device tool brings back): results.json (every stage's numbers), log.txt, cuda_tests.xml,
speed.md, profile.txt (or best_launch.json and sweep_kernels.md), triton_cache.tgz (Triton's
compile cache, to carry into the next call: `--cache path/to/triton_cache.tgz` unpacks it first).
A stage that fails records its error and the next stage runs; stages that would start past
--deadline seconds are skipped and say so.

Correctness is the tests' job (`pytest -m "cuda or triton" tests/kernels tests/cuda`: the kernels
against their torch twins and the float64 recurrence, NaN-poisoned outputs, fresh random inputs).
The sweep stage adds what Triton 3.6 on Hopper asks for: every launch config checked against the
fp32 torch chunk form at several sizes before its time is taken.
"""

from __future__ import annotations

import argparse
import copy
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
DEVICE = "cuda"  # "cpu" with --dry-run (the interpreter)


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
    from fastweights.bench.speed import median_ms

    return median_ms(fn, torch.device("cuda"), warmup, reps)


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
                          device=DEVICE, seed=seed)
    x.pop("initial_state", None)
    return {k: (v.to(dtype) if k in ("q", "k", "v") else v) for k, v in x.items()}


def _run_with_grads(model, x, backend, dtype_compute=None):
    import fastweights as fw

    leaves = {k: v.detach().clone().to(dtype_compute or v.dtype).requires_grad_(True) for k, v in x.items()}
    # check_values off: a launch config that miscompiles shows as non-finite or wrong values in the sweep's own
    # check (and `_launches` skips kernels, leaving poisoned outputs, when only the launch sites are listed)
    o, S = fw.chunk(model, backend=backend, output_final_state=True, check_values=False, **leaves)
    S = S if isinstance(S, torch.Tensor) else S.weights[0]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    wo = torch.randn(o.shape, device=DEVICE, generator=gen)
    ws = torch.randn(S.shape, device=DEVICE, generator=gen)
    loss = (o.float() * wo).sum() + (S.float() * ws).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o.detach().float(), S.detach().float(), {k: g.float() for k, g in zip(leaves, grads)}


def _time_triton_chunk(model, x) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms) of `fw.chunk(model, backend="triton")` on the inputs x (`bench_ms`)."""
    import fastweights as fw

    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}

    def fwd():
        with torch.no_grad():
            fw.chunk(model, backend="triton", **leaves)

    def fwdbwd():
        o = fw.chunk(model, backend="triton", **leaves)[0]
        o.float().sum().backward()
        for t in leaves.values():
            t.grad = None

    return bench_ms(fwd), bench_ms(fwdbwd)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def stage_sweep():
    """Each launch config × model × size: relative errors against the fp32 torch chunk form on the
    same (bf16-rounded) inputs, then the median fwd and fwd+bwd times at the anchor size."""
    from fastweights.kernels.triton.common import util

    configs = [tuple(int(v) for v in c.split(",")) for c in ARGS.configs]
    sizes = [(2, 1000, 4, 64), (1, 333, 3, 128), (4, 4096, 16, 128)]
    out = RESULTS.setdefault("sweep", [])
    default = copy.deepcopy(util.LAUNCH)
    for nw, ns in configs:
        _set_launch({name: dict(cfg, num_warps=nw, num_stages=ns) for name, cfg in default.items()})
        for model in ARGS.models:
            for size in sizes:
                if time.time() - T_START > ARGS.deadline:
                    log("sweep: deadline reached")
                    _set_launch(default)
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
                        rec["fwd_ms"], rec["fwdbwd_ms"] = _time_triton_chunk(model, x)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                out.append(rec)
                save()
                worst = max(rec.get("errors", {"-": float("nan")}).values())
                log(f"sweep nw={nw} ns={ns} {model} {size}: worst rel {worst:.2e} finite={rec.get('finite')} "
                    f"fwd {rec.get('fwd_ms')} fwdbwd {rec.get('fwdbwd_ms')} {rec.get('error', '')[:300]}")
                torch.cuda.empty_cache()
    _set_launch(default)


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

    from fastweights import zoo
    from fastweights.bench.train import backends_ran
    from fastweights.models import LM, LMConfig

    lines = []
    for model in ARGS.models:
        # the `bench train` row's LMConfig: --lm-backend applies to fast-weight mixers, softmax ones keep "auto"
        backend = "auto" if zoo.resolve(model).is_softmax else ARGS.lm_backend
        cfg = LMConfig(vocab_size=32768, d_model=1024, n_layers=8, num_heads=8, head_dim=128, mixer=model,
                       backend=backend, layer_ops="auto")
        with torch.device("cuda"):
            lm = LM(cfg)
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=True)  # `bench train`'s optimizer on CUDA
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
        forms, ops = backends_ran(lm)  # what the layers ran (their routes), not what they requested
        lines.append(f"## {model} LM (2 optimizer steps, backends {sorted(set(forms))}, layer ops {ops})\n{table}\n")
        with open(os.path.join(OUT, "lmprofile.txt"), "w") as f:
            f.write("\n".join(lines))
        del lm, opt, step
        torch.cuda.empty_cache()
    log("\n".join(lines)[-5000:])


# ------------------------------------------------------------------------------- sweep-kernels
#: Launch sites in the order they are swept: the dearest first (H100, gated DeltaNet at the anchor, one
#: LM step: the transposed state pass 0.71 ms, WY backward 0.33, qk_grads 0.20 × 2, then the forward
#: state pass and the output), then the gated class's passes, then the cheap elementwise-ish stages.
SWEEP_ORDER = ("delta_states_bwd", "wy_bwd", "qk_grads", "delta_states_fwd", "output_fwd", "states_bwd",
               "states_fwd", "output_bwd", "delta_output_bwd", "wy_fwd", "scores", "inverse", "delta_grads",
               "cumsum", "prologue", "delta_fused_fwd", "delta_prepass", "delta_fused_rev", "delta_fused_grads",
               "delta_fused_grads_rows",
               "delta_fused_rec", "delta_fused_fwd_t", "delta_split_states", "delta_split_out",
               "gated_fused_fwd", "gated_fused_bwd_states",
               "gated_fused_bwd_chunk", "gated_fused_scores", "ttt_linear_fwd", "ttt_linear_readout",
               "ttt_linear_bwd_read", "ttt_linear_bwd", "ttt_linear_bwd_post", "ttt_linear_sliced",
               "ttt_linear_sliced_bwd", "ttt_mlp_fwd",
               "ttt_mlp_bwd", "ttt_mlp_sliced",
               "ttt_mlp_sliced_read", "ttt_mlp_sliced_bwd_pre", "titans_single_fwd",
               "titans_single_bwd", "titans_fwd", "titans_readout", "titans_bwd_read", "titans_bwd", "titans_sliced",
               "titans_sliced_bwd", "titans_sliced_gates", "conv_fwd",
               "conv_bwd_fused", "conv_bwd_dpre", "conv_bwd_dx", "conv_bwd_rows", "rope")
#: The dear kernels get every num_warps ∈ {2, 4, 8} × num_stages ∈ {1, 2, 3} at their default tiles, and
#: each other tile value (TILE_OPTIONS) with TILE_WARPS × {1, 2, 3} stages.
HEAVY = ("delta_states_bwd", "wy_bwd", "qk_grads", "delta_states_fwd", "output_fwd", "states_bwd", "states_fwd",
         "output_bwd")
FULL = tuple((nw, ns) for nw in (2, 4, 8) for ns in (1, 2, 3))
#: The cheap ones: the default and four neighbours (one warp count or stage count changed).
CHEAP = ((2, 2), (8, 2), (4, 1), (4, 3))
TILE_OPTIONS = {"delta_fused_grads": ({"BV": 32}, {"BV": 128}), "delta_fused_fwd": ({"PROGRAMS": 264},),
                "delta_fused_rev": ({"PROGRAMS": 264},), "delta_fused_rec": ({"PROGRAMS": 264},),
                "delta_states_bwd": ({"BV": 32}, {"BV": 16}), "delta_states_fwd": ({"BV": 32}, {"BV": 16}),
                "states_bwd": ({"BV": 32},), "states_fwd": ({"BV": 32},), "output_fwd": ({"BV": 32},),
                "qk_grads": ({"BC": 16}, {"BC": 64}, {"BC_DIAG": 32}),
                "ttt_linear_readout": ({"BK": 16}, {"BK": 64}, {"BK": 128}),
                "ttt_linear_bwd_read": ({"BK": 16}, {"BK": 64}, {"BK": 128}),
                "titans_readout": ({"TILE": 1024}, {"TILE": 4096}), "titans_bwd_read": ({"TILE": 1024}, {"TILE": 4096}),
                "titans_fwd": ({"TILE": 1024}, {"TILE": 4096}), "titans_bwd": ({"TILE": 1024}, {"TILE": 4096})}
TILE_WARPS = {16: (2, 4)}  # BV = 16: a [K, 16] state tile wants few warps; other tiles 4 and 8 warps


def _set_launch(table: dict):
    """util.LAUNCH := a copy of `table` (in place: the kernels' modules read util.LAUNCH at each call)."""
    from fastweights.kernels.triton.common import util

    util.LAUNCH.clear()
    util.LAUNCH.update(copy.deepcopy(table))


def _candidates(name: str, default: dict, used_tiles: set) -> list[dict]:
    """Launch configs of `name` to try, its default first; tile options only for tile keys some model
    read (used_tiles: "name.KEY")."""
    out = [dict(default)]

    def add(cfg):
        if cfg not in out:
            out.append(cfg)

    for nw, ns in (FULL if name in HEAVY else CHEAP):
        add(dict(default, num_warps=nw, num_stages=ns))
    for opt in TILE_OPTIONS.get(name, ()):
        if not all(f"{name}.{key}" in used_tiles for key in opt):
            continue
        for nw in TILE_WARPS.get(next(iter(opt.values())), (4, 8)):
            for ns in (1, 2, 3):
                add(dict(default, **opt, num_warps=nw, num_stages=ns))
    return out[:ARGS.sweep_limit] if ARGS.sweep_limit else out


def _cfg_str(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _sweep_sizes():
    if ARGS.dry_run:  # the interpreter on the CPU: tiny shapes with the same structure (odd T, two head dims)
        return [(1, 33, 3, 32), (2, 40, 2, 16)], (2, 64, 2, 32)
    anchor = tuple(int(n) for n in ARGS.sweep_shape.split(",")) if ARGS.sweep_shape else (4, 4096, 16, 128)
    return [(1, 333, 3, 128), (2, 1000, 4, 64)], anchor


def _fn_name(name: str) -> str:
    from fastweights.kernels.triton.common import util

    return util.KERNEL_FN[name].rsplit(".", 1)[1]


def _kernel_us(model, x, fn: str, reps: int = 5):
    """(µs of kernel `fn` per fwd+bwd, µs of every CUDA kernel per fwd+bwd, the profiler names matched):
    torch.profiler (CUDA activity) over `reps` steps after two warm-up steps; made up under --dry-run."""
    import fastweights as fw

    if ARGS.dry_run:  # a made-up time from the table (fewer warps and stages: less), to exercise the selection
        from fastweights.kernels.triton.common import util

        fake = sum(7 * c["num_warps"] + 3 * c["num_stages"] + c.get("BV", 0) / 16 for c in util.LAUNCH.values())
        return float(fake), float(fake), ["(dry run)"]
    from torch.profiler import ProfilerActivity, profile

    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}

    def step():
        o = fw.chunk(model, backend="triton", **leaves)[0]
        o.float().sum().backward()
        for t in leaves.values():
            t.grad = None

    step()
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.key_averages():  # self time: a kernel's own duration, no parent op counted twice
        t = getattr(e, "self_device_time_total", None)
        per[e.key] = per.get(e.key, 0.0) + float(t if t is not None else e.self_cuda_time_total)
    hit = [key for key in per if key == fn] or [key for key in per if fn in key]
    return (sum(per[key] for key in hit) / reps if hit else None), sum(per.values()) / reps, hit


def _check_config(model, sizes, tol):
    """Errors of the whole fwd+bwd (o, final state, every gradient) against the fp32 torch chunk form on
    the same bf16-rounded inputs, a fresh seed per size: {size: {"seed", "errors", "finite", "first_call_s"}}."""
    out = {}
    for size in sizes:
        seed = int.from_bytes(os.urandom(4), "little")
        x = _gated_inputs(model, *size, torch.bfloat16, seed)
        want = _run_with_grads(model, x, "torch", torch.float32)
        t0 = time.time()
        got = _run_with_grads(model, x, "triton")
        rec = {"seed": seed, "first_call_s": time.time() - t0}
        errs = {"o": _rel(got[0], want[0]), "S": _rel(got[1], want[1])}
        errs.update({f"d{k}": _rel(got[2][k], want[2][k]) for k in want[2]})
        rec["errors"] = errs
        rec["finite"] = all(bool(torch.isfinite(t).all()) for t in (got[0], got[1], *got[2].values()))
        rec["worst"] = max(errs.values())
        rec["ok"] = rec["finite"] and rec["worst"] < tol
        out[str(size)] = rec
        del x, want, got
    return out


def _model_info(model, size):
    """(launch sites the model's triton fwd+bwd runs, tile keys it reads "name.KEY", tolerance)."""
    from fastweights.kernels.triton.common import util
    from tests.tolerances import TRITON_DELTA_LOW_REL, TRITON_LOW_REL

    util.SEEN = set()
    try:
        with _launches(lambda name: None):  # nothing compiled, nothing launched: the names only
            _run_with_grads(model, _gated_inputs(model, *size, torch.bfloat16, 0), "triton")
        seen = set(util.SEEN)
    finally:
        util.SEEN = None
    names = {s for s in seen if "." not in s}
    tol = (TRITON_DELTA_LOW_REL if "delta_states_fwd" in names else TRITON_LOW_REL)[torch.bfloat16]
    return names, {s for s in seen if "." in s}, tol


class _launches:
    """Within: each chunk-pipeline kernel's launch (`kernel[grid](...)`, its `run`) asks mode(launch site):
    None — skipped (nothing compiled or launched; the outputs stay unwritten), "warmup" — compiled
    (or loaded from TRITON_CACHE_DIR), not launched."""

    def __init__(self, mode):
        self.mode, self.saved = mode, []

    def __enter__(self):
        import importlib

        from fastweights.kernels.triton.common import util

        for name, fpath in util.KERNEL_FN.items():
            mod, fn = fpath.rsplit(".", 1)
            kernel = getattr(importlib.import_module(f"fastweights.kernels.triton.{mod}"), fn)
            self.saved.append((kernel, kernel.__dict__.get("run")))

            def run(*a, grid, warmup, _run=kernel.run, _name=name, **kw):
                if self.mode(_name) == "warmup" and not ARGS.dry_run:
                    return _run(*a, grid=grid, warmup=True, **kw)
                return None

            kernel.run = run
        return self

    def __exit__(self, *exc):
        for kernel, run in self.saved:
            if run is None:
                del kernel.run
            else:
                kernel.run = run


def _warm_worker():
    """A compile helper (--warm-worker I N JOBS): for jobs I, I + N, … of the JSON list JOBS
    ([model, launch site, config]), set that config and run the model's triton fwd+bwd at the sweep's
    sizes with that site's launches turned into warm-ups (compiled, not launched) and every other
    launch skipped, so the sweep process finds the binaries in TRITON_CACHE_DIR. One line per job:
    "warm ok J …" or "warm FAIL J …"."""
    from fastweights.kernels.triton.common import util

    idx, count, path = int(ARGS.warm_worker[0]), int(ARGS.warm_worker[1]), ARGS.warm_worker[2]
    with open(path) as f:
        jobs = json.load(f)
    default = copy.deepcopy(util.LAUNCH)
    small, anchor = _sweep_sizes()
    for j in range(idx, len(jobs), count):
        model, name, cfg = jobs[j]
        _set_launch(dict(default, **{name: cfg}))
        t = time.time()
        try:
            for size in (anchor, *small):
                with _launches(lambda site, name=name: "warmup" if site == name else None):
                    _run_with_grads(model, _gated_inputs(model, *size, torch.bfloat16, 0), "triton")
            print(f"warm ok {j} {model} {name} {_cfg_str(cfg)}: {time.time() - t:.1f} s", flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()  # a dozen workers share the GPU's memory with the sweep
        except Exception as e:
            print(f"warm FAIL {j} {model} {name} {_cfg_str(cfg)}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def _start_warmers(jobs: list) -> list:
    """--compile-workers processes compiling `jobs` ahead of the sweep (their logs: /tmp/sweep_warm_*.log)."""
    n = ARGS.compile_workers
    if n <= 0 or not jobs:
        return []
    path = "/tmp/sweep_warm_jobs.json"
    with open(path, "w") as f:
        json.dump(jobs, f)
    procs = []
    for i in range(n):
        cmd = [sys.executable, os.path.abspath(__file__), "--warm-worker", str(i), str(n), path, "--out", "/tmp"]
        if ARGS.dry_run:
            cmd.append("--dry-run")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=open(f"/tmp/sweep_warm_{i}.log", "w"),
                                      stderr=subprocess.STDOUT))
    log(f"sweep-kernels: {n} compile workers on {len(jobs)} jobs")
    return procs


def _wait_warm(procs: list, j: int, timeout: float = 90.0):
    """Wait (at most `timeout` s) until the worker of job j has compiled it, failed, or exited."""
    if not procs:
        return
    w = j % len(procs)
    t = time.time()
    while time.time() - t < timeout and time.time() - T_START < ARGS.deadline:
        if procs[w].poll() is not None:
            return
        with open(f"/tmp/sweep_warm_{w}.log") as f:
            text = f.read()
        if f"warm ok {j} " in text or f"warm FAIL {j} " in text:
            return
        time.sleep(0.2)


def _stop_warmers(procs: list):
    tails = []
    for i, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
        try:
            with open(f"/tmp/sweep_warm_{i}.log") as f:
                lines = f.read().splitlines()
            tails.append({"worker": i, "exit": p.returncode, "jobs_done": sum(ln.startswith("warm ok") for ln in lines),
                          "failed": [ln for ln in lines if ln.startswith("warm FAIL")][-5:], "tail": lines[-3:]})
        except OSError:
            pass
    RESULTS.setdefault("sweep_kernels_warm", tails)


def _best(name: str, rows: list, models: list, default: dict):
    """(best config, its µs summed over the models, the default's µs) of launch site `name`: among the
    configs accepted (every check within tolerance and finite, timed) for every model, the least
    kernel time summed over the models (the re-timed ones, `_retime`, where there are any); the
    default unless the best is ≥ 2 % faster (the timer's noise)."""
    by: dict = {}
    for r in rows:
        if r["kernel"] == name:
            by.setdefault(json.dumps(r["config"], sort_keys=True), {})[r["model"]] = r
    field = "retime_us" if any(r.get("retime_us") is not None for per in by.values() for r in per.values()) \
        else "kernel_us"  # the re-timed configs (the workers gone) where there are any
    scored = []
    for key, per in by.items():
        if set(per) != set(models) or not all(r.get("accepted") for r in per.values()):
            continue
        if any(r.get(field) is None for r in per.values()):
            continue
        scored.append((sum(r[field] for r in per.values()), json.loads(key)))
    dkey = json.dumps(default, sort_keys=True)
    d_us = next((us for us, cfg in scored if json.dumps(cfg, sort_keys=True) == dkey), None)
    if not scored:
        return None, None, d_us
    us, cfg = min(scored, key=lambda t: t[0])
    if d_us is not None and us > 0.98 * d_us:
        return default, d_us, d_us
    return cfg, us, d_us


def stage_sweep_kernels():
    """Each kernel alone: for every launch site the models run (SWEEP_ORDER, dearest first) and each
    candidate config (`_candidates`), the other sites at their defaults, per model: (a) the whole
    fwd+bwd against the fp32 torch chunk form on the same bf16-rounded inputs at (1, 333, 3, 128),
    (2, 1000, 4, 64) and the anchor (4, 4096, 16, 128), a fresh seed each, relative errors of o, the
    final state and every gradient; beyond TRITON_DELTA_LOW_REL (delta class) / TRITON_LOW_REL (gated
    class) of tests/tolerances.py, or not finite, or an error raised: rejected; (b) the kernel's CUDA
    time per fwd+bwd at the anchor (torch.profiler, 5 steps, the kernels named as its Triton function).
    Every row lands in results.json["sweep_kernels"] as it is measured; then the default and the three
    fastest accepted configs of each kernel are timed again with the compile workers gone (`_retime`);
    at the end a table per kernel (sweep_kernels.md) and best_launch.json (launch site → config, for
    util.load_launch / `fastweights bench speed|train --launch`), then, time permitting, the best table all at
    once: checked the same way and timed against the defaults.

    Compiles: each (kernel, config, model) compiles that kernel once per size (H, K, V are constexprs)
    and per variant the pipeline launches (qk_grads, wy_fwd and cumsum twice) — a few seconds each.
    gated DeltaNet: 117 candidates (delta_states_bwd 21, qk_grads 21, delta_states_fwd 21, output_fwd 15,
    wy_bwd 9, six cheap stages × 5), ≈ 440 kernel compiles (the defaults' 42 included): ~20 min in one process, so
    --compile-workers processes (default 12 of the 16 cores) compile the same jobs in the same order
    ahead of the sweep (launches turned into warm-ups: nothing runs on the GPU but the inputs), and the
    sweep loads their binaries from TRITON_CACHE_DIR; each row's first_call_s shows whether it did.
    The checks and the timing take ≈ 1 s per candidate and model. What --deadline cuts off is the tail:
    the cheap kernels."""
    from fastweights.kernels.triton.common import util

    models = ARGS.models
    small, anchor = _sweep_sizes()
    sizes = [*small, anchor]
    default = copy.deepcopy(util.LAUNCH)
    users, used_tiles, tols = {}, set(), {}  # users: launch site → the models that run it
    for model in models:
        names, u, tols[model] = _model_info(model, small[1])
        for n in names:
            users.setdefault(n, []).append(model)
        used_tiles |= u
    order = [n for n in SWEEP_ORDER if n in users and (not ARGS.sweep_only or n in ARGS.sweep_only)]
    plan = {n: _candidates(n, default[n], used_tiles) for n in order}
    RESULTS["sweep_kernels_plan"] = {"models": models, "sizes": sizes, "tolerance": tols, "users": users,
                                     "candidates": {n: len(c) for n, c in plan.items()},
                                     "runs": sum(len(c) * len(users[n]) for n, c in plan.items())}
    log(f"sweep-kernels plan: {RESULTS['sweep_kernels_plan']}")
    save()
    # the compile jobs: every site's default (all run in each check), then the candidates in sweep order
    every = [n for n in SWEEP_ORDER if n in users]
    jobs = [[model, n, default[n]] for n in every for model in users[n]]
    jobs += [[model, n, cfg] for n in order for cfg in plan[n][1:] for model in users[n]]
    job_of = {(n, json.dumps(cfg, sort_keys=True), model): j for j, (model, n, cfg) in enumerate(jobs)}
    procs = _start_warmers(jobs)
    n_default = sum(len(users[n]) for n in every)
    for j in range(n_default):  # the defaults first: every check runs them
        _wait_warm(procs, j)
    rows = RESULTS.setdefault("sweep_kernels", [])
    stop = False
    try:
        for n in order:
            fn = _fn_name(n)
            for cfg in plan[n]:
                for model in users[n]:
                    if time.time() - T_START > ARGS.deadline:
                        log("sweep-kernels: deadline reached")
                        stop = True
                        break
                    _wait_warm(procs, job_of[(n, json.dumps(cfg, sort_keys=True), model)])
                    _set_launch(dict(default, **{n: cfg}))
                    rec = {"kernel": n, "config": cfg, "model": model, "default": cfg == default[n],
                           "workers_running": sum(p.poll() is None for p in procs)}
                    t = time.time()
                    try:
                        rec["checks"] = _check_config(model, sizes, tols[model])
                        rec["worst"] = max(c["worst"] for c in rec["checks"].values())
                        rec["accepted"] = all(c["ok"] for c in rec["checks"].values())
                        if rec["accepted"]:
                            x = _gated_inputs(model, *anchor, torch.bfloat16, 1)
                            rec["kernel_us"], rec["total_us"], rec["matched"] = _kernel_us(model, x, fn)
                            del x
                    except Exception as e:  # e.g. Triton's OutOfResources (shared memory) at the launch
                        rec["accepted"] = False
                        rec["error"] = f"{type(e).__name__}: {e}"[:1500]
                        if "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError":
                            stop = True  # a device fault (illegal address, …) leaves the context unusable
                            RESULTS["sweep_kernels_fatal"] = rec["error"]
                    rec["seconds"] = time.time() - t
                    rows.append(rec)
                    save()
                    us = rec.get("kernel_us")
                    log(f"{n:17s} {_cfg_str(cfg):42s} {model:15s} "
                        f"{'-' if us is None else f'{us:8.1f} µs'}  worst {rec.get('worst', float('nan')):.2e} "
                        f"{'ok' if rec['accepted'] else 'REJECTED'}  {rec['seconds']:.1f} s "
                        f"{rec.get('error', '')[:200]}")
                    if stop:
                        log(f"sweep-kernels: device fault at {n} {_cfg_str(cfg)} {model}: stopped (rerun without it)")
                        break
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
                if stop:
                    break
            if stop:
                break
    finally:
        _set_launch(default)
        _stop_warmers(procs)
    if not stop:
        _retime(order, users, default)
    _sweep_report(order, users, default)  # from what was measured (no CUDA call)
    if not stop and time.time() - T_START < ARGS.deadline:
        _check_best(models, sizes, default, tols)


def _retime(order, users, default, top: int = 3):
    """The default and the `top` fastest accepted configs of each kernel timed again (rows' "retime_us"),
    now that the compile workers are gone (their inputs and small torch ops share the GPU while they
    run); `_best` then compares these."""
    rows = RESULTS.get("sweep_kernels", [])
    anchor = _sweep_sizes()[1]
    for n in order:
        if time.time() - T_START > ARGS.deadline:
            log("sweep-kernels: deadline reached in the re-timing")
            return
        by: dict = {}
        for r in rows:
            if r["kernel"] == n:
                by.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
        ok = {key: rs for key, rs in by.items() if len(rs) == len(users[n]) and all(r.get("accepted") for r in rs)
              and all(r.get("kernel_us") is not None for r in rs)}
        ranked = sorted(ok, key=lambda key: sum(r["kernel_us"] for r in ok[key]))[:top]
        dkey = json.dumps(default[n], sort_keys=True)
        if dkey in ok and dkey not in ranked:
            ranked.append(dkey)
        if len(ranked) < 2:
            continue
        for key in ranked:
            for r in ok[key]:
                _set_launch(dict(default, **{n: r["config"]}))
                try:
                    x = _gated_inputs(r["model"], *anchor, torch.bfloat16, 1)
                    r["retime_us"] = _kernel_us(r["model"], x, _fn_name(n))[0]
                    del x
                except Exception as e:
                    r["retime_error"] = f"{type(e).__name__}: {e}"[:500]
        _set_launch(default)
        save()
        log(f"sweep-kernels re-timed {n}: " + ", ".join(
            f"{_cfg_str(json.loads(key))} {sum(r.get('retime_us') or 0 for r in ok[key]):.1f} µs" for key in ranked))


def _sweep_report(order, users, default):
    """The table per kernel (config, µs summed over the models, worst error, accepted), the best, and
    best_launch.json: every swept kernel → its best accepted config (its default where none beat it)."""
    rows = RESULTS.get("sweep_kernels", [])
    lines, best = [], {}
    summary = {}
    for n in order:
        mine = [r for r in rows if r["kernel"] == n]
        if not mine:
            continue
        models = users[n]
        lines.append(f"## {n} ({_fn_name(n)})   µs per fwd+bwd, summed over {', '.join(models)}")
        seen = []
        for r in mine:
            if r["config"] not in seen:
                seen.append(r["config"])
        for cfg in seen:
            rs = [r for r in mine if r["config"] == cfg]
            us = [r.get("kernel_us") for r in rs]
            tot = sum(us) if all(u is not None for u in us) and len(rs) == len(models) else None
            re = [r.get("retime_us") for r in rs]
            retime = f" (again: {sum(re):.1f})" if all(u is not None for u in re) else ""
            worst = max((r.get("worst", float("nan")) for r in rs), default=float("nan"))
            acc = all(r.get("accepted") for r in rs) and len(rs) == len(models)
            lines.append(f"  {_cfg_str(cfg):44s} {'-' if tot is None else f'{tot:9.1f}'}{retime}  worst {worst:.2e}  "
                         f"{'ok' if acc else 'REJECTED' if len(rs) == len(models) else 'incomplete'}"
                         f"{'  (default)' if cfg == default[n] else ''}")
        cfg, us, d_us = _best(n, rows, models, default[n])
        summary[n] = {"best": cfg, "best_us": us, "default_us": d_us}
        lines.append(f"  best: {'-' if cfg is None else _cfg_str(cfg)}  {us if us is None else round(us, 1)} µs "
                     f"(default {d_us if d_us is None else round(d_us, 1)} µs)\n")
        if cfg is not None:
            best[n] = cfg
    RESULTS["sweep_kernels_best"] = summary
    with open(os.path.join(OUT, "best_launch.json"), "w") as f:
        json.dump(best, f, indent=1)
    text = "\n".join(lines)
    with open(os.path.join(OUT, "sweep_kernels.md"), "w") as f:
        f.write(text + "\n")
    log(text)
    log(f"best_launch.json: {best}")
    log(f"changed from the defaults: { {n: c for n, c in best.items() if c != default[n]} }")
    save()


def _check_best(models, sizes, default, tols):
    """best_launch.json all at once: the same checks, and fwd / fwd+bwd ms (bench_ms) against the defaults."""
    from fastweights.kernels.triton.common import util

    with open(os.path.join(OUT, "best_launch.json")) as f:
        best = json.load(f)
    best = {n: c for n, c in best.items() if c != default[n]}
    if not best:
        return

    out = RESULTS.setdefault("sweep_kernels_combined", [])
    for model in models:
        rec = {"model": model, "best": best}
        try:
            for label, table in (("default", default), ("best", None)):
                _set_launch(default)
                if table is None:
                    util.load_launch(best)
                    rec["checks"] = _check_config(model, sizes, tols[model])
                    rec["accepted"] = all(c["ok"] for c in rec["checks"].values())
                if DEVICE != "cuda":
                    continue
                x = _gated_inputs(model, *sizes[-1], torch.bfloat16, 1)
                rec[f"{label}_fwd_ms"], rec[f"{label}_fwdbwd_ms"] = _time_triton_chunk(model, x)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
        finally:
            _set_launch(default)
        out.append(rec)
        save()
        log(f"sweep-kernels combined {model}: accepted {rec.get('accepted')} worst "
            f"{max((c['worst'] for c in rec.get('checks', {}).values()), default=float('nan')):.2e}; fwd "
            f"{rec.get('default_fwd_ms')} → {rec.get('best_fwd_ms')} ms, fwd+bwd {rec.get('default_fwdbwd_ms')} → "
            f"{rec.get('best_fwdbwd_ms')} ms {rec.get('error', '')[:300]}")


STAGES = {"env": stage_env, "tests": stage_tests, "sweep": stage_sweep, "speed": stage_speed,
          "decode": stage_decode, "profile": stage_profile, "lmprofile": stage_lmprofile,
          "sweep-kernels": stage_sweep_kernels}


def _dry_run_setup():
    """--dry-run: CPU tensors under Triton's interpreter; the triton rows' CUDA predicate told it is CUDA."""
    global DEVICE

    os.environ["TRITON_INTERPRET"] = "1"
    DEVICE = "cpu"
    from fastweights import api
    from fastweights.dispatch import Target

    class _AsCuda(Target):
        @staticmethod
        def of(*a, **kw):
            return Target.of(*a, **kw)._replace(device_type="cuda")

    api.Target = _AsCuda


def main():
    global OUT, ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", nargs="+", default=[s for s in STAGES if s != "sweep-kernels"], choices=list(STAGES))
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
    ap.add_argument("--compile-workers", type=int, default=12,
                    help="sweep-kernels: processes compiling its configs ahead of it (0: none)")
    ap.add_argument("--sweep-only", nargs="+", default=None, help="sweep-kernels: only these launch sites")
    ap.add_argument("--sweep-limit", type=int, default=0, help="sweep-kernels: at most this many configs per kernel")
    ap.add_argument("--sweep-shape", default=None, metavar="B,T,H,D",
                    help="sweep-kernels: the shape timed (default 4,4096,16,128; the preset's: 8,2048,6,128)")
    ap.add_argument("--dry-run", action="store_true",
                    help="sweep-kernels on the CPU under the interpreter at tiny sizes (plumbing only, made-up times)")
    ap.add_argument("--warm-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help="a triton_cache.tgz from an earlier call, unpacked first")
    ARGS = ap.parse_args()
    OUT = ARGS.out
    os.makedirs(OUT, exist_ok=True)
    if ARGS.dry_run:
        _dry_run_setup()
    if ARGS.warm_worker:
        os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_cache")
        _warm_worker()
        return
    cache_dir = os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_cache")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if ARGS.cache and os.path.exists(ARGS.cache):
        with tarfile.open(ARGS.cache) as t:
            t.extractall(os.path.dirname(cache_dir.rstrip("/")) or "/")
        log(f"triton cache unpacked from {ARGS.cache}")
    warm = None
    if ARGS.warm_flashqla:
        code = ("import torch; from fastweights.bench.speed import flashqla_case; "
                "run, ts = flashqla_case('gated_deltanet', 4, 4096, 16, 128, torch.bfloat16, torch.device('cuda')); "
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
