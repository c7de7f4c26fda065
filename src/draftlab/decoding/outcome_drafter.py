"""Drafting after an outcome that has not been verified yet: the seam SSD-style drafters build on.

An ordinary drafter proposes from the verified state (``Drafter.propose(state)``). Speculative speculative
decoding prepares the *next* round while the target still verifies this one, for each likely outcome
``(j accepted, bonus t)``, so its base must draft after any sequence it is given, verified or not.
A drafter that can do so declares ``outcome_drafter(target)`` (the ``DraftsOutcomes`` protocol) returning such an
object, an ``OutcomeDrafter``; the others, which only draft from verified target state, do not have it.
(EAGLE-3's features of a hypothetical bonus token do not exist yet; its outcome drafter drafts past the verified
rows on its own states instead, as its trees do.) The name keeps SSD's seam apart from ``speculators``, the
export format.

An ``OutcomeDrafter`` drafts chains; ``Sampling`` says how each token is drawn and ``OutcomeChain`` carries the
tokens with the law each was drawn from (what the verifier's ``min(1, p/q)`` rule must be told).

A draft that reads more of the verified sequence than its tokens (EAGLE-3: the target's features of every
committed token) learns it through ``absorb(verified(state))``, once per round in order; ``verified`` is
picklable, so a copy in another process is kept in step the same way. A draft model needs nothing: None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree

# (position j, logits z [V], q [V]) -> q': the law a chain's j-th token is actually drawn from
Reshape = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Sampling:
    """The sampling settings a draft token is drawn under (the engine's, ``DecodeState``), and the generator."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, state) -> Sampling:
        return cls(state.temperature, state.top_k, state.top_p, state.generator)

    def draw(self, z: torch.Tensor, reshape: Reshape | None = None, position: int = 0
             ) -> tuple[int, torch.Tensor | None]:
        """One token from logits ``z [V]``: the argmax at T = 0 (no law to report), else a draw from
        ``q = logits_to_probs(z)`` (reshaped when asked), returned with the law it was drawn from."""
        tokens, q = self.draw_rows(z[None], reshape, position)
        return tokens[0], None if q is None else q[0]

    def draw_rows(self, z: torch.Tensor, reshape: Reshape | None = None, position: int = 0
                  ) -> tuple[list[int], torch.Tensor | None]:
        """One token per row of logits ``z [B, V]``, all at chain position ``position``: what ``draw`` does to
        each row, in one softmax, one reshape and one inverse-CDF pass (rows draw independently, each with its
        own uniform from the generator, in row order). Returns the tokens and the laws ``[B, V]`` (None at T = 0)."""
        if self.temperature == 0:
            return z.argmax(-1).tolist(), None
        q = logits_to_probs(z, self.temperature, self.top_k, self.top_p)  # [B, V]
        if reshape is not None:
            q = reshape(position, z, q)
        return sample(q, self.generator).tolist(), q


@dataclass
class OutcomeChain:
    """A chain drafted after a sequence: ``tokens [K]`` and, when sampled, ``probs [K, V]`` (row j: the law
    tokens[j] was drawn from)."""

    tokens: list[int]
    probs: torch.Tensor | None

    def tree(self, root: int) -> DraftTree:
        return DraftTree.chain(root, self.tokens, draft_probs=self.probs)


def draw_branches(step: Callable[[list[int]], torch.Tensor], tokens: list[int], depth: int, sampling: Sampling,
                  reshape: Reshape | None = None, stop: Callable[[], bool] | None = None) -> list[OutcomeChain] | None:
    """``len(tokens)`` chains of ``depth`` tokens drafted together (an ``OutcomeDrafter.branches`` loop): each step,
    ``step(last tokens) -> z [B, V]`` runs one draft row per branch consuming its last token, and each branch's
    next token is drawn from its row. ``stop()`` after every step: True abandons them (None)."""
    drafted: list[list[int]] = [[] for _ in tokens]
    laws: list[list[torch.Tensor]] = [[] for _ in tokens]
    for j in range(depth):
        z = step(tokens)  # [B, V]
        drawn, q = sampling.draw_rows(z, reshape, j)  # [B], [B, V] | None
        for b, tok in enumerate(drawn):
            drafted[b].append(tok)
            if q is not None:
                laws[b].append(q[b])
        tokens = [d[-1] for d in drafted]
        if stop is not None and stop():
            return None
    return [OutcomeChain(d, torch.stack(q) if q else None) for d, q in zip(drafted, laws)]


@runtime_checkable
class OutcomeDrafter(Protocol):
    """Drafts after any sequence, verified or hypothetical (see the module docstring)."""

    def chain(self, context: list[int], depth: int, sampling: Sampling, reshape: Reshape | None = None
              ) -> OutcomeChain:
        """``depth`` tokens drafted one after another after ``context`` (its last token is the root)."""
        ...

    def glue(self, context: list[int], chain: list[int]) -> torch.Tensor:
        """The draft's logits ``[K+1, V]`` after ``context`` and after each of ``chain``'s K tokens (one pass);
        ``branches`` then drafts from this chain's positions."""
        ...

    def branches(self, starts: list[tuple[int, int]], depth: int, sampling: Sampling,
                 reshape: Reshape | None = None, stop: Callable[[], bool] | None = None) -> list[OutcomeChain] | None:
        """After ``glue(context, chain)``: for each ``(j, t)`` a chain of ``depth`` tokens drafted after
        ``context + chain[:j] + [t]`` (all branches advance together). ``stop`` is asked after every step;
        True abandons the branches (returns None)."""
        ...

    def verified(self, state) -> object | None:
        """What a copy must be told of the verified sequence ``state`` (a ``DecodeState`` after prefill or after a
        round) besides its tokens, picklable; None when the tokens suffice."""
        ...

    def absorb(self, verified) -> None:
        """Take in ``verified(state)`` (this object's or another copy's): every round's, in order."""
        ...

    def portable(self) -> Callable[[], OutcomeDrafter]:
        """A picklable factory of an independent copy (its own weights and cache), for a worker process."""
        ...


@runtime_checkable
class DraftsOutcomes(Protocol):
    """A drafter that can draft after an unverified outcome: it hands out an ``OutcomeDrafter``. Not part of the
    ``Drafter`` seam (most drafters only draft from verified state); SSD checks its base for it."""

    def outcome_drafter(self, target) -> OutcomeDrafter:
        """A ``OutcomeDrafter`` drafting beside ``target`` after any sequence."""
        ...
