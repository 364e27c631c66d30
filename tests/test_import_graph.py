"""gamma_titan's modules import each other without a cycle.

Every import statement counts, at module level or inside a function: a lazy import still
ties two modules together, and a cycle hidden in a function is one refactor away from a
circular-import error at start-up. The graph is read from the sources with `ast`; nothing
is imported. Edges, as Python resolves them:
  * `import a.b` imports module a.b (a package's is its __init__.py);
  * `from a import b` imports a.b when that is a module, else the package a (b is a name);
  * relative imports resolve against the importing module's package.
The parent packages an import initialises on the way are not edges (every submodule would
otherwise be in a cycle with a package __init__ that imports it), nor is a module's import
of a name from itself.

`python tests/test_import_graph.py [PREFIX]` prints the cycles, and the edges between the
modules whose names start with PREFIX (e.g. gamma_titan.data).
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "gamma_titan"


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package in `package_dir`."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module name that `from <...> import` names."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` (in `path`) imports, anywhere in its body."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):  # every node: function bodies too
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    found.discard(name)
    return found & modules.keys()  # the package's own modules only


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest cycle through each import that lies on one, as chains [a, b, ..., a],
    each cycle once: empty iff the graph is acyclic."""
    cycles, seen = [], set()
    for module in sorted(graph):
        for target in sorted(graph[module]):
            back = _shortest_path(graph, target, module)
            if back is None:
                continue
            ring = [module, *back[:-1]]  # the cycle without its repeated end
            first = ring.index(min(ring))  # one rotation names each cycle
            key = tuple(ring[first:] + ring[:first])
            if key not in seen:
                seen.add(key)
                cycles.append([module, *back])
    return cycles


def _shortest_path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """[start, ..., goal] along imports (breadth first), or None if goal is unreachable."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = parent[node]
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def _chains(cycles: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(cycle) for cycle in cycles)


# --------------------------------------------------------------------------- tests


def test_no_import_cycles():
    graph = import_graph()
    assert "gamma_titan.data.shard_sources" in graph["gamma_titan.data.loader"]  # the walk sees imports
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s) in gamma_titan:\n{_chains(cycles)}"


#: Arrows point down: what each package (or top-level module) may import besides itself.
#: models/, config/, data/ and diagnostics/ import nothing from training/; a constant lives
#: with the schema or the leaf module (files.py, errors.py) that names it; file_reads.py
#: (reading what a command did not write, damage in one line) is a leaf beside them.
MAY_IMPORT = {
    "errors": set(),
    "files": set(),
    "file_reads": {"errors"},
    "progress": set(),
    "init": {"errors"},
    "grid_search": {"errors"},
    "data": {"errors", "file_reads", "files"},
    "models": {"errors", "files", "init"},
    "diagnostics": {"data", "errors", "files", "init"},
    "config": {"data", "errors", "files", "init", "models"},
    "convert": {"data", "errors", "file_reads", "files", "init", "models"},
    "reports": {"convert", "data", "diagnostics", "errors", "file_reads", "files", "grid_search", "init", "models"},
    "training": {"config", "convert", "data", "diagnostics", "errors", "file_reads", "files", "init", "inspect_model",
                 "models", "progress"},
    "inspect_model": {"diagnostics", "errors", "init", "models", "training"},
    "slurm": {"config", "errors", "file_reads", "files", "reports", "training"},
    "recipes": {"config", "data", "diagnostics", "errors", "file_reads", "files", "grid_search", "init", "models",
                "progress", "reports", "slurm", "training"},
}


def package_of(module: str) -> str:
    """gamma_titan.training.main -> "training"; gamma_titan.files -> "files"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if (src := package_of(module)) in MAY_IMPORT and (dst := package_of(target)) != src
            and dst not in MAY_IMPORT[src]]


def test_arrows_point_down():
    graph = import_graph()
    assert not upward_imports(graph), "\n".join(upward_imports(graph))
    assert upward_imports({"gamma_titan.models.dense": {"gamma_titan.training.train_spec"}}) == [
        "gamma_titan.models.dense -> gamma_titan.training.train_spec"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_graph_counts_lazy_relative_and_package_imports(tmp_path):
    package_dir = _write(tmp_path, {
        "pkg/__init__.py": "X = 1\nfrom pkg import X as Y\n",  # itself: no edge
        "pkg/a.py": "def f():\n    from pkg.b import thing\n",  # lazy, a name in b
        "pkg/b.py": "from .sub import c\nfrom . import sub\n",  # a module, then a package
        "pkg/sub/__init__.py": "from ..a import f\n",  # relative from a package __init__
        "pkg/sub/c.py": "import os\nimport pkg.sub\n",
        "pkg/d.py": "from pkg import *\n",
    })
    graph = import_graph(package_dir)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c", "pkg.sub"},
        "pkg.sub": {"pkg.a"},
        "pkg.sub.c": {"pkg.sub"},
        "pkg.d": {"pkg"},
    }
    assert find_cycles(graph) == [  # each once, although a -> b lies on both
        ["pkg.a", "pkg.b", "pkg.sub", "pkg.a"],
        ["pkg.b", "pkg.sub.c", "pkg.sub", "pkg.a", "pkg.b"],
    ]


def test_find_cycles():
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    # Two cycles sharing a -> b: both are reported.
    assert find_cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"a"}}) == [["a", "b", "a"], ["b", "c", "a", "b"]]


if __name__ == "__main__":
    graph = import_graph()
    print(f"cycles:\n{_chains(find_cycles(graph)) or '  none'}")
    if len(sys.argv) > 1:
        prefix = sys.argv[1]
        print(f"edges within {prefix}:")
        for module in sorted(m for m in graph if m.startswith(prefix)):
            targets = sorted(t for t in graph[module] if t.startswith(prefix))
            print(f"  {module} -> {', '.join(targets) or '(none)'}")
