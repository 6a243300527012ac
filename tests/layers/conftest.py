import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs and weights each run; the seed is printed (shown when a test fails)."""
    seed = torch.seed()
    print(f"torch seed {seed}")
    yield seed
