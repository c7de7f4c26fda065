"""Prompt lookup decoding: proposes what followed the latest earlier match of the context's trailing n-gram."""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import DecodeState, Drafter
from draftlab.decoding.tree import DraftTree


class PromptLookupDrafter(Drafter):
    """n-gram lookup against the context (prompt + output so far), as in "prompt lookup decoding".

    The trailing n-gram (n from ``max_ngram`` down to ``min_ngram``) is searched for earlier in the context;
    the tokens that followed a match are proposed. With ``num_branches > 1`` the most recent distinct
    continuations become branches of a tree (common prefixes merged); otherwise a chain. Proposals are
    deterministic, so the verifier uses the deterministic-candidate rule when sampling.
    """

    def __init__(self, nodes: int = 8, max_ngram: int = 3, min_ngram: int = 1, num_branches: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.k, self.max_ngram, self.min_ngram, self.branches = nodes, max_ngram, min_ngram, num_branches

    def scratch_rows(self, cfg) -> int:
        return 1 + self.k * self.branches

    def _continuations(self, ctx: torch.Tensor) -> list[list[int]]:
        L = ctx.numel()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if L <= n:
                continue
            pattern = ctx[L - n:]
            windows = ctx[: L - 1].unfold(0, n, 1) if L - 1 >= n else ctx.new_empty(0, n)  # [L-n, n]
            starts = (windows == pattern).all(1).nonzero().flatten()
            conts, seen = [], set()
            for s in starts.flip(0).tolist():  # most recent match first
                follow = ctx[s + n: s + n + self.k].tolist()
                if follow and tuple(follow) not in seen:
                    seen.add(tuple(follow))
                    conts.append(follow)
                if len(conts) == self.branches:
                    break
            if conts:
                return conts
        return []

    def propose(self, state: DecodeState) -> DraftTree:
        ctx = torch.tensor(state.tokens, dtype=torch.long)
        conts = self._continuations(ctx)
        if len(conts) <= 1:
            return DraftTree.chain(state.root, conts[0] if conts else [])
        tokens, parents, index = [state.root], [-1], {}
        for cont in conts:  # merge shared prefixes into one trie
            parent = 0
            for j, t in enumerate(cont):
                key = tuple(cont[: j + 1])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = index[key]
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
