"""Micro-benchmark of the short causal depthwise convolution: the Triton kernels
(`kernels.triton.layer.conv.short_conv`) against the layer's torch ops (`layers.conv.ShortConv` with
backend="torch"; the kernels: backend="triton"), at the gated-DeltaNet LM's conv shapes.

    python3 scripts/bench_conv.py --out runs/bench/conv.json                    # CUDA (< 60 s on an H100)
    python3 scripts/bench_conv.py --bwd BT=32,NBLK=8 --out /tmp/conv.json       # other launch settings
    python3 scripts/bench_conv.py --bwd fused=1 --out /tmp/conv.json            # one-pass backward everywhere
    python3 scripts/bench_conv.py --sweep --out runs/bench/conv_sweep.json      # launch settings (~1 min)
    python3 scripts/bench_conv.py --device cpu --tiny --out /tmp/conv.json      # a check that it runs

Shapes: B = 4, T = 4,096, C ∈ {1,024, 2,048}, W = 4, SiLU, no bias, no tail, bf16. First, at each
shape, the kernels are checked against the torch twin in float64 (`ShortConv`'s torch ops): fp32
inputs (y, the new tail, dx, dw; and once with a tail, positions and a bias: dtail and db too) to
1e-5, bf16 inputs to 3e-2 (tests/tolerances.py's CONV_F32_REL and CONV_LOW_REL), and bf16 x read
as a channel slice of a wider [B, T, 3C] tensor (a fused projection); the same for the opt-in
one-pass backward. Then each path is timed (Triton: the two-kernel backward, with x sliced, with the
one-pass backward; the torch ops). The backward is an argument, `short_conv(..., one_pass_backward=)` (the
library's default is the one-pass one), passed through the layer's Triton conv row for the block that runs
a path: "one-pass" in a path's or check's name runs it, every other Triton path and check the two kernels
(`--bwd fused=1`: the one-pass backward there too; `fused=` is no launch setting, it picks the backward):
forward (no autograd), backward alone (autograd.grad of y with a fixed dy through a retained
graph: dx and dw) and forward + backward; median of --repeats calls after --warmup, each between
CUDA events recorded behind a ~1 ms GPU sleep (so the host's launch time is not counted). Printed
and written to --out (JSON): ms, and GB/s of the byte floor (forward: read x, write y, 2·N·e
bytes; backward: read x and dy, write dx, 3·N·e; both: 5·N·e; N = B·T·C, e = 2).
No autotuning: the launch settings are util.LAUNCH's conv sites ("conv_fwd", "conv_bwd_fused", "conv_bwd_dpre",
"conv_bwd_dx"), overridden by --fwd / --bwd in this script's own key names (FWD_KEYS, BWD_KEYS). --sweep
times the two-kernel backward at each of its settings and the one-pass one at the settings marked fused=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights


def parse_settings(text: str) -> dict:
    """'BT=32,NBLK=8,dpre_fp32=1' -> {'BT': 32, 'NBLK': 8, 'dpre_fp32': 1}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, val = item.split("=")
        out[key.strip()] = int(val)
    return out


def _one_pass(settings: dict) -> bool:
    """The backward a --bwd / SWEEP_BWD setting asks for, its "fused" key taken out (1: one pass, 0 or absent:
    the two kernels); the rest are launch settings (BWD_KEYS)."""
    return bool(settings.pop("fused", 0))


