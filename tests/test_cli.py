import json
import time

import pytest

from fastweights import cli, zoo


def test_zoo_table(capsys):
    assert cli.main(["zoo"]) == 0
    out = capsys.readouterr().out
    for name in zoo.names():
        assert name in out
    assert "retention" in out.splitlines()[0]


def test_zoo_json(capsys):
    assert cli.main(["zoo", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == zoo.names()
    assert all(r["citation"] for r in rows)


def test_demo_runs_every_form_and_they_agree(capsys):
    assert cli.main(["demo", "--seq-len", "9", "--models", "gated_deltanet", "mesanet", "titans"]) == 0
    out = capsys.readouterr().out
    assert "gated_deltanet" in out and "parallel" in out and "largest disagreement" in out


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--seq-len", "-5"], "--seq-len"), (["demo", "--models", "foo"], "--models"),
    (["capacity", "--d-k", "7"], "--d-k"), (["capacity", "--threads", "-2"], "--threads"),
    (["capacity", "--models", "foo"], "--models"), (["capacity", "--out", "/proc/version/x"], "--out"),
    (["capacity", "--json", "/proc/version/x.json"], "--json"), (["bench", "decode", "--models", "foo"], "--models"),
    (["bench", "decode", "--contexts", "0"], "--contexts"), (["bench", "decode", "--device", "tpu"], "--device"),
    (["bench", "decode", "--out", "/proc/version/x"], "--out")])
def test_every_command_rejects_bad_values_in_one_line_before_work(argv, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (default output directories land here, if anything were written)
    t0 = time.perf_counter()
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}") and not cap.out, err
    assert time.perf_counter() - t0 < 5  # before any work (the capacity probe alone takes seconds)
    assert not list(tmp_path.iterdir())


def test_capacity_says_what_d_k_must_be(capsys):
    assert cli.main(["capacity", "--d-k", "7"]) == 2
    assert "multiple of 8, at least 16" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import fastweights.demo

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(fastweights.demo, "run_demo", interrupted)
    assert cli.main(["demo", "--models", "deltanet"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: fastweights demo stopped on Ctrl-C"


@pytest.mark.parametrize("argv", [["mqar", "--epochs", "abc"], ["bench", "speed", "--dtype", "int8"],
                                  ["capacity", "--form", "x"], ["demo", "--bogus"]])
def test_argparse_errors_are_one_line_too(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
