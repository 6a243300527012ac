"""The pipeline rule of the Triton chunk rows (fastweights/kernels/pipelines.py) and how the rows use and report it.

DELTA and GATED pin the choices made before the rule moved out of the kernel modules (module globals FORWARD,
BACKWARD, FUSED_CHECKED_HEAD_DIMS_CUDA, LOW_PRECISION_MIN_HEAD_DIM_CUDA of kernels/triton/delta.py, PIPELINE of
gated.py): the same table passed against `delta.uses_fused_forward` / `uses_fused_backward` / `runs_in_fp32` and
`gated.uses_fused` at commit "tests: pin today's delta/gated Triton pipeline choices", before the refactor.
"""

from __future__ import annotations

import pytest
import torch

import fastweights as fw
from fastweights import dispatch
from fastweights.kernels import rows
from fastweights.kernels.pipelines import (
    DELTA_PIPELINES,
    DeltaPipeline,
    GatedPipeline,
    delta_pipeline,
    gated_pipeline,
)
from tests.fake_cuda import FakeCuda

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
#: (device, dtype, K, V, C, gate, probe, decay_first) -> (forward, backward, runs in fp32)
DELTA = [
    (("cpu", fp32, 128, 128, 64, "scalar", False, True), ("staged", "staged", False)),
    (("cpu", bf16, 128, 128, 64, "scalar", False, True), ("fused", "fused", False)),
    (("cpu", bf16, 16, 16, 64, "none", False, True), ("fused", "fused", False)),
    (("cpu", bf16, 256, 256, 64, "scalar", False, True), ("fused", "staged", False)),
    (("cpu", bf16, 64, 64, 128, "scalar", False, True), ("fused", "staged", False)),
    (("cpu", bf16, 128, 128, 64, "diagonal", False, True), ("staged", "staged", False)),
    (("cpu", bf16, 64, 64, 64, "scalar", True, False), ("staged", "staged", False)),
    (("cpu", bf16, 64, 64, 64, "none", False, False), ("fused", "fused", False)),
    (("cpu", fp16, 32, 32, 64, "scalar", False, True), ("fused", "fused", False)),
    (("cuda", bf16, 128, 128, 64, "scalar", False, True), ("fused", "fused", False)),
    (("cuda", bf16, 128, 256, 64, "scalar", False, True), ("staged", "fused", False)),
    (("cuda", bf16, 64, 64, 64, "scalar", False, True), ("staged", "staged", False)),
    (("cuda", bf16, 16, 16, 64, "scalar", False, True), ("staged", "staged", True)),
    (("cuda", bf16, 64, 32, 64, "none", False, True), ("staged", "staged", True)),
    (("cuda", fp32, 16, 16, 64, "scalar", False, True), ("staged", "staged", False)),
    (("cuda", fp32, 128, 128, 64, "scalar", False, True), ("staged", "staged", False)),
    (("cuda", fp16, 128, 128, 64, "none", False, True), ("fused", "fused", False)),
    (("cuda", bf16, 256, 256, 64, "scalar", False, True), ("staged", "staged", False)),
    (("cuda", bf16, 128, 128, 64, "diagonal", False, True), ("staged", "staged", False)),
    (("cuda", bf16, 128, 128, 128, "scalar", False, True), ("fused", "staged", False)),
    (("cuda", bf16, 128, 128, 64, "scalar", True, False), ("staged", "staged", False)),
]

#: (device, dtype, K, V, gate) -> fused
GATED = [
    (("cpu", bf16, 64, 64, "scalar"), False),
    (("cuda", bf16, 128, 128, "none"), False),
    (("cuda", fp32, 64, 64, "diagonal"), False),
]


@pytest.mark.parametrize("facts,want", DELTA, ids=[str(i) for i in range(len(DELTA))])
def test_delta_choice_pinned(facts, want):
    device, dtype, K, V, C, gate, probe, decay_first = facts
    got = delta_pipeline(gate=gate, probe=probe, decay_first=decay_first, device_type=device, dtype=dtype, K=K, V=V,
                         C=C)
    assert (got.forward, got.backward, got.fp32) == want and got.recompute_states
    assert got.name in DELTA_PIPELINES


