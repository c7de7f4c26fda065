"""The loss menu (``draftlab.training.losses``) on DFlash blocks: every DFlash-family module's slot loss.

Without a menu choice a block's loss is ``blocks.block_loss`` (CE on the sequence token, ``exp(-(k-1)/gamma)``).
With one, slot k of the block at anchor a is scored by the chosen terms against:

- the hard label ``x_{a+k}``, the (target-written) sequence token DFlash trains on (``ce``);
- the teacher ``p = softmax(target logits at position a+k-1)``, the target's distribution of ``x_{a+k}`` given
  the sequence up to it, from its final-norm hidden state and LM head (soft terms only: the batch then carries
  ``last_hidden [B, T, d]``, stored offline or returned by the online target pass);

and weighted along the block's slots by the method's decay, uniformly or by D-PACE, normalised by the weight sum
as DFlash's own loss is.
"""

from __future__ import annotations

import torch

from draftlab.methods.dflash.blocks import BlockOutput, Blocks, slot_sums
from draftlab.methods.dflash.config import position_weights
from draftlab.training.losses import Loss, chain_weights, hard_confidence, position_losses


@torch.no_grad()
def teacher_probs(draft, last_hidden: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The target's distribution ``[B, A, K, V]`` (fp32) of each labelled slot's token: its LM head on the
    final-norm state ``last_hidden [B, T, d]`` one position before the label."""
    B, T, _ = last_hidden.shape
    K = blocks.labels.shape[-1]
    pos = (blocks.anchors[:, :, None] + torch.arange(K, device=last_hidden.device)).clamp(max=T - 1)  # [B, A, K]
    h = last_hidden.gather(1, pos.reshape(B, -1, 1).expand(-1, -1, last_hidden.shape[-1]))  # [B, A*K, d]
    z = draft.logits(h.to(draft.lm_head_weight.dtype)).float()  # [B, A*K, V]
    return torch.softmax(z, -1).view(B, *pos.shape[1:], -1)


def menu_block_loss(logits: torch.Tensor, blocks: Blocks, gamma: float, loss: Loss,
                    teacher: torch.Tensor | None) -> BlockOutput:
    """``BlockOutput`` of the menu's loss on slot logits ``[B, A, K, V]`` (``teacher`` as ``teacher_probs``)."""
    valid = blocks.label_valid  # [B, A, K]
    labels = torch.where(valid, blocks.labels, torch.zeros_like(blocks.labels))
    ell = position_losses(loss, logits, teacher, labels)  # [B, A, K]
    method = torch.tensor(position_weights(logits.shape[2] + 1, gamma), dtype=torch.float32, device=logits.device)
    w = chain_weights(loss, method, valid, lambda: hard_confidence(logits.detach(), labels))  # [B, A, K]
    loss_sum, weight_sum = (ell * w).sum(), w.sum()
    with torch.no_grad():
        per_slot = slot_sums((logits.argmax(-1) == blocks.labels) & valid, blocks)
    return BlockOutput(loss=loss_sum / weight_sum.clamp_min(1e-12), loss_sum=loss_sum, weight_sum=weight_sum,
                       per_slot=per_slot)

