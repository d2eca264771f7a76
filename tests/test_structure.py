"""The packages' layering, read from the source with ``ast`` (nothing is imported).

Layers, lowest first; a module may import its own layer and the ones below, never one above:

1. ``staging``: copying datasets to node-local storage, the launcher probe, the exit codes;
2. the leaves of ``datastore``: ``datastore.errors`` (what a user catches), ``datastore._version``;
3. ``datastore.maths``: pure functions, numpy only: blocks and halos, the sample order, owners,
   the exchange's messages, what one rank receives;
4. ``datastore.readers``: the dataset formats, behind one interface;
5. ``datastore.ranks``: who this process is (``world``), checks all ranks pass alike (``agree``);
6. ``datastore.store``: what a rank holds: its samples in memory (``store``, its key index, the
   nodes' shards, the memory left), its batch buffers (``ring``), their copies to the GPU;
7. ``datastore.plan``: ``datastore plan``, what a layout costs before anything is staged;
8. ``datastore.service``: ``datastore serve`` and its client side;
9. ``datastore.sources``: where the loader's batches come from (the embedded store and the
   exchanges, or the service as its client);
10. the ``datastore`` front end: the loader, the package root that re-exports it, the CLI, the
    demos;
11. ``trainer``.

Every module is in exactly one layer: a new module at the top of ``datastore/`` must be placed
in ``LAYERS``. Imports inside functions count too: a lazy import is a dependency all the same.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("staging", "datastore", "trainer")
FRONT_END = "datastore front end"
# (layer, its members), lowest first; a member is a module, or a package with all below it
LAYERS = (
    ("staging", ("staging",)),
    ("datastore leaves", ("datastore.errors", "datastore._version")),
    ("datastore.maths", ("datastore.maths",)),
    ("datastore.readers", ("datastore.readers",)),
    ("datastore.ranks", ("datastore.ranks",)),
    ("datastore.store", ("datastore.store",)),
    ("datastore.plan", ("datastore.plan",)),
    ("datastore.service", ("datastore.service",)),
    ("datastore.sources", ("datastore.sources",)),
    (
        FRONT_END,
        (
            "datastore",  # the package root alone, not what is below it
            "datastore.__main__",
            "datastore.cli",
            "datastore.demo",
            "datastore.demo_read",
            "datastore.loader",
        ),
    ),
    ("trainer", ("trainer",)),
)
ORDER = [name for name, _ in LAYERS]
MATHS_NEEDS = {"numpy"}  # besides the standard library and the layers below
MATHS_REFUSES = {
    "os",
    "socket",
    "threading",
    "concurrent",
    "multiprocessing",
    "subprocess",
    "staging",
}
"""What the pure layer must not touch although it is the standard library or a layer below:
the machine, threads, processes; the maths plan, the layers above run (``store.gather``)."""


def _modules(root: Path = REPO) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ours (generated gRPC stubs left out)."""
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            if "_pb" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, top_level_only: bool, run_time_only: bool = False) -> set[str]:
    """Names of ours that ``path`` imports (``top_level_only``: not inside functions;
    ``run_time_only``: not under ``if TYPE_CHECKING:``); a ``from M import x`` gives both ``M``
    and ``M.x`` (``x`` may be a module)."""
    tree = ast.parse(path.read_text())
    if run_time_only:
        tree = _WithoutTypeChecking().visit(tree)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to this module's package
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


class _WithoutTypeChecking(ast.NodeTransformer):
    """Drops the body of every ``if TYPE_CHECKING:`` (imports for type checkers only)."""

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return node.orelse
        return self.generic_visit(node)


