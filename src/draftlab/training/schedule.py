"""Learning-rate schedules as ``_partial_`` config components, and the optimiser wiring every module shares.

A method's ``module`` block names its schedule like its optimiser::

    optimizer: {_target_: torch.optim.AdamW, _partial_: true, lr: 1.0e-4}
    schedule: {_target_: draftlab.training.schedule.warmup_cosine, _partial_: true, warmup_ratio: 0.015}

and its ``configure_optimizers`` is one call: ``return configure(self, params, self.optimizer_factory,
self.schedule_factory, self.total_steps)``. A schedule factory takes ``(optimizer, total_steps=)`` and
returns a per-step ``torch.optim.lr_scheduler.LRScheduler``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch


def cosine_with_warmup(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warm-up from 0 to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float = 0.015,
                  min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_ratio`` of the run's steps, then cosine decay to ``min_ratio`` (EAGLE,
    SpecForge, DFlash all train this way)."""
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
    warmup = int(round(warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(cosine_with_warmup, warmup_steps=warmup, total_steps=total_steps, min_ratio=min_ratio))


def constant(optimizer: torch.optim.Optimizer, *, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """No schedule (the optimiser's learning rate throughout)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


ScheduleFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


def _takes_named_params(factory) -> bool:
    """Whether ``factory`` (or the function a Hydra ``_partial_`` wraps) wants ``(name, param)`` pairs: an
    optimiser that treats parameters by name, such as ``optim.muon_adamw``."""
    return bool(getattr(factory, "takes_named_params", False)
                or getattr(getattr(factory, "func", None), "takes_named_params", False))


def named_params(module, params) -> list:
    """``params`` (tensors, or param groups of them), in order, with each tensor as its ``(name, tensor)`` in
    ``module.named_parameters()``."""
    names = {id(p): name for name, p in module.named_parameters()}

    def named(p):
        if id(p) not in names:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} given to the optimiser is not among "
                             f"{type(module).__name__}.named_parameters(), so it has no name to be split by")
        return names[id(p)], p

    return [{**g, "params": [named(p) for p in g["params"]]} if isinstance(g, dict) else named(g)
            for g in params]


def configure(module, params, optimizer_factory, schedule_factory: ScheduleFactory | None,
              total_steps: int | None = None) -> dict:
    """What ``LightningModule.configure_optimizers`` returns: the optimiser over ``params`` (parameters or
    param groups; named, see :func:`named_params`, for a factory with ``takes_named_params``) and the schedule
    stepped every optimiser step over the run's ``total_steps`` (default: the trainer's estimate)."""
    if optimizer_factory is None:
        # The optimiser and its defaults live in the method config only (conf/method/<m>.yaml module.optimizer).
        from draftlab.utils.errors import ConfigError

        raise ConfigError("no optimizer: the method config's module block sets one (e.g. torch.optim.AdamW, "
                          "_partial_: true)", field="method.module.optimizer")
    if _takes_named_params(optimizer_factory):
        params = named_params(module, params)
    opt = optimizer_factory(params)
    total = total_steps or int(module.trainer.estimated_stepping_batches)
    schedule_factory = schedule_factory or warmup_cosine
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule_factory(opt, total_steps=total), "interval": "step"}}
