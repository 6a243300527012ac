"""Every script in scripts/ still fits the library it drives (scripts/README.md): a renamed function fails here,
not at the next GPU sitting.

- each Python script imports as a module (`__name__` is not "__main__": nothing runs) and its argparse CLI
  prints its `--help`;
- every name it takes from `fastweights` — `from fastweights.x import name` anywhere in it, `alias.name` on a
  fastweights module it imported, in its own code and in the code it hands to subprocesses as strings — exists,
  and none is private (`_name`);
- every shell script passes `bash -n`;
- scripts/README.md has a row for every script and none for a script that is gone.
"""

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PY = sorted(SCRIPTS.glob("*.py"))
SH = sorted(SCRIPTS.glob("*.sh"))

#: Private names a script may still reach, with the reason (none since the short conv's launch settings joined
#: util.LAUNCH).
PRIVATE_ALLOWED: set[tuple[str, str]] = set()

_LOADED: dict[Path, object] = {}


def load(path: Path):
    """The script at `path` as a module named scripts_<stem> (registered in sys.modules: its dataclasses need it)."""
    if path not in _LOADED:
        name = f"scripts_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED[path] = module
    return _LOADED[path]


def _trees(source: str):
    """The script's syntax tree, then that of every string in it that is Python code (a subprocess's program;
    format fields such as {root!r} read as a name)."""
    tree = ast.parse(source)
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "fastweights" in node.value:
            try:
                yield from _trees(re.sub(r"\{\w+(![rs])?\}", "_field", node.value))
            except SyntaxError:
                continue  # prose, not code


def _is_module(dotted: str) -> bool:
    """Whether `dotted` imports as a module (a dependency it lacks is raised, not read as "no such module")."""
    try:
        importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        if e.name and (dotted == e.name or dotted.startswith(e.name + ".")):
            return False
        raise
    return True


def fastweights_names(source: str) -> set[str]:
    """Every dotted name ("fastweights.bench.speed.median_ms") that the script's code takes from fastweights."""
    names = set()
    for tree in _trees(source):
        aliases = {}  # a local name bound to a fastweights module -> the module's dotted path
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "fastweights":
                        aliases[a.asname or "fastweights"] = a.name if a.asname else "fastweights"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == \
                    "fastweights":
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    names.add(full)
                    if _is_module(full):
                        aliases[a.asname or a.name] = full
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    chain.insert(0, base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    names.add(".".join([aliases[base.id], *chain]))
    return names


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module, or an attribute reached from the longest module prefix of it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if _is_module(".".join(parts[:i])):
            obj = sys.modules[".".join(parts[:i])]
            for p in parts[i:]:
                if not hasattr(obj, p):
                    return False
                obj = getattr(obj, p)
            return True
    return False


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


@pytest.mark.parametrize("path", PY, ids=lambda p: p.name)
def test_script_imports_without_running_and_prints_its_help(path, monkeypatch, capsys):
    module = load(path)
    assert module.__name__ != "__main__" and callable(getattr(module, "main", None)), \
        f"{path.name}: its work belongs under main()"
    if "ArgumentParser(" not in path.read_text():
        return  # no CLI: importing it is the check
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


@pytest.mark.parametrize("path", PY, ids=lambda p: p.name)
def test_every_fastweights_name_a_script_takes_exists_and_is_public(path):
    names = fastweights_names(path.read_text())
    missing = sorted(n for n in names if not resolves(n))
    assert not missing, f"{path.name} takes names fastweights no longer has: {missing}"
    private = sorted(n for n in names if _private(n) and not any(
        path.name == script and (n == allowed or n.startswith(allowed + ".")) for script, allowed in PRIVATE_ALLOWED))
    assert not private, f"{path.name} reaches private names of fastweights: {private}"


def test_the_name_scan_sees_imports_in_functions_aliases_and_subprocess_code():
    """The scan itself: a private import inside a function, an alias's attribute, a program in a string."""
    source = '''
import fastweights as fw
from fastweights.bench import speed
CHILD = """
import sys
sys.path.insert(0, {root!r})
from fastweights.lab.mqar import _fmt_bytes, format_bytes
"""
def f():
    from fastweights.bench.speed import median_ms
    return fw.chunk, speed._inputs, speed.no_such_name
'''
    names = fastweights_names(source)
    assert {"fastweights.chunk", "fastweights.bench.speed._inputs", "fastweights.lab.mqar._fmt_bytes",
            "fastweights.lab.mqar.format_bytes", "fastweights.bench.speed.median_ms"} <= names
    assert not resolves("fastweights.bench.speed.no_such_name") and resolves("fastweights.bench.speed.median_ms")
    assert _private("fastweights.bench.speed._inputs") and not _private("fastweights.__file__")


@pytest.mark.parametrize("path", SH, ids=lambda p: p.name)
def test_shell_script_parses(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"{path.name}: {r.stderr}"


def test_the_readme_has_a_row_for_every_script():
    readme = (SCRIPTS / "README.md").read_text()
    rows = set(re.findall(r"^\| `([\w.]+)` \|", readme, flags=re.M))
    files = {p.name for p in [*PY, *SH]}
    assert rows == files, f"without a row: {sorted(files - rows)}; rows of no script: {sorted(rows - files)}"
