"""The per-kernel launch table `fastweights.kernels.triton.common.util.LAUNCH`: every launch site of the
chunk pipelines reads its own entry, an override reaches that launch and no other, the tile keys
(BV, BC) are pure launch choices (other values, the same results), and a swept table loads from
JSON (`util.load_launch`; no environment variable applies one). The GPU sweep that picks the entries is
`scripts/gpu_kernels.py --stages sweep-kernels`.

Marked `triton`: under the interpreter on a machine without CUDA (launch keywords are recorded,
not acted on there), at tiny shapes.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from fastweights.kernels.pipelines import DeltaPipeline, GatedPipeline
from fastweights.kernels.triton.common import util
from fastweights.kernels.triton.gated import chunk_gated_triton
from fastweights.kernels.triton.layer.prologue import delta_prologue
from tests.kernels.helpers import DEV, delta_inputs, delta_triton, grads, rel, to_dev
from tests.tolerances import F32

pytestmark = pytest.mark.triton

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
RECORDED = ("num_warps", "num_stages", "BV", "BC")  # launch keywords and tile constexprs


@pytest.fixture
def table(monkeypatch):
    """util.LAUNCH as a private copy for this test (overrides are undone after it)."""
    monkeypatch.setattr(util, "LAUNCH", copy.deepcopy(util.LAUNCH))
    return util.LAUNCH


@pytest.fixture
def calls(monkeypatch):
    """{launch site name: [(grid, {keyword: value}) of each launch]}, recorded at every kernel of
    util.KERNEL_FN (its `run`, which `kernel[grid](...)` calls)."""
    rec: dict = {}
    for name, path in util.KERNEL_FN.items():
        mod, fn = path.rsplit(".", 1)
        kernel = getattr(importlib.import_module(f"fastweights.kernels.triton.{mod}"), fn)

        def spy(*args, grid, warmup, _run=kernel.run, _name=name, **kw):
            rec.setdefault(_name, []).append((tuple(grid), {key: kw[key] for key in RECORDED if key in kw}))
            return _run(*args, grid=grid, warmup=warmup, **kw)

        monkeypatch.setattr(kernel, "run", spy)
    return rec


def _delta(x, **kw):
    """The staged forward and backward (whatever the rule picks)."""
    return delta_triton(x, pipeline=DeltaPipeline("staged", "staged"), **kw)


def _delta_rule(x, **kw):
    """No pipeline argument: what the glue's rule picks (it reads util.LAUNCH["delta_split_out"]["ON"])."""
    return delta_triton(x, **kw)


def _delta_fused(x, **kw):
    """The fused forward and the staged backward."""
    return delta_triton(x, pipeline=DeltaPipeline("fused", "staged"), **kw)


def _delta_split(x, **kw):
    """The split forward and the staged backward."""
    return delta_triton(x, pipeline=DeltaPipeline("split", "staged"), **kw)


def _delta_fused_bwd(x, *, t_form=False, **kw):
    """The fused forward (its T-form variant with `t_form`: the pre-pass writes only T) and the fused backward."""
    old = util.LAUNCH["delta_prepass"]["WU"]
    util.LAUNCH["delta_prepass"]["WU"] = 0 if t_form else old
    try:
        return delta_triton(x, pipeline=DeltaPipeline("fused", "fused"), **kw)
    finally:
        util.LAUNCH["delta_prepass"]["WU"] = old


def _grads_rows(gen):
    """The fused backward with its gradient kernel's rows over programs (LAUNCH["delta_fused_grads_rows"]["ON"] = 1
    through the backward; a chunk of 32: BR 16 < C)."""
    old = util.LAUNCH["delta_fused_grads_rows"]["ON"]
    util.LAUNCH["delta_fused_grads_rows"]["ON"] = 1
    try:
        grads(_delta_fused_bwd, delta_inputs("scalar", gen, T=20, K=16, V=16), 1, chunk_size=32)
    finally:
        util.LAUNCH["delta_fused_grads_rows"]["ON"] = old


def _gated(x, *, chunk_size=16, pipeline=None):
    d = to_dev(x)
    return chunk_gated_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], scale=0.4,
                              initial_state=d["S0"], output_final_state=True, chunk_size=chunk_size,
                              pipeline=pipeline)


