"""The published result tables equal what scripts/regenerate_tables.py renders from the committed
result records (docs/results/*.jsonl), so no table can drift from its run silently."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("regenerate_tables", ROOT / "scripts" / "regenerate_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_published_table_equals_its_records():
    mod = _script()
    assert mod.TABLES
    for run, path in mod.RUNS.items():
        if any(t[0] == run for t in mod.TABLES.values()):
            for p in path if isinstance(path, tuple) else (path,):  # a run of several files: each
                assert p.exists(), p
    assert mod.differences() == []


def test_a_changed_cell_is_caught(tmp_path, monkeypatch):
    """Copy a publishing file, change one number between its markers: differences() names it."""
    mod = _script()
    name, (_, _, paths) = next(iter(mod.TABLES.items()))
    (tmp_path / Path(paths[0]).parent).mkdir(parents=True, exist_ok=True)
    text = (ROOT / paths[0]).read_text()
    start, end = mod._span(text, name, paths[0])
    table = text[start:end]
    digit = next(i for i, ch in enumerate(table) if ch.isdigit() and table[i - 1] == ".")
    changed = table[:digit] + str((int(table[digit]) + 1) % 10) + table[digit + 1:]
    (tmp_path / paths[0]).write_text(text[:start] + changed + text[end:])
    for other in {p for t in mod.TABLES.values() for p in t[2]} - {paths[0]}:
        (tmp_path / Path(other).parent).mkdir(parents=True, exist_ok=True)
        (tmp_path / other).write_text((ROOT / other).read_text())
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    assert f"{paths[0]}: {name}" in mod.differences()
