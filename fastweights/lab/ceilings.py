"""The capacity ceilings read off an MQAR sweep over kv pairs (`fastweights mqar --preset ceilings`).

From the records (best over lr per model and setting, Zoology's per-example accuracy):

    ceiling     the largest number of kv pairs with accuracy ≥ 0.9 (None: not even the smallest)
    kv@0.5      the number of kv pairs where accuracy crosses 0.5, interpolated linearly in
                log2(kv) between the last setting at ≥ 0.5 and the next one below it ("> max" when
                every setting stays above, "< min" when the smallest is already below)
    state       the decoding state per sequence (`LM.state_size`, fp32 memories, 2 layers; the
                softmax side's KV cache at the setting's length)
    probe       the training-free prediction: the capacity probe (`fastweights capacity`, its
                committed records at d_k = 64) gives the largest n / d_k that the model's
                probe memory recalls at ≥ 0.9 on random unit keys; times the model's head dim K it
                predicts the pairs one head holds (None for the softmax side: a KV cache keeps
                every pair)

`four_axis_pairs` lists the pairs of models that differ on exactly one axis of the recipe
(memory, feature map, objective, optimizer, retention), and the pairs the issue names
(`NAMED_PAIRS`) with every axis they differ on; `format_*` render the tables, `plot_ceilings` the
two figures (accuracy vs kv pairs grouped by class, and ceiling vs state bytes).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .. import zoo
from ..recipe import recipe_class
from .train import best_over

AXES = ("memory", "feature_map", "objective", "optimizer", "retention")

#: Pairs the issue names (a → b, the axis it reads them for), whatever else they differ on.
NAMED_PAIRS = (("linear_attention", "deltanet", "objective"), ("linear_attention", "mamba2", "retention"),
               ("deltanet", "gated_deltanet", "retention"), ("deltanet", "ttt_mlp", "memory"),
               ("ttt_mlp", "titans", "optimizer"), ("gla", "kda", "objective"))

#: Panel titles of the accuracy plot, per recipe class.
CLASS_LABELS = {"softmax": "softmax side (KV cache)", "gated_linear": "gated linear (dot objective)",
                "delta": "delta rule (l2 objective)", "mesa": "least squares (Mesa)",
                "generic": "trained memories (mini-batch GD, momentum, Muon)"}


def kv_of(record: dict) -> int:
    return int(record["test_segments"][0][1])


def curves(records: Sequence[dict]) -> dict[str, list[dict]]:
    """{model: best-over-lr records sorted by kv}, models in zoo order."""
    best = best_over(records, over=("lr",), fields=("model", "d_model", "setting"))
    order = {m: i for i, m in enumerate(zoo.names())}
    out: dict[str, list[dict]] = {}
    for r in sorted(best, key=lambda r: (order.get(r["model"], len(order)), kv_of(r))):
        out.setdefault(r["model"], []).append(r)
    return out


#: The sweep's economy (`unreachable`): a model whose accuracy stayed below SKIP_BELOW at each of the SKIP_AFTER
#: kv just below n in the grid is not trained at n. Its ceiling and its kv at 0.5 are read by then, and at a fixed
#: state MQAR's accuracy falls as kv grows (Zoology): what a cell past two failures could change is only a lucky run.
SKIP_BELOW, SKIP_AFTER = 0.5, 2


def failed_before(accuracy: dict[int, float], kv: int, grid: Sequence[int]) -> list[tuple[int, float | None]] | None:
    """[(k, accuracy)] for the SKIP_AFTER kv of `grid` just below `kv` when each is below SKIP_BELOW in
    `accuracy` ({kv: best accuracy}) or is itself skipped (accuracy None) — the cell at `kv` is then skipped —
    else None."""
    acc: dict[int, float | None] = dict(accuracy)
    for k in sorted(set(grid)) + [kv]:
        below = sorted(j for j in set(grid) if j < k)[-SKIP_AFTER:]
        failed = len(below) == SKIP_AFTER and all(j in acc and (acc[j] is None or acc[j] < SKIP_BELOW)
                                                   for j in below)
        if k == kv:
            return [(j, acc[j]) for j in below] if failed else None
        if k not in acc and failed:
            acc[k] = None
    return None


def unreachable(model: str, d_model: int, kv: int, grid: Sequence[int], records: Sequence[dict]) -> str | None:
    """Why the cell (model, d_model, kv) of a sweep over `grid` (its kv pairs) need not be trained, from the
    records so far (best over lr per kv, `failed_before`); None when it must be trained."""
    curve = curves([r for r in records if r["model"] == model and r["d_model"] == d_model]).get(model, [])
    best = {kv_of(r): r["accuracy"] for r in curve}
    below = failed_before(best, kv, grid)
    if below is None:
        return None
    return (f"accuracy below {SKIP_BELOW:g} at kv "
            + " and ".join(f"{k} ({'skipped' if a is None else f'{a:.3f}'})" for k, a in below)
            + f": not trained at kv {kv}")


def ceiling(points: Sequence[tuple[int, float]], threshold: float = 0.9) -> int | None:
    """The largest kv with accuracy ≥ threshold (None when no setting reaches it)."""
    ok = [kv for kv, acc in points if acc >= threshold]
    return max(ok) if ok else None


def crossing(points: Sequence[tuple[int, float]], level: float = 0.5) -> tuple[str, float | None]:
    """Where accuracy crosses `level`: ("=", kv) interpolated in log2 kv, (">", max kv) when it never
    falls below, ("<", min kv) when the smallest kv is already below."""
    pts = sorted(points)
    if pts[0][1] < level:
        return "<", float(pts[0][0])
    for (k0, a0), (k1, a1) in zip(pts, pts[1:]):
        if a0 >= level > a1:
            f = (a0 - level) / (a0 - a1)
            return "=", 2 ** (math.log2(k0) + f * (math.log2(k1) - math.log2(k0)))
    return ">", float(pts[-1][0])


def probe_model(name: str) -> str | None:
    """The capacity probe's memory (`fastweights.lab.capacity.MODELS`) that stands for a zoo model:
    its objective, optimizer, memory and feature map, with `_decay` (constant γ = 0.97) for any
    retention (None for the softmax side). A stand-in, not the model: the probe writes at fixed step
    sizes with one head and no learned projections."""
    r = zoo.get(name)
    if r.is_softmax:
        return None
    if r.objective.kind == "least_squares":
        return "mesa"
    if r.optimizer.kind == "muon":
        return "muon"
    if r.memory.kind == "mlp":
        return "mlp"
    if r.objective.kind == "omega":
        return "omega"
    base = "delta" if r.objective.kind == "l2" else "linear"
    if r.feature_map.kind == "polynomial":
        return base + ("_poly2h" if r.feature_map.homogeneous else "_poly2")
    return base + ("_decay" if r.retention.kind != "none" else "")


def probe_ratio(capacity_records: Sequence[dict], probe: str, threshold: float = 0.9) -> float | None:
    """The largest n / d_k at which `probe` recalls ≥ threshold in the probe's random setting."""
    ok = [r["n_pairs"] / r["d_k"] for r in capacity_records
          if r["setting"] == "random" and r["model"] == probe and r["accuracy"] >= threshold]
    return max(ok) if ok else None


