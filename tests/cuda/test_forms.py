"""fastweights.chunk and fastweights.recurrent on CUDA in fp32 against the float64 recurrence on
the CPU, for every zoo model of the gated-linear and delta classes: outputs, every final-state
tensor, and the gradients of every input and of the initial state (a random valid one), each as
max |Δ| / max |reference|. Fresh random inputs each run (one draw per model and size, shared by
the two forms); the seed is in every failure message.

Marked `cuda`: run with `python3 -m pytest -m cuda tests/cuda` on a GPU machine; skipped without
a CUDA device. (These are the correctness checks scripts/gpu_check.py used to print.)
"""

from __future__ import annotations

import functools
import secrets

import pytest
import torch

import fastweights as fw
from fastweights import zoo
from fastweights.state import state_map, state_tensors
from tests.helpers import random_state, rel_err
from tests.tolerances import CHUNK_F32_REL, RECURRENT_F32_REL

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device: run `pytest -m cuda` on a GPU machine")]

LINEAR = [n for n in zoo.names() if fw.recipe_class(zoo.get(n)) in ("gated_linear", "delta")]
#: (B, T, H, D), D = head_dim = head_v_dim: gpu_check's shape, the benchmark's head size, and a
#: small one a token past one chunk
SIZES = {"B2-T300-H4-D64": (2, 300, 4, 64), "B1-T200-H2-D128": (1, 200, 2, 128), "B3-T65-H1-D32": (3, 65, 1, 32)}
FORMS = {"chunk": (fw.chunk, CHUNK_F32_REL), "recurrent": (fw.recurrent, RECURRENT_F32_REL)}


def make_inputs(name: str, B: int, T: int, H: int, D: int, seed: int):
    """Float64 CPU inputs and a random valid initial state for `name`."""
    gen = torch.Generator().manual_seed(seed)
    inputs = fw.example_inputs(name, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=torch.float64,
                               generator=gen)
    inputs.pop("initial_state", None)
    return inputs, random_state(name, B, H, D, D, gen)


def run_form(form, name: str, inputs: dict, state, device, dtype):
    """`form` on copies of the inputs and state on `device` in `dtype`, then the gradient of a fixed
    random projection of the output and every final-state tensor (the projection is drawn in float64
    on the CPU from seed 1, so every run projects alike). Returns (o, [final-state tensors],
    {"d<input>" or "dinitial_state[i]": gradient})."""
    leaves = {k: v.detach().to(device, dtype).requires_grad_(True) for k, v in inputs.items()}
    st = state_map(state, lambda x: x.detach().to(device, dtype).requires_grad_(True))
    o, final = form(name, initial_state=st, output_final_state=True, **leaves)
    finals = state_tensors(final)
    gen = torch.Generator().manual_seed(1)
    loss = 0
    for t in [o, *finals]:
        loss = loss + (t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device, t.dtype)).sum()
    wrt = {f"d{k}": x for k, x in leaves.items()}
    wrt.update({f"dinitial_state[{i}]": x for i, x in enumerate(state_tensors(st))})
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    grads = {k: torch.zeros_like(x) if g is None else g for (k, x), g in zip(wrt.items(), grads)}
    return o.detach(), [s.detach() for s in finals], grads


@functools.cache
def float64_reference(name: str, size: tuple):
    """(seed, inputs, initial state, (o, final state, gradients)) of the float64 recurrence on the
    CPU: drawn once per run for each (model, size), shared by the forms compared against it."""
    seed = secrets.randbelow(2**31)
    inputs, state = make_inputs(name, *size, seed)
    return seed, inputs, state, run_form(fw.recurrent, name, inputs, state, "cpu", torch.float64)


def check_against_float64(name: str, form: str, size: tuple, device) -> None:
    """Asserts every relative error of `form` (fp32 on `device`) against the float64 CPU recurrence."""
    seed, inputs, state, (ref_o, ref_s, ref_g) = float64_reference(name, size)
    fn, tol = FORMS[form]
    o, s, g = run_form(fn, name, inputs, state, device, torch.float32)
    where = f"{name} {form} (B, T, H, D) = {size} seed={seed}"
    assert o.device.type == torch.device(device).type and o.dtype == torch.float32, where
    assert len(s) == len(ref_s) and g.keys() == ref_g.keys(), where
    errs = {"o": rel_err(o, ref_o)}
    errs.update({f"state[{i}]": rel_err(a, b) for i, (a, b) in enumerate(zip(s, ref_s))})
    errs.update({k: rel_err(g[k], ref_g[k]) for k in ref_g})
    over = {k: e for k, e in errs.items() if not e < tol}  # NaN is over too
    assert not over, f"{where}: relative errors at or above {tol:g}: {over}"


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", LINEAR)
def test_fp32_on_cuda_matches_the_float64_recurrence(name, form, size):
    check_against_float64(name, form, SIZES[size], "cuda")
