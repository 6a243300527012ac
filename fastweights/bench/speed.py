"""`fastweights bench speed`: forms × models × T, forward and forward+backward, side by side.

Forms: recurrent, parallel, chunk (eager PyTorch), chunk_compile (the chunk core through
torch.compile; the compile happens in the warm-up calls and is not timed) and chunk_triton (the
Triton kernels of `fastweights.kernels.triton`, `backend="triton"`: CUDA, gated-linear models with
the identity feature map; a model they cannot serve gets its error as the row's result).

Every row is timed in the same process and run, with fresh random inputs, as the median of
repeated calls (CUDA: device events after a warm-up; CPU: a host clock). On CUDA the peers are
timed in the same run: torch SDPA causal attention, and flash-linear-attention (`fla`, the PyPI
package `fla-core`) when it is importable — installed only into a benchmark environment, never a
dependency of this library — and FlashQLA (pip `flash-qla`, TileLang; the gated delta rule only)
when importable. A peer that fails (e.g. fla's gated backward on Hopper with Triton
3.6) is recorded with its error instead of a time.

Also printed per row: the floor, max(FLOPs / matmul peak, bytes / bandwidth), from the counts in
`chunk_flops` and `io_bytes` (peaks are arguments: measure them on the machine).

Each row also gets its speed-up against the recurrent form of the same model and T (recurrent is
timed first when it is among the forms): recurrent ms / this row's ms, forward and forward+backward.

Prints the table's header, then each row as it is timed with an estimate of the time left (from
the rows of the first length, scaled linearly in T — quadratically for the parallel form); writes
`speed.md` and `speed.json` under --out, rewritten after each row, so a run that dies keeps every
row already timed. Defaults (`fastweights bench speed`): five models, recurrent and chunk, T = 512
and 2048, B=1, H=4, D=64, 1 warm-up and 5 timed calls per row, one torch thread (`threads=0`:
torch's default pool).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .. import api, zoo
from ..chunkwise.flops import chunk_flops
from ..inputs import example_inputs

__all__ = ["FORMS", "Row", "io_bytes", "step_times", "median_ms", "fwd_bwd", "bench_inputs", "fastweights_case",
           "sdpa_case", "fla_case", "flashqla_case", "FLA_OPS", "FLASHQLA_MODELS", "check_args", "run_speed"]

FORMS = ("recurrent", "parallel", "chunk", "chunk_compile", "chunk_triton")
"""The forms `bench speed` times, in the order it times them (the speed-up base first)."""


@dataclass
class Row:
    impl: str  # "fastweights" | "sdpa" | "fla" | "flashqla"
    model: str
    form: str
    B: int
    T: int
    H: int
    D: int
    dtype: str
    fwd_ms: float | None
    fwdbwd_ms: float | None
    floor_fwd_ms: float | None
    error: str = ""
    speedup_fwd: float | None = None  # recurrent ms / this ms, same model and T (None: no recurrent row)
    speedup_fwdbwd: float | None = None
    HV: int | None = None  # value heads when they differ from H (grouped: q, k have H heads)


def io_bytes(B, T, H, K, V, elem=2, gates=1, HV=None, n=1) -> float:
    """Fewest bytes moved by one forward: read q, k, v (and fp32 gates), write o; q and k with H heads,
    v, the gates and o with HV (default H); k and v n times (DeltaProduct's micro-steps)."""
    HV = HV or H
    return elem * B * T * ((1 + n) * H * K + (1 + n) * HV * V) + 4 * B * T * HV * gates


def step_times(fn, device: torch.device, reps: int, before=None) -> list[float]:
    """Milliseconds of each of `reps` calls of fn(): CUDA events around it on a GPU (the device synchronized
    first, so each call is timed alone), a host clock elsewhere. before(): run untimed before each call (a
    barrier, a fresh batch)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def median_ms(fn, device, warmup=1, reps=5) -> float:
    """Median milliseconds of `reps` calls of fn() (`step_times`) after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(step_times(fn, device, reps))


def fwd_bwd(run, tensors):
    """A case's (run, tensors) as the two timed callables: fwd() runs it with gradients off; fwdbwd() runs it,
    backpropagates the sum of its output and clears the gradients of `tensors`.

    A case (`fastweights_case`, `sdpa_case`, `fla_case`, `flashqla_case`) is (run, tensors): run() returns
    the op's output (e.g. o [B, T, H, V]) on inputs drawn once; tensors are those inputs' trainable leaves."""
    def fwd():
        with torch.no_grad():
            run()

    def fwdbwd():
        o = run()
        o.float().sum().backward()
        for t in tensors:
            t.grad = None

    return fwd, fwdbwd


def bench_inputs(model, B, T, H, D, dtype, device, HV=None) -> dict:
    """`example_inputs` as trainable leaves; with HV value heads (grouped, HV a multiple of H) the
    inputs are drawn with HV heads and q, k (and a probe p) keep their first H heads."""
    inp = example_inputs(model, batch_size=B, seq_len=T, num_heads=HV or H, head_dim=D, dtype=dtype,
                         device=device, requires_grad=True)
    if HV and HV != H:
        if HV % H:
            raise ValueError(f"value_heads must be a multiple of heads, got {HV} and {H}")
        for name in ("q", "k", "p"):
            if name in inp:  # the head axis is −2 ([B, T, H, K], DeltaProduct's k [B, T, n, H, K])
                inp[name] = inp[name][..., :H, :].detach().contiguous().requires_grad_(True)
    return inp


def fastweights_case(model, form, B, T, H, D, dtype, device, chunk_size, HV=None):
    """The case (run, tensors) of `model` in one of FORMS on `bench_inputs` (see `fwd_bwd`)."""
    inp = bench_inputs(model, B, T, H, D, dtype, device, HV)
    state = inp.pop("initial_state", None)
    fn = getattr(api, form.split("_")[0])
    kw = {"chunk_size": chunk_size} if form.startswith("chunk") else {}
    if form in ("chunk_compile", "chunk_triton"):
        kw["backend"] = form.split("_")[1]

    def run():  # check_values=False as layers call it: reading values is a host synchronization
        return fn(model, initial_state=state, check_values=False, **inp, **kw)[0]

    return run, [x for x in inp.values() if x.requires_grad]


def sdpa_case(B, T, H, D, dtype, device):
    """Causal softmax attention with H heads (give it the value heads of a grouped row)."""
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, device=device, requires_grad=True) for _ in range(3))

    def run():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run, [q, k, v]


