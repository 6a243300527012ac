"""What one training step of each zoo memory costs: `fw.chunk` forward + backward time and memory
per model at one MQAR-sized shape (issue 24: the memories without kernels must not sink the
ceilings sweep's budget).

    python3 scripts/step_costs.py --device cuda                      # B 64, T 512, H 2, K = V = 64, bf16
    python3 scripts/step_costs.py --device cpu                       # B 4, T 128, H 2, K = V = 32, fp32
    python3 scripts/step_costs.py --device cpu --models ttt_mlp atlas --seq-len 64 128   # memory vs T
    python3 scripts/step_costs.py --device cuda --models ttt_mlp titans --compile-loop   # the loop compiled

Per model it times the training form the layer uses (`chunk` where it exists, else `parallel`:
the softmax side, shown for comparison; its layer runs SDPA instead) on random valid inputs
(`fastweights.example_inputs`: unit keys, the recipe's gates, MLP memories' initial weights as
leaves), forward + backward of a random projection of the output into every input, the median of
--repeats calls after --warmup. Memory: `saved` is the bytes autograd keeps for the backward
(every saved tensor counted once per storage, via `torch.autograd.graph.saved_tensors_hooks`: any
device), and on CUDA `peak` is `torch.cuda.max_memory_allocated` over the step minus what was
allocated before it. `ATen ops`: the ops one step dispatches (forward and backward), a
device-independent proxy for a launch-bound GPU step. Several --seq-len values print each model's
saved bytes per T, the check that memory grows linearly in T. A model that fails (e.g. out of
memory) prints its error in its row. Also prints the ratio to gated DeltaNet (the issue's goal: every model within 10×).

--lm PRESET times instead what an MQAR sweep pays per optimizer step: for every model of the preset
and every (seq_len, batch) of its settings, the cell's own LM (`fastweights.lab.mqar.build_model`:
its d_model, heads, conv and gates) on a batch of its MQAR data, forward + backward + AdamW step
(bf16 autocast on CUDA, as `--dtype bfloat16` trains), and writes {model: {"L{L}-B{batch}": ms}} to
--json, the input of `fastweights mqar --preset PRESET --dry-run --step-costs JSON`:

    python3 scripts/step_costs.py --lm ceilings --device cuda --json runs/steps.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fastweights as fw  # noqa: E402
from fastweights.layers.mixer import training_form  # noqa: E402
from fastweights.state import state_tensors  # noqa: E402

DEFAULTS = {"cuda": dict(batch=64, seq_len=[512], heads=2, head_dim=64, dtype="bfloat16"),
            "cpu": dict(batch=4, seq_len=[128], heads=2, head_dim=32, dtype="float32")}


def _leaves(inputs: dict) -> list[torch.Tensor]:
    out = [x for key, x in inputs.items() if key != "initial_state" and x.requires_grad]
    state = inputs.get("initial_state")
    if state is not None:
        out += [x for x in state_tensors(state) if x.requires_grad]
    return out


def _inputs(model: str, *, B: int, T: int, H: int, K: int, dtype, device) -> dict:
    inputs = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=K, head_v_dim=K,
                               dtype=dtype, device=device, seed=0, requires_grad=True)
    state = inputs.get("initial_state")
    if state is not None:
        for x in state_tensors(state):
            x.requires_grad_(True)
    return inputs


class _Ops(TorchDispatchMode):
    """Counts the ATen ops a step dispatches (views and metadata ops included): on a GPU at this
    shape most ops are a kernel launch each, so the count is a device-independent proxy for a
    launch-bound step."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Saved:
    """Bytes of the tensors autograd saves for the backward, each storage counted once."""

    def __init__(self):
        self.storages: dict = {}

    def pack(self, x):
        st = x.untyped_storage()
        self.storages[(st.data_ptr(), x.device)] = st.nbytes()
        return x

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def measure(model: str, *, B: int, T: int, H: int, K: int, dtype, device, warmup: int, repeats: int) -> dict:
    form = training_form(model)
    fn = fw.chunk if form == "chunk" else fw.parallel
    inputs = _inputs(model, B=B, T=T, H=H, K=K, dtype=dtype, device=device)
    leaves = _leaves(inputs)
    cuda = torch.device(device).type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1)

    def step():
        o, _ = fn(model, check_values=False, **inputs)
        proj = torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype)
        torch.autograd.grad((o * proj).float().sum(), leaves, allow_unused=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    saved = _Saved()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        o, _ = fn(model, check_values=False, **inputs)
    del o
    ops = _Ops()
    with ops:
        step()
    peak = None
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        sync()
        peak = torch.cuda.max_memory_allocated(device) - base
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return {"form": form, "ms": statistics.median(times), "saved": saved.bytes, "peak": peak, "ops": ops.count}


def graphed_step_ms(net, x, y, *, warmup: int, repeats: int, grad_clip=1.0, dtype: str = "bfloat16"):
    """The same LM step as the lab trains it with CUDA graphs (`fastweights.lab.graph.GraphedSteps`, what
    `train_cell(cuda_graph=True)` replays: the loss at each example's supervised positions, clipping, AdamW
    with capturable=True), captured after its eager warm-up steps and replayed. Returns ms (median of
    replays) or why the capture failed."""
    from fastweights.lab import graph
    from fastweights.lab.train import Supervised
    from fastweights.training.step import adamw

    opt = adamw(net, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
    graph.set_capturable(opt, True)
    runner = graph.GraphedSteps(Supervised(net), opt, device=x.device, dtype=dtype, grad_clip=grad_clip,
                                inputs=x.cpu(), labels=y.cpu(), batch=x.shape[0], steps_per_epoch=1,
                                capture=True)
    notes = []
    try:
        sel = runner.epoch(torch.arange(x.shape[0]))
        for _ in range(graph.WARMUP + 1):  # the warm-up, then the capture and its first replay
            runner.step(0, sel[0], log=notes.append)
        if not runner.graphed:
            return f"not graphed: {runner.why_not()}"
        for _ in range(warmup):
            runner.step(0, sel[0])
        times = []
        for _ in range(max(repeats, 5)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.step(0, sel[0])
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    except Exception as e:  # noqa: BLE001 — a probe: report why it failed
        return f"failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    finally:
        runner.close()


class _Traffic(TorchDispatchMode):
    """Counts the non-view ATen ops a step dispatches and the bytes of their tensor inputs and outputs
    (each op's reads and writes: what a memory-bound GPU step pays), device-independent."""

    VIEWS = {"view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze",
             "select", "slice", "as_strided", "detach", "alias", "unflatten", "unbind", "split", "chunk",
             "diagonal", "view_as", "flatten", "narrow", "movedim", "unfold", "lift_fresh", "_reshape_alias",
             "split_with_sizes", "t_", "expand_as"}

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.ops += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs or {}, out))[0]
                              if isinstance(t, torch.Tensor))
        return out


