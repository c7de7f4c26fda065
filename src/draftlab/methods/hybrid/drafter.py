"""Hybrid drafting: one verify pass over the union of a learned draft's tree and a lookup drafter's tree.

A learned draft is good at what it was trained on; n-gram / suffix lookup is good at text that repeats
(code edits, summaries that quote their source, the answer's own phrasing). Merging both proposals into
one tree costs only the extra rows in the verify pass, and the verifier takes whichever branch the target
agrees with. Paths the two share become one branch (a trie over the token paths), so nothing is verified
twice.

The merged tree is deterministic (EAGLE-style top-k trees and lookup continuations both are), which is
what keeps sampling exact: the deterministic-candidate rule is exact for any candidate set chosen without
the verifier's coins. Components see the merged tree's ``VerifyOutput`` in ``update``; the ones here read
only what every tree shares (``kept``, ``accepted_aux``, ``state.tokens``). Components that add extra
verify rows (``extra_rows``) are not supported.

A learned drafter that sizes its tree (``tree: auto``) is told what the lookup tree brings to the same
pass (``TreeBudget.alongside``: its expected tokens and rows), so it keeps only the nodes that still pay.

Gating (``skip_learned_at``): the lookup proposes first, for next to nothing. When its tree already expects
at least ``skip_learned_at`` accepted tokens (``DraftTree.expected_tokens``: the suffix trie's count
ratios along each path), the learned draft's passes are skipped and only the lookup tree is verified:
a long, confident match is likely to be accepted as it stands, and the learned passes and their extra
verify rows would mostly pay for branches the walk never takes. The learned drafter still sees every
round's ``update`` (its cache must follow the sequence), so a skipped round costs it one accept pass.
Gating only chooses which deterministic candidates are verified, so exactness is untouched.
"""

from __future__ import annotations

import torch
from hydra.utils import get_class

from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput, closing_all
from draftlab.decoding.tree import DraftTree


def union_tree(trees: list[DraftTree]) -> tuple[DraftTree, list[list[int]]]:
    """The trie union of deterministic ``trees`` with one root; returns it and, per input tree, the merged
    index of each of its nodes."""
    root = int(trees[0].tokens[0])
    if any(int(t.tokens[0]) != root for t in trees):
        raise ValueError(f"trees to merge must share their root; got {[int(t.tokens[0]) for t in trees]}")
    if not all(t.deterministic for t in trees):
        raise ValueError("only deterministic trees can be merged: a sampled tree's min(1, p/q) rule needs the "
                         "distribution each node was drawn from, which a merged sibling set no longer has")
    tokens, parents = [root], [-1]
    index: dict[tuple[int, ...], int] = {(): 0}
    maps = []
    for tree in trees:
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        paths: list[tuple[int, ...]] = [()] * len(toks)
        where = [0] * len(toks)
        for i in range(1, len(toks)):  # parents come before their children in a DraftTree
            paths[i] = paths[pars[i]] + (toks[i],)
            if paths[i] not in index:
                index[paths[i]] = len(tokens)
                tokens.append(toks[i])
                parents.append(where[pars[i]])
            where[i] = index[paths[i]]
        maps.append(where)
    return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents)), maps


class HybridDrafter(Drafter):
    """Proposes the union of ``learned``'s and ``lookup``'s trees (see the module docstring).

    ``skip_learned_at``: rounds whose lookup tree expects at least this many accepted tokens verify the lookup
    tree alone (None: the learned draft runs every round)."""

    def __init__(self, learned: Drafter, lookup: Drafter, skip_learned_at: float | None = None):
        if skip_learned_at is not None and skip_learned_at <= 0:
            raise ValueError(f"skip_learned_at must be > 0 expected tokens or None, got {skip_learned_at}")
        self.learned, self.lookup = learned, lookup
        self.skip_learned_at = skip_learned_at
        # Per component (learned, lookup), the merged index of each node of its last tree; None: it proposed
        # nothing this round.
        self._maps: list[list[int] | None] = [None, None]
        self._rounds = self._learned_rounds = 0

    def taps(self, target):
        return self.learned.taps(target)

    def scratch_rows(self, cfg) -> int | None:
        rows = [d.scratch_rows(cfg) for d in (self.learned, self.lookup)]
        if None in rows:
            return None
        return rows[0] + rows[1] - 1  # one shared root

    def reset(self, state: DecodeState) -> None:
        self.learned.reset(state)
        self.lookup.reset(state)
        self._rounds = self._learned_rounds = 0

    def propose(self, state: DecodeState) -> DraftTree:
        self._rounds += 1
        lookup = self.lookup.propose(state)
        confident = lookup.expected_tokens or 0.0
        if self.skip_learned_at is not None and confident >= self.skip_learned_at:
            self._maps = [None, list(range(lookup.size))]
            return lookup
        self._learned_rounds += 1
        budget = getattr(self.learned, "budget", None)
        if budget is not None:  # a sized learned tree only adds nodes that pay beside the lookup's
            budget.alongside(confident, lookup.size - 1)
        merged, (learned_map, lookup_map) = union_tree([self.learned.propose(state), lookup])
        self._maps = [learned_map, lookup_map]
        return merged

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        # A component that sizes its trees (``tree: auto``) learns from the accepted nodes of its *own* tree,
        # not from those the other component proposed; its own update then finds the round accounted for.
        path = set(out.result.path[1:])
        for component, where in zip((self.learned, self.lookup), self._maps):
            budget = getattr(component, "budget", None)
            if budget is not None and where is not None:
                budget.observe(len(path.intersection(where[1:])))
        self.learned.update(state, out)
        self.lookup.update(state, out)

    def close(self) -> None:
        with closing_all(self.learned, self.lookup):  # it owns both components
            pass

    def sequence_stats(self) -> dict[str, float]:
        """Rounds decoded and rounds in which the learned draft ran (fewer with ``skip_learned_at``)."""
        return {"rounds": self._rounds, "learned_rounds": self._learned_rounds}


def learned_plus_lookup(draft, *, learned_target: str, lookup: Drafter, skip_learned_at: float | None = None,
                        **learned_kwargs) -> HybridDrafter:
    """The drafter factory of a hybrid method config: ``learned_target(draft, **learned_kwargs)`` (the
    learned method's own drafter settings, inherited from its config) merged with ``lookup``."""
    return HybridDrafter(get_class(learned_target)(draft, **learned_kwargs), lookup, skip_learned_at)