def _gated_fused(x, *, aqk=0, **kw):
    old_aqk = util.LAUNCH["gated_fused_fwd"]["AQK"]
    util.LAUNCH["gated_fused_fwd"]["AQK"] = aqk  # 1: the scores kernel (gated_fused_scores) runs too
    try:
        return _gated(x, pipeline=GatedPipeline("fused"), **kw)
    finally:
        util.LAUNCH["gated_fused_fwd"]["AQK"] = old_aqk


def _pipelines(gen, *, K=16, V=16, T=20, chunk_size=16):
    """(name, fn, inputs, kw) of the chunk pipelines: the delta class with each gate (staged and fused
    forward) and Comba's decay-after (probe key, exclusive cumsum), the gated class with a scalar and a
    diagonal gate."""
    out = []
    for gate in ("none", "scalar", "diagonal"):
        out.append((f"delta {gate}", _delta, delta_inputs(gate, gen, T=T, K=K, V=V), dict(chunk_size=chunk_size)))
        out.append((f"delta fused {gate}", _delta_fused, delta_inputs(gate, gen, T=T, K=K, V=V),
                    dict(chunk_size=chunk_size)))
        if gate == "scalar":  # the split forward (its states pass and output kernel), the staged backward
            out.append((f"delta split {gate}", _delta_split, delta_inputs(gate, gen, T=T, K=K, V=V),
                        dict(chunk_size=chunk_size)))
        if gate != "diagonal":  # the fused backward (no/scalar decay), after the T-form forward for the scalar gate
            out.append((f"delta fused bwd {gate}", partial(_delta_fused_bwd, t_form=gate == "scalar"),
                        delta_inputs(gate, gen, T=T, K=K, V=V), dict(chunk_size=chunk_size)))
    out.append(("comba", _delta_rule, delta_inputs("scalar", gen, T=T, K=K, V=V, probe=True),  # the rule: staged
                dict(chunk_size=chunk_size, decay_first=False)))
    for gate in ("scalar", "diagonal"):
        x = delta_inputs(gate, gen, T=T, K=K, V=V)
        out.append((f"gated {gate}", _gated, x, dict(chunk_size=chunk_size)))
        out.append((f"gated fused {gate}", _gated_fused, x, dict(chunk_size=chunk_size, aqk=int(gate == "diagonal"))))
    return out


def _prologue(gen):
    """The delta prologue forward and backward (L2 norms, β, the KDA gate with its cumsum)."""
    x = {"q": torch.randn(1, 20, 2, 16, generator=gen), "k": torch.randn(1, 20, 2, 16, generator=gen),
         "b": torch.randn(1, 20, 2, generator=gen), "a": torch.randn(1, 20, 2, 16, generator=gen)}
    leaves = {n: v.to(DEV).requires_grad_(True) for n, v in x.items()}
    A_log, dt_bias = torch.zeros(2, device=DEV), torch.zeros(32, device=DEV)
    out = delta_prologue(leaves["q"], leaves["k"], leaves["b"], leaves["a"], A_log, dt_bias, gate="kda")
    sum(o.float().sum() for o in out).backward()


