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


# The layers of docs/architecture.md, bottom first: a module imports modules of its own layer or below,
# never above (and, by the test above, never in a cycle). A new module must be placed here.
LAYERS = [
    ("foundations", ["lowmem.kernels", "lowmem.residual", "lowmem.profiler", "lowmem.signals", "lowmem.libraries",
                     "lowmem.schedules", "lowmem.download"]),
    ("techniques", ["lowmem.techniques", "lowmem.losses"]),
    ("configuration", ["lowmem.config", "lowmem.knobs", "lowmem.recipe", "lowmem.distributed", "lowmem.sharding"]),
    ("run files", ["lowmem.run", "lowmem.metrics_log"]),
    ("checkpoint planning", ["lowmem.planning.schedule", "lowmem.planning.measure", "lowmem.planning.optimal",
                             "lowmem.planning.reported", "lowmem.planning.ahead", "lowmem.planning"]),
    ("trainer", ["lowmem.trainer"]),
    ("API and search", ["lowmem.api", "lowmem.planning.search", "lowmem.planning.budget"]),
    ("command lines", ["lowmem.train", "lowmem.profile", "lowmem.plan", "lowmem.report", "lowmem.report_plot",
                       "lowmem"]),
]


def layer_of(module: str) -> int:
    """The layer of ``module``: its longest prefix listed in LAYERS."""
    best = None
    for rank, (_, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and (best is None or len(member) > best[1]):
                best = (rank, len(member))
    assert best is not None, f"{module} is in no layer of tests/test_imports.py (and docs/architecture.md)"
    return best[0]


def test_every_module_imports_only_its_layer_and_below():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports reaching up a layer:\n" + "\n".join(upward)
