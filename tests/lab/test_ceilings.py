"""The ceilings reading (fastweights.lab.ceilings): ceilings, crossings, probe mapping, the
four-axis pairs and the rendering, on synthetic records."""

from __future__ import annotations

import math

import pytest

from fastweights import zoo
from fastweights.lab import ceilings as cl


def test_ceiling_and_crossing():
    pts = [(8, 1.0), (16, 0.95), (32, 0.7), (64, 0.3), (128, 0.1)]
    assert cl.ceiling(pts) == 16
    sign, v = cl.crossing(pts)
    assert sign == "=" and math.isclose(math.log2(v), 5 + 0.2 / 0.4)
    assert cl.ceiling([(8, 0.5)]) is None
    assert cl.crossing([(8, 0.4), (16, 0.1)]) == ("<", 8.0)
    assert cl.crossing([(8, 1.0), (16, 0.6)]) == (">", 16.0)


def test_every_fast_weight_model_has_a_probe_memory():
    from fastweights.lab.capacity import MODELS

    for name in zoo.names():
        probe = cl.probe_model(name)
        assert (probe is None) == zoo.get(name).is_softmax
        assert probe is None or probe in MODELS, (name, probe)
    assert cl.probe_model("deltanet") == "delta" and cl.probe_model("gated_deltanet") == "delta_decay"
    assert cl.probe_model("omeganet") == "omega" and cl.probe_model("atlas") == "muon"


def test_four_axis_pairs():
    pairs = {(a, b): axes for a, b, axes in cl.four_axis_pairs(zoo.names())}
    assert pairs[("deltanet", "gated_deltanet")] == ["retention"]
    assert pairs[("gla", "kda")] == ["objective"]
    assert pairs[("ttt_linear", "ttt_mlp")] == ["memory"]
    assert len(pairs[("ttt_mlp", "titans")]) > 1  # named by the issue: several axes at once
    assert pairs[("linear_attention", "deltanet")][0] == "objective"  # the named axis first
    named = {(a, b) for a, b, _ in cl.NAMED_PAIRS}
    assert all(len(axes) == 1 or (a, b) in named for (a, b), axes in pairs.items())


def _records():
    acc = {"deltanet": [1.0, 0.95, 0.6, 0.2], "gated_deltanet": [1.0, 1.0, 0.92, 0.55],
           "softmax_attention": [1.0, 1.0, 1.0, 0.99], "linear_attention": [0.3, 0.1, 0.05, 0.02]}
    out = []
    for model, accs in acc.items():
        for kv, a in zip((8, 16, 32, 64), accs):
            for lr, shift in ((1e-3, -0.05), (3e-3, 0.0)):
                out.append({"model": model, "d_model": 128, "num_heads": 2, "setting": f"L{4 * kv}-kv{kv}",
                            "lr": lr, "accuracy": max(0.0, a + shift), "test_segments": [[4 * kv, kv, 100]],
                            "state_bytes": 1000 * kv if model == "softmax_attention" else 75000})
    return out


