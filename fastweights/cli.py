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


def _demo(args):
    from .demo import format_demo, run_demo

    records = run_demo(seq_len=args.seq_len, seed=args.seed, names=args.models)
    print(format_demo(records))
    worst = max(r["output_err"] for r in records)
    if worst > 1e-8:
        print(f"error: forms disagree by {worst:.2e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastweights", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    z = sub.add_parser("zoo", help="the four-axis table of every zoo model")
    z.add_argument("--json", action="store_true", help="print a JSON list (name, axes, citation)")
    z.set_defaults(fn=_zoo)
    d = sub.add_parser("demo", help="run every zoo model in every form and print how closely they agree")
    d.add_argument("--seq-len", type=int, default=37)
    d.add_argument("--seed", type=int, default=None, help="fixed seed (default: fresh inputs each run)")
    d.add_argument("--models", nargs="*", default=None, help="zoo names (default: all)")
    d.set_defaults(fn=_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
