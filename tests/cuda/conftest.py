"""Settings for the CUDA tests (`pytest -m cuda` on a GPU machine; skipped without a CUDA device)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """fp32 means fp32: TF32 matmuls (10-bit mantissa) would be held to fp32 tolerances otherwise."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
