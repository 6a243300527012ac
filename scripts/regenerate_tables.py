"""Regenerate the published result tables from the committed result records.

    python3 scripts/regenerate_tables.py            # rewrite every table (and the MQAR plots) in place
    python3 scripts/regenerate_tables.py --check    # change nothing; exit 1 naming each table that differs

Records (each the `results.jsonl` a run wrote, committed as it came):

    docs/results/mqar_quick.jsonl       fastweights mqar --preset quick
    docs/results/capacity.json          fastweights capacity --json PATH (the default probe)
    docs/results/mqar_quick_e40.jsonl   fastweights mqar --preset quick --epochs 40
    docs/results/mqar_ceilings_tiny.jsonl   fastweights mqar --preset ceilings-tiny (the CPU check of the
                                        ceilings reading; the GPU run goes beside it as mqar_ceilings.jsonl)
    docs/results/mqar_ceilings_pilot.jsonl  fastweights mqar --preset ceilings-pilot --device cuda (the lr
                                        pilot of the ceilings, H100, resumable: grows as sessions add cells)
    docs/results/mqar_ceilings.jsonl        fastweights mqar --preset ceilings --device cuda (the sweep,
                                        resumable across machines; bash scripts/gpu_ceilings.sh)
    docs/results/mqar_ceilings_checks.jsonl fastweights mqar --preset ceilings --device cuda --lrs/--seed ...
                                        (cells of the same grid trained again at another lr or seed:
                                        STAGE=atlas / STAGE=checks of scripts/gpu_ceilings.sh)

Each published table sits in its Markdown file between two marker lines,
`<!-- table:NAME -->` and `<!-- /table:NAME -->`; everything between them is what `render(NAME)`
returns, nothing else. tests/test_published_tables.py checks that every table equals its
rendering, so a table cannot drift from its records silently: to publish a new run, replace
the records and run this script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

#: record files, by run
RUNS = {
    "mqar_quick": RESULTS / "mqar_quick.jsonl",
    "capacity": RESULTS / "capacity.json",
    "mqar_quick_e40": RESULTS / "mqar_quick_e40.jsonl",
    "mqar_ceilings_tiny": RESULTS / "mqar_ceilings_tiny.jsonl",
    "mqar_ceilings_pilot": RESULTS / "mqar_ceilings_pilot.jsonl",
    "mqar_ceilings": RESULTS / "mqar_ceilings.jsonl",
    "mqar_ceilings_checks": RESULTS / "mqar_ceilings_checks.jsonl",
    # the best run of every cell of the grid, the sweep's or a check's (the checks' off-grid cells left out)
    "mqar_ceilings_all": (RESULTS / "mqar_ceilings.jsonl", RESULTS / "mqar_ceilings_checks.jsonl"),
}

#: table name -> (run, style, files that publish it)
TABLES = {
    "mqar_quick_text": ("mqar_quick", "text", ("docs/mqar.md",)),
    "mqar_quick_md": ("mqar_quick", "markdown_state", ("BENCHMARKS.md",)),
    "mqar_e40_text": ("mqar_quick_e40", "text", ("docs/mqar.md",)),
    "mqar_e40_md": ("mqar_quick_e40", "markdown_ranked", ("BENCHMARKS.md",)),
    "capacity_text": ("capacity", "capacity_text", ("docs/capacity.md",)),
    "capacity_cells": ("capacity", "capacity_cells", ("README.md",)),
    "ceilings_tiny_text": ("mqar_ceilings_tiny", "text", ("docs/mqar.md",)),
    "ceilings_tiny_reading": ("mqar_ceilings_tiny", "ceilings", ("docs/mqar.md", "BENCHMARKS.md")),
    "ceilings_tiny_axes": ("mqar_ceilings_tiny", "four_axis", ("docs/mqar.md",)),
    "ceilings_pilot": ("mqar_ceilings_pilot", "pilot", ("docs/mqar.md",)),
    "ceilings_gpu": ("mqar_ceilings", "ceilings_grid", ("docs/mqar.md", "BENCHMARKS.md")),
    "ceilings_gpu_costs": ("mqar_ceilings", "costs", ("docs/mqar.md",)),
    "ceilings_gpu_checks": ("mqar_ceilings_checks", "checks", ("docs/mqar.md",)),
    "ceilings_gpu_best": ("mqar_ceilings_all", "ceilings_grid", ("docs/mqar.md",)),
    "ceilings_gpu_axes": ("mqar_ceilings", "four_axis_grid", ("docs/mqar.md",)),
    "ceilings_gpu_axes_best": ("mqar_ceilings_all", "four_axis_grid", ("docs/mqar.md",)),
}

#: the PNGs `plot_mqar` (and, for a ceilings run, `ceilings.plot_ceilings`) draws from each run, and where
#: they are published
PLOTS = {
    "mqar_quick": {"mqar_d_model.png": "docs/img/mqar_quick_d_model.png",
                   "mqar_state.png": "docs/img/mqar_quick_state.png"},
    "mqar_quick_e40": {"mqar_d_model.png": "docs/img/mqar_e40_d_model.png",
                       "mqar_state.png": "docs/img/mqar_e40_state.png"},
    "mqar_ceilings_tiny": {"ceilings_accuracy.png": "docs/img/mqar_ceilings_tiny_accuracy.png",
                           "ceilings_frontier.png": "docs/img/mqar_ceilings_tiny_frontier.png"},
    "mqar_ceilings": {"ceilings_accuracy.png": "docs/img/mqar_ceilings_accuracy.png",
                      "ceilings_frontier.png": "docs/img/mqar_ceilings_frontier.png"},
    "mqar_ceilings_all": {"ceilings_accuracy.png": "docs/img/mqar_ceilings_best_accuracy.png",
                          "ceilings_frontier.png": "docs/img/mqar_ceilings_best_frontier.png"},
}


#: README's selected cells of the capacity table: (label, description) rows; (setting, n / d_k) columns
CAPACITY_ROWS = [("linear", "S += k vᵀ"), ("delta", "β = 1"), ("mesa", "exact least squares"),
                 ("linear_decay", "γ = 0.97"), ("delta_decay", "γ = 0.97"),
                 ("linear_poly2", "1 + x·y + (x·y)²"), ("linear_poly2h", "(x·y)² only"),
                 ("delta_poly2h", "(x·y)² only")]
CAPACITY_COLS = [("random", 1.0, "random n=d_k"), ("random", 2.0, "random n=2d_k"), ("random", 8.0, "random n=8d_k"),
                 ("skewed", 0.5, "skewed n=d_k/2"), ("update", 0.5, "update n=d_k/2"), ("update", 1.0, "update n=d_k"),
                 ("stream", 8.0, "stream (last 16 of 512)")]


def records(run: str) -> list[dict]:
    """The records of one run (a JSON list, or one JSON object per line); a run of several files: theirs together,
    on the ceilings grid."""
    path = RUNS[run]
    if isinstance(path, tuple):
        from fastweights.lab.ceilings import on_grid
        from fastweights.lab.mqar import CEILING_SETTINGS

        return on_grid([r for p in path for r in _read(p)], CEILING_SETTINGS)
    return _read(path)


def _read(path: Path) -> list[dict]:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _render_capacity(name: str, style: str, recs: list[dict]) -> str:
    import inspect

    from fastweights.lab import capacity

    if style == "capacity_text":  # what the default `fastweights capacity` prints (table and legend)
        defaults = inspect.signature(capacity.run_capacity).parameters
        d_k = recs[0]["d_k"]
        head = (f"capacity probe: d_k = d_v = {d_k}, {defaults['trials'].default} trials, seed "
                f"{defaults['seed'].default}; recall = share of reads whose nearest stored value (cosine) is their own")
        return ("```\n" + head + "\n\n" + capacity.format_table(recs) + "\nmemories:\n" + capacity.legend(d_k)
                + "```\n")
    acc = {(r["setting"], r["model"], r["n_pairs"] / r["d_k"]): r["accuracy"] for r in recs}
    head = "| memory |" + "".join(f" {c[2]} |" for c in CAPACITY_COLS)
    rule = "|---|" + "---:|" * len(CAPACITY_COLS)
    rows = [f"| `{m}` ({note}) |" + "".join(f" {acc[(s, m, ratio)]:.3f} |" for s, ratio, _ in CAPACITY_COLS)
            for m, note in CAPACITY_ROWS]
    return "\n".join([head, rule, *rows]) + "\n"


def _best(run: str) -> tuple[list[str], list[int], dict]:
    """Models (first-seen order), d_models and {(model, d_model): best-over-lr record}."""
    from fastweights.lab.train import best_over

    best = best_over(records(run), over=("lr",), fields=("model", "d_model", "setting"))
    models = list(dict.fromkeys(r["model"] for r in best))
    ds = sorted({r["d_model"] for r in best})
    return models, ds, {(r["model"], r["d_model"]): r for r in best}


def render(name: str) -> str:
    """The text between the markers of table `name` (ends with a newline)."""
    from fastweights.lab.mqar import format_bytes, format_table

    run, style, _ = TABLES[name]
    if style.startswith("capacity"):
        return _render_capacity(name, style, records(run))
    if style in ("ceilings", "ceilings_grid", "four_axis", "four_axis_grid", "pilot", "checks", "costs"):
        from fastweights.lab import ceilings

        if style == "pilot":
            from fastweights.lab.mqar import PRESETS

            return ceilings.format_pilot(records(run), PRESETS["ceilings"].lr_pick)

        if style == "ceilings":
            return ceilings.format_ceilings(records(run), records("capacity"))
        if style == "checks":
            return ceilings.format_checks(records("mqar_ceilings"), records(run))
        from fastweights.lab.mqar import CEILING_SETTINGS

        grid = [n for _, n in CEILING_SETTINGS]  # every grid column: cells skipped "–", open ceilings "≥"
        if style == "costs":
            return ceilings.format_costs(records(run), grid)
        if style == "ceilings_grid":
            return ceilings.format_ceilings(records(run), records("capacity"), grid=grid)
        return ceilings.format_four_axis(records(run), grid=grid if style == "four_axis_grid" else ())
    if style == "text":  # what `fastweights mqar` prints, in a code block
        return "```\n" + format_table(records(run)) + "```\n"
    models, ds, get = _best(run)
    if style == "markdown_state":  # accuracy and state bytes per d_model, the preset's model order
        head = "| model |" + "".join(f" d = {d} | state |" for d in ds)
        rule = "|---|" + "---:|---:|" * len(ds)
        rows = [f"| {m} |" + "".join(f" {get[(m, d)]['accuracy']:.3f} | {format_bytes(get[(m, d)]['state_bytes'])} |"
                                     for d in ds) for m in models]
    else:  # markdown_ranked: accuracy per d_model, best first at the smallest d_model
        models = sorted(models, key=lambda m: -get[(m, ds[0])]["accuracy"])
        head = "| model |" + "".join(f" d = {d} |" for d in ds)
        rule = "|---|" + "---:|" * len(ds)
        rows = [f"| {m} |" + "".join(f" {get[(m, d)]['accuracy']:.3f} |" for d in ds) for m in models]
    return "\n".join([head, rule, *rows]) + "\n"


def _span(text: str, name: str, path: str) -> tuple[int, int]:
    """(start, end) of the text between the markers of `name` in `text`."""
    open_m, close_m = f"<!-- table:{name} -->\n", f"<!-- /table:{name} -->"
    if text.count(open_m) != 1 or text.count(close_m) != 1:
        raise SystemExit(f"{path}: needs exactly one '{open_m.strip()}' line and one '{close_m}' line")
    start = text.index(open_m) + len(open_m)
    end = text.index(close_m)
    if end < start:
        raise SystemExit(f"{path}: '{close_m}' comes before '{open_m.strip()}'")
    return start, end


def published(name: str, path: str) -> str:
    """The text now between the markers of `name` in `path` (relative to the repository root)."""
    text = (ROOT / path).read_text()
    start, end = _span(text, name, path)
    return text[start:end]


def differences() -> list[str]:
    """'path: table' for every published table that differs from its rendering."""
    out = []
    for name, (_, _, paths) in TABLES.items():
        want = render(name)
        out += [f"{path}: {name}" for path in paths if published(name, path) != want]
    return out


def write() -> list[str]:
    """Rewrite every table in place and redraw the plots; returns what changed."""
    changed = []
    for name, (_, _, paths) in TABLES.items():
        want = render(name)
        for path in paths:
            text = (ROOT / path).read_text()
            start, end = _span(text, name, path)
            if text[start:end] != want:
                (ROOT / path).write_text(text[:start] + want + text[end:])
                changed.append(f"{path}: {name}")
    from fastweights.lab.ceilings import plot_ceilings
    from fastweights.lab.mqar import plot_mqar

    for run, pngs in PLOTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            plot_mqar(records(run), tmp)
            if any(src.startswith("ceilings_") for src in pngs):
                plot_ceilings(records(run), tmp)
            for src, dst in pngs.items():
                shutil.copyfile(Path(tmp) / src, ROOT / dst)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    args = ap.parse_args(argv)
    if args.check:
        diff = differences()
        for d in diff:
            print(f"differs from its records: {d}")
        return 1 if diff else 0
    for d in write():
        print(f"rewrote {d}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
