"""No import circle inside ``kvmem/``: the module import graph, read from the source by AST, is
acyclic.

What counts as an edge ``A -> B`` (A and B modules of kvmem):

- every ``import kvmem.x.y`` and ``from kvmem.x import y`` statement that runs, at module level
  or inside a function (a deferred import is still a dependency: it only waits for the first
  call, and a circle through it is one refactoring away from a partly initialized module);
- relative imports, resolved against A's package;
- B is the module the statement names: ``from kvmem.x import y`` is an edge to ``kvmem.x.y``
  when that is a module, else to ``kvmem.x`` (``y`` is a name defined there).

Not counted:

- imports under ``if TYPE_CHECKING:``: they never run; they let a module name a type in its
  annotations only (mypy reads them, and handles circles among them);
- the implicit import of a module's parent packages (``import kvmem.x.y`` runs
  ``kvmem/__init__.py`` and ``kvmem/x/__init__.py`` first): every package ``__init__``
  re-exports its submodules' names, so with those edges every module would sit on a circle
  through its package; an ``__init__`` is checked through its own statements like any module;
- imports by string (``importlib.import_module(name)``, the lazy tables of
  ``kvmem/__init__.py``, ``kvmem/quant/__init__.py`` and ``kvmem/integrations/vllm/__init__.py``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import kvmem

ROOT = Path(kvmem.__file__).parent


def module_name(path: Path, root: Path = ROOT) -> str:
    """``kvmem/cli/__init__.py`` -> ``kvmem.cli``; ``kvmem/cli/args.py`` -> ``kvmem.cli.args``."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((root.name, *parts))


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """Every dotted name an import statement of ``module`` reaches for, relative imports
    resolved: ``from a.b import c`` gives ``a.b.c`` (the caller keeps the longest prefix that is
    a module)."""
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            yield from (f"{base}.{alias.name}" if alias.name != "*" else base
                        for alias in node.names)


def _runtime_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def target(name: str, modules: Iterable[str]) -> str | None:
    """The module of ``modules`` that ``name`` lands in: the longest dotted prefix that is one."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in known:
            return prefix
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: {modules it imports}}`` for every module under ``root`` (a package folder)."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in imported_names(tree, module, path.name == "__init__.py"):
            dep = target(name, paths)
            if dep is not None and dep != module:
                graph[module].add(dep)
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The graph's circles, one per strongly connected component that has one: each as the
    modules along it, first repeated last (``[a, b, a]``)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0

    def edges(node: str) -> list[str]:
        return sorted(graph.get(node, ()))

    for start in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit)
        if start in index:
            continue
        work = [(start, iter(edges(start)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges(child))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_circle_in(component, graph) for component in components]


def _circle_in(component: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """One circle through the component's first module (breadth-first: a shortest one)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")  # pragma: no cover


def assert_no_circle(graph: Mapping[str, Iterable[str]]) -> None:
    """Fail, naming every circle (``a -> b -> a``), if ``graph`` has one."""
    circles = find_cycles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_kvmem_has_no_import_circle() -> None:
    graph = import_graph()
    assert "kvmem.manager" in graph and "kvmem.allocator" in graph["kvmem"]  # it read kvmem/
    assert_no_circle(graph)


def test_the_graph_counts_every_import_that_runs(tmp_path: Path) -> None:
    """Module-level, function-level and relative imports are edges, ``TYPE_CHECKING`` ones are
    not (their ``else`` is); the target is the submodule when the imported name is one, else
    the module that defines the name."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "import pkg.sub.c\nA = 1\n",
        "b.py": "def f():\n    from pkg import a\n    return a\n",
        "sub/__init__.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n"
                           "else:\n    from pkg.b import f\n",
        "sub/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import f\n"
                    "from .. import A\n",
        "sub/c.py": "from . import d\nimport os\n",
        "sub/d.py": "from .c import *\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert import_graph(pkg) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.c"},
        "pkg.b": {"pkg.a"},
        "pkg.sub": {"pkg.b"},
        "pkg.sub.c": {"pkg.sub.d"},
        "pkg.sub.d": {"pkg.sub.c"},
        "pkg.sub.e": {"pkg"},
    }
    assert find_cycles(import_graph(pkg)) == [["pkg.sub.c", "pkg.sub.d", "pkg.sub.c"]]


@pytest.mark.parametrize(
    ("graph", "circles"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, []),  # a diamond is no circle
        ({"a": {"a"}}, [["a", "a"]]),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
        ({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()},
         [["a", "b", "c", "a"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}},
         [["a", "b", "a"], ["c", "d", "e", "c"]]),
    ],
)
def test_find_cycles_names_each_circle(graph: dict[str, set[str]],
                                       circles: list[list[str]]) -> None:
    assert sorted(find_cycles(graph)) == circles


def test_a_circle_in_kvmem_fails_and_names_the_edge_that_closes_it() -> None:
    """kvmem's own graph with one upward edge added (the allocator importing the manager that
    imports it): the check fails, and the circle it names goes through that edge (the graph was
    acyclic without it, so every circle does)."""
    graph = import_graph()
    assert "kvmem.allocator" in graph["kvmem.manager"]
    graph["kvmem.allocator"].add("kvmem.manager")
    with pytest.raises(AssertionError, match=re.escape("kvmem.allocator -> kvmem.manager")):
        assert_no_circle(graph)
