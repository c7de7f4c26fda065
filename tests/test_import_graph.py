"""The import graph keeps one declared layer order: every import of every module under ``src/draftlab`` and
``analysis/`` (function-level and ``TYPE_CHECKING`` imports included) points down or sideways in ``LAYERS``,
no modules import each other in a circle, and a method imports no sibling method except by declared composition.

Read from the source with ``ast`` (nothing is imported), so a violation is reported even where a lazy import
would have hidden it at run time. The README's layout section states the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "src", ROOT)  # (where the package lives, its top folder): src/draftlab/..., analysis/...
PACKAGES = ("draftlab", "analysis")

# Lowest first. A module may import its own layer and the layers before it, never one after it. The package
# root (``draftlab/__init__.py``, which every module's import runs first) belongs to the lowest layer.
LAYERS = ("utils", "assets", "configs", "tracking", "kernels", "nn", "targets", "decoding", "data", "serving",
          "training", "methods", "export", "eval", "stages", "cli", "analysis")

# Methods that are built out of another method by design (composition); every other method-to-method
# import is a shared piece that belongs in draftlab.nn, draftlab.decoding or draftlab.training. (Hybrid
# and Draft-OPD compose their parts through config and the method registry, not by import.)
ALLOWED_METHOD_EDGES = {
    ("confu", "eagle3"),  # ConFu is an EAGLE-3 draft plus contemplate tokens and a future vector
    ("dspark", "dflash"),  # DSpark is a DFlash block draft plus a Markov head and a confidence head
    ("dflash2", "dflash"),  # DFlash2 is a DFlash block draft plus block convolutions and a candidate selector
}


def _modules(roots=SOURCES) -> dict[str, Path]:
    """Module name -> file, for every .py of the packages under ``roots``."""
    found = {}
    for root in roots:
        for pkg in PACKAGES:
            for path in sorted((root / pkg).rglob("*.py")) if (root / pkg / "__init__.py").exists() else ():
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "analysis":
        return "analysis"
    return "utils" if len(parts) == 1 else parts[1]


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ``modules`` that ``path`` imports anywhere (``from pkg import mod`` resolves to the submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph(roots=SOURCES) -> dict[str, set[str]]:
    modules = _modules(roots)
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, modules)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: the parents are edges too.
        for dep in list(deps):
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts)))
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for src, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if rank[layer_of(dep)] > rank[layer_of(src)]:
                bad.append(f"{src} ({layer_of(src)}) imports {dep} ({layer_of(dep)})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One sorted list per strongly connected component with more than one module (Tarjan)."""
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


def test_every_folder_has_a_declared_layer():
    layers = {layer_of(m) for m in _modules()}
    assert layers <= set(LAYERS), f"modules outside the declared layers: {sorted(layers - set(LAYERS))}"
    assert layers == set(LAYERS), f"declared layers with no module: {sorted(set(LAYERS) - layers)}"


def test_every_import_follows_the_declared_layer_order():
    bad = upward_edges(import_graph())
    assert not bad, "imports against the layer order (move the shared piece down a layer):\n" + "\n".join(bad)


def test_no_modules_import_each_other_in_a_circle():
    found = cycles(import_graph())
    assert not found, "import circles (function-level imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def _method_edges(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    edges = set()
    for src, deps in graph.items():
        parts = src.split(".")
        if len(parts) < 3 or parts[:2] != ["draftlab", "methods"]:
            continue
        for dep in deps:
            d = dep.split(".")
            if len(d) >= 3 and d[:2] == ["draftlab", "methods"] and d[2] != parts[2] and d[2] in _method_names():
                edges.add((parts[2], d[2], src))
    return edges


def _method_names() -> set[str]:
    return {p.name for p in (ROOT / "src/draftlab/methods").iterdir() if (p / "__init__.py").exists()}


def test_methods_import_no_sibling_method_except_declared_composition():
    bad = sorted(f"{src} imports draftlab.methods.{dst}" for m, dst, src in _method_edges(import_graph())
                 if (m, dst) not in ALLOWED_METHOD_EDGES)
    assert not bad, "method importing another method (shared layers belong in draftlab.nn):\n" + "\n".join(bad)
    # Every declared composition edge is real (so the check sees imports, and the list stays exact).
    assert ALLOWED_METHOD_EDGES <= {(m, dst) for m, dst, _ in _method_edges(import_graph())}


def test_the_checks_see_an_injected_upward_import_and_circle(tmp_path):
    # The checks above pass vacuously if the walker finds nothing: a copy of two real modules, one given a
    # function-level import of a pipeline stage and one a circle through a lazy import, must be flagged.
    pkg = tmp_path / "draftlab"
    for sub in ("", "utils", "stages"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "utils" / "atomic.py").write_text("def f():\n    from draftlab.stages.train import run\n")
    (pkg / "stages" / "train.py").write_text("from draftlab.stages.data import x\n")
    (pkg / "stages" / "data.py").write_text("def g():\n    import draftlab.stages.train\n")
    graph = import_graph((tmp_path,))
    assert upward_edges(graph) == ["draftlab.utils.atomic (utils) imports draftlab.stages (stages)",
                                   "draftlab.utils.atomic (utils) imports draftlab.stages.train (stages)"]
    assert cycles(graph) == [["draftlab.stages.data", "draftlab.stages.train"]]
    real = import_graph()
    assert "draftlab.decoding.drafter" in real["draftlab.decoding.engine"]
    assert "draftlab.targets.cache" in real["draftlab.targets.hf"]
