"""The house's floors as a checked contract (pyproject.toml [tool.importlinter]; docs/architecture.md):
no module imports a higher floor, and no import cycle hides behind an import inside a function."""
from __future__ import annotations

import grimp
from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

from tests.helpers import REPO


def test_the_floors_hold(monkeypatch):
    monkeypatch.chdir(REPO)
    assert lint_imports(no_cache=True, no_logo=True) == EXIT_STATUS_SUCCESS


def import_cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle's members.
    grimp reads every import statement, those inside functions too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle():
    graph = grimp.build_graph("tasks", "flows", cache_dir=None)
    assert import_cycles(graph) == []


def test_a_cycle_is_found():
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph) == [["a.x", "a.y"]]