def _memories(gen):
    """TTT-Linear's, TTT-MLP's and Titans' loop kernels forward and backward (D 16, b 16, T 20)."""
    from fastweights.kernels.triton.memories.titans import titans_triton
    from fastweights.kernels.triton.memories.ttt import ttt_linear_triton
    from fastweights.kernels.triton.memories.ttt_mlp import ttt_mlp_triton

    B, T, H, D = 1, 20, 2, 16
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(DEV).requires_grad_(True) for _ in range(3))
    beta = torch.rand(B, T, H, generator=gen).to(DEV).requires_grad_(True)
    lnw, lnb = torch.ones(H, D, device=DEV), torch.zeros(H, D, device=DEV)
    lin = (torch.randn(B, H, D, D, generator=gen).to(DEV) * 0.1, torch.zeros(B, H, 1, D, device=DEV))
    bwd = util.LAUNCH["ttt_linear_bwd"]
    old = util.LAUNCH["ttt_linear_sliced"]["ON"], bwd["CARRY"], bwd["POST"]
    try:  # TTT-Linear's one-program sequential passes (ON 0; the reverse pass `_bwd_kernel` at CARRY 0, the default
        # `_bwd_carry_kernel` at 1, the chain-only `_bwd_chain_kernel` and `_bwd_post_kernel` at POST 1), then its
        # sliced ones (memories/ttt_linear_sliced.py)
        for on, carry, post in ((0, 0, 0), (0, 1, 0), (0, 1, 1), (1, 1, 0)):
            util.LAUNCH["ttt_linear_sliced"]["ON"], bwd["CARRY"], bwd["POST"] = on, carry, post
            ttt_linear_triton(q, k, v, beta, lnw, lnb, scale=0.25, weights=lin)[0].sum().backward()
    finally:
        util.LAUNCH["ttt_linear_sliced"]["ON"], bwd["CARRY"], bwd["POST"] = old
    mlp = (torch.randn(B, H, D, 4 * D, generator=gen).to(DEV) * 0.1, torch.zeros(B, H, 1, 4 * D, device=DEV),
           torch.randn(B, H, 4 * D, D, generator=gen).to(DEV) * 0.1, torch.zeros(B, H, 1, D, device=DEV))
    old = util.LAUNCH["ttt_mlp_sliced"]["ON"]
    try:  # TTT-MLP's one-program kernels (ON 0), then its sliced ones (memories/ttt_mlp_sliced.py)
        for on in (0, 1):
            util.LAUNCH["ttt_mlp_sliced"]["ON"] = on
            ttt_mlp_triton(q, k, v, beta, lnw, lnb, scale=0.25, weights=mlp)[0].sum().backward()
    finally:
        util.LAUNCH["ttt_mlp_sliced"]["ON"] = old
    g, nu = (torch.rand(B, T, H, generator=gen).to(DEV) for _ in range(2))
    old = util.LAUNCH["titans_sliced"]["ON"]
    try:  # Titans' two pipelines on the one-program kernels (ON 0) — the single one as the launch table picks it at
        # this head dim (limits.titans_pipeline reads titans_single_fwd MAX_DIM) —, then the split pipeline with its
        # sequential passes sliced (ON 1: memories/titans_sliced.py)
        for pipeline, on in ((None, 0), ("split", 0), ("split", 1)):
            util.LAUNCH["titans_sliced"]["ON"] = on
            titans_triton(q, k, v, -g, beta, nu, scale=0.25, weights=mlp[::2], momentum=mlp[::2],
                          pipeline=pipeline)[0].sum().backward()
    finally:
        util.LAUNCH["titans_sliced"]["ON"] = old


def _conv(gen):
    """The short conv forward and its backwards (the one-pass, the two kernels, the row-streaming one), and RoPE
    forward and backward."""
    from fastweights.kernels.triton.layer.conv import short_conv
    from fastweights.kernels.triton.layer.rope import rope

    for one_pass, rows in ((True, 0), (False, 0), (True, 1)):  # rows: the row-streaming backward (conv_bwd_rows)
        old = util.LAUNCH["conv_bwd_rows"]["ON"]
        util.LAUNCH["conv_bwd_rows"]["ON"] = rows
        try:
            x = torch.randn(1, 20, 8, generator=gen).to(DEV).requires_grad_(True)
            w = torch.randn(8, 4, generator=gen).to(DEV).requires_grad_(True)
            short_conv(x, w, one_pass_backward=one_pass)[0].sum().backward()
        finally:
            util.LAUNCH["conv_bwd_rows"]["ON"] = old
    x = torch.randn(1, 20, 2, 8, generator=gen).to(DEV).requires_grad_(True)
    rope(x, 3).sum().backward()


