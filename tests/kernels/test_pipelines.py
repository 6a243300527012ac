"""Today's pipeline choices pinned (before the refactor that moves them out of the kernel modules)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastweights.kernels.triton import delta as delta_mod
from fastweights.kernels.triton import gated as gated_mod

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
    (("cuda", bf16, 16, 16, 64, "scalar", False, True), (None, None, True)),
    (("cuda", bf16, 64, 32, 64, "none", False, True), (None, None, True)),
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

_GDIM = {"none": None, "scalar": 3, "diagonal": 4}


def _g(gate):
    return None if _GDIM[gate] is None else SimpleNamespace(dim=lambda: _GDIM[gate])


@pytest.mark.parametrize("facts,want", DELTA, ids=[str(i) for i in range(len(DELTA))])
def test_delta_choice_pinned(facts, want):
    device, dtype, K, V, C, gate, probe, decay_first = facts
    x = SimpleNamespace(is_cuda=device == "cuda", dtype=dtype)
    L = SimpleNamespace(K=K, V=V, C=C)
    fp32_copy = delta_mod.runs_in_fp32(x, L)
    p = object() if probe else None
    if fp32_copy:
        x = SimpleNamespace(is_cuda=device == "cuda", dtype=fp32)
        assert (delta_mod.uses_fused_forward(p, _g(gate), decay_first, L, x),
                delta_mod.uses_fused_backward(p, _g(gate), decay_first, L, x)) == (False, False)
    got = (None if fp32_copy else ("fused" if delta_mod.uses_fused_forward(p, _g(gate), decay_first, L, x)
                                   else "staged"),
           None if fp32_copy else ("fused" if delta_mod.uses_fused_backward(p, _g(gate), decay_first, L, x)
                                   else "staged"),
           fp32_copy)
    assert got == want


@pytest.mark.parametrize("facts,want", GATED)
def test_gated_choice_pinned(facts, want):
    device, dtype, K, V, gate = facts
    assert gated_mod.uses_fused(_g(gate), K, V, device == "cuda") == want
