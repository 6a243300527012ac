"""`fastweights train`: the command line of `fastweights.pretrain` (settings: preset < --config
file < flags; `--model key=value` sets one LMConfig field, the value read as JSON when it parses)."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_cli", "cli_main", "config_from_args"]

_FLAGS = [  # (flag, type, help)
    ("out", str, "run directory (checkpoint.pt, model/, log.jsonl, loss.png); an existing run resumes"),
    ("tokenizer", str, "'bytes' (default) or a local Hugging Face tokenizer directory"),
    ("preset", str, "cpu (default: minutes on a CPU) or gpu-125m"),
    ("steps", int, "optimizer steps"),
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
    ("threads", int, "torch CPU threads"),
    ("progress", str, "auto, tqdm, plain or none"),
]


def add_cli(sub) -> None:
    t = sub.add_parser("train", help="pretrain a language model on your own text (or token files)",
                       description=__doc__)
    t.add_argument("--data", nargs="+", default=None,
                   help="text files or directories (UTF-8), .npy or .bin token files")
    t.add_argument("--config", default=None, help="a JSON or TOML file of settings")
    t.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="an LMConfig field, e.g. --model d_model=256 --model 'mixer=[\"gated_deltanet\"]'")
    for name, typ, help_ in _FLAGS:
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    t.set_defaults(fn=cli_main)


def config_from_args(args):
    from .config import ConfigFileError, PretrainConfig, load_config_file

    layers = []
    if args.config:
        layers.append(load_config_file(args.config))
    flags = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
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


def cli_main(args) -> int:
    from ..inputs import InputError
    from ..models import ConfigError
    from .config import ConfigFileError
    from .data import DataError
    from .loop import train

    try:
        cfg = config_from_args(args)
        if not cfg.data:
            raise ConfigFileError("data: give --data (text files, directories, .npy or .bin) or 'data' in --config")
        summary = train(cfg)
    except (ConfigFileError, DataError, ConfigError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ..training.distributed import dist_info

    if dist_info().is_main:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="fastweights")
    add_cli(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["train", *sys.argv[1:]])
    sys.exit(a.fn(a))