def test_default_table_covers_every_launch_site(gen, table, calls, monkeypatch):
    """The delta and gated pipelines (forward and backward, every gate), the prologue, the TTT memories' and Titans'
    loops, the short conv and RoPE launch every kernel of util.KERNEL_FN, each under its own name in util.LAUNCH,
    with today's defaults: 4 warps, 2 stages (1 for the TTT loops but TTT-Linear's parallel ones; the conv's and
    RoPE's Triton default, none passed), BV 64 (or V), qk_grads' BC 32 (scalar / no gate) and 16 (diagonal)."""
    monkeypatch.setattr(util, "SEEN", set())
    seed = 1
    for _, fn, x, kw in _pipelines(gen):
        grads(fn, x, seed, **kw)
    _grads_rows(gen)
    _prologue(gen)
    _memories(gen)
    _conv(gen)
    assert set(util.KERNEL_FN) == set(table)
    sites = {s for s in util.SEEN if "." not in s}
    assert sites == set(table), f"never launched: {set(table) - sites}"
    tiles = {f"{name}.{key}" for name, cfg in table.items() for key in cfg if key[:1].isupper()}
    assert util.SEEN - sites == tiles  # every tile key is read
    assert set(calls) == set(table)
    for name, launches in calls.items():
        for _, kw in launches:
            if name in GATED_FUSED_WARPS:  # the fused gated-linear pipeline's own defaults (fp32 inputs: 1 stage)
                assert kw["num_warps"] in GATED_FUSED_WARPS[name] and kw["num_stages"] == 1, name
                continue
            # the state passes run unpipelined for fp32 inputs (these are): util.state_pass_launch
            # (8: delta_fused_grads' [C, K] accumulators' registers; TTT-Linear's [D, D] weight, BENCHMARKS §1m)
            # (Titans' loop kernels: ptxas's register allocation at 4 warps, util.LAUNCH; TTT-MLP's: timed, §1p; its
            # sliced steps: 4 warps, two CTAs an SM, timed on the H200 in r4s12–13; their parallel kernels: sm_90
            # registers; Titans' sliced sequential kernels: sm_90 registers)
            warps = 8 if name in ("delta_fused_grads", "delta_split_out",
                                  "ttt_linear_fwd", "ttt_linear_bwd", "titans_fwd",
                                  "titans_bwd", "titans_single_fwd", "titans_single_bwd", "ttt_mlp_fwd",
                                  "ttt_mlp_bwd", "ttt_mlp_sliced_read", "ttt_mlp_sliced_bwd_pre", "titans_sliced",
                                  "titans_sliced_bwd") else 2 if name == "conv_bwd_rows" else 4
            # (the TTT loops: a scratch; TTT-Linear's and Titans' parallel kernels pipeline their loads: timed, H200)
            parallel = name in ("ttt_linear_readout", "ttt_linear_bwd_read", "ttt_linear_bwd_post", "titans_readout",
                                "titans_bwd_read")
            stages = 1 if name in STATE_PASSES or name.startswith(("ttt_", "titans_")) and not parallel else 2
            if name == "delta_fused_grads_rows":  # (1 stage: its V loops are two tiles long; sm_90 registers)
                stages = 1
            if name.startswith("conv_") or name == "rope":
                stages = None  # (Triton's default: a single pass, nothing to pipeline)
            assert kw["num_warps"] == warps and kw.get("num_stages") == stages, name
            if "BV" in kw and name in ("delta_states_fwd", "delta_states_bwd", "states_fwd", "states_bwd",
                                       "output_fwd", "delta_fused_fwd", "delta_fused_rec", "delta_fused_rev",
                                       "delta_fused_fwd_t", "delta_fused_grads", "delta_fused_grads_rows",
                                       "delta_split_states", "delta_split_out"):
                assert kw["BV"] == 16, name  # min(64, V = 16)
    assert {kw["BC"] for _, kw in calls["qk_grads"]} == {16}  # min(32 or 16, C = 16)


