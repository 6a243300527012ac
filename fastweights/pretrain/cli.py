"""`fastweights train`: the command line of `fastweights.pretrain` (settings: preset < --config
file < flags; `--model key=value` sets one LMConfig field, the value read as JSON when it parses).

Exit status: 0 done; 2 a bad setting, data file or --out (one line, before any training); 1 the run
directory could not be written mid-run (the last good checkpoint is kept and named); 130 stopped
by SIGINT/SIGTERM after saving a checkpoint at the step boundary (one line saying how to resume).
--fresh discards what an earlier run left in --out instead of resuming it. An existing run given a
larger --steps goes on to that step (the learning rate follows the new number of steps' schedule).
--init-from DIR starts a new run from a saved model's weights."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_cli", "cli_main", "config_from_args"]

_FLAGS = [  # (flag, type, help)
    ("out", str, "run directory (checkpoint.pt, model/, log.jsonl, loss.png): new, empty or an earlier run's, which "
                 "resumes (with a larger --steps it goes on to them); never the current directory, a directory "
                 "holding anything else (a saved model, a repository) or the --init-from directory"),
    ("tokenizer", str, "'bytes' (default) or a local Hugging Face tokenizer directory"),
    ("preset", str, "cpu (default: minutes on a CPU) or gpu-125m"),
    ("steps", int, "optimizer steps (raised on an existing run: it trains on to the new number, the learning "
                   "rate following the new schedule)"),
    ("batch_size", int, "sequences per optimizer step (all ranks together)"),
    ("seq_len", int, "tokens per sequence"),
    ("grad_accum", int, "micro-batches per step and rank"),
    ("lr", float, "peak learning rate"),
    ("min_lr", float, "the cosine's floor"),
    ("warmup", float, "warm-up: a fraction of the steps (< 1) or a number of steps"),
    ("weight_decay", float, "AdamW weight decay"),
    ("grad_clip", float, "max global gradient norm"),
    ("val_fraction", float, "held-out tail of the data"),
    ("val_every", int, "validation period (steps)"),
    ("val_batches", int, "validation batches"),
    ("save_every", int, "checkpoint period (steps)"),
    ("log_every", int, "log period (steps)"),
    ("seed", int, "model init and data order"),
    ("dtype", str, "float32 or bfloat16 (autocast)"),
    ("device", str, "cpu or cuda"),
    ("parallel", str, "ddp or fsdp (FSDP2) under torchrun"),
    ("context_parallel", int, "split each sequence over N ranks (context parallelism; the world is N × the "
                              "data-parallel ranks)"),
    ("threads", int, "torch CPU threads"),
    ("progress", str, "auto, tqdm, plain or none"),
    ("init_from", str, "start a new run (step 0, fresh optimizer, its own --out) from the weights of a model "
                       "directory (save_pretrained, e.g. a run's out/model/) or a run directory; the model config "
                       "comes from there (--model may only repeat it)"),
    ("text_key", str, "the key of each line's text in .jsonl data (default: text)"),
]


def add_cli(sub) -> None:
    t = sub.add_parser("train", help="pretrain a language model on your own text (or token files)",
                       description=__doc__)
    t.add_argument("--data", nargs="+", default=None,
                   help="text files or directories (UTF-8), .jsonl files (one JSON object a line, its text under "
                        "--text-key), .npy or .bin token files")
    t.add_argument("--config", default=None, help="a JSON or TOML file of settings")
    t.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="an LMConfig field, e.g. --model d_model=256 --model 'mixer=[\"gated_deltanet\"]'")
    t.add_argument("--fresh", action="store_true",
                   help="discard the checkpoint, model, log and curve an earlier run left in --out and start "
                        "again (without it, a run resumes, and refuses other settings or other data)")
    t.add_argument("--grad-checkpoint", dest="grad_checkpoint", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient checkpointing per block: each block recomputes its activations in backward (less "
                        "activation memory, the same gradients, about one more forward per step); recorded in the "
                        "run, so a resume keeps it unless --no-grad-checkpoint")
    t.add_argument("--documents", default=None, metavar="{separate,joined}",
                   help="separate (default): every layer restarts at each document of a packed window; joined: the "
                        "window is one sequence, reading across end-of-text tokens (no varlen path)")
    t.add_argument("--cuda-graph", dest="cuda_graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each optimizer step from one CUDA graph (the step without the host's launch time; "
                        "one CUDA process, no --grad-checkpoint); --no-cuda-graph: always eager. Neither: the "
                        "preset's or --config's cuda_graph (gpu-125m: \"auto\", graphed where it can be: one CUDA "
                        "process, no --grad-checkpoint or --context-parallel; the run's log says which)")
    for name, typ, help_ in _FLAGS:
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    t.set_defaults(fn=cli_main)


def config_from_args(args):
    from .config import ConfigFileError, PretrainConfig, load_config_file

    layers = []
    if args.config:
        layers.append(load_config_file(args.config))
    flags = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    if getattr(args, "grad_checkpoint", None) is not None:
        flags["grad_checkpoint"] = args.grad_checkpoint
    for name in ("documents", "cuda_graph"):
        if getattr(args, name, None) is not None:
            flags[name] = getattr(args, name)
    if args.data is not None:
        flags["data"] = args.data
    model = {}
    for item in args.model:
        if "=" not in item:
            raise ConfigFileError(f"--model takes FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            model[k] = json.loads(v)
        except json.JSONDecodeError:
            model[k] = v
    if model:
        flags["model"] = model
    layers.append(flags)
    return PretrainConfig.build(*layers)


def check_device(args, cfg) -> None:
    """The run's device is usable here; the error names where it came from (--device, the --config
    file, or the preset)."""
    from ..cliargs import ArgError, device, preset_device
    from .config import PRESETS, ConfigFileError, load_config_file

    file_sets = bool(args.config) and "device" in load_config_file(args.config)
    try:
        if args.device is None and not file_sets and cfg.device == PRESETS[cfg.preset].get("device"):
            preset_device(cfg.preset, cfg.device, None)
        else:
            device("--device" if args.device is not None or not file_sets else f"device (in --config {args.config})",
                   cfg.device)
    except ArgError as e:
        raise ConfigFileError(str(e)) from None


def cli_main(args) -> int:
    from ..inputs import InputError
    from ..models import ConfigError
    from ..training.control import Interrupted
    from ..training.distributed import dist_info
    from .config import ConfigFileError
    from .data import DataError, check_tokenizer
    from .loop import init_sources, train
    from .rundir import OutputError, check_out_path

    try:
        cfg = config_from_args(args)
        check_device(args, cfg)
        check_out_path(cfg.out, init_sources(cfg.init_from))
        check_tokenizer(cfg.tokenizer)
        if not cfg.data:
            raise ConfigFileError("data: give --data (text files, directories, .npy or .bin) or 'data' in --config")
        summary = train(cfg, fresh=args.fresh)
    except (ConfigFileError, DataError, ConfigError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        if dist_info().is_main:  # (one line, whatever the number of ranks; every rank exits 130)
            print(e, file=sys.stderr, flush=True)
        return 130
    if dist_info().is_main:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="fastweights")
    add_cli(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["train", *sys.argv[1:]])
    sys.exit(a.fn(a))
