"""fastweights.chunk on CUDA at long T in bf16: q, k, v in bf16 (g and β in fp32) with strong
decay (g = −5 per token), no decay (g = 0) and alternating runs of 1,000 tokens with g = 0 (the
rest as example_inputs draws it). Outputs and final states finite; both within the bf16 tolerance
of the fp32 chunk form on the same bf16-rounded q, k, v (what is left is the arithmetic and the
output's rounding). Fresh random inputs each run; the seed is in every failure message.

Marked `cuda`: run with `python3 -m pytest -m cuda tests/cuda` on a GPU machine; skipped without
a CUDA device. (These are the long-T checks scripts/gpu_check.py used to print.)
"""

from __future__ import annotations

import secrets

import pytest
import torch

import fastweights as fw
from fastweights.state import state_tensors
from tests.helpers import rel_err
from tests.tolerances import CHUNK_LOW_REL

pytestmark = [pytest.mark.cuda, pytest.mark.cuda_big,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]

MODELS = ["gated_deltanet", "gla", "mamba2", "kda"]
DECAYS = ["strong", "none", "zero_runs"]
LENGTHS = [4096, 65536]
H, D = 2, 64


def long_inputs(name: str, decay: str, T: int, device, seed: int) -> dict:
    """fp32 inputs on `device` with the log-decay g replaced as `decay` says."""
    x = fw.example_inputs(name, batch_size=1, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float32,
                          device=device, seed=seed)
    x.pop("initial_state", None)
    g = x["g"]
    if decay == "strong":
        x["g"] = torch.full_like(g, -5.0)
    elif decay == "none":
        x["g"] = torch.zeros_like(g)
    else:  # runs of 1,000 tokens without decay, then 1,000 with example_inputs' ordinary decay, …
        run = (torch.arange(T, device=device) // 1000) % 2 == 0
        x["g"] = torch.where(run.view(1, T, *([1] * (g.dim() - 2))), torch.zeros_like(g), g)
    return x


def check_long_bf16(name: str, decay: str, T: int, device) -> None:
    seed = secrets.randbelow(2**31)
    x = long_inputs(name, decay, T, device, seed)
    low = {k: (v.to(torch.bfloat16) if k in ("q", "k", "v") else v) for k, v in x.items()}
    with torch.no_grad():
        o32, s32 = fw.chunk(name, output_final_state=True, **{k: v.float() for k, v in low.items()})
        o16, s16 = fw.chunk(name, output_final_state=True, **low)
    where = f"{name} decay={decay} T={T} seed={seed}"
    s32, s16 = state_tensors(s32), state_tensors(s16)
    assert o16.dtype == torch.bfloat16 and o16.device.type == torch.device(device).type, where
    assert torch.isfinite(o16).all() and all(torch.isfinite(s).all() for s in s16), where
    tol = CHUNK_LOW_REL[torch.bfloat16]
    errs = {"o": rel_err(o16, o32), **{f"state[{i}]": rel_err(a, b) for i, (a, b) in enumerate(zip(s16, s32))}}
    over = {k: e for k, e in errs.items() if not e < tol}
    assert not over, f"{where}: relative errors against fp32 at or above {tol:g}: {over}"


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("name", MODELS)
def test_long_bf16_chunk_is_finite_and_near_fp32(name, decay, T):
    check_long_bf16(name, decay, T, "cuda")
