"""The package is plain files: no symlink under ``src/`` (a copy or an install that drops symlinks would lose
what it points to, and tree walkers skip it), and every check that walks the package sees the kernels."""

from __future__ import annotations

import shutil
from pathlib import Path

from draftlab.eval.reuse import source_version
from tests import test_code_shape, test_import_graph

SRC = Path(__file__).resolve().parents[1] / "src"
KERNEL = "kernels/ttt_attention.py"


def test_no_symlink_under_src():
    links = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*") if p.is_symlink()]
    assert not links, f"symlinks under src/: {links}"


def test_the_code_shape_walker_reads_the_kernels(tmp_path):
    pkg = tmp_path / "draftlab"
    shutil.copytree(SRC / "draftlab", pkg, symlinks=True)  # a symlinked folder stays one (walkers skip it)
    path = pkg / KERNEL
    path.write_text(path.read_text() + "\n" * (test_code_shape.MAX_FILE_LINES + 1))
    assert KERNEL in test_code_shape.oversized(pkg)


def test_the_import_graph_reads_the_kernels():
    modules = test_import_graph._modules()
    assert "draftlab.kernels.ttt_attention" in modules and "draftlab.kernels.soft_cross_entropy" in modules
    graph = test_import_graph.import_graph()
    assert "draftlab.kernels._triton" in graph["draftlab.kernels.ttt_attention"]


def test_the_reuse_hash_covers_the_kernels(tmp_path):
    pkg = tmp_path / "draftlab"
    shutil.copytree(SRC / "draftlab", pkg, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_version(pkg)
    (pkg / KERNEL).write_text((pkg / KERNEL).read_text() + "\n# an edit\n")
    assert source_version(pkg) != before
