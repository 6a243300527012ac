"""Fresh random inputs and weights each run (the seed is printed); one torch thread per xdist
worker is set by the root conftest."""

import pytest

from tests import helpers

fresh_seed = pytest.fixture(autouse=True)(helpers.fresh_seed)
