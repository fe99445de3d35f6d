"""Dependencies point down (DESIGN §9): no import cycle between arl's packages and top modules.

Every module under arl/ is parsed with `ast`; every import counts, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING:``), relative ones resolved against the
importing module. Each import becomes an edge between the top-level units of arl it joins
(``arl.weights``, ``arl.control``, ``arl.trainer``, ...); the graph of those units must have no
cycle. A function-level import does not make a cycle harmless: it still means neither side can
be understood, tested or moved without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ARL = Path(__file__).resolve().parents[2] / "arl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ARL.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(text: str, module: str, is_package: bool = False) -> set[str]:
    """Every module name the source ``text`` of ``module`` imports (for ``from m import x``,
    ``m.x`` too: x may be a submodule), relative imports made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{a.name}" for a in node.names)
    return names


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


def test_the_import_graph_of_arls_packages_has_no_cycle():
    graph = unit_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        hops = [
            f"  {a} -> {b}  ({', '.join(graph[a][b])})"
            for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        raise AssertionError(
            "import cycle between arl's packages: " + " -> ".join(cycle) + "\n" + "\n".join(hops)
        )


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
