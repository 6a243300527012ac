"""The ceilings v2 protocol (issue 37): every MQAR cell read as the best of an lr grid × seeds, with a follow-up
that re-seeds the cells whose curve along kv dips, and the tables and plots of the seeds' claims.

A *cell* is (model, d_model, setting); its *runs* are the records of its lr × seed grid (`MQARCell.lr`,
`MQARCell.seed`), each a record of the sweep's results file like any other (`run_sweep`, `ResultStore`: a killed
sweep loses no finished run, and a re-run trains only what is missing). A cell's runs train together, stacked
(`stack.run_stacked_sweep`; `run_protocol(stack=False)`, `--no-stack`: one at a time), with the same records.

    summarize(records)    per cell: best (max over every complete run), median (the median over seeds at each lr,
                          the best lr's), the lr and seed of each, the lrs and seeds, the runs, the state bytes, and
                          the follow-up notes of its runs. A seed counts once it has a run at every lr of the cell
                          (a seed half-trained when a sweep was killed does not move a reading).
    dips(summaries)       the cells whose best accuracy lies below the next kv's by more than `tol` and below the
                          previous kv's by more than `tol` (the smallest kv: below the next one): a drop then a
                          rise, where capacity can only fall as kv grows at a fixed state.
    followup_cells(...)   the runs a round of the follow-up adds: `extra` more seeds at every lr of each dip cell,
                          while it has fewer than `cap` complete seeds; a dip cell at the cap is reported as capped.
    run_protocol(...)     round 0 (the grid), then follow-up rounds until no cell dips or every dip is capped. Every
                          follow-up run's record carries "followup": {"round", "reason", "seeds"}.

Reading: `format_table` (the main table: best / median per kv, the ceiling and kv at 0.5 of both, the state bytes,
the runs and the extensions), `plot_state` (Zoology's figure: accuracy against state bytes, one curve per kv),
`format_dk` (claim 1: kv at 0.5 against d_k with the log–log slope), `format_pairs` (claims 2, 3 and 4: a → b at each
d_k) and `format_equal_bytes` (claim 5: each MLP memory against the matrix memories' kv at 0.5 interpolated at its
state bytes). `CLAIMS` maps each of the issue's claims to the presets whose records it reads; `report(records,
out)` renders them all from one records file (the runs of the v2 presets' grids in it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .ceilings import ceiling, crossing, kv_of
from .train import TrainError

#: Differences of best accuracy below this are read as noise by the follow-up rule.
DIP_TOL = 0.05

CellId = tuple[str, int, str]


def cell_id(r) -> CellId:
    """(model, d_model, setting) of a record or an MQARCell."""
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k)
    return get("model"), int(get("d_model")), get("setting")


def _latest(records: Sequence[dict]) -> dict[CellId, dict[tuple[float, int], dict]]:
    """{cell: {(lr, seed): record}}, the last record of a run winning (a --fresh run supersedes)."""
    out: dict[CellId, dict[tuple[float, int], dict]] = {}
    for r in records:
        out.setdefault(cell_id(r), {})[(float(r["lr"]), int(r.get("seed", 0)))] = r
    return out


def summarize(records: Sequence[dict]) -> list[dict]:
    """One summary per cell (first-seen order): model, d_model, num_heads, head_dim, setting, L, kv, lrs, seeds
    (complete: a run at every lr), partial_seeds, runs, best, best_lr, best_seed, median, median_lr, state_bytes,
    extended (the distinct follow-up notes of its runs). best and median are None when no seed is complete."""
    out = []
    for cid, runs in _latest(records).items():
        lrs = sorted({lr for lr, _ in runs})
        seeds = sorted({s for _, s in runs})
        complete = [s for s in seeds if all((lr, s) in runs for lr in lrs)]
        any_rec = next(iter(runs.values()))
        row = {"model": cid[0], "d_model": cid[1], "setting": cid[2], "num_heads": int(any_rec.get("num_heads", 1)),
               "L": int(any_rec["test_segments"][0][0]), "kv": kv_of(any_rec), "lrs": lrs, "seeds": complete,
               "partial_seeds": [s for s in seeds if s not in complete], "runs": len(runs),
               "state_bytes": any_rec.get("state_bytes"), "best": None, "best_lr": None, "best_seed": None,
               "median": None, "median_lr": None}
        # the cell's K = V, or "preset" (each zoo preset's own head dims: not d_model / H for every mixer)
        row["head_dim"] = int(any_rec["head_dim"]) if any_rec.get("head_dim") is not None else "preset"
        notes = [r["followup"] for r in runs.values() if r.get("followup")]
        row["extended"] = [n for i, n in enumerate(notes) if n not in notes[:i]]
        if complete:
            best = max((runs[(lr, s)]["accuracy"], -lr, -s) for lr in lrs for s in complete)
            row.update(best=best[0], best_lr=-best[1], best_seed=-best[2])
            med = max((statistics.median(runs[(lr, s)]["accuracy"] for s in complete), -lr) for lr in lrs)
            row.update(median=med[0], median_lr=-med[1])
        out.append(row)
    return out


def curves_of(summaries: Sequence[dict]) -> dict[tuple[str, int], list[dict]]:
    """{(model, d_model): the complete summaries sorted by kv}."""
    out: dict[tuple[str, int], list[dict]] = {}
    for s in sorted(summaries, key=lambda s: s["kv"]):
        if s["best"] is not None:
            out.setdefault((s["model"], s["d_model"]), []).append(s)
    return out


def dips(summaries: Sequence[dict], tol: float = DIP_TOL) -> dict[CellId, str]:
    """{cell: why} for every cell whose best accuracy is below its next kv's by more than `tol` and below its
    previous kv's by more than `tol` (the first kv of a curve: below the next one only)."""
    out = {}
    for seq in curves_of(summaries).values():
        for i, s in enumerate(seq[:-1]):
            nxt, prev = seq[i + 1], seq[i - 1] if i else None
            if nxt["best"] - s["best"] > tol and (prev is None or prev["best"] - s["best"] > tol):
                before = f"kv {prev['kv']} ({prev['best']:.3f}) and " if prev else ""
                out[(s["model"], s["d_model"], s["setting"])] = (
                    f"best {s['best']:.3f} at kv {s['kv']} below {before}kv {nxt['kv']} ({nxt['best']:.3f})")
    return out


