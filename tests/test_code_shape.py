"""Source stays in rooms a reader can hold in their head: no file over 500 lines, no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "draftlab"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# Known offenders (none now); an entry here is a debt, not a licence. Paths are relative
# to src/draftlab, functions are "path::qualified.name". Remove an entry when its split lands (the
# test below fails on stale entries, so the list can only shrink).
PENDING: set[str] = set()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _functions(tree: ast.Module):
    """``(qualified name, node)`` of every function and method, nested ones included."""
    stack = [(node, "") for node in tree.body]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            stack += [(child, f"{name}.") for child in node.body]


def _function_lines(node: ast.AST) -> int:
    # From the first decorator (or ``def``) to the last line of the body, docstring included.
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def oversized(pkg: Path = PKG) -> dict[str, int]:
    """Every file and function over its limit, with its length."""
    found: dict[str, int] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if (n := _lines(path)) > MAX_FILE_LINES:
            found[rel] = n
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            if (n := _function_lines(node)) > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = n
    return found


def test_no_oversized_files_or_functions():
    new = {k: v for k, v in oversized().items() if k not in PENDING}
    assert not new, (f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per function; split along the "
                     "seams:\n" + "\n".join(f"{k}: {v} lines" for k, v in sorted(new.items())))


def test_pending_entries_are_still_oversized():
    stale = PENDING - set(oversized())
    assert not stale, f"split already; drop from PENDING: {sorted(stale)}"


def test_the_walker_sees_long_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    (tmp_path / "short.py").write_text("def g():\n    return 1\n")
    assert oversized(tmp_path) == {"m.py::A.f": MAX_FUNCTION_LINES + 1}
