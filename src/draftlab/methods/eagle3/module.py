"""EAGLE-3 training as a LightningModule: training-time test over a frozen target, online or offline.

Feature modes (chosen per batch by what the batch holds):

- **online**: the batch holds tokens only; the frozen target runs inside the step under ``no_grad`` and
  yields the aux hidden states and logits;
- **offline**: the batch also holds ``aux_hidden`` and ``last_hidden`` read from a feature store
  (``features.py``); logits are ``last_hidden @ lm_head.T`` with the target's LM head, which the module
  keeps as a non-persistent buffer. The two modes give the same loss (tested).

Checkpoints hold the draft only: the target is a plain attribute (never registered), the LM head buffer
is non-persistent, and the frozen embedding copy is dropped on save and restored from the target on
load. ``eagle3_config`` is stored next to the weights so a checkpoint can be exported on its own.

Metrics: ``train/loss``, ``train/ploss_k``, ``train/acc_k``, ``train/cond_acc_k``,
``train/acceptance_rate_k`` per step; validation aggregates numerators and denominators over the
whole split (and across ranks) before dividing, then reports ``val/simulated_tau`` = 1 + Σ_k Π_{j≤k}
cond_acc_j (expected tokens per verify round of a greedy chain, bonus included) and SpecForge's
``val/simulated_acc_len`` = Σ_k Π_{j≤k} acc_j. The best checkpoint is chosen on ``val/simulated_tau``.
"""

from __future__ import annotations

import math
import random
from functools import partial
from typing import Any

import lightning as L
import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.methods.eagle3.ttt import NORMALIZATIONS, simulated_tau, ttt_forward

_EMBED_KEY = "draft.embed_tokens.weight"
_SUMMED = ("correct", "count", "cond_correct", "cond_count", "accept_sum", "loss_sum", "loss_denom")


