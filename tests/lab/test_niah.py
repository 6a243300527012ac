"""`fastweights niah` (fastweights.lab.niah): scoring with a stub generator, greedy cached decoding,
an end-to-end tiny run (records, table shape, markdown, PNG), resume, CLI parsing, published table."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fastweights.lab import niah as lab
from fastweights.tasks.niah import ByteTokenizer, make_niah


def _oracle(task, length, n, seed=42):
    """A generate fn that appends each example's true answer (it knows the data by its prompt)."""
    answers = {tuple(ex["input_ids"].tolist()): ex["answer_ids"] for ex in make_niah(task, length, n, seed)}

    def gen(ids, n_new):
        rows = [torch.cat([row, answers[tuple(row.tolist())][:n_new]]) for row in ids]
        return torch.stack(rows)

    return gen


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_3"])
def test_right_answer_scores_100_and_wrong_0(task):
    good = lab.evaluate_cell(_oracle(task, 600, 3), task, 600, 3, batch_size=2)
    assert good["score"] == 100.0 and good["hits"] == 3 and good["n"] == 3 and good["char_acc"] == 100.0
    assert all(s["prediction"].strip() == s["answer"] for s in good["samples"])

    tok = ByteTokenizer()

    def wrong(ids, n_new):
        return torch.cat([ids, torch.tensor([tok.encode(" 0000000000" * 5)[:n_new]] * ids.shape[0])], 1)

    bad = lab.evaluate_cell(wrong, task, 600, 3, batch_size=3)
    assert bad["score"] == 0.0 and bad["hits"] == 0 and bad["char_acc"] < 100.0


def test_case_insensitive_and_partial_scores():
    task = "niah_single_3"
    exs = make_niah(task, 600, 2, 42)
    answers = {tuple(ex["input_ids"].tolist()): ex["answer"] for ex in exs}
    tok = ByteTokenizer()

    def upper_first_only(ids, n_new):
        rows = []
        for i, row in enumerate(ids):
            ans = answers[tuple(row.tolist())]
            text = (" " + ans.upper()) if i == 0 else " " + "x" * len(ans)
            rows.append(torch.cat([row, torch.tensor(tok.encode(text)[:n_new])]))
        return torch.stack(rows)

    cell = lab.evaluate_cell(upper_first_only, task, 600, 2, batch_size=2)
    assert cell["score"] == 50.0  # the upper-cased uuid matches (case-insensitive), the other does not
    assert cell["char_acc"] == pytest.approx(50.0 + 50.0 * exs[1]["answer"].count("x") / len(exs[1]["answer"]))


def test_greedy_generate_matches_uncached_generate():
    from fastweights.models import LM, LMConfig

    torch.manual_seed(0)
    for mixer in ("gated_deltanet", "softmax_attention"):
        m = LM(LMConfig(vocab_size=260, d_model=32, n_layers=2, mixer=mixer, num_heads=2, mlp="none")).eval()
        ids = torch.randint(0, 256, (2, 70))
        ours = lab.greedy_generate(m, ids, 5, prefill_chunk=32)  # 3 prefill pieces, then steps
        ref = m.generate(ids, 5, use_cache=False)
        assert torch.equal(ours, ref), mixer


def test_config_validation():
    with pytest.raises(ValueError, match="too small"):
        lab.NIAHConfig(train_len=300)
    with pytest.raises(ValueError):
        lab.NIAHConfig(models=("not_a_model",))
    with pytest.raises(ValueError):
        lab.NIAHConfig(lengths=())
    assert lab.NIAHConfig(tasks=("passkey", "uuid")).tasks == ("niah_single_1", "niah_single_3")
    with pytest.raises(ValueError, match="preset"):
        lab.preset("huge")
    with pytest.raises(ValueError, match="out_gate"):
        lab.NIAHConfig(out_gate="bogus")


def test_out_gate_none_builds_gateless_layers_and_keys_the_training():
    cfg = lab.NIAHConfig(models=("gated_deltanet",), out_gate="none")
    lm_cfg = cfg.lm_config("gated_deltanet")
    assert dict(lm_cfg.mixer_overrides) == {"out_gate": "none"}
    assert cfg.train_signature()["out_gate"] == "none"  # a model trained with the gates is not reused
    assert "out_gate" not in lab.NIAHConfig().train_signature()