def on_grid(cells: Sequence, records: Sequence[dict]) -> list[dict]:
    """The records of the grid `cells`' runs: every field of one of the cells but the seed (a records file shared
    with other sweeps — v1's runs at another lr or with other heads, a check — keeps those out of the readings)."""
    if not cells:
        return []
    names = [f.name for f in dataclasses.fields(cells[0]) if f.name != "seed"]

    def sig(fields) -> str:
        return json.dumps([fields.get(n) for n in names], default=list)

    grid = {sig(dataclasses.asdict(c)) for c in cells}
    return [r for r in records if sig(r) in grid]


def followup_cells(cells: Sequence, records: Sequence[dict], *, extra: int, cap: int,
                   tol: float = DIP_TOL) -> tuple[list, dict, dict[CellId, str]]:
    """(new cells, {cell: note}, {cell id: why capped}) of one follow-up round over the grid `cells` (MQARCells,
    every lr × seed of every cell) given the `records` so far: each dip cell (`dips`) with fewer than `cap`
    complete seeds gets min(extra, cap − complete) seeds more — the smallest above its grid's seeds that are not
    complete yet (a seed half-run before a kill is finished first) — at every lr of its grid."""
    grid: dict[CellId, list] = {}
    for c in cells:
        grid.setdefault(cell_id(c), []).append(c)
    summary = {cell_id(s): s for s in summarize(on_grid(cells, records))}
    new, notes, capped = [], {}, {}
    for cid, why in dips(summary.values(), tol).items():
        if cid not in grid:
            continue
        done = set(summary[cid]["seeds"])
        base = sorted({c.seed for c in grid[cid]})
        if len(done) >= cap:
            capped[cid] = f"{why}; still after {len(done)} seeds (the cap)"
            continue
        want, s = min(extra, cap - len(done)), base[-1] + 1
        seeds = []
        while len(seeds) < want:
            if s not in done:
                seeds.append(s)
            s += 1
        note = {"round": 1 + max(0, len(done) - len(base)) // max(1, extra), "reason": why, "seeds": seeds}
        for lr in sorted({c.lr for c in grid[cid]}):
            template = next(c for c in grid[cid] if c.lr == lr)
            for sd in seeds:
                c = dataclasses.replace(template, seed=sd)
                new.append(c)
                notes[c] = note
    return new, notes, capped


def run_protocol(cells: Sequence, out, *, extra: int, cap: int, tol: float = DIP_TOL, device: str = "cpu",
                 dtype: str = "float32", records=None, fresh: bool = False, log=print, **run_kw) -> tuple[list, dict]:
    """Run the grid `cells` (`mqar.run_mqar`, resumable), then follow-up rounds (`followup_cells`) until no cell
    dips or every dip is capped; returns (the records of the grid's cells and of their follow-up runs, {cell id:
    why capped}). `extra` = 0: the grid alone. run_kw: `run_mqar`'s (mode, workers, threads, progress, cuda_graph,
    stack).
    A re-run after a kill finds the same rounds from the records and trains only the runs missing."""
    import torch

    from .mqar import results_store, run_mqar

    store = results_store(out, records)
    start = store.size() if fresh else 0  # --fresh: only the runs of this invocation count
    ctx = {"dtype": dtype, "device": torch.device(device).type}

    def mine() -> list[dict]:
        return on_grid(cells, [r for r in store.records(start) if all(r.get(k) == v for k, v in ctx.items())])

    run_mqar(cells, out, device=device, dtype=dtype, records=records, fresh=fresh, **run_kw)
    capped, last = {}, None
    while extra > 0:
        new, notes, capped = followup_cells(cells, mine(), extra=extra, cap=cap, tol=tol)
        if not new:
            break
        if new == last:
            raise TrainError("the follow-up made no progress: its runs left no complete records (" +
                               ", ".join(c.describe() for c in new[:3]) + ")")
        log(f"follow-up: {len(new)} runs for {len({cell_id(c) for c in new})} cell(s) that dip along kv")
        run_mqar(new, out, device=device, dtype=dtype, records=records, fresh=fresh, notes=notes, **run_kw)
        last = new
    return mine(), capped


# ------------------------------------------------------------------------------------------ reading
def _points(seq: Sequence[dict], stat: str) -> list[tuple[int, float]]:
    return [(s["kv"], s[stat]) for s in seq]


def _half(seq: Sequence[dict], stat: str) -> str:
    sign, v = crossing(_points(seq, stat))
    return f"{v:.3g}" if sign == "=" else f"{sign} {v:g}"


def _bytes(b) -> str:
    from .mqar import format_bytes

    return format_bytes(b)


def format_table(summaries: Sequence[dict], tol: float = DIP_TOL) -> str:
    """The main table (Markdown): per (model, d_model) in zoo order its heads × head dim, the decoding state, the
    best / median accuracy at every kv, the ceiling (≥ 0.9) and kv at 0.5 of the best and of the median, the runs
    (complete seeds × lrs), and the cells the follow-up extended or that still dip at its cap."""
    from .. import zoo

    order = {m: i for i, m in enumerate(zoo.names())}
    cur = curves_of(summaries)
    kvs = sorted({s["kv"] for seq in cur.values() for s in seq})
    still = dips(summaries, tol)
    lines = ["| model | H × K | state | " + " | ".join(f"kv {k}" for k in kvs)
             + " | ceiling best / median | kv at 0.5 best / median | runs | follow-up |",
             "|---|---|---:|" + "---:|" * len(kvs) + "---:|---:|---|---|"]
    for (m, _), seq in sorted(cur.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1])):
        by_kv = {s["kv"]: s for s in seq}
        accs = " | ".join(f"{by_kv[k]['best']:.3f} / {by_kv[k]['median']:.3f}" if k in by_kv else "·" for k in kvs)
        ceil = " / ".join("—" if (c := ceiling(_points(seq, st))) is None else str(c) for st in ("best", "median"))
        runs = ", ".join(sorted({f"{len(s['seeds'])} × {len(s['lrs'])}" for s in seq}))
        notes = [f"kv {s['kv']}: +{sum(len(n['seeds']) for n in s['extended'])} seeds" for s in seq if s["extended"]]
        notes += [f"kv {s['kv']}: still dips" for s in seq if (s["model"], s["d_model"], s["setting"]) in still]
        lines.append(f"| {m} | {seq[0]['num_heads']} × {seq[0]['head_dim']} | {_bytes(seq[-1]['state_bytes'])} | "
                     f"{accs} | {ceil} | {_half(seq, 'best')} / {_half(seq, 'median')} | {runs} | "
                     f"{'; '.join(notes) or '—'} |")
    return "\n".join(lines) + "\n"


