"""On-policy replay of an EAGLE-3 draft: its log-probs along chains it proposed during decoding, with gradients.

This is the ``replay`` seam of ``conf/method/eagle3.yaml``, which on-policy training (``method=draft_opd``)
reads without knowing the draft. A chain starts at a verification round's root (sequence position ``a``,
the context is ``tokens[:a + 1]``) and holds the draft tokens ``d_1..d_K`` the round proposed along one
root-to-leaf path. Replaying it is the drafter's tree growth written as a training-time-test unroll:

- step 0 runs the draft over the whole committed sequence (``Emb(x_{t+1})`` with the target's features
  ``F_t`` at row t, causal), exactly like the drafter's committed rows; row ``a - 1`` consumes the root and
  gives ``q_1``, the distribution of position ``a + 1``;
- step k >= 1 unrolls only the anchor rows: row ``a - 1`` consumes the draft's own token ``d_k`` and its
  own output state of step k-1 at position ``a - 1 + k``, attending to the committed rows ``<= a - 1`` and
  its own earlier steps (``ttt_attention`` with ``query_rows``), as the drafter's depth-k node does, and
  gives ``q_{k+1}``.

So with unchanged weights the replayed log-probs equal the ones the drafter proposed from (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.methods.eagle3.ttt import TTTAttention
from draftlab.targets.base import PassRequest


class Eagle3Replay:
    """``vocab_ids(draft)`` and ``logprobs(draft, target, tokens, roots, chains)`` for on-policy training."""

    def vocab_ids(self, draft: Eagle3Draft) -> torch.Tensor:
        """Target id of each column of the draft's output (``[V_d]``)."""
        return draft.target_ids()

    def features(self, draft: Eagle3Draft, target, tokens: torch.Tensor) -> torch.Tensor:
        """The target's tapped states ``[1, T, 3*d_t]`` over ``tokens [T]`` (no gradient, target precision)."""
        with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
            out = target.forward(tokens[None].to(target.device),
                                 request=PassRequest(aux=draft.taps(target)))
        return out.aux_hidden

    def prepare(self, draft: Eagle3Draft, target, tokens: torch.Tensor, rows: torch.Tensor, features
                ) -> tuple[torch.Tensor, TTTAttention]:
        """The step-0 inputs ``[1, T, 3*d_t]`` and the unroll's attention, given ``features`` (``features``)
        and the rows the rounds drafted from: what a method extending EAGLE-3 overrides (ConFu's futures)."""
        return features, TTTAttention(None)

    def logprobs(self, draft: Eagle3Draft, target, tokens: torch.Tensor, roots: torch.Tensor,
                 chains: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """Draft log-probs ``[M, K, V_d]`` (with gradients) along ``chains``.

        tokens   [T] the committed sequence (prompt + output); every root position is < T.
        roots    [M] distinct root positions (>= 1: the prompt is never empty).
        chains   [M, K] draft tokens d_1..d_K (target ids); padding may be any valid id, its rows are
                 computed and ignored by the caller. Row k of the output is the distribution of d_{k+1}.
        features the target's tapped states over ``tokens`` (``features``), computed here when None.
        """
        device = draft.fc.weight.device
        tokens, roots, chains = tokens.to(device), roots.to(device), chains.to(device)
        T = tokens.shape[0]
        M, K = chains.shape
        if M == 0 or K == 0:
            return torch.zeros(M, K, draft.d2t.numel(), device=device)
        if int(roots.min()) < 1 or int(roots.max()) >= T:
            raise ValueError(f"roots must lie in [1, {T - 1}] for a sequence of {T} tokens, got "
                             f"{int(roots.min())}..{int(roots.max())}")
        rows = roots - 1  # [M] the committed row that consumes each root
        aux, attention = self.prepare(draft, target, tokens, rows,
                                      features if features is not None else self.features(draft, target, tokens))
        ids0 = torch.zeros(1, T, dtype=torch.long, device=device)
        ids0[0, : T - 1] = tokens[1:]  # row t consumes x_{t+1}
        positions = torch.arange(T, device=device)[None]  # [1, T]
        hidden, logits = draft.forward_step(ids0, aux, positions, attention, logits_rows=rows)  # [1, T, d], [1, M, V_d]
        out = [F.log_softmax(logits[0].float(), -1)]  # q_1 per anchor, [M, V_d]
        hidden = hidden[:, rows]  # [1, M, d]
        attention.query_rows = rows
        for k in range(1, K):
            hidden, logits = draft.forward_step(chains[None, :, k - 1], hidden, rows[None] + k, attention)
            out.append(F.log_softmax(logits[0].float(), -1))  # [M, V_d]
        return torch.stack(out, dim=1)  # [M, K, V_d]
