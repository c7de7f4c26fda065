"""Which cache slots a sparse draft step reads: sinks + a recent window + the slots the target attended to most.

The importance of slot i at layer l, KV head h is the attention mass the last ``rows`` verification query
rows put on it (``s_{l,h}(i) = sum_q A_{l,h}(q, i)``, summed over the query heads of the group), which every
verify pass computes anyway (``PassRequest(attn_mass_rows=W)``). Selection is per layer and per KV head, at
token granularity, and is redone each round from the dense cache, so a slot dropped from one view can
be chosen again later (recall): nothing is ever evicted from the target's cache.
"""

from __future__ import annotations

import math
from collections import deque

import torch


def budget_slots(context: int, budget: float, min_budget: int) -> int:
    """Slots per KV head a view keeps: ``max(min_budget, budget * context)``, at most the whole context."""
    return min(context, max(int(min_budget), math.ceil(float(budget) * context)))


def select_slots(scores: torch.Tensor, context: int, keep: int, *, sinks: int, window: int) -> torch.Tensor:
    """Per layer and KV head: the first ``sinks`` slots, the last ``window`` and the top-scoring rest.

    scores [L, Hkv, S] (S <= context: slots past S have no score yet and are recent anyway) -> slots
    [L, Hkv, keep], ascending, distinct. With ``keep >= context`` every slot is kept (dense attention).
    """
    L, Hkv, S = scores.shape
    if keep >= context:
        return torch.arange(context, device=scores.device).expand(L, Hkv, context)
    s = scores.new_zeros(L, Hkv, context)
    s[..., :min(S, context)] = scores[..., :context]
    # Forced slots rank above any attention mass; ties among them do not matter (all fit when
    # sinks + window <= keep, and otherwise the most recent of the window are what topk keeps first).
    s[..., :sinks] = math.inf
    if window > 0:
        s[..., max(0, context - window):] = math.inf
    return s.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values  # [L, Hkv, keep]


class MassHistory:
    """The attention mass of the most recent passes, summed over their last ``rows`` query rows in all.

    Each verify pass reports the mass of up to W of its rows; a short pass (few drafted tokens) reports
    fewer, so the score sums the newest passes until ``rows`` rows are covered, as "the last W verification
    queries" asks.
    """

    def __init__(self, rows: int):
        self.rows = int(rows)
        self._passes: deque[tuple[torch.Tensor, int]] = deque()

    def add(self, mass: torch.Tensor, rows: int) -> None:
        """mass [L, Hkv, S] summed over ``rows`` query rows."""
        self._passes.append((mass, int(rows)))
        covered = 0
        for i, (_, n) in enumerate(reversed(self._passes)):
            covered += n
            if covered >= self.rows:  # older passes no longer count
                for _ in range(len(self._passes) - i - 1):
                    self._passes.popleft()
                break

    def scores(self, context: int) -> torch.Tensor:
        """[L, Hkv, context]: the summed mass per slot (slots a pass did not cover count zero there)."""
        first = self._passes[0][0]
        out = first.new_zeros(*first.shape[:-1], context)
        for mass, _ in self._passes:
            n = min(mass.shape[-1], context)
            out[..., :n] += mass[..., :n]
        return out
