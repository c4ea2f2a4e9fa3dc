"""No two kvfence modules depend on each other, directly or through others.

The graph is read from the source with `ast`, not by importing: every `import kvfence...` and
`from kvfence... import ...` (relative ones resolved) anywhere in a module counts, inside functions
and under `if TYPE_CHECKING:` too, since a lazy import is still a dependency a reader has to
follow. `from kvfence.x import y` is an edge to `kvfence.x.y` when `y` is a submodule, else to
`kvfence.x`. Imports built from strings (`importlib.import_module(f"kvfence.commands.{name}")`)
are not seen.

The same holds one floor up: no two folders of `kvfence/` (packages, and top-level modules
each on their own) import each other through any chain, so the layers can be read bottom up.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kvfence"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE_DIR) -> Graph:
    files = {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    graph: Graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}

        def add(target: str, line: int, _edges: dict[str, int] = edges, _self: str = name) -> None:
            if target in files and target != _self:
                _edges.setdefault(target, line)

        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kvfence":
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                if source.split(".")[0] != "kvfence":
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    add(sub if sub in files else source, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan, recursive: the graph has ~150 nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # breadth-first from `start` back to `start`, inside the component
        paths: dict[str, list[str]] = {start: [start]}
        frontier = [start]
        cycle: list[str] = []
        while frontier and not cycle:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        cycle = [*paths[v], start]
                        break
                    if w in members and w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def describe(graph: Graph, cycles: list[list[str]]) -> str:
    """Each cycle as `a (line N) -> b (line M) -> a`, then every module of its tangle."""
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join([*(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)), cycle[-1]]))
        lines.append("  tangled together: " + ", ".join(sorted(tangle_of(graph, cycle[0]))))
    return "import cycles:\n" + "\n".join(lines)


def tangle_of(graph: Graph, module: str) -> set[str]:
    """The modules that reach `module` and are reached from it (its strongly connected component)."""

    def reach(start: str, edges: Graph) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges.get(todo.pop(), {}):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reverse: Graph = {}
    for a, out in graph.items():
        for b in out:
            reverse.setdefault(b, {})[a] = 0
    return reach(module, graph) & reach(module, reverse)


def folder_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def folder_graph(graph: Graph) -> Graph:
    """The module graph collapsed to `kvfence.<folder>` nodes (a top-level module is its own folder); an edge's
    line is that of the first import that makes it."""
    out: Graph = {folder_of(m): {} for m in graph}
    for a, edges in graph.items():
        for b, line in edges.items():
            if folder_of(a) != folder_of(b):
                out[folder_of(a)].setdefault(folder_of(b), line)
    return out


def upward_imports(graph: Graph, cycle: list[str]) -> list[str]:
    """The module imports that make each folder edge of `cycle` (what to move to break it)."""
    return [
        f"{a} (line {line}) -> {b}"
        for fa, fb in itertools.pairwise(cycle)
        for a, edges in graph.items()
        for b, line in edges.items()
        if folder_of(a) == fa and folder_of(b) == fb
    ]


def test_graph_sees_imports_inside_functions_and_submodules(tmp_path: Path) -> None:
    pkg = tmp_path / "kvfence"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from kvfence.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nfrom . import c\n")
    (pkg / "sub" / "c.py").write_text("import kvfence.sub\n")
    graph = import_graph(pkg)
    assert graph["kvfence.a"] == {"kvfence.sub.b": 2}
    assert graph["kvfence.sub.b"] == {"kvfence.a": 1, "kvfence.sub.c": 2}
    assert graph["kvfence.sub.c"] == {"kvfence.sub": 1}
    assert find_cycles(graph) == [["kvfence.a", "kvfence.sub.b", "kvfence.a"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, describe(graph, cycles)


def test_folder_graph_finds_a_cycle_through_two_folders(tmp_path: Path) -> None:
    pkg = tmp_path / "kvfence"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from kvfence.high import b\n")  # the upward arrow
    (pkg / "high" / "b.py").write_text("from kvfence.low import c\n")
    (pkg / "low" / "c.py").write_text("")
    graph = import_graph(pkg)
    assert not find_cycles(graph)  # no module cycle...
    assert find_cycles(folder_graph(graph)) == [["kvfence.high", "kvfence.low", "kvfence.high"]]  # ...but a folder one


def test_no_import_cycles_between_folders() -> None:
    graph = import_graph()
    folders = folder_graph(graph)
    cycles = find_cycles(folders)
    assert not cycles, (
        describe(folders, cycles)
        + "\nmade by:\n"
        + "\n".join(line for cycle in cycles for line in upward_imports(graph, cycle))
    )
