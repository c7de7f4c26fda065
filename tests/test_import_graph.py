"""The import graph of ``src/draftlab`` keeps its layers: no cycles, no upward imports, methods stand alone.

Read from the source with ``ast`` (nothing is imported), so a violation is reported even where a lazy
import would have hidden it at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "draftlab"

# Layers that the pipeline's later stages build on; they must never reach back up into these.
LOWER = ("draftlab.methods", "draftlab.decoding", "draftlab.targets", "draftlab.nn")
UPPER = ("draftlab.export", "draftlab.stages", "draftlab.cli")

# Methods that are built out of another method by design (composition); every other method-to-method
# import is a shared piece that belongs in draftlab.nn, draftlab.decoding or draftlab.training. (Hybrid
# and Draft-OPD compose their parts through config and the method registry, not by import.)
ALLOWED_METHOD_EDGES = {
    ("confu", "eagle3"),  # ConFu is an EAGLE-3 draft plus contemplate tokens and a future vector
}

# Upward imports that are known and scheduled to move; this list may only shrink (a stale entry fails).
PENDING_UPWARD: set[tuple[str, str]] = set()

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _type_checking_only(node: ast.stmt) -> bool:
    """``if TYPE_CHECKING:`` blocks never run, so their imports cannot close a cycle."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: dict[str, Path], *, top_level_only: bool) -> set[str]:
    """draftlab modules that ``path`` imports (``from pkg import mod`` resolves to the submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module-level code includes imports under if / try at the top level
        nodes = [n for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and not _type_checking_only(top) for n in ast.walk(top)]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "draftlab":
                continue
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, modules, top_level_only=top_level_only)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: the parents are edges too.
        for dep in list(deps):
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts)))
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_no_import_cycles_among_module_level_imports():
    cycles = _cycles(_graph(top_level_only=True))
    assert not cycles, "module-level import cycles (move the shared piece down a layer):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def _upward_edges() -> set[tuple[str, str]]:
    return {(src, dep) for src, deps in _graph(top_level_only=False).items() if src.startswith(LOWER)
            for dep in deps if dep.startswith(UPPER)}


def test_lower_layers_never_import_upper_ones():
    bad = sorted(f"{src} imports {dep}" for src, dep in _upward_edges() - PENDING_UPWARD)
    assert not bad, "lower layers importing pipeline stages / exporters / CLI:\n" + "\n".join(bad)


def test_pending_upward_imports_still_exist():
    stale = PENDING_UPWARD - _upward_edges()
    assert not stale, f"these imports are gone; drop them from PENDING_UPWARD: {sorted(stale)}"


def _method_edges() -> set[tuple[str, str, str]]:
    methods = {p.name for p in (PKG / "methods").iterdir() if (p / "__init__.py").exists()}
    edges = set()
    for src, deps in _graph(top_level_only=False).items():
        parts = src.split(".")
        if len(parts) < 3 or parts[1] != "methods" or parts[2] not in methods:
            continue
        for dep in deps:
            d = dep.split(".")
            if len(d) >= 3 and d[1] == "methods" and d[2] in methods and d[2] != parts[2]:
                edges.add((parts[2], d[2], src))
    return edges


def test_methods_import_no_sibling_method_except_declared_composition():
    bad = sorted(f"{src} imports draftlab.methods.{dst}" for m, dst, src in _method_edges()
                 if (m, dst) not in ALLOWED_METHOD_EDGES)
    assert not bad, "method importing another method (shared layers belong in draftlab.nn):\n" + "\n".join(bad)


def test_cycle_finder_finds_a_cycle():
    # The checks above pass vacuously if the walker finds nothing; make sure it can see a cycle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph(top_level_only=True)
    assert "draftlab.decoding.drafter" in graph["draftlab.decoding.engine"]
    # Every declared composition edge is real (so the method check sees imports, and the list stays exact).
    assert ALLOWED_METHOD_EDGES <= {(m, dst) for m, dst, _ in _method_edges()}
