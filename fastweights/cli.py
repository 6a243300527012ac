"""`fastweights ...`: parses the command line and dispatches; the work lives in the modules."""

from __future__ import annotations

import argparse
import json
import sys


def _zoo(args):
    from . import zoo

    if args.json:
        print(json.dumps(zoo.rows(), indent=2, ensure_ascii=False))
    else:
        print(zoo.table())


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _demo(args):
    from . import cliargs
    from .demo import format_demo, run_demo

    try:
        cliargs.positive("--seq-len", args.seq_len, allow_none=False)
        cliargs.nonnegative("--seed", args.seed)
        if args.models is not None and not args.models:
            raise cliargs.ArgError("--models needs at least one zoo name (or leave it out: all)")
        cliargs.zoo_names("--models", args.models)
    except ValueError as e:
        return _fail(e)
    records = run_demo(seq_len=args.seq_len, seed=args.seed, names=args.models)
    print(format_demo(records))
    worst = max(r["output_err"] for r in records)
    if worst > 1e-8:
        print(f"error: forms disagree by {worst:.2e}", file=sys.stderr)
        return 1
    return 0


def _apply_launch(flag: str, path: str | None) -> None:
    """`--launch PATH`: a swept launch table (e.g. the best_launch.json of scripts/gpu_kernels.py) applied to the
    Triton kernels by `kernels.triton.common.util.load_launch` before a benchmark runs (the kernels read no environment
    variable); ValueError naming the flag when it cannot be read or names an unknown launch site or setting."""
    if path is None:
        return
    import importlib.util
    import json

    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{flag}: a launch table configures the Triton kernels, and triton is not installed")
    from .kernels.triton.common import util

    try:
        util.load_launch(path)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None
    except KeyError as e:
        raise ValueError(f"{flag} {path}: {e.args[0]}") from None
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{flag} {path}: expected {{launch site: {{setting: integer}}}} ({e})") from None


def _bench_speed(args):
    from . import cliargs
    from .bench.speed import check_args, run_speed

    try:
        check_args(models=args.models, forms=args.forms, lengths=args.lengths, B=args.batch, H=args.heads,
                   D=args.dim, dtype=args.dtype, device=args.device, chunk_size=args.chunk_size,
                   repeats=args.repeats, warmup=args.warmup, threads=args.threads, value_heads=args.value_heads)
        _apply_launch("--launch", args.launch)
        cliargs.writable_dir("--out", args.out)
    except ValueError as e:
        return _fail(e)
    with _pinned_precision(args.precision):
        rows = run_speed(models=args.models, forms=args.forms, lengths=args.lengths, B=args.batch, H=args.heads,
                         D=args.dim, dtype=args.dtype, device=args.device, out_dir=args.out, peers=not args.no_peers,
                         chunk_size=args.chunk_size, backward=not args.forward_only, repeats=args.repeats,
                         warmup=args.warmup, threads=args.threads, value_heads=args.value_heads)
    failed = [f"{r.model} {r.form} T={r.T}: {r.error}" for r in rows if r.error and r.impl == "fastweights"]
    return _failed_rows(failed, len([r for r in rows if r.impl == "fastweights"]), args.keep_going)


def _failed_rows(failed: list[str], total: int, keep_going: bool) -> int:
    """Exit status of a benchmark whose rows record their own errors: 1 when a row of ours failed
    (a peer's failure is the peer's result), unless --keep-going."""
    if not failed or keep_going:
        return 0
    print(f"error: {len(failed)} of {total} rows failed (the table keeps their errors); first: {failed[0]}. "
          "Pass --keep-going to exit 0 anyway", file=sys.stderr)
    return 1


def _bench_decode(args):
    from . import cliargs
    from .bench.decode import run_decode

    try:
        cliargs.zoo_names("--models", args.models)
        cliargs.device("--device", args.device)
        cfg = _decode_config(args)
        cliargs.writable_dir("--out", args.out)
    except ValueError as e:
        return _fail(cliargs.flag_message(e, _DECODE_FIELDS))
    run_decode(cfg)
    return 0


def _bench_floors(args):
    from . import cliargs
    from .bench.floors import run_floors
    from .inputs import InputError

    try:
        if args.models:
            cliargs.zoo_names("--models", args.models)
        if args.count_len is not None and args.count_len < 1:
            raise ValueError(f"--count-len must be a positive int (tokens), got {args.count_len}")
        if args.out:
            cliargs.writable_dir("--out", args.out)
    except ValueError as e:
        return _fail(e)
    try:
        if args.newton_schulz:
            from pathlib import Path

            from .bench.floors import SHAPES, newton_schulz_table

            text = newton_schulz_table(tuple(args.models or ["atlas"]), tuple(args.shapes or SHAPES))
            print(text)
            if args.out:
                (Path(args.out) / "newton_schulz.md").write_text(text + "\n")
            return 0
        run_floors(args.models, args.shapes, out_dir=args.out, count_len=args.count_len)
    except InputError as e:
        return _fail(e)
    return 0


