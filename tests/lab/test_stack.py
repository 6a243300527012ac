"""Stacked training (fastweights.lab.stack): the lr × seed variants of a cell trained together equal the cells
trained alone (train_cell), the vectorised AdamW equals torch.optim.AdamW, a variant that stops leaves the others
alone, a killed stacked group resumes with only its missing variants, and the protocol reads the same."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from fastweights.lab import mqar, protocol, stack
from fastweights.lab.train import ResultStore, TrainError, train_cell
from fastweights.training import control
from tests import helpers
from tests.tolerances import STACKED_ADAMW_F64, STACKED_F64, STACKED_LOSS_REL

fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)

DTYPE = "float64"


def _cell(model="deltanet", **kw) -> mqar.MQARCell:
    base = dict(model=model, d_model=16, setting="L16-kv2", lr=3e-3, train_segments=((16, 2, 24),),
                test_segments=((16, 2, 16),), vocab_size=32, num_heads=2, epochs=2, batch_size=16, conv="qkv",
                out_gate="none", grad_clip=1.0, warmup=0.2, decay_filter="matrices", chunk_size=8)
    return mqar.MQARCell(**{**base, **kw})


def _variants(base, lrs_seeds):
    return [dataclasses.replace(base, lr=lr, seed=s) for lr, s in lrs_seeds]


def _alone(cell):
    """train_cell's result and final model for one cell (the path `mqar.run_cell` takes)."""
    box = {}

    def make(_cfg):
        box["m"] = mqar.build_model(cell)
        return box["m"]

    tr, te = mqar.cell_data(cell)
    res = train_cell(mqar.lm_config(cell), tr, te, cell.train_config("cpu", DTYPE), model_fn=make, progress="none")
    return res, box["m"]


def _stacked(cells):
    base = cells[0]
    return stack.train_stacked(mqar.lm_config(base), [(*mqar.cell_data(c), c.train_config("cpu", DTYPE))
                                                      for c in cells],
                               model_fn=lambda _cfg: mqar.build_model(base), progress="none")


def _assert_same_run(a: dict, b: dict, ma, mb):
    for k in ("epochs_run", "best_epoch", "stopped_early", "steps", "params", "state_bytes", "resumed_from"):
        assert a[k] == b[k], k
    assert a["accuracy"] == pytest.approx(b["accuracy"], abs=STACKED_F64)
    assert len(a["history"]) == len(b["history"])
    for ha, hb in zip(a["history"], b["history"]):
        assert ha["epoch"] == hb["epoch"]
        assert ha["loss"] == pytest.approx(hb["loss"], rel=STACKED_LOSS_REL)
        for k in ("accuracy", "lr"):
            assert ha[k] == pytest.approx(hb[k], rel=STACKED_F64, abs=STACKED_F64), k
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys()
    assert max(helpers.max_err(sa[k], sb[k]) for k in sa) < STACKED_F64


def _draw_variants(n):
    seeds = random.sample(range(50), n)
    lrs = random.sample([1e-3, 3e-3, 1e-2, 3e-2], n)
    return list(zip(lrs, seeds))


def test_stacked_variants_equal_separate_train_cell_runs():
    """Three variants (each its lr, seed, init, data and order) stepped together: each one's losses, accuracies,
    lrs and final weights are train_cell's for that (lr, seed) alone."""
    cells = _variants(_cell(), _draw_variants(3))
    results, models = _stacked(cells)
    assert len({round(r["history"][-1]["loss"], 6) for r in results}) == 3  # three different runs
    for c, r, m in zip(cells, results, models):
        a, ma = _alone(c)
        _assert_same_run(a, r, ma, m)