def _owner(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name lives in: its longest prefix that is one of ours (the
    generated stubs, left out of ``modules``, count as their package)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return parts[0]


def layer(module: str) -> str:
    """The layer (a name of ``LAYERS``) a module belongs to: that of its longest member."""
    found = [
        (len(member), name)
        for name, members in LAYERS
        for member in members
        if module == member or (member != "datastore" and module.startswith(member + "."))
    ]
    if not found:
        raise ValueError(f"{module} is in no layer: place it in LAYERS of tests/test_structure.py")
    return max(found)[1]


def _edges(root: Path = REPO) -> dict[tuple[str, str], list[str]]:
    """``{(layer, layer it imports): ["module -> module", ...]}`` between different layers."""
    modules = _modules(root)
    out: dict[tuple[str, str], list[str]] = {}
    for name, path in sorted(modules.items()):
        for imported in sorted(_imports(path, name, False)):
            target = _owner(imported, modules)
            a, b = layer(name), layer(target)
            if a != b:
                out.setdefault((a, b), []).append(f"{name} -> {target}")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or ``None`` when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]  # path ends with n
            if m not in state:
                found = visit(m, [*path, m])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def test_the_layer_graph_has_no_cycle_and_goes_down_only():
    edges = _edges()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    if cycle is not None:
        why = [f"{a} -> {b}: {', '.join(edges[a, b][:5])}" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("layer cycle " + " -> ".join(cycle) + "\n  " + "\n  ".join(why))
    up = {k: v for k, v in edges.items() if ORDER.index(k[1]) > ORDER.index(k[0])}
    assert not up, "imports of a higher layer:\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(v)}" for (a, b), v in up.items()
    )


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
        n: {_owner(m, modules) for m in _imports(p, n, True)} & set(modules) - {n}
        for n, p in modules.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _readers_graph(root: Path = REPO) -> dict[str, set[str]]:
    """``{module: modules it imports at run time, lazily too}`` within ``datastore.readers``."""
    modules = {n: p for n, p in _modules(root).items() if n.startswith("datastore.readers")}
    return {
        n: {_owner(m, modules) for m in _imports(p, n, False, run_time_only=True)}
        & set(modules) - {n}
        for n, p in modules.items()
    }


def test_the_readers_import_no_cycle_even_lazily_and_no_reader_imports_another():
    graph = _readers_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in datastore.readers: " + " -> ".join(cycle)
    # a reader module registers its format; it imports the registry, never another reader
    readers = {
        n for n, p in _modules().items()
        if n.startswith("datastore.readers.") and "\nregister(" in p.read_text()
    }  # fmt: skip
    assert len(readers) >= 5, readers
    crossed = {n: sorted(graph[n] & readers) for n in readers if graph[n] & readers}
    assert not crossed, f"readers importing readers: {crossed}"
    assert all("datastore.readers.registry" in graph[n] for n in readers)


def test_a_lazy_import_back_into_the_readers_is_a_cycle(tmp_path):
    for path in (REPO / "datastore" / "readers").glob("*.py"):
        dest = tmp_path / path.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    assert find_cycle(_readers_graph(tmp_path)) is None
    registry = tmp_path / "datastore" / "readers" / "registry.py"
    registry.write_text(
        registry.read_text() + "\n\ndef f():\n    from datastore.readers.spec import detect\n"
    )
    assert find_cycle(_readers_graph(tmp_path)) is not None


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_layer_of_each_kind_of_module():
    assert [
        layer(m)
        for m in (
            "staging.cluster",
            "datastore.errors",
            "datastore.maths.partition",
            "datastore.readers.base",
            "datastore.ranks.agree",
            "datastore.store.store",
            "datastore.plan.plan_model",
            "datastore.service.client",
            "datastore.service.commands",
            "datastore.sources.service",
            "datastore.loader",
            "datastore",
            "datastore.cli",
            "trainer.train",
        )
    ] == [
        "staging",
        "datastore leaves",
        "datastore.maths",
        "datastore.readers",
        "datastore.ranks",
        "datastore.store",
        "datastore.plan",
        "datastore.service",
        "datastore.service",
        "datastore.sources",
        FRONT_END,
        FRONT_END,
        FRONT_END,
        "trainer",
    ]
    with pytest.raises(ValueError, match=r"datastore\.stray is in no layer"):
        layer("datastore.stray")


def test_every_module_is_in_one_layer_and_each_layer_package_says_what_it_is():
    placed = {name: layer(name) for name in _modules()}  # raises for a module in no layer
    assert set(placed.values()) == set(ORDER), "a layer of LAYERS has no module"
    for _, members in LAYERS:
        for member in members:
            init = REPO.joinpath(*member.split("."), "__init__.py")
            if member.startswith("datastore.") and init.is_file():
                assert ast.get_docstring(ast.parse(init.read_text())), f"{init}: no docstring"