def _bench_train(args):
    from . import cliargs
    from .bench.train import check_args, run_train

    kw = dict(models=args.models, d_model=args.d_model, n_layers=args.n_layers, num_heads=args.num_heads,
              head_dim=args.head_dim, vocab_size=args.vocab_size, shapes=args.shapes, batch=args.batch,
              lengths=args.lengths,
              steps=args.steps, warmup=args.warmup, device=args.device, dtype=args.dtype,
              threads=args.threads or None, backend=args.backend, layer_ops=args.layer_ops, build=args.build,
              grad_checkpoint=args.grad_checkpoint, cuda_graph=args.cuda_graph, same_params=args.same_params,
              head_v_dim=args.head_v_dim)
    try:
        check_args(**kw)
        _apply_launch("--launch", args.launch)
        cliargs.writable_dir("--out", args.out)
    except ValueError as e:
        return _fail(e)
    with _pinned_precision(args.precision):
        rows = run_train(**kw, out_dir=args.out, profile=args.profile)
    failed = [f"{r.model} {r.B}×{r.T}: {r.error}" for r in rows if r.error]
    return _failed_rows(failed, len(rows), args.keep_going)


_DECODE_FIELDS = ("models", "contexts", "d_model", "n_layers", "num_heads", "head_dim", "vocab_size", "batch_size",
                  "new_tokens", "repeats", "threads", "warmup", "prefill_chunk", "device", "dtype", "seed",
                  "cuda_graph")


def _decode_config(args):
    from .bench.decode import DecodeBenchConfig

    return DecodeBenchConfig(models=tuple(args.models), contexts=tuple(args.contexts), d_model=args.d_model,
                             n_layers=args.n_layers, num_heads=args.num_heads, head_dim=args.head_dim,
                             vocab_size=args.vocab_size, batch_size=args.batch_size, new_tokens=args.new_tokens,
                             repeats=args.repeats, threads=args.threads, warmup=args.warmup,
                             prefill_chunk=args.prefill_chunk, device=args.device, dtype=args.dtype, seed=args.seed,
                             out=args.out, plot=not args.no_plot, cuda_graph=args.cuda_graph)


def _capacity(args):
    from .lab.capacity import cli_main

    return cli_main(args)


_KEEP_GOING = ("exit 0 even when some rows failed (their errors stay in the table); by default a failed row "
               "makes the exit status 1")
_LAUNCH = ("a launch table for the Triton kernels (JSON {launch site: {setting: int}}, e.g. the best_launch.json of "
           "scripts/gpu_kernels.py --stages sweep-kernels), applied before the rows run (default: the shipped one)")
_PRECISION = ("tl.dot's input precision of the generic Triton row's kernels (TTT-Linear, TTT-MLP, Newton–Schulz): "
              "ieee (fp32 FMAs), tf32x3 (three TF32 tensor-core products, about fp32's accuracy) or tf32 (~1e-3); "
              "default: each kernel's own (kernels.rows.PRECISIONS)")


