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
    (["bench", "decode", "--out", "/proc/version/x"], "--out"), (["bench", "decode", "--out", ""], "--out is empty"),
    (["bench", "speed", "--out", ""], "--out is empty"), (["capacity", "--out", ""], "--out is empty"),
    (["mqar", "--out", ""], "--out is empty")])
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


# ------------------------------------------------------------------------------------------ eval
def _checkpoint(d, weights=True):
    """A directory shaped like a checkpoint: JSON config.json and a readable safetensors file."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if weights:
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("case, message", [
    ("missing", "error: --model_args pretrained={p}: no such directory; expected a checkpoint directory holding "
                "config.json and the weights (model.safetensors), such as the model/ directory of a "
                "`fastweights train` run"),
    ("run", "error: --model_args pretrained={p}: is a `fastweights train` run directory, not a checkpoint; the run "
            "directory's checkpoint is at {p}/model"),
    ("file", "error: --model_args pretrained={p}: is a file; expected a checkpoint directory"),
    ("empty", "error: --model_args pretrained={p}: holds no config.json; expected a checkpoint directory"),
    ("no weights", "error: --model_args pretrained={p}: holds config.json but no weights"),
])
@pytest.mark.parametrize("form", ["pair", "equals", "json"])
def test_eval_says_what_was_given_and_what_a_checkpoint_is(case, message, form, tmp_path, monkeypatch, capsys):
    import fastweights.hf.harness as harness

    monkeypatch.setattr(harness, "main", lambda argv: pytest.fail("lm-eval was started on a bad checkpoint"))
    p = tmp_path / "runs" / "lm"
    if case == "run":  # (as `fastweights train` leaves it: its own config.json beside model/)
        _checkpoint(p / "model")
        for name in ("checkpoint.pt", "config.json", "log.jsonl"):
            (p / name).write_text("{}")
    elif case == "file":
        p.parent.mkdir()
        p.write_text("x")
    elif case == "empty":
        p.mkdir(parents=True)
    elif case == "no weights":
        _checkpoint(p, weights=False)
    args = {"pair": ["--model_args", f"pretrained={p},dtype=float32"], "equals": [f"--model_args=pretrained={p}"],
            "json": ["-a", json.dumps({"pretrained": str(p)})]}[form]
    assert cli.main(["eval", "--model", "fastweights", *args, "--tasks", "t"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(p=p)) and not cap.out, err


def test_eval_passes_a_checkpoint_or_a_hub_id_through(tmp_path, monkeypatch):
    import fastweights.hf.harness as harness

    seen = []
    monkeypatch.setattr(harness, "main", lambda argv: seen.append(argv))
    ckpt = _checkpoint(tmp_path / "run" / "model")
    for value in (str(ckpt), "org/some-model"):  # (a Hub id that is no local path is the loader's to resolve)
        assert cli.main(["eval", "--model", "hf", "--model_args", f"pretrained={value}", "--tasks", "t"]) == 0
    assert [a[3] for a in seen] == [f"pretrained={ckpt}", "pretrained=org/some-model"]


def _eval_refused(argv, message, monkeypatch, capsys):
    import fastweights.hf.harness as harness

    monkeypatch.setattr(harness, "main", lambda argv: pytest.fail("lm-eval was started on a bad argument"))
    assert cli.main(["eval", *argv]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message) and not cap.out and "Traceback" not in cap.err, cap.err


def test_eval_a_missing_local_dir_name_path_never_goes_to_the_hub(tmp_path, monkeypatch, capsys):
    """`runs/lm` beside a local runs/ is a local path: refused at once (it was looked up on the Hub)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    _eval_refused(["--model", "fastweights", "--model_args", "pretrained=runs/lm", "--tasks", "t"],
                  "error: --model_args pretrained=runs/lm: no such directory; expected a checkpoint directory",
                  monkeypatch, capsys)


@pytest.mark.parametrize("case, message", [
    ("dtype", "error: --model_args dtype=int7: expected auto or a floating torch dtype (float32, bfloat16"),
    ("no pretrained", "error: --model_args: no pretrained=DIR; --model fastweights needs the checkpoint directory"),
    ("cuda", "error: --device cuda: this torch build sees no CUDA device"),
    ("truncated", "error: --model_args pretrained={p}: {p}/model.safetensors is a corrupt or truncated safetensors "
                  "file"),
    ("config", "error: --model_args pretrained={p}: {p}/config.json is not JSON"),
    # backend= was dropped without a word; device= gave lm-eval's "got multiple values for keyword argument 'device'"
    ("backend", "error: --model_args backend=triton: the fastweights model is a causal LM (lm-eval's backend"),
    ("device", "error: --model_args device=cpu: give the device once, as --device cpu"),
])
def test_eval_bad_arguments_are_one_line_before_lm_eval(case, message, tmp_path, monkeypatch, capsys):
    import torch

    p = _checkpoint(tmp_path / "ckpt")
    args = {"dtype": ["--model_args", f"pretrained={p},dtype=int7"], "no pretrained": ["-a", "dtype=float32"],
            "cuda": ["-a", f"pretrained={p}", "--device", "cuda"], "backend": ["-a", f"pretrained={p},backend=triton"],
            "device": ["-a", f"pretrained={p},device=cpu"]}.get(case, ["-a", f"pretrained={p}"])
    if case == "truncated":
        (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:20])
    if case == "config":
        (p / "config.json").write_text("{not json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (the same answer on a GPU machine)
    _eval_refused(["--model", "fastweights", *args, "--tasks", "t"], message.format(p=p), monkeypatch, capsys)


@pytest.mark.parametrize("raised, message", [
    (ValueError("Tasks not found: nosuchtask"), "error: --tasks: lm-eval knows no task nosuchtask (`lm-eval ls "
                                                "tasks` lists them"),
    (OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection."),
     "error: lm-eval stopped: OSError: We couldn't connect to 'https://huggingface.co' to load the files."),
])
def test_eval_errors_lm_eval_raises_are_one_line(raised, message, tmp_path, monkeypatch, capsys):
    """What only lm-eval can find (its task names; the Hub): one line and status 2, not its traceback."""
    import fastweights.hf.harness as harness

    def lm_eval(argv):
        raise raised

    monkeypatch.setattr(harness, "main", lm_eval)
    assert cli.main(["eval", "--model", "fastweights", "-a", f"pretrained={_checkpoint(tmp_path / 'c')}",
                     "--tasks", "nosuchtask"]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines()[0].startswith(message) and len(cap.err.strip().splitlines()) == 1, cap.err


def test_eval_hands_lm_evals_other_commands_through_unchecked(monkeypatch):
    """`ls` and `validate` load no model: no pretrained is asked for."""
    import fastweights.hf.harness as harness

    seen = []
    monkeypatch.setattr(harness, "main", lambda argv: seen.append(argv))
    for argv in (["ls", "tasks"], ["validate", "--tasks", "t"], ["--help"]):
        assert cli.main(["eval", *argv]) == 0
    assert seen == [["ls", "tasks"], ["validate", "--tasks", "t"], ["--help"]]


def test_python_dash_m_fastweights_is_the_console_script(monkeypatch):
    """`python -m fastweights` ran nothing: 'fastweights' is a package and cannot be directly executed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(cli.__file__).resolve().parents[1])
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-m", "fastweights", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    monkeypatch.setenv("COLUMNS", "100")
    assert got.returncode == 0, got.stderr
    assert got.stdout == cli.build_parser().format_help()


def test_version_is_the_package_version(capsys):
    """`fastweights --version` said "invalid choice"; it prints the installed package's version and exits 0."""
    import fastweights

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastweights {fastweights.__version__}"