def lm_step_ms(preset: str, models, *, device, warmup: int, repeats: int,
               graph: bool = False, batch: int | None = None, counts: bool = False,
               lengths=None) -> dict[str, dict[str, float]]:
    """{model: {"L{L}-B{batch}": ms per training step}} for the cells of an MQAR preset (with graph: also
    {model + "+graph": ...}, the step captured in a CUDA graph, `graphed_step_ms`). batch: instead of each
    cell's (a CPU measurement at a smaller batch). counts: also {model + "+ops" / "+GiB" / "+GFLOP": ...},
    the non-view ATen ops, the bytes their tensors read and write, and the FLOPs of one step. lengths: only
    the cells of these sequence lengths."""
    import torch.nn.functional as F

    from fastweights.lab.mqar import PRESETS, build_model, cell_data, make_cells
    from fastweights.lab.train import Supervised

    p = PRESETS[preset]
    cells = make_cells(p, models=models, lrs=[1e-3])
    cuda = torch.device(device).type == "cuda"
    out: dict[str, dict[str, float]] = {}
    for cell in cells:
        L, n, _ = cell.train_segments[-1]
        if lengths and L not in lengths:
            continue
        bs = batch or cell.batch_size
        key = f"L{L}-B{bs}"
        if key in out.get(cell.model, {}):
            continue
        small = dataclasses.replace(cell, train_segments=((L, n, bs),), test_segments=((L, n, 1),), batch_size=bs)
        (x, y), _ = cell_data(small)
        x, y = x.to(device), y.to(device)
        torch.manual_seed(0)
        net = build_model(small).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        sup = Supervised(net)

        def step(sup=sup, opt=opt, x=x, y=y):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
                logits, tgt, _ = sup(x, y)
                loss = F.cross_entropy(logits.float(), tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            for _ in range(warmup):
                step()
            times = []
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            ms = statistics.median(times)
        except Exception as e:  # noqa: BLE001 — out of memory, a kernel that does not compile, ...: the cell goes on
            print(f"{cell.model} {key}: failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}",
                  flush=True)
            ms = float("nan")
        out.setdefault(cell.model, {})[key] = ms
        extra = ""
        if counts and ms == ms:
            from torch.utils.flop_counter import FlopCounterMode

            traffic, flops = _Traffic(), FlopCounterMode(display=False)
            with flops, traffic:
                step()
            for suffix, v in (("+ops", traffic.ops), ("+GiB", traffic.bytes / 2**30),
                              ("+GFLOP", flops.get_total_flops() / 1e9)):
                out.setdefault(cell.model + suffix, {})[key] = v
            gflop = flops.get_total_flops() / 1e9
            extra += f"  {traffic.ops:6d} ops {traffic.bytes / 2**30:7.2f} GiB {gflop:8.2f} GFLOP"
        if graph and cuda and ms == ms:
            gms = graphed_step_ms(net, x, y, warmup=warmup, repeats=repeats, grad_clip=cell.grad_clip)
            out.setdefault(cell.model + "+graph", {})[key] = gms if isinstance(gms, float) else float("nan")
            extra = f"  graphed {gms:9.2f} ms ({ms / gms:.1f}x)" if isinstance(gms, float) else f"  graph: {gms}"
        print(f"{cell.model:<20} {key:<10} {ms:9.2f} ms  (heads {cell.num_heads}){extra}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return out


def _mib(x) -> str:
    return "—" if x is None else f"{x / 2 ** 20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=fw.zoo.names())
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int, nargs="+")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--head-dim", type=int, help="K = V")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "float64"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--out", help="also write the Markdown table here")
    ap.add_argument("--lm", metavar="PRESET", help="time the LM training step of an MQAR preset's cells instead")
    ap.add_argument("--json", help="with --lm: write the step times here")
    ap.add_argument("--lm-batch", type=int, help="with --lm: this batch instead of each cell's (e.g. a CPU run)")
    # (with --lm, --seq-len keeps only the cells of those sequence lengths)
    ap.add_argument("--counts", action="store_true",
                    help="with --lm: also count each step's non-view ATen ops, the bytes they read and write, and "
                         "its FLOPs (device-independent)")
    ap.add_argument("--graph", action="store_true",
                    help="with --lm on CUDA: also time each step captured in a CUDA graph (a probe; prints why a "
                         "capture fails)")
    ap.add_argument("--compile-loop", action="store_true",
                    help="opt in to torch.compile of the mini-batch loop body (fastweights.chunkwise."
                         "minibatch.compile_loop; gd / momentum memories); its compile time falls in the first "
                         "step, and the ATen ops and saved bytes it prints do not see inside compiled regions")
    ap.add_argument("--ns", choices=["kernel", "tf32x3", "tf32", "torch"], default="kernel",
                    help="the Newton–Schulz of Muon memories (ATLAS) on the generic chunk Triton row: kernel — its "
                         "kernel as routed (ieee); tf32x3 / tf32 — the kernel at that tl.dot precision "
                         "(rows.pinned(precision=)); torch — that row refused, so 'auto' runs the torch row (the "
                         "iteration in torch; the layer ops stay on Triton)")
    a = ap.parse_args(argv)
    with _newton_schulz(a.ns):
        return _main(a)


