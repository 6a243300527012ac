"""`fastweights convert` against fla's own model forward: scripts/verify_fla_convert.py as tests, for
a test-only environment with fla installed (fla is never a fastweights dependency; see the script's
doc for the CPU shims). Without fla they are skipped: the CI checks of fla's layout, which need no
fla, are tests/convert/test_fla.py.

    /work/venvs/convert-fla/bin/python -m pytest tests/convert/test_fla_peer.py   (CPU: Triton's interpreter)
"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.fla  # deselected by default (pyproject addopts); `pytest -m fla` in an env with fla

_SPEC = importlib.util.spec_from_file_location(
    "verify_fla_convert", Path(__file__).resolve().parents[2] / "scripts" / "verify_fla_convert.py")
verify = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(verify)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(model, label, kw) for model, cases in verify.CASES.items() for label, kw in cases]


@pytest.fixture(scope="module", autouse=True)
def _shims():
    pytest.importorskip("fla")  # `-m fla` where fla is not installed: skipped, saying so
    if DEVICE == "cpu":
        verify.install_cpu_shims()


@pytest.mark.parametrize("model,label,kw", CASES, ids=[f"{m}-{label}" for m, label, _ in CASES])
def test_logits_equal_fla_both_ways(model, label, kw, tmp_path):
    err_in, err_out = verify.check_case(model, kw, DEVICE, tmp_path)
    assert err_in <= verify.LOGITS_REL and err_out <= verify.LOGITS_REL