def plot_state(summaries: Sequence[dict], out, name: str = "ceilings_v2_state.png") -> Path:
    """Zoology's figure: accuracy (best over lr × seeds: solid; the best lr's median over seeds: dotted) against
    the decoding state in bytes (log), one curve per kv through every (model, d_model) sorted by state bytes, each
    point labelled with its model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = [s for s in summaries if s["best"] is not None and s["state_bytes"]]
    kvs = sorted({s["kv"] for s in done})
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for i, kv in enumerate(kvs):
        pts = sorted((s["state_bytes"], s["best"], s["median"], s["model"]) for s in done if s["kv"] == kv)
        color = plt.get_cmap("viridis")(i / max(1, len(kvs) - 1))
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", ms=4, color=color, label=f"kv {kv}")
        ax.plot(xs, [p[2] for p in pts], ls=":", lw=0.9, color=color)
        for x, y, _, m in pts:
            ax.annotate(m, (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points", color=color)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("decoding state per sequence (bytes, log scale)")
    ax.set_ylabel("accuracy (solid: best over lr × seeds; dotted: median over seeds)")
    ax.set_title("MQAR accuracy vs state size, one curve per kv", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def kv_half(seq: Sequence[dict], stat: str = "best") -> tuple[str, float]:
    return crossing(_points(seq, stat))


def loglog_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of log y against log x (None with fewer than two distinct x)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def format_dk(summaries: Sequence[dict], models: Sequence[str], stat: str = "best",
              capacity_records: Sequence[dict] = ()) -> str:
    """Claim 1 (Markdown): per model the kv at 0.5 at each head dim d_k (heads fixed) and the slope of log kv at 0.5
    against log d_k over the bracketed crossings ("=": a crossing inside the grid; bounds are shown, not fitted), and
    beside it the capacity probe's prediction (`ceilings.probe_ratio`: the largest n / d_k its stand-in memory
    recalls at ≥ 0.9 — pairs per head r·d_k, a slope of 1 by construction; "—" without probe records)."""
    from .ceilings import probe_model, probe_ratio

    cur = {c: seq for c, seq in curves_of(summaries).items() if isinstance(seq[0]["head_dim"], int)}  # (K = V set)
    dks = sorted({seq[0]["head_dim"] for (m, _), seq in cur.items() if m in models})
    lines = ["| model | " + " | ".join(f"d_k {k}" for k in dks)
             + " | log–log slope (bracketed points) | probe: pairs per head |",
             "|---|" + "---:|" * len(dks) + "---:|---|"]
    for m in models:
        at = {seq[0]["head_dim"]: kv_half(seq, stat) for (mm, _), seq in cur.items() if mm == m}
        if not at:
            continue
        cells = " | ".join((f"{at[k][1]:.3g}" if at[k][0] == "=" else f"{at[k][0]} {at[k][1]:g}") if k in at else "·"
                           for k in dks)
        slope = loglog_slope([(k, v) for k, (sign, v) in at.items() if sign == "="])
        probe = probe_model(m.split("+", 1)[0])
        ratio = probe_ratio(capacity_records, probe) if probe else None
        pred = "—" if ratio is None else f"{ratio:g}·d_k (`{probe}`)"
        lines.append(f"| {m} | {cells} | {'—' if slope is None else f'{slope:.2f}'} | {pred} |")
    return "\n".join(lines) + "\n"


def format_pairs(summaries: Sequence[dict], pairs: Sequence[tuple[str, str]], stat: str = "best") -> str:
    """Claims 2, 3 and 4 (Markdown): per pair a → b and head dim d_k, both kv at 0.5 and their ratio b / a where both
    are bracketed."""
    cur = curves_of(summaries)
    by = {(m, seq[0]["head_dim"]): seq for (m, _), seq in cur.items() if isinstance(seq[0]["head_dim"], int)}
    lines = ["| a → b | d_k | kv at 0.5, a → b | b / a |", "|---|---:|---:|---:|"]
    for a, b in pairs:
        for dk in sorted({k for m, k in by if m in (a, b)}):
            if (a, dk) not in by or (b, dk) not in by:
                continue
            ha, hb = kv_half(by[(a, dk)], stat), kv_half(by[(b, dk)], stat)
            ratio = f"×{hb[1] / ha[1]:.2f}" if ha[0] == hb[0] == "=" else "n/a (not bracketed)"
            fa, fb = (f"{v:.3g}" if s == "=" else f"{s} {v:g}" for s, v in (ha, hb))
            lines.append(f"| {a} → {b} | {dk} | {fa} → {fb} | {ratio} |")
    return "\n".join(lines) + "\n"


def interpolate_loglog(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """y at x by linear interpolation of log y in log x between the two points around x (None outside)."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1 and x1 > x0:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return next((y for xx, y in pts if xx == x), None)