@contextmanager
def _newton_schulz(choice: str):
    """Within the block, the generic chunk Triton row as --ns says (see its help); put back after."""
    if choice == "kernel":
        yield
        return
    from fastweights.kernels.rows import pinned

    if choice != "torch":
        with pinned("generic", precision=choice):
            yield
        return
    from fastweights.dispatch import DISPATCH

    key = ("generic", "chunk", "triton")
    impl = DISPATCH[key]
    off = "the Newton–Schulz kernel is off (step_costs.py --ns torch)"
    DISPATCH[key] = dataclasses.replace(impl, supports=lambda recipe, target: off)
    try:
        yield
    finally:
        DISPATCH[key] = impl


def _main(a) -> int:
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is present", file=sys.stderr)
        return 2
    d = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    B, Ts, H = a.batch or d["batch"], a.seq_len or d["seq_len"], a.heads or d["heads"]
    K, dtype = a.head_dim or d["head_dim"], getattr(torch, a.dtype or d["dtype"])
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    if a.compile_loop:
        from fastweights.chunkwise.minibatch import compile_loop

        compile_loop(True)
    if a.lm:
        import json

        from fastweights.lab.mqar import PRESETS

        models = a.models if a.models != fw.zoo.names() else list(PRESETS[a.lm].models)
        res = lm_step_ms(a.lm, models, device=dev, warmup=a.warmup, repeats=a.repeats, graph=a.graph,
                         batch=a.lm_batch, counts=a.counts, lengths=a.seq_len)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    for m in a.models:
        fw.zoo.get(m)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    head = (f"fw.chunk (parallel where no chunk form) forward + backward, B {B}, H {H}, K = V = {K}, "
            f"{dtype}, {where}, torch {torch.__version__}; median of {a.repeats} after {a.warmup}")
    lines = [head, "", "| model | form | T | step (ms) | × gated_deltanet | ATen ops | saved (MiB) | peak (MiB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    print(head, flush=True)
    ref: dict[int, float] = {}
    order = sorted(a.models, key=lambda m: m != "gated_deltanet")  # the reference first
    rows: dict[str, list[str]] = {}
    for T in Ts:
        for m in order:
            try:
                r = measure(m, B=B, T=T, H=H, K=K, dtype=dtype, device=dev, warmup=a.warmup, repeats=a.repeats)
            except Exception as e:  # noqa: BLE001 — out of memory, a kernel that does not compile, ...: a row too
                row = f"| {m} | — | {T} | failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]} | | | | |"
            else:
                if m == "gated_deltanet":
                    ref[T] = r["ms"]
                ratio = f"{r['ms'] / ref[T]:.1f}×" if T in ref else "—"
                row = (f"| {m} | {r['form']} | {T} | {r['ms']:.2f} | {ratio} | {r['ops']} | {_mib(r['saved'])} | "
                       f"{_mib(r['peak'])} |")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.setdefault(m, []).append(row)
            print(row, flush=True)
    lines += [row for m in a.models for row in rows[m]]
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