@pytest.mark.parametrize("facts,want", DELTA, ids=[str(i) for i in range(len(DELTA))])
def test_the_split_switch_replaces_the_fused_forward_only(facts, want):
    """split=True (util.LAUNCH["delta_split_out"]["ON"] 1): the split forward exactly where the rule runs the fused
    one; the backward, the fp32 copies and every staged choice unchanged."""
    device, dtype, K, V, C, gate, probe, decay_first = facts
    got = delta_pipeline(gate=gate, probe=probe, decay_first=decay_first, device_type=device, dtype=dtype, K=K, V=V,
                         C=C, split=True)
    forward, backward, fp32 = want
    assert (got.forward, got.backward, got.fp32) == ("split" if forward == "fused" else forward, backward, fp32)
    assert got.name in DELTA_PIPELINES


def test_the_row_names_the_split_forward_the_launch_table_switches_on(monkeypatch):
    """The delta row's pipeline (what `fw.pipeline` and the kernels' glue run) follows util.LAUNCH["delta_split_out"]
    ["ON"] as the kernels now read it."""
    from fastweights.kernels.triton.common import util

    target = dispatch.Target("cuda", bf16, 128, 128, 64)
    recipe = fw.zoo.get("gated_deltanet")
    assert rows.delta_chunk_pipeline(recipe, target) == DeltaPipeline("fused", "fused")
    monkeypatch.setitem(util.LAUNCH["delta_split_out"], "ON", 1)
    assert rows.delta_chunk_pipeline(recipe, target) == DeltaPipeline("split", "fused")


@pytest.mark.parametrize("facts,want", GATED)
def test_gated_choice_pinned(facts, want):
    device, dtype, K, V, gate = facts
    got = gated_pipeline(gate=gate, device_type=device, dtype=dtype, K=K, V=V)
    assert (got.pipeline == "fused") == want and got.recompute_states


@pytest.mark.parametrize("model,facts,want", [
    ("gated_deltanet", ("cuda", bf16, 128, 256, 64), ("triton", "staged forward, fused backward")),
    ("deltanet", ("cuda", bf16, 128, 128, 64), ("triton", "fused forward, fused backward")),
    ("gated_deltanet", ("cuda", bf16, 32, 32, 64), ("triton", "staged forward, staged backward, in fp32")),
    ("kda", ("cuda", bf16, 128, 128, 64), ("triton", "staged forward, staged backward")),
    ("comba", ("cuda", bf16, 128, 128, 64), ("triton", "staged forward, staged backward")),
    ("gated_deltanet", ("cuda", fp32, 128, 128, 64), ("triton", "staged forward, staged backward")),
    ("retnet", ("cuda", bf16, 128, 128, 64), ("triton", "staged")),
    ("gla", ("cuda", bf16, 64, 64, 64), ("triton", "staged")),
    ("gated_deltanet", ("cpu", bf16, 128, 256, 64), ("torch", None)),
    ("gated_deltanet", ("cuda", bf16, 128, 128, 48), ("torch", None)),  # chunk 48: the torch row
])
def test_fastweights_pipeline_names_the_row_and_its_pipeline(model, facts, want):
    device, dtype, K, V, C = facts
    assert fw.pipeline(model, device=device, dtype=dtype, head_dim=K, head_v_dim=V, chunk_size=C) == want


def test_rows_list_the_named_pipelines():
    listed = dispatch.rows(pipelines=True)
    delta = [r[3] for r in listed if r[:3] == ("delta", "chunk", "triton")]
    assert delta == list(DELTA_PIPELINES) and "staged forward, staged backward, in fp32" in delta
    assert [r[3] for r in listed if r[:3] == ("gated_linear", "chunk", "triton")] == ["staged", "fused"]
    assert ("delta", "chunk", "torch", None) in listed
    assert sorted({r[:3] for r in listed}) == dispatch.rows()  # every row, once or once per pipeline


def _pipeline_spy():
    """(seen, spy): a stand-in for a chunk kernel's glue that records the `pipeline` it was handed and returns
    zeros of the right shapes (o [B, T, H, V], the final state [B, H, K, V])."""
    seen = []

    def spy(q, k, v, **kw):
        seen.append(kw["pipeline"])
        B, T, H, V = v.shape
        return torch.zeros_like(v), torch.zeros(B, H, q.shape[-1], V)

    return seen, spy


