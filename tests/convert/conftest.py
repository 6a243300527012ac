import os

# nothing is ever fetched from the Hugging Face Hub: every model is built here from a config
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from tests import helpers  # noqa: E402

fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)
