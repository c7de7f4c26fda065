"""Thin Hydra entry points. Configs live in the repository's top-level ``conf/`` directory."""

from __future__ import annotations

import os

from draftlab.configs import config_dir  # noqa: F401  (the entry points and users read it here)


def report_user_errors(task):
    """Wrap a Hydra task function: the config is prepared first (``configs.prepare_config``: the experiment's
    tuning checked against the selected method, ``init.from`` routed, ``trust_checkpoint`` applied); a ``UserError`` (and an unread
    appended setting, checked next) becomes
    ``error: <file>[:line]: <field>: <what>`` on stderr and exit code 2; ``DRAFTLAB_DEBUG=1`` re-raises
    with the traceback. Any other exception is a bug and keeps its traceback."""
    import functools
    import sys

    from draftlab.configs import prepare_config
    from draftlab.training.checkpoint import trust_checkpoints
    from draftlab.utils.errors import UserError

    @functools.wraps(task)
    def run(cfg):
        try:
            prepare_config(cfg)
            reject_unread_appends(cfg)
            trust_checkpoints(bool(cfg.get("trust_checkpoint", False)))
            return task(cfg)
        except UserError as e:
            if os.environ.get("DRAFTLAB_DEBUG") == "1":
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return run


def reject_unread_appends(cfg, overrides: list[str] | None = None) -> None:
    """``ConfigError`` for an appended key (``+a.b=v``) that nothing reads.

    Hydra's ``+`` adds a key the configs do not have. Under a block that is instantiated (one with a
    ``_target_``, e.g. ``trainer``, a method's ``module``) the new key becomes a constructor argument and
    is read; anywhere else draftlab reads only the keys its configs declare, so an appended one would be
    silently ignored (while still changing the run's content keys). ``+group=option`` appends a config
    group choice and is fine. ``overrides`` default to the running Hydra job's.
    """
    from omegaconf import OmegaConf

    from draftlab.utils.errors import ConfigError

    choices: dict = {}
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return
        hc = HydraConfig.get()
        overrides, choices = list(hc.overrides.task), dict(hc.runtime.choices)
    for text in overrides:
        if not text.startswith("+") or text.startswith("++"):
            continue
        key = text[1:].split("=", 1)[0].strip()
        if key in choices or key.split("@", 1)[0] in choices:
            continue
        parts = key.split(".")
        read = False
        for i in range(len(parts) - 1, 0, -1):
            node = OmegaConf.select(cfg, ".".join(parts[:i]), default=None)
            if OmegaConf.is_dict(node) and "_target_" in node:
                read = True
                break
        if read:
            continue
        parent = ".".join(parts[:-1])
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        known = sorted(k for k in node.keys() if k != parts[-1]) if OmegaConf.is_dict(node) else []
        hint = f"; the settings under '{parent or '<root>'}' are: {', '.join(map(str, known))}" if known else ""
        raise ConfigError(f"appended setting '{text}' is read by nothing (a typo?){hint}", field=key)