#: The conv's launch sites in util.LAUNCH, and the --fwd / --bwd (and SWEEP_*) keys → (site, setting).
CONV_SITES = ("conv_fwd", "conv_bwd_fused", "conv_bwd_dpre", "conv_bwd_dx")
FWD_KEYS = {k: ("conv_fwd", k) for k in ("BT", "BC", "num_warps")}
BWD_KEYS = {**{k: ("conv_bwd_dpre", k) for k in ("BT", "BC", "NBLK", "num_warps")},
            "dpre_fp32": ("conv_bwd_dpre", "DPRE_FP32"), "DX_BT": ("conv_bwd_dx", "BT"),
            "DX_BC": ("conv_bwd_dx", "BC"), "DX_warps": ("conv_bwd_dx", "num_warps"),
            "F_BT": ("conv_bwd_fused", "BT"), "F_BC": ("conv_bwd_fused", "BC"), "F_NBLK": ("conv_bwd_fused", "NBLK"),
            "F_warps": ("conv_bwd_fused", "num_warps"), "F_DWACC": ("conv_bwd_fused", "DW_ACC")}


def apply_settings(over: dict, keys: dict) -> None:
    """util.LAUNCH's conv entries set from settings in this script's key names (`keys`: FWD_KEYS or BWD_KEYS);
    an unknown key raises KeyError naming it."""
    from fastweights.kernels.triton.common.util import load_launch

    table: dict = {}
    for key, val in over.items():
        if key not in keys:
            raise KeyError(f"unknown launch setting {key!r} (known: {sorted(keys)})")
        site, name = keys[key]
        table.setdefault(site, {})[name] = val
    load_launch(table)


def conv_launch() -> dict:
    """The conv's launch sites as they are now ({site: settings})."""
    from fastweights.kernels.triton.common.util import LAUNCH

    return {site: dict(LAUNCH[site]) for site in CONV_SITES}


def restore_launch(saved: dict) -> None:
    from fastweights.kernels.triton.common.util import LAUNCH

    for site, cfg in saved.items():
        LAUNCH[site].clear()
        LAUNCH[site].update(cfg)


@contextmanager
def conv_backward(one_pass: bool):
    """Within the block the Triton conv row (what ShortConv with backend="triton" calls) runs
    `short_conv(..., one_pass_backward=one_pass)`; the row is put back after."""
    from fastweights.dispatch import DISPATCH, LAYER
    from fastweights.kernels.triton.layer.conv import short_conv

    key = (LAYER, "conv", "triton")
    impl = DISPATCH[key]
    DISPATCH[key] = dataclasses.replace(impl, fn=functools.partial(short_conv, one_pass_backward=one_pass))
    try:
        yield
    finally:
        DISPATCH[key] = impl


