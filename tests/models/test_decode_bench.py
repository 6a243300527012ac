"""Smoke test of `fastweights bench decode` (the benchmark script, not a timing test): it runs,
writes the table, the JSON and the plot, and its byte counts follow the models' state sizes.
(Belongs in tests/bench/test_decode.py; kept here with the LM tests it exercises.)"""

import json

import pytest

from fastweights import cli
from fastweights.bench.decode import DecodeBenchConfig


def test_cli_decode_bench_writes_table_json_plot(tmp_path, capsys):
    out = tmp_path / "dec"
    rc = cli.main(["bench", "decode", "--contexts", "8", "24", "--d-model", "16", "--num-heads", "2",
                   "--head-dim", "8", "--vocab-size", "32", "--new-tokens", "2", "--repeats", "1", "--warmup", "1",
                   "--prefill-chunk", "16", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "decode.json").read_text())
    rows = {(r["model"], r["context"]): r for r in doc["rows"]}
    assert set(rows) == {(m, L) for m in ("gated_deltanet", "softmax_attention") for L in (8, 24)}
    lin8, lin24 = rows["gated_deltanet", 8], rows["gated_deltanet", 24]
    sm8, sm24 = rows["softmax_attention", 8], rows["softmax_attention", 24]
    assert lin8["state_bytes"] == lin24["state_bytes"] > 0 and lin8["kv_cache_bytes"] == 0
    assert sm24["kv_cache_bytes"] == 3 * sm8["kv_cache_bytes"] > 0  # 2 layers × L × 2 heads × (8 + 8) × 4 bytes
    assert sm8["kv_cache_bytes"] == 2 * 8 * 2 * 16 * 4
    assert all(r["tokens_per_s"] > 0 for r in doc["rows"])
    md = (out / "decode.md").read_text()
    assert "| gated_deltanet |" in md and "fastweights bench decode --models" in md
    assert (out / "decode.png").stat().st_size > 1000


def test_config_validates():
    with pytest.raises(ValueError, match="contexts"):
        DecodeBenchConfig(contexts=())
    with pytest.raises(ValueError, match="dtype"):
        DecodeBenchConfig(dtype="int8")
    assert "--threads 1" in DecodeBenchConfig().as_command()
    assert "--cuda-graph" not in DecodeBenchConfig().as_command()
    assert DecodeBenchConfig(cuda_graph=True, device="cuda").as_command().endswith("--cuda-graph")
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeBenchConfig(cuda_graph=True)  # device cpu