FLA_OPS = {  # our model name -> (fla function name, gate kind)
    "deltanet": ("chunk_delta_rule", None),
    "gated_deltanet": ("chunk_gated_delta_rule", "scalar"),
    "gla": ("chunk_gla", "diagonal"),
    "kda": ("chunk_kda", "diagonal"),
    "mamba2": ("chunk_simple_gla", "scalar"),  # scalar decay per token and head
    "retnet": ("chunk_retention", None),  # its own constant per-head decays
    # k, v, β with T·n_h rows (micro-steps interleaved); not re-exported by fla.ops: module.function
    "deltaproduct": ("gated_delta_product.chunk_gated_delta_product", "scalar"),
    # fla's Comba decays the state before reading the error (v − (D S)ᵀp), ours after (v − Sᵀp): the same work
    # per token (a probe key p, a scalar gate), another recurrence; timed on the same inputs
    "comba": ("comba.chunk_comba", "scalar"),
    # TTT-Linear (issue 36's peer): fla's chunk kernels take the LayerNorm's affine (w, b [H, V]) and η [B, T, H, 1];
    # mini-batches of 16 tokens (fla's chunk_size), as the zoo's recipe
    "ttt_linear": ("ttt.chunk_ttt_linear", None),
}


def fla_case(model, B, T, H, D, dtype, device, HV=None):
    """fla's op for `model` (FLA_OPS) on `bench_inputs` as a case (run, tensors); needs fla installed."""
    import fla.ops as ops  # noqa: PLC0415 — the peer, only in benchmark environments

    name, gate = FLA_OPS[model]
    if "." in name:
        mod, name = name.rsplit(".", 1)
        ops = importlib.import_module(f"fla.ops.{mod}")
    fn = getattr(ops, name)
    inp = bench_inputs(model, B, T, H, D, dtype, device, HV)
    q, k, v = inp["q"], inp["k"], inp["v"]
    kw = {}
    if gate is not None:
        kw["g"] = inp["g"]
    if "beta" in inp and model not in ("gla", "mamba2", "retnet"):
        kw["beta"] = inp["beta"]
    n = k.shape[2] if k.dim() == 5 else 1  # DeltaProduct: [B, T, n_h, H, K] → fla's [B, T·n_h, H, K]
    if n > 1:
        kw["num_householder"] = n

    if model == "ttt_linear":  # q, k, v, w, b, η [B, T, H, 1]; the initial state fla's zeros
        w, b, eta = inp["ln_weight"], inp["ln_bias"], inp["beta"]

        def run():
            return fn(q, k, v, w, b, eta.unsqueeze(-1), chunk_size=16)[0]

        return run, [x for x in (q, k, v, w, b, eta) if x.requires_grad]

    if "p" in inp:  # Comba's probe key, fla's 4th positional argument
        p = inp["p"]

        def run():
            return fn(q, k, v, p, **kw)[0]

        return run, [x for x in inp.values() if x.requires_grad]

    def run():
        if n == 1:
            return fn(q, k, v, **kw)[0]
        return fn(q, k.flatten(1, 2), v.flatten(1, 2), kw["g"], kw["beta"].flatten(1, 2), num_householder=n)[0]

    return run, [x for x in inp.values() if x.requires_grad]