def _pinned_precision(precision: str | None):
    """`--precision`: the generic row pinned at it for the run (`kernels.rows.pinned`), or nothing pinned."""
    import contextlib

    if precision is None:
        return contextlib.nullcontext()
    from .kernels import rows

    return rows.pinned("generic", precision=precision)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .cliargs import Parser
    from .kernels.triton.common.limits import DOT_PRECISIONS  # (imports no triton)

    p = Parser(prog="fastweights", description=__doc__)
    p.add_argument("--version", action="version", version=f"fastweights {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    z = sub.add_parser("zoo", help="the four-axis table of every zoo model")
    z.add_argument("--json", action="store_true", help="print a JSON list (name, axes, citation)")
    z.set_defaults(fn=_zoo)
    d = sub.add_parser("demo", help="run every zoo model in every form and print how closely they agree")
    d.add_argument("--seq-len", type=int, default=37)
    d.add_argument("--seed", type=int, default=None, help="fixed seed (default: fresh inputs each run)")
    d.add_argument("--models", nargs="*", default=None, help="zoo names (default: all)")
    d.set_defaults(fn=_demo)
    bench = sub.add_parser("bench", help="benchmarks (scripts that time; not tests)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    sp = bsub.add_parser("speed", help="forms × models × T, forward and forward+backward, with peers on CUDA")
    sp.add_argument("--models", nargs="+", default=["gated_deltanet", "deltanet", "gla", "kda", "retnet"])
    sp.add_argument("--forms", nargs="+", default=["recurrent", "chunk"],
                    help="recurrent parallel chunk chunk_compile (torch.compile'd chunk core) chunk_triton "
                         "(the Triton kernels, CUDA); recurrent is timed first, the speed-up columns divide by it")
    sp.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    sp.add_argument("--repeats", type=int, default=5, help="timed calls per row (the median is reported)")
    sp.add_argument("--warmup", type=int, default=1, help="untimed calls before them")
    sp.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: a pool that shares its cores with other work stalls; "
                         "0 keeps torch's default)")
    sp.add_argument("--batch", type=int, default=1)
    sp.add_argument("--heads", type=int, default=4)
    sp.add_argument("--value-heads", type=int, default=None,
                    help="grouped rows: v, the gates and the output with this many heads (a multiple of --heads; "
                         "q and k keep --heads)")
    sp.add_argument("--dim", type=int, default=64)
    sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--chunk-size", type=int, default=64)
    sp.add_argument("--no-peers", action="store_true", help="skip torch SDPA and fla")
    sp.add_argument("--forward-only", action="store_true")
    sp.add_argument("--out", default="runs/speed")
    sp.add_argument("--keep-going", action="store_true", help=_KEEP_GOING)
    sp.add_argument("--launch", default=None, metavar="PATH", help=_LAUNCH)
    sp.add_argument("--precision", default=None, choices=DOT_PRECISIONS, help=_PRECISION)
    sp.set_defaults(fn=_bench_speed)
    dc = bsub.add_parser("decode", help="decode tokens/s and state memory vs context: a linear LM against softmax")
    dc.add_argument("--models", nargs="+", default=["gated_deltanet", "softmax_attention"])
    dc.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096, 16384, 32768])
    dc.add_argument("--d-model", type=int, default=256)
    dc.add_argument("--n-layers", type=int, default=2)
    dc.add_argument("--num-heads", type=int, default=4)
    dc.add_argument("--head-dim", type=int, default=64)
    dc.add_argument("--vocab-size", type=int, default=1024)
    dc.add_argument("--batch-size", type=int, default=1)
    dc.add_argument("--new-tokens", type=int, default=32, help="timed decoding steps per row")
    dc.add_argument("--repeats", type=int, default=3, help="timed rounds; the least disturbed one is reported")
    dc.add_argument("--threads", type=int, default=1, help="torch CPU threads while measuring")
    dc.add_argument("--warmup", type=int, default=4)
    dc.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill call")
    dc.add_argument("--device", default="cpu")
    dc.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    dc.add_argument("--seed", type=int, default=0)
    dc.add_argument("--out", default="runs/bench/decode")
    dc.add_argument("--no-plot", action="store_true")
    dc.add_argument("--cuda-graph", action="store_true",
                    help="CUDA: also time each model that can decode through a CUDA graph that way (rows '+graph')")
    dc.set_defaults(fn=_bench_decode)
    fl = bsub.add_parser("floors", help="counted FLOPs and unavoidable bytes of one chunk-form step of each deep "
                                        "memory (and gated DeltaNet) at issue 36's shapes: the floors, no GPU needed")
    fl.add_argument("--models", nargs="+", default=None,
                    help="zoo names (default: the deep memories and gated DeltaNet)")
    fl.add_argument("--shapes", nargs="+", default=None, choices=["small", "lm"],
                    help="small: B 64, T 512, H 2, D 64; lm: B 4, T 4096, H 16, D 128 (default both)")
    fl.add_argument("--count-len", type=int, default=None,
                    help="count at this many tokens and scale linearly to T (default: count at T)")
    fl.add_argument("--out", default=None, help="also write floors.md and floors.json here")
    fl.add_argument("--newton-schulz", action="store_true",
                    help="instead: Muon's Newton–Schulz iterations of a step (calls and FLOPs by Gram side; "
                         "default model atlas), newton_schulz.md under --out")
    fl.set_defaults(fn=_bench_floors)
    tr = bsub.add_parser("train", help="one LM optimizer step (forward, backward, AdamW): tokens/s and peak memory "
                                       "against the softmax transformer of the same shape")
    tr.add_argument("--models", nargs="+", default=["gated_deltanet", "softmax_attention"])
    tr.add_argument("--d-model", type=int, default=256)
    tr.add_argument("--n-layers", type=int, default=2)
    tr.add_argument("--num-heads", type=int, default=4)
    tr.add_argument("--head-dim", type=int, default=64)
    tr.add_argument("--head-v-dim", type=int, default=None,
                    help="the fast-weight mixers' value head dim (default: each mixer's own, e.g. 2×head_dim for "
                         "gated_deltanet; the gpu-125m preset sets 128); softmax_attention keeps head_dim")
    tr.add_argument("--vocab-size", type=int, default=1024)
    tr.add_argument("--batch", type=int, default=None,
                    help="sequences per step, with every --lengths entry (default 1)")
    tr.add_argument("--lengths", nargs="+", type=int, default=None, help="sequence lengths T (default 512 2048)")
    tr.add_argument("--shapes", nargs="+", default=None,
                    help="B,T pairs instead of --batch/--lengths, e.g. --shapes 4,4096 4,8192 1,32768")
    tr.add_argument("--steps", type=int, default=5, help="timed steps per row (the median is reported)")
    tr.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    tr.add_argument("--device", default="cpu")
    tr.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="bfloat16: autocast over fp32 weights and optimizer state")
    tr.add_argument("--backend", default="auto",
                    help="the fast-weight mixers' training-form backend (auto, torch, compile, triton); "
                         "softmax_attention keeps auto")
    tr.add_argument("--layer-ops", default="auto", choices=["auto", "torch", "triton"],
                    help="the layer ops' backend (short convs, norms, the delta prologue): auto (their Triton "
                         "kernels on CUDA), torch (their PyTorch ops everywhere: the A/B of those kernels), triton")
    tr.add_argument("--build", nargs="+", default=["device"], choices=["device", "moved", "from_pretrained"],
                    help="how each LM is made: built under torch.device(--device), built on the CPU then moved, "
                         "or saved and loaded by LM.from_pretrained then moved (several: a row each)")
    tr.add_argument("--grad-checkpoint", nargs="?", const="both", default="off", choices=["off", "on", "both"],
                    help="gradient checkpointing per block in the step (as `fastweights train --grad-checkpoint`): off "
                         "(default), on (every row), or both (each model's plain row and its '+ grad ckpt' row, with "
                         "the peak memory and tokens/s against the plain one; the bare flag means both)")
    tr.add_argument("--cuda-graph", action="store_true",
                    help="every row's step captured once in a CUDA graph and replayed (fastweights.training."
                         "GraphedLMStep; CUDA only): the step without the host's launch time")
    tr.add_argument("--same-params", action="store_true",
                    help="also a softmax_attention row per other model with its MLP widened to that model's parameter "
                         "count (within 3%%), and each row's ratios against it beside the same-shape ones")
    tr.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: a pool that shares its cores with other work stalls; "
                         "0 keeps torch's default)")
    tr.add_argument("--out", default="runs/bench/train")
    tr.add_argument("--profile", action="store_true",
                    help="after each row's timed steps, one more eager step under torch.profiler: where its time went "
                         "(CUDA: kernels, then ATen ops by shape; CPU: ops), written to profile/<row>.txt under --out "
                         "(not for --cuda-graph rows)")
    tr.add_argument("--keep-going", action="store_true", help=_KEEP_GOING)
    tr.add_argument("--launch", default=None, metavar="PATH", help=_LAUNCH)
    tr.add_argument("--precision", default=None, choices=DOT_PRECISIONS, help=_PRECISION)
    tr.set_defaults(fn=_bench_train)
    cp = sub.add_parser("capacity", help="training-free capacity probe: recall vs n/d_k per memory (table, PNG, JSON)")
    cp.add_argument("--d-k", type=int, default=64, help="key (= value) dimension")
    cp.add_argument("--settings", nargs="+", default=None, help="random skewed update stream (default: all)")
    cp.add_argument("--models", nargs="+", default=None, help="memory labels (default: all; see docs/capacity.md)")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--trials", type=int, default=4, help="independent draws averaged (the batch dimension)")
    cp.add_argument("--form", default="fast", choices=["fast", "recurrent", "chunk", "parallel"],
                    help="fast: per memory the quickest exact write (chunk/parallel forms, a state-only "
                         "recurrence); recurrent: fastweights.recurrent token by token (the reference); "
                         "chunk/parallel: that form where one exists")
    cp.add_argument("--out", default="runs/capacity", help="directory for capacity.png")
    cp.add_argument("--json", default=None, help="also write the records as a JSON list to this path")
    cp.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the probe's ops are tiny; 0 keeps torch's default)")
    cp.set_defaults(fn=_capacity)
    ev = sub.add_parser("eval", help="lm-evaluation-harness with the 'fastweights' model registered (extra: eval); "
                                     "every argument goes to lm_eval", add_help=False)
    ev.add_argument("lm_eval_args", nargs=argparse.REMAINDER)  # handled by main() before parsing
    from .pretrain.cli import add_cli as add_train_cli

    add_train_cli(sub)
    from .convert.cli import add_cli as add_convert_cli

    add_convert_cli(sub)
    from .lab import mad, mqar, niah  # each adds its subcommand and sets fn to its cli_main

    for lab_module in (mqar, niah, mad):
        lab_module.add_cli(sub)
    return p


