"""Kernel tests run the Triton kernels on the GPU, or — where no CUDA device is present — on CPU
tensors under Triton's interpreter. TRITON_INTERPRET is read when a `@triton.jit` function is
defined, so the root tests/conftest.py sets it, before any test module imports triton; it is set
again here for a run of this folder from another rootdir."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
