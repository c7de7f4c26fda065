"""The selector's training objective and its metrics (PROPOSAL: DFlash2's objective is not published).

Per labelled block slot the selector re-scores the slot's unary top-K given the previous gold token
(teacher forcing: the anchor for slot 1), as the drafter's walk does given the previous drafted token. The
loss is a K-way cross-entropy toward the gold token on the slots whose gold token is among the K (a slot
whose gold the unary head missed teaches the selector nothing it could use), averaged over those slots.
With ``detach`` (default) it trains the selector only, on detached unary logits and slot states, so the
DFlash loss alone shapes the backbone (SpecForge exposes the same choice as a stop-gradient flag).

Under teacher forcing a slot's selector pick is right exactly when the walk's pick would be right given
that every earlier slot was right, so the chain counts of these picks give the greedy selector chain's
simulated tau, comparable with the unary chain's (``val/simulated_tau``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftlab.methods.dflash.blocks import Blocks, slot_sums
from draftlab.methods.dflash2.model import DFlash2Draft

# Per-slot sums: gold in the unary top-K, labelled slots, selector picks right, and the greedy selector
# chain's counts (``chain_`` + dflash's SUMMED).
SELECTOR_SUMMED = ("top_k_hits", "labelled", "picked", "chain_correct", "chain_count", "chain_cond_correct",
                   "chain_cond_count")


@dataclass
class SelectorOutput:
    loss: torch.Tensor  # scalar: mean K-way CE over slots whose gold is in the unary top-K (0 when none)
    sums: dict[str, torch.Tensor]  # SELECTOR_SUMMED name -> [bs-1] counts per block slot


def selector_loss(draft: DFlash2Draft, states: torch.Tensor, logits: torch.Tensor, blocks: Blocks, *,
                  detach: bool = True) -> SelectorOutput:
    """The selector objective for slot states ``[B, A, S, d]`` and their unary logits ``[B, A, S, V]``."""
    if detach:
        states, logits = states.detach(), logits.detach()
    B, A, S, _ = states.shape
    values, ids = draft.candidates(logits)  # [B, A, S, K]
    selector = draft.candidate_selector
    anchors = blocks.block_ids.view(B, A, S + 1)[:, :, :1]  # [B, A, 1]
    previous = torch.cat([anchors, blocks.labels[:, :, :-1]], dim=-1)  # [B, A, S]: gold of the slot before
    edges = selector.edges(previous[..., None], ids, selector.project(states))[..., 0, :]  # [B, A, S, K]
    scores = values + edges  # [B, A, S, K]
    hit = ids == blocks.labels[..., None]  # [B, A, S, K]
    in_top = hit.any(-1) & blocks.label_valid  # [B, A, S]
    gold = hit.long().argmax(-1)  # [B, A, S]: the gold's index among the candidates (where in_top)
    if in_top.any():
        loss = F.cross_entropy(scores[in_top], gold[in_top])
    else:
        loss = scores.sum() * 0.0  # keeps the graph (and DDP's gradient sync) whole
    with torch.no_grad():
        picked = in_top & (scores.argmax(-1) == gold)  # [B, A, S]
        chain = slot_sums(picked, blocks)
        sums = {"top_k_hits": in_top.sum((0, 1)).double(), "labelled": blocks.label_valid.sum((0, 1)).double(),
                "picked": picked.sum((0, 1)).double(), **{f"chain_{k}": v for k, v in chain.items()}}
    return SelectorOutput(loss=loss, sums=sums)
