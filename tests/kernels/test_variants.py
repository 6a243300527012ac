"""The launch-table variants named where the pipeline is named (fastweights/kernels/variants.py): the names follow the
table (`util.load_launch`, put back after), `fastweights.pipeline(..., variants=True)`, `fastweights.layer_op_pipeline`
and `dispatch.rows(variants=True)` report them, and what a layer records is what its kernels ran (the kernels'
launches spied under the interpreter: the glue branches on the same `kernels.variants` answer that names it).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import fastweights as fw
from fastweights import dispatch
from fastweights.kernels import variants as V
from fastweights.kernels.triton.common import util
from tests.fake_cuda import FakeCuda

bf16, fp32 = torch.bfloat16, torch.float32


@contextmanager
def launched(table: dict):
    """`util.load_launch(table)` within the block, the table before it put back after."""
    old = util.load_launch(table)
    try:
        yield
    finally:
        util.LAUNCH.update(old)


def _copy(**sites) -> dict:
    """A copy of the live table with `sites` ({site: {key: value}}) changed: an explicit table."""
    out = {name: dict(cfg) for name, cfg in util.LAUNCH.items()}
    for name, cfg in sites.items():
        out[name].update(cfg)
    return out


def test_the_names_follow_the_launch_table():
    """Every variant's name under the shipped table, under a table loaded with `util.load_launch` (and after it is
    put back), and under an explicit table passed as `launch=` (the live one untouched)."""
    ttt = dict(device="cuda", dtype=bf16, head_dim=64, variants=True)
    assert fw.pipeline("ttt_mlp", **ttt, batch_size=4, num_heads=8)[2] == ("TTT-MLP: sliced NP 8",)
    assert fw.pipeline("ttt_mlp", **ttt, batch_size=64, num_heads=2)[2] == ("TTT-MLP: one program",)
    assert fw.pipeline("ttt_mlp", **ttt) == ("triton", "TTT-MLP kernels (tf32)", (
        "TTT-MLP: sliced NP 8 where sequences × heads ≤ 64, else one program",))
    assert fw.pipeline("ttt_mlp", device="cuda", dtype=bf16, head_dim=64) == ("triton", "TTT-MLP kernels (tf32)")
    assert fw.pipeline("ttt_linear", **ttt, batch_size=4, num_heads=16)[2] == (
        "TTT-Linear: one program",
        "TTT-Linear backward: chain only, dk's products after (G bf16 with bf16 inputs); dtypes in the kernels")
    assert fw.pipeline("titans", device="cuda", dtype=bf16, head_dim=64, variants=True)[2] == (
        "Titans single backward: e and the read kept",)
    conv = dict(device="cuda", dtype=bf16)
    assert fw.layer_op_pipeline("conv", **conv, conv_width=4) == ("triton", ("conv backward: rows (RUN 128)",))
    assert fw.layer_op_pipeline("conv", **conv, conv_width=8) == ("triton", ("conv backward: block",))
    assert fw.layer_op_pipeline("conv", **conv) == ("triton", ("conv backward: rows (RUN 128) where W ≤ 4, else "
                                                               "block",))
    assert fw.layer_op_pipeline("conv", conv_width=4) == ("torch", ())  # the CPU: the torch row, no variant
    delta = dict(device="cuda", dtype=bf16, head_dim=128, head_v_dim=128, chunk_size=64, variants=True)
    assert fw.pipeline("deltanet", **delta)[2] == ("fused forward: W, U' pre-pass; raw q, k; inverse tf32x3; "
                                                   "inverse by batched recursion",
                                                   "fused backward: Aqk per value block")
    assert fw.pipeline("gated_deltanet", **{**delta, "head_v_dim": 256})[1:] == (
        "staged forward, fused backward", ("fused backward: Aqk per value block",))
    assert fw.pipeline("kda", **delta)[2] == ()  # staged: no variant
    assert fw.pipeline("titans", device="cuda", dtype=bf16, head_dim=128, variants=True)[2] == (
        "Titans: sliced NP 4 where sequences × heads ≤ 64, else one program",
        "Titans backward: read terms in the reverse pass")

    with launched({"ttt_mlp_sliced": {"ON": 1, "NP": 4, "BWD": 0, "ZS": 1}, "conv_bwd_rows": {"ON": 0, "RUN": 64},
                   "conv_bwd_fused": {"DW_ACC": 0}, "delta_prepass": {"WU": 0}, "delta_fused_rev": {"AQK": 1},
                   "titans_bwd": {"READ_TERMS": 1}}):
        assert fw.pipeline("ttt_mlp", **ttt, batch_size=64, num_heads=2)[2] == (
            "TTT-MLP: sliced NP 4 forward, one-program backward, Z1 stored",)
        assert fw.layer_op_pipeline("conv", **conv, conv_width=4) == ("triton", ("conv backward: block",))
        assert fw.pipeline("deltanet", **delta)[2] == (
            "fused forward: T form; inverse tf32x3; inverse by batched recursion",
            "fused backward: Aqk from the recompute")
        assert fw.pipeline("titans", device="cuda", dtype=bf16, head_dim=128, variants=True, batch_size=64,
                           num_heads=2)[2] == ("Titans: one program", "Titans backward: read terms from the pre-pass")
    with launched({"ttt_mlp_sliced": {"ON": 0}, "conv_bwd_rows": {"RUN": 64}}):
        assert fw.pipeline("ttt_mlp", **ttt, batch_size=1, num_heads=1)[2] == ("TTT-MLP: one program",)
        assert fw.pipeline("ttt_mlp", **ttt)[2] == ("TTT-MLP: one program",)  # ON 0: whatever the shape
        assert fw.layer_op_pipeline("conv", **conv, conv_width=3)[1] == ("conv backward: rows (RUN 64)",)
    assert fw.layer_op_pipeline("conv", **conv, conv_width=4)[1] == ("conv backward: rows (RUN 128)",)  # put back

    other = _copy(conv_bwd_rows={"ON": 0}, conv_bwd_fused={"DW_ACC": 1}, ttt_mlp_sliced={"MAX_BH": 128},
                  delta_prepass={"AQK": 1, "RAW_KV": 1, "INV_TF32": 1}, delta_fused_fwd={"RAW_QK": 0})
    assert fw.layer_op_pipeline("conv", **conv, conv_width=2, launch=other)[1] == (
        "conv backward: block (dw accumulated)",)
    assert fw.pipeline("ttt_mlp", **ttt, batch_size=64, num_heads=2, launch=other)[2] == ("TTT-MLP: sliced NP 8",)
    assert fw.pipeline("deltanet", **delta, launch=other)[2][0] == (
        "fused forward: W, U' pre-pass; Aqk from the pre-pass; raw k, v; inverse tf32; inverse by batched recursion")
    assert fw.pipeline("deltanet", **{**delta, "dtype": fp32}, launch=other)[2] == ()  # fp32: staged
    assert fw.layer_op_pipeline("conv", **conv, conv_width=2)[1] == ("conv backward: rows (RUN 128)",)  # live table


def test_the_rules_read_what_the_kernels_take():
    """The pure rules beside their kernels' reach: the delta T form only where the fused backward's state kernel
    takes the call (no or a scalar decay, K ≤ 128, C ≤ 64), Aqk and the raw operands never with the diagonal decay;
    the gated fused forward's two flags; the conv's rows variant only to width 4, the two kernels without one pass;
    an ON the TTT-MLP rule does not know is refused."""
    t = _copy(delta_prepass={"WU": 0, "AQK": 1, "RAW_KV": 1}, delta_fused_fwd={"RAW_QK": 1})
    assert V.delta_fused_forward("scalar", 128, 64, bf16, t).t_form
    for gate, K, C in (("diagonal", 64, 64), ("scalar", 256, 64), ("none", 64, 128)):
        got = V.delta_fused_forward(gate, K, C, bf16, t)
        assert not got.t_form and got.aqk_in_prepass == got.raw_kv == got.raw_qk == (gate != "diagonal"), gate
    assert V.delta_fused_forward("none", 64, 64, fp32, _copy()).inverse == "ieee"
    g = V.gated_fused_forward(_copy(gated_fused_fwd={"AQK": 1, "PREFETCH": 0}))
    assert str(g.variant) == "fused forward: scores kernel; β loaded in place"
    live = _copy()
    assert [V.conv_backward(W, live).kind for W in (1, 4, 5, 8)] == ["rows", "rows", "block", "block"]
    assert V.conv_backward(4, _copy(conv_bwd_dpre={"DPRE_FP32": 1}), one_pass=False).variant == V.Variant(
        "conv backward", "two kernels (dpre fp32)")
    with pytest.raises(ValueError, match="ttt_mlp_sliced"):
        V.ttt_mlp(1, 1, _copy(ttt_mlp_sliced={"ON": 4}))


def test_the_fused_backward_names_its_gradient_kernel():
    """The fused backward's gradient kernel (`variants.delta_fused_backward`, the rule `delta_fused_bwd.fused_backward`
    branches on): one program by default (the name as before), rowsums with ROWSUMS 1, rows over programs with the rows
    site ON where BR (clamped to ≥ 16) is below the chunk and divides it — else back to ROWSUMS' choice — and, the
    chunk unknown, rows named with the condition."""
    assert str(V.delta_fused_backward(_copy(), 64).variant) == "fused backward: Aqk per value block"
    assert V.delta_fused_backward(_copy(delta_fused_grads={"ROWSUMS": 1}), 64).grads == "rowsums"
    on = _copy(delta_fused_grads_rows={"ON": 1, "BR": 16}, delta_fused_grads={"ROWSUMS": 1})
    assert [(V.delta_fused_backward(on, C).grads, V.delta_fused_backward(on, C).rows) for C in (64, 32, 16)] == [
        ("rows", 16), ("rows", 16), ("rowsums", 0)]
    assert V.delta_fused_backward(_copy(delta_fused_grads_rows={"ON": 1, "BR": 8}), 32).rows == 16
    assert str(V.delta_fused_backward(on).variant) == ("fused backward: Aqk per value block; gradient kernel's rows "
                                                       "over programs (BR 16) where the chunk exceeds 16")


def test_rows_list_the_alternatives():
    """`dispatch.rows(variants=True)`: each entry (with pipelines=True each named pipeline) followed by the
    alternatives of the variants the row names there; the listings without it keep their shapes."""
    listed = dispatch.rows(pipelines=True, variants=True)
    assert [r[:4] for r in listed] == dispatch.rows(pipelines=True)
    by = {r[:4]: r[4] for r in listed}
    conv = by[("layer", "conv", "triton", None)]
    assert len(conv) == 1 and conv[0].startswith("conv backward: rows (RUN n) | block")
    assert "conv_bwd_rows ON" in conv[0]
    assert by[("layer", "conv", "torch", None)] == ()
    assert by[("delta", "chunk", "triton", "staged forward, staged backward")] == ()
    fused = by[("delta", "chunk", "triton", "fused forward, fused backward")]
    assert [a.split(":")[0] for a in fused] == ["delta fused forward", "delta fused backward"]
    assert "T form" in fused[0] and "delta_prepass WU" in fused[0]
    assert by[("gated_linear", "chunk", "triton", "fused")][0].startswith("gated fused forward: scores per value block")
    assert [a.split(":")[0] for a in by[("generic", "chunk", "triton", "TTT-MLP kernels (tf32)")]] == ["TTT-MLP"]
    assert [a.split(":")[0] for a in by[("generic", "chunk", "triton", "TTT-Linear kernels (tf32)")]] == [
        "TTT-Linear", "TTT-Linear backward"]
    assert [a.split(":")[0] for a in by[("generic", "chunk", "triton", "Titans kernels (ieee)")]] == [
        "Titans single backward"]
    plain = dispatch.rows(variants=True)
    assert [r[:3] for r in plain] == dispatch.rows()
    assert {a.split(":")[0] for r in plain if r[:3] == ("generic", "chunk", "triton") for a in r[3]} == {
        "TTT-Linear", "TTT-Linear backward", "TTT-MLP", "Titans", "Titans backward", "Titans single backward"}


def _spied(monkeypatch, kernels: dict) -> list[str]:
    """Record the name of each of `kernels` ({name: @triton.jit function}) as it launches (then run it)."""
    ran = []
    for name, kern in kernels.items():
        monkeypatch.setattr(kern, "run", (lambda real, n: lambda *a, **kw: ran.append(n) or real(*a, **kw))(
            kern.run, name))
    return ran


@pytest.mark.triton
def test_the_conv_op_names_the_backward_that_ran(monkeypatch, gen):
    """A ShortConv on the Triton row (the fake CUDA table, the kernels under the interpreter): its record and repr name
    the backward kernel that ran — the rows one by default, the block one-pass with conv_bwd_rows ON 0 and at width
    8 — and the joint q|k|v conv records it on each conv."""
    from fastweights.kernels.triton.layer import conv as kconv
    from fastweights.layers.conv import ShortConv, joint_conv

    FakeCuda(monkeypatch, kernels=True).install()
    ran = _spied(monkeypatch, {"rows": kconv._conv_bwd_rows, "block": kconv._conv_bwd_fused,
                               "two kernels": kconv._conv_bwd_dpre})

    def backward_of(layer, x):
        ran.clear()
        y, _ = layer(x)
        y.sum().backward()
        return ran[:]

    x = torch.randn(1, 9, 16, generator=gen, requires_grad=True)
    layer = ShortConv(16, 4)
    assert backward_of(layer, x) == ["rows"]
    assert layer.variants == {"conv": ("conv backward: rows (RUN 128)",)}
    assert "conv: triton [conv backward: rows (RUN 128)] on cpu" in repr(layer)
    with launched({"conv_bwd_rows": {"ON": 0}}):
        assert backward_of(layer, x) == ["block"]
        assert layer.variants["conv"] == ("conv backward: block (dw accumulated)",)
    wide = ShortConv(16, 8)
    assert backward_of(wide, x) == ["block"] and wide.variants["conv"] == ("conv backward: block",)
    convs = [ShortConv(8, 4), ShortConv(8, 4)]
    ran.clear()
    ys, _ = joint_conv(convs, x)
    sum(y.sum() for y in ys).backward()
    assert ran == ["rows"] and [c.variants["conv"] for c in convs] == [("conv backward: rows (RUN 128)",)] * 2


@pytest.mark.triton
def test_the_ttt_mlp_row_names_the_kernels_that_ran(monkeypatch, gen):
    """A MemoryMixer("ttt_mlp") on the Triton row (the fake CUDA table, the kernels under the interpreter), MAX_BH 2:
    at batch 1 × 2 heads the sliced kernels run both ways and the record, the repr and `fw.pipeline` for the same
    facts say "sliced NP 8"; at batch 2 the one-program kernels run and all three say "one program"."""
    from fastweights.kernels.triton.memories import ttt_mlp as mod
    from fastweights.kernels.triton.memories import ttt_mlp_sliced as sliced
    from fastweights.layers.mixer import MemoryMixer

    FakeCuda(monkeypatch, kernels=True).install()
    ran = _spied(monkeypatch, {"sliced": sliced._step_kernel, "sliced backward": sliced._bwd_chain_kernel,
                               "one program": mod._fwd_kernel, "one-program backward": mod._bwd_kernel})
    torch.manual_seed(0)
    layer = MemoryMixer(32, "ttt_mlp", 2, head_dim=16, backend="triton", layer_ops="torch")
    with launched({"ttt_mlp_sliced": {"MAX_BH": 2}}):
        for B, want, name in ((1, {"sliced", "sliced backward"}, "TTT-MLP: sliced NP 8"),
                              (2, {"one program", "one-program backward"}, "TTT-MLP: one program")):
            ran.clear()
            y, _ = layer(torch.randn(B, 5, 32, generator=gen))
            y.sum().backward()
            assert set(ran) == want, (B, ran)
            assert layer.variants["chunk"] == (name,)
            assert f"chunk: triton (TTT-MLP kernels (ieee)) [{name}] on cpu" in repr(layer)
            assert fw.pipeline("ttt_mlp", device="cuda", dtype=fp32, head_dim=16, variants=True, batch_size=B,
                               num_heads=2) == ("triton", "TTT-MLP kernels (ieee)", (name,))


def _launch_kwargs(monkeypatch, kernels: dict) -> dict:
    """{name: [the launch keywords (constexprs) of each launch]} of `kernels` ({name: @triton.jit function})."""
    seen = {name: [] for name in kernels}
    for name, kern in kernels.items():
        monkeypatch.setattr(kern, "run", (lambda real, n: lambda *a, **kw: seen[n].append(kw) or real(*a, **kw))(
            kern.run, name))
    return seen


@pytest.mark.triton
@pytest.mark.parametrize("table", [{}, {"delta_prepass": {"WU": 0}, "delta_fused_rev": {"AQK": 1}},
                                   {"delta_prepass": {"AQK": 1, "RAW_KV": 1, "INV_TF32": 1, "INV": 1},
                                    "delta_fused_fwd": {"RAW_QK": 0}}], ids=["default", "t_form", "flags"])
def test_the_fused_delta_pipeline_names_the_flags_it_launches_with(monkeypatch, gen, table):
    """Gated DeltaNet on the fused delta pipeline (pinned; the fake CUDA table, the kernels under the interpreter, bf16)
    under three tables: the names `fw.pipeline(..., variants=True)` gives for the call are the kernels' launches —
    the T form where the sequential forward kernel does not run, the pre-pass's STORE_A, RAW_KV, inverse
    precision and form, the sequential kernel's RAW_QK, the backward recompute's STORE_A."""
    from fastweights.kernels import rows
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton.fused import delta_fused, delta_fused_bwd

    FakeCuda(monkeypatch, kernels=True).install()
    seen = _launch_kwargs(monkeypatch, {"pre": delta_fused._prepass_kernel, "seq": delta_fused._fused_fwd_kernel,
                                        "states": delta_fused_bwd._states_kernel})
    x = fw.example_inputs("gated_deltanet", batch_size=1, seq_len=20, num_heads=1, head_dim=16, dtype=bf16,
                          generator=gen)
    leaves = [x[k].requires_grad_(True) for k in ("q", "k", "v")]
    with rows.pinned("delta", pipeline=DeltaPipeline("fused", "fused")), launched(table):
        fwd, bwd = fw.pipeline("gated_deltanet", device="cuda", dtype=bf16, head_dim=16, chunk_size=16,
                               variants=True)[2]
        o, _ = fw.chunk("gated_deltanet", **x, chunk_size=16)
        forward = {name: list(kws) for name, kws in seen.items()}
        torch.autograd.grad(o.float().sum(), leaves)
    (pre,) = forward["pre"]
    assert ("T form" in fwd) == (not forward["seq"]) == (not pre["STORE_WU"]), fwd
    assert ("Aqk from the pre-pass" in fwd) == bool(pre["STORE_A"]) and ("raw k, v" in fwd) == bool(pre["RAW_KV"])
    assert f"inverse {pre['PREC']}" in fwd and f"inverse by {V.INVERSE_FORMS[pre['INV']]}" in fwd
    assert forward["seq"] == [] or ("raw q, k" in fwd) == bool(forward["seq"][0]["RAW_QK"])
    recompute = seen["states"][len(forward["states"]):]  # the backward's launches of the state kernel
    assert recompute and ("Aqk from the recompute" in bwd) == bool(recompute[0]["STORE_A"]), bwd


@pytest.mark.triton
@pytest.mark.parametrize("table", [{}, {"gated_fused_fwd": {"AQK": 1, "PREFETCH": 0}}], ids=["default", "flags"])
def test_the_fused_gated_pipeline_names_the_flags_it_launches_with(monkeypatch, gen, table):
    """Mamba2 on the fused gated-linear pipeline (pinned, as above): "scores kernel" where `_scores_kernel` runs,
    "β prefetched" where the forward kernel launches with PREFETCH."""
    from fastweights.kernels import rows
    from fastweights.kernels.pipelines import GatedPipeline
    from fastweights.kernels.triton.fused import gated_fused

    FakeCuda(monkeypatch, kernels=True).install()
    seen = _launch_kwargs(monkeypatch, {"scores": gated_fused._scores_kernel, "fwd": gated_fused._fwd_kernel})
    x = fw.example_inputs("mamba2", batch_size=1, seq_len=20, num_heads=1, head_dim=16, generator=gen)
    with rows.pinned("gated_linear", pipeline=GatedPipeline("fused")), launched(table):
        (name,) = fw.pipeline("mamba2", device="cuda", dtype=fp32, head_dim=16, chunk_size=16, variants=True)[2]
        fw.chunk("mamba2", **x, chunk_size=16)
    assert ("scores kernel" in name) == bool(seen["scores"]), name
    assert ("β prefetched" in name) == bool(seen["fwd"][0]["PREFETCH"]), name


def test_the_deep_memories_backward_variants_follow_the_table():
    """Titans' single backward by KEEP (0 recomputes, 1 the sums kept, 2 the read kept; another refused) and
    TTT-Linear's reverse pass by CARRY, DIRECT and POST (another refused): the names the rows give, from the table they
    are handed."""
    table = {**util.LAUNCH, "titans_single_bwd": {**util.LAUNCH["titans_single_bwd"], "KEEP": 0},
             "ttt_linear_bwd": {**util.LAUNCH["ttt_linear_bwd"], "CARRY": 0, "DIRECT": 0, "POST": 0}}
    assert str(V.titans_single_backward(table).variant) == "Titans single backward: recomputes e and the read"
    assert str(V.ttt_linear_backward(table).variant) == "TTT-Linear backward: anchor gradient in memory"
    assert [V.titans_single_backward({"titans_single_bwd": {"KEEP": k}}).keep for k in (0, 1, 2)] == [0, 1, 2]
    post = {"ttt_linear_bwd": {"CARRY": 0, "DIRECT": 1, "POST": 1}}  # POST ≥ 1 carries gA whatever CARRY says
    assert str(V.ttt_linear_backward(post).variant) == (
        "TTT-Linear backward: chain only, dk's products after (G fp32); dtypes in the kernels")
    assert V.ttt_linear_backward({"ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1}}).post == 0  # a table without POST
    with pytest.raises(ValueError, match="POST"):
        V.ttt_linear_backward({"ttt_linear_bwd": {"CARRY": 1, "DIRECT": 1, "POST": 3}})
    with pytest.raises(ValueError, match="KEEP"):
        V.titans_single_backward({"titans_single_bwd": {"KEEP": 3}})
    got = fw.pipeline("titans", device="cuda", dtype=torch.bfloat16, head_dim=64, variants=True, launch=table)[2]
    assert got == ("Titans single backward: recomputes e and the read",)
    got = fw.pipeline("ttt_linear", device="cuda", dtype=torch.bfloat16, head_dim=128, variants=True, launch=table,
                      batch_size=4, num_heads=16)[2]
    assert got == ("TTT-Linear: one program", "TTT-Linear backward: anchor gradient in memory")


def test_the_split_forward_names_its_states_pass():
    """The split forward's variant (`variants.delta_split_forward`, what `rows.delta_chunk_variants` lists for a
    pinned DeltaPipeline("split", ...)): the T form with the backward's states kernel exactly where the split forward
    launches that kernel (tests/kernels/fused/test_triton_delta_fused.LAUNCHED), else the sequential kernel on W, U';
    the inverse's precision and form as the fused forward's."""
    from fastweights import zoo
    from fastweights.dispatch import Target
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.rows import delta_chunk_variants
    from tests.kernels.fused.test_triton_delta_fused import LAUNCHED

    for gate in ("none", "scalar", "diagonal"):
        name = str(V.delta_split_forward(gate, 128, 64, torch.bfloat16, util.LAUNCH))
        assert name.startswith("split forward: ") and name.endswith("; inverse tf32x3; inverse by batched recursion")
        assert ("T form, states kernel" in name) == ("_states_kernel" in LAUNCHED["split", gate]), (gate, name)
    assert "W, U' pre-pass" in str(V.delta_split_forward("scalar", 256, 64, torch.bfloat16, util.LAUNCH))
    target = Target(device_type="cuda", dtype=torch.bfloat16, head_k_dim=128, head_v_dim=128, chunk_size=64)
    got = delta_chunk_variants(zoo.get("gated_deltanet"), target, DeltaPipeline("split", "fused"))
    assert [str(v).split(":")[0] for v in got] == ["split forward", "fused backward"], got