def _tiny(tmp_path, **kw):
    base = dict(models=("deltanet", "mamba2"), tasks=("niah_single_1", "niah_single_2"), lengths=(512, 600),
                train_len=450, train_examples=4, test_examples=2, eval_examples=2, d_model=16, n_layers=1,
                num_heads=1, epochs=1, batch_size=4, warmup=0, eval_batch_size=2, prefill_chunk=256, threads=1,
                out=str(tmp_path / "niah"))
    base.update(kw)
    return lab.NIAHConfig(**base)


def test_end_to_end_tiny_run_and_resume(tmp_path):
    cfg = _tiny(tmp_path)
    logs: list[str] = []
    recs = lab.run_niah(cfg, progress=False, log=logs.append)
    assert len(recs) == 2 * 2 * 2
    assert {(r["model"], r["task"], r["context_len"]) for r in recs} == {
        (m, t, L) for m in cfg.models for t in cfg.tasks for L in cfg.lengths}
    for r in recs:
        assert 0.0 <= r["score"] <= 100.0 and r["n"] == 2 and r["kind"] == "eval"
        assert len(r["samples"]) == 2 and set(r["samples"][0]) == {"answer", "prediction"}
    lines = [json.loads(x) for x in (tmp_path / "niah" / "niah.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "train" for r in lines) == 2 and sum(r["kind"] == "eval" for r in lines) == 8
    assert (tmp_path / "niah" / "models" / "deltanet" / "config.json").exists()

    # Table 2's shape: one row per model, one column per task x length.
    table = lab.format_table(recs, models=cfg.models, tasks=cfg.tasks, lengths=cfg.lengths)
    rows = table.splitlines()
    assert len(rows) == 2 + 2
    assert rows[0].count("|") == 2 + 4  # model + 2 tasks x 2 lengths
    assert "S-NIAH-1 512" in rows[0] and "S-NIAH-2 600" in rows[0]

    md = lab.write_report(cfg, recs, wall_s=1.0, command="fastweights niah --preset small")
    text = md.read_text()
    assert "Published" in text and "1.3B" in text and "NOT the same scale" in text
    png = lab.plot_niah(recs, tmp_path / "niah" / "niah.png")
    assert png.stat().st_size > 1000

    # Resume: every cell is in the store, so nothing is trained or evaluated again.
    logs.clear()
    again = lab.run_niah(cfg, progress=False, log=logs.append)
    assert all("every cell done" in line for line in logs) and len(logs) == 2
    assert [r["score"] for r in again] == [r["score"] for r in recs]
    assert len((tmp_path / "niah" / "niah.jsonl").read_text().splitlines()) == 10

    # A new length reuses the saved model (no second train record) and evaluates only the new cells.
    cfg2 = _tiny(tmp_path, lengths=(512, 600, 700), models=("deltanet",))
    logs.clear()
    recs2 = lab.run_niah(cfg2, progress=False, log=logs.append)
    assert len(recs2) == 2 * 3
    evals = [line for line in logs if "@" in line]
    assert len(evals) == 2 and all("@ 700" in line for line in evals)
    lines = [json.loads(x) for x in (tmp_path / "niah" / "niah.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "train" for r in lines) == 2


def test_stub_generator_through_run(tmp_path):
    """run_niah with a generate_factory that answers correctly scores 100 in every cell."""
    cfg = _tiny(tmp_path, models=("mamba2",), lengths=(512,))
    oracles = {t: _oracle(t, 512, 2) for t in cfg.tasks}

    def factory(model):
        def gen(ids, n_new):
            for o in oracles.values():
                try:
                    return o(ids, n_new)
                except KeyError:
                    continue
            raise AssertionError("unknown prompt")

        return gen

    recs = lab.run_niah(cfg, progress=False, log=None, generate_factory=factory)
    assert [r["score"] for r in recs] == [100.0, 100.0]


def test_published_table():
    text = lab.format_published()
    lines = text.splitlines()
    assert len(lines) == 2 + 3 and lines[0].count("|") == 2 + 12
    gdn = next(line for line in lines if "gated_deltanet" in line)
    assert "| 98.4 | 88.4 | 91.4 | 91.8 | 100.0 | 99.8 | 92.2 | 29.6 | 86.6 | 84.2 | 27.6 | – |" in gdn


def test_cli_parses_and_runs(tmp_path, capsys):
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    p = lab.add_cli(sub)
    out = tmp_path / "cli"
    args = p.parse_args(["--models", "mamba2", "--tasks", "passkey", "--lengths", "512", "--train-len", "450",
                         "--train-examples", "4", "--test-examples", "2", "--eval-examples", "2", "--d-model", "16",
                         "--n-layers", "1", "--num-heads", "1", "--epochs", "1", "--batch-size", "4", "--warmup", "0",
                         "--out", str(out), "--no-progress"])
    assert args.fn is lab.cli_main
    assert lab.cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "published" in printed and "mamba2" in printed
    assert (out / "niah.md").exists() and (out / "niah.png").exists() and (out / "niah.jsonl").exists()
    bad = p.parse_args(["--models", "nope", "--out", str(out)])
    assert lab.cli_main(bad) == 2


def test_other_training_or_eval_settings_never_reuse_results(tmp_path):
    """Issue 12: a 2-epoch run, then 1 epoch, a wider model and more eval examples on the same out."""
    logs: list[str] = []
    two = lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), epochs=2), progress=False,
                       log=logs.append)
    one = lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), epochs=1), progress=False,
                       log=logs.append)
    assert not any("every cell done" in ln for ln in logs)  # the 1-epoch run did its own cells
    assert {r["signature"]["epochs"] for r in two} == {2} and {r["signature"]["epochs"] for r in one} == {1}
    train = [r for r in lab._records(tmp_path / "niah" / "niah.jsonl") if r["kind"] == "train"]
    assert [(r["signature"]["epochs"], r["train_epochs_run"], r["train_resumed_from"]) for r in train] == [
        (2, 2, 0), (1, 1, 0)]  # not "resumed after epoch 2" and recorded as 1 epoch
    wide = lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), d_model=32), progress=False, log=None)
    assert {r["signature"]["d_model"] for r in wide} == {32}  # no state_dict size mismatch
    more = lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), eval_examples=3), progress=False,
                        log=None)
    assert {r["n"] for r in more} == {3}
    logs.clear()
    again = lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), epochs=1), progress=False,
                         log=logs.append)
    assert [r["score"] for r in again] == [r["score"] for r in one] and "every cell done" in logs[0]
    logs.clear()
    lab.run_niah(_tiny(tmp_path, models=("deltanet",), lengths=(512,), epochs=1), progress=False, log=logs.append,
                 fresh=True)
    assert any("trained in" in ln for ln in logs)


