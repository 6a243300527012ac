"""`fastweights bench speed`: arguments checked before anything is timed, a printed table with a
speed-up column against the recurrent form, --repeats/--warmup/--threads honoured."""

from __future__ import annotations

import json

import pytest
import torch

from fastweights import cli


def test_tiny_run_prints_the_table_with_speedups(tmp_path, capsys):
    n = torch.get_num_threads()
    try:
        rc = cli.main(["bench", "speed", "--models", "deltanet", "gla", "--forms", "chunk", "recurrent",
                       "--lengths", "16", "32", "--heads", "1", "--dim", "8", "--chunk-size", "8", "--repeats", "2",
                       "--warmup", "0", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("| impl |"))
    assert "speed-up fwd" in out[head] and "speed-up fwd+bwd" in out[head]
    assert out[head - 1].startswith("bench speed: 8 rows") and "torch threads 1" in out[head - 1]
    rows = [ln for ln in out if ln.startswith("| fastweights |")]
    assert len(rows) == 8
    assert [r.split(" | ")[2] for r in rows[:2]] == ["recurrent", "chunk"]  # the speed-up base is timed first
    assert rows[0].split(" | ")[6] == "1.0×" and rows[1].split(" | ")[6].endswith("×")
    assert "s left)" in rows[-2] and "s left)" not in rows[-1]  # an estimate once the first length is done
    recs = json.loads((tmp_path / "speed.json").read_text())
    chunk = next(r for r in recs if r["form"] == "chunk" and r["model"] == "gla" and r["T"] == 32)
    rec = next(r for r in recs if r["form"] == "recurrent" and r["model"] == "gla" and r["T"] == 32)
    assert chunk["speedup_fwd"] == pytest.approx(rec["fwd_ms"] / chunk["fwd_ms"])
    assert "speed-up" in (tmp_path / "speed.md").read_text()


@pytest.mark.parametrize("argv, flag", [(["--forms", "fast"], "--forms"), (["--lengths", "0"], "--lengths"),
                                        (["--dim", "-4"], "--dim"), (["--models", "foo"], "--models"),
                                        (["--repeats", "0"], "--repeats"), (["--threads", "-1"], "--threads"),
                                        (["--device", "tpu"], "--device"), (["--out", "/proc/version/x"], "--out"),
                                        (["--heads", "2", "--value-heads", "3"], "--value-heads")])
def test_bad_arguments_are_one_line_before_any_timing(argv, flag, tmp_path, capsys):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "x")]
    assert cli.main(["bench", "speed", *argv]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}") and not cap.out, err
    assert not (tmp_path / "x").exists()


