"""The kernels package imports as a DAG: no module imports (at the top or inside a function) one that
imports it back, directly or around a loop. A cycle makes the import order decide what exists when a
module runs, and on the hot path a call that bounces between two modules."""

from __future__ import annotations

import ast
from pathlib import Path

import moerules.kernels

PACKAGE = "moerules.kernels"
ROOT = Path(moerules.kernels.__file__).parent


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, package: str) -> list[str]:
    """Candidate module names one import statement names (a `from X import y` may import module X.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the package it imports, anywhere in its source."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {target for node in ast.walk(ast.parse(path.read_text()))
                       for target in _imported(node, package) if target in paths and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_reports_a_loop_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_kernels_package_has_no_import_cycle():
    graph = import_graph()
    assert "moerules.kernels.triton.quant" in graph["moerules.kernels.quantize"]  # imported inside a function
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
