import os

# nothing is ever fetched from the Hugging Face Hub: every model and tokenizer is a local directory
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402  (after the offline switches above)

from tests import helpers  # noqa: E402

# fresh random inputs and weights each run (the seed is printed); one torch thread per xdist
# worker is set by the root conftest
fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)
