"""The one step every entry point runs on a composed config before anything reads it.

An experiment owns data, budget and evaluation; the knobs of a method live in ``conf/method/<m>.yaml``. An
experiment that needs other values for some methods writes them in ``method_overrides``, a block keyed by
method name::

    method_overrides:
      eagle3: {module: {ttt_length: 2}, drafter: {nodes: 6}}
      dflash: {data: {val_fraction: 0.1}}

:func:`prepare_config` merges the block of the selected method (``method.name``) into ``method`` and drops
the rest, so ``experiment=quickstart method=<m>`` runs for every method, each with its own knobs. A knob the
selected method does not have is a one-line ``ConfigError`` naming it and the method's file (a typo would
otherwise be an unexpected keyword deep inside a constructor). Settings given on the command line
(``method.module.ttt_length=4``, a sweep's values) win over the experiment's block, as Hydra's own order
would have it.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from draftlab.utils.errors import ConfigError


def config_dir() -> str:
    """``$DRAFTLAB_CONF`` or the checkout's ``conf/`` (draftlab is installed editable from its checkout)."""
    env = os.environ.get("DRAFTLAB_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / "data_stage.yaml").exists():
        raise FileNotFoundError(f"draftlab configs not found at {path}; set DRAFTLAB_CONF to the conf/ directory")
    return str(path)


def prepare_config(cfg: DictConfig, *, overrides: list[str] | None = None,
                   method_file: str | None = None) -> DictConfig:
    """Apply ``method_overrides`` for the selected method and refuse a retired config form; returns ``cfg``.

    ``overrides``: the command line's (default: the running Hydra job's), whose ``method.*`` settings the
    experiment's block does not overwrite. ``method_file``: the selected method's config file for messages
    (default: from the Hydra choice, else ``conf/method/<method.name>.yaml``).
    """
    overrides, choice = _job_overrides(overrides)
    method_file = method_file or f"conf/method/{choice or _method_name(cfg)}.yaml"
    _refuse_old_forms(cfg)
    _route_init(cfg, method_file)
    blocks = cfg.get("method_overrides")
    if blocks is not None and "method" in cfg:
        known = _method_config_names()
        for name in blocks:
            if str(name) not in known:
                raise ConfigError(f"names no method config (conf/method/{name}.yaml does not exist)",
                                  field=f"method_overrides.{name}")
        chosen = blocks.get(_method_name(cfg))
        if chosen is not None:
            cli = [_override_key(o) for o in overrides]
            for path, value in _leaves(chosen):
                _check_knob(cfg.method, path, method_file)
                if any(_overlaps(f"method.{path}", k) for k in cli if k.startswith("method.")):
                    continue  # the command line set it (or a block around it)
                OmegaConf.update(cfg.method, path, value, merge=False, force_add=True)
    if "method_overrides" in cfg:
        with open_dict(cfg):
            del cfg["method_overrides"]  # what runs is `method`; the block would only mislead records
    return cfg


def compose_train_config(overrides: list[str], config_name: str = "train") -> DictConfig:
    """The real ``conf/`` composed with ``overrides`` (outside a Hydra app), prepared as the entry points
    prepare theirs (``configs.prepare_config``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    refuse_retired_overrides(list(overrides))
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name=config_name, overrides=list(overrides))
    else:
        with initialize_config_dir(config_dir=config_dir(), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
    return prepare_config(cfg, overrides=list(overrides))


def _job_overrides(overrides: list[str] | None) -> tuple[list[str], str | None]:
    """The command-line overrides and the ``method`` group choice of the running Hydra job, where there is one."""
    from hydra.core.hydra_config import HydraConfig

    if overrides is None and HydraConfig.initialized():
        hc = HydraConfig.get()
        return list(hc.overrides.task), hc.runtime.choices.get("method")
    # Given explicitly (a composition outside the Hydra app): the choice, if any, is among them.
    choice = next((o.split("=", 1)[1] for o in overrides or () if o.split("=", 1)[0] == "method"), None)
    return list(overrides or ()), choice


def _method_name(cfg: DictConfig) -> str:
    return str(OmegaConf.select(cfg, "method.name", default=""))


def _method_config_names() -> set[str]:
    return {p.stem for p in (Path(config_dir()) / "method").glob("*.yaml")}


def _override_key(text: str) -> str:
    return text.split("=", 1)[0].lstrip("+~").strip()


def _overlaps(a: str, b: str) -> bool:
    """One dotted path is the other or lies inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _leaves(node, prefix: str = ""):
    """``(dotted path, value)`` for every setting of an overrides block; a mapping is descended into, so a
    block sets only the knobs it names and keeps the method's others."""
    for key, value in node.items_ex(resolve=False):
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(value) and len(value) > 0:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _check_knob(method: DictConfig, path: str, method_file: str) -> None:
    """``ConfigError`` unless ``path`` names a setting of the method config (a knob it has)."""
    parent, _, key = path.rpartition(".")
    node = OmegaConf.select(method, parent, default=None) if parent else method
    if OmegaConf.is_dict(node) and key in node:
        return
    # A plain settings block inside a method (no _target_, not a nested method config) may gain keys: it is a
    # set of changes read as a whole (Draft-OPD's rollout_drafter: the evaluated drafter's knobs to change).
    if parent and OmegaConf.is_dict(node) and "_target_" not in node and "name" not in node:
        return
    have = ", ".join(sorted(map(str, node.keys()))) if OmegaConf.is_dict(node) else "no such block"
    raise ConfigError(f"the method has no knob '{path}' ({parent or 'the method'}: {have})", file=method_file,
                      field=f"method_overrides.{path}")


def _route_init(cfg: DictConfig, method_file: str) -> None:
    """``init.from``, the one spelling of "start from a trained draft", becomes the ``draft.init.from`` of the
    draft the method trains (its own, or its student's for a method that trains another's, as Draft-OPD).

    Set by interpolation, so a required start (``init.from: ???`` in an experiment) fails by that name when the
    config resolves, and the training key holds the path as before. Nothing trains under ``draft_path``
    (an existing draft is evaluated), so there the setting is not read."""
    if "init" not in cfg or "method" not in cfg or cfg.get("draft_path"):
        return
    missing = OmegaConf.is_missing(cfg.init, "from")
    if not missing and cfg.init.get("from") is None:
        return
    owner = "method.student" if OmegaConf.select(cfg, "method.student") is not None else "method"
    if OmegaConf.select(cfg, f"{owner}.draft") is None:
        raise ConfigError(f"method '{_method_name(cfg)}' trains no draft to start from ({method_file})",
                          field="init.from")
    here = OmegaConf.select(cfg, f"{owner}.draft.init.from", default=None, throw_on_missing=False)
    if here is not None and (missing or str(here) != str(cfg.init["from"])):
        raise ConfigError(f"contradicts {owner}.draft.init.from={here}: give the start draft once, as init.from",
                          field="init.from")
    OmegaConf.update(cfg, f"{owner}.draft.init.from", "${init.from}", merge=False, force_add=True)


# Settings renamed so that each concept has one name (README "Glossary"): (pattern of the dotted setting,
# what to write instead). A retired spelling is refused with one line naming the new one, wherever it appears:
# on the command line, in an experiment file or in a method_overrides block.
RETIRED: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(drafter|rollout_drafter|chain)\.total_tokens$", "a tree's size is 'nodes' (drafter.nodes)"),
    (r"(^|\.)(drafter|rollout_drafter|chain)\.top_k$", "a tree's width is 'branching' (drafter.branching); top_k is sampling only"),
    (r"^eval\.top_k_sampling$", "sampling top-k is eval.top_k"),
    (r"^eval\.others$", "comparison drafters are eval.baselines"),
    (r"^init_draft$|(^|\.)draft\.init_from$", "start from a trained draft with init.from=DIR"),
)


