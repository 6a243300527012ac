"""The ceilings v2 protocol (fastweights.lab.protocol): the lr × seed grid, best and median per cell, the follow-up
that re-seeds a dip, the state bytes, the tables and the plot, and the presets' dry run."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest

from fastweights.lab import mqar, protocol
from fastweights.lab.mqar import PRESETS, make_cells
from tests.tolerances import LOG_SPACED

TINY = PRESETS["ceilings-v2-tiny"]


def _record(cell, accuracy, **extra) -> dict:
    return {**dataclasses.asdict(cell), "accuracy": accuracy, "state_bytes": 1000, **extra}


def test_the_grid_expands_to_every_lr_times_seed_run():
    cells = make_cells(TINY)
    runs = {(c.model, c.setting, c.lr, c.seed) for c in cells}
    assert len(cells) == len(runs) == 2 * 2 * 2 * 2
    assert runs == {(m, st, lr, s) for m in ("deltanet", "ttt_mlp") for st in ("L16-kv2", "L32-kv4")
                    for lr in (3e-3, 1e-2) for s in (0, 1)}
    assert {c.seed for c in make_cells(TINY, seed=5)} == {5, 6}  # --seed shifts the preset's seeds
    v2 = PRESETS["ceilings-v2"]
    lrs = sorted(v2.lrs)
    assert len(lrs) >= 4 and math.isclose(lrs[0], 3e-4) and math.isclose(lrs[-1], 3e-2)
    steps = [math.log(b / a) for a, b in zip(lrs, lrs[1:])]
    assert max(steps) - min(steps) < LOG_SPACED  # log-spaced
    cells = make_cells(v2)
    assert len(v2.seeds) >= 2 and len(cells) == 20 * 6 * len(lrs) * len(v2.seeds)
    # equal footing: every memory, the MLP memories included, built at 2 heads of K = V = 64 (the zoo presets' own
    # head dims differ: gated DeltaNet's keys are 0.75·d/H with values twice that, GLA's d/(2H), Mamba2's values 2K)
    assert {(c.num_heads, c.head_dim) for c in cells} == {(2, 64)}
    import torch

    from fastweights.lab.mqar import lm_config
    from fastweights.models import LM

    built = {}
    for c in cells:
        if c.model not in built:
            with torch.device("meta"):
                lm = LM(lm_config(c))
            built[c.model] = {(b.mixer.config.num_heads, b.mixer.K, b.mixer.V) for b in lm.blocks}
    assert len(built) == 20 and all(dims == {(2, 64, 64)} for dims in built.values()), built


def test_best_and_median_per_cell_from_records():
    cell = make_cells(TINY)[0]
    acc = {(3e-3, 0): random.uniform(0.0, 0.3), (3e-3, 1): random.uniform(0.0, 0.3), (3e-3, 2): 0.95,
           (1e-2, 0): random.uniform(0.5, 0.6), (1e-2, 1): random.uniform(0.6, 0.7),
           (1e-2, 2): random.uniform(0.7, 0.8)}
    recs = [_record(dataclasses.replace(cell, lr=lr, seed=s), a) for (lr, s), a in acc.items()]
    recs.append(_record(dataclasses.replace(cell, lr=1e-2, seed=3), 1.0))  # seed 3 at one lr only: not counted
    recs.insert(0, _record(dataclasses.replace(cell, lr=3e-3, seed=2), 0.0))  # superseded by the later record
    (s,) = protocol.summarize(recs)
    assert s["seeds"] == [0, 1, 2] and s["partial_seeds"] == [3] and s["lrs"] == [3e-3, 1e-2]
    assert (s["best"], s["best_lr"], s["best_seed"]) == (0.95, 3e-3, 2)
    med = {lr: statistics.median(acc[(lr, k)] for k in (0, 1, 2)) for lr in (3e-3, 1e-2)}
    assert s["median"] == max(med.values()) and s["median_lr"] == max(med, key=med.get)
    assert s["kv"] == 2 and s["head_dim"] == 8 and s["runs"] == 7


def _dip_cells():
    preset = dataclasses.replace(TINY, models=("deltanet",), settings=((16, 2), (32, 4), (32, 8)))
    return make_cells(preset)


def test_followup_adds_seeds_exactly_to_the_cell_with_a_dip():
    cells = _dip_cells()
    acc = {"L16-kv2": 0.95, "L32-kv4": 0.2, "L32-kv8": 0.9}
    recs = [_record(c, acc[c.setting] - 0.01 * c.seed) for c in cells]
    recs.append(_record(dataclasses.replace(cells[0], lr=0.5, seed=7), 0.0))  # off the lr grid: not the protocol's
    recs.append(_record(dataclasses.replace(cells[0], num_heads=1), 0.0))  # another config of the cell (v1's heads)
    new, notes, capped = protocol.followup_cells(cells, recs, extra=2, cap=4)
    assert {(c.setting, c.lr, c.seed) for c in new} == {("L32-kv4", lr, s) for lr in (3e-3, 1e-2) for s in (2, 3)}
    assert not capped and all(notes[c]["seeds"] == [2, 3] for c in new)
    assert notes[new[0]]["reason"] == "best 0.200 at kv 4 below kv 2 (0.950) and kv 8 (0.900)"
    # a half-run seed (killed mid-round) is finished first, not skipped
    half = recs + [_record(new[0], 0.2)]
    assert {c.seed for c in protocol.followup_cells(cells, half, extra=2, cap=4)[0]} == {2, 3}
    # the new seeds lift the dip: the curve is monotone, nothing more
    fixed = recs + [_record(c, 0.93) for c in new]
    assert protocol.followup_cells(cells, fixed, extra=2, cap=4) == ([], {}, {})
    # the dip persists at the cap: no more runs, and the reason says so
    stuck = recs + [_record(c, 0.2) for c in new]
    new2, _, capped = protocol.followup_cells(cells, stuck, extra=2, cap=4)
    assert not new2 and list(capped) == [("deltanet", 16, "L32-kv4")] and "4 seeds (the cap)" in next(
        iter(capped.values()))
    # a monotone curve and a rise within the tolerance call for nothing
    for accs in ({"L16-kv2": 0.9, "L32-kv4": 0.6, "L32-kv8": 0.1}, {"L16-kv2": 0.9, "L32-kv4": 0.6, "L32-kv8": 0.63}):
        assert protocol.followup_cells(cells, [_record(c, accs[c.setting]) for c in cells], extra=2, cap=4)[0] == []


def test_run_protocol_records_the_followup_and_resumes(tmp_path, monkeypatch):
    """The follow-up round runs through the sweep machinery: its runs' records say why, and a re-run trains
    nothing (every run, the follow-up's included, is found in the records)."""
    acc = {"L16-kv2": 0.95, "L32-kv4": 0.1, "L32-kv8": 0.9}
    trained = []

    def fake_run_cell(cell, **kw):
        trained.append(cell)
        return {"accuracy": acc[cell.setting] if cell.seed < 2 or cell.setting != "L32-kv4" else 0.92,
                "state_bytes": 2176}

    monkeypatch.setattr(mqar, "run_cell", fake_run_cell)
    cells = _dip_cells()
    recs, capped = protocol.run_protocol(cells, tmp_path, extra=2, cap=6, progress="none", log=lambda *_: None,
                                         stack=False)  # (the stand-in replaces one cell's training)
    assert len(trained) == len(cells) + 4 and not capped
    extended = [r for r in recs if r.get("followup")]
    assert {(r["setting"], r["seed"]) for r in extended} == {("L32-kv4", 2), ("L32-kv4", 3)} and len(extended) == 4
    assert extended[0]["followup"]["round"] == 1 and "kv 4" in extended[0]["followup"]["reason"]
    rows = {s["setting"]: s for s in protocol.summarize(recs)}
    assert rows["L32-kv4"]["seeds"] == [0, 1, 2, 3] and rows["L32-kv4"]["best"] == 0.92
    assert rows["L32-kv4"]["extended"] and not rows["L16-kv2"]["extended"]
    table = protocol.format_table(list(rows.values()))
    assert "kv 4: +2 seeds" in table and "| deltanet | 2 × 8 |" in table
    trained.clear()
    again, _ = protocol.run_protocol(cells, tmp_path, extra=2, cap=6, progress="none", log=lambda *_: None,
                                     stack=False)
    assert trained == [] and len(again) == len(recs)


def test_state_bytes_match_a_hand_count():
    cells = {c.model: c for c in make_cells(TINY)}
    K = V = 16 // 2  # d_model 16, 2 heads
    conv = 2 * (4 - 1) * 3 * 16 * 4  # 2 layers × (kernel − 1) × q, k, v × d_model × fp32: the qkv conv tails
    # a matrix memory: 2 layers × H × K × V fp32
    assert mqar.cell_state_bytes(cells["deltanet"]) == 2 * 2 * K * V * 4 + conv
    # TTT-MLP: per head W1 [K, 4K], b1 [4K], W2 [4K, V], b2 [V], and the same again as the mini-batch's anchor
    mlp = K * 4 * K + 4 * K + 4 * K * V + V
    assert mqar.cell_state_bytes(cells["ttt_mlp"]) == 2 * 2 * 2 * mlp * 4 + conv


def _dk_records():
    """DeltaNet and gated DeltaNet at d_k 8, 16, 32 whose kv at 0.5 is 2·d_k (gated: d_k), TTT-MLP at d_k 8."""
    out = []
    for model, dks, scale in (("deltanet", (8, 16, 32), 2), ("gated_deltanet", (8, 16, 32), 1), ("ttt_mlp", (8,), 4)):
        for dk in dks:
            preset = dataclasses.replace(TINY, models=(model,), d_models=(2 * dk,),
                                         settings=tuple((max(16, 4 * n), n) for n in (2, 4, 8, 16, 32, 64, 128)))
            for c in make_cells(preset):
                half = scale * dk  # accuracy 1 at half/2, 0 at 2·half: the crossing in log2 kv falls at `half`
                a = min(1.0, max(0.0, 0.5 - 0.5 * math.log2(c.num_kv_pairs / half)))
                out.append(_record(c, a, state_bytes=2 * 2 * dk * dk * 4 * (4 if model == "ttt_mlp" else 1)))
    return out


def test_claim_tables_and_the_state_plot(tmp_path):
    summaries = protocol.summarize(_dk_records())
    probe = [{"setting": "random", "model": "delta", "d_k": 64, "n_pairs": n, "accuracy": a}
             for n, a in ((32, 1.0), (64, 0.95), (128, 0.4))]
    dk = protocol.format_dk(summaries, ("deltanet", "gated_deltanet"), capacity_records=probe)
    assert "| deltanet | 16 | 32 | 64 | 1.00 | 1·d_k (`delta`) |" in dk
    assert "| gated_deltanet | 8 | 16 | 32 | 1.00 | — |" in dk  # no delta_decay probe records here
    pairs = protocol.format_pairs(summaries, protocol.GATING_PAIRS)
    assert "| deltanet → gated_deltanet | 16 | 32 → 16 | ×0.50 |" in pairs
    # TTT-MLP at d_k 8 holds 4·8 = 32 in 4× DeltaNet's d_k-8 state, i.e. DeltaNet's state at d_k 16 (kv 32 there)
    eq = protocol.format_equal_bytes(summaries, ("ttt_mlp",), ("deltanet", "gated_deltanet"))
    assert "| ttt_mlp | 2 × 8 | 4.0 KiB | 32 | 32 | 16 |" in eq
    assert protocol.loglog_slope([(16, 8), (32, 8 * 2 ** 0.5), (64, 16)]) == pytest.approx(0.5)
    path = protocol.plot_state(summaries, tmp_path / "plots")
    assert path.exists() and path.stat().st_size > 10_000 and path.name == "ceilings_v2_state.png"


@pytest.mark.parametrize("preset", ["ceilings-v2", "ceilings-v2-dk"])
def test_v2_dry_run_from_any_directory(preset, tmp_path, monkeypatch, capsys):
    from fastweights import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["mqar", "--preset", preset, "--dry-run", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "protocol: 10 runs a cell (5 lrs" in out and "up to 6 seeds" in out
    assert ("atlas d=128: 26.0 MiB" in out) == (preset == "ceilings-v2")
    assert "deltanet d=128: 73.0 KiB" in out


def test_followup_flags_only_on_protocol_presets(capsys):
    assert mqar.main(["--preset", "quick", "--followup-seeds", "2", "--dry-run"]) == 2
    assert "has no lr × seed protocol" in capsys.readouterr().err


def test_cli_runs_the_protocol_and_prints_the_v2_reading(tmp_path, monkeypatch, capsys):
    """`fastweights mqar --preset ceilings-v2-tiny`: the grid, a follow-up round for the cell below its next kv,
    the v2 table and the claims, and the state plot (training replaced by a stand-in: the CLI's path is tested)."""

    def fake_run_cell(cell, **kw):
        low = cell.setting == "L16-kv2" and cell.seed < 2
        return {"accuracy": 0.1 if low else 0.9 + 0.01 * random.random(), "state_bytes": 2176, "steps": 2}

    monkeypatch.setattr(mqar, "run_cell", fake_run_cell)
    argv = ["--preset", "ceilings-v2-tiny", "--models", "deltanet", "--out", str(tmp_path), "--progress", "none",
            "--no-stack"]  # (the stand-in replaces one cell's training)
    assert mqar.main(argv) == 0
    out = capsys.readouterr().out
    assert "| deltanet | 2 × 8 | 2.1 KiB |" in out and "kv 2: +2 seeds" in out and "claim 1 ceiling grows" in out
    assert (tmp_path / "ceilings_v2_state.png").exists()
    recs = [r for r in mqar.results_store(tmp_path).records()]
    assert len(recs) == 8 + 4 and {r["seed"] for r in recs if r.get("followup")} == {2, 3}
    assert mqar.main([*argv, "--max-seeds", "2", "--followup-seeds", "0"]) == 0  # the records are read, none added
    assert len(mqar.results_store(tmp_path).records()) == 12


def test_the_polynomial_variant_of_a_model(capsys):
    """Claim 3's models: "deltanet+poly2h" is DeltaNet with the degree-2 homogeneous feature map (K' = K(K+1)/2 in
    its state), a model name of its own; an unknown variant is refused by --models."""
    cell = make_cells(TINY, lrs=[1e-2], models=["deltanet+poly2h"])[0]
    spec = mqar.model_spec(cell.model)
    assert spec.feature_map.kind == "polynomial" and spec.feature_map.homogeneous and spec.name == "deltanet+poly2h"
    K = V = 8
    conv = 2 * (4 - 1) * 3 * 16 * 4
    assert mqar.cell_state_bytes(cell) == 2 * 2 * (K * (K + 1) // 2) * V * 4 + conv
    assert mqar.main(["--preset", "ceilings-v2-tiny", "--models", "deltanet+poly3", "--dry-run"]) == 2
    assert "unknown model 'deltanet+poly3'" in capsys.readouterr().err
    recs = [_record(c, 1.0 if c.num_kv_pairs < (4 if "+" in c.model else 2) else 0.0)
            for m in ("deltanet", "deltanet+poly2h")
            for c in make_cells(dataclasses.replace(TINY, models=(m,), settings=((16, 1), (16, 2), (32, 4))))]
    claims = protocol.format_claims(protocol.summarize(recs))
    assert "| deltanet → deltanet+poly2h | 8 | 1.41 → 2.83 | ×2.00 |" in claims


def test_report_reads_every_preset_grid_from_one_records_file(tmp_path):
    """`protocol.report`: the main table from ceilings-v2's grid, the claims from every v2 preset's runs in the same
    file (claim 5 reads TTT-MLP from ceilings-v2 and DeltaNet's d_k sweep from ceilings-v2-dk); other runs ignored."""
    import json

    lines = []
    ctx = {"dtype": "bfloat16", "device": "cuda"}
    kv = {c.setting: c.num_kv_pairs for c in make_cells(PRESETS["ceilings-v2"], models=["deltanet"])}
    cells = make_cells(PRESETS["ceilings-v2"], models=["ttt_mlp"]) + make_cells(PRESETS["ceilings-v2-dk"],
                                                                                models=["deltanet"])
    one = {(c.model, c.d_model): c for c in cells}
    state = {k: mqar.cell_state_bytes(c) for k, c in one.items()}
    for i, c in enumerate(cells):
        half = {"ttt_mlp": 64}.get(c.model, c.d_model)  # DeltaNet's kv at 0.5 = 2·d_k
        acc = min(1.0, max(0.0, 0.5 - 0.5 * math.log2(kv[c.setting] / half)))
        lines.append({**_record(c, acc, state_bytes=state[(c.model, c.d_model)]), **ctx, "key": f"run {i}"})
    v1 = make_cells(PRESETS["ceilings"], models=["ttt_mlp"], lrs=[3e-3])[0]  # 8 heads: not a v2 run
    lines.append({**_record(v1, 1.0), **ctx, "key": "v1"})
    (tmp_path / "v2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = protocol.report(tmp_path / "v2.jsonl", tmp_path / "plots")
    main = text.split("claim 1")[0]  # ceilings-v2's grid: DeltaNet at d_model 128 (a run shared with the d_k sweep)
    assert "| ttt_mlp | 2 × 64 | 1.0 MiB |" in main and "| deltanet | 2 × 64 |" in main
    assert "| deltanet | 2 × 16 |" not in main and "| ttt_mlp | 8 × 16 |" not in text
    assert "| deltanet | 32 | 64 | 128 | > 256 | 1.00 |" in text  # (at d_k 128 the grid's kv 256 is not below 0.5)
    # TTT-MLP's 1.0 MiB is above DeltaNet's largest state on its d_k sweep (274 KiB): not interpolated
    assert "| ttt_mlp | 2 × 64 | 1.0 MiB | 64 | out of range |" in text
    assert (tmp_path / "plots" / "ceilings_v2_state.png").exists()


def test_head_dim_joins_the_cell_key_only_when_set():
    """`MQARCell.head_dim` (the v2 presets' K = V) is left out of the key while None, so the cells of the sweeps made
    before it existed keep their keys — every committed ceilings record is found again by its cell — and a set head
    dim is part of the key."""
    import json
    import os

    from fastweights.lab.mqar import MQARCell
    from fastweights.lab.train import cell_key

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results", "mqar_ceilings.jsonl")
    names = {f.name for f in dataclasses.fields(MQARCell)}
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert len(recs) > 50
    for r in recs:
        cell = MQARCell(**{k: (tuple(map(tuple, v)) if k.endswith("segments") else v)
                           for k, v in r.items() if k in names})
        assert cell.head_dim is None and r["key"].startswith(cell_key(cell) + "|"), r["key"]
    v2 = make_cells(PRESETS["ceilings-v2"])[0]
    assert json.loads(cell_key(v2)[len("MQARCell"):])["head_dim"] == 64
    assert cell_key(v2) != cell_key(dataclasses.replace(v2, head_dim=None))
