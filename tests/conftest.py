"""Suite-wide settings: one intra-op thread per pytest-xdist worker (`-n 2` on 2 cores would
otherwise run 2 × 2 threads on 2 cores and stall every parallel region)."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
