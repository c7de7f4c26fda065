"""Source stays in rooms a reader can hold in their head: no file over 500 lines, no function over 80, in the
package (its kernels included) and in analysis/; tests, which state long cases, get 600 and 100."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "draftlab"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# folder -> (lines per file, lines per function)
LIMITS = {PKG: (MAX_FILE_LINES, MAX_FUNCTION_LINES), REPO / "analysis": (MAX_FILE_LINES, MAX_FUNCTION_LINES),
          REPO / "tests": (600, 100)}

# Known offenders (none now); an entry here is a debt, not a licence. Paths are relative
# to the repository, functions are "path::qualified.name". Remove an entry when its split lands (the
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


def oversized(pkg: Path = PKG, max_file: int = MAX_FILE_LINES, max_function: int = MAX_FUNCTION_LINES
              ) -> dict[str, int]:
    """Every file and function under ``pkg`` over its limit, with its length (paths relative to ``pkg``)."""
    found: dict[str, int] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if (n := _lines(path)) > max_file:
            found[rel] = n
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            if (n := _function_lines(node)) > max_function:
                found[f"{rel}::{name}"] = n
    return found


def oversized_everywhere() -> dict[str, int]:
    """``oversized`` over every folder of ``LIMITS``, paths relative to the repository."""
    return {f"{root.relative_to(REPO).as_posix()}/{k}": v for root, (f, g) in LIMITS.items()
            for k, v in oversized(root, f, g).items()}


def test_no_oversized_files_or_functions():
    new = {k: v for k, v in oversized_everywhere().items() if k not in PENDING}
    assert not new, ("over the limits (src/draftlab and analysis: 500 lines per file, 80 per function; tests: 600 "
                     "and 100); split along the seams:\n" + "\n".join(f"{k}: {v} lines" for k, v in sorted(new.items())))


def test_pending_entries_are_still_oversized():
    stale = PENDING - set(oversized_everywhere())
    assert not stale, f"split already; drop from PENDING: {sorted(stale)}"


def test_the_walker_sees_long_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    (tmp_path / "short.py").write_text("def g():\n    return 1\n")
    assert oversized(tmp_path) == {"m.py::A.f": MAX_FUNCTION_LINES + 1}
    # The gate covers the package (the kernels are inside it, not behind a symlink), analysis/ and tests/.
    assert {r.relative_to(REPO).as_posix() for r in LIMITS} == {"src/draftlab", "analysis", "tests"}
    assert (PKG / "kernels").is_dir() and not (PKG / "kernels").is_symlink()
