"""No module under fastweights/kernels reads the environment (DESIGN.md, "No hidden global state": a kernel choice
is a row or an argument, never an environment variable read at import or at call time).

The one exception, named here: `kernels/triton/common/interpreter.py::interpreting`, which reads TRITON_INTERPRET — the
variable Triton's own `@triton.jit` reads to decide whether it interprets — so that the interpreter's shims and
`util.dot_dtype` follow what Triton does; it chooses nothing of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fastweights.kernels

KERNELS = Path(fastweights.kernels.__file__).parent
ROOT = KERNELS.parent.parent

#: (file relative to the repository, enclosing function) allowed to read the environment.
ALLOWED = {("fastweights/kernels/triton/common/interpreter.py", "interpreting")}

_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(source: str) -> list[tuple[str | None, int, str]]:
    """(enclosing function or None, line, what) for every reference to os.environ / os.getenv & co. in `source`
    (attribute access, a bare name imported from os, or the import itself)."""
    found = []

    def visit(node, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Attribute) and node.attr in _NAMES:
            found.append((func, node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in _NAMES:
            found.append((func, node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found.extend((func, node.lineno, f"from os import {a.name}") for a in node.names if a.name in _NAMES)
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), None)
    return found


def test_the_scan_finds_every_form_of_a_read():
    src = ("import os\nfrom os import environ\nX = os.environ.get('A')\n"
           "def f():\n    return os.getenv('B'), environ['C']\n")
    assert [(f, what) for f, _, what in environment_reads(src)] == [
        (None, "from os import environ"), (None, "environ"), ("f", "getenv"), ("f", "environ")]


def test_no_kernel_module_reads_the_environment():
    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) > 20  # the scan sees the whole package
    reads = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        reads += [(rel, func, line, what) for func, line, what in environment_reads(path.read_text())
                  if (rel, func) not in ALLOWED]
    assert reads == [], "a kernel module reads the environment (make it an argument or a row):\n" + "\n".join(
        f"  {rel}:{line} in {func or 'module scope'}: {what}" for rel, func, line, what in reads)
    # the exception exists as named (a stale entry must not hide a moved read)
    for rel, func in ALLOWED:
        assert any(f == func for f, _, _ in environment_reads((ROOT / rel).read_text())), (rel, func)
