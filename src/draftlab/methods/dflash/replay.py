"""On-policy replay of a DFlash draft: its log-probs for blocks it proposed during decoding, with gradients.

This is the ``replay`` seam of ``conf/method/dflash.yaml`` (read by ``method=draft_opd``). A round with its
root at sequence position ``a`` drafted one block ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1`` that
saw the fused target context of the committed tokens ``< a``; slot k gave ``q_k``, the distribution of
position ``a + k``. A DFlash block does not condition on its own earlier proposals (the slots are masks), so
replaying every anchor of a rollout is one packed block forward, exactly the training forward
(``blocks.block_logits``) with the rollout's roots as the anchors. With unchanged weights the replayed
log-probs equal the ones the drafter proposed from (tested).

``block_size`` must be the block the rollouts were drafted with (the drafter's ``block_size``): the slots
attend to each other, so a shorter block is a different distribution. None = the draft's trained block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.methods.dflash.blocks import block_logits, make_blocks
from draftlab.methods.dflash.model import DFlashDraft
from draftlab.targets.base import PassRequest


class DFlashReplay:
    """``vocab_ids(draft)``, ``features(draft, target, tokens)`` and ``logprobs(...)`` for on-policy training."""

    def __init__(self, block_size: int | None = None):
        self.block_size = None if block_size is None else int(block_size)

    def _block(self, draft: DFlashDraft) -> int:
        return self.block_size or draft.config.block_size

    def vocab_ids(self, draft: DFlashDraft) -> torch.Tensor:
        """DFlash drafts over the target's own vocabulary: column i is target id i (``[V]``)."""
        return torch.arange(draft.config.vocab_size)

    def features(self, draft: DFlashDraft, target, tokens: torch.Tensor) -> torch.Tensor:
        """The target's tapped states ``[1, T, n_taps*d]`` over ``tokens [T]`` (no gradient, target precision)."""
        with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
            no_logits = torch.arange(0, device=target.device)  # no LM head rows
            out = target.forward(tokens[None].to(target.device),
                                 request=PassRequest(aux=draft.taps(target), logits_rows=no_logits))
        return out.aux_hidden

    def logprobs(self, draft: DFlashDraft, target, tokens: torch.Tensor, roots: torch.Tensor,
                 chains: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """Draft log-probs ``[M, K, V]`` (with gradients) of the blocks rooted at ``roots``.

        tokens   [T] the committed sequence; roots [M] distinct positions in [1, T-1].
        chains   [M, K] the proposed tokens; only their length K (<= block_size - 1) matters, since a block's
                 slots never read the draft's own proposals. Row k of the output is the distribution of
                 slot k + 1.
        """
        bs = self._block(draft)
        M, K = chains.shape
        if K > bs - 1:
            raise ValueError(f"chains of {K} tokens but a block of {bs} proposes at most {bs - 1}: "
                             "replay.block_size must be the block the rollouts were drafted with")
        draft.share_target_weights(target)
        device = draft.fc.weight.device
        tokens, roots = tokens.to(device), roots.to(device)
        T = tokens.shape[0]
        if M == 0 or K == 0:
            return torch.zeros(M, K, draft.config.vocab_size, device=device)
        if int(roots.min()) < 1 or int(roots.max()) >= T:
            raise ValueError(f"roots must lie in [1, {T - 1}] for a sequence of {T} tokens, got "
                             f"{int(roots.min())}..{int(roots.max())}")
        aux = features if features is not None else self.features(draft, target, tokens)  # [1, T, n_taps*d]
        ones = torch.ones(1, T, dtype=torch.long, device=device)
        blocks = make_blocks(tokens[None], ones, ones, block_size=bs, mask_token_id=draft.config.mask_token_id,
                             anchors=roots[None])  # block j at roots[j], context t < roots[j]
        logits = block_logits(draft, aux.to(device), blocks, block_size=bs)  # [1, M, bs-1, V]
        return F.log_softmax(logits[0, :, :K].float(), -1)  # [M, K, V]
