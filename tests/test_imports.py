"""The package's import graph, read from the source (ast; every import, module-level or inside a
function — a lazy import is an arrow all the same): no circle among the dispatch mechanism, the
backends and the registry, and no import from a lower layer into a higher one.

The layers, lowest first (a module may import its own layer and those below it):

    base        recipe, state, zoo, features, inputs, constants   what a model is and what a call takes
    maths       reference, chunkwise                          the exact forms and the torch chunk engines
    dispatch    dispatch                                      the table's mechanism and THE RULE
    torch       torch_backend, torch_layer_ops                the plain-PyTorch rows
    kernels     kernels                                       the Triton rows (their backward: the torch rows)
    registry    registry, api, the package's __init__         the rows registered; the functional API
    layers      layers                                        modules over the API and the layer ops
    models      models                                        the LM, its configs and checkpoints
    apps        hf, lab, pretrain, bench, tasks, cli, cliargs, demo
"""

from __future__ import annotations

import ast
from pathlib import Path

import fastweights

ROOT = Path(fastweights.__file__).resolve().parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("recipe", "state", "zoo", "features", "inputs", "constants")),
    ("maths", ("reference", "chunkwise", "stability")),
    ("dispatch", ("dispatch",)),
    ("torch", ("torch_backend", "torch_layer_ops")),
    ("kernels", ("kernels",)),
    ("registry", ("registry", "api", "")),  # "": fastweights/__init__.py
    ("distributed", ("distributed",)),  # context parallelism: the functional API over ranks; layers and LM use it
    ("layers", ("layers",)),
    ("models", ("models",)),
    ("training", ("training",)),  # the training step both the lab's sweeps and `fastweights train` import
    ("apps", ("hf", "lab", "pretrain", "bench", "tasks", "cli", "cliargs", "demo", "convert", "__main__")),
]

#: Modules between which no circle may run (the issue-21 triangle was dispatch → torch_backend → dispatch,
#: dispatch → kernels.rows → dispatch).
NO_CIRCLE = ("fastweights.dispatch", "fastweights.torch_backend", "fastweights.torch_layer_ops",
             "fastweights.kernels", "fastweights.registry", "fastweights.api")

#: Accepted upward imports, each with its reason. Empty: there are none.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    """{module: the fastweights modules it imports}; `from . import x` counts as importing `x`."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.split(".")[0] == "fastweights")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "fastweights":
                    continue
                subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
                out.update(subs or [target])
    return graph


def layer_of(module: str) -> int:
    rest = module.split(".", 1)[1] if "." in module else ""
    top = rest.split(".")[0]
    for i, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return i
    raise AssertionError(f"{module} is in no layer of this test: add it to LAYERS")


def test_every_module_has_a_layer():
    for mod in imports():
        layer_of(mod)


def test_no_import_runs_up_the_layers():
    up = []
    for mod, targets in imports().items():
        for t in targets:
            if layer_of(t) > layer_of(mod) and (mod, t) not in EXCEPTIONS:
                up.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})")
    assert not up, "imports from a lower layer into a higher one:\n" + "\n".join(up)


def test_no_circle_among_dispatch_backends_and_registry():
    graph = imports()

    def inside(m: str) -> bool:
        return any(m == n or m.startswith(n + ".") for n in NO_CIRCLE)

    nodes = {m for m in graph if inside(m)}
    edges = {m: {t for t in graph[m] if inside(t) and t != m} for m in nodes}
    # a module reaching itself through the others: a circle
    for start in sorted(nodes):
        seen, todo = set(), list(edges[start])
        while todo:
            m = todo.pop()
            if m == start:
                raise AssertionError(f"a circle through {start}")
            if m not in seen and m in edges:
                seen.add(m)
                todo.extend(edges[m])
    assert "fastweights.dispatch" in nodes and not edges["fastweights.dispatch"] & {
        "fastweights.torch_backend", "fastweights.kernels.rows", "fastweights.registry"}


def test_the_scanner_sees_lazy_and_relative_imports():
    """What the tests above read: a function-level import counts, `from . import x` names x."""
    graph = imports()
    assert "fastweights.torch_backend" in graph["fastweights.kernels.rows"]  # module level
    assert "fastweights.kernels.triton.layer.conv" in graph["fastweights.kernels.rows"]  # inside a function
    assert "fastweights.registry" in graph["fastweights.api"]  # from . import registry
