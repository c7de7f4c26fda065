"""Thin Hydra entry points. Configs live in the repository's top-level ``conf/`` directory."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> str:
    """``$DRAFTLAB_CONF`` or the checkout's ``conf/`` (draftlab is installed editable from its checkout)."""
    env = os.environ.get("DRAFTLAB_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "conf"
    if not (path / "data_stage.yaml").exists():
        raise FileNotFoundError(f"draftlab configs not found at {path}; set DRAFTLAB_CONF to the conf/ directory")
    return str(path)