def test_the_delta_row_passes_its_pipeline_to_the_kernels(monkeypatch, gen):
    """The row computes the pipeline from the call's Target and hands it to `chunk_delta_triton` as an argument
    (the row run on the CPU through the fake CUDA table; the kernel replaced by a spy)."""
    from fastweights.kernels.triton import delta as delta_mod

    seen, spy = _pipeline_spy()

    monkeypatch.setattr(delta_mod, "chunk_delta_triton", spy)
    FakeCuda(monkeypatch, kernels=True).install()
    for dtype, C in ((bf16, 64), (fp32, 64), (bf16, 128)):
        x = fw.example_inputs("gated_deltanet", batch_size=1, seq_len=5, num_heads=2, head_dim=16, head_v_dim=32,
                              dtype=dtype, generator=gen)
        fw.chunk("gated_deltanet", **x, chunk_size=C)
        target = dispatch.Target("cpu", dtype, 16, 32, C)
        assert seen[-1] == rows.delta_chunk_pipeline(fw.zoo.get("gated_deltanet"), target)
    assert [(p.forward, p.backward) for p in seen] == [("fused", "fused"), ("staged", "staged"), ("fused", "staged")]


def test_pipeline_objects_check_their_fields():
    with pytest.raises(ValueError, match="forward must be one of"):
        DeltaPipeline(forward="fast")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        GatedPipeline("fast")
    kept = DeltaPipeline("fused", "staged", recompute_states=False)
    assert kept.name == "fused forward, staged backward, states kept"


def test_a_pinned_row_runs_the_pinned_pipeline_and_is_put_back(monkeypatch, gen):
    """`rows.pinned`: within the block the row hands the pinned pipeline (the generic row: the Newton–Schulz
    precision) to the kernels and names it, after it the rule's again; a pipeline of the other class, an unknown
    option, precision or class is refused (the chunk kernels: spies)."""
    from fastweights.inputs import InputError
    from fastweights.kernels.triton import delta as delta_mod
    from fastweights.kernels.triton import gated as gated_mod

    seen, spy = _pipeline_spy()

    monkeypatch.setattr(delta_mod, "chunk_delta_triton", spy)
    monkeypatch.setattr(gated_mod, "chunk_gated_triton", spy)
    FakeCuda(monkeypatch, kernels=True).install()
    cases = (("gated_deltanet", "delta", DeltaPipeline("staged", "fused", recompute_states=False)),
             ("gla", "gated_linear", GatedPipeline("fused", recompute_states=False)))
    for model, cls, pinned in cases:
        x = fw.example_inputs(model, batch_size=1, seq_len=5, num_heads=2, head_dim=16, dtype=bf16, generator=gen)
        rule = dispatch.DISPATCH[(cls, "chunk", "triton")]
        with rows.pinned(cls, pipeline=pinned):
            fw.chunk(model, **x, chunk_size=16)
            assert seen[-1] == pinned
            assert fw.pipeline(model, device="cuda", dtype=bf16, head_dim=16, chunk_size=16) == ("triton", pinned.name)
        assert dispatch.DISPATCH[(cls, "chunk", "triton")] is rule
        fw.chunk(model, **x, chunk_size=16)
        assert seen[-1] != pinned and seen[-1].recompute_states
    from fastweights.kernels.triton.memories import newton_schulz

    precisions = []
    kernel = newton_schulz.newton_schulz_gram

    def ns_spy(G, steps, *, precision):
        precisions.append(precision)
        return kernel(G, steps)  # (ieee: the interpreter's)

    monkeypatch.setattr(newton_schulz, "newton_schulz_gram", ns_spy)
    x = fw.example_inputs("atlas", batch_size=1, seq_len=4, num_heads=1, head_dim=8, generator=gen)
    with rows.pinned("generic", precision="tf32x3"):
        fw.chunk("atlas", **x, chunk_size=16)
        assert fw.pipeline("atlas", device="cuda", dtype=fp32, head_dim=8, chunk_size=16) == (
            "triton", "Newton–Schulz kernel (tf32x3)")
    assert precisions and set(precisions) == {"tf32x3"}
    fw.chunk("atlas", **x, chunk_size=16)
    assert precisions[-1] == "ieee"
    with pytest.raises(InputError, match="precision must be one of"):
        with rows.pinned("generic", precision="fp8"):
            pass
    with pytest.raises(InputError, match="pipeline must be a kernels.pipelines.DeltaPipeline"):
        with rows.pinned("delta", pipeline=GatedPipeline("fused")):
            pass
    with pytest.raises(InputError, match="takes one option, precision="):
        with rows.pinned("generic", pipeline=DeltaPipeline()):
            pass
    with pytest.raises(InputError, match="recipe_class must be one of"):
        with rows.pinned("softmax", pipeline=DeltaPipeline()):
            pass
    with pytest.raises(InputError, match="takes one option, precision="):  # Mesa's CG row: its precision
        with rows.pinned("mesa", pipeline=DeltaPipeline()):
            pass
    assert dispatch.DISPATCH[("delta", "chunk", "triton")] is not None
