"""The suite's own machinery (tests/conftest.py, tests/helpers.py) where it decides what runs together."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import one_of_slots


def test_slots_let_n_processes_in_and_block_the_next_until_one_is_released(tmp_path):
    """At most n xdist workers hold one of `one_of_slots`'s n locks (the cuda_big slots): with both of two held,
    another process waits until one is released, then takes that one."""
    prefix = str(tmp_path / "big.lock")
    child = (f"import sys, time; sys.path.insert(0, {sys.path[0]!r}); from tests.helpers import one_of_slots\n"
             "print('ready', flush=True); t0 = time.monotonic()\n"
             f"with one_of_slots({prefix!r}, 2, poll=0.05) as i: print(i, time.monotonic() - t0)")
    with one_of_slots(prefix, 2) as a, one_of_slots(prefix, 2) as b:
        assert {a, b} == {0, 1}
        p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"  # the child has imported and now asks for a slot
        time.sleep(1.0)
        assert p.poll() is None  # still waiting: both slots are held
        released = b
    out, _ = p.communicate(timeout=60)
    slot, waited = out.split()
    assert p.returncode == 0 and float(waited) >= 0.9 and int(slot) in (a, released)


def test_big_cuda_slots_follow_the_card_memory():
    """One cuda_big test at a time on an 80 GB H100 (three at once ran out of memory), three on a 141 GB H200; the
    override's count where given, a bad one refused by name."""
    from tests.conftest import big_cuda_slots

    assert big_cuda_slots(79 * 2**30, "") == 1 and big_cuda_slots(139 * 2**30, "") == 3
    assert big_cuda_slots(8 * 2**30, "") == 1
    assert big_cuda_slots(139 * 2**30, "5") == 5  # FASTWEIGHTS_CUDA_BIG_SLOTS: a run sized by its logged peaks
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="FASTWEIGHTS_CUDA_BIG_SLOTS"):
            big_cuda_slots(139 * 2**30, bad)


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
