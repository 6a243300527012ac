"""Every numerical tolerance lives in tests/tolerances.py: a scan of tests/**/*.py keeps it so.

The scan parses each test file (all but tests/tolerances.py) with `ast` and reports a numeric
literal (an int or float constant; True/False are not numbers here) in any of these places:

1. a keyword argument named atol, rtol, rel_tol, abs_tol, abs or rel, or any keyword whose name
   contains "tol" (torch.testing.assert_close, torch.allclose, math.isclose, pytest.approx, ...);
2. the default of a function parameter named like 1 (a helper's `tol=1e-6`);
3. the value of an assignment to a tolerance-like name: one that contains "tol" or has a part
   (split at "_") equal to rel, abs, atol, rtol, err or slack, any case (`tol = 1e-10 if ... else
   1e-4`, `F32_REL = 1e-5`), when the value holds a float 0 < |x| < 1;
4. an upper bound inside an `assert`: for every comparison `a < b` / `a <= b` in the asserted
   expression the bound is b, for `a > b` / `a >= b` it is a; the bound must not hold a float
   0 < |x| < 1 (`assert err < 1e-5`, `assert d < 1e-4 * (1 + scale)`, `assert 1e-9 > d`).

What the scan does not see: a lower bound's slack (`x >= lo - 1e-6`), a tolerance ≥ 1 outside a
tolerance keyword, a literal assigned to a name that does not look like a tolerance and then used
as one. Those were moved by hand; review keeps them out.

EXEMPT lists the comparisons rule 4 reports that are not tolerances, by file and the comparison's
source text (ast.unparse), each with the reason; an entry that matches nothing fails the test, so
the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

TOLERANCE_KEYWORDS = {"atol", "rtol", "rel_tol", "abs_tol", "abs", "rel"}
TOLERANCE_NAME_PARTS = {"rel", "abs", "atol", "rtol", "err", "slack"}

_CAPACITY = ("expected recall of a memory model, measured over many seeds (see the test's comment): "
             "a statement about the model, not a numerical tolerance")
EXEMPT = {
    ("lab/test_capacity.py", "acc['random', 'linear', 256] < 0.3"): _CAPACITY,
    ("lab/test_capacity.py", "mean('linear') <= 0.75"): _CAPACITY,
    ("lab/test_capacity.py", "mean('mesa') <= 0.75"): _CAPACITY,
    ("lab/test_capacity.py", "acc['skewed', 'linear', 8] <= 0.75"): _CAPACITY,
    ("lab/test_capacity.py", "acc['stream', 'linear', 256] <= 0.5"): _CAPACITY,
    ("models/test_lm.py", "sum(losses[-3:]) / 3 < 0.5 * losses[0]"):
        "training progress: the loss halves within the steps the test trains, not an error bound",
    ("pretrain/test_loop.py", "4 * 16 / last['tokens_per_s_steady'] < 0.5"):
        "a timing bound (no step of the steady window took the slowed first step's extra second), not an error",
    ("tasks/test_mqar.py", "gaps.mean() < 0.8 * (space - 1) / 2"):
        "the skew the power law must produce (mean gap well below the uniform mean), not an error bound",
}


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _small_floats(node: ast.AST) -> list[float]:
    return [n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and type(n.value) is float and 0 < abs(n.value) < 1]


def _tolerance_keyword(name: str | None) -> bool:
    return name is not None and (name in TOLERANCE_KEYWORDS or "tol" in name.lower())


def _tolerance_name(name: str) -> bool:
    low = name.lower()
    return "tol" in low or any(part in TOLERANCE_NAME_PARTS for part in low.split("_"))


def _upper_bounds(cmp: ast.Compare):
    operands = [cmp.left, *cmp.comparators]
    for i, op in enumerate(cmp.ops):
        if isinstance(op, (ast.Lt, ast.LtE)):
            yield operands[i + 1]
        elif isinstance(op, (ast.Gt, ast.GtE)):
            yield operands[i]


def scan(source: str, rel: str = "<string>") -> list[tuple[str, int, str, str]]:
    """(file, line, rule, source text) for every literal tolerance in `source`, by the rules above."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and _tolerance_keyword(node.arg):
            if any(_is_number(n) for n in ast.walk(node.value)):
                found.append((rel, node.value.lineno, "keyword", f"{node.arg}={ast.unparse(node.value)}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults))
            pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for param, default in pairs:
                if _tolerance_keyword(param.arg) and any(_is_number(n) for n in ast.walk(default)):
                    found.append((rel, default.lineno, "default", f"{param.arg}={ast.unparse(default)}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if any(_tolerance_name(n) for n in names) and _small_floats(node.value):
                found.append((rel, node.lineno, "assignment", ast.unparse(node)))
        elif isinstance(node, ast.Assert):
            for cmp in ast.walk(node.test):
                if isinstance(cmp, ast.Compare) and any(_small_floats(b) for b in _upper_bounds(cmp)):
                    found.append((rel, cmp.lineno, "bound", ast.unparse(cmp)))
    return found


def _test_files():
    return sorted(p for p in TESTS.rglob("*.py") if p.name != "tolerances.py")


def test_no_literal_tolerance_outside_tolerances_py():
    found = [f for p in _test_files() for f in scan(p.read_text(), p.relative_to(TESTS).as_posix())]
    left = [f for f in found if not (f[2] == "bound" and (f[0], f[3]) in EXEMPT)]
    assert not left, "literal tolerances (move each to tests/tolerances.py):\n" + "\n".join(
        f"  tests/{f}:{line} [{rule}] {text}" for f, line, rule, text in left)
    used = {(f[0], f[3]) for f in found if f[2] == "bound"}
    stale = [key for key in EXEMPT if key not in used]
    assert not stale, f"exemptions that match no comparison any more: {stale}"


@pytest.mark.parametrize("src,rule", [
    ("assert err < 1e-5", "bound"),
    ("assert (a - b).abs().max() <= 1e-4 * (1 + s)", "bound"),
    ("assert 1e-9 > err", "bound"),
    ("assert ok and 0.15 < p < 0.21", "bound"),
    ("torch.testing.assert_close(a, b, atol=1e-6, rtol=R)", "keyword"),
    ("math.isclose(a, b, rel_tol=1e-6)", "keyword"),
    ("x == pytest.approx(y, abs=1e-9)", "keyword"),
    ("tol = 1e-10 if f64 else 1e-4", "assignment"),
    ("LOW_REL = {'bf16': 2e-2}", "assignment"),
    ("def close(a, b, tol=1e-6): pass", "default"),
])
def test_scan_reports_literal_tolerances(src, rule):
    assert [f[2] for f in scan(src)] == [rule]


@pytest.mark.parametrize("src", [
    "assert err < TOL",
    "assert err < CHUNK_F32_REL * scale",
    "assert n < 5 and x.shape[0] <= 16",
    "assert (o1 - o2).abs().max() > 1e-6",  # a lower bound: something changed
    "torch.testing.assert_close(a, b, atol=F64, rtol=F64)",
    "lr = 1e-3",
    "rel = ((a - b).abs().max() / b.abs().max()).item()",
])
def test_scan_accepts_named_tolerances_and_non_tolerances(src):
    assert scan(src) == []
