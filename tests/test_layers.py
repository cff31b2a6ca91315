"""The package's layers, read from the source (every import, function-level ones included):

    vocabulary (moerules.config, .quant, .decision, .errors, ...)  imports nothing of ours
    engine     (moerules.engine)   the vocabulary
    kernels    (moerules.kernels)  the vocabulary and the engine
    tools      (moerules.tools, moerules.integrations, moerules.testing)  any layer; imported by none
    facade     (moerules/__init__: decide, build, ...)  lazily, any layer; imported by name by none

No import cycles between modules (imports under `if TYPE_CHECKING:` name a type and never run, so they
count for the layers but not for cycles), and no module imports another package's private (`_`) name.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import moerules

ROOT = Path(moerules.__file__).parent
LAYERS = ("vocabulary", "engine", "kernels", "tools")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    # engine/, kernels/, tools/ are symlinks inside the package in a checkout: walk through them
    paths = [Path(folder, name) for folder, _, names in os.walk(ROOT, followlinks=True) for name in names
             if name.endswith(".py")]
    return {module_name(p): p for p in sorted(paths)}


def layer(module: str) -> str:
    if module == "moerules":
        return "facade"
    sub = module.split(".")[1]
    if sub in ("engine", "kernels", "tools"):
        return sub
    return "tools" if sub in ("integrations", "testing") else "vocabulary"


def typing_only(tree: ast.Module) -> set[ast.AST]:
    guarded = [node for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    return {inner for node in guarded for statement in node.body for inner in ast.walk(statement)}


def imports(module: str, path: Path, known: dict[str, Path],
            runtime: bool = False) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every moerules import in the file (`runtime`: only
    those that can run)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = typing_only(tree) if runtime else set()
    found = []
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [alias.name for alias in node.names]
            # `from moerules.engine import decide` imports the module moerules.engine.decide
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            found += [(s, [], node.lineno) for s in submodules]
            if len(submodules) < len(names):
                found.append((base, [n for n in names if f"{base}.{n}" not in known], node.lineno))
    return [(target, names, line) for target, names, line in found
            if target == "moerules" or target.startswith("moerules.")]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, list[str], int]]]:
    known = modules()
    return {module: imports(module, path, known) for module, path in known.items()}


@pytest.fixture(scope="module")
def runtime_graph() -> dict[str, list[tuple[str, list[str], int]]]:
    known = modules()
    return {module: imports(module, path, known, runtime=True) for module, path in known.items()}


def test_each_layer_imports_only_the_layers_below(graph):
    allowed = {"vocabulary": {"vocabulary"}, "engine": {"vocabulary", "engine"},
               "kernels": {"vocabulary", "engine", "kernels"}, "tools": set(LAYERS), "facade": set(LAYERS)}
    wrong = [f"{module}:{line} ({layer(module)}) imports {target} ({layer(target)})"
             for module, found in graph.items() for target, _, line in found
             if target != "moerules" and layer(target) not in allowed[layer(module)]]
    assert wrong == []


def test_nothing_imports_the_facade(graph):
    # Inside the package the facade's names come from their own modules; `from moerules import decide`
    # in the engine would make the bottom import the top.
    wrong = [f"{module}:{line} imports {names} from the facade" for module, found in graph.items()
             for target, names, line in found if target == "moerules" and module != "moerules"]
    assert wrong == []


def test_no_private_names_across_packages(graph):
    def package(module):
        return module.rpartition(".")[0]
    wrong = [f"{module}:{line} imports {name} from {target}" for module, found in graph.items()
             for target, names, line in found for name in names
             if name.startswith("_") and not name.startswith("__") and package(target) != package(module)]
    assert wrong == []


def cycles(graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _, _ in found if t in graph and t != m}) for m, found in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles(runtime_graph):
    assert cycles(runtime_graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"moerules.a": [("moerules.b", [], 1)], "moerules.b": [("moerules.a", [], 1)], "moerules.c": []}
    assert cycles(graph) == [["moerules.a", "moerules.b"]]
