"""DSpark drafting for the shared engine: DFlash's block pass, a length from the confidence head, then the
Markov chain drawn left to right.

A round (``DFlashDrafter`` runs the block pass and its context bookkeeping; this drafter only turns the
pass's outputs into the round's chain, ``_proposal``):

1. **length.** How many slots to verify is decided from the block pass alone, before any slot is drawn:
   the confidence head's per-slot acceptance estimates ``c_k`` (a function of the slot states, never of
   drawn tokens) give a prefix of k slots the path probability ``c_1 ... c_k``. ``tree: auto`` hands these
   to the round's ``TreeBudget`` (the prefix with the most expected tokens per second); ``confidence_threshold``
   keeps the longest prefix whose product stays at or above it; otherwise the whole block. A draft without
   a confidence head scores slots by their base laws as DFlash does (argmax probability; ``sum q^2``).
2. **chain.** Slot k's logits are its base logits plus the Markov bias of the token drafted before it
   (the root for slot 1): ``z_k + bias(y_{k-1})``. At T = 0 (or ``sampling="argmax"``) ``y_k`` is their
   argmax; at T > 0 ``y_k`` is drawn from ``q_k = softmax`` of them at the sampling temperature / top-k /
   top-p, and ``q_k`` is the row reported for node k. ``q_k`` depends on ``y_{k-1}``, an ancestor of node
   k, which the rule of ``decoding.drafter`` allows: given everything before it, ``y_k`` is distributed as
   its reported row, which is all the verifier's min(1, p/q) rule needs.

Why not the block length from the drawn chain (e.g. a confidence head fed the Markov embedding of the drawn
token, as vLLM's ``confidence_head_with_markov`` allows): a cut that looks at the draws keeps likely draws
and drops unlikely ones, and the kept tokens are no longer distributed as their reported rows.
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.dflash.drafter import DFlashDrafter
from draftlab.methods.dspark.model import DSparkDraft


class DSparkDrafter(DFlashDrafter):
    """Proposes one Markov chain per round with a :class:`DSparkDraft` (see the module docstring).

    block_size, sampling, tree   as ``DFlashDrafter``'s (``tree: auto`` sizes the chain from the confidence head).
    confidence_threshold         keep the longest prefix whose cumulative confidence is >= this (None: off;
                                 with ``tree: auto`` the budget decides and this is not allowed).
    """

    def __init__(self, draft: DSparkDraft, *, block_size: int | None = None, sampling: str = "sample",
                 tree: str = "fixed", confidence_threshold: float | None = None):
        super().__init__(draft, block_size=block_size, sampling=sampling, tree=tree)
        if confidence_threshold is not None:
            if self.budget is not None:
                raise ValueError("confidence_threshold and tree: auto both size the chain: set one")
            if not 0.0 <= float(confidence_threshold) <= 1.0:
                raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
            if draft.confidence_head is None:
                raise ValueError("confidence_threshold needs a draft with a confidence head (enable_confidence_head)")
        self.confidence_threshold = None if confidence_threshold is None else float(confidence_threshold)

    def _proposal(self, state: DecodeState, hidden: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        greedy = state.temperature == 0 or self.sampling == "argmax"
        k = self._length(hidden, logits, state, greedy)
        tokens, probs = self._draw_markov(logits[:k], state, greedy)
        return DraftTree.chain(state.root, tokens.cpu(), draft_probs=probs)

    # ---- 1. the length: from the block pass alone ------------------------------------------------------

    def slot_scores(self, hidden: torch.Tensor, logits: torch.Tensor, state: DecodeState, greedy: bool) -> torch.Tensor:
        """Per-slot acceptance estimates ``[bs-1]`` from the block pass's states ``[bs-1, d]`` and base logits
        ``[bs-1, V]``: the confidence head's, else the base laws' (DFlash's scores)."""
        conf = self.draft.confidence(hidden)  # [bs-1]
        if conf is not None:
            return conf.double()
        if greedy:
            return logits.float().softmax(-1).max(-1).values.double()
        probs = logits_to_probs(logits, state.temperature, state.top_k, state.top_p)  # [bs-1, V]
        return (probs.double() ** 2).sum(-1)

    def _length(self, hidden: torch.Tensor, logits: torch.Tensor, state: DecodeState, greedy: bool) -> int:
        full = logits.shape[0]
        if self.budget is None and self.confidence_threshold is None:
            return full
        path = self.slot_scores(hidden, logits, state, greedy).cumprod(0).cpu()  # [bs-1]
        if self.budget is not None:
            return int(self.budget.choose(path, 0))
        return int((path >= self.confidence_threshold).long().cumprod(0).sum())

    # ---- 2. the chain: left to right from the root -------------------------------------------------------

    def _draw_markov(self, logits: torch.Tensor, state: DecodeState, greedy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens ``[k]`` and, when drawn, the laws they were drawn from ``[k, V]`` (None: a greedy chain)."""
        device, gen = logits.device, state.generator
        prev = torch.tensor(int(state.root), device=device)
        tokens, rows = [], []
        for base in logits:  # [V] per slot
            slot = base + self.draft.markov_bias(prev)  # [V]
            if greedy:
                prev = slot.argmax(-1)
            else:
                q = logits_to_probs(slot, state.temperature, state.top_k, state.top_p)  # [V]
                if gen is not None and gen.device != q.device:
                    q = q.to(gen.device)
                prev = sample(q, gen).to(device)
                rows.append(q)
            tokens.append(prev)
        if not tokens:
            return torch.zeros(0, dtype=torch.long, device=device), None
        return torch.stack(tokens), (torch.stack(rows) if rows else None)  # [k], [k, V]
