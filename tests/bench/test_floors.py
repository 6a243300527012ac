"""`fastweights bench floors` (bench/floors.py): the FLOP counts it scales hold — B·H exactly, T linearly for the
mini-batch forms —, its bytes are the formula's, its table and CLI run, and bad arguments name themselves."""

from __future__ import annotations

import pytest
import torch

from fastweights.bench.floors import SHAPES, count_step_flops, floors_table, step_floor
from fastweights.inputs import InputError, example_inputs
from fastweights.state import state_tensors
from tests.tolerances import FLOOR_T_SCALING_REL

MODELS = ["gated_deltanet", "ttt_linear", "ttt_mlp", "titans", "mesanet", "omeganet", "atlas"]


@pytest.mark.parametrize("model", MODELS)
def test_heads_and_sequences_scale_the_count_exactly(model):
    """2 sequences × 3 heads cost 6 × one sequence of one head (the floors count one and multiply)."""
    one = count_step_flops(model, 32, 8)
    many = count_step_flops(model, 32, 8, B=2, H=3)
    assert one[0] > 0 and one[1] > 2 * one[0]  # a backward costs more than the forward it differentiates
    assert many == (6 * one[0], 6 * one[1])


@pytest.mark.parametrize("model", ["ttt_linear", "ttt_mlp", "titans", "omeganet", "atlas"])
def test_mini_batch_forms_are_linear_in_T(model):
    """The mini-batch forms cost the same per mini-batch: the forward of 128 tokens counts exactly 2 × 64 tokens', the
    step within FLOOR_T_SCALING_REL of it (count_len's scaling; the default counts at T)."""
    a, b = count_step_flops(model, 64, 8), count_step_flops(model, 128, 8)
    assert b[0] == 2 * a[0]
    assert 2 * a[1] <= b[1] <= 2 * a[1] * (1 + FLOOR_T_SCALING_REL)


def test_bytes_are_the_inputs_outputs_and_states():
    """fwd = inputs + o + 2·state and step = 3·inputs + 2·o + 4·state, from example_inputs' tensors in bf16."""
    B, T, H, D = 2, 64, 3, 16
    f = step_floor("titans", B, T, H, D)
    inp = example_inputs("titans", batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                         device="meta")
    state = inp.pop("initial_state")
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    i, o, s = nbytes(inp.values()), B * T * H * D * 2, nbytes(state_tensors(state))
    assert f.fwd_bytes == i + o + 2 * s and f.step_bytes == 3 * i + 2 * o + 4 * s
    assert f.floor_ms == pytest.approx(1e3 * max(f.step_flops / 989e12, f.step_bytes / 4.8e12))


def test_count_len_scales_linearly_and_is_checked():
    full = step_floor("ttt_linear", 1, 256, 1, 16)
    part = step_floor("ttt_linear", 1, 256, 1, 16, count_len=128)
    assert part.fwd_flops == full.fwd_flops and part.fwd_bytes == full.fwd_bytes
    assert part.step_flops == pytest.approx(full.step_flops, rel=FLOOR_T_SCALING_REL)
    with pytest.raises(InputError, match="count_len must be a multiple of chunk_size=64, got 100"):
        step_floor("ttt_linear", 1, 256, 1, 16, count_len=100)
    with pytest.raises(InputError, match="shapes must be among"):
        floors_table(["ttt_linear"], ["huge"])
    assert set(SHAPES) == {"small", "lm"}


def test_cli_prints_the_table(tmp_path, capsys):
    from fastweights.cli import main

    assert main(["bench", "floors", "--models", "gated_deltanet", "ttt_linear", "--shapes", "small",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ttt_linear | small 64×512×2×64 |" in out and "1.0×" in out
    assert (tmp_path / "floors.json").exists() and (tmp_path / "floors.md").read_text().startswith("| model |")
    assert main(["bench", "floors", "--models", "nope"]) != 0


def test_newton_schulz_counts_are_atlas_iterations(monkeypatch):
    """ATLAS at K = V = 8 (K' 45, hidden 32): one Newton–Schulz a token per weight matrix, Gram sides 32 and 8, each
    17 r × r products in the forward (5 steps: A², Q P after the first, Q A Q before the last) — 34 r³ FLOPs —, run
    again by the backward's recompute and differentiated (two products each): 4 × the forward's. Counted at B·H = 1,
    scaled by B·H. A model without Muon has none."""
    from fastweights.bench import floors
    from fastweights.bench.floors import count_newton_schulz, newton_schulz_table

    B, T, H = 2, 32, 3
    got = count_newton_schulz("atlas", B, T, H, 8)
    assert [c.r for c in got] == [8, 32]
    for c in got:
        assert (c.fwd_calls, c.step_calls, c.steps) == (B * T * H, 2 * B * T * H, 5)
        assert c.fwd_flops == 34 * c.r ** 3 * B * T * H and c.step_flops == 4 * c.fwd_flops
    assert count_newton_schulz("omeganet", 1, 16, 1, 4) == []
    monkeypatch.setitem(floors.SHAPES, "small", (B, T, H, 8))
    table = newton_schulz_table(shapes=("small",))
    assert f"| atlas | small {B}×{T}×{H}×8 | 32 | {B * T * H} | {2 * B * T * H} |" in table

    from fastweights.cli import main

    assert main(["bench", "floors", "--newton-schulz", "--shapes", "small"]) == 0