def test_override_reaches_only_its_launch(gen, table, calls):
    """One entry changed (the delta backward state pass: 8 warps, 3 stages, BV 16 at V = 32): that
    kernel's launches change (keywords, and the grid's V tiles), every other launch is as before,
    the forward's results are bit-equal and the gradients equal up to the order of the ∂L/∂G_last sum."""
    x = delta_inputs("scalar", gen, T=20, K=16, V=32)
    seed = 3
    before = grads(_delta, x, seed)
    calls_before = copy.deepcopy(calls)
    calls.clear()
    old = util.load_launch({"delta_states_bwd": {"num_warps": 8, "num_stages": 3, "BV": 16}})
    assert old["delta_states_bwd"] == dict(num_warps=4, num_stages=2, BV=64)
    assert util.launch("delta_states_bwd") == dict(num_warps=8, num_stages=3)
    assert util.launch("delta_states_fwd") == dict(num_warps=4, num_stages=2)
    after = grads(_delta, x, seed)
    assert set(calls) == set(calls_before)
    for name in calls:
        if name != "delta_states_bwd":
            assert calls[name] == calls_before[name], name
    (grid0, kw0), = calls_before["delta_states_bwd"]
    (grid1, kw1), = calls["delta_states_bwd"]
    # num_stages: 1 for these fp32 inputs whatever the table says (util.state_pass_launch)
    assert kw0 == dict(num_warps=4, num_stages=1, BV=32) and kw1 == dict(num_warps=8, num_stages=1, BV=16)
    assert grid1[0] == 2 * grid0[0] and grid1[1:] == grid0[1:]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    for n in before[2]:
        assert rel(after[2][n], before[2][n]) < F32, n
    table.update(old)
    assert util.launch("delta_states_bwd") == dict(num_warps=4, num_stages=2)


STATE_PASSES = ("delta_states_fwd", "delta_states_bwd", "states_fwd", "states_bwd", "delta_fused_fwd",
                "delta_fused_rec", "delta_fused_rev", "delta_fused_fwd_t", "delta_split_states")
#: The fused gated-linear pipeline's warps (util.LAUNCH): its forward 8 with the diagonal decay (WARPS_DIAG), its
#: chunk kernel 8 (a whole chunk's dq, dk accumulators).
GATED_FUSED_WARPS = {"gated_fused_fwd": {4, 8}, "gated_fused_bwd_states": {4}, "gated_fused_bwd_chunk": {8},
                     "gated_fused_scores": {4}}


def test_state_passes_unpipelined_where_shared_memory_overflows(table):
    """The state passes keep the table's num_stages for bf16/fp16 inputs with K ≤ 128 and run with
    num_stages 1 for fp32 inputs or K > 128 (their staged chunk tiles outgrow 227 KB on an H100)."""
    util.load_launch({"delta_states_bwd": {"num_stages": 3}})
    assert util.state_pass_launch("delta_states_bwd", torch.bfloat16, 128)["num_stages"] == 3
    assert util.state_pass_launch("delta_states_bwd", torch.float16, 64)["num_stages"] == 3
    assert util.state_pass_launch("delta_states_bwd", torch.float32, 128)["num_stages"] == 1
    assert util.state_pass_launch("delta_states_bwd", torch.bfloat16, 256)["num_stages"] == 1
    assert util.launch("delta_states_bwd")["num_stages"] == 3  # the table itself unchanged


@pytest.mark.variants
@pytest.mark.variants  # (launch choices: the newest environment holds them; the floor runs the defaults)
def test_tiles_are_launch_choices(gen, table):
    """Every tile key of the table at another value (BV 16 of 32 value columns: two programs per
    state instead of one; qk_grads' BC 16 and BC_DIAG 32 at C = 32; the pre-pass's inverse form INV 1, a
    code of `variants.INVERSE_FORMS`): outputs, final state and every gradient as with the defaults (fp32,
    only summation orders differ), all pipelines."""
    cases = _pipelines(gen, K=32, V=32, T=40, chunk_size=32)
    seed = 5
    want = [grads(fn, x, seed, **kw) for _, fn, x, kw in cases]
    other = {name: {key: (16 if key in ("BV", "BC") else 1 if key == "INV" else 32) for key in cfg if key[:1].isupper()}
             for name, cfg in table.items()}
    util.load_launch({name: cfg for name, cfg in other.items() if cfg})
    for (what, fn, x, kw), w in zip(cases, want):
        got = grads(fn, x, seed, **kw)
        assert rel(got[0], w[0]) < F32 and rel(got[1], w[1]) < F32, what
        for n in w[2]:
            assert rel(got[2][n], w[2][n]) < F32, f"d{n} {what}"