@pytest.mark.parametrize("argv, flag", [(["--device", "tpu"], "--device"), (["--threads", "-2"], "--threads"),
                                        (["--models", "foo"], "--models"), (["--epochs", "0"], "--epochs"),
                                        (["--lr", "nan"], "--lr"), (["--out", "/proc/version/x"], "--out")])
def test_cli_rejects_bad_values_in_one_line(argv, flag, tmp_path, capsys):
    p = lab.add_cli(argparse.ArgumentParser().add_subparsers(dest="command"))
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "x")]
    assert lab.cli_main(p.parse_args(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err


def test_a_model_held_by_another_process_is_waited_for_not_trained_twice(tmp_path):
    import threading
    import time

    from fastweights.lab.control import CellLock

    cfg = _tiny(tmp_path, models=("deltanet", "mamba2"), lengths=(512,), tasks=("niah_single_1",))
    tag = lab._digest(cfg.eval_signature())
    held = CellLock.acquire(tmp_path / "niah" / ".niah.locks", f"deltanet|{tag}")  # "another process"
    logs: list[str] = []
    result: list = []
    t = threading.Thread(target=lambda: result.append(lab.run_niah(cfg, progress=False, log=logs.append)))
    t.start()
    deadline = time.monotonic() + 60
    while not any("waiting" in ln for ln in logs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("deltanet: being trained by another process" in ln for ln in logs), logs
    assert any("mamba2: trained" in ln for ln in logs)  # it took the model nobody held
    assert t.is_alive()
    held.release()
    t.join(timeout=60)
    assert not t.is_alive() and len(result[0]) == 2
    assert sum("deltanet: trained" in ln for ln in logs) == 1
