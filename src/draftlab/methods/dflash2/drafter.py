"""DFlash2 drafting: DFlash's block pass, then the candidate selector's walk from the verified token.

Each round the block pass gives every slot a state ``h_t`` and logits. Slot t's candidates are its unary
top-K; each is scored ``logit(c) + edge(prev, c)`` where ``prev`` is the token the walk chose for slot
t - 1 (the verified root for slot 0), and the walk picks slot t's token from those K scores:

- T = 0, or ``sampling="argmax"``: the best-scoring candidate (a deterministic chain);
- T > 0 with ``sampling="sample"``: a draw from ``softmax(score / T)`` over the K candidates, reported as that
  slot's ``draft_probs`` row (zero outside the candidates). The law of slot t depends on the token drawn for
  slot t - 1, an ancestor in the chain, which the drafter rule allows (``decoding/drafter.py``): each token
  is distributed as its reported row given everything before it, so the verifier's sampled rule is exact.

With ``tree: auto`` the number of slots verified is decided before the walk, from the unary laws (the
argmax's probability at T = 0, ``sum q^2`` of the tempered unary law at T > 0: functions of the block pass,
never of a drawn token), as DFlash decides its cut. ``selector: false`` drafts exactly as DFlash does from
the same draft (the ablation's unary side).
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import DecodeState
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.dflash.drafter import DFlashDrafter, _keep
from draftlab.methods.dflash2.model import DFlash2Draft


class DFlash2Drafter(DFlashDrafter):
    """DFlash's drafter with the selector's walk (see the module docstring).

    selector   True: the walk over each slot's re-scored top-K; False: DFlash's own proposal (unary).
    Every other knob is DFlash's (``block_size``, ``sampling``, ``tree``).
    """

    def __init__(self, draft: DFlash2Draft, *, selector: bool = True, **dflash):
        if not isinstance(draft, DFlash2Draft):
            raise TypeError(f"DFlash2Drafter needs a DFlash2Draft (its selector), got {type(draft).__name__}")
        super().__init__(draft, **dflash)
        self.selector = bool(selector)
        if self.selector and int(getattr(self, "branching", 1)) > 1:
            raise ValueError("DFlash2's selector walks one chain: branching > 1 needs selector: false")

    def _proposal(self, state: DecodeState, hidden: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        if not self.selector:
            return super()._proposal(state, hidden, logits)
        T = state.temperature
        greedy = T == 0 or self.sampling == "argmax"
        if self.budget is not None:
            unary = logits.float().softmax(-1).max(-1).values if greedy else \
                (logits_to_probs(logits, T).double() ** 2).sum(-1)  # [bs-1]: the laws alone, nothing drawn
            keep = _keep(self.budget, unary)
            hidden, logits = hidden[:keep], logits[:keep]
        tokens, probs = self.walk(state, hidden, logits, greedy=greedy)
        return DraftTree.chain(state.root, tokens, draft_probs=probs)

    def walk(self, state: DecodeState, hidden: torch.Tensor, logits: torch.Tensor, *, greedy: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens ``[k]`` (CPU) of the walk over slots ``hidden [k, d]`` / ``logits [k, V]``, and at T > 0 the
        rows ``[k, V]`` they were drawn from (None for a deterministic walk)."""
        k, V = logits.shape
        values, ids = self.draft.candidates(logits)  # [k, K]
        selector = self.draft.candidate_selector
        projected = selector.project(hidden)  # [k, r]
        previous = torch.tensor([int(state.root)], device=ids.device)
        tokens, rows = [], []
        for t in range(k):
            score = values[t] + selector.edges(previous, ids[t], projected[t])[0]  # [K]
            if greedy:
                pick = int(score.argmax())
            else:
                law = torch.softmax(score / state.temperature, -1)  # [K]
                row = torch.zeros(V, dtype=law.dtype, device=law.device).scatter_(0, ids[t], law)  # [V]
                g = state.generator
                row = row.to(g.device) if g is not None and g.device != row.device else row
                drawn = int(sample(row[None], g)[0])
                rows.append(row)
                pick = int((ids[t] == drawn).nonzero()[0, 0])
            previous = ids[t, pick : pick + 1]
            tokens.append(int(previous))
        out = torch.tensor(tokens, dtype=torch.long)
        if greedy or k == 0:
            return out, None
        return out, torch.stack(rows)  # [k], [k, V]
