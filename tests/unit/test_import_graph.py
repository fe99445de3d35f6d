"""Dependencies point down (DESIGN §9): no import cycle between arl's packages and top modules.

Every module under arl/ is parsed with `ast`; every import counts, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING:``), relative ones resolved against the
importing module. Each import becomes an edge between the top-level units of arl it joins
(``arl.weights``, ``arl.control``, ``arl.trainer``, ...); the graph of those units must have no
cycle. A function-level import does not make a cycle harmless: it still means neither side can
be understood, tested or moved without the other.

The same holds between modules (issue 34): with every module of arl a node, and an import an edge
to the module it names, there is no cycle either, inside a package or across packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ARL = Path(__file__).resolve().parents[2] / "arl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ARL.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_source(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, a relative one made absolute."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_sites(text: str, module: str, is_package: bool = False) -> list[tuple[str, str, int]]:
    """Every import in the source ``text`` of ``module`` as (the module it reads from, the name
    it imports, its line): ``import m.n`` is (m.n, m.n), ``from m import x`` is (m, m.x), where
    x may be a submodule of m or a name defined in it; relative imports made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    sites: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            sites += [(a.name, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _from_source(node, package)
            sites += [(source, f"{source}.{a.name}", node.lineno) for a in node.names]
    return sites


def imports_of(text: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name the source ``text`` of ``module`` imports (for ``from m import x``,
    ``m.x`` too: x may be a submodule), relative imports made absolute."""
    sites = import_sites(text, module, is_package)
    return {source for source, _, _ in sites} | {name for _, name, _ in sites}


def imported_names(path: Path) -> set[str]:
    """`imports_of` the module at ``path`` under arl/."""
    return imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _unit(name: str) -> str | None:
    """The top-level unit of arl that ``name`` lies in (``arl.weights.base`` -> ``arl.weights``);
    None outside arl, or for ``arl`` itself."""
    parts = name.split(".")
    if parts[0] != "arl" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: the files that do}, self-imports left out."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ARL.rglob("*.py")):
        here = _unit(_module_name(path))
        if here is None:
            continue
        for name in imported_names(path):
            there = _unit(name)
            if there is not None and there != here:
                files = graph.setdefault(here, {}).setdefault(there, [])
                rel = str(path.relative_to(ARL.parent))
                if rel not in files:
                    files.append(rel)
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A cycle of ``graph`` as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = "open"
        path.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == "open":
                return path[path.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = "done"
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def _assert_no_cycle(graph: dict[str, dict[str, list[str]]], between: str) -> None:
    cycle = find_cycle(graph)
    if cycle is not None:
        hops = [
            f"  {a} -> {b}  ({', '.join(graph[a][b])})"
            for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        raise AssertionError(
            f"import cycle between {between}: " + " -> ".join(cycle) + "\n" + "\n".join(hops)
        )


def test_the_import_graph_of_arls_packages_has_no_cycle():
    _assert_no_cycle(unit_graph(), "arl's packages")


def imported_module(name: str, modules: set[str]) -> str | None:
    """The module of ``modules`` that importing ``name`` runs: the longest one that ``name``
    starts with (``arl.config.tree.Config`` -> ``arl.config.tree``); None if none does."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if (candidate := ".".join(parts[:n])) in modules:
            return candidate
    return None


def module_edges(text: str, module: str, modules: set[str], is_package: bool = False):
    """(module imported, line) for each import of ``module`` (source ``text``) that names one
    of ``modules`` other than itself.

    An import names the module it imports by its full name only: ``import arl.config.tree`` and
    ``from arl.config import tree`` name ``arl.config.tree``, ``from arl.config import Config``
    names ``arl.config`` (the package's ``__init__``). The packages above the module named are
    not counted, although Python runs their ``__init__`` first: that is no dependency of the
    importer on them, and counting it would make every package re-exporting its modules a cycle.
    So a package's ``__init__`` may import its modules and they each other, but a module that
    imports from its own package (``from arl.config import X`` in arl/config/tree.py) closes a
    cycle through the ``__init__`` that imports it, as it does at run time (it may see the
    package half initialised)."""
    edges = []
    for _, name, line in import_sites(text, module, is_package):
        target = imported_module(name, modules)
        if target is not None and target != module:
            edges.append((target, line))
    return edges


def module_graph() -> dict[str, dict[str, list[str]]]:
    """module -> {module of arl it imports: where, as ``file:line``} (`module_edges`)."""
    paths = {_module_name(path): path for path in sorted(ARL.rglob("*.py"))}
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in paths.items():
        rel = str(path.relative_to(ARL.parent))
        text, is_package = path.read_text(), path.name == "__init__.py"
        for target, line in module_edges(text, module, set(paths), is_package):
            graph.setdefault(module, {}).setdefault(target, []).append(f"{rel}:{line}")
    return graph


def test_the_import_graph_of_arls_modules_has_no_cycle():
    """Inside a package too: every import counts, as between packages."""
    _assert_no_cycle(module_graph(), "arl's modules")


def test_module_edges_name_the_module_imported_not_its_packages():
    modules = {"arl", "arl.config", "arl.config.tree", "arl.config.rules"}
    package = "from arl.config.tree import Config\nfrom . import rules\nimport yaml\n"
    assert module_edges(package, "arl.config", modules, is_package=True) == [
        ("arl.config.tree", 1),
        ("arl.config.rules", 2),
    ]
    inside = (
        "from arl.config import rules\n"  # the module, not the package's __init__
        "from .rules import Range\n"
        "def f():\n"
        "    import arl.config.rules.registry\n"  # not a module here: the longest that is
    )
    assert {t for t, _ in module_edges(inside, "arl.config.tree", modules)} == {"arl.config.rules"}
    via_package = "from arl.config import ConfigError\n"
    assert module_edges(via_package, "arl.config.tree", modules) == [("arl.config", 1)]
    graph = {"arl.config": {"arl.config.tree": ["arl/config/__init__.py:1"]}}
    graph["arl.config.tree"] = {"arl.config": ["arl/config/tree.py:1"]}
    assert find_cycle(graph) == ["arl.config", "arl.config.tree", "arl.config"]


def test_the_cycle_finder_reports_the_path():
    graph = {"a": {"b": ["a.py"]}, "b": {"c": ["b.py"]}, "c": {"a": ["c.py"]}, "d": {"a": []}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def test_relative_function_level_and_guarded_imports_are_counted():
    text = (
        "from typing import TYPE_CHECKING\n"
        "from . import base\n"
        "from ..protocol.plan import NodeSpec\n"
        "if TYPE_CHECKING:\n"
        "    from arl.control.cluster import Cluster\n"
        "def f():\n"
        "    import arl.trainer\n"
    )
    names = imports_of(text, "arl.weights", is_package=True)
    assert {"arl.weights.base", "arl.protocol.plan", "arl.control.cluster", "arl.trainer"} <= names
    assert "arl.weights.sibling" in imports_of("from .sibling import x", "arl.weights.base")


def _importers(package: str, forbidden: str) -> list[str]:
    return sorted(
        str(path.relative_to(ARL.parent))
        for path in (ARL / package).rglob("*.py")
        if any(n == forbidden or n.startswith(forbidden + ".") for n in imported_names(path))
    )


def test_weights_and_engines_never_import_control():
    """weights/ and engines/ read the plan and the cluster through arl.protocol (plan, handles);
    control/ builds on them, not back."""
    assert _importers("weights", "arl.control") == []
    assert _importers("engines", "arl.control") == []


def test_no_engine_name_guesses():
    """What an engine can do is declared on it (`weight_targets`, ...), and the weight-sync mode
    is read from the plan: nothing tests a backend string's prefix."""
    offenders = [
        str(path.relative_to(ARL.parent))
        for path in sorted(ARL.rglob("*.py"))
        if 'startswith("hf' in path.read_text() or "startswith('hf" in path.read_text()
    ]
    assert offenders == []
