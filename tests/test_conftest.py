"""The suite's own machinery (tests/conftest.py, tests/helpers.py) where it decides what runs together."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import exclusive


def test_exclusive_blocks_a_second_process_until_released(tmp_path):
    """Two xdist workers entering `exclusive` with one path run one after the other (the cuda_big lock)."""
    lock = str(tmp_path / "big.lock")
    child = (f"import sys, time; sys.path.insert(0, {sys.path[0]!r}); from tests.helpers import exclusive\n"
             "print('ready', flush=True); t0 = time.monotonic()\n"
             f"with exclusive({lock!r}): print(time.monotonic() - t0)")
    with exclusive(lock):
        p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"  # the child has imported and now asks for the lock
        time.sleep(1.0)
        assert p.poll() is None  # still waiting on it
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and float(out) >= 0.9


@pytest.mark.parametrize("module,name", [("tests.kernels.test_triton_delta", "test_cuda_realistic"),
                                         ("tests.kernels.fused.test_triton_delta_fused", "test_cuda_long_bf16"),
                                         ("tests.cuda.test_long_numerics",
                                          "test_long_bf16_chunk_is_finite_and_near_fp32")])
def test_the_gib_sized_cuda_tests_are_marked_big(module, name):
    mod = importlib.import_module(module)
    module_marks = getattr(mod, "pytestmark", [])
    marks = getattr(getattr(mod, name), "pytestmark", []) + (module_marks if isinstance(module_marks, list)
                                                              else [module_marks])
    marks = [m.name for m in marks]
    assert "cuda_big" in marks


def test_the_floor_environment_selects_what_can_see_a_floor_version():
    """FASTWEIGHTS_FLOOR_TESTS=1 (CI's floor environment): one case of each triton test function but those marked
    `variants`; of a module that imports transformers only inside some tests, exactly those tests."""
    env = dict(os.environ, FASTWEIGHTS_FLOOR_TESTS="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "tests/kernels/fused/test_triton_delta_fused.py", "tests/pretrain/test_loop.py",
                          "tests/kernels/test_triton_gated.py"],
                         capture_output=True, text=True, timeout=300, env=env).stdout
    ids = [line for line in out.splitlines() if "::" in line]
    assert sum("::test_kernels_match_twins[" in i for i in ids) == 1, out[-2000:]
    assert sum("test_triton_delta_fused.py::test_matches_recurrence[" in i for i in ids) == 1
    assert sum("test_triton_gated.py::test_matches_recurrence[" in i for i in ids) == 1
    assert not any("::test_long_chunk_64" in i for i in ids)  # marked variants
    assert any("test_loop.py::test_trains_and_writes_log_curve_and_a_loadable_model" in i for i in ids)
    assert not any("test_a_run_killed_by_sigkill" in i for i in ids)  # no floor package in it