def test_stacked_adamw_equals_torch_adamw():
    """Per variant v, StackedAdamW's steps (lr_v × the step's factor, weight decay per parameter) are
    torch.optim.AdamW's on that variant's slice."""
    V, betas = 3, (random.uniform(0.8, 0.95), random.uniform(0.95, 0.999))
    shapes = {"w": (V, 4, 5), "b": (V, 5)}
    params = {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
    lrs = torch.tensor([random.uniform(1e-3, 1e-1) for _ in range(V)], dtype=torch.float64)
    wd = {"w": random.uniform(0.01, 0.2), "b": 0.0}
    refs = [{n: p[v].clone().requires_grad_(True) for n, p in params.items()} for v in range(V)]
    opts = [torch.optim.AdamW([{"params": [r[n]], "weight_decay": wd[n]} for n in r], lr=float(lrs[v]), betas=betas)
            for v, r in enumerate(refs)]
    sopt = stack.StackedAdamW({n: p.clone() for n, p in params.items()}, lrs, betas=betas, weight_decay=wd)
    for _ in range(5):
        grads = {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
        factors = torch.rand(V, dtype=torch.float64)
        sopt.step(grads, factors)
        for v, (r, opt) in enumerate(zip(refs, opts)):
            for g in opt.param_groups:
                g["lr"] = float(lrs[v] * factors[v])
            for n in r:
                r[n].grad = grads[n][v].clone()
            opt.step()
    for v, r in enumerate(refs):
        for n in r:
            assert helpers.max_err(sopt.params[n][v], r[n]) < STACKED_ADAMW_F64, (v, n)


def test_a_variant_that_stops_leaves_the_others_as_alone():
    """One variant's lr is so large that its loss goes non-finite at its second step (train_cell stops such a cell
    there): it stops with the record it gets alone, and the two others run on to theirs."""
    base = _cell(epochs=3)
    (lr, s), (lr2, s2) = _draw_variants(2)
    cells = _variants(base, [(lr, s), (1e30, random.randrange(50, 100)), (lr2, s2)])
    results, models = _stacked(cells)
    assert results[1]["stopped_early"] and results[1]["epochs_run"] == 1
    assert results[0]["epochs_run"] == results[2]["epochs_run"] == 3
    for c, r, m in zip(cells, results, models):
        a, ma = _alone(c)
        if c.lr == 1e30:  # (its weights are not finite: compare the run, not the weights)
            assert a["stopped_early"] and a["epochs_run"] == 1 and a["history"][0]["epoch"] == r["history"][0]["epoch"]
            assert a["history"][0]["loss"] == pytest.approx(r["history"][0]["loss"], rel=STACKED_LOSS_REL)
            continue
        _assert_same_run(a, r, ma, m)


def test_variants_must_differ_only_in_lr_and_seed():
    cells = [_cell(), _cell(epochs=3)]
    with pytest.raises(TrainError, match="differs from variants\\[0\\]'s in epochs"):
        _stacked(cells)


def test_a_killed_stacked_group_keeps_its_records_and_resumes_the_missing(tmp_path, monkeypatch):
    """The group is stopped right after its first variant finished (a non-finite loss ends it at step 2): that
    record is in the store, and a re-run trains only the two missing variants, stacked."""
    cells = _variants(_cell(), [(3e-3, 0), (1e30, 1), (1e-2, 2)])
    append = ResultStore.append

    def append_then_stop(self, rec):
        append(self, rec)
        control.request_stop()

    monkeypatch.setattr(ResultStore, "append", append_then_stop)
    with pytest.raises(control.Interrupted, match="1 of 3 cells finished"):
        mqar.run_mqar(cells, tmp_path, dtype=DTYPE, progress="none", stack=True)
    monkeypatch.setattr(ResultStore, "append", append)
    store = mqar.results_store(tmp_path)
    assert [r["lr"] for r in store.records()] == [1e30]
    trained = []
    train_stacked = stack.train_stacked

    def counting(lm_config, variants, **kw):
        trained.append([v[2].lr for v in variants])
        return train_stacked(lm_config, variants, **kw)

    monkeypatch.setattr(stack, "train_stacked", counting)
    recs = mqar.run_mqar(cells, tmp_path, dtype=DTYPE, progress="none", stack=True)
    assert trained == [[3e-3, 1e-2]] and [r["lr"] for r in recs] == [3e-3, 1e30, 1e-2]
    for c, r in zip(cells, recs):
        if c.lr != 1e30:
            a, _ = _alone(c)
            assert r["accuracy"] == pytest.approx(a["accuracy"], abs=STACKED_F64)
            assert r["history"][-1]["loss"] == pytest.approx(a["history"][-1]["loss"], rel=STACKED_LOSS_REL)
    trained.clear()
    assert len(mqar.run_mqar(cells, tmp_path, dtype=DTYPE, progress="none", stack=True)) == 3 and trained == []


def test_records_of_a_stacked_sweep_are_the_unstacked_ones(tmp_path):
    """The same keys and fields as a sweep of train_cell runs (GLA, stacked); a model that does not stack (MesaNet)
    trains one at a time."""
    gla = _cell("gla", epochs=1, setting="L48-kv4", train_segments=((48, 4, 32),), test_segments=((48, 4, 16),),
                chunk_size=48, vocab_size=64)  # (a diagonal decay over 3 blocks of 16 rows: the functional form)
    cells = _variants(gla, _draw_variants(2)) + _variants(_cell("mesanet", epochs=1), _draw_variants(2))
    assert mqar.stack_support(cells[0]) is None and "setup_context" in mqar.stack_support(cells[2])
    on = mqar.run_mqar(cells, tmp_path / "on", dtype=DTYPE, progress="none", stack=True)
    off = mqar.run_mqar(cells, tmp_path / "off", dtype=DTYPE, progress="none", stack=False)
    assert [r["key"] for r in on] == [r["key"] for r in off] and len(on) == 4
    for a, b in zip(on, off):
        assert set(a) == set(b)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=STACKED_F64)
        assert a["history"][-1]["loss"] == pytest.approx(b["history"][-1]["loss"], rel=STACKED_LOSS_REL)


def test_the_protocol_reads_the_same_stacked_or_not(tmp_path):
    """ceilings-v2-tiny's grid for TTT-MLP (2 lrs × 2 seeds at two kv), stacked and not: the same summaries (best
    and median, their lr and seed, the seeds)."""
    cells = mqar.make_cells(mqar.PRESETS["ceilings-v2-tiny"], models=["ttt_mlp"], seed=random.randrange(10))
    reads = []
    for stacked in (True, False):
        recs, _ = protocol.run_protocol(cells, tmp_path / str(stacked), extra=0, cap=2, dtype=DTYPE,
                                        progress="none", log=lambda *_: None, stack=stacked)
        assert len(recs) == len(cells)
        reads.append(protocol.summarize(recs))
    for a, b in zip(*reads):
        for k in ("model", "setting", "lrs", "seeds", "best_lr", "best_seed", "median_lr", "runs", "state_bytes"):
            assert a[k] == b[k], k
        assert a["best"] == pytest.approx(b["best"], abs=STACKED_F64)
        assert a["median"] == pytest.approx(b["median"], abs=STACKED_F64)



def test_cli_refuses_stack_beside_workers(tmp_path, capsys):
    """`--stack` trains a group in one process: beside `--workers 2` it is one line and status 2, before any work."""
    from fastweights.cli import main

    assert main(["mqar", "--preset", "ceilings-v2-tiny", "--stack", "--workers", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stack" in err[0] and "--no-stack" in err[0]
    assert not (tmp_path / "results.jsonl").exists()


def test_a_stacked_group_builds_its_model_on_the_torch_backend():
    """vmap runs torch ops, not the Triton/CUDA rows' kernels: a stacked group's model requests the torch backend
    for every layer's training form and layer ops, and is initialised as the cell's own model."""
    cell = _cell("gated_deltanet")
    cfg = mqar.stacked_lm_config(cell)
    seed = random.randrange(1000)
    torch.manual_seed(seed)
    ours = mqar.build_lm(cfg)
    torch.manual_seed(seed)
    theirs = mqar.build_model(cell)
    assert ours.backends == ("torch",) * cell.n_layers and cfg.layer_ops == "torch"
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
