import os

# nothing is ever fetched from the Hugging Face Hub: every model and tokenizer is a local directory
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

# Under pytest-xdist every worker would otherwise run torch's intra-op pool with one thread per
# core: two workers on two cores oversubscribe, and OpenMP's spin-waiting turns the many tiny ops
# of these tests (training loops over T ≤ 24 tokens) into a 50× slowdown. One thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs and weights each run; the seed is printed (shown when a test fails)."""
    seed = torch.seed()
    print(f"torch seed {seed}")
    yield seed
