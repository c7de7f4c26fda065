"""DFlash training core: random anchors, packed blocks, the block mask and the position-weighted loss.

For one sequence ``x_0..x_{T-1}`` with tapped target states ``F_t`` (context ``x_0..x_t``):

- anchors ``a`` are drawn without replacement from positions whose token and successor are both in the
  loss mask (a response token with at least one response label after it), at most ``num_anchors`` a row;
- block j is ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1``; block slot ``k = 1..B-1`` is trained to
  predict ``x_{a+k}`` with weight ``exp(-(k-1)/gamma)`` where ``x_{a+k}`` is a real, loss-masked token;
- block rows see the fused context ``F_t`` for ``t < a`` only (at inference the anchor is the newest
  token, whose target states are not known yet), all rows of their own block, and nothing of any other
  block. ``context_mask`` + the block-diagonal structure of ``model.block_attention`` implement it;
  ``block_attention_mask`` spells the same rule out as one explicit ``[Q, T + Q]`` mask for tests. A draft
  with a ``sliding_window`` W also drops context ``t <= a + k - W`` for slot k (``DFlashConfig``).

Metrics are returned as sums (numerators and denominators) so validation can aggregate across batches
and ranks before dividing. ``simulated_tau`` (``draftlab.nn``) turns the conditional accuracies
(slot k right given slots 1..k-1 right) into the expected tokens per verify round of a greedy chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftlab.methods.dflash.config import position_weights
from draftlab.methods.dflash.model import DFlashDraft
from draftlab.nn.window import in_window

SUMMED = ("correct", "count", "cond_correct", "cond_count")


@dataclass
class Blocks:
    """Packed training blocks of a batch (A blocks per row; ``keep`` marks real ones)."""

    anchors: torch.Tensor  # [B, A] anchor positions
    keep: torch.Tensor  # [B, A] bool: a real block (rows with fewer eligible anchors are padded)
    block_ids: torch.Tensor  # [B, A*bs] anchor token then mask ids
    positions: torch.Tensor  # [B, A*bs] anchor + slot
    labels: torch.Tensor  # [B, A, bs-1] x_{a+k}, k = 1..bs-1
    label_valid: torch.Tensor  # [B, A, bs-1] bool
    ctx_mask: torch.Tensor  # [B, A*bs, T] bool: context key t visible to the row (t < anchor, t real)


@dataclass
class BlockOutput:
    loss: torch.Tensor  # scalar, sum(w * ce) / sum(w) over valid labels
    loss_sum: torch.Tensor  # sum(w * ce)
    weight_sum: torch.Tensor  # sum(w)
    per_slot: dict[str, torch.Tensor]  # SUMMED name -> [bs-1] counts per block slot k = 1..bs-1


def eligible_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """bool ``[B, T]``: positions that may start a block (loss-masked, with a loss-masked successor)."""
    m = loss_mask.bool() & attention_mask.bool()  # [B, T]
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [B, A], keep [B, A])``: up to ``num_anchors`` distinct eligible positions per row, ascending.

    ``A = min(num_anchors, most eligible positions in any row)`` (at least 1); rows with fewer are padded
    with ``keep = False``. Uniform without replacement: each row's eligible positions get random keys and
    the smallest ``A`` keys win.
    """
    elig = eligible_anchors(loss_mask, attention_mask)  # [B, T]
    B, T = elig.shape
    A = max(1, min(int(num_anchors), int(elig.sum(1).max())))
    # Keys drawn on the generator's device (the CPU by default), so a seeded draw is the same everywhere.
    keys = torch.rand(B, T, generator=generator).to(elig.device)  # [B, T]
    keys = torch.where(elig, keys, torch.full_like(keys, 2.0))  # [B, T]
    chosen, pos = torch.topk(keys, A, dim=1, largest=False)  # [B, A]
    keep = chosen < 2.0
    pos = torch.where(keep, pos, torch.full_like(pos, T))  # padding sorts last
    pos, order = pos.sort(dim=1)
    keep = keep.gather(1, order)
    return torch.where(keep, pos, torch.zeros_like(pos)), keep


def context_mask(anchors: torch.Tensor, attention_mask: torch.Tensor, block_size: int,
                 window: int | None = None) -> torch.Tensor:
    """bool ``[B, A*bs, T]``: row (block j, slot k) sees context position t iff ``t < anchor_j`` and t is real, and
    with a sliding ``window`` W also ``anchor_j + k - W < t`` (``DFlashConfig``; the draft applies its own window in
    ``forward_blocks`` whatever this mask says, so passing it here only spells the rule out)."""
    B, T = attention_mask.shape
    t = torch.arange(T, device=anchors.device)
    before = t[None, None, :] < anchors[:, :, None]  # [B, A, T]
    mask = before & attention_mask.bool()[:, None, :]  # [B, A, T]
    mask = mask.repeat_interleave(block_size, dim=1)  # [B, A*bs, T]
    if window is None:
        return mask
    rows = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).flatten(1)  # [B, A*bs]
    return mask & in_window(rows, t, window)