def readings(records: Sequence[dict], capacity_records: Sequence[dict] = ()) -> list[dict]:
    """One row per model: model, class, head_dim, ceiling, kv_half (sign, value), state_bytes, probe,
    predicted (pairs per head), accuracies {kv: acc}."""
    rows = []
    for model, recs in curves(records).items():
        points = [(kv_of(r), r["accuracy"]) for r in recs]
        ceil = ceiling(points)
        at = next((r for r in recs if kv_of(r) == ceil), recs[0])  # the state at the ceiling (else the first)
        probe = probe_model(model)
        ratio = probe_ratio(capacity_records, probe) if probe else None
        K = recs[0]["d_model"] // recs[0]["num_heads"]
        rows.append({"model": model, "class": recipe_class(zoo.get(model)), "head_dim": K,
                     "num_heads": recs[0]["num_heads"], "ceiling": ceil, "kv_half": crossing(points),
                     "state_bytes": at.get("state_bytes"), "state_len": at["test_segments"][0][0], "probe": probe,
                     "predicted": None if ratio is None else ratio * K,
                     "accuracy": {kv: acc for kv, acc in points}})
    return rows


def differing_axes(a: str, b: str) -> list[str]:
    ra, rb = zoo.get(a), zoo.get(b)
    out = [ax for ax in AXES if getattr(ra, ax) != getattr(rb, ax)]
    if ra.scale != rb.scale:
        out.append("query scale")
    return out


