"""`fastweights bench train`: a tiny CPU run writes the table and the JSON (positive tokens/s for
both models, the ratio against softmax_attention), every argument is checked before anything runs,
a failing row is recorded while the run goes on, --layer-ops picks the layer ops' backend and
--build makes the LM three ways that run the same rows (on a fake GPU: `tests/fake_cuda.py`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from fastweights import cli
from fastweights.bench import train
from fastweights.cliargs import ArgError
from fastweights.models import LM
from tests.fake_cuda import FakeCuda

TINY = ["--d-model", "32", "--n-layers", "2", "--num-heads", "2", "--head-dim", "16", "--vocab-size", "64",
        "--steps", "2", "--warmup", "1", "--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_tiny_cpu_run_writes_table_and_json_with_ratios(tmp_path, capsys):
    rc = cli.main(["bench", "train", *TINY, "--lengths", "64", "--dtype", "bfloat16", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("| model |"))
    assert "tokens/s vs softmax" in out[head] and "peak GiB" in out[head]
    printed = [ln for ln in out if ln.startswith(("| gated_deltanet |", "| softmax_attention |"))]
    assert [ln.split(" | ")[0] for ln in printed] == ["| softmax_attention", "| gated_deltanet"]  # the base first
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["command"].startswith("fastweights bench train --models softmax_attention gated_deltanet "
                                      "--shapes 1,64 ")
    rows = {r["model"]: r for r in data["rows"]}
    assert set(rows) == {"gated_deltanet", "softmax_attention"}
    base, gdn = rows["softmax_attention"], rows["gated_deltanet"]
    for r in (base, gdn):
        assert not r["error"], r["error"]
        assert (r["B"], r["T"], r["dtype"], r["optimizer"]) == (1, 64, "bfloat16", "AdamW foreach")
        assert r["tokens_per_s"] > 0 and len(r["step_ms_all"]) == 2
        assert r["tokens_per_s"] == pytest.approx(64 / (r["step_ms"] / 1e3))
        assert r["peak_bytes"] is None and r["peak_vs_base"] is None  # CPU: no number made up
        assert r["params"] > 0 and len(r["backends"]) == 2 and r["build"] == "device"
        assert math.isfinite(r["loss"]) and r["loss"] > 0  # finite: the step really ran
    assert base["tokens_vs_base"] == pytest.approx(1.0)
    assert gdn["tokens_vs_base"] == pytest.approx(gdn["tokens_per_s"] / base["tokens_per_s"])
    md = (tmp_path / "train.md").read_text()
    assert data["command"] in md and md.count("\n| gated_deltanet |") == 1
    cells = md.split("\n| gated_deltanet |")[1].split("\n")[0].split(" | ")
    assert cells[9] == f"{gdn['tokens_vs_base']:.2f}×" and cells[8] == f"{gdn['saved_per_token'] / 1024:,.1f}"
    for r in (base, gdn):  # the activations kept for the backward, a token (the CPU's SDPA: its math path)
        assert r["saved_per_token"] > 0
    assert gdn["saved_vs_base"] == pytest.approx(gdn["saved_per_token"] / base["saved_per_token"])
    assert gdn["backends"] == ["torch", "torch"] and gdn["layer_ops"] == ["torch"] and base["backends"] == ["sdpa"] * 2


def test_the_timed_step_is_an_optimizer_step(tmp_path, monkeypatch):
    """After one timed step (no warm-up) every parameter of the LM has moved; fp32, one model."""
    built = []

    class Recorded(LM):
        def __init__(self, config):
            super().__init__(config)
            built.append((self, {n: p.detach().clone() for n, p in self.named_parameters()}))

    monkeypatch.setattr(train, "LM", Recorded)
    rows = train.run_train(models=["gated_deltanet"], d_model=16, n_layers=1, num_heads=2, head_dim=8,
                           vocab_size=32, lengths=[16], steps=1, warmup=0, dtype="float32", threads=1,
                           out_dir=str(tmp_path), log=lambda s: None)
    assert rows[0].tokens_per_s > 0 and rows[0].tokens_vs_base is None  # no softmax row: no ratio
    lm, before = built[0]
    assert [n for n, p in lm.named_parameters() if torch.equal(p.detach(), before[n])] == []


@pytest.mark.parametrize("argv, flag", [
    (["--models", "foo"], "--models"), (["--d-model", "0"], "--d-model"), (["--n-layers", "-1"], "--n-layers"),
    (["--num-heads", "0"], "--num-heads"), (["--head-dim", "0"], "--head-dim"), (["--vocab-size", "0"], "--vocab-size"),
    (["--lengths", "0"], "--lengths"), (["--batch", "0"], "--batch"), (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"), (["--threads", "-1"], "--threads"), (["--device", "tpu"], "--device"),
    (["--shapes", "4x64"], "--shapes"), (["--shapes", "0,64"], "--shapes"), (["--shapes", "1,64", "--lengths", "64"],
                                                                            "--lengths"),
    (["--shapes", "1,64", "--batch", "2"], "--batch"), (["--backend", "cuda"], "--backend"),
    (["--models", "softmax_attention", "--head-dim", "15"], "--head-dim"),  # RoPE: an even head_dim
    (["--out", "/proc/version/x"], "--out"), (["--launch", "/nonexistent/best_launch.json"], "--launch"),
    (["--launch", "{bad}"], "--launch"), (["--cuda-graph"], "--cuda-graph"),  # the default device is the CPU
    (["--cuda-graph", "--device", "cuda", "--grad-checkpoint"], "--cuda-graph"),
    (["--head-v-dim", "0"], "--head-v-dim")])
def test_bad_arguments_are_one_line_before_anything_runs(argv, flag, tmp_path, capsys):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "x")]
    assert cli.main(["bench", "train", *argv]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}") and not cap.out, err
    assert not (tmp_path / "x").exists()


def test_bad_dtype_is_refused_by_check_args():
    with pytest.raises(ArgError, match="^--dtype"):
        train.check_args(models=["gated_deltanet"], d_model=32, n_layers=2, num_heads=2, head_dim=16, vocab_size=64,
                         lengths=[64], dtype="float16")


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    class Failing(LM):
        def forward(self, ids, **kw):
            if self.config.mixer == "gated_deltanet":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.00 GiB\nsecond line")
            return super().forward(ids, **kw)

    monkeypatch.setattr(train, "LM", Failing)
    lines = []
    rows = train.run_train(models=["gated_deltanet", "softmax_attention"], d_model=32, n_layers=2, num_heads=2,
                           head_dim=16, vocab_size=64, shapes=["1,32", "2,16"], steps=1, warmup=1, threads=1,
                           out_dir=str(tmp_path), log=lines.append)
    assert [(r.model, r.B, r.T) for r in rows] == [("softmax_attention", 1, 32), ("gated_deltanet", 1, 32),
                                                   ("softmax_attention", 2, 16), ("gated_deltanet", 2, 16)]
    for r in rows:
        if r.model == "gated_deltanet":
            assert r.error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 34.00 GiB"
            assert r.tokens_per_s is None and r.tokens_vs_base is None and r.params > 0
        else:
            assert not r.error and r.tokens_per_s > 0 and r.tokens_vs_base == pytest.approx(1.0)
    recs = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert [r["error"] != "" for r in recs] == [False, True, False, True]
    assert any("| gated_deltanet | 2×16 |" in ln and "OutOfMemoryError" in ln for ln in lines)


def test_layer_ops_torch_turns_the_layer_kernels_off(tmp_path, monkeypatch):
    """--layer-ops torch builds every row with LMConfig.layer_ops="torch": with the Triton rows serving
    CPU calls (as on CUDA) and the norm kernel made to fail, the default ("auto") run records the
    failure and the torch run does not; the setting is in the setup line and the command."""
    from fastweights.kernels.triton.layer import norm as triton_norm

    def refuse(*a, **k):
        raise RuntimeError("the norm kernel ran")

    FakeCuda(monkeypatch, kernels=True).install()
    monkeypatch.setattr(triton_norm, "gated_rms_norm", refuse)
    kw = dict(models=["softmax_attention"], d_model=32, n_layers=1, num_heads=2, head_dim=16, vocab_size=64,
              lengths=[16], steps=1, warmup=0, dtype="float32", log=lambda s: None)
    fused = train.run_train(**kw, out_dir=str(tmp_path / "f"))
    plain = train.run_train(**kw, layer_ops="torch", out_dir=str(tmp_path / "t"))
    assert "the norm kernel ran" in fused[0].error
    assert not plain[0].error and plain[0].tokens_per_s > 0 and plain[0].layer_ops == ["torch"]
    data = json.loads((tmp_path / "t" / "train.json").read_text())
    assert "--layer-ops torch" in data["command"] and data["setup"].endswith("layer ops torch")
    with pytest.raises(ArgError, match="^--layer-ops"):
        train.check_args(models=["gated_deltanet"], d_model=32, n_layers=2, num_heads=2, head_dim=16, vocab_size=64,
                         lengths=[64], layer_ops="fused")


def test_build_makes_the_lm_three_ways_that_run_the_same_rows(tmp_path, monkeypatch, capsys):
    """--build device moved from_pretrained: a row per build (each compared with the softmax row of its
    build); on a (fake) GPU every build's layers run the Triton rows, their training form and their
    layer ops alike."""
    FakeCuda(monkeypatch).install()
    rc = cli.main(["bench", "train", *TINY, "--lengths", "32", "--dtype", "float32", "--steps", "1",
                   "--build", "device", "moved", "from_pretrained", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["command"].endswith("--build device moved from_pretrained")
    assert "built device, moved, from_pretrained" in data["setup"]
    rows = data["rows"]
    assert [(r["build"], r["model"]) for r in rows] == [(b, m) for b in ("device", "moved", "from_pretrained")
                                                        for m in ("softmax_attention", "gated_deltanet")]
    for r in rows:
        assert not r["error"] and r["tokens_per_s"] > 0 and r["tokens_vs_base"] is not None, r
        assert r["layer_ops"] == ["triton"]
        triton = "triton (staged forward, staged backward)"  # fp32: the staged pipeline
        assert r["backends"] == ([triton, triton] if r["model"] == "gated_deltanet" else ["sdpa", "sdpa"])
        # the launch-table variants the rows name (the staged pipeline: none; the convs' backward)
        assert r["variants"] == (["conv backward: rows (RUN 128)"] if r["model"] == "gated_deltanet" else [])
    out = capsys.readouterr().out
    assert "| gated_deltanet | 1×32 | from_pretrained |" in out and f"{triton}×2; ops triton" in out
    assert f"{triton}×2; ops triton; variants conv backward: rows (RUN 128) |" in out
    with pytest.raises(SystemExit, match="2"):  # argparse: not one of the choices
        cli.main(["bench", "train", *TINY, "--build", "cuda", "--out", str(tmp_path / "x")])
    with pytest.raises(ArgError, match="^--build"):
        train.check_args(models=["gated_deltanet"], d_model=32, n_layers=2, num_heads=2, head_dim=16, vocab_size=64,
                         lengths=[64], build=())


def test_a_failed_row_makes_the_command_exit_1_unless_keep_going(tmp_path, monkeypatch, capsys):
    """`fastweights bench train` with a failing row exited 0, its error only in a table cell."""

    class Failing(LM):
        def forward(self, ids, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(train, "LM", Failing)
    argv = ["bench", "train", "--models", "gated_deltanet", "--d-model", "32", "--n-layers", "1", "--num-heads", "2",
            "--head-dim", "16", "--vocab-size", "64", "--shapes", "1,16", "--steps", "1", "--warmup", "0",
            "--dtype", "float32", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "error: 1 of 1 rows failed" in err and "OutOfMemoryError" in err
    assert cli.main(argv + ["--keep-going"]) == 0


def test_grad_checkpoint_both_adds_a_checkpointed_row_beside_each_plain_one(tmp_path, monkeypatch, capsys):
    """--grad-checkpoint (bare: both): each model's plain row, then its '+ grad ckpt' row, which really
    recomputes (twice the block forwards under grad) and is compared with its plain row."""
    from fastweights.models.lm import Block

    calls = {True: 0, False: 0}
    forward = Block.forward

    def counted(self, *a, **k):
        calls[torch.is_grad_enabled()] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(Block, "forward", counted)
    seen = []
    measure = train._measure

    def spy(row, *a, **k):
        before = calls[True]
        measure(row, *a, **k)
        seen.append((row.model, row.grad_ckpt, calls[True] - before))

    monkeypatch.setattr(train, "_measure", spy)
    rc = cli.main(["bench", "train", *TINY, "--lengths", "32", "--dtype", "float32", "--grad-checkpoint",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    assert data["command"].endswith("--grad-checkpoint both --build device")
    assert "gradient checkpointing both" in data["setup"]
    rows = data["rows"]
    assert [(r["model"], r["grad_ckpt"]) for r in rows] == [
        ("softmax_attention", False), ("softmax_attention", True), ("gated_deltanet", False), ("gated_deltanet", True)]
    steps = 1 + 2  # warm-up + timed, 2 blocks each
    # (a plain row runs one more forward of its 2 blocks: the saved-activations count; a checkpointed row none)
    assert [n for *_, n in seen] == [2 * steps + 2, 4 * steps, 2 * steps + 2, 4 * steps]
    for r in rows:
        assert not r["error"] and math.isfinite(r["loss"])
        if r["grad_ckpt"]:
            plain = next(p for p in rows if p["model"] == r["model"] and not p["grad_ckpt"])
            assert r["tokens_vs_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
            assert r["peak_vs_plain"] is None  # CPU: no peak measured
        else:
            assert r["tokens_vs_plain"] is None
    gdn = rows[3]
    base = rows[1]  # the softmax row with checkpointing is this row's base
    assert gdn["tokens_vs_base"] == pytest.approx(gdn["tokens_per_s"] / base["tokens_per_s"])
    out = capsys.readouterr().out
    assert "| gated_deltanet + grad ckpt | 1×32 |" in out and "| peak vs plain |" in out
    # "on": only checkpointed rows
    assert cli.main(["bench", "train", *TINY, "--lengths", "32", "--dtype", "float32", "--models", "gated_deltanet",
                     "--grad-checkpoint", "on", "--out", str(tmp_path / "on")]) == 0
    assert [r["grad_ckpt"] for r in json.loads((tmp_path / "on" / "train.json").read_text())["rows"]] == [True]
    with pytest.raises(ArgError, match="^--grad-checkpoint"):
        train.check_args(models=["gated_deltanet"], d_model=32, n_layers=2, num_heads=2, head_dim=16, vocab_size=64,
                         lengths=[64], grad_checkpoint="yes")


def test_peak_vs_plain_is_the_checkpointed_row_over_its_plain_row():
    rows = [train.TrainRow("gated_deltanet", 1, 64, "bfloat16", "cuda:0", "AdamW fused", tokens_per_s=100.0,
                           peak_bytes=1000),
            train.TrainRow("gated_deltanet", 1, 64, "bfloat16", "cuda:0", "AdamW fused", tokens_per_s=80.0,
                           peak_bytes=400, grad_ckpt=True)]
    train._fill_ratios(rows)
    assert rows[1].peak_vs_plain == pytest.approx(0.4) and rows[1].tokens_vs_plain == pytest.approx(0.8)
    assert rows[0].peak_vs_plain is None and "| gated_deltanet + grad ckpt |" in train._fmt(rows[1])
    assert train._fmt(rows[1]).endswith("| 0.80× | 0.40× |")


def test_launch_applies_a_swept_table_before_the_rows(tmp_path, monkeypatch):
    """--launch PATH: the table is applied to the Triton kernels' launch settings (`util.load_launch`; the kernels
    read no environment variable) before the rows run; a table naming an unknown launch site is one line, exit 2."""
    import copy

    from fastweights.kernels.triton.common import util

    monkeypatch.setattr(util, "LAUNCH", copy.deepcopy(util.LAUNCH))
    table = tmp_path / "best_launch.json"
    table.write_text(json.dumps({"wy_bwd": {"num_warps": 8}}))
    seen = []
    monkeypatch.setattr("fastweights.bench.train.run_train", lambda **kw: seen.append(util.launch("wy_bwd")) or [])
    argv = ["bench", "train", "--models", "deltanet", "--d-model", "16", "--num-heads", "2", "--head-dim", "8",
            "--lengths", "16", "--steps", "1", "--out", str(tmp_path / "out"), "--launch", str(table)]
    assert cli.main(argv) == 0 and seen == [dict(num_warps=8, num_stages=2)]
    table.write_text(json.dumps({"no_such_kernel": {"num_warps": 8}}))
    assert cli.main(argv) == 2


@pytest.mark.parametrize("d_model, n_layers, heads, head_dim, model", [
    (768, 12, 6, 128, "gated_deltanet"), (1024, 8, 8, 128, "gated_deltanet"), (32, 2, 2, 16, "deltanet"),
    (256, 2, 4, 64, "mamba2")])
def test_same_params_config_widens_the_mlp_to_the_models_parameter_count(d_model, n_layers, heads, head_dim, model):
    """The widened transformer's count is the nearest its MLP width (a multiple) allows, within the tolerance, and
    its count really is what LM(cfg) has (counted on the meta device, checked on a real build at small sizes)."""
    kw = dict(vocab_size=256, d_model=d_model, n_layers=n_layers, num_heads=heads, head_dim=head_dim, backend="auto")
    base, target = train._config(train.BASE_MODEL, **kw), train._config(model, **kw)
    cfg = train.same_params_config(base, target)
    want, got = train.count_parameters(target), train.count_parameters(cfg)
    m = next(m for m in train.MLP_MULTIPLES if cfg.hidden % m == 0)
    assert abs(got - want) <= train.SAME_PARAMS_TOL * want and cfg.hidden > base.hidden
    for other in (cfg.hidden - m, cfg.hidden + m):  # no neighbouring width of that multiple is nearer
        near = train.count_parameters(dataclasses.replace(cfg, mlp_hidden=other))
        assert abs(near - want) >= abs(got - want)
    if d_model <= 32:
        assert LM(cfg).num_parameters() == got
    if d_model == 768:
        assert cfg.hidden % 64 == 0


def test_same_params_adds_a_widened_base_row_and_its_ratios(tmp_path):
    rc = cli.main(["bench", "train", *TINY, "--models", "deltanet", "softmax_attention", "--lengths", "32",
                   "--dtype", "float32", "--same-params", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "train.json").read_text())
    assert "--same-params" in data["command"]
    base, wide, dn = data["rows"]
    assert (base["model"], base["matches"], wide["model"], wide["matches"], dn["model"]) == (
        "softmax_attention", "", "softmax_attention", "deltanet", "deltanet")
    assert all(not r["error"] for r in data["rows"])
    assert wide["mlp_hidden"] > base["mlp_hidden"]
    assert abs(wide["params"] - dn["params"]) <= train.SAME_PARAMS_TOL * dn["params"]
    assert dn["tokens_vs_same"] == pytest.approx(dn["tokens_per_s"] / wide["tokens_per_s"])
    assert dn["tokens_vs_base"] == pytest.approx(dn["tokens_per_s"] / base["tokens_per_s"])
    assert wide["tokens_vs_base"] is None  # a widened base row is compared with no other base
    md = (tmp_path / "train.md").read_text()
    assert f"| softmax_attention (MLP {wide['mlp_hidden']:,}: params of deltanet) |" in md


@pytest.mark.parametrize("models", [["gated_deltanet"], ["softmax_attention"]])
def test_same_params_needs_the_base_and_another_model(models, tmp_path, capsys):
    argv = ["bench", "train", *TINY, "--models", *models, "--same-params", "--out", str(tmp_path / "x")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --same-params"), err
    assert not (tmp_path / "x").exists()


def test_head_v_dim_sets_the_fast_weight_mixers_value_heads_only(tmp_path):
    """--head-v-dim 16 (= head_dim, as the gpu-125m preset sets it) narrows gated DeltaNet's value heads from its
    default 2× and leaves the transformer alone; the command line reproduces it."""
    def run(extra, out):
        assert cli.main(["bench", "train", *TINY, "--lengths", "16", "--dtype", "float32", *extra, "--out", out]) == 0
        data = json.loads((tmp_path / out / "train.json").read_text())
        return data["command"], {r["model"]: r["params"] for r in data["rows"]}

    cmd, narrow = run(["--head-v-dim", "16"], str(tmp_path / "a"))
    _, default = run([], str(tmp_path / "b"))
    assert "--head-v-dim 16" in cmd
    assert narrow["softmax_attention"] == default["softmax_attention"]
    assert narrow["gated_deltanet"] < default["gated_deltanet"]
    want = LM(train._config("gated_deltanet", vocab_size=64, d_model=32, n_layers=2, num_heads=2, head_dim=16,
                            backend="auto", head_v_dim=16)).num_parameters()
    assert narrow["gated_deltanet"] == want


class _Double(torch.autograd.Function):
    """A custom autograd.Function (as the Triton rows are) that saves a new tensor of its own."""

    @staticmethod
    def forward(ctx, x):
        kept = x * 2
        ctx.save_for_backward(kept)
        return kept.clone()

    @staticmethod
    def backward(ctx, g):
        (kept,) = ctx.saved_tensors
        return g * 2 + 0 * kept


class _Toy(torch.nn.Module):
    """ids [B, T] -> logits [B, T, V]: an embedding (keeps the ids), _Double (keeps x·2), a linear map (keeps its
    input, the _Double output: a fresh tensor)."""

    def __init__(self, vocab=16, width=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        return self.out(_Double.apply(self.emb(ids)))


def test_saved_bytes_counts_each_kept_storage_once_without_the_weights():
    """Embedding: the ids (a view of the [1, T + 1] batch, whose other view is the loss's target: one storage);
    _Double: its [T, 8] product; the linear map: its [T, 8] input; the loss: its [T, V] log-softmax (and a scalar
    total weight). The weights' storages are not counted."""
    T, V, W = 37, 16, 8
    toy = _Toy(V, W)
    ids = torch.randint(0, V, (1, T + 1))
    want = (T + 1) * 8 + 2 * T * W * 4 + T * V * 4
    got = train.saved_bytes(toy, ids, bf16=False)
    assert want <= got <= want + 16, (got, want)  # (+ the loss's 0-d total weight)
    assert got < want + V * W * 4  # the embedding's weights (the smallest) are not in it


def test_saved_bytes_frees_the_graph_it_measured():
    """The measured forward's graph is gone when saved_bytes returns: a saved tensor packed as itself would hold
    its own grad_fn, a cycle through autograd's nodes that gc cannot break, and on a GPU every bench row's
    activations stayed allocated into the next rows' peak memory."""
    import gc

    def with_graph() -> set[int]:  # (other tests of the process may leave graphs of their own)
        gc.collect()
        return {id(t) for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None}

    before = with_graph()
    toy = _Toy(16, 8)
    train.saved_bytes(toy, torch.randint(0, 16, (2, 30)), bf16=False)
    assert not with_graph() - before


def test_precision_pins_the_generic_rows_kernels_for_the_run(tmp_path, monkeypatch):
    """--precision P (bench train and bench speed): the generic row runs every kernel at P for the whole run — the
    pipeline the rows report says so — and is put back after; an unknown precision is one line, exit 2."""
    import fastweights as fw

    def ran(**kw):
        seen.append(fw.pipeline("ttt_linear", device="cuda", dtype=torch.float32, head_dim=64)[1])
        return []

    seen: list = []
    monkeypatch.setattr("fastweights.bench.train.run_train", ran)
    monkeypatch.setattr("fastweights.bench.speed.run_speed", ran)
    train_argv = ["bench", "train", "--models", "deltanet", "--d-model", "16", "--num-heads", "2", "--head-dim", "8",
                  "--lengths", "16", "--steps", "1", "--out", str(tmp_path / "out")]
    speed_argv = ["bench", "speed", "--models", "ttt_linear", "--lengths", "16", "--out", str(tmp_path / "speed")]
    assert cli.main(train_argv + ["--precision", "ieee"]) == 0
    assert cli.main(speed_argv + ["--precision", "tf32"]) == 0
    assert cli.main(speed_argv) == 0
    assert seen == ["TTT-Linear kernels (ieee)", "TTT-Linear kernels (tf32)", "TTT-Linear kernels (tf32x3)"]
    assert fw.pipeline("ttt_linear", device="cuda", dtype=torch.float32, head_dim=64)[1] == \
        "TTT-Linear kernels (tf32x3)"
    with pytest.raises(SystemExit) as e:
        cli.main(speed_argv + ["--precision", "fp8"])
    assert e.value.code == 2


def test_profile_writes_each_rows_step_by_op(tmp_path, capsys):
    """--profile: one more eager step of each row under torch.profiler, written as profile/<row>.txt (on the CPU the
    ATen ops by self CPU time and input shapes, largest share first); the timed rows are unchanged
    in number. (Graphed rows, CUDA only, are not profiled: their step is a replay.)"""
    from fastweights.cli import main

    assert main(["bench", "train", "--models", "gated_deltanet", "softmax_attention", "--d-model", "32",
                 "--n-layers", "1", "--num-heads", "2", "--head-dim", "16", "--vocab-size", "64", "--shapes", "1,24",
                 "--steps", "1", "--warmup", "1", "--profile", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["gated_deltanet_device_1x24.txt", "softmax_attention_device_1x24.txt"]
    text = (tmp_path / "profile" / files[0]).read_text()
    assert text.startswith("gated_deltanet 1×24 device: one eager step") and "aten::mm" in text
    shares = [float(line.split("%")[0].split()[-1]) for line in text.splitlines()[2:] if "%" in line]
    assert shares and all(0 <= x <= 100 for x in shares) and shares == sorted(shares, reverse=True)
    assert len(json.loads((tmp_path / "train.json").read_text())["rows"]) == 2
