"""The speculation cache: the next round's chains for the likely outcomes of the chain being verified.

``build`` runs one glue pass of the draft over the chain (the draft's law after the root and after each
chain token), picks the bonus candidates at every position (``saguaro.candidates``) and drafts a next chain
after each outcome ``(j, t)``, all branches together. The keys are known after the glue pass: ``give_up``
(the worker's check for an outcome that has already arrived and is not among them) is asked then and after
every branch step, and ends the build, so a miss does not wait for the branches. Every build replaces the whole cache: an entry is only
ever an answer for the chain it was built from. ``lookup((j, t))`` returns the entry or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftlab.decoding.outcome_drafter import OutcomeChain, OutcomeDrafter, Sampling
from draftlab.methods.ssd.saguaro import Reshaper, candidates


class OutcomeCache:
    def __init__(self, outcome_drafter: OutcomeDrafter):
        self.outcome_drafter = outcome_drafter
        self.entries: dict[tuple[int, int], OutcomeChain] = {}

    def build(self, *, context: list[int], chain: list[int], fanout: list[int], depth: int, temperature: float,
              top_k: int | None, top_p: float | None, seed: int, scale: float, verified=None,
              give_up: Callable[[set], bool] | None = None) -> None:
        """Chains of ``depth`` tokens after ``context + chain[:j] + [t]`` for every candidate ``t`` at every j
        (``fanout[j]`` of them); at T > 0 drawn with a generator seeded by ``seed`` and reshaped by σ_{F,C}.
        ``verified``: the round's ``OutcomeDrafter.verified`` (the target's features a feature draft reads)."""
        self.entries = {}
        self.outcome_drafter.absorb(verified)
        z = self.outcome_drafter.glue(context, chain)  # [K+1, V]
        starts = [(j, t) for j in range(len(chain) + 1)
                  for t in candidates(z[j], fanout[j], chain[j] if j < len(chain) else None)]
        if give_up is not None and give_up(set(starts)):
            return
        gen = torch.Generator(device=z.device).manual_seed(int(seed)) if temperature > 0 else None
        sampling = Sampling(temperature, top_k, top_p, gen)
        keys = set(starts)
        stop = None if give_up is None else (lambda: give_up(keys))
        chains = self.outcome_drafter.branches(starts, depth, sampling, Reshaper(fanout, scale), stop)
        if chains is not None:
            self.entries = dict(zip(starts, chains))

    def lookup(self, key: tuple[int, int] | None) -> OutcomeChain | None:
        return None if key is None else self.entries.get(key)