def four_axis_pairs(models: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """(a, b, axes) for the pairs of `models` differing on exactly one axis (zoo order), then the
    named pairs not among them (with every axis they differ on)."""
    order = [m for m in zoo.names() if m in set(models)]
    out = [(a, b, differing_axes(a, b)) for a, b in itertools.combinations(order, 2)]
    out = [p for p in out if len(p[2]) == 1]
    seen = {(a, b) for a, b, _ in out}
    for a, b, axis in NAMED_PAIRS:
        if a in set(models) and b in set(models) and (a, b) not in seen:
            axes = differing_axes(a, b)
            out.append((a, b, [axis] + [x for x in axes if x != axis]))
    return out


# ------------------------------------------------------------------------------------------ rendering
def _fmt_kv(x) -> str:
    return "—" if x is None else f"{x:g}"


def _fmt_half(h) -> str:
    sign, v = h
    return f"{v:.3g}" if sign == "=" else f"{sign} {v:g}"


def open_above(row: dict, grid: Sequence[int]) -> bool:
    """Whether a reading's ceiling is still open: a kv of `grid` above its last run kv is not run yet, and no run
    kv has fallen below 0.9 yet (a partial run: the ceiling is at least the one shown)."""
    run = row["accuracy"]
    return bool(run) and any(kv > max(run) for kv in grid) and all(acc >= 0.9 for acc in run.values())


def _fmt_ceiling(row: dict, grid: Sequence[int]) -> str:
    """A reading's ceiling, "≥ …" where `grid` has a kv not run yet that could still raise it (`open_above`)."""
    return ("≥ " if grid and open_above(row, grid) else "") + _fmt_kv(row["ceiling"])


def format_ceilings(records: Sequence[dict], capacity_records: Sequence[dict] = (),
                    grid: Sequence[int] = ()) -> str:
    """The ceilings table (Markdown): per model its class, heads × head dim, the accuracy at every
    kv, the ceiling, kv@0.5, the state bytes (the softmax side's KV cache at the ceiling's length,
    else the smallest) and the probe's prediction. With `grid` (the preset's kv pairs) every grid column is
    shown, a cell not run yet as "·", one the sweep skips (`unreachable`) as "–", and a ceiling or kv at 0.5
    that a kv not run yet could still raise as "≥ …" / "> …"; a model with no cell yet gets a row of "·"."""
    from .mqar import format_bytes

    rows = readings(records, capacity_records)
    kvs = sorted({kv for r in rows for kv in r["accuracy"]} | set(grid))
    head = ("| model | class | H × K |" + "".join(f" kv {kv} |" for kv in kvs)
            + " ceiling (≥ 0.9) | kv at 0.5 | state | probe: pairs per head |")
    rule = "|---|---|---|" + "---:|" * len(kvs) + "---:|---:|---:|---|"
    lines = [head, rule]
    missing = " · |" if grid else " — |"
    for r in rows:
        accs = "".join(f" {r['accuracy'][kv]:.3f} |" if kv in r["accuracy"] else
                       " – |" if grid and failed_before(r["accuracy"], kv, grid) else missing for kv in kvs)
        pred = ("KV cache (every pair)" if r["probe"] is None else
                f"{_fmt_kv(None if r['predicted'] is None else round(r['predicted']))} (`{r['probe']}`)")
        state = format_bytes(r["state_bytes"]) + (f" (L {r['state_len']})" if r["class"] == "softmax" else "")
        lines.append(f"| {r['model']} | {r['class']} | {r['num_heads']} × {r['head_dim']} |{accs}"
                     f" {_fmt_ceiling(r, grid)} | {_fmt_half(r['kv_half'])} | {state} | {pred} |")
    if grid:
        run = {r["model"] for r in rows}
        for m in zoo.names():
            if m not in run:
                lines.append(f"| {m} | {recipe_class(zoo.get(m))} | · |" + " · |" * len(kvs) + " · | · | · | · |")
    return "\n".join(lines) + "\n"


def format_pilot(records: Sequence[dict], pick: int = 1) -> str:
    """The lr pilot's table (Markdown): per model (zoo order) the best accuracy at each lr, with the epoch it was
    reached in and "†" where the cell stopped on a non-finite loss, and the lr(s) `pilot_lrs` picks."""
    from .mqar import pilot_lrs

    order = {m: i for i, m in enumerate(zoo.names())}
    models = sorted({r["model"] for r in records}, key=lambda m: order.get(m, len(order)))
    lrs = sorted({float(r["lr"]) for r in records})
    picked = pilot_lrs(records, models, pick)
    head = "| model |" + "".join(f" lr {lr:g} |" for lr in lrs) + " picked |"
    lines = [head, "|---|" + "---:|" * len(lrs) + "---|"]
    for m in models:
        cells = {float(r["lr"]): r for r in records if r["model"] == m}
        row = []
        for lr in lrs:
            r = cells.get(lr)
            if r is None:
                row.append(" — |")
                continue
            broke = r.get("stopped_early") and r["accuracy"] < 0.99
            row.append(f" {r['accuracy']:.3f} (ep {r['best_epoch']}){' †' if broke else ''} |")
        lines.append(f"| {m} |" + "".join(row) + f" {', '.join(f'{x:g}' for x in picked[m])} |")
    return "\n".join(lines) + "\n"


def format_four_axis(records: Sequence[dict], grid: Sequence[int] = ()) -> str:
    """The four-axis table (Markdown): a → b, the axes they differ on, both ceilings and kv@0.5,
    and the change (b − a; "n/a" where a ceiling could not be read). With `grid` (a partial run, as
    `format_ceilings`) a ceiling a kv not run yet could still raise shows as "≥ …"."""
    rows = {r["model"]: r for r in readings(records)}

    lines = ["| a → b | axis (others that differ) | ceiling a → b | kv at 0.5, a → b | change of kv at 0.5 |",
             "|---|---|---:|---:|---:|"]
    for a, b, axes in four_axis_pairs(list(rows)):
        ra, rb = rows[a], rows[b]
        axis = axes[0] if len(axes) == 1 else f"{axes[0]} (+ {', '.join(axes[1:])})"
        ha, hb = ra["kv_half"], rb["kv_half"]
        change = f"×{hb[1] / ha[1]:.2f}" if ha[0] == hb[0] == "=" else "n/a (not bracketed)"
        lines.append(f"| {a} → {b} | {axis} | {_fmt_ceiling(ra, grid)} → {_fmt_ceiling(rb, grid)} | "
                     f"{_fmt_half(ha)} → {_fmt_half(hb)} | {change} |")
    return "\n".join(lines) + "\n"


def on_grid(records: Sequence[dict], settings: Sequence[tuple[int, int]]) -> list[dict]:
    """The records whose setting is one of `settings` ((L, kv) pairs: a sweep's grid)."""
    names = {f"L{L}-kv{n}" for L, n in settings}
    return [r for r in records if r["setting"] in names]


def format_checks(sweep: Sequence[dict], checks: Sequence[dict]) -> str:
    """The budget checks beside the sweep (Markdown): per cell the checks trained again at another lr or seed
    (zoo order, then kv), the sweep's own run of it (lr, seed 0) and every check's accuracy."""
    order = {m: i for i, m in enumerate(zoo.names())}
    cells = sorted({(r["model"], r["setting"]) for r in checks},
                   key=lambda c: (order.get(c[0], len(order)), int(c[1].split("kv")[1]), c[1]))
    lines = ["| model | setting | the sweep: lr → accuracy | the checks: lr, seed → accuracy |", "|---|---|---|---|"]
    for m, st in cells:
        mine = [r for r in sweep if r["model"] == m and r["setting"] == st]
        swept = ", ".join(f"{r['lr']:g} → {r['accuracy']:.3f}" for r in mine) or "not trained (skipped)"
        runs = sorted((r for r in checks if r["model"] == m and r["setting"] == st), key=lambda r: (r["seed"], r["lr"]))
        got = ", ".join(f"{r['lr']:g}, {r['seed']} → {r['accuracy']:.3f}" for r in runs)
        lines.append(f"| {m} | {st} | {swept} | {got} |")
    return "\n".join(lines) + "\n"


def format_costs(records: Sequence[dict], grid: Sequence[int]) -> str:
    """What the sweep cost per model (Markdown, zoo order): the cells trained and the cells the skip rule left
    out (`failed_before`), the optimizer steps, the wall seconds of its cells (each as run: several cells shared
    a GPU) in all, per cell (median) and per 1000 steps (median over cells)."""
    lines = ["| model | cells trained | skipped | steps | wall s | s per cell (median) | s per 1000 steps (median) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    tot = [0, 0, 0, 0.0]
    for row in readings(records):
        recs = [r for r in records if r["model"] == row["model"]]
        skipped = sum(1 for kv in grid if kv not in row["accuracy"] and failed_before(row["accuracy"], kv, grid))
        steps = sum(int(r["steps"]) for r in recs)
        wall = [float(r["wall_seconds"]) for r in recs]
        per_k = [1000 * float(r["wall_seconds"]) / int(r["steps"]) for r in recs if int(r["steps"]) > 0]
        lines.append(f"| {row['model']} | {len(recs)} | {skipped} | {steps} | {sum(wall):.0f} | "
                     f"{statistics.median(wall):.0f} | {statistics.median(per_k):.0f} |")
        tot = [tot[0] + len(recs), tot[1] + skipped, tot[2] + steps, tot[3] + sum(wall)]
    lines.append(f"| all | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]:.0f} | | |")
    return "\n".join(lines) + "\n"


def plot_ceilings(records: Sequence[dict], out) -> list[Path]:
    """Two PNGs in `out`: ceilings_accuracy.png (accuracy vs kv pairs, one panel per class, one
    line per model) and ceilings_frontier.png (kv at 0.5 vs state bytes, log-log, one point per model;
    a hollow marker where the crossing is only bounded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = readings(records)
    classes = list(dict.fromkeys(r["class"] for r in rows))
    colors = {r["model"]: plt.get_cmap("tab20")(i % 20) for i, r in enumerate(rows)}
    fig, axes = plt.subplots(1, len(classes), figsize=(max(6.4, 3.6 * len(classes)), 3.8), squeeze=False)
    for ax, cls in zip(axes[0], classes):
        for r in rows:
            if r["class"] == cls:
                pts = sorted(r["accuracy"].items())
                ax.plot(*zip(*pts), marker="o", ms=4, color=colors[r["model"]], label=r["model"])
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(0.9, color="0.5", ls=":", lw=0.8)
        ax.axhline(0.5, color="0.5", ls="--", lw=0.8)
        ax.set_xlabel("kv pairs")
        ax.set_ylabel("accuracy (best over lr)")
        ax.set_title(CLASS_LABELS.get(cls, cls), fontsize=9)
        ax.legend(fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [out / "ceilings_accuracy.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in rows:
        sign, v = r["kv_half"]
        if r["state_bytes"] is None:
            continue
        ax.scatter([r["state_bytes"]], [v], color=colors[r["model"]], s=30,
                   facecolors=colors[r["model"]] if sign == "=" else "none")
        ax.annotate(r["model"] + ("" if sign == "=" else f" ({sign})"), (r["state_bytes"], v), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("decoding state per sequence (bytes)")
    ax.set_ylabel("kv pairs at accuracy 0.5")
    ax.set_title("ceiling vs state size (hollow: only bounded)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "ceilings_frontier.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
