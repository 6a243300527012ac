"""Suite-wide settings.

- One intra-op thread per pytest-xdist worker (`-n 2` on 2 cores would otherwise run 2 × 2
  threads on 2 cores and stall every parallel region).
- Markers: `cuda` (needs a CUDA GPU; deselected by default, run with `pytest -m cuda` on the
  GPU machine), `triton` (runs Triton kernels: on the GPU, or on CPU tensors under
  TRITON_INTERPRET=1), `distributed` (starts several processes).
- MKL_CBWR=COMPATIBLE (unless set): bitwise-equal computations stay bitwise equal on any x86 CPU.
- `cuda_big` tests hold a lock per GPU: xdist workers run them one at a time.
- Kernel tests (`cuda` or `triton`) run with NaN-poisoned kernel outputs
  (`fastweights.kernels.poisoned_outputs`): an element a kernel forgets to write is NaN, never
  a leftover that happens to be right.
"""

import os

# MKL's conditional numerical reproducibility, before torch loads MKL: two equal computations on arrays at
# other addresses give the same bits (tests compare them with torch.equal). Without it MKL may pick code
# paths by memory alignment: on an AMD EPYC machine a float64 LM's logits differed by 2.5e-16 between two
# copies of one model. COMPATIBLE leaves the ISA-pinning tests (tests/lab/test_reproducible.py, which set
# their own MKL_CBWR) their own choice.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fastweights.kernels import poisoned_outputs
from tests.helpers import one_of_slots

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Without a CUDA device the Triton kernel tests run on CPU tensors under Triton's interpreter.
# TRITON_INTERPRET is read when Triton defines a `@triton.jit` function — its own standard
# library (tl.sum, tl.cumsum, ...) included, at `import triton` — so it is set here, before any
# test module can import triton (transformers and accelerate do, in tests/hf).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _poison_kernel_outputs(request):
    if request.node.get_closest_marker("cuda") or request.node.get_closest_marker("triton"):
        with poisoned_outputs():
            yield
    else:
        yield
    if request.node.get_closest_marker("cuda") and torch.cuda.is_available():
        _release_cuda_memory()


