"""The packages' layering: staging < datastore < trainer, and no import cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("staging", "datastore", "trainer")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if "_pb" in path.parts:
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, top_level_only: bool) -> set[str]:
    """Modules of ours that ``path`` imports (``top_level_only``: not inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative
                base = ".".join([*name.split(".")[: -node.level], node.module])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_staging_imports_neither_datastore_nor_the_trainer():
    for name, path in _modules().items():
        if name.startswith("staging"):
            bad = {m for m in _imports(path, name, False) if not m.startswith("staging")}
            assert not bad, f"{name} imports {sorted(bad)}"
        if name.startswith("datastore"):
            bad = {m for m in _imports(path, name, False) if m.startswith("trainer")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_module_level_import_cycle():
    modules = _modules()
    graph = {
        n: {m for m in _imports(p, n, True) if m in modules and m != n} for n, p in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, n, m]))
            if m not in state:
                visit(m, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
