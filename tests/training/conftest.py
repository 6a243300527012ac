"""Fresh random inputs and weights each run (the seed is printed)."""

import pytest

from tests import helpers

fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)
