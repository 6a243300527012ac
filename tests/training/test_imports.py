"""fastweights.training sits below the lab's sweeps and `fastweights train`: it imports neither, and
neither of those imports the other (each reaches the shared step through fastweights.training)."""

import ast
from pathlib import Path

import fastweights

PKG = Path(fastweights.__file__).parent


def _imports(subpackage: str) -> set[str]:
    """Absolute names of every fastweights module imported by the subpackage's files."""
    names = set()
    for path in (PKG / subpackage).rglob("*.py"):
        module = ["fastweights", *path.relative_to(PKG).with_suffix("").parts]
        if module[-1] == "__init__":
            module.pop()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module[: len(module) - node.level + (path.name == "__init__.py")]
                    names.add(".".join(base + ([node.module] if node.module else [])))
                else:
                    names.add(node.module or "")
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return {n for n in names if n == "fastweights" or n.startswith("fastweights.")}


def _under(names: set[str], *packages: str) -> set[str]:
    return {n for n in names for p in packages if n == f"fastweights.{p}" or n.startswith(f"fastweights.{p}.")}


def test_training_imports_neither_lab_nor_pretrain_nor_the_cli():
    assert _imports("training"), "the scan found no import at all: it is broken"
    assert not _under(_imports("training"), "lab", "pretrain", "cli", "cliargs")


def test_pretrain_and_lab_share_the_step_through_training_only():
    assert _under(_imports("pretrain"), "training") and _under(_imports("lab"), "training")
    assert not _under(_imports("pretrain"), "lab")
    assert not _under(_imports("lab"), "pretrain")
