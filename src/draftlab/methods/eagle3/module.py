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

The module is EAGLE-3's target features on top of ``ttt_training.TTTTraining`` (the unrolled loss's settings,
the Lightning steps, train/val logging with the best checkpoint chosen on ``val/simulated_tau``, the
``_partial_`` optimiser and schedule), plus the frozen-embedding checkpoint helpers below, which ConFu takes too.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.methods.eagle3.ttt_training import TTTTraining
from draftlab.targets.base import PassRequest

_EMBED_KEY = "draft.embed_tokens.weight"


class Eagle3Module(TTTTraining):
    """Trains an :class:`Eagle3Draft` with TTT against a frozen target (see the module docstring).

    draft           the draft (embedding already copied from the target, vocab mapping installed).
    target          a ``draftlab.targets.Target`` for online batches (and the LM head of offline ones);
                    may be None when every batch is offline and ``target_lm_head`` is given.
    **ttt           the TTT settings, optimiser and schedule (``ttt_training.TTTTraining``).
    """

    def __init__(self, draft: Eagle3Draft, target=None, *, target_lm_head: torch.Tensor | None = None, **ttt):
        super().__init__(draft, target, **ttt)
        self.register_buffer("target_lm_head", lm_head_weight(target, target_lm_head), persistent=False)
        self.save_hyperparameters(ignore=["draft", "target", "target_lm_head", "optimizer", "schedule"])

    # ---- features --------------------------------------------------------------------------------------

    def target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux_hidden [B, T, 3*d_t], target_logits [B, T, V])`` from the batch or from the frozen target."""
        if "aux_hidden" in batch:
            if self.target_lm_head is None:
                raise RuntimeError("offline batch but no target LM head: pass target or target_lm_head")
            last = batch["last_hidden"].to(self.target_lm_head.dtype)  # [B, T, d]
            # The target's distribution stays in its own precision under bf16 autocast (trainer.precision):
            # only the draft's passes are mixed.
            with torch.autocast(last.device.type, enabled=False):
                return batch["aux_hidden"], last @ self.target_lm_head.T  # [B, T, V]
        if self.target is None:
            raise RuntimeError("online batch (tokens only) but the module has no target")
        with torch.no_grad():
            # Right padding + causal attention: padded rows never reach real ones, as in the offline store.
            with torch.autocast(batch["input_ids"].device.type, enabled=False):
                out = self.target.forward(batch["input_ids"],
                                          request=PassRequest(aux=self.draft.taps(self.target)))
        return out.aux_hidden, out.logits

    def loss(self, batch: dict[str, torch.Tensor]):
        """The TTT output (loss + per-step statistics) of ``batch``."""
        aux, logits = self.target_features(batch)
        return self.ttt(self.draft, batch["input_ids"], aux, logits, batch["loss_mask"], batch["attention_mask"])

    # ---- checkpoints: draft only, plus what a bit-exact resume needs -----------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_draft_checkpoint(checkpoint, "eagle3_config", self.draft.config.to_dict())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_draft_checkpoint(checkpoint, "eagle3_config", self.draft, Eagle3Config)


# ---- pieces other TTT-trained modules compose ------------------------------------------------------------


def lm_head_weight(target, given: torch.Tensor | None = None) -> torch.Tensor | None:
    """The target's LM head ``[V, d]`` (detached) for offline batches, or ``given``, or None."""
    if given is None and target is not None:
        given = target.model.get_output_embeddings().weight.detach()
    return given


def save_draft_checkpoint(checkpoint: dict[str, Any], config_key: str, config: dict) -> None:
    """Drop the frozen target-embedding copy, store the draft config under ``config_key`` and the RNG states."""
    checkpoint["state_dict"].pop(_EMBED_KEY, None)
    checkpoint[config_key] = config
    checkpoint["rng_states"] = {"torch": torch.get_rng_state(), "python": random.getstate()}


def load_draft_checkpoint(checkpoint: dict[str, Any], config_key: str, draft, config_cls) -> None:
    """Refuse a checkpoint of another draft config, put the frozen embedding back, restore the RNG states."""
    saved = checkpoint.get(config_key)
    if saved is not None and config_cls.from_dict(saved) != draft.config:
        what = config_cls.__name__.removesuffix("Config")
        raise ValueError(f"checkpoint was trained with a different {what} draft config:\n"
                         f"  checkpoint: {saved}\n  this run:   {draft.config.to_dict()}")
    # The embedding is the target's, copied at construction; put it back so strict loading passes.
    checkpoint["state_dict"][_EMBED_KEY] = draft.embed_tokens.weight.detach().clone()
    rng = checkpoint.get("rng_states")
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
