"""Write-then-rename for what a user keeps (exports, artifacts, records): a reader sees the old or the new, never half.

``with atomic_dir(out) as tmp:`` -- write everything into ``tmp`` (a hidden sibling of ``out``) and validate
it there; on a clean exit ``tmp`` replaces ``out`` (an earlier ``out`` is moved aside first, then removed);
on an exception ``tmp`` is removed and ``out`` is left as it was. A killed process leaves only a hidden
``.<name>.tmp-*`` sibling, which nothing mistakes for a finished directory. ``atomic_write_text`` is the same
for one file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a hidden sibling and a rename (parents created); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
