"""The ``hybridkv`` package's module-level imports form no cycle: imports point down.

Each module's imports are read with ``ast`` (no import is executed): module-level statements only, ``if
TYPE_CHECKING:`` blocks excluded; imports inside functions are lazy and allowed (that is how the backend
registry reaches the optional Triton and vendor modules). Importing ``a.b.c`` also runs ``a`` and ``a.b``, so
those count as edges too, except a module's own parent packages (already being imported when it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hybridkv"

# Cycles known and owned elsewhere, as sets of modules, each with why it is still here (none today).
EXPECTED_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(name: str, path: Path) -> set[str]:
    """Every module name ``name``'s module-level statements import (``from x import y`` gives x and x.y)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules its module-level imports run."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges: set[str] = set()
        for target in _imported(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):          # importing a.b.c runs a, a.b and a.b.c
                dep = ".".join(parts[:i])
                if dep in mods and dep != name and not name.startswith(dep + "."):
                    edges.add(dep)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:          # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(graph, component) for component in components]


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle inside ``component`` starting at its first module (breadth-first back to the start)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    unexpected = [c for c in found if set(c) not in EXPECTED_CYCLES]
    assert not unexpected, ("import cycles (module-level imports; make one side lazy or move the shared part "
                            "down):\n" + "\n".join(" -> ".join(c) for c in unexpected))


def test_the_checker_finds_cycles_and_ignores_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    source = ("from typing import TYPE_CHECKING\nimport x.y\nfrom . import z\nif TYPE_CHECKING:\n    import t\n"
              "def f():\n    import lazy\ntry:\n    import opt\nexcept ImportError:\n    pass\n")
    module = tmp_path / "m.py"
    module.write_text(source)
    assert _imported("p.m", module) == {"typing", "typing.TYPE_CHECKING", "x.y", "p", "p.z", "opt"}


def test_backends_import_down() -> None:
    """The registry reaches the Triton and vendor modules only lazily; they build on ``backends.base``."""
    graph = import_graph()
    kernels = {m for m in graph if m.startswith(("hybridkv.backends.triton", "hybridkv.backends.vendor"))}
    assert kernels and not graph["hybridkv.backends.registry"] & kernels
    assert all("hybridkv.backends.registry" not in graph[m] for m in kernels)
