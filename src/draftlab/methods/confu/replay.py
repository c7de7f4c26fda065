"""On-policy replay of a ConFu draft: its log-probs along chains it proposed during decoding, with gradients.

This is the ``replay`` seam of ``conf/method/confu.yaml`` (read by ``method=draft_opd``). It is EAGLE-3's
replay (``eagle3.replay``: step 0 over the committed sequence, then a TTT unroll of the rows each round
started from) with the future tokens the rounds drafted with, which can be rebuilt from the committed
sequence alone:

- the round whose root sits at position ``a`` drafted from row ``a - 1`` and saw the future anchored
  there: ``f`` from the contemplate row attached to the round's last accepted token, keyed on the target
  features of the previous round's anchor. After the round, that token and its ancestors are the
  committed tokens ``<= a - 1``, so the same contemplate row is ``contemplate`` over the committed
  sequence at anchor ``a - 1`` with the lag ``a - 1 - (previous anchor)`` (1 at the prompt's end, as the
  drafter's prefill row); ``e_f`` comes from the anchor's features;
- committed rows see the future of their own window (``future_visibility`` over every round's anchor),
  as the drafter appended them; the unrolled rows see their round's future at every step.

So with unchanged weights the replayed log-probs equal the ones the drafter proposed from (tested), and
the gradient reaches every ConFu part: the EAGLE-3 layers, both MoEs and, through the frozen target's
contemplate rows, the soft prompts. ``roots`` must be every round of the rollout (``method=draft_opd``
passes them all): a round left out would drop its future from the committed rows after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.methods.confu.contemplate import contemplate
from draftlab.methods.confu.model import ConFuDraft, FutureTTTAttention, future_visibility
from draftlab.methods.eagle3.replay import Eagle3Replay
from draftlab.targets.base import PassRequest


@dataclass
class TargetPass:
    """What replay reads from the target over one committed sequence (computed once per rollout)."""

    aux: torch.Tensor  # [1, T, 3*d_t] tapped states
    cache: object  # the target cache of the T tokens: the contemplate rows attend to it


class ConFuReplay(Eagle3Replay):
    """``vocab_ids``, ``features`` (a :class:`TargetPass`) and ``logprobs`` for on-policy training."""

    def features(self, draft: ConFuDraft, target, tokens: torch.Tensor) -> TargetPass:
        T = tokens.shape[0]
        cache = target.new_cache(1, T)
        with torch.no_grad(), torch.autocast(tokens.device.type, enabled=False):
            no_logits = torch.arange(0, device=target.device)  # no LM head rows
            out = target.forward(tokens[None].to(target.device), cache=cache,
                                 request=PassRequest(aux=draft.taps(target), logits_rows=no_logits))
        cache.commit(T)
        return TargetPass(out.aux_hidden, cache)

    def logprobs(self, draft: ConFuDraft, target, tokens: torch.Tensor, roots: torch.Tensor,
                 chains: torch.Tensor, features: TargetPass | None = None) -> torch.Tensor:
        """``Eagle3Replay.logprobs``; ``roots`` strictly ascending, one per round of the rollout."""
        if roots.numel() > 1 and bool((roots[1:] <= roots[:-1]).any()):
            raise ValueError("roots must be strictly ascending: one per round, in decoding order")
        return super().logprobs(draft, target, tokens, roots, chains, features)

    def prepare(self, draft: ConFuDraft, target, tokens: torch.Tensor, rows: torch.Tensor, features: TargetPass
                ) -> tuple[torch.Tensor, FutureTTTAttention]:
        """Every round's future token (module docstring) and the attention that shows each row its own."""
        aux = features.aux.to(rows.device)  # [1, T, 3*d_t]
        T = aux.shape[1]
        lags = torch.cat([rows[:1].clamp(max=1), rows[1:] - rows[:-1]])  # [M] back to the previous anchor
        con_aux = contemplate(target, features.cache, draft.soft_prompts, draft.contemplate_embedding(aux[:, rows - lags]),
                              rows[None], aux_layer_ids=draft.taps(target))  # [1, M, 3*d_t]
        f = draft.future_vector(con_aux)  # [1, M, d]
        e_f = draft.future_embedding(aux[:, rows])  # [1, M, d]
        future_kv = draft.future_kv(e_f, f, rows[None])  # per layer ([1, Hkv, M, hd], [1, Hkv, M, hd])
        visible = future_visibility(rows[None], T, draft.config.future_window)  # [1, T, M]
        return aux, FutureTTTAttention(None, future_kv, visible)
