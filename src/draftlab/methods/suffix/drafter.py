"""Suffix decoding (Oliaro et al., 2024; ArcticInference, vLLM ``method: suffix``): a training-free drafter
that speculates from suffix tries over the current request and over earlier outputs.

Each round, the longest suffix of the context that occurred before is matched in two tries: one over
this request's prompt and output so far, one over the outputs of earlier requests (the last
``max_cached_requests``). From the matched node a speculation tree is grown best first: a candidate's
score is the product of the empirical next-token probabilities along its path (a child's count over
its siblings' total), the candidate with the highest score joins the tree next, candidates below ``min_token_prob``
are never taken, and the tree stops at ``min(nodes, ceil(max_spec_factor * match length))``
nodes. A longer match earns a longer speculation: it is more likely to continue as before. The tree whose
scores sum higher (the expected number of accepted tokens, if the scores were the acceptance
probabilities) is proposed. Candidates are chosen by counts, never sampled, so the verifier treats the
tree as deterministic and sampling stays exact.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import torch

from draftlab.decoding.budget import tree_budget
from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.tree import DraftTree
from draftlab.methods.suffix.suffix_trie import Node, SuffixTrie, next_token_probs


class SuffixDrafter(Drafter):
    """Suffix-trie speculation over the request and earlier outputs (see the module docstring).

    nodes                most draft nodes per round, the root excluded (vLLM's suffix decoding: max_spec_tokens)
    max_spec_factor      draft nodes allowed per matched pattern token
    min_token_prob       a candidate whose next-token probability is below this is not proposed
    max_pattern          longest context suffix matched (the tries index ``max_pattern + nodes``
                         tokens deep, so the longest match can still be continued by a full speculation)
    max_cached_requests  earlier outputs kept in the global trie (0: per-request only); the trie is rebuilt
                         from the kept outputs when one is evicted
    tree                 ``fixed``: the whole speculation; ``auto``: its best-first prefix with the most expected
                         tokens per second under the target's measured verify cost (``decoding.budget``)
    """

    def __init__(self, nodes: int = 16, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_pattern: int = 16, max_cached_requests: int = 64, tree: str = "fixed"):
        if (nodes < 1 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_pattern < 1
                or max_cached_requests < 0):
            raise ValueError("need nodes >= 1, max_spec_factor > 0, 0 <= min_token_prob <= 1, "
                             f"max_pattern >= 1, max_cached_requests >= 0; got {nodes}, {max_spec_factor}, "
                             f"{min_token_prob}, {max_pattern}, {max_cached_requests}")
        self.nodes, self.max_spec_factor = nodes, max_spec_factor
        self.min_token_prob, self.max_pattern, self.max_cached_requests = min_token_prob, max_pattern, max_cached_requests
        self.max_depth = max_pattern + nodes
        self.past_outputs: deque[list[int]] = deque()
        self.global_trie = SuffixTrie(self.max_depth)
        self._request: SuffixTrie | None = None
        self._prompt_len = 0
        self._indexed = 0  # tokens of the current request in its trie
        self._tokens: list[int] = []
        self.budget = tree_budget(tree)  # no draft passes to time: the trie lookups cost next to nothing

    def scratch_rows(self, cfg) -> int:
        return 1 + self.nodes

    # ---- the drafter protocol ---------------------------------------------------------------------------

    def reset(self, state: DecodeState) -> None:
        self._finish_request()
        if self.budget is not None:
            self.budget.bind(state.target)
        self._request = SuffixTrie(self.max_depth)
        self._prompt_len = state.prompt_len
        self._indexed = 0
        self._index(state.tokens)

    def propose(self, state: DecodeState) -> DraftTree:
        self._index(state.tokens)
        best: tuple[float, list[int], list[int], list[float]] = (0.0, [], [], [])
        for trie in (self._request, self.global_trie):
            node, m = trie.match(state.tokens, self.max_pattern)
            if node is None:
                continue
            budget = min(self.nodes, math.ceil(self.max_spec_factor * m))
            tree = self._grow(node, budget)
            if tree[0] > best[0]:
                best = tree
        _, tokens, parents, scores = best
        if self.budget is not None and tokens:  # a prefix of the best-first order is still a tree
            self.budget.context = len(state.tokens)
            n = self.budget.choose(torch.tensor(scores), 0)
            tokens, parents, scores = tokens[:n], parents[:n], scores[:n]
        if not tokens:
            return DraftTree.chain(state.root, [])
        return DraftTree.from_parents(torch.tensor([state.root, *tokens]), torch.tensor([-1, *parents]),
                                      path_probs=torch.tensor([1.0, *scores]))

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        if self.budget is not None:
            self.budget.observe(len(out.result.path) - 1)
        self._index(state.tokens)

    # ---- internals --------------------------------------------------------------------------------------

    def _index(self, tokens: list[int]) -> None:
        # The request's trie follows the sequence: prompt, then each committed output token.
        self._request.extend(tokens[self._indexed:])
        self._indexed = len(tokens)
        self._tokens = tokens

    def _finish_request(self) -> None:
        # The finished request's output joins the global trie (its prompt does not: another request's
        # prompt says little about this one's answer, while answers repeat their phrasing).
        if self._request is None or self.max_cached_requests == 0:
            return
        output = list(self._tokens[self._prompt_len:])
        if not output:
            return
        self.past_outputs.append(output)
        if len(self.past_outputs) > self.max_cached_requests:
            self.past_outputs.popleft()
            self.global_trie = SuffixTrie(self.max_depth)
            for past in self.past_outputs:
                self.global_trie.start_sequence()
                self.global_trie.extend(past)
        else:
            self.global_trie.start_sequence()
            self.global_trie.extend(output)

    def _grow(self, start: Node, budget: int) -> tuple[float, list[int], list[int], list[float]]:
        """Best-first tree of at most ``budget`` nodes under ``start``: (score sum, tokens, parent indices
        with 0 = the root, scores), in selection order."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        total = 0.0
        heap: list[tuple[float, int, int, int, Node]] = []  # (-score, tie, parent index, token, node)
        tie = 0

        def push(node: Node, score: float, parent: int) -> None:
            nonlocal tie
            for token, (p, child) in next_token_probs(node).items():
                if p >= self.min_token_prob:
                    heapq.heappush(heap, (-score * p, tie, parent, token, child))
                    tie += 1

        push(start, 1.0, 0)
        while heap and len(tokens) < budget:
            neg, _, parent, token, node = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg)
            total -= neg
            push(node, -neg, len(tokens))
        return total, tokens, parents, scores