def behind_sleep_ms(fn, dev, warmup: int, repeats: int) -> float:
    """Median ms of fn over `repeats` calls (after `warmup`), each between CUDA events behind ~1 ms of GPU work (the
    launches queue behind it, so the events time the kernels, not the Python in front of them); a host clock off
    CUDA."""
    import torch  # (main imports it after choosing the interpreter)

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--channels", default="1024,2048")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--fwd", default="",
                    help="overrides of the forward's launch (FWD_KEYS), e.g. BT=64,BC=128,num_warps=8")
    ap.add_argument("--bwd", default="", help="overrides of the backward's launches (BWD_KEYS), e.g. "
                                              "BT=32,NBLK=8,DX_BC=128,dpre_fp32=1 (fused=1: the one-pass backward)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of the paths: time the Triton forward and backward at a fixed list of launch "
                         "settings (each checked against the module's defaults first)")
    ap.add_argument("--tiny", action="store_true", help="B = 2, T = 37, C = 24, 2 repeats (a check that it runs)")
    ap.add_argument("--out", required=True, help="the JSON is written here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.channels, a.warmup, a.repeats = 2, 37, "24", 1, 2
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

    import torch

    from fastweights.dispatch import DISPATCH, LAYER
    from fastweights.kernels.triton.layer import conv as conv_k
    from fastweights.layers.conv import ShortConv

    if a.device == "cpu":  # the Triton conv row asks for CUDA: under the interpreter, let it serve the CPU
        key = (LAYER, "conv", "triton")
        DISPATCH[key] = dataclasses.replace(DISPATCH[key], supports=lambda recipe, target: None)

    def on(conv, fused: bool):
        """The conv with its Triton row (fused) or its torch ops requested."""
        conv.backend = "triton" if fused else "torch"
        return conv

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is present (use --device cpu --tiny to check the script)",
              file=sys.stderr)
        return 2
    bwd = parse_settings(a.bwd)
    one_pass_all = _one_pass(bwd)  # --bwd fused=1: the paths without "one-pass" in their name run it too
    try:
        apply_settings(parse_settings(a.fwd), FWD_KEYS)
        apply_settings(bwd, BWD_KEYS)
    except KeyError as e:
        print(f"error: --fwd/--bwd: {e.args[0]}", file=sys.stderr)
        return 2
    B, T, W = a.batch, a.seq_len, a.width
    gen = torch.Generator(device=dev).manual_seed(0)  # on the device: the LM shapes are 8-100 M values
    t_start = time.perf_counter()

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    def rel(got, want) -> float:
        return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()

    def layer(C, bias=False):
        torch.manual_seed(1)
        return ShortConv(C, W, bias=bias).to(dev)

    def run(conv, x, fused, tail=None, positions=None, seed=2):
        """(y, new tail, {name: gradient}) of a random projection of y and the new tail."""
        leaves = {"x": x, "weight": conv.conv.weight}
        if conv.conv.bias is not None:
            leaves["bias"] = conv.conv.bias
        if tail is not None:
            leaves["tail"] = tail
        y, nt = on(conv, fused)(x, tail, positions)
        g = torch.Generator(device=dev).manual_seed(seed)
        loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64, device=dev)).sum()
                   for o in (y, nt))
        return y, nt, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    def check(C, dtype, tol, *, extras=False, sliced=False, one_pass=False) -> dict:
        """Errors of the kernels against the float64 twin on the same (rounded) values."""
        conv = layer(C, bias=extras)
        x64 = rnd(B, T, C, dtype=dtype).double()
        tail = rnd(B, W - 1, C, dtype=dtype).double() if extras else None
        # documents of 37 tokens, the first continuing the tail (its taps reach into it)
        pos = ((torch.arange(T, device=dev) + 3) % 37).expand(B, T).contiguous() if extras else None
        ref = layer(C, bias=extras).double()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), conv.parameters()):
                p.copy_(q.to(dtype))  # the kernel rounds the parameters to x's dtype
        want = run(ref, x64.requires_grad_(True), False, tail.requires_grad_(True) if extras else None, pos)
        if sliced:
            big = torch.cat([x64.to(dtype), rnd(B, T, 2 * C, dtype=dtype)], dim=-1).requires_grad_(True)
            xk = big[..., :C]
            # a strided slice whose channels stay contiguous: the kernels read it in place (no copy)
            assert not xk.is_contiguous() and xk.stride(2) == 1
        else:
            xk = x64.detach().to(dtype).requires_grad_(True)
        with conv_backward(one_pass or one_pass_all):
            got = run(conv, xk, True, tail.detach().to(dtype).requires_grad_(True) if extras else None, pos)
        errs = {"y": rel(got[0], want[0])}
        if W > 1:
            errs["new_tail"] = rel(got[1], want[1])
        for name, gr in want[2].items():
            errs["d" + name] = rel(got[2][name], gr)
        bad = {k: v for k, v in errs.items() if not v < tol}
        tag = f"C={C} {str(dtype).split('.')[-1]}" + (" tail+positions+bias" if extras else "") \
            + (" sliced" if sliced else "") + (" one-pass backward" if one_pass else "")
        print(f"check {tag}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + (" FAIL" if bad else " ok"))
        return {"case": tag, "tol": tol, "errors": errs, "ok": not bad}

    def timer(fn) -> float:
        return behind_sleep_ms(fn, dev, a.warmup, a.repeats)

    def bench(C, path) -> dict:
        dtype = torch.bfloat16
        conv = on(layer(C).to(dtype), path != "torch ops")
        with conv_backward(path.endswith("one-pass backward") or one_pass_all):
            return _bench(conv, path, dtype)

    def _bench(conv, path, dtype) -> dict:
        if path.endswith("sliced"):  # x: the first C channels of a [B, T, 3C] projection
            x = rnd(B, T, 3 * C, dtype=dtype)[..., :C].requires_grad_(True)
        else:
            x = rnd(B, T, C, dtype=dtype).requires_grad_(True)
        dy = rnd(B, T, C, dtype=dtype)
        w = conv.conv.weight

        def fwd():
            with torch.no_grad():
                conv(x)

        def fwd_bwd():
            y, _ = conv(x)
            torch.autograd.grad(y, [x, w], dy)

        y, _ = conv(x)

        def bwd():
            torch.autograd.grad(y, [x, w], dy, retain_graph=True)

        n = B * T * C * 2
        res = {"forward_ms": timer(fwd), "backward_ms": timer(bwd), "forward_backward_ms": timer(fwd_bwd)}
        for key, floor in (("forward", 2 * n), ("backward", 3 * n), ("forward_backward", 5 * n)):
            res[key + "_floor_bytes"] = floor
            res[key + "_GBps"] = floor / (res[key + "_ms"] * 1e-3) / 1e9
        return res

    channels = [int(c) for c in a.channels.split(",")]
    if a.sweep:
        return sweep(a, channels, rnd, rel, timer, conv_k, torch, t_start)
    checks, results = [], {}
    for C in channels:
        checks.append(check(C, torch.float32, 1e-5))
        checks.append(check(C, torch.bfloat16, 3e-2))
        checks.append(check(C, torch.bfloat16, 3e-2, sliced=True))
        checks.append(check(C, torch.float32, 1e-5, one_pass=True))
        checks.append(check(C, torch.bfloat16, 3e-2, sliced=True, one_pass=True))
    checks.append(check(channels[0], torch.float32, 1e-5, extras=True))
    checks.append(check(channels[0], torch.float32, 1e-5, extras=True, one_pass=True))
    ok = all(c["ok"] for c in checks)
    print(f"checks {'passed' if ok else 'FAILED'} ({time.perf_counter() - t_start:.1f} s)")
    bw = 3.35e12 if dev.type == "cuda" and "H100" in torch.cuda.get_device_name(dev) else None
    for C in channels:
        for path in ("triton", "triton, x sliced", "triton, one-pass backward", "torch ops"):
            r = bench(C, path)
            results[f"C={C} {path}"] = r
            floors = "" if bw is None else (f"  (floor at 3.35 TB/s: fwd {2 * B * T * C * 2 / bw * 1e6:.0f} µs, "
                                            f"bwd {3 * B * T * C * 2 / bw * 1e6:.0f} µs)")
            print(f"B={B} T={T} C={C} W={W} bf16 {path:26s}: fwd {r['forward_ms'] * 1e3:7.1f} µs "
                  f"({r['forward_GBps']:6.0f} GB/s)  bwd {r['backward_ms'] * 1e3:7.1f} µs "
                  f"({r['backward_GBps']:6.0f} GB/s)  fwd+bwd {r['forward_backward_ms'] * 1e3:7.1f} µs "
                  f"({r['forward_backward_GBps']:6.0f} GB/s)" + floors)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except OSError:
        commit = ""
    import triton
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
           "shape": {"B": B, "T": T, "channels": channels, "W": W, "dtype": "bfloat16", "silu": True},
           "launch": conv_launch(), "one_pass_backward_everywhere": int(one_pass_all),
           "warmup": a.warmup, "repeats": a.repeats, "checks_ok": ok, "checks": checks, "results": results,
           "seconds": time.perf_counter() - t_start}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({out['seconds']:.1f} s)")
    return 0 if ok else 1


