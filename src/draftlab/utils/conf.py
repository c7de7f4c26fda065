"""Where draftlab's configs live, and the interpolations they use (registered on ``import draftlab``)."""

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


def method_name(choice: str) -> str:
    """The ``name`` of the method config ``conf/method/<choice>.yaml``: its own, else the one of the config it
    extends (its first default), so ``eagle3_continue`` is ``eagle3``. The experiment tunings are keyed by it
    (``conf/train.yaml``): a variant of a method takes that method's tuning."""
    import yaml

    path = Path(config_dir()) / "method" / f"{choice}.yaml"
    node = yaml.safe_load(path.read_text()) if path.exists() else None
    if not isinstance(node, dict):
        return str(choice)  # a method config from elsewhere on the search path: keyed by its own choice
    if "name" in node:
        return str(node["name"])
    base = next((d for d in node.get("defaults") or () if isinstance(d, str) and d != "_self_"), None)
    return method_name(base) if base else str(choice)


def tuning_settings(tuning: str, name: str):
    """The settings ``conf/tuning/<tuning>/<name>.yaml`` gives a method, with those of the tunings it extends (its
    defaults, ``/tuning/<t>/<m>@_here_``, merged first), as one DictConfig."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(config_dir()) / "tuning" / tuning / f"{name}.yaml")
    merged = OmegaConf.create()
    for entry in node.pop("defaults", None) or ():
        if entry != "_self_":
            base_tuning, base_name = str(entry).removeprefix("/tuning/").split("@")[0].split("/")
            merged = OmegaConf.merge(merged, tuning_settings(base_tuning, base_name))
    return OmegaConf.merge(merged, node)


def register_resolvers() -> None:
    """``${auto_precision:<accelerator>}`` and ``${method_name:<choice>}`` (idempotent)."""
    from omegaconf import OmegaConf

    from draftlab.utils.precision import AUTO, resolve_precision

    if not OmegaConf.has_resolver("auto_precision"):
        OmegaConf.register_new_resolver("auto_precision", lambda accelerator="cpu": resolve_precision(AUTO, accelerator))
    if not OmegaConf.has_resolver("method_name"):
        OmegaConf.register_new_resolver("method_name", method_name)