def format_equal_bytes(summaries: Sequence[dict], mlp: Sequence[str], matrix: Sequence[str],
                       stat: str = "best") -> str:
    """Claim 5 (Markdown): per MLP memory (each of its d_model) its state bytes and kv at 0.5, and each matrix
    memory's kv at 0.5 interpolated at the same state bytes along its d_k sweep (log–log, between the bracketed
    crossings around those bytes; "out of range" where its sweep does not reach them)."""
    cur = curves_of(summaries)
    lines = ["| MLP memory | H × K | state | kv at 0.5 | " + " | ".join(f"{m} at equal bytes" for m in matrix) + " |",
             "|---|---|---:|---:|" + "---:|" * len(matrix)]
    for (m, _), seq in sorted(cur.items()):
        if m not in mlp:
            continue
        sign, v = kv_half(seq, stat)
        sb = seq[0]["state_bytes"]
        row = []
        for mm in matrix:
            pts = [(s[0]["state_bytes"], kv_half(s, stat)[1]) for (n, _), s in cur.items()
                   if n == mm and kv_half(s, stat)[0] == "=" and s[0]["state_bytes"]]
            y = interpolate_loglog(pts, sb) if sb else None
            row.append("out of range" if y is None else f"{y:.3g}")
        lines.append(f"| {m} | {seq[0]['num_heads']} × {seq[0]['head_dim']} | {_bytes(sb)} | "
                     f"{f'{v:.3g}' if sign == '=' else f'{sign} {v:g}'} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


#: The issue's claims: (what it reads, the presets whose records it needs, the renderer or None when not built).
CLAIMS = {
    "1 ceiling grows with d_k": ("kv at 0.5 vs d_k, log–log slope", ("ceilings-v2-dk",), "format_dk"),
    "2 gating does not raise it": ("gated DeltaNet vs DeltaNet, GLA vs linear attention per d_k",
                                   ("ceilings-v2-dk",), "format_pairs"),
    "3 polynomial features raise it": ("the degree-2 homogeneous map against none, DeltaNet and linear attention at "
                                       "d_k 16 and 32", ("ceilings-v2-poly",), "format_pairs"),
    "4 Mesa vs DeltaNet": ("mesanet vs deltanet per d_k", ("ceilings-v2-dk",), "format_pairs"),
    "5 MLP vs matrix at equal bytes": ("kv at 0.5 at equal state bytes", ("ceilings-v2", "ceilings-v2-dk"),
                                       "format_equal_bytes"),
}
GATING_PAIRS = (("deltanet", "gated_deltanet"), ("linear_attention", "gla"))
MESA_PAIRS = (("deltanet", "mesanet"),)
POLY_PAIRS = (("linear_attention", "linear_attention+poly2h"), ("deltanet", "deltanet+poly2h"))
MLP_MEMORIES = ("ttt_mlp", "titans", "omeganet", "atlas")
MATRIX_MEMORIES = ("linear_attention", "deltanet", "gated_deltanet", "mesanet")
DK_MODELS = ("linear_attention", "gla", "deltanet", "gated_deltanet", "mesanet")


def format_claims(summaries: Sequence[dict], capacity_records: Sequence[dict] = ()) -> str:
    """Every built claim's table from one set of summaries (a section per claim); claim 1 with the capacity probe's
    prediction from `capacity_records` (`fastweights capacity`'s records)."""
    parts = []
    for title, (what, presets, fn) in CLAIMS.items():
        parts.append(f"claim {title} ({what}; records of {', '.join(presets) or 'no preset yet'}):")
        if fn == "format_dk":
            parts.append(format_dk(summaries, DK_MODELS, capacity_records=capacity_records))
        elif fn == "format_pairs":
            parts.append(format_pairs(summaries, {"2": GATING_PAIRS, "3": POLY_PAIRS, "4": MESA_PAIRS}[title[0]]))
        elif fn == "format_equal_bytes":
            parts.append(format_equal_bytes(summaries, MLP_MEMORIES, MATRIX_MEMORIES))
        else:  # pragma: no cover - every claim has its table
            parts.append("not built\n")
    return "\n".join(parts)


#: The presets whose records the claims read (`report`).
V2_PRESETS = ("ceilings-v2", "ceilings-v2-dk", "ceilings-v2-poly")


def report(records_path, out, presets: Sequence[str] = V2_PRESETS, dtype: str = "bfloat16",
           device: str = "cuda") -> str:
    """Every v2 reading from one records file (Markdown; Zoology's plot written to `out`): the main table of
    `presets[0]`'s grid, then the claims over the runs of every preset in `presets` (claim 5 needs `ceilings-v2`'s
    MLP memories and `ceilings-v2-dk`'s matrix memories at once) — only the runs of the presets' grids
    (`on_grid`) at `dtype` on `device`, so one file can hold them all beside v1's runs."""
    from .mqar import PRESETS, _capacity_records, make_cells, results_store

    recs = [r for r in results_store(Path(out), records_path).records()
            if r.get("dtype") == dtype and r.get("device") == device]
    main = summarize(on_grid(make_cells(PRESETS[presets[0]]), recs))
    cells = [c for p in presets for c in make_cells(PRESETS[p])]
    every = summarize(on_grid(cells, recs))
    plot_state(main, out)
    return format_table(main) + "\n" + format_claims(every, _capacity_records())
