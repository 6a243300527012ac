"""What one `fw.chunk` forward of a mini-batch memory (OmegaNet, ATLAS, TTT, Titans) keeps for its backward, per
token and head — and, on a GPU, the peak of a whole forward + backward at a given shape.

Saved bytes: `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd saves (distinct storages, a
view of a saved one counts once) during one forward at B = 1, H = 1 and two lengths T₁ < T₂ (fp32, any device);
the slope (bytes(T₂) − bytes(T₁)) / (T₂ − T₁) is the per-token cost (what does not grow with T cancels), with the
source lines it came from (--by-line). The prediction at [B, T, H] is slope · B · T · H (the saved tensors only;
the peak adds the forward's and backward's transients). --peak (CUDA) runs one forward + backward of
`fw.chunk` at --shape in --dtype and reports torch.cuda.max_memory_allocated.

    python scripts/minibatch_memory.py --models omeganet atlas --D 64 --by-line
    python scripts/minibatch_memory.py --models omeganet atlas --D 64 --peak --device cuda --shape 64 512 2 --out DIR

--split N sets `fastweights.chunkwise.minibatch.split_readout(N)` (0: every gd / momentum readout segment by
segment); without it, the library's default.

--time (CUDA) times the fwd+bwd step of `fw.chunk` at --shape in --dtype instead (issue 36's small shape by default):
the first call alone (compiles included), then --repeats calls between CUDA events (median, min), the peak, and per
--ns-precisions entry (ATLAS: `kernels.rows.pinned("generic", precision=P)` — the Newton–Schulz kernel's tl.dot and the
torch iteration's products; OmegaNet has no Newton–Schulz and runs once) the relative error of o and of every input
gradient against the first precision's run; --matmul-tf32 runs each model once more with torch's fp32 matmuls on
TF32 process-wide (OmegaNet's form on TF32: emulated on the CPU its o and gradients moved 3–4e-4 from float64,
0.16× what rounding its inputs to bf16 does; ATLAS's: its Newton–Schulz one TF32 pass, 2.5–4e-2 on o);
--profile also writes the top kernels of one timed call; --bmm-tiles sets the tf32x3 product kernel's tiles;
--ns-kernel-sides 32 64 first runs the Newton–Schulz kernel alone at those Gram sides (its first call's compile
seconds, or its launch error). Each result is appended to time.json under --out as soon as it exists (a later row
that hangs or fails keeps the earlier ones).

--kernel-trick on routes OmegaNet to the kernel trick's form (`chunkwise.omega.kernel_trick`; off, the default as the
library's: the mini-batch form on expanded features); --feature-kernels runs its K'-wide products by the Triton
kernels that build φ in registers (`kernels.triton.memories.omega_features`). --cpu-time times the fp32 fwd+bwd step
on the CPU at --shape (--threads):

    python scripts/minibatch_memory.py --cpu-time --models omeganet --shape 4 256 2 --D 32 --kernel-trick both

    python scripts/minibatch_memory.py --time --models atlas omeganet --shape 64 512 2 --D 64 \
        --ns-precisions ieee tf32x3 tf32 --matmul-tf32 --ns-kernel-sides 32 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import defaultdict
from pathlib import Path

import torch

import fastweights as fw
from fastweights.chunkwise import minibatch, omega
from fastweights.state import state_tensors


def _inputs(model, B, T, H, D, dtype, device, grad=True, seed=None):
    inp = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=dtype, device=device,
                            requires_grad=grad, seed=seed)
    return inp, inp.pop("initial_state", None)


def saved_bytes(model, T, D, device="cpu", by_line=False):
    """(bytes autograd saves in one fp32 forward at B 1, H 1, T tokens, {(source line, shape): bytes})."""
    torch.manual_seed(0)
    inp, st = _inputs(model, 1, T, 1, D, torch.float32, device)
    seen, where = {}, defaultdict(int)

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            if by_line:
                fr = [f for f in traceback.extract_stack() if "fastweights" in f.filename]
                at = f"{Path(fr[-1].filename).name}:{fr[-1].lineno} {fr[-1].name}" if fr else "?"
                where[(at, tuple(t.shape))] += seen[key]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
    return sum(seen.values()), where


def cpu_peak(model, T, D, B=1, H=1):
    """Peak bytes of tensor storages alive during one fp32 fw.chunk forward + backward on the CPU (the inputs and
    initial state not counted): `fastweights.bench.memory.cpu_peak_bytes`."""
    from fastweights.bench.memory import cpu_peak_bytes

    torch.manual_seed(0)
    inp, st = _inputs(model, B, T, H, D, torch.float32, "cpu")

    def fwd_bwd():
        o, fin = fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
        loss = o.sum() + sum(t.sum() for t in state_tensors(fin))
        leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(loss, leaves, allow_unused=True)

    return cpu_peak_bytes(fwd_bwd)


def cuda_peak(model, B, T, H, D, dtype):
    """torch.cuda.max_memory_allocated (bytes) of one fw.chunk forward + backward, and its seconds."""
    import time

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    inp, st = _inputs(model, B, T, H, D, dtype, "cuda")
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    o, fin = fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
    loss = o.float().sum() + sum(t.float().sum() for t in state_tensors(fin))
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.grad(loss, leaves, allow_unused=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0


def _fwd_bwd(model, inp, st, backend):
    """One fw.chunk forward + backward: (o, the input gradients)."""
    o, fin = fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, backend=backend, **inp)
    loss = o.float().sum() + sum(t.float().sum() for t in state_tensors(fin))
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    return o, torch.autograd.grad(loss, leaves, allow_unused=True)


def _rel(a, b):
    if a is None or b is None:
        return None
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def time_step(model, B, T, H, D, dtype, *, backend="auto", precision=None, repeats=5, profile_to=None, ref=None,
              budget_s=240.0):
    """Times of one fw.chunk fwd+bwd on CUDA (see the module doc): a dict, and (o, grads) for the next comparison.
    The repeats are cut to what fits `budget_s` at the first call's pace (at least one), and the profile is skipped
    when the first call alone took more than half of it."""
    import contextlib
    import time

    from fastweights.kernels.rows import pinned

    inp, st = _inputs(model, B, T, H, D, dtype, "cuda", seed=0)  # the same inputs for every precision
    pin = pinned("generic", precision=precision) if precision and model == "atlas" else contextlib.nullcontext()
    row = dict(model=model, shape=[B, T, H], D=D, dtype=str(dtype), backend=backend, precision=precision)
    with pin:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        o, grads = _fwd_bwd(model, inp, st, backend)
        torch.cuda.synchronize()
        row.update(first_call_s=time.perf_counter() - t0, peak_GiB=(torch.cuda.max_memory_allocated() - base) / 2 ** 30)
        if not all(bool(torch.isfinite(x).all()) for x in [o, *[g for g in grads if g is not None]]):
            row["nonfinite"] = True
        if ref is not None:
            row["rel_err_o"] = _rel(o, ref[0])
            row["rel_err_grads_max"] = max((e for e in map(_rel, grads, ref[1]) if e is not None), default=None)
        ms = []
        repeats = min(repeats, max(1, int(budget_s / max(row["first_call_s"], 1e-3))))
        row["repeats"] = repeats
        if row["first_call_s"] > budget_s / 2:
            profile_to = None
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _fwd_bwd(model, inp, st, backend)
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        ms.sort()
        row.update(ms_median=ms[len(ms) // 2] if ms else None, ms_min=ms[0] if ms else None, ms_all=ms)
        if profile_to:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _fwd_bwd(model, inp, st, backend)
                torch.cuda.synchronize()
            Path(profile_to).write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    return row, (o, grads)


def time_ns_kernel(r, M=2048, repeats=5):
    """The Newton–Schulz kernel alone (`kernels.triton.memories.newton_schulz.newton_schulz_gram`, the generic row's
    precision) on M fp32 Gram matrices [r, r] (one segment of ATLAS at the small shape: B·H·16 tokens), forward +
    backward: the first call's seconds (its compiles), the median ms after, or the error (at r > 32 the backward's
    sm_90 compile needs more shared memory than a block has: limits.NS_KERNEL_MAX_DIM)."""
    import time

    from fastweights.kernels.triton.memories.newton_schulz import newton_schulz_gram

    row = dict(kernel="newton_schulz_gram", r=r, M=M)
    x = torch.randn(M, r, r + 8, device="cuda")
    G = (x @ x.transpose(-1, -2)).requires_grad_(True)
    D = torch.randn(M, r, r, device="cuda")
    try:
        for i in range(1 + repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            (newton_schulz_gram(G, 5) * D).sum().backward()
            torch.cuda.synchronize()
            row.setdefault("first_call_s" if i == 0 else "ms", []).append(time.perf_counter() - t0 if i == 0 else
                                                                          1e3 * (time.perf_counter() - t0))
        row["first_call_s"] = row["first_call_s"][0]
        row["ms_median"] = sorted(row["ms"])[len(row["ms"]) // 2]
    except Exception as e:  # noqa: BLE001 — the error is the result (OutOfResources expected at r > 32)
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


def cpu_time(model, B, T, H, D, repeats, threads, trick):
    """--cpu-time: fp32 fw.chunk fwd+bwd on the CPU, timed after a warm-up call; trick "both": the kernel trick's form
    and the expanded one interleaved call by call (a shared machine's load hits both alike), with the largest
    difference of o and of the gradients between them. A dict per form (printed)."""
    import time

    torch.set_num_threads(threads)
    inp, st = _inputs(model, B, T, H, D, torch.float32, "cpu", seed=0)
    tricks = ["off", "on"] if trick == "both" else [trick]
    ms, cpu, got = {t: [] for t in tricks}, {t: [] for t in tricks}, {}
    for i in range(1 + max(1, repeats)):
        for t in tricks:
            omega.kernel_trick(t == "on", min_elements=0)
            t0, c0 = time.perf_counter(), time.process_time()
            got[t] = _fwd_bwd(model, inp, st, "auto")
            if i:
                ms[t].append(1e3 * (time.perf_counter() - t0))
                cpu[t].append(1e3 * (time.process_time() - c0))
    rows = []
    for t in tricks:
        m, c = sorted(ms[t]), sorted(cpu[t])
        # the process's CPU ms beside the wall ms: on a shared machine the wall clock counts the time others ran
        rows.append(dict(model=model, shape=[B, T, H], D=D, threads=threads, kernel_trick=t,
                         ms_median=m[len(m) // 2], ms_min=m[0], cpu_ms_median=c[len(c) // 2], cpu_ms_min=c[0]))
    if len(tricks) == 2:
        (o0, g0), (o1, g1) = got["off"], got["on"]
        rows[-1]["rel_err_o"] = _rel(o1, o0)
        rows[-1]["rel_err_grads_max"] = max((e for e in map(_rel, g1, g0) if e is not None), default=None)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def run_times(a, B, T, H):
    """--time: every model (ATLAS at each --ns-precisions entry), each row appended to time.json as it is done."""
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    if a.bmm_tiles:
        from fastweights.kernels.triton.memories import newton_schulz

        bm, bn, bk, warps = a.bmm_tiles
        newton_schulz.BMM_TILES.update(BM=bm, BN=bn, BK=bk, num_warps=warps)
    for r in a.ns_kernel_sides:
        rows.append(time_ns_kernel(r))
        print(json.dumps(rows[-1]), flush=True)
        if out:
            (out / "time.json").write_text(json.dumps(rows, indent=1))
    mm = torch.backends.cuda.matmul
    for m in a.models:
        ref = None
        runs = [(p, False) for p in (a.ns_precisions if m == "atlas" else [None])]
        if a.matmul_tf32:
            runs.append((runs[0][0], True))
        for prec, tf32 in runs:
            prev = mm.fp32_precision
            try:
                if tf32:
                    mm.fp32_precision = "tf32"
                name = f"{m}_{prec or 'default'}{'_tf32' if tf32 else ''}"
                prof = str(out / f"profile_{name}.txt") if out and a.profile else None
                row, got = time_step(m, B, T, H, a.D, getattr(torch, a.dtype), backend=a.backend, precision=prec,
                                     repeats=a.repeats, profile_to=prof, ref=ref, budget_s=a.row_budget)
                row["matmul_tf32"] = tf32
                if a.bmm_tiles:
                    row["bmm_tiles"] = a.bmm_tiles
                ref = ref or got
            except Exception as e:  # noqa: BLE001 — a row that fails is recorded, the next one runs
                row = dict(model=m, precision=prec, matmul_tf32=tf32, error=f"{type(e).__name__}: {str(e)[:400]}")
            finally:
                mm.fp32_precision = prev
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                (out / "time.json").write_text(json.dumps(rows, indent=1))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["omeganet", "atlas"],
                    help="(none: --time runs only the kernel alone)")
    ap.add_argument("--D", type=int, default=64, help="K = V")
    ap.add_argument("--lengths", type=int, nargs=2, default=[64, 128], help="T₁ T₂ of the slope")
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 512, 2], metavar=("B", "T", "H"),
                    help="where to predict (and, with --peak, run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="--peak's input dtype")
    ap.add_argument("--split", type=int, default=None, help="minibatch.split_readout(N)")
    ap.add_argument("--chain", type=int, default=0, help="minibatch.checkpoint_chain(k) for --peak")
    ap.add_argument("--by-line", action="store_true")
    ap.add_argument("--cpu-peak", action="store_true", help="also the CPU fwd+bwd peak of live storages, per token")
    ap.add_argument("--cpu-peak-B", type=int, default=1, help="--cpu-peak's batch (B·H the loop batches over)")
    ap.add_argument("--peak", action="store_true", help="also one fwd+bwd at --shape on CUDA: its peak")
    ap.add_argument("--out", default=None, help="write memory.json (--time: time.json) here")
    ap.add_argument("--time", action="store_true", help="CUDA: time the fwd+bwd step at --shape (module doc)")
    ap.add_argument("--ns-precisions", nargs="+", default=["ieee"], choices=["ieee", "tf32x3", "tf32"],
                    help="--time: ATLAS's Newton–Schulz precisions (the first is the reference of the errors)")
    ap.add_argument("--backend", default="auto", help="--time: fw.chunk's backend")
    ap.add_argument("--repeats", type=int, default=5, help="--time: timed calls after the first")
    ap.add_argument("--profile", action="store_true", help="--time: also profile one call per row (top kernels)")
    ap.add_argument("--bmm-tiles", type=int, nargs=4, default=None, metavar=("BM", "BN", "BK", "WARPS"),
                    help="--time: `newton_schulz.BMM_TILES` for the tf32x3 rows' product kernel (default 64 64 32 4)")
    ap.add_argument("--row-budget", type=float, default=240.0,
                    help="--time: seconds of repeats a row may take at its first call's pace (repeats cut to fit)")
    ap.add_argument("--ns-kernel-sides", type=int, nargs="*", default=[],
                    help="--time: first the Newton–Schulz kernel alone at these Gram sides (compile s, ms, or error)")
    ap.add_argument("--matmul-tf32", action="store_true",
                    help="--time: each model once more with every fp32 product of the process on TF32 (torch's "
                         "matmul.fp32_precision = 'tf32': the whole form, forward and backward; its errors against the "
                         "model's first row) — what a TF32 region around the whole form would give at most")
    ap.add_argument("--kernel-trick", default="off", choices=["on", "off", "both"],
                    help="`fastweights.chunkwise.omega.kernel_trick`: OmegaNet's form by the kernel trick (on: at "
                         "every width, min_elements 0) or the mini-batch form on expanded features (off, the "
                         "default as the library's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the fp32 fwd+bwd step on the CPU at --shape (--threads torch threads, --repeats calls "
                         "after one warm-up: median and min ms) instead")
    ap.add_argument("--threads", type=int, default=2, help="--cpu-time: torch.set_num_threads")
    ap.add_argument("--feature-kernels", action="store_true",
                    help="the kernel trick's K'-wide products by the Triton kernels of "
                         "`kernels.triton.memories.omega_features` (`chunkwise.omega.feature_products`)")
    a = ap.parse_args(argv)
    if a.feature_kernels:
        from fastweights.kernels.triton.memories.omega_features import feature_mm, feature_tmm, feature_vjp_kernel

        omega.feature_products(feature_mm, feature_tmm, feature_vjp_kernel)
    if a.split is not None:
        minibatch.split_readout(a.split)
    omega.kernel_trick(a.kernel_trick != "off", min_elements=0)  # on: the kernel trick's form at every width
    B, T, H = a.shape
    if a.cpu_time:
        return [cpu_time(m, B, T, H, a.D, a.repeats, a.threads, a.kernel_trick) for m in a.models]
    if a.time:
        return run_times(a, B, T, H)
    rows = []
    for m in a.models:
        (t1, t2) = a.lengths
        s1, _ = saved_bytes(m, t1, a.D, a.device)
        s2, where = saved_bytes(m, t2, a.D, a.device, a.by_line)
        per = (s2 - s1) / (t2 - t1)
        row = dict(model=m, D=a.D, saved_per_token_head=per, predicted_saved_GiB=per * B * T * H / 2 ** 30,
                   shape=[B, T, H])
        print(f"{m:10s} D {a.D}: saved {per / 1024:8.1f} KiB a token and head -> {row['predicted_saved_GiB']:7.2f} "
              f"GiB saved at B {B}, T {T}, H {H}")
        if a.cpu_peak:
            p1, p2 = cpu_peak(m, t1, a.D, a.cpu_peak_B, 1), cpu_peak(m, t2, a.D, a.cpu_peak_B, 1)
            pp = (p2 - p1) / (t2 - t1) / a.cpu_peak_B
            row.update(cpu_peak_per_token_head=pp, cpu_peak_at_T2=p2, predicted_peak_GiB=pp * B * T * H / 2 ** 30)
            print(f"    CPU fwd+bwd peak {p2 / 2 ** 20:.1f} MiB at B {a.cpu_peak_B}, T {t2}, H 1: slope "
                  f"{pp / 1024:.1f} KiB a token and head -> {row['predicted_peak_GiB']:.2f} GiB at B {B}, T {T}, H {H} "
                  f"(fp32, the T-independent part left out)")
        if a.by_line:
            for (at, shape), nb in sorted(where.items(), key=lambda kv: -kv[1])[:12]:
                print(f"    {nb / t2 / 1024:8.2f} KiB/token  {at}  {list(shape)}")
        if a.peak:
            minibatch.checkpoint_chain(a.chain)
            try:
                peak, sec = cuda_peak(m, B, T, H, a.D, getattr(torch, a.dtype))
                row.update(peak_GiB=peak / 2 ** 30, seconds=sec)
                print(f"    peak {peak / 2 ** 30:.2f} GiB, {sec:.2f} s (first call, compiles included)")
            except torch.cuda.OutOfMemoryError as e:
                row.update(peak_GiB=None, error=str(e)[:300])
                print(f"    out of memory: {str(e)[:200]}")
            finally:
                minibatch.checkpoint_chain(0)
                torch.cuda.empty_cache()
        rows.append(row)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "memory.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
