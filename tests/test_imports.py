"""No import cycle inside ``lowmem/``: every module's imports, at module level and inside functions
(a cycle hidden in a function-local import is still a cycle), read with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "lowmem"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The ``lowmem`` modules ``path`` imports anywhere in its code (module level, functions, ``if
    TYPE_CHECKING``): ``from lowmem.x import y`` imports ``lowmem.x.y`` where that is a module, else
    ``lowmem.x``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import lowmem.a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_inside_lowmem():
    graph = import_graph()
    found = cycles(graph)
    shown = "; ".join(
        " <-> ".join(component) + " (" + ", ".join(f"{a} imports {b}" for a in component for b in sorted(graph[a])
                                            if b in component) + ")"
        for component in found
    )
    assert not found, f"import cycles: {shown}"


def test_the_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    package = tmp_path / "lowmem"
    package.mkdir()
    (package / "m.py").write_text("def f():\n    from lowmem.n import g\n    return g\n")
    (package / "n.py").write_text("from . import m\n")
    modules = {"lowmem.m", "lowmem.n"}
    graph = {module_name(p, tmp_path): imported_modules(p, modules, tmp_path) for p in package.glob("*.py")}
    assert graph == {"lowmem.m": {"lowmem.n"}, "lowmem.n": {"lowmem.m"}}
    assert cycles(graph) == [["lowmem.m", "lowmem.n"]]


def test_the_run_directory_modules_import_nothing_above_them():
    graph = import_graph()
    for name in [n for n in graph if n.startswith("lowmem.run")]:
        above = {m for m in graph[name] if m.startswith(("lowmem.trainer", "lowmem.techniques", "lowmem.profiler",
                                                       "lowmem.planning", "lowmem.api"))}
        assert not above, f"{name} imports {sorted(above)}"
