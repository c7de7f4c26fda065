"""The one step every entry point runs on a composed config before anything reads it.

A method's knobs live in ``conf/method/<m>.yaml``, an experiment's other values for it in its tuning
(``conf/tuning/<name>/<method>.yaml``, merged by Hydra after the method's file: ``conf/train.yaml``).
:func:`prepare_config` adds the one check Hydra cannot make: a tuning names only knobs the method has (a typo
would otherwise be an unknown keyword deep inside a constructor).
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from draftlab.utils.conf import config_dir, method_name, tuning_settings
from draftlab.utils.errors import ConfigError


def prepare_config(cfg: DictConfig, *, overrides: list[str] | None = None, choices: dict | None = None) -> DictConfig:
    """Check the selected tuning against the method and route ``init.from``; returns ``cfg``. ``overrides`` /
    ``choices``: the command line and the group choices it led to (default: the running Hydra job's)."""
    if choices is None:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get() if HydraConfig.initialized() else None
        overrides = list(hc.overrides.task) if hc else list(overrides or ())
        choices = dict(hc.runtime.choices) if hc else {}
    tuning, choice = choices.get("tuning"), choices.get("method") or OmegaConf.select(cfg, "method.name", default="")
    if tuning not in (None, "none") and "method" in cfg:
        folder = Path(config_dir()) / "tuning" / str(tuning)
        if not folder.is_dir():
            raise ConfigError(f"no tuning '{tuning}' (conf/tuning/{tuning}/ does not exist)", field="tuning")
        if (folder / f"{method_name(choice)}.yaml").exists():  # its knobs against the method's own
            own = tuple(o for o in overrides if o.split("=")[0].lstrip("+~").startswith(("method.", "method@method")))
            _check_knobs(tuning_settings(str(tuning), method_name(choice)), _own_method(config_dir(), str(choice), own),
                         f"conf/tuning/{tuning}/{method_name(choice)}.yaml")
    _route_init(cfg, f"conf/method/{choice}.yaml")
    _route_training_choices(cfg, f"conf/method/{choice}.yaml")
    return cfg


def compose_train_config(overrides: list[str], config_name: str = "train", *, prepare: bool = True) -> DictConfig:
    """The real ``conf/`` composed with ``overrides`` (outside a Hydra app or inside one), prepared as the entry points
    prepare theirs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def composed():
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg, choices

    if GlobalHydra.instance().is_initialized():
        cfg, choices = composed()
    else:
        with initialize_config_dir(config_dir=config_dir(), version_base=None):
            cfg, choices = composed()
    if prepare:
        prepare_config(cfg, overrides=list(overrides), choices=choices)
    return cfg


@functools.lru_cache(maxsize=64)
def _own_method(conf: str, choice: str, overrides: tuple[str, ...]) -> DictConfig:
    """The method config ``choice`` with the command line's method settings, without any tuning (read only)."""
    return compose_train_config([f"method={choice}", "tuning=none", *overrides], prepare=False).method


def _check_knobs(tuned: DictConfig, plain: DictConfig, file: str, prefix: str = "") -> None:
    """``ConfigError`` for the first setting of ``tuned`` (a tuning's) that ``plain`` (the method's own) lacks."""
    for key, value in tuned.items_ex(resolve=False):
        path = f"{prefix}{key}"
        if key not in plain:
            have = ", ".join(sorted(map(str, plain.keys())))
            raise ConfigError(f"the method has no knob '{path}' ({prefix.rstrip('.') or 'the method'}: {have})",
                              file=file, field=path)
        sub = plain[key] if OmegaConf.is_dict(plain) else None
        # A plain settings block (no _target_, not a nested method) is a set of changes read as a whole and may
        # gain keys (Draft-OPD's rollout_drafter: the evaluated drafter's knobs to change).
        if OmegaConf.is_dict(value) and OmegaConf.is_dict(sub) and ("_target_" in sub or "name" in sub):
            _check_knobs(value, sub, file, path + ".")


# Top-level choices (conf/<group>) that belong in the module block of the method that trains the draft, and whether
# the choice replaces that block's entry (the loss) or is merged into it (the optimiser keeps the method's lr, betas).
_MODULE_CHOICES = {"loss": False, "optimizer": True}


def _route_training_choices(cfg: DictConfig, method_file: str) -> None:
    """``loss=<name>`` / ``optimizer=<name>`` become ``module.loss`` / are merged into ``module.optimizer`` of the
    module that trains: the method's own, or its base's for a method that trains another's draft (SSD on
    EAGLE-3). Routed once: the top-level entry is removed, so the method config (and the training key) holds it."""
    for key, merge in _MODULE_CHOICES.items():
        if key not in cfg or cfg.get(key) is None or "method" not in cfg:
            continue
        own = OmegaConf.select(cfg, "method.module._target_", default=None) is not None
        owner = "method.module" if own else "method.base.module"
        if not OmegaConf.select(cfg, "method.trainable", default=False) or \
                OmegaConf.select(cfg, f"{owner}._target_", default=None) is None:
            raise ConfigError(f"method '{OmegaConf.select(cfg, 'method.name')}' trains no draft: {key}= does not "
                              f"apply ({method_file})", field=key)
        node = cfg[key]
        if merge and OmegaConf.select(cfg, f"{owner}.{key}") is not None:
            # a plain copy of the method's block (the composed config is in struct mode: no new keys)
            node = OmegaConf.merge(OmegaConf.to_container(OmegaConf.select(cfg, f"{owner}.{key}")), node)
        OmegaConf.update(cfg, f"{owner}.{key}", node, merge=False, force_add=True)
        with open_dict(cfg):
            del cfg[key]


def _route_init(cfg: DictConfig, method_file: str) -> None:
    """``init.from``, the one spelling of "start from a trained draft", becomes the ``draft.init.from`` of the
    draft the method trains (its own, or its base's for a method that trains another's, as Draft-OPD).

    Set by interpolation, so a required start (``init.from: ???`` in an experiment) fails by that name when the
    config resolves, and the training key holds the path as before. Nothing trains under ``draft_path``
    (an existing draft is evaluated), so there the setting is not read."""
    if "init" not in cfg or "method" not in cfg or cfg.get("draft_path"):
        return
    missing = OmegaConf.is_missing(cfg.init, "from")
    if not missing and cfg.init.get("from") is None:
        return
    owner = "method.base" if OmegaConf.select(cfg, "method.base") is not None else "method"
    if OmegaConf.select(cfg, f"{owner}.draft") is None:
        raise ConfigError(f"method '{OmegaConf.select(cfg, 'method.name')}' trains no draft to start from ({method_file})",
                          field="init.from")
    here = OmegaConf.select(cfg, f"{owner}.draft.init.from", default=None, throw_on_missing=False)
    if here is not None and (missing or str(here) != str(cfg.init["from"])):
        raise ConfigError(f"contradicts {owner}.draft.init.from={here}: give the start draft once, as init.from",
                          field="init.from")
    OmegaConf.update(cfg, f"{owner}.draft.init.from", "${init.from}", merge=False, force_add=True)