def _eval_model_args(args: list[str]) -> dict:
    """lm-eval's --model_args (-a) as one dict: `key=val,key2=val2` tokens or JSON objects, later
    values winning (as lm-eval merges them)."""
    values, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--model_args="):
            values.append(a.split("=", 1)[1])
        elif a in ("--model_args", "-a"):
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                values.append(args[i])
        i += 1
    found = {}
    for v in values:
        try:
            obj = json.loads(v)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            found.update(obj)
            continue
        for item in v.split(","):
            k, eq, val = item.partition("=")
            if eq:
                found[k.strip()] = val
    return found


def _eval_option(args: list[str], *names: str) -> str | None:
    """The value of one of lm-eval's single-valued options (`--device cuda`, `--device=cuda`)."""
    value = None
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(tuple(n + "=" for n in names)):
            value = a.split("=", 1)[1]
    return value


def _check_eval_args(args: list[str]) -> None:
    """What `fastweights eval` checks before lm-eval starts (ArgError naming the argument): the
    checkpoint directory of a local `pretrained` (`cliargs.checkpoint_dir`), that the fastweights
    and hf models are given one, `dtype`, and --device."""
    from .cliargs import ArgError, checkpoint_dir, device

    # lm-eval's `run` command, named or implied (its other commands, `ls` and `validate`, load no model)
    if not (args[:1] == ["run"] or (len(args) > 1 and args[0] not in ("ls", "validate", "run"))):
        return
    model_args = _eval_model_args(args)
    pretrained = model_args.get("pretrained")
    model = _eval_option(args, "--model", "-M") or "hf"
    if pretrained is None and model in ("fastweights", "hf") and _eval_option(args, "--config", "-C") is None \
            and not {"-h", "--help"} & set(args):
        raise ArgError(f"--model_args: no pretrained=DIR; --model {model} needs the checkpoint directory (e.g. "
                       "--model_args pretrained=runs/lm/model)")
    if isinstance(pretrained, str):
        checkpoint_dir("--model_args pretrained=", pretrained)
    dtype = model_args.get("dtype")
    if dtype is not None and dtype != "auto":
        import torch

        named = getattr(torch, str(dtype), None)
        if not (isinstance(named, torch.dtype) and named.is_floating_point):
            raise ArgError(f"--model_args dtype={dtype}: expected auto or a floating torch dtype (float32, bfloat16, "
                           "float16, float64)")
    if model == "fastweights":
        backend = model_args.get("backend")
        if backend is not None and backend != "causal":  # (the harness passes lm-eval backend="causal" itself)
            raise ArgError(f"--model_args backend={backend}: the fastweights model is a causal LM (lm-eval's backend "
                           "'causal', the only one it takes); the kernels' backend is routed per call (auto)")
        if "device" in model_args:  # (lm-eval passes --device as the model's device: both gave a TypeError)
            raise ArgError(f"--model_args device={model_args['device']}: give the device once, as --device "
                           f"{model_args['device']}")
    device("--device", _eval_option(args, "--device"))


def _lm_eval_error(e: Exception) -> str:
    """One line for an error lm-eval raised (the first line of its message, with the argument it is about)."""
    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, ValueError) and msg.startswith("Tasks not found:"):
        return (f"--tasks: lm-eval knows no task {msg.split(':', 1)[1].strip()} (`lm-eval ls tasks` lists them; "
                "--include_path DIR adds your own task YAMLs)")
    return f"lm-eval stopped: {type(e).__name__}: {msg}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # every further argument is lm-eval's (argparse cannot pass `--x` through)
        from .cliargs import ArgError

        try:
            _check_eval_args(argv[1:])
        except ArgError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from .hf.harness import main as harness_main

        try:
            harness_main(argv[1:])
        except Exception as e:  # (lm-eval's own errors: one line, never a traceback)
            print(f"error: {_lm_eval_error(e)}", file=sys.stderr)
            return 2
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:  # (the sweeps stop by themselves on Ctrl-C and say how to resume)
        print(f"interrupted: fastweights {args.command} stopped on Ctrl-C", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
