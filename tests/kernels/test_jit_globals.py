"""Every `@triton.jit` function of `fastweights.kernels.triton` reads only globals that compile on a GPU: constexprs,
other jit functions, modules (tl, triton) and builtins. Triton's interpreter (the CPU tests) lets a plain Python
number through, the compiler refuses it ("Cannot access global variable ... from within @jit'ed function"): TTT-MLP's
kernels passed every interpreter test and failed to compile on the H100 for exactly this."""

from __future__ import annotations

import builtins
import importlib
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from tests.helpers import triton_kernel_modules

#: what `@triton.jit` makes: a JITFunction, or under TRITON_INTERPRET=1 (the CPU tests) an InterpretedFunction
JIT_TYPES = (triton.runtime.JITFunction, InterpretedFunction)


#: {module name: dotted path} of every kernel module, the subpackages walked (stages/, fused/, layer/, ...)
MODULES = triton_kernel_modules()


def _jit_functions():
    for dotted in MODULES.values():
        mod = importlib.import_module(dotted)
        for name, obj in vars(mod).items():
            if isinstance(obj, JIT_TYPES) and obj.fn.__module__ == mod.__name__:
                yield f"{dotted.removeprefix('fastweights.kernels.triton.')}.{name}", obj


def _bad_globals(jit) -> list[str]:
    fn = jit.fn
    bad = []
    names = set(fn.__code__.co_names)
    for const in fn.__code__.co_consts:  # nested code (comprehensions, lambdas)
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    for n in sorted(names):
        if n not in fn.__globals__:
            continue  # an attribute name (tl.sum's "sum") or a builtin
        v = fn.__globals__[n]
        if isinstance(v, (tl.constexpr, *JIT_TYPES, types.ModuleType, type)) or callable(v):
            continue
        if v is None or isinstance(v, bool) or n in vars(builtins):
            continue
        bad.append(f"{n} = {v!r} ({type(v).__name__})")
    return bad


JITS = dict(_jit_functions())


def test_the_kernel_modules_have_jit_functions():
    """The walk sees the whole package: every subpackage's modules, and the jit functions in them."""
    assert len(MODULES) >= 28, sorted(MODULES)
    assert {d.split(".")[3] for d in MODULES.values()} >= {"stages", "fused", "layer", "memories", "common"}
    assert len(JITS) > 20 and any(k.startswith("memories.ttt_mlp.") for k in JITS)


@pytest.mark.parametrize("name", sorted(JITS))
def test_jit_function_reads_only_compilable_globals(name):
    assert not _bad_globals(JITS[name]), f"{name} reads non-constexpr globals: {_bad_globals(JITS[name])}"


def test_the_check_catches_a_plain_number():
    ns = {"tl": tl, "triton": triton, "_K": 0.5}
    exec("@triton.jit\ndef f(x):\n    return x * _K\n", ns)
    assert _bad_globals(ns["f"]) == ["_K = 0.5 (float)"]
    ns["_K"] = tl.constexpr(0.5)
    assert _bad_globals(ns["f"]) == []