def test_load_launch_rejects_unknown_names(table):
    with pytest.raises(KeyError, match="unknown launch site"):
        util.load_launch({"no_such_kernel": {"num_warps": 8}})
    with pytest.raises(KeyError, match="has no setting"):
        util.load_launch({"wy_bwd": {"num_warps": 8}, "cumsum": {"BV": 32}})
    assert util.launch("wy_bwd") == dict(num_warps=4, num_stages=2)  # nothing applied


@pytest.mark.variants
def test_launch_table_from_a_file(tmp_path):
    """`util.load_launch(path)` applies a swept table (e.g. best_launch.json) from its file — the only way one is
    applied (FASTWEIGHTS_LAUNCH, read at import, is gone: it stays unread, so the defaults hold)."""
    path = tmp_path / "best_launch.json"
    path.write_text(json.dumps({"wy_bwd": {"num_warps": 8, "num_stages": 1}, "qk_grads": {"BC": 64}}))
    code = ("import json, sys; from fastweights.kernels.triton.common import util; before = util.launch('wy_bwd'); "
            "util.load_launch(sys.argv[1]); "
            "print(json.dumps([before, util.launch('wy_bwd'), util.launch('wy_fwd'), util.tile('qk_grads', 'BC')]))")
    env = dict(os.environ, FASTWEIGHTS_LAUNCH=str(path), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [dict(num_warps=4, num_stages=2),
                                                              dict(num_warps=8, num_stages=1),
                                                              dict(num_warps=4, num_stages=2), 64]


def test_sweep_plan_names_the_table():
    """scripts/gpu_kernels.py's sweep-kernels plan: its order lists every launch site of the table once,
    its tile options are tile keys of the table, every candidate is a full config of its site (the
    default first), and gated DeltaNet's plan is the 117 candidates its docstring counts."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kernels", os.path.join(ROOT, "scripts", "gpu_kernels.py"))
    gk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gk)
    gk.ARGS = argparse.Namespace(sweep_limit=0)
    assert sorted(gk.SWEEP_ORDER) == sorted(util.LAUNCH)
    assert set(gk.HEAVY) <= set(gk.SWEEP_ORDER)
    for name, opts in gk.TILE_OPTIONS.items():
        for opt in opts:
            assert set(opt) <= {key for key in util.LAUNCH[name] if key[:1].isupper()}, name
    gdn_tiles = {"delta_states_fwd.BV", "delta_states_bwd.BV", "output_fwd.BV", "qk_grads.BC"}
    gdn_sites = ("delta_states_bwd", "wy_bwd", "qk_grads", "delta_states_fwd", "output_fwd", "delta_output_bwd",
                 "wy_fwd", "scores", "inverse", "delta_grads", "cumsum")
    total = 0
    for name in gdn_sites:
        cands = gk._candidates(name, util.LAUNCH[name], gdn_tiles)
        assert cands[0] == util.LAUNCH[name] and all(set(c) == set(util.LAUNCH[name]) for c in cands)
        assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
        total += len(cands)
    assert total == 117


def test_row_view_reads_column_views_in_place_and_copies_the_rest():
    """`util.row_view(x, lead)`: a column view of a wider tensor (rows one stride apart, the rest contiguous) is x
    itself; rows not one stride apart, or a non-contiguous trailing block, give a contiguous copy of the same values."""
    wide = torch.randn(2, 5, 3, 11)
    col = wide[:, :, :, 2:10]  # [B, T, H, 8]: trailing 8 contiguous, but H steps 11 — a block only at lead 3
    assert util.row_view(col, 3) is col
    flat = torch.randn(2, 5, 40)[:, :, 4:28].view(2, 5, 3, 8)  # [B, T, 3, 8]: B·T rows of 24 contiguous
    assert util.row_view(flat, 2) is flat
    head = torch.randn(2, 6, 24)[:, :5]  # batch rows not one stride apart
    for x, lead in ((col, 2), (head, 2), (wide.transpose(2, 3), 3)):
        y = util.row_view(x, lead)
        assert y is not x and y.is_contiguous() and torch.equal(y, x)
