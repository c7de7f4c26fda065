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

The module is a thin composition of shared components: ``metrics.TTTStep`` (the unrolled loss),
``metrics.TTTMetrics`` (train/val logging; the best checkpoint is chosen on ``val/simulated_tau``), the
``_partial_`` optimiser and schedule (``draftlab.training.schedule``) and the frozen-embedding checkpoint
helpers below, which ConFu composes the same way.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.metrics import TTTHooks, TTTMetrics, TTTStep
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.targets.base import PassRequest
from draftlab.training.schedule import configure

_EMBED_KEY = "draft.embed_tokens.weight"


class Eagle3Module(TTTHooks, L.LightningModule):
    """Trains an :class:`Eagle3Draft` with TTT against a frozen target (see the module docstring).

    draft          the draft (embedding already copied from the target, vocab mapping installed).
    target         a ``draftlab.targets.Target`` for online batches (and the LM head of offline ones);
                   may be None when every batch is offline and ``target_lm_head`` is given.
    ttt_length     K unrolled steps; ``step_weight`` ** k weights step k; ``normalization`` is
                   ``batch_tokens`` (EAGLE/SpecForge) or ``mask_sum`` (speculators).
    ttt_curriculum ``[[until_fraction, length], ...]``: shorter unrolls for the first fractions of the run
                   (``metrics.TTTStep``); ``val_ttt_length`` the unroll of validation (default ``ttt_length``).
    optimizer      a partial ``torch.optim`` constructor (Hydra ``_partial_: true``): the config's (AdamW 1e-4,
                   betas (0.9, 0.95), wd 0 as SpecForge/EAGLE in conf/method/eagle3.yaml), required to fit.
    schedule       a partial LR schedule (``draftlab.training.schedule``); default warm-up 1.5 % + cosine.
    attention      the TTT attention's kernel (``draftlab.kernels.ttt_attention``; ``auto``: Triton on CUDA, blockwise
                   elsewhere); ``cross_entropy`` the loss's (``draftlab.kernels.soft_cross_entropy``). Neither
                   changes the loss, so neither enters the training key.
    """

    def __init__(self, draft: Eagle3Draft, target=None, *, ttt_length: int = 7, step_weight: float = 0.8,
                 normalization: str = "batch_tokens", optimizer=None, schedule=None,
                 total_steps: int | None = None, ttt_curriculum=None, val_ttt_length: int | None = None,
                 target_lm_head: torch.Tensor | None = None,
                 attention: str = "auto", cross_entropy: str = "auto"):
        super().__init__()
        self.draft = draft
        self.target = target  # not an nn.Module: never in state_dict, never wrapped by DDP/FSDP
        self.ttt = TTTStep(ttt_length, step_weight, normalization, attention, cross_entropy, ttt_curriculum,
                           val_ttt_length)
        self.metrics = TTTMetrics(step_weight)
        self.optimizer_factory = optimizer  # conf/method/<m>.yaml's module.optimizer: its defaults live there
        self.schedule_factory = schedule
        self.total_steps = total_steps
        self.register_buffer("target_lm_head", lm_head_weight(target, target_lm_head), persistent=False)
        self.save_hyperparameters(ignore=["draft", "target", "target_lm_head", "optimizer", "schedule"])

    @property
    def ttt_length(self) -> int:
        return self.ttt.ttt_length

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

    # ---- optimisation ----------------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        return configure(self, params, self.optimizer_factory, self.schedule_factory, self.total_steps)

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
