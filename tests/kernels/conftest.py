"""Kernel tests run the Triton kernels on the GPU, or — where no CUDA device is present — on CPU
tensors under Triton's interpreter. TRITON_INTERPRET is read when a `@triton.jit` function is
defined, so the root tests/conftest.py sets it, before any test module imports triton; it is set
again here for a run of this folder from another rootdir. `gen` is the kernel tests' random source."""

import os
import secrets

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def gen():
    """A CPU generator with a fresh seed each run (printed, so a failure can be replayed)."""
    seed = secrets.randbits(62)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
