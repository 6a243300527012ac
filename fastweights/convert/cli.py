"""`fastweights convert`: checkpoints in and out of fastweights.

    fastweights convert from-fla SRC DST   an fla checkpoint directory (fla's save_pretrained: config.json and
                                           model.safetensors) -> a fastweights checkpoint (LM.from_pretrained,
                                           transformers' AutoModelForCausalLM)
    fastweights convert to-fla SRC DST     a fastweights checkpoint -> an fla checkpoint directory (fla's
                                           AutoModelForCausalLM)
    fastweights convert to-transformers SRC DST
                                           a fastweights Mamba2 LM -> a checkpoint of transformers' own
                                           Mamba2ForCausalLM (no fla or fastweights needed to load it)

from-fla also reads transformers' own Mamba2 checkpoints (the same model_type and weight names as
fla's Mamba2; their config fields are told apart and read by transformers' names and defaults).

Exact or refused: a model fla and fastweights do not share prints one line naming what differs
(exit status 2); see `fastweights.convert.fla` for the models and docs/hf.md for a worked example.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_cli(sub) -> None:
    import argparse

    c = sub.add_parser("convert", help="convert checkpoints to and from flash-linear-attention (fla) and "
                       "transformers' Mamba2", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # (the doc's columns kept)
    c.add_argument("direction", choices=["from-fla", "to-fla", "to-transformers"],
                   help="from-fla: fla (or transformers Mamba2) checkpoint -> fastweights; to-fla: fastweights "
                        "checkpoint -> fla; to-transformers: fastweights Mamba2 checkpoint -> transformers' "
                        "Mamba2ForCausalLM")
    c.add_argument("src", help="the checkpoint directory to read")
    c.add_argument("dst", help="the directory to write (created; an existing checkpoint there needs --overwrite)")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    c.set_defaults(fn=cli_main)


def _layers(cfg) -> str:
    names = [m if isinstance(m, str) else m.name for m in cfg.layer_mixers]
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def cli_main(args) -> int:
    from .. import cliargs
    from .common import ConversionError
    from .fla import checkpoint_kind, convert_from_fla, convert_to_fla, convert_to_transformers

    src, dst = Path(args.src), Path(args.dst)
    try:
        for flag, value in (("SRC", args.src), ("DST", args.dst)):
            if not value.strip():  # (Path("") is the current directory)
                raise cliargs.ArgError(f"{flag} is empty; expected a checkpoint directory")
        if not src.is_dir():
            raise cliargs.ArgError(f"SRC {src}: no such checkpoint directory")
        if src.resolve() == dst.resolve():
            raise cliargs.ArgError(f"DST {dst}: is SRC {src}; the conversion would write over its source, give "
                                   "another directory")
        if (dst / "config.json").exists() and not args.overwrite:
            raise cliargs.ArgError(f"DST {dst}: holds a checkpoint already (pass --overwrite to replace it)")
        cliargs.writable_dir("DST", dst)
        if args.direction == "from-fla":
            cfg = convert_from_fla(src, dst)
            head = "tied" if cfg.tie_word_embeddings else "untied"
            kind = checkpoint_kind(json.loads((src / "config.json").read_text(encoding="utf-8")))
            print(f"converted the {kind} checkpoint {src} -> fastweights {dst}: {cfg.n_layers} layers "
                  f"({_layers(cfg)}), d_model {cfg.d_model}, vocab {cfg.vocab_size}, {head} head")
        elif args.direction == "to-transformers":
            c = convert_to_transformers(src, dst)
            print(f"converted the fastweights checkpoint {src} -> transformers Mamba2ForCausalLM {dst}: "
                  f"{c['num_hidden_layers']} layers, {c['num_heads']} heads, "
                  f"{'tied' if c['tie_word_embeddings'] else 'untied'} head")
        else:
            c = convert_to_fla(src, dst)
            attn = f" (attn layers {c['attn']['layers']})" if "attn" in c else ""
            print(f"converted the fastweights checkpoint {src} -> fla {c['model_type']} {dst}: "
                  f"{c['num_hidden_layers']} layers{attn}, {'tied' if c['tie_word_embeddings'] else 'untied'} head")
    except (ConversionError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
