"""The lab tests train small models: one torch thread each (a 2-thread pool sharing a busy
2-core machine stalled tiny ops by 10–100×; these tests are about the harness, not threading)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