def test_readings_and_rendering(tmp_path):
    capacity = [{"setting": "random", "model": "delta", "d_k": 64, "n_pairs": n, "accuracy": a}
                for n, a in ((32, 1.0), (64, 0.95), (128, 0.4))]
    rows = {r["model"]: r for r in cl.readings(_records(), capacity)}
    assert rows["deltanet"]["ceiling"] == 16 and rows["gated_deltanet"]["ceiling"] == 32
    assert rows["deltanet"]["predicted"] == pytest.approx(64 / 64 * 64)  # ratio 1 × K = 64
    assert rows["linear_attention"]["ceiling"] is None and rows["linear_attention"]["kv_half"] == ("<", 8.0)
    assert rows["softmax_attention"]["kv_half"] == (">", 64.0)
    table = cl.format_ceilings(_records(), capacity)
    assert "| deltanet | delta | 2 × 64 |" in table and "KV cache" in table and "(L 256)" in table
    axes = cl.format_four_axis(_records())
    assert "| deltanet → gated_deltanet | retention |" in axes
    assert "n/a" in axes.split("linear_attention → deltanet")[1].splitlines()[0]  # "< 8" is not bracketed
    paths = cl.plot_ceilings(_records(), tmp_path)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_a_partial_sweep_renders_every_grid_column_and_marks_open_ceilings():
    """With the preset's grid (a sweep under way): kvs not run yet shown as "·", a ceiling that a kv not run yet
    could raise as "≥", one already bracketed (a run kv below 0.9) as is, a model with no cell as a row of "·"."""
    recs = [r for r in _records() if r["setting"] != "L256-kv64"]  # kv 8..32 run, 64 and 128 not yet
    rows = {r["model"]: r for r in cl.readings(recs)}
    grid = (8, 16, 32, 64, 128)
    assert cl.open_above(rows["softmax_attention"], grid) and cl.open_above(rows["gated_deltanet"], grid)
    assert not cl.open_above(rows["deltanet"], grid)  # 0.6 at kv 32: its ceiling, 16, is read
    assert not cl.open_above(rows["softmax_attention"], (8, 16, 32))  # the whole grid run: nothing open
    table = cl.format_ceilings(recs, grid=grid)
    line = {ln.split(" | ")[0].strip("| "): ln for ln in table.splitlines()[2:]}
    assert line["softmax_attention"].count(" · |") == 2 and "| ≥ 32 |" in line["softmax_attention"]
    assert "| 16 |" in line["deltanet"] and "≥" not in line["deltanet"]
    assert line["kda"].count(" · |") == 1 + 5 + 4  # no cell yet: H × K, the grid and the four readings
    assert set(line) == set(zoo.names())
    assert "·" not in cl.format_ceilings(recs)  # without a grid: the run's own columns, as before
    axes = {ln.split(" | ")[0].strip("| "): ln for ln in cl.format_four_axis(recs, grid=grid).splitlines()[2:]}
    assert "| 16 → ≥ 32 |" in axes["deltanet → gated_deltanet"]  # an open ceiling on one side
    assert "≥" not in cl.format_four_axis(recs)


GRID = (8, 16, 32, 64, 128, 256)


def test_failed_before_needs_the_two_grid_kv_below_both_below_half():
    assert cl.failed_before({8: 0.3, 16: 0.2}, 32, GRID) == [(8, 0.3), (16, 0.2)]
    assert cl.failed_before({8: 0.5, 16: 0.2}, 32, GRID) is None  # 0.5 itself is not below
    assert cl.failed_before({8: 0.3, 16: 0.7}, 32, GRID) is None
    assert cl.failed_before({16: 0.2}, 32, GRID) is None  # kv 8 not recorded (yet)
    assert cl.failed_before({8: 0.1}, 16, GRID) is None  # one grid kv below only
    assert cl.failed_before({}, 8, GRID) is None
    assert cl.failed_before({8: 0.1, 16: 0.1, 32: 0.1}, 64, GRID) == [(16, 0.1), (32, 0.1)]  # the last two


def test_failed_before_chains_through_skipped_kv():
    acc = {8: 0.3, 16: 0.2}
    assert cl.failed_before(acc, 64, GRID) == [(16, 0.2), (32, None)]  # 32 skipped
    assert cl.failed_before(acc, 128, GRID) == [(32, None), (64, None)]
    assert cl.failed_before(acc, 256, GRID) == [(64, None), (128, None)]
    assert cl.failed_before({**acc, 32: 0.6}, 64, GRID) is None  # a recorded kv 32 breaks the chain
    assert cl.failed_before({**acc, 32: 0.6}, 256, GRID) is None


def _rec(model, kv, acc, lr=3e-3, d_model=128):
    return {"model": model, "d_model": d_model, "num_heads": 2, "setting": f"L{4 * kv}-kv{kv}", "lr": lr,
            "accuracy": acc, "test_segments": [[4 * kv, kv, 100]], "state_bytes": 75000}