def _foreign_in_maths(root: Path = REPO) -> dict[str, list[str]]:
    """``{module of datastore.maths: the packages it imports beyond MATHS_NEEDS, or in
    MATHS_REFUSES}``."""
    out = {}
    for name, path in _modules(root).items():
        if layer(name) != "datastore.maths":
            continue
        tops = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops.add(node.module.split(".")[0])
        foreign = (tops - set(sys.stdlib_module_names) - set(PACKAGES) - MATHS_NEEDS) | (
            tops & MATHS_REFUSES
        )
        if foreign:
            out[name] = sorted(foreign)
    return out


def test_the_maths_import_numpy_and_the_standard_library_only(tmp_path):
    """The pure layer runs anywhere: no torch, no MPI, no file formats, no gRPC."""
    assert _foreign_in_maths() == {}
    for path in (REPO / "datastore" / "maths").glob("*.py"):
        dest = tmp_path / path.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    order = tmp_path / "datastore" / "maths" / "order.py"
    order.write_text(order.read_text() + "\n\ndef f():\n    import torch.distributed\n")
    assert _foreign_in_maths(tmp_path) == {"datastore.maths.order": ["torch"]}


def test_the_maths_start_no_threads_and_read_no_machine(tmp_path):
    """A thread pool or the machine's cores belong to the layers that run the plans."""
    for path in (REPO / "datastore" / "maths").glob("*.py"):
        dest = tmp_path / path.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    delivery = tmp_path / "datastore" / "maths" / "delivery.py"
    delivery.write_text(
        delivery.read_text()
        + "\nimport os\nfrom concurrent.futures import ThreadPoolExecutor\n"
        + "from staging.cluster import local_size\n"
    )
    assert _foreign_in_maths(tmp_path) == {
        "datastore.maths.delivery": ["concurrent", "os", "staging"]
    }


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        (
            "staging/plan.py",
            "from datastore.service.paths import x",
            "staging -> datastore.service",
        ),
        (
            "datastore/store/store.py",
            "from datastore import DataStoreLoader",
            f"datastore.store -> {FRONT_END}",
        ),
        (
            "datastore/maths/order.py",
            "import datastore.store.ring",
            "datastore.maths -> datastore.store",
        ),
        (
            "datastore/ranks/agree.py",
            "from datastore.store.memory import parse_size",
            "datastore.ranks -> datastore.store",
        ),
        (
            "datastore/errors.py",
            "from datastore.maths import order",
            "datastore leaves -> datastore.maths",
        ),
        (
            "datastore/service/shm.py",
            "import datastore.sources.service",
            "datastore.service -> datastore.sources",
        ),
        (
            "datastore/maths/order.py",
            "def f():\n    from trainer import grid",
            "datastore.maths -> trainer",
        ),
        (
            "datastore/readers/base.py",
            "from ..loader import x",
            f"datastore.readers -> {FRONT_END}",
        ),
        (
            "datastore/maths/partition.py",
            "from ..plan import plan_model",
            "datastore.maths -> datastore.plan",
        ),
    ],
)
def test_the_checker_sees_an_import_of_a_higher_layer(tmp_path, module, line, expected):
    """A copy of the packages with one such import added fails the check (and the copy as it
    is passes)."""
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if "_pb" not in path.parts:
                dest = tmp_path / path.relative_to(REPO)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(path.read_text())

    def up() -> list[str]:
        return [f"{a} -> {b}" for a, b in _edges(tmp_path) if ORDER.index(b) > ORDER.index(a)]

    assert up() == []
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    assert up() == [expected]


def test_the_exit_codes_are_one_enum_and_the_readme_lists_them():
    from staging.exitcodes import Exit

    readme = (REPO / "README.md").read_text()
    listed = readme[readme.index("Exit codes:") :].split("\n\n")[0]
    assert [int(c) for c in re.findall(r"`(\d+)`", listed)] == list(Exit)
    defined = [
        f"{name}: class {node.name}"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(getattr(b, "id", getattr(b, "attr", "")) == "IntEnum" for b in node.bases)
    ]
    assert defined == ["staging.exitcodes: class Exit"]
