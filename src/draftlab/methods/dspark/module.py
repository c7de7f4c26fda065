"""DSpark training: DFlash's block loss on the base logits, plus the Markov head's and the confidence head's.

For every packed block (``methods.dflash.blocks``: random anchors, slot k labelled ``x_{a+k}``):

- **base** (DFlash's loss, unchanged): position-weighted CE of the base logits ``z_k``;
- **Markov** (PROPOSAL: the sources ship no training code): the same position-weighted CE of
  ``z_k + bias(x_{a+k-1})``, the previous slot's *label* standing in for the previously drafted token (teacher
  forcing: exactly the input the chain sees whenever its prefix is accepted, the only case in which slot k
  is verified at all). Gradients reach the backbone too;
- **confidence** (PROPOSAL): binary cross-entropy of the head's logit at slot k against the Markov law's
  probability of the label, ``q_k(x_{a+k})`` (detached; ``confidence_target: prob``), or against whether its
  argmax is the label (``argmax``). With the target's own greedy continuation as the label, the first is the
  T = 1 acceptance rate ``sum_x min(p, q)`` of slot k given an accepted prefix, the second the greedy one; the
  drafter multiplies the estimates along the chain as path probabilities.

``loss = base_weight * base + markov_weight * markov + confidence_weight * confidence``. The per-slot accuracy
metrics (and ``val/simulated_tau``, the checkpoint metric) are the Markov chain's, the proposal the drafter makes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from draftlab.methods.dflash.blocks import BlockOutput, block_states, make_blocks, slot_logits
from draftlab.methods.dflash.module import DFlashModule
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.methods.dspark.model import DSparkDraft

CONFIDENCE_TARGETS = ("prob", "argmax")


def markov_inputs(anchor_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each labelled slot ``[B, A, K]``: the anchor ``[B, A]`` for slot 1, else the previous label."""
    return torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)


def confidence_loss(draft: DSparkDraft, states: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                    valid: torch.Tensor, target: str = "prob") -> torch.Tensor:
    """Mean BCE over valid slots of the confidence head on states ``[B, A, K, d]`` against the acceptance of the
    Markov logits ``[B, A, K, V]`` at ``labels [B, A, K]`` (see the module docstring); 0 without a head."""
    if draft.confidence_head is None:
        return states.new_zeros((), dtype=torch.float32)
    with torch.no_grad():
        if target == "prob":
            goal = logits.float().softmax(-1).gather(-1, labels[..., None])[..., 0]  # [B, A, K]
        else:
            goal = (logits.argmax(-1) == labels).float()  # [B, A, K]
    bce = F.binary_cross_entropy_with_logits(draft.confidence_head(states), goal, reduction="none")  # [B, A, K]
    return (bce * valid).sum() / valid.sum().clamp_min(1)


class DSparkModule(DFlashModule):
    """Trains a :class:`DSparkDraft` (see the module docstring); the other arguments are ``DFlashModule``'s.

    base_weight, markov_weight, confidence_weight   the three losses' weights.
    confidence_target                              ``prob`` or ``argmax`` (the confidence head's label).
    """

    def __init__(self, draft: DSparkDraft, target=None, *, base_weight: float = 1.0, markov_weight: float = 1.0,
                 confidence_weight: float = 0.1, confidence_target: str = "prob", **dflash: Any):
        if confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"confidence_target must be one of {CONFIDENCE_TARGETS}, got {confidence_target!r}")
        super().__init__(draft, target, **dflash)
        self.base_weight, self.markov_weight = float(base_weight), float(markov_weight)
        self.confidence_weight, self.confidence_target = float(confidence_weight), confidence_target
        self._parts: dict[str, torch.Tensor] = {}

    def block_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> BlockOutput:
        """Sample blocks and return the weighted total loss with the Markov chain's per-slot sums."""
        c = self.draft.config
        aux = self.target_features(batch)
        blocks = make_blocks(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], block_size=c.block_size,
                             mask_token_id=c.mask_token_id, num_anchors=self.num_anchors, generator=generator)
        states = block_states(self.draft, aux, blocks)  # [B, A, K, d]
        base_logits = slot_logits(self.draft, states)  # [B, A, K, V]
        base = self.slot_loss(base_logits, blocks, batch)
        anchor_ids = batch["input_ids"].gather(1, blocks.anchors)  # [B, A]
        prev = markov_inputs(anchor_ids, blocks.labels)  # [B, A, K]
        markov_logits = base_logits + self.draft.markov_bias(prev)  # [B, A, K, V]
        markov = self.slot_loss(markov_logits, blocks, batch)
        conf = confidence_loss(self.draft, states, markov_logits, blocks.labels, blocks.label_valid,
                               self.confidence_target)
        total = self.base_weight * base.loss + self.markov_weight * markov.loss + self.confidence_weight * conf
        self._parts = {"base_loss": base.loss.detach(), "markov_loss": markov.loss.detach(),
                       "confidence_loss": conf.detach()}
        # Validation's val/loss = loss_sum / weight_sum: the Markov chain's CE, the proposal's own.
        return BlockOutput(loss=total, loss_sum=markov.loss_sum, weight_sum=markov.weight_sum, per_slot=markov.per_slot)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"train/{k}": v for k, v in self._parts.items()}, batch_size=batch["input_ids"].shape[0])
        return loss

    # ---- checkpoints: the DSpark config beside the weights ---------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dspark_config"] = self.draft.config.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("dspark_config")
        if saved is not None and DSparkConfig.from_dict(saved) != self.draft.config:
            raise ValueError("checkpoint was trained with a different DSpark config:\n"
                             f"  checkpoint: {saved}\n  this run:   {self.draft.config.to_dict()}")
