"""EAGLE-2 dynamic draft trees: grow a candidate pool level by level, then keep the best-scoring nodes.

Split from ``decoding.tree`` because the token budget (``decoding.budget``) builds on the tree structure
while the tree builder consults the budget: the structure stays at the bottom of the import graph.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftlab.decoding.budget import TreeBudget
from draftlab.decoding.tree import DraftTree, children_lists


@dataclass
class FrontierBatch:
    """The nodes ``build_dynamic_tree`` asks the drafter to expand at one depth.

    Indices refer to the growing candidate list: candidate 0 is the root, later candidates are appended
    level by level in generation order, so ``parents[i] < node_ids[i]``. All tensors are on the CPU.

    - ``node_ids``: ``LongTensor[F]`` the frontier nodes' candidate indices.
    - ``tokens``: ``LongTensor[F]`` their token ids.
    - ``parents``: ``LongTensor[F]`` their parents' candidate indices (-1 for the root).
    - ``depth``: the common depth of the frontier nodes (0 for the root's expansion).
    - ``ancestor_mask``: ``BoolTensor[F, C]`` over all ``C`` candidates generated so far (the frontier
      included): True at each node itself and at its ancestors.
    - ``scores``: ``Tensor[F]`` cumulative draft log-probabilities (0 for the root).
    """

    node_ids: torch.Tensor  # [F]
    tokens: torch.Tensor  # [F]
    parents: torch.Tensor  # [F]
    depth: int
    ancestor_mask: torch.Tensor  # [F, C]
    scores: torch.Tensor  # [F]

    @property
    def num_candidates(self) -> int:
        """``C``: candidates generated so far, root included."""
        return int(self.ancestor_mask.shape[1])


@dataclass
class TopCandidates:
    """What ``expand`` may return instead of ``[F, V]`` log-probs: each frontier row's best children, already
    chosen by the drafter (e.g. a top-k inside a reduced draft vocabulary, mapped to target ids only for the
    chosen ones).

    - ``logprobs``: ``Tensor[F, k]`` each row's log-probs in descending order (as ``torch.topk`` returns them).
    - ``tokens``: ``LongTensor[F, k]`` their target token ids.

    ``k`` may be below ``branching`` (a vocabulary smaller than ``branching``); columns past ``branching`` are ignored.
    It must be what ``torch.topk`` over the full log-probs would give, up to the non-finite entries that
    ``build_dynamic_tree`` drops anyway: then the tree is the same as from the full log-probs.
    """

    logprobs: torch.Tensor  # [F, k]
    tokens: torch.Tensor  # [F, k]


def _best_first(parents: list[int], scores: list[float], nodes: int) -> list[int]:
    """Best-first selection from the root (a node is eligible once its parent is selected; ties broken by
    generation order): the candidates kept, root first, in selection order."""
    children = children_lists(parents)
    heap = [(-scores[c], c) for c in children[0]]
    heapq.heapify(heap)
    selected = [0]
    while heap and len(selected) < nodes + 1:
        _, node = heapq.heappop(heap)
        selected.append(node)
        for child in children[node]:
            heapq.heappush(heap, (-scores[child], child))
    return selected


class _Pool:
    """The candidate pool on the host: candidate 0 is the root, children are appended level by level."""

    def __init__(self, root_token: int, branching: int, depth: int):
        size = 1 + branching + max(depth - 1, 0) * branching * branching
        self.tokens = torch.empty(size, dtype=torch.long)  # [Cmax]
        self.parents = torch.empty(size, dtype=torch.long)  # [Cmax]
        self.depth = torch.empty(size, dtype=torch.long)  # [Cmax]
        self.scores = torch.empty(size, dtype=torch.float32)  # [Cmax]
        self.tokens[0], self.parents[0], self.depth[0], self.scores[0] = int(root_token), -1, 0, 0.0
        self.ancestors = torch.zeros(size, size, dtype=torch.bool)  # [Cmax, Cmax]
        self.ancestors[0, 0] = True
        self.num = 1  # candidates so far

    def batch(self, frontier: torch.Tensor, level: int) -> FrontierBatch:
        return FrontierBatch(
            node_ids=frontier.clone(),  # the drafter's own copy: ``frontier`` is read again by the caller
            tokens=self.tokens[frontier],
            parents=self.parents[frontier],
            depth=level,
            ancestor_mask=self.ancestors[frontier, :self.num],  # [F, C] (a copy: advanced indexing)
            scores=self.scores[frontier],
        )

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, level: int,
            branching: int) -> torch.Tensor:
        """Append ``m`` children of ``level``; returns the next frontier (the ``branching`` best new ids)."""
        num, m = self.num, scores.shape[0]
        new = slice(num, num + m)
        self.tokens[new], self.parents[new], self.depth[new], self.scores[new] = tokens, parents, level + 1, scores
        self.ancestors[new] = self.ancestors[parents]
        self.ancestors[new, new].fill_diagonal_(True)
        self.num += m
        if m <= branching:
            return torch.arange(num, num + m)
        # A stable sort keeps generation order on ties.
        order = torch.sort(scores, descending=True, stable=True).indices[:branching]  # [branching]
        return order.sort().values + num


def _top_children(out: torch.Tensor | TopCandidates, f: int, branching: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frontier row's best ``<= branching`` children from ``expand``'s answer: log-probs and ids ``[F, k]``."""
    if isinstance(out, TopCandidates):
        top_vals, top_ids = out.logprobs, out.tokens
        if top_vals.ndim != 2 or top_vals.shape[0] != f or top_ids.shape != top_vals.shape:
            raise ValueError(f"expand must return TopCandidates of [F={f}, k] log-probs and tokens, got "
                             f"{tuple(top_vals.shape)} and {tuple(top_ids.shape)}")
        return top_vals[:, :branching].detach().float(), top_ids[:, :branching]  # [F, k]
    if out.ndim != 2 or out.shape[0] != f:
        raise ValueError(f"expand must return [F={f}, V] log-probs, got {tuple(out.shape)}")
    # top-k on the drafter's device; only the small [F, k] result comes back to the host.
    return torch.topk(out.detach().float(), min(branching, out.shape[-1]), dim=-1)  # [F, k]


def _grow(pool: _Pool, expand, *, branching: int, levels: int, nodes: int, budget: TreeBudget | None) -> int:
    """The expansion phase; returns the number of levels expanded."""
    frontier = torch.zeros(1, dtype=torch.long)  # [F] candidate ids, in generation order
    run = 0
    for level in range(levels):
        batch = pool.batch(frontier, level)
        top_vals, top_ids = _top_children(expand(batch), frontier.shape[0], branching)
        k = top_vals.shape[1]
        child_scores = (batch.scores[:, None] + top_vals.cpu()).reshape(-1)  # [F*k] in generation order
        child_tokens = top_ids.cpu().to(torch.long).reshape(-1)  # [F*k]
        child_parents = frontier.repeat_interleave(k)  # [F*k]
        # Drop NaN and -inf (an impossible token); +inf stays, as it always did.
        finite = child_scores > float("-inf")  # [F*k]
        if not bool(finite.all()):
            keep = finite.nonzero().flatten()  # [M]
            child_scores, child_tokens, child_parents = child_scores[keep], child_tokens[keep], child_parents[keep]
        if child_scores.shape[0] == 0:
            break
        frontier = pool.add(child_tokens, child_parents, child_scores, level, branching)
        run = level + 1
        if budget is not None and run < levels:
            ranked = torch.sort(pool.scores[1:pool.num], descending=True).values[:nodes].exp()  # [<=N]
            if not budget.keep_growing(ranked, pool.scores[frontier].exp(), run):
                break
    return run


def _select(pool: _Pool, nodes: int) -> torch.Tensor:
    """The kept candidates, root first, in best-first order (any prefix is ancestor-closed).

    Vectorised: best-first selection equals the prefix of all candidates sorted by (score descending,
    generation order) whenever every node of that prefix comes after its parent in it, which holds
    whenever log-probs are <= 0; otherwise (an ``expand`` returning positive "log-probs") the best-first
    search itself runs.
    """
    num = pool.num
    scores, parents_all = pool.scores[1:num], pool.parents[:num]
    ranked = torch.sort(scores, descending=True, stable=True).indices + 1  # [C-1] candidate ids, best first
    rank = torch.empty(num, dtype=torch.long)  # [C]
    rank[0] = -1
    rank[ranked] = torch.arange(num - 1)
    taken = ranked[:nodes]  # [n]
    if bool((rank[parents_all[taken]] < rank[taken]).all()):
        return torch.cat([torch.zeros(1, dtype=torch.long), taken])  # [N], root first, best first
    # A child outranks its parent: only the best-first search is ancestor-closed.
    return torch.tensor(_best_first(parents_all.tolist(), pool.scores[:num].tolist(), nodes), dtype=torch.long)


def build_dynamic_tree(
    root_token: int,
    expand: Callable[[FrontierBatch], torch.Tensor | TopCandidates],
    *,
    branching: int,
    depth: int,
    nodes: int,
    budget: TreeBudget | None = None,
) -> DraftTree:
    """Grow an EAGLE-2 dynamic draft tree (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models
    with Dynamic Draft Trees", arXiv:2406.16858).

    ``expand(frontier) -> logprobs [F, V]`` returns the drafter's log-probabilities of the token that
    follows each frontier node; it is called once per depth (``depth`` calls at most). It may instead
    return ``TopCandidates`` (each row's best children, already chosen): a drafter with a reduced
    vocabulary then never materialises log-probs over the whole target vocabulary.

    Algorithm (a node's score is its cumulative draft log-probability, the sum of ``logprobs`` along its
    root path, which approximates the chance that the target accepts the whole path):

    1. Expansion phase. Depth 1: expand the root, its ``branching`` most probable tokens become candidates
       and the frontier. Each further depth: expand every frontier node into its ``branching`` most probable
       children (up to ``branching**2`` new candidates); ALL of them join the candidate pool, and the
       ``branching`` with the best scores form the next frontier. Stop after ``depth`` levels.
    2. Reranking phase. Keep the ``nodes`` best-scoring candidates of the whole pool (root
       excluded from the count). Child scores never exceed their parent's (log-probs are <= 0), so the
       global top set is closed under ancestors; selection is done best-first from the root (a node is
       eligible only once its parent is selected, ties broken by generation order) so that ties and
       rounding can never orphan a node.
    3. The kept nodes are re-indexed in topological order (by depth, then generation order) with parents
       remapped.

    Candidates with a non-finite score (a ``-inf`` log-prob, e.g. a token outside a reduced draft
    vocabulary) are dropped; if a frontier empties, growth stops early. Proposals are chosen
    deterministically, so the tree has ``deterministic=True`` and ``draft_probs=None``: the verifier must
    use the deterministic-candidate rule, not ``min(1, p/q)``.

    ``budget`` (``tree: auto``, see ``decoding.budget``): ``nodes`` becomes a cap, growth stops once
    another level cannot pay for itself, and the kept prefix of the best-first order is the size with the
    most expected tokens per second.
    """
    if branching < 1 or depth < 0 or nodes < 0:
        raise ValueError(f"need branching >= 1, depth >= 0, nodes >= 0; got {branching}, {depth}, {nodes}")
    pool = _Pool(root_token, branching, depth)
    levels = depth if nodes > 0 else 0
    if budget is not None:
        expand = budget.timed(expand)
    run = _grow(pool, expand, branching=branching, levels=levels, nodes=nodes, budget=budget)
    selected = _select(pool, nodes)
    if budget is not None:  # any prefix of the selection order is ancestor-closed
        selected = selected[:1 + budget.choose(pool.scores[selected[1:]].exp(), run)]
    # Topological order: by depth, then generation order.
    num = pool.num
    selected = selected[torch.sort(pool.depth[selected] * num + selected).indices]  # [N]
    new_index = torch.empty(num, dtype=torch.long)  # [C]
    new_index[selected] = torch.arange(selected.shape[0])
    parents = new_index[pool.parents[selected].clamp(min=0)]  # [N]
    parents[0] = -1
    return DraftTree(pool.tokens[selected], parents, pool.depth[selected], None, deterministic=True,
                     path_probs=pool.scores[selected].exp())
