"""scripts/lora_finetune.py (docs/hf.md, "LoRA with peft") runs at a tiny size: the base trains, the LoRA
run keeps the base weights and trains every adapter, the plot is written; a bad flag is one line and
status 2."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lora_finetune.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("lora_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lora_script_runs_at_a_tiny_size(script, tmp_path):
    out = script.run(steps=3, base_steps=2, d_model=16, T=16, batch=2, rank=2, seed=1, plot=tmp_path / "l.png")
    assert len(out["base_losses"]) == 2 and len(out["lora_losses"]) == 3
    assert out["base_weights_unchanged"] and 0 < out["trainable"] < out["parameters"]
    n = out["adapters_trained"].split("/")[1]
    assert out["adapters_trained"] == f"{n}/{n}" and int(n) == 2 * 7  # every adapter of both layers trained
    assert (tmp_path / "l.png").stat().st_size > 0


def test_a_bad_flag_is_one_line_and_status_2(script, capsys):
    assert script.main(["--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps" in err