def block_attention_mask(anchors: torch.Tensor, attention_mask: torch.Tensor, block_size: int,
                         window: int | None = None) -> torch.Tensor:
    """The whole rule as one explicit mask bool ``[B, Q, T + Q]`` over keys ``[context ; packed blocks]``.

    Reference only (tests): ``model.block_attention`` never builds the ``[Q, Q]`` part. A ``window`` (at least the
    block, ``DFlashConfig``) narrows the context part only.
    """
    ctx = context_mask(anchors, attention_mask, block_size, window)  # [B, Q, T]
    A = anchors.shape[1]
    blocks = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool)] * A).to(anchors.device)
    return torch.cat([ctx, blocks[None].expand(ctx.shape[0], -1, -1)], dim=-1)  # [B, Q, T + Q]


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor, *,
                block_size: int, mask_token_id: int, num_anchors: int | None = None,
                anchors: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                generator: torch.Generator | None = None, window: int | None = None) -> Blocks:
    """Packed blocks for a batch: sampled anchors, or the given ``anchors [B, A]`` (``keep`` default all).

    ``window``: spell a sliding window out in ``ctx_mask`` too (``context_mask``; the draft applies its own anyway)."""
    B, T = input_ids.shape
    bs = block_size
    if anchors is None:
        anchors, keep = sample_anchors(loss_mask, attention_mask, num_anchors or 1, generator)
    elif keep is None:
        keep = torch.ones_like(anchors, dtype=torch.bool)
    A = anchors.shape[1]
    slots = torch.arange(bs, device=input_ids.device)  # [bs]
    block_ids = torch.full((B, A, bs), int(mask_token_id), dtype=torch.long, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)  # [B, A]
    positions = anchors[:, :, None] + slots  # [B, A, bs]
    target_pos = positions[:, :, 1:]  # [B, A, bs-1]
    inside = target_pos < T
    idx = target_pos.clamp(max=T - 1).reshape(B, -1)  # [B, A*(bs-1)]
    labels = input_ids.gather(1, idx).view(B, A, bs - 1)
    real = (loss_mask.bool() & attention_mask.bool()).gather(1, idx).view(B, A, bs - 1)
    valid = inside & real & keep[:, :, None]  # [B, A, bs-1]
    return Blocks(anchors=anchors, keep=keep, block_ids=block_ids.view(B, A * bs), positions=positions.view(B, A * bs),
                  labels=labels, label_valid=valid, ctx_mask=context_mask(anchors, attention_mask, bs, window))


def block_states(draft: DFlashDraft, aux: torch.Tensor, blocks: Blocks, block_size: int | None = None) -> torch.Tensor:
    """Final-norm draft states ``[B, A, bs-1, d]`` of the labelled slots of every packed block (what the LM
    head reads).

    ``block_size``: the blocks' size when it is not the draft's trained one (a drafter may run shorter blocks).
    """
    B, T = aux.shape[:2]
    bs = block_size or draft.config.block_size
    ctx = draft.fuse(aux)  # [B, T, d]
    ctx_kv = draft.context_kv(ctx, torch.arange(T, device=aux.device))
    hidden = draft.forward_blocks(blocks.block_ids, blocks.positions, ctx_kv, blocks.ctx_mask,
                                  block_size=bs)  # [B, A*bs, d]
    A = blocks.anchors.shape[1]
    return hidden.view(B, A, bs, -1)[:, :, 1:]  # the anchor slot has no label


def slot_logits(draft: DFlashDraft, states: torch.Tensor) -> torch.Tensor:
    """The LM head on slot states ``[B, A, k, d]`` -> ``[B, A, k, V]``, as one matrix product: a strided 4-D
    input would make the head a batched matmul over copies of the [V, d] weight."""
    B, A, k, d = states.shape
    return draft.logits(states.reshape(B * A * k, d)).view(B, A, k, -1)


def block_logits(draft: DFlashDraft, aux: torch.Tensor, blocks: Blocks, block_size: int | None = None) -> torch.Tensor:
    """Draft logits ``[B, A, bs-1, V]`` of the labelled slots of every packed block."""
    return slot_logits(draft, block_states(draft, aux, blocks, block_size))


def block_loss(logits: torch.Tensor, blocks: Blocks, gamma: float) -> BlockOutput:
    """Position-weighted CE (normalised by the weight of the valid labels) and per-slot accuracy sums."""
    B, A, K, V = logits.shape
    w = torch.tensor(position_weights(K + 1, gamma), dtype=torch.float32, device=logits.device)  # [K]
    valid = blocks.label_valid  # [B, A, K]
    ce = F.cross_entropy(logits.float().reshape(-1, V), blocks.labels.reshape(-1), reduction="none").view(B, A, K)
    wv = w * valid  # [B, A, K]
    loss_sum, weight_sum = (ce * wv).sum(), wv.sum()
    with torch.no_grad():
        per_slot = slot_sums((logits.argmax(-1) == blocks.labels) & valid, blocks)
    return BlockOutput(loss=loss_sum / weight_sum.clamp_min(1e-12), loss_sum=loss_sum, weight_sum=weight_sum,
                       per_slot=per_slot)


def slot_sums(ok: torch.Tensor, blocks: Blocks) -> dict[str, torch.Tensor]:
    """``SUMMED`` counts ``[K]`` (double) per block slot of a greedy chain whose slot predictions are right where
    ``ok [B, A, K]`` (already restricted to valid labels): right, labelled, right with every earlier slot right,
    and labelled with every earlier slot right (the conditional accuracy ``simulated_tau`` reads)."""
    valid = blocks.label_valid
    prefix = ok.long().cumprod(dim=-1).bool()  # [B, A, K]: slots 1..k all right
    before = torch.cat([blocks.keep[:, :, None], prefix[:, :, :-1]], dim=-1)  # [B, A, K]: slots 1..k-1 right
    sums = {"correct": ok.sum((0, 1)), "count": valid.sum((0, 1)),
            "cond_correct": prefix.sum((0, 1)), "cond_count": (before & valid).sum((0, 1))}
    return {k: v.double() for k, v in sums.items()}