def test_triton_rows_on_a_cpu_without_the_interpreter_are_refused_not_failed_row_by_row(tmp_path, capsys,
                                                                                          monkeypatch):
    """--forms chunk_triton --device cpu (the interpreter off) failed every row and exited 1."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["bench", "speed", "--models", "deltanet", "--forms", "chunk", "chunk_triton", "--device", "cpu",
                     "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --forms chunk_triton runs the Triton kernels: it needs "
                                               "--device cuda, got 'cpu'"), err
    assert not (tmp_path / "x").exists()


def test_models_without_any_of_the_forms_are_refused_not_an_empty_table(tmp_path, capsys):
    """softmax_attention has no chunk form: the run wrote a table of 0 rows and exited 0."""
    assert cli.main(["bench", "speed", "--models", "softmax_attention", "--forms", "chunk", "chunk_compile",
                     "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no row to run: softmax_attention has no chunk/chunk_compile form (check --models and "
                   "--forms)"], err
    assert not (tmp_path / "x").exists()


def test_grouped_value_heads_reach_the_model_unexpanded(tmp_path, capsys):
    """--value-heads HV: q and k with --heads H, v, the gates and the output with HV heads, recorded per row."""
    from fastweights.bench.speed import bench_inputs

    inp = bench_inputs("gated_deltanet", 1, 8, 2, 4, torch.float32, "cpu", HV=6)
    assert inp["q"].shape[2] == inp["k"].shape[2] == 2 and inp["v"].shape[2] == inp["g"].shape[2] == 6
    assert all(t.is_leaf and t.requires_grad for t in (inp["q"], inp["k"], inp["v"]))
    dp = bench_inputs("deltaproduct", 1, 8, 2, 4, torch.float32, "cpu", HV=4)
    assert dp["k"].shape[2:4] == (2, 2) and dp["v"].shape[2:4] == (2, 4)  # [B, T, n_h, H, D]
    rc = cli.main(["bench", "speed", "--models", "gated_deltanet", "--forms", "chunk", "--lengths", "16",
                   "--heads", "1", "--value-heads", "2", "--dim", "8", "--chunk-size", "8", "--repeats", "1",
                   "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "speed.json").read_text())[0]
    assert (rec["H"], rec["HV"]) == (1, 2) and rec["error"] == "" and rec["fwd_ms"] > 0
    assert "1×16×1/2×8" in capsys.readouterr().out


@pytest.mark.parametrize("keep_going", [False, True])
def test_a_failed_row_fails_the_run_unless_keep_going(keep_going, tmp_path, capsys):
    """The Triton rows on the CPU fail (their error stays in the table): exit 1 and one line saying so,
    not exit 0 with the error only in a cell; --keep-going exits 0."""
    argv = ["bench", "speed", "--models", "gla", "--forms", "recurrent", "chunk_triton", "--lengths", "8",
            "--heads", "1", "--dim", "4", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
    n = torch.get_num_threads()
    try:
        rc = cli.main(argv + (["--keep-going"] if keep_going else []))
    finally:
        torch.set_num_threads(n)
    cap = capsys.readouterr()
    recs = json.loads((tmp_path / "speed.json").read_text())
    assert [bool(r["error"]) for r in recs] == [False, True]
    if keep_going:
        assert rc == 0 and "rows failed" not in cap.err
    else:
        assert rc == 1
        assert cap.err.strip().startswith("error: 1 of 2 rows failed") and "gla chunk_triton T=8" in cap.err
        assert "--keep-going" in cap.err


def test_fla_ttt_linear_case_passes_fla_its_arguments(monkeypatch):
    """The TTT-Linear peer row (fla's `chunk_ttt_linear`, a stand-in module here: fla is no dependency): q, k, v as
    ours, the LayerNorm's affine as w, b [H, D], η = our β as [B, T, H, 1], mini-batches of 16; the output is fla's
    first return value and the trainable leaves include every input fla differentiates."""
    import sys
    import types

    import torch

    from fastweights.bench import speed

    seen = {}

    def chunk_ttt_linear(q, k, v, w, b, eta, chunk_size=16, **kw):
        seen.update(q=q, k=k, v=v, w=w, b=b, eta=eta, chunk_size=chunk_size, kw=kw)
        return q * 2, None

    fla, ops, ttt = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.ttt"))
    ttt.chunk_ttt_linear = chunk_ttt_linear
    fla.ops, ops.ttt = ops, ttt
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.ttt", ttt)):
        monkeypatch.setitem(sys.modules, name, mod)
    B, T, H, D = 2, 5, 3, 4
    run, leaves = speed.fla_case("ttt_linear", B, T, H, D, torch.float32, "cpu")
    o = run()
    assert seen["q"].shape == seen["k"].shape == seen["v"].shape == (B, T, H, D)
    assert seen["w"].shape == seen["b"].shape == (H, D) and seen["eta"].shape == (B, T, H, 1)
    assert seen["chunk_size"] == 16 and not seen["kw"]
    assert torch.equal(o, seen["q"] * 2)
    assert any(t is seen["eta"]._base or t.data_ptr() == seen["eta"].data_ptr() for t in leaves)
    assert {id(seen[n]) for n in ("q", "k", "v", "w", "b")} <= {id(t) for t in leaves}
