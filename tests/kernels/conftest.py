"""Kernel tests run the Triton kernels on the GPU, or — where no CUDA device is present — on CPU
tensors under Triton's interpreter. TRITON_INTERPRET is read when a `@triton.jit` function is
defined, so it is set here, before any test module imports fastweights.kernels.triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