def flashqla_case(model, B, T, H, D, dtype, device, HV=None):
    """FlashQLA (pip `flash-qla`, TileLang): the gated delta rule on the same inputs as ours, q and k
    already L2-normalized (use_qk_l2norm_in_kernel=False: the same work as our kernel call)."""
    from flash_qla import chunk_gated_delta_rule  # noqa: PLC0415 — the peer, only in benchmark environments

    inp = bench_inputs(model, B, T, H, D, dtype, device, HV)
    q, k, v, g = inp["q"], inp["k"], inp["v"], inp["g"]
    beta = inp["beta"]

    def run():
        return chunk_gated_delta_rule(q, k, v, g.float(), beta.to(dtype), use_qk_l2norm_in_kernel=False)[0]

    return run, [x for x in inp.values() if x.requires_grad]


FLASHQLA_MODELS = ("gated_deltanet",)


def check_args(*, models, forms, lengths, B, H, D, dtype, device, chunk_size, repeats=5, warmup=1,
               threads=None, value_heads=None) -> None:
    """Every argument checked before anything is timed (`fastweights.cliargs.ArgError` naming the flag)."""
    from .. import cliargs as ca

    if not models:
        raise ca.ArgError("--models needs at least one zoo name")
    ca.zoo_names("--models", models)
    if not forms:
        raise ca.ArgError(f"--forms needs at least one of {', '.join(FORMS)}")
    for f in forms:
        if f not in FORMS:
            raise ca.ArgError(f"--forms: unknown form {f!r}; forms: {', '.join(FORMS)}")
    if not any(f.split("_")[0] in api.forms(m) for m in models for f in forms):
        raise ca.ArgError(f"no row to run: {', '.join(models)} ha{'s' if len(models) == 1 else 've'} no "
                          f"{'/'.join(forms)} form (check --models and --forms)")
    if not lengths:
        raise ca.ArgError("--lengths needs at least one sequence length")
    for flag, v in (("--lengths", list(lengths)), ("--batch", B), ("--heads", H), ("--dim", D),
                    ("--chunk-size", chunk_size), ("--repeats", repeats)):
        ca.positive(flag, v, allow_none=False)
    ca.nonnegative("--warmup", warmup, allow_none=False)
    ca.positive("--value-heads", value_heads, allow_none=True)
    if value_heads is not None and value_heads % H:
        raise ca.ArgError(f"--value-heads must be a multiple of --heads ({H}), got {value_heads}")
    ca.threads("--threads", threads, zero_ok=True)
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise ca.ArgError(f"--dtype must be float32, bfloat16, float16 or float64, got {dtype!r}")
    ca.device("--device", device)
    if "chunk_triton" in forms and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ca.ArgError(f"--forms chunk_triton runs the Triton kernels: it needs --device cuda, got {device!r} "
                          "(or TRITON_INTERPRET=1 to run them in Triton's interpreter on CPU tensors)")


