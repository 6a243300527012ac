"""Shims that make Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) compute what the compiled
kernels compute, on every Triton release in pyproject's range (3.6–3.9). Applied when this module is
first imported under the interpreter: every kernel module imports it (`util` does, so a module that
imports `util` has it), before any kernel runs. Nothing of the compiled path changes, and kernels
need no interpreter-specific code for these.

- Run-time `range` bounds (`_run_time_ranges`): Triton 3.6's interpreter gives its scalar tensors
  `__index__ = int(handle.data)`, and its scalars are 1-element arrays, which numpy ≥ 2.4 no
  longer converts with int(): every loop whose bound is a kernel argument or a loaded value
  raises there.
- Masks from scalar comparisons (`_bool_masks`): the interpreter keeps a comparison's result in
  the dtype of its left operand (an int32 handle holding bools), and broadcasting a scalar one
  into a block (`m_k & (t < eos)`) makes it an int32 array of 0/1. Triton 3.6's C++ load/store
  cast such a mask to bool (nonzero = true); 3.9's reject it (`ValueError: mask has unsupported
  dtype`). The shim casts a load's or store's mask to bool first, as 3.6 did: the same values
  on every release, and what the compiled kernel (an i1 mask) does.
"""

from __future__ import annotations

import os

import numpy as np
from triton.runtime import interpreter


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors, in numpy) rather than
    compiling. The one read of the environment in `fastweights.kernels` (tests/kernels/test_no_environment.py names
    it): Triton's own `@triton.jit` reads the same variable when a kernel is defined, so this says what Triton does —
    it chooses nothing of its own. Read by the shims below (applied at import) and by `util.dot_dtype` (bf16 /
    fp16 products rounded and multiplied in fp32 under the interpreter, whose bf16 `tl.dot` is wrong)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _run_time_ranges() -> None:
    """Re-set scalar tensors' `__index__` (for the duration of each interpreted launch, as the
    interpreter does) to take the one element; nothing else of the interpreter changes."""
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "fastweights_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.fastweights_shim = True
    interpreter._patch_lang_tensor = patched


def _as_bool(mask):
    """`mask` (a TensorHandle) with bool data: nonzero = true, as Triton 3.6's C++ load/store read it."""
    if mask.data.dtype == np.bool_:
        return mask
    return interpreter.TensorHandle(mask.data != 0, mask.dtype)


def _bool_masks() -> None:
    """Wrap the interpreter's masked load and store (their signatures differ across releases: the
    mask is the second argument in each) to pass a bool mask to the C++ side."""
    builder = interpreter.InterpreterBuilder
    for name, pos in (("create_masked_load", 1), ("create_masked_store", 2)):
        orig = getattr(builder, name)
        if getattr(orig, "fastweights_shim", False):
            continue

        def patched(self, *args, _orig=orig, _pos=pos, **kwargs):
            args = list(args)
            args[_pos] = _as_bool(args[_pos])
            return _orig(self, *args, **kwargs)

        patched.fastweights_shim = True
        setattr(builder, name, patched)


def apply() -> None:
    """Apply every shim (idempotent)."""
    _run_time_ranges()
    _bool_masks()


if interpreting():
    apply()
