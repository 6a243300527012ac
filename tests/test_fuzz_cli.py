"""Fuzzing every `fastweights` subcommand's flags (hypothesis; issue 26), in process through
`fastweights.cli.main([...])`.

The flags are read from the parser itself (so a new flag is fuzzed without editing this file); each
example gives one flag a malformed value for its kind — a word where a number goes, a fraction for an
int, a negative size, nan/inf, an unknown choice, zoo name, device or form, an unwritable path — on top
of a valid baseline. The command must exit with status 2 and one line on stderr naming the flag, before
any work starts: the functions that start the work are replaced by a sentinel, so a malformed value
that slips through is caught (a "silent" verdict) without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastweights import cli
from tests.fuzz import record, watchdog

# derandomize: CI draws the same cases every run (a red CI is a finding, never chance); explore others with
# FASTWEIGHTS_FUZZ_DERANDOMIZE=0 (and --hypothesis-seed=N)
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    derandomize=os.environ.get("FASTWEIGHTS_FUZZ_DERANDOMIZE", "1") != "0",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Started(BaseException):
    """The command got past its checks and started working (a BaseException: no handler swallows it)."""


WORK = ["fastweights.demo.run_demo", "fastweights.bench.speed.run_speed", "fastweights.bench.decode.run_decode",
        "fastweights.bench.train.run_train", "fastweights.bench.floors.run_floors",
        "fastweights.lab.capacity.run_capacity",
        "fastweights.cliargs.run_sweep_command", "fastweights.pretrain.loop.train"]


@pytest.fixture
def no_work(monkeypatch):
    def started(*args, **kwargs):
        raise Started()

    for path in WORK:
        module, name = path.rsplit(".", 1)
        monkeypatch.setattr(f"{module}.{name}", started)


def _commands():
    """(argv prefix, parser) of every subcommand that takes flags (eval passes everything to lm-eval)."""
    out = []

    def walk(parser, prefix):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, prefix + [name])
        flags = [a for a in parser._actions if a.option_strings and _bad_values(a)]
        if prefix and prefix != ["eval"] and flags:
            out.append((prefix, flags))

    walk(cli.build_parser(), [])
    return [(prefix, flags) for prefix, flags in out if tuple(prefix) not in DEFERRED]


UNWRITABLE = "/proc/version/x"
WORDS = {"--models": ["bogus_model"], "--forms": ["fast"], "--device": ["tpu", "cuda:7"], "--out": [UNWRITABLE],
         "--json": [UNWRITABLE + ".json"], "--settings": ["bogus"], "--tasks": ["bogus"], "--shapes": ["4x8", "0,16"],
         "--backend": ["nope"], "--config": ["/nonexistent/run.json"], "--preset": ["nope"],
         "--dtype": ["float8"], "--parallel": ["mpi"], "--progress": ["maybe"], "--model": ["d_model"],
         "--tokenizer": ["/nonexistent/tokenizer"], "--init-from": ["/nonexistent/model"], "--text-key": [""]}


def _bad_values(action) -> list[str]:
    """Values that are malformed for this flag, whatever the command."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)):
        return []
    flag = action.option_strings[-1]
    if action.choices:
        return ["bogus"]
    if action.type is int:
        return ["x", "2.5", "-7", "", "1e3"]
    if action.type is float:
        return ["nan", "inf", "-1", "x", ""]
    return WORDS.get(flag, [])


#: Commands fuzzed by the census but not asserted here (their checks live on another branch). Empty:
#: `train --min-lr nan`, `--val-fraction nan` and `--device cuda:7` (no such device) are refused before work.
DEFERRED: set[tuple[str, ...]] = set()

#: a valid value for the flags a command needs (the rest keep their defaults)
BASELINE = {("train",): ["--data", "{data}", "--out", "{tmp}/run"]}


def _run(argv) -> tuple[str, str]:
    """(verdict, detail) of `fastweights argv` with a malformed flag value."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with watchdog(60), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except Started:
        return "silent", "the command started its work"
    except SystemExit as e:
        rc = e.code
    except BaseException as e:  # noqa: BLE001 — a traceback out of main is the finding
        return ("hang" if type(e).__name__ == "Hang" else "raw"), f"{type(e).__name__}: {str(e)[:300]}"
    if rc == 2:
        return "clear", err.getvalue().strip()
    return ("silent" if rc == 0 else "raw"), f"exit status {rc}; stderr: {err.getvalue().strip()[:300]}"


COMMANDS = _commands()


@SETTINGS
@given(data=st.data())
def test_every_flag_rejects_malformed_values_naming_the_flag(data, no_work, tmp_path):
    prefix, flags = data.draw(st.sampled_from(COMMANDS), label="command")
    action = data.draw(st.sampled_from(flags), label="flag")
    flag = action.option_strings[-1]
    bad = data.draw(st.sampled_from(_bad_values(action)), label="value")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world. " * 200)
    base = [a.format(data=corpus, tmp=tmp_path) for a in BASELINE.get(tuple(prefix), [])]
    if flag in base:  # the mutated flag replaces its baseline value
        i = base.index(flag)
        base = base[:i] + base[i + 2:]
    argv = [*prefix, *base, flag, bad]
    verdict, detail = _run(argv)
    names = {flag, action.dest, action.dest.replace("_", "-")}
    if verdict == "clear" and not any(n in detail for n in names):
        verdict = "unnamed"
    if verdict == "clear" and len(detail.splitlines()) != 1:
        verdict, detail = "raw", f"{len(detail.splitlines())} lines on stderr: {detail[:300]}"
    record("fastweights " + " ".join(prefix), " ".join(argv), verdict, detail)
