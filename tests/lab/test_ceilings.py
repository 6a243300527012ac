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
