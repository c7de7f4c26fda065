"""DFlash2 training: DFlash's block loss plus the selector's (``selector_loss.py``), with a warm-up and ramp.

The total loss is ``dflash + w(step) * selector`` with ``w = 0`` for ``selector_warmup_steps`` optimiser
steps, then rising linearly to ``selector_weight`` over ``selector_ramp_steps`` (PROPOSAL: the schedule's
shape is not published; SpecForge's DFlash2 trainer exposes a weight with warm-up and ramp, and NeMo reports
the selector overtaking the unary ranking only after a few hundred steps).

Logged beside DFlash's metrics: ``train/selector_loss``, ``train/unary_top_k_recall`` (gold among the K
candidates), ``train/selector_acc`` (the selector's pick right, among those); validation adds
``val/unary_top_k_recall``, ``val/selector_acc``, ``val/selector_simulated_tau`` (the greedy selector
chain's expected tokens per round) and ``val/selector_tau_gap`` (that minus ``val/simulated_tau``, the
unary chain's).
"""

from __future__ import annotations

import torch

from draftlab.methods.dflash.blocks import block_states, make_blocks, slot_logits
from draftlab.methods.dflash.module import DFlashModule
from draftlab.methods.dflash2.selector_loss import SELECTOR_SUMMED, selector_loss
from draftlab.nn import simulated_tau


class DFlash2Module(DFlashModule):
    """Trains a :class:`DFlash2Draft` (see the module docstring); every other knob is DFlash's.

    selector_weight        the selector loss's weight after the ramp.
    selector_warmup_steps  optimiser steps with weight 0 (the unary head settles first).
    selector_ramp_steps    steps of the linear rise to ``selector_weight`` (0: a step).
    selector_detach        train the selector on detached logits / states (the backbone sees the DFlash loss only).
    """

    def __init__(self, draft, target=None, *, selector_weight: float = 1.0, selector_warmup_steps: int = 0,
                 selector_ramp_steps: int = 0, selector_detach: bool = True, **dflash):
        super().__init__(draft, target, **dflash)
        self.selector_weight = float(selector_weight)
        self.selector_warmup_steps = int(selector_warmup_steps)
        self.selector_ramp_steps = int(selector_ramp_steps)
        self.selector_detach = bool(selector_detach)
        self._selector = None
        self._selector_val: dict[str, torch.Tensor] | None = None

    def selector_weight_at(self, step: int) -> float:
        """The selector loss's weight at optimiser step ``step``."""
        if step < self.selector_warmup_steps:
            return 0.0
        if self.selector_ramp_steps <= 0:
            return self.selector_weight
        return self.selector_weight * min(1.0, (step - self.selector_warmup_steps + 1) / self.selector_ramp_steps)

    def block_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None):
        c = self.draft.config
        aux = self.target_features(batch)
        blocks = make_blocks(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], block_size=c.block_size,
                             mask_token_id=c.mask_token_id, num_anchors=self.num_anchors, generator=generator)
        states = block_states(self.draft, aux, blocks)  # [B, A, bs-1, d]
        logits = slot_logits(self.draft, states)  # [B, A, bs-1, V]
        out = self.slot_loss(logits, blocks, batch)
        self._selector = selector_loss(self.draft, states, logits, blocks, detach=self.selector_detach)
        w = self.selector_weight_at(self.global_step)
        if w > 0:
            out.loss = out.loss + w * self._selector.loss
        return out

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        s = self._selector.sums
        hits = s["top_k_hits"].sum()
        self.log_dict({"train/selector_loss": self._selector.loss.detach(),
                       "train/selector_weight": float(self.selector_weight_at(self.global_step)),
                       "train/unary_top_k_recall": (hits / s["labelled"].sum().clamp_min(1.0)).float(),
                       "train/selector_acc": (s["picked"].sum() / hits.clamp_min(1.0)).float()},
                      batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        sums = self._selector.sums
        prev = self._selector_val
        self._selector_val = sums if prev is None else {k: prev[k] + v for k, v in sums.items()}

    def on_validation_epoch_end(self) -> None:
        if self._selector_val is not None and self._val is not None:
            K = self._selector_val["labelled"].numel()
            parts = [self._selector_val[n] for n in SELECTOR_SUMMED] + [self._val["cond_correct"], self._val["cond_count"]]
            # Numerators and denominators summed across ranks before dividing, as DFlash's metrics are.
            flat = self.trainer.strategy.reduce(torch.cat(parts).to(self.device), reduce_op="sum").cpu()
            got = dict(zip([*SELECTOR_SUMMED, "cond_correct", "cond_count"], flat.view(-1, K)))
            hits = got["top_k_hits"].sum()
            selector_tau = simulated_tau((got["chain_cond_correct"] / got["chain_cond_count"].clamp_min(1.0)).tolist())
            unary_tau = simulated_tau((got["cond_correct"] / got["cond_count"].clamp_min(1.0)).tolist())
            self.log_dict({"val/unary_top_k_recall": float(hits / got["labelled"].sum().clamp_min(1.0)),
                           "val/selector_acc": float(got["picked"].sum() / hits.clamp_min(1.0)),
                           "val/selector_simulated_tau": selector_tau,
                           "val/selector_tau_gap": selector_tau - unary_tau}, sync_dist=False)
        self._selector_val = None
        super().on_validation_epoch_end()

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._selector_val = None
