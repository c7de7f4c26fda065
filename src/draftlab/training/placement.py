"""The frozen target beside the module it trains: on the device the strategy trains on.

A training module holds its target as a plain attribute (``self.target``), not as a submodule: the target is
not trained, so it stays out of checkpoints and out of the DDP / FSDP wrapper. For the same reason Lightning
does not move it with the module, and a draft trained on ``cuda:1`` would meet a target left wherever it was
built (the CPU, or ``cuda:0`` on every rank). This callback moves it when the fit sets up, for any method whose
module has a ``target``; in ``ddp_spawn`` processes that is the only code that runs before training.
"""

from __future__ import annotations

import lightning as L
import torch

from draftlab.nn.placement import same_device
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


class TargetPlacement(L.Callback):
    """Moves ``pl_module.target`` (when the module has one) to ``trainer.strategy.root_device`` at setup."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        target = getattr(pl_module, "target", None)
        if target is None:
            return
        device = torch.device(trainer.strategy.root_device)
        current = getattr(target, "device", None)
        if current is not None and same_device(current, device):
            return
        move = getattr(target, "to", None)
        if not callable(move):
            raise RuntimeError(f"the target is on {current} but training runs on {device}, and a "
                               f"{type(target).__name__} cannot be moved: set target.device={device.type}")
        log.info("target moved from %s to %s for training", current, device)
        moved = move(device)
        if moved is not None and moved is not target:  # a copy rather than an in-place move
            pl_module.target = moved