def refuse_retired(key: str) -> None:
    """``ConfigError`` naming the new spelling when the dotted setting ``key`` is a retired one."""
    import re

    for pattern, instead in RETIRED:
        if re.search(pattern, key):
            raise ConfigError(f"retired spelling: {instead}", field=key)


def refuse_retired_overrides(overrides: list[str]) -> None:
    """:func:`refuse_retired` for command-line overrides (``key=value``, ``+key=value``, ``~key``), checked before
    Hydra composes them: a setting the configs no longer declare would otherwise fail as "not in struct"."""
    for text in overrides:
        if text.startswith("-") or ("=" not in text and not text.startswith("~")):
            continue  # a flag (-m, --cfg job) or a bare argument
        refuse_retired(_override_key(text).split("@", 1)[0])


def _setting_paths(node, prefix: str = ""):
    """Every dotted setting path of a config (mappings descended, interpolations left unresolved); the
    ``method_overrides`` blocks are reported as the ``method.*`` paths they set."""
    if not OmegaConf.is_dict(node):
        return
    for key, value in node.items_ex(resolve=False):
        path = f"{prefix}{key}"
        if not prefix and key == "method_overrides" and OmegaConf.is_dict(value):
            for block in value.values():
                yield from _setting_paths(block, "method.")
            continue
        yield path
        yield from _setting_paths(value, path + ".")


def _refuse_old_forms(cfg: DictConfig) -> None:
    for path in _setting_paths(cfg):
        refuse_retired(path)
    sources = OmegaConf.select(cfg, "data.sources", default=None, throw_on_missing=False)
    if OmegaConf.is_list(sources):
        raise ConfigError("is a list; sources are a mapping keyed by name now: data.sources.<name>: {path, format, "
                          "limit, ...}", field="data.sources")