@pytest.fixture(autouse=True)
def _one_big_cuda_test_at_a_time(request):
    """`cuda_big` tests (several GiB each: the T = 4096, H = 16 realistic rows with their fp32 torch references, the
    long-sequence ones) hold one of `big_cuda_slots()` locks per GPU, so xdist workers sharing one card run at most
    that many at once: at `-n 8` on an 80 GB H100 three of them at once ran out of memory (2026-11-27, d5caabe),
    while alone or at `-n 4` on a 139 GB H200 they pass. One slot on the H200 made tests/kernels outlast a 600 s
    call (13 tests in 379 s, r4s6 call 2): they queue for the lock. The other cuda tests run beside them.
    With FASTWEIGHTS_CUDA_LOG set (a file), every cuda test appends a JSON line: its node id, the seconds it waited
    for a slot and ran, and its process's peak allocated and reserved GiB — what sizes the slots."""
    log = os.environ.get("FASTWEIGHTS_CUDA_LOG")
    cuda = request.node.get_closest_marker("cuda") is not None and torch.cuda.is_available()
    if not cuda:
        yield
        return
    big = request.node.get_closest_marker("cuda_big") is not None
    asked = started = time.perf_counter()
    if log:
        torch.cuda.reset_peak_memory_stats()
    if not big:
        yield
    else:
        gpu = torch.cuda.current_device()
        prefix = os.path.join(tempfile.gettempdir(), f"fastweights-cuda-big-{gpu}.lock")
        with one_of_slots(prefix, big_cuda_slots(torch.cuda.get_device_properties(gpu).total_memory)):
            started = time.perf_counter()
            yield
    if log:
        line = {"test": request.node.nodeid, "big": big, "waited_s": round(started - asked, 2),
                "ran_s": round(time.perf_counter() - started, 2),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


def big_cuda_slots(total_memory: int, override: str | None = None) -> int:
    """How many `cuda_big` tests share a GPU of `total_memory` bytes: one per 45 GiB (an 80 GB H100: 1; a 141 GB
    H200: 3), at least one; `override` (FASTWEIGHTS_CUDA_BIG_SLOTS, read when None) a count ≥ 1 instead, for a run
    whose logged peaks (FASTWEIGHTS_CUDA_LOG) show the card holds more."""
    override = os.environ.get("FASTWEIGHTS_CUDA_BIG_SLOTS") if override is None else override
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"FASTWEIGHTS_CUDA_BIG_SLOTS must be a count ≥ 1, got {override!r}")
        return int(override)
    return max(1, total_memory // (45 * 2**30))


def _release_cuda_memory() -> None:
    """After each cuda test, the blocks its tensors left in this process's caching allocator go back to the
    device. Several xdist workers share one GPU: each worker's allocator keeps the peak of the largest test it ran
    (a T = 65,536 bf16 test takes GiBs) and never returns it, so at `-n 8` on an 80 GB H100 the workers' caches
    filled the card (81,062 of 81,559 MiB in use) and most later tests failed (issue 32's census, 2026-11-27)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


#: The packages whose tested range has a floor that CI pins in its second environment (pyproject's extras), as a
#: test module names them. Under FASTWEIGHTS_FLOOR_TESTS=1 (`.ci/run`'s floor environment) only the tests that can
#: see a floor version run: every test of a module that names one of these, and of the `triton` tests (the kernels
#: under the interpreter) the first case of each test function — each kernel's Triton code once through Triton
#: 3.6's language and interpreter (an API the floor lacks fails there); the other cases differ in shapes and values,
#: which Triton's version does not decide (they run in full in the newest environment, and every kernel runs
#: compiled by 3.6 in `pytest -m cuda` on the GPU machine). Test functions marked `variants` (launch settings, tiles,
#: long chunks, strided inputs, recompute and compile-count choices: kernels another test of the module already runs)
#: are left out there too.
FLOOR_PACKAGES = ("transformers", "lm_eval", "lm-eval", "peft", "accelerate", "fastweights.hf", "fastweights.convert")


_FLOOR_IMPORT = re.compile(r"^(import|from)\s+(" + "|".join(re.escape(n.replace("-", "_")) for n in FLOOR_PACKAGES)
                           + r")\b", re.M)


def _sees_a_floor_package(item, cache: dict) -> bool:
    """Whether `item` runs in the floor environment: the first case of a `triton` test function; every test of a
    module that imports a floor package at its top level; any other test whose own source names one."""
    if item.get_closest_marker("triton") is not None:
        if item.get_closest_marker("variants") is not None:  # its kernels run in another floor test of its module
            return False
        key = (str(item.fspath), getattr(item, "originalname", item.name))
        if key not in cache:  # the first case of this test function
            cache[key] = item.nodeid
        return cache[key] == item.nodeid
    path = str(item.fspath)
    if path not in cache:
        try:
            cache[path] = bool(_FLOOR_IMPORT.search(open(path, encoding="utf-8").read()))
        except OSError:
            cache[path] = False
    if cache[path]:
        return True
    try:
        source = inspect.getsource(item.obj)
    except (TypeError, OSError, AttributeError):
        return False
    return any(name in source for name in FLOOR_PACKAGES)


def pytest_collection_modifyitems(config, items):
    """`cuda` tests are skipped, with the reason, where no CUDA device is present (they are also
    deselected by default: pyproject's addopts). FASTWEIGHTS_FLOOR_TESTS=1 deselects the tests that cannot
    see a floor package's version (`FLOOR_PACKAGES`)."""
    if os.environ.get("FASTWEIGHTS_FLOOR_TESTS") == "1":
        cache: dict = {}
        floor = [_sees_a_floor_package(it, cache) for it in items]
        config.hook.pytest_deselected(items=[it for it, f in zip(items, floor) if not f])
        items[:] = [it for it, f in zip(items, floor) if f]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m cuda` on the GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