def cosine_with_warmup(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warm-up from 0 to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Eagle3Module(L.LightningModule):
    """Trains an :class:`Eagle3Draft` with TTT against a frozen target (see the module docstring).

    draft          the draft (embedding already copied from the target, vocab mapping installed).
    target         a ``draftlab.targets.Target`` for online batches (and the LM head of offline ones);
                   may be None when every batch is offline and ``target_lm_head`` is given.
    ttt_length     K unrolled steps; ``step_weight`` ** k weights step k; ``normalization`` is
                   ``batch_tokens`` (EAGLE/SpecForge) or ``mask_sum`` (speculators).
    optimizer      a partial ``torch.optim`` constructor (Hydra ``_partial_: true``); default AdamW(1e-4,
                   betas (0.9, 0.95), wd 0) as SpecForge/EAGLE.
    warmup_ratio   fraction of the run's optimiser steps spent in linear warm-up before cosine decay.
    """

    def __init__(self, draft: Eagle3Draft, target=None, *, ttt_length: int = 7, step_weight: float = 0.8,
                 normalization: str = "batch_tokens", optimizer=None, warmup_ratio: float = 0.015,
                 min_lr_ratio: float = 0.0, total_steps: int | None = None,
                 target_lm_head: torch.Tensor | None = None, naive_attention: bool = False):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got '{normalization}'")
        self.draft = draft
        self.target = target  # not an nn.Module: never in state_dict, never wrapped by DDP/FSDP
        self.ttt_length = ttt_length
        self.step_weight = step_weight
        self.normalization = normalization
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
        self.warmup_ratio = warmup_ratio
        self.min_lr_ratio = min_lr_ratio
        self.total_steps = total_steps
        self.naive_attention = naive_attention
        if target_lm_head is None and target is not None:
            target_lm_head = target.model.get_output_embeddings().weight.detach()
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)  # [V, d] or None
        self._val_sums: list[dict[str, torch.Tensor]] | None = None
        self.save_hyperparameters(ignore=["draft", "target", "target_lm_head", "optimizer"])

    # ---- features --------------------------------------------------------------------------------------

    def target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux_hidden [B, T, 3*d_t], target_logits [B, T, V])`` from the batch or from the frozen target."""
        if "aux_hidden" in batch:
            if self.target_lm_head is None:
                raise RuntimeError("offline batch but no target LM head: pass target or target_lm_head")
            last = batch["last_hidden"].to(self.target_lm_head.dtype)  # [B, T, d]
            return batch["aux_hidden"], last @ self.target_lm_head.T  # [B, T, V]
        if self.target is None:
            raise RuntimeError("online batch (tokens only) but the module has no target")
        with torch.no_grad():
            # Right padding + causal attention: padded rows never reach real ones, as in the offline store.
            out = self.target.forward(batch["input_ids"], return_aux=True,
                                      aux_layer_ids=self.draft.tapped_layers(self.target))
        return out.aux_hidden, out.logits

    def _ttt(self, batch: dict[str, torch.Tensor]):
        aux, logits = self.target_features(batch)
        return ttt_forward(self.draft, batch["input_ids"], aux, logits, batch["loss_mask"], batch["attention_mask"],
                           ttt_length=self.ttt_length, step_weight=self.step_weight,
                           normalization=self.normalization, naive=self.naive_attention)

    # ---- steps -----------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self._ttt(batch)
        bs = batch["input_ids"].shape[0]
        logs = {"train/loss": out.loss.detach()}
        for k, s in enumerate(out.per_step):
            logs[f"train/ploss_{k}"] = s["loss"].detach()
            logs[f"train/acc_{k}"] = s["acc"]
            logs[f"train/cond_acc_{k}"] = s["cond_acc"]
            logs[f"train/acceptance_rate_{k}"] = s["acceptance_rate"]
        self.log_dict(logs, batch_size=bs, prog_bar=False)
        self.log("train/acc_0_bar", out.per_step[0]["acc"], batch_size=bs, prog_bar=True, logger=False)
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = None

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self._ttt(batch)
        sums = [{name: s[name].detach().double() for name in _SUMMED} for s in out.per_step]
        if self._val_sums is None:
            self._val_sums = sums
        else:
            for acc, new in zip(self._val_sums, sums):
                for name in _SUMMED:
                    acc[name] = acc[name] + new[name]

    def on_validation_epoch_end(self) -> None:
        if self._val_sums is None:
            return
        # Sum numerators and denominators across ranks, then divide (averaging ratios would be wrong).
        stacked = torch.stack([torch.stack([s[n] for n in _SUMMED]) for s in self._val_sums])  # [K, 7]
        stacked = self.trainer.strategy.reduce(stacked.to(self.device), reduce_op="sum").cpu()
        logs, acc, cond = {}, [], []
        total = 0.0
        for k, row in enumerate(stacked.tolist()):
            s = dict(zip(_SUMMED, row))
            acc.append(s["correct"] / max(1.0, s["count"]))
            cond.append(s["cond_correct"] / max(1.0, s["cond_count"]))
            ploss = s["loss_sum"] / max(1e-12, s["loss_denom"])
            total += self.step_weight ** k * ploss
            logs[f"val/acc_{k}"] = acc[-1]
            logs[f"val/cond_acc_{k}"] = cond[-1]
            logs[f"val/acceptance_rate_{k}"] = s["accept_sum"] / max(1.0, s["count"])
            logs[f"val/ploss_{k}"] = ploss
        logs["val/loss"] = total
        logs["val/simulated_tau"] = simulated_tau(cond)
        logs["val/simulated_acc_len"] = simulated_tau(acc, include_bonus=False)
        self.log_dict({k: float(v) for k, v in logs.items()}, sync_dist=False)
        self._val_sums = None

    # ---- optimisation ----------------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        opt = self.optimizer_factory(params)
        total = self.total_steps or int(self.trainer.estimated_stepping_batches)
        warmup = int(round(self.warmup_ratio * total))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, partial(cosine_with_warmup, warmup_steps=warmup, total_steps=total, min_ratio=self.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints: draft only, plus what a bit-exact resume needs -----------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"].pop(_EMBED_KEY, None)
        checkpoint["eagle3_config"] = self.draft.config.to_dict()
        checkpoint["rng_states"] = {"torch": torch.get_rng_state(), "python": random.getstate()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("eagle3_config")
        if saved is not None and Eagle3Config.from_dict(saved) != self.draft.config:
            raise ValueError("checkpoint was trained with a different draft config:\n"
                             f"  checkpoint: {saved}\n  this run:   {self.draft.config.to_dict()}")
        # The embedding is the target's, copied at construction; put it back so strict loading passes.
        checkpoint["state_dict"][_EMBED_KEY] = self.draft.embed_tokens.weight.detach().clone()
        rng = checkpoint.get("rng_states")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])


def draft_state_dict(module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft's own keys (``draft.`` prefix removed) from a module or checkpoint state dict."""
    return {k.removeprefix("draft."): v for k, v in module_state.items() if k.startswith("draft.")}
