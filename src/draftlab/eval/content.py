"""What an evaluation reads, named by content: the bench's question file and the target's weights.

An evaluation's key (``eval.reuse``) names them by sha256, so a question file edited in place or weights
replaced under the same path evaluate again. A file is hashed once: its digest is kept in
``<DRAFTLAB_CACHE>/content_digests.json`` under its resolved path with its size and modification time, and
used while both are unchanged. (A file rewritten with the same size and a restored modification time would
be taken for the old one; ``eval.reuse=false`` covers that.) A directory's digest is over its files' relative
paths and digests, hidden files left out.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftlab.assets import cache_root, sha256_file
from draftlab.utils.atomic import atomic_write_text

_CACHE: dict[str, dict[str, Any]] | None = None


def _cache_path() -> Path:
    return cache_root() / "content_digests.json"


def _cached() -> dict[str, dict[str, Any]]:
    global _CACHE
    if _CACHE is None:
        try:
            _CACHE = json.loads(_cache_path().read_text())
        except (OSError, ValueError):
            _CACHE = {}
    return _CACHE


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, from the cache while its size and modification time are unchanged."""
    path = Path(path).resolve()
    st = path.stat()
    seen = _cached().get(str(path))
    if seen and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        return str(seen["sha256"])
    digest = sha256_file(path)
    _cached()[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_cache_path(), json.dumps(_cached(), indent=0, sort_keys=True))
    except OSError:
        pass  # a read-only cache only costs the hash again next time
    return digest


def digest(path: str | Path) -> str:
    """:func:`file_digest` of a file; of a directory, sha256 over its files' relative paths and digests."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        h.update(f"{rel}\0{file_digest(f)}\0".encode())
    return h.hexdigest()


def _local(source: str) -> Path | None:
    """Where ``source`` (a config's path: ``asset:<name>``, a local path, a hub id) is on this machine."""
    if source.startswith("asset:"):
        from draftlab.assets import fetch

        return Path(fetch(source.removeprefix("asset:")))
    if Path(source).expanduser().exists():
        return Path(source).expanduser()
    try:  # a hub id already downloaded: its snapshot directory; otherwise the key names it by id alone
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:
        return None


def input_digests(cfg: DictConfig) -> dict[str, str | None]:
    """``{"bench": ..., "target": ...}``: the digests of the question file and the target's files (None where
    there is no file: the random test target, a hub id not on this machine)."""
    out: dict[str, str | None] = {"bench": None, "target": None}
    bench = OmegaConf.select(cfg, "bench.path")
    if bench and (local := _local(str(bench))) is not None:
        out["bench"] = digest(local)
    source = str(OmegaConf.select(cfg, "target.source", default="") or "")
    if source and source != "tiny_random" and (local := _local(source)) is not None:
        out["target"] = digest(local)
    return out
