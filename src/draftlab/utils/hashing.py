"""Content keys for artifacts: the same config slice always maps to the same directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def _plain(obj: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def content_key(*parts: Any, length: int = 16) -> str:
    """A short sha256 over the canonical JSON of ``parts`` (dict keys sorted)."""
    blob = json.dumps([_plain(p) for p in parts], sort_keys=True, default=str, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def file_fingerprint(path: str | Path) -> str:
    """Identity of a data file without reading it all: its size plus its first and last MiB (not its path)."""
    p = Path(path)
    st = p.stat()
    h = hashlib.sha256(str(st.st_size).encode())
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 1 << 20:
            f.seek(max(0, st.st_size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]