#: the launch settings --sweep tries (each over the module's defaults)
SWEEP_FWD = [{}, dict(BT=32, BC=128), dict(BT=64, BC=128, num_warps=8), dict(BT=128, BC=64, num_warps=8),
             dict(BT=32, BC=64, num_warps=2)]
SWEEP_BWD = [{}, dict(NBLK=8), dict(NBLK=32), dict(BC=64), dict(BT=16, num_warps=8), dict(BT=16, NBLK=8),
             dict(BT=32, BC=64, NBLK=4, num_warps=8), dict(DX_BT=32), dict(DX_BT=32, DX_BC=64, DX_warps=8),
             dict(DX_BT=64, DX_BC=64), dict(dpre_fp32=1), dict(fused=1), dict(fused=1, F_BT=16),
             dict(fused=1, F_BT=64), dict(fused=1, F_BC=64, F_warps=8), dict(fused=1, F_BT=16, F_BC=64),
             dict(fused=1, F_DWACC=1), dict(fused=1, F_DWACC=1, F_BC=64), dict(fused=1, F_DWACC=1, F_NBLK=16),
             dict(fused=1, F_DWACC=1, F_BT=32, F_BC=64),
             dict(fused=1, F_NBLK=16)]


def sweep(a, channels, rnd, rel, timer, conv_k, torch, t_start) -> int:
    """Forward and backward (bf16, SiLU, no bias, no tail) at each setting of SWEEP_FWD / SWEEP_BWD:
    y, dx and dw within 1e-2 of the defaults' (the same maths; dw summed in another order), then the
    median µs; the best of each printed and written to --out."""
    B, T, W = a.batch, a.seq_len, a.width
    saved = conv_launch()
    rows, ok = [], True
    for C in channels:
        x = rnd(B, T, C, dtype=torch.bfloat16).requires_grad_(True)
        w = (rnd(C, 1, W) / W ** 0.5).requires_grad_(True)
        dy = rnd(B, T, C, dtype=torch.bfloat16)
        ref = None
        for which, grid in (("fwd", SWEEP_FWD), ("bwd", SWEEP_BWD)):
            for cfg in grid:
                restore_launch(saved)
                over = dict(cfg)
                one_pass = _one_pass(over)  # (the forward ignores it)
                apply_settings(over, FWD_KEYS if which == "fwd" else BWD_KEYS)
                y, _ = conv_k.short_conv(x, w, one_pass_backward=one_pass)
                dx, dw = torch.autograd.grad(y, [x, w], dy, retain_graph=True)
                if ref is None:
                    ref = (y, dx, dw)
                errs = [rel(got, want) for got, want in zip((y, dx, dw), ref)]
                good = max(errs) < 1e-2
                ok &= good
                if which == "fwd":
                    def fn(x=x, w=w):
                        with torch.no_grad():
                            conv_k.short_conv(x, w)
                else:
                    def fn(x=x, w=w, y=y, dy=dy):
                        torch.autograd.grad(y, [x, w], dy, retain_graph=True)
                us = timer(fn) * 1e3
                floor = (2 if which == "fwd" else 3) * B * T * C * 2
                rows.append({"C": C, "kernel": which, "settings": cfg, "us": us, "GBps": floor / us / 1e3,
                             "max_rel_err_vs_defaults": max(errs), "ok": good})
                print(f"C={C} {which} {str(cfg or 'defaults'):50s} {us:7.1f} µs {floor / us / 1e3:6.0f} GB/s"
                      + ("" if good else f"  MISMATCH {max(errs):.1e}"))
    restore_launch(saved)
    for C in channels:
        for which in ("fwd", "bwd"):
            best = min((r for r in rows if r["C"] == C and r["kernel"] == which and r["ok"]), key=lambda r: r["us"])
            print(f"best C={C} {which}: {best['settings'] or 'defaults'} {best['us']:.1f} µs")
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sweep": rows, "launch_defaults": saved, "ok": ok,
                                "seconds": time.perf_counter() - t_start}, indent=1) + "\n")
    print(f"wrote {path} ({time.perf_counter() - t_start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