def _ordered(forms) -> list[str]:
    return sorted(dict.fromkeys(forms), key=FORMS.index)


def run_speed(*, models, forms, lengths, B, H, D, dtype, device, out_dir, peers=True, chunk_size=64,
              peak_tflops=None, peak_tbps=None, backward=True, repeats=5, warmup=1, threads=None,
              value_heads=None, log=print) -> list[Row]:
    """Time every (T, model, form) row; see the module doc. `value_heads` HV: grouped rows (q, k with H
    heads, v, the gates and the output with HV; SDPA gets HV heads). Returns the rows."""
    check_args(models=models, forms=forms, lengths=lengths, B=B, H=H, D=D, dtype=dtype, device=device,
               chunk_size=chunk_size, repeats=repeats, warmup=warmup, threads=threads, value_heads=value_heads)
    HV = value_heads if value_heads and value_heads != H else None
    forms = _ordered(forms)
    device = torch.device(device)
    dt = getattr(torch, dtype)
    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out_dir, exist_ok=True)
    rows: list[Row] = []
    peak_tflops = peak_tflops or (790.0 if device.type == "cuda" else 0.2)
    peak_tbps = peak_tbps or (3.0 if device.type == "cuda" else 0.02)
    plan = [(T, m, f) for T in lengths for m in models for f in forms if f.split("_")[0] in api.forms(m)]
    for m in models:
        missing = [f for f in forms if f.split("_")[0] not in api.forms(m)]
        if missing:
            log(f"note: {m} has no {'/'.join(missing)} form; those rows are skipped")
    log(f"bench speed: {len(plan)} rows ({B}×T×{H}×{D} {dtype} on {device}, torch threads "
        f"{torch.get_num_threads()}), each {warmup} warm-up + {repeats} timed calls, forward"
        + (" and forward+backward" if backward else ""))
    log(HEADER)
    spent: dict[tuple[str, str], tuple[int, float]] = {}  # (model, form) -> (T, seconds) of its first row
    t_start = time.perf_counter()

    def floor_ms(model, T):
        recipe = zoo.resolve(model)
        delta = api.recipe_class(recipe) == "delta"
        n = recipe.optimizer.householder_steps
        f = n * chunk_flops(B, T, HV or H, D, D, chunk_size, delta) / (peak_tflops * 1e12)
        b = io_bytes(B, T, H, D, D, elem=torch.finfo(dt).bits // 8, HV=HV, n=n) / (peak_tbps * 1e12)
        return 1e3 * max(f, b)

    def estimate_left(done: int) -> str:
        if done >= len(plan) or any((m, f) not in spent for _, m, f in plan):
            return ""
        left = 0.0
        for T, m, f in plan[done:]:
            T0, sec = spent[(m, f)]
            left += sec * (T / T0) ** (2 if f == "parallel" else 1)
        return f"  (~{left:.0f} s left)"

    def record(impl, model, form, T, make):
        t0 = time.perf_counter()
        try:
            run, tensors = make()
            fwd, fwdbwd = fwd_bwd(run, tensors)
            f = median_ms(fwd, device, warmup, repeats)
            fb = median_ms(fwdbwd, device, warmup, repeats) if backward else None
            row = Row(impl, model, form, B, T, H, D, dtype, f, fb, floor_ms(model, T), HV=HV)
        except Exception as e:  # a failing peer or form is a result too
            row = Row(impl, model, form, B, T, H, D, dtype, None, None, None, f"{type(e).__name__}: {e}"[:300], HV=HV)
        base = row if (impl, form) == ("fastweights", "recurrent") else next(
            (r for r in rows if r.impl == "fastweights" and r.model == model and r.T == T and r.form == "recurrent"),
            None)
        if base is not None and impl != "sdpa":
            row.speedup_fwd = _ratio(base.fwd_ms, row.fwd_ms)
            row.speedup_fwdbwd = _ratio(base.fwdbwd_ms, row.fwdbwd_ms)
        rows.append(row)
        if impl == "fastweights":
            spent.setdefault((model, form), (T, time.perf_counter() - t0))
        _write(rows, out_dir)
        done = sum(r.impl == "fastweights" for r in rows)
        log(_fmt(row) + estimate_left(done))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    have_fla = importlib.util.find_spec("fla") is not None
    have_flashqla = importlib.util.find_spec("flash_qla") is not None
    if peers and device.type == "cuda" and not have_fla:
        log("note: flash-linear-attention (fla-core) is not importable here; its rows are skipped")
    for T in lengths:
        if peers and device.type == "cuda":
            record("sdpa", "softmax_attention", "sdpa", T, lambda T=T: sdpa_case(B, T, HV or H, D, dt, device))
        for model in models:
            for form in forms:
                if form.split("_")[0] not in api.forms(model):
                    continue
                record("fastweights", model, form, T,
                       lambda m=model, f=form, T=T: fastweights_case(m, f, B, T, H, D, dt, device, chunk_size, HV))
            if peers and device.type == "cuda" and have_fla and model in FLA_OPS:
                record("fla", model, "chunk", T, lambda m=model, T=T: fla_case(m, B, T, H, D, dt, device, HV))
            if peers and device.type == "cuda" and have_flashqla and model in FLASHQLA_MODELS:
                record("flashqla", model, "chunk", T,
                       lambda m=model, T=T: flashqla_case(m, B, T, H, D, dt, device, HV))
    log(f"{len(rows)} rows in {time.perf_counter() - t_start:.0f} s; table: {os.path.join(out_dir, 'speed.md')}")
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def _fmt(r: Row) -> str:
    def ms(x):
        return "—" if x is None else f"{x:.3f}"

    def up(x):
        return "—" if x is None else f"{x:.1f}×"

    err = f"  {r.error}" if r.error else ""
    heads = f"{r.H}/{r.HV}" if r.HV else f"{r.H}"
    return (f"| {r.impl} | {r.model} | {r.form} | {r.B}×{r.T}×{heads}×{r.D} {r.dtype} | {ms(r.fwd_ms)} | "
            f"{ms(r.fwdbwd_ms)} | {up(r.speedup_fwd)} | {up(r.speedup_fwdbwd)} | {ms(r.floor_fwd_ms)} |{err}")


HEADER = ("| impl | model | form | B×T×H(/HV)×D dtype | fwd ms | fwd+bwd ms | speed-up fwd | speed-up fwd+bwd "
          "| fwd floor ms |\n|---|---|---|---|---:|---:|---:|---:|---:|")
"""Speed-up: the recurrent form's time over this row's (same model, T)."""


def _write(rows, out_dir):
    with open(os.path.join(out_dir, "speed.json"), "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
    with open(os.path.join(out_dir, "speed.md"), "w") as f:
        f.write(HEADER + "\n" + "\n".join(_fmt(r) for r in rows) + "\n")