def test_unreachable_takes_the_best_lr_and_only_its_model_and_width():
    low = [_rec("deltanet", 8, 0.1), _rec("deltanet", 16, 0.3)]
    assert cl.unreachable("deltanet", 128, 32, GRID, low) == \
        "accuracy below 0.5 at kv 8 (0.100) and 16 (0.300): not trained at kv 32"
    assert cl.unreachable("deltanet", 128, 64, GRID, low) == \
        "accuracy below 0.5 at kv 16 (0.300) and 32 (skipped): not trained at kv 64"
    assert cl.unreachable("deltanet", 128, 32, GRID, low + [_rec("deltanet", 16, 0.7, lr=1e-3)]) is None
    assert cl.unreachable("deltanet", 128, 32, GRID, [_rec("deltanet", 16, 0.7, lr=1e-3)] + low) is None  # not the last
    others = [_rec("gla", 8, 0.1), _rec("gla", 16, 0.1), _rec("deltanet", 8, 0.1, d_model=64),
              _rec("deltanet", 16, 0.1, d_model=64)]
    assert cl.unreachable("deltanet", 128, 32, GRID, others) is None
    assert cl.unreachable("gla", 128, 32, GRID, others) is not None
    assert cl.unreachable("deltanet", 64, 32, GRID, others) is not None


def test_format_ceilings_marks_skipped_kv_apart_from_kv_not_run():
    table = cl.format_ceilings(_records(), grid=GRID)  # every model run at kv 8..64
    line = {ln.split(" | ")[0].strip("| "): ln for ln in table.splitlines()[2:]}
    assert line["linear_attention"].count(" – |") == 2 and " · |" not in line["linear_attention"]  # 128, 256
    assert line["deltanet"].count(" · |") == 2 and "–" not in line["deltanet"]  # 0.6 at kv 32: not skipped
    assert "–" not in cl.format_ceilings(_records())  # without a grid nothing is skipped


def test_on_grid_keeps_only_the_grid_settings():
    recs = [_rec("deltanet", 8, 0.9), {**_rec("deltanet", 128, 0.9), "setting": "L1024-kv128"}]
    assert cl.on_grid(recs, [(32, 8), (512, 128)]) == recs[:1]


def test_format_checks_sets_each_checked_cell_beside_the_sweeps_run():
    sweep = [_rec("deltanet", 64, 0.2, lr=1e-2), _rec("softmax_attention", 128, 0.0, lr=1e-2)]
    checks = [{**_rec("softmax_attention", 128, 0.999), "seed": 1},
              {**_rec("softmax_attention", 128, 0.001), "seed": 0}, {**_rec("deltanet", 256, 0.5), "seed": 0},
              {**_rec("deltanet", 64, 0.7), "seed": 1}]
    lines = cl.format_checks(sweep, checks).splitlines()[2:]
    # zoo order (softmax attention first), then kv
    assert [ln.split(" | ")[:2] for ln in lines] == [["| softmax_attention", "L512-kv128"],
                                                    ["| deltanet", "L256-kv64"], ["| deltanet", "L1024-kv256"]]
    assert lines[0].endswith("0.003, 0 → 0.001, 0.003, 1 → 0.999 |")  # by seed, then lr
    assert "0.01 → 0.200" in lines[1] and "0.003, 1 → 0.700" in lines[1]
    assert "not trained (skipped)" in lines[2]


def test_format_costs_counts_cells_steps_seconds_and_skipped_cells():
    recs = []
    for kv, acc, steps, wall in ((8, 0.3, 2000, 100.0), (16, 0.2, 2000, 300.0), (32, 0.1, 1000, 50.0)):
        recs.append({**_rec("mamba2", kv, acc), "steps": steps, "wall_seconds": wall})
    row, total = cl.format_costs(recs, GRID).splitlines()[2:]
    # 3 cells, kv 64..256 skipped (below 0.5 at 16 and 32, then chained), 5000 steps, 450 s, median 100 s a cell,
    # median of 50, 150, 50 s per 1000 steps
    assert row == "| mamba2 | 3 | 3 | 5000 | 450 | 100 | 50 |"
    assert total == "| all | 3 | 3 | 5000 | 450 | | |"
