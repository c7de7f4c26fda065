"""Draft trees: the one structure every drafter hands to the verifier, plus EAGLE-2 dynamic tree building.

Conventions (the engine and the verifier rely on them):

- Node 0 is the ROOT: the last committed token whose KV is not yet in the target cache (the previous
  round's bonus token). Nodes ``1..N-1`` are proposals.
- Nodes are in topological order: ``parents[0] == -1`` and ``parents[i] < i``; ``depth[0] == 0`` and
  ``depth[i] == depth[parents[i]] + 1``.
- The target's logits row ``i`` in the verify pass is the distribution of the token that follows node
  ``i``; so a chain ``root, x1, .., xK`` is verified with K+1 rows, exactly like a chain of K drafts plus
  the bonus position in the Leviathan et al. formulation.
- ``draft_probs[i]`` is the distribution node ``i`` was SAMPLED from (``q(. | parent(i))``, conditioned on
  any siblings drawn before it if the drafter samples without replacement); row 0 is unused. It is only
  meaningful for sampled proposals: a tree whose candidates were chosen deterministically (top-k,
  argmax, n-gram lookup) sets ``deterministic=True`` and the verifier then ignores ``draft_probs``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # budget -> cost -> tree
    from draftlab.decoding.budget import TreeBudget

IntsLike = torch.Tensor | Sequence[int]


def _as_long(values: IntsLike) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(torch.long)
    return torch.tensor(list(values), dtype=torch.long)


def _depths_from_parents(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _check_parents(parents: list[int]) -> None:
    if not parents:
        raise ValueError("a draft tree needs at least the root node")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parents[0]}")
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(
                f"nodes must be in topological order with parents[i] < i; node {i} has parent {parent}"
            )


@dataclass
class DraftTree:
    """Proposed tokens for one verify pass, rooted at the last committed (not yet cached) token.

    ``deterministic`` defaults to ``draft_probs is None``: passing draft probabilities means the
    proposals were sampled from them. Set it explicitly to ``True`` when the candidates were chosen
    deterministically even though draft probabilities are at hand (e.g. EAGLE's top-k trees).

    ``path_probs`` (optional) is the drafter's own estimate, per node, that the target accepts the node's
    whole path (EAGLE-2's cumulative draft probability, a suffix trie's count ratio; 1 at the root). The
    verifier never reads it; composite drafters and reports do (``expected_tokens``).
    """

    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    draft_probs: torch.Tensor | None = None  # [N, V]
    deterministic: bool | None = None
    path_probs: torch.Tensor | None = None  # [N]

    def __post_init__(self) -> None:
        # Shape checks only: value checks (topological order) would force a device sync every round and
        # live in ``from_parents``.
        if self.deterministic is None:
            self.deterministic = self.draft_probs is None
        n = self.tokens.shape[0] if self.tokens.ndim == 1 else -1
        if n < 1 or self.parents.shape != (n,) or self.depth.shape != (n,):
            raise ValueError(
                f"tokens, parents and depth must be 1-D of equal length >= 1, got shapes "
                f"{tuple(self.tokens.shape)}, {tuple(self.parents.shape)}, {tuple(self.depth.shape)}"
            )
        if self.draft_probs is not None and (self.draft_probs.ndim != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs must be [N={n}, V], got {tuple(self.draft_probs.shape)}")
        if not self.deterministic and self.draft_probs is None:
            raise ValueError("a sampled (deterministic=False) tree needs draft_probs")
        if self.path_probs is not None and self.path_probs.shape != (n,):
            raise ValueError(f"path_probs must be [N={n}], got {tuple(self.path_probs.shape)}")

    @property
    def size(self) -> int:
        """Number of nodes N, root included."""
        return int(self.tokens.shape[0])

    @property
    def expected_tokens(self) -> float | None:
        """The drafter's expected number of accepted draft tokens, ``sum(path_probs[1:])`` (None: no estimate)."""
        return None if self.path_probs is None else float(self.path_probs[1:].sum())

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for a root-only tree)."""
        return int(self.depth.max())

    def to(self, device: torch.device | str) -> DraftTree:
        """Copy of the tree with every tensor on ``device``."""
        return DraftTree(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            depth=self.depth.to(device),
            draft_probs=None if self.draft_probs is None else self.draft_probs.to(device),
            deterministic=self.deterministic,
            path_probs=None if self.path_probs is None else self.path_probs.to(device),
        )

    @classmethod
    def from_parents(
        cls,
        tokens: IntsLike,
        parents: IntsLike,
        draft_probs: torch.Tensor | None = None,
        deterministic: bool | None = None,
        path_probs: torch.Tensor | None = None,
    ) -> DraftTree:
        """Build a tree from node tokens (``tokens[0]`` is the root) and parent indices.

        Depths are computed from ``parents``. Raises ``ValueError`` unless ``parents[0] == -1`` and
        ``0 <= parents[i] < i`` for every other node (topological order), or if the lengths differ.
        """
        tokens_t = _as_long(tokens)
        parents_t = _as_long(parents).to(tokens_t.device)
        if tokens_t.ndim != 1 or parents_t.shape != tokens_t.shape:
            raise ValueError(
                f"tokens and parents must be 1-D of equal length, got {tuple(tokens_t.shape)} "
                f"and {tuple(parents_t.shape)}"
            )
        parent_list = parents_t.tolist()
        _check_parents(parent_list)
        depth = torch.tensor(_depths_from_parents(parent_list), dtype=torch.long, device=parents_t.device)
        return cls(tokens_t, parents_t, depth, draft_probs, deterministic, path_probs)

    @classmethod
    def chain(
        cls,
        root_token: int,
        tokens: IntsLike,
        draft_probs: torch.Tensor | None = None,
        deterministic: bool | None = None,
    ) -> DraftTree:
        """A linear draft ``root -> tokens[0] -> tokens[1] -> ...``.

        ``draft_probs`` may be ``[K, V]`` (one row per proposed token, the usual drafter output) or
        ``[K+1, V]`` (already in tree layout with an unused row 0); a ``[K, V]`` input gets a zero row
        prepended for the root.
        """
        proposals = _as_long(tokens).reshape(-1)  # [K]
        k = proposals.shape[0]
        all_tokens = torch.cat([proposals.new_tensor([int(root_token)]), proposals])  # [K+1]
        parents = torch.arange(-1, k, dtype=torch.long, device=proposals.device)  # [K+1]
        depth = torch.arange(0, k + 1, dtype=torch.long, device=proposals.device)  # [K+1]
        if draft_probs is not None and draft_probs.shape[0] == k:
            draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[-1]), draft_probs])  # [K+1, V]
        return cls(all_tokens, parents, depth, draft_probs, deterministic)


def ancestor_mask(parents: IntsLike) -> torch.Tensor:
    """``BoolTensor[N, N]`` whose row ``i`` is True at ``j`` iff ``j == i`` or ``j`` is an ancestor of ``i``.

    This is the tree-attention mask among the draft nodes (each node sees itself and its ancestors).
    """
    parents_t = _as_long(parents)  # [N]
    n = parents_t.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents_t.device)  # [N, N]
    rows = torch.arange(n, device=parents_t.device)  # [N]
    ancestor = parents_t.clone()  # [N]
    # One vectorised hop up the tree per iteration: max_depth iterations, not N. The bound guards
    # against a malformed (cyclic) parents array spinning forever.
    for _ in range(n):
        valid = ancestor >= 0  # [N]
        if not bool(valid.any()):
            break
        mask[rows[valid], ancestor[valid]] = True
        ancestor = torch.where(valid, parents_t[ancestor.clamp(min=0)], ancestor)  # [N]
    return mask


def children_lists(parents: IntsLike) -> list[list[int]]:
    """Children of every node, each list in increasing index order."""
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    children: list[list[int]] = [[] for _ in parent_list]
    for i, parent in enumerate(parent_list):
        if parent >= 0:
            children[parent].append(i)
    return children


def root_to_leaf_paths(parents: IntsLike) -> list[list[int]]:
    """Every root-to-leaf path as node indices (starting with 0), leaves in increasing index order.

    A root-only tree has the single path ``[[0]]``.
    """
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    children = children_lists(parent_list)
    paths = []
    for leaf, kids in enumerate(children):
        if kids:
            continue
        path = [leaf]
        while parent_list[path[-1]] >= 0:
            path.append(parent_list[path[-1]])
        paths.append(path[::-1])
    return paths


def retrieve_indices(parents: IntsLike) -> torch.Tensor:
    """EAGLE's ``retrieve_indices``: ``LongTensor[n_leaves, max_depth + 1]``, one root-to-leaf path per
    row (leaves in increasing index order), right-padded with -1."""
    paths = root_to_leaf_paths(parents)
    width = max(len(path) for path in paths)
    out = torch.full((len(paths), width), -1, dtype=torch.long)  # [n_leaves, max_depth+1]
    for row, path in enumerate(paths):
        out[row, : len(path)] = torch.tensor(path, dtype=torch.long)
    return out


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

    ``k`` may be below ``top_k`` (a vocabulary smaller than ``top_k``); columns past ``top_k`` are ignored.
    It must be what ``torch.topk`` over the full log-probs would give, up to the non-finite entries that
    ``build_dynamic_tree`` drops anyway: then the tree is the same as from the full log-probs.
    """

    logprobs: torch.Tensor  # [F, k]
    tokens: torch.Tensor  # [F, k]


def _best_first(parents: list[int], scores: list[float], total_tokens: int) -> list[int]:
    """Best-first selection from the root (a node is eligible once its parent is selected; ties broken by
    generation order): the candidates kept, root first, in selection order."""
    children = children_lists(parents)
    heap = [(-scores[c], c) for c in children[0]]
    heapq.heapify(heap)
    selected = [0]
    while heap and len(selected) < total_tokens + 1:
        _, node = heapq.heappop(heap)
        selected.append(node)
        for child in children[node]:
            heapq.heappush(heap, (-scores[child], child))
    return selected


def build_dynamic_tree(
    root_token: int,
    expand: Callable[[FrontierBatch], torch.Tensor | TopCandidates],
    *,
    top_k: int,
    depth: int,
    total_tokens: int,
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

    1. Expansion phase. Depth 1: expand the root, its ``top_k`` most probable tokens become candidates
       and the frontier. Each further depth: expand every frontier node into its ``top_k`` most probable
       children (up to ``top_k**2`` new candidates); ALL of them join the candidate pool, and the
       ``top_k`` with the best scores form the next frontier. Stop after ``depth`` levels.
    2. Reranking phase. Keep the ``total_tokens`` best-scoring candidates of the whole pool (root
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

    ``budget`` (``tree: auto``, see ``decoding.budget``): ``total_tokens`` becomes a cap, growth stops once
    another level cannot pay for itself, and the kept prefix of the best-first order is the size with the
    most expected tokens per second.

    The bookkeeping is vectorised (no Python per candidate). Best-first selection equals the prefix of all
    candidates sorted by (score descending, generation order) whenever every node of that prefix comes
    after its parent in it, which holds whenever log-probs are <= 0; otherwise (an ``expand`` returning
    positive "log-probs") the best-first search itself runs.
    """
    if top_k < 1 or depth < 0 or total_tokens < 0:
        raise ValueError(f"need top_k >= 1, depth >= 0, total_tokens >= 0; got {top_k}, {depth}, {total_tokens}")

    max_candidates = 1 + top_k + max(depth - 1, 0) * top_k * top_k
    cand_tokens = torch.empty(max_candidates, dtype=torch.long)  # [Cmax]
    cand_parents = torch.empty(max_candidates, dtype=torch.long)  # [Cmax]
    cand_depth = torch.empty(max_candidates, dtype=torch.long)  # [Cmax]
    cand_scores = torch.empty(max_candidates, dtype=torch.float32)  # [Cmax]
    cand_tokens[0], cand_parents[0], cand_depth[0], cand_scores[0] = int(root_token), -1, 0, 0.0
    ancestors = torch.zeros(max_candidates, max_candidates, dtype=torch.bool)  # [Cmax, Cmax]
    ancestors[0, 0] = True
    frontier = torch.zeros(1, dtype=torch.long)  # [F] candidate ids, in generation order
    num = 1  # candidates so far

    levels = depth if total_tokens > 0 else 0
    if budget is not None:
        expand = budget.timed(expand)
    run = 0  # levels expanded
    for level in range(levels):
        f = frontier.shape[0]
        batch = FrontierBatch(
            node_ids=frontier.clone(),  # the drafter's own copy: ``frontier`` is read again below
            tokens=cand_tokens[frontier],
            parents=cand_parents[frontier],
            depth=level,
            ancestor_mask=ancestors[frontier, :num],  # [F, C] (a copy: advanced indexing)
            scores=cand_scores[frontier],
        )
        out = expand(batch)
        if isinstance(out, TopCandidates):
            top_vals, top_ids = out.logprobs, out.tokens
            if top_vals.ndim != 2 or top_vals.shape[0] != f or top_ids.shape != top_vals.shape:
                raise ValueError(f"expand must return TopCandidates of [F={f}, k] log-probs and tokens, got "
                                 f"{tuple(top_vals.shape)} and {tuple(top_ids.shape)}")
            top_vals, top_ids = top_vals[:, :top_k].detach().float(), top_ids[:, :top_k]  # [F, k]
        else:
            if out.ndim != 2 or out.shape[0] != f:
                raise ValueError(f"expand must return [F={f}, V] log-probs, got {tuple(out.shape)}")
            k = min(top_k, out.shape[-1])
            # top-k on the drafter's device; only the small [F, k] result comes back to the host.
            top_vals, top_ids = torch.topk(out.detach().float(), k, dim=-1)  # [F, k]
        k = top_vals.shape[1]
        child_scores = (batch.scores[:, None] + top_vals.cpu()).reshape(-1)  # [F*k] in generation order
        child_tokens = top_ids.cpu().to(torch.long).reshape(-1)  # [F*k]
        child_parents = frontier.repeat_interleave(k)  # [F*k]
        # Drop NaN and -inf (an impossible token); +inf stays, as it always did.
        finite = child_scores > float("-inf")  # [F*k]
        if not bool(finite.all()):
            keep = finite.nonzero().flatten()  # [M]
            child_scores, child_tokens, child_parents = child_scores[keep], child_tokens[keep], child_parents[keep]
        m = child_scores.shape[0]
        if m == 0:
            break
        new = slice(num, num + m)  # the new candidates' ids
        cand_tokens[new], cand_parents[new], cand_depth[new], cand_scores[new] = (
            child_tokens, child_parents, level + 1, child_scores)
        ancestors[new] = ancestors[child_parents]
        ancestors[new, new].fill_diagonal_(True)
        # Next frontier: the top_k new candidates by score; a stable sort keeps generation order on ties.
        if m <= top_k:
            frontier = torch.arange(num, num + m)
        else:
            order = torch.sort(child_scores, descending=True, stable=True).indices[:top_k]  # [top_k]
            frontier = order.sort().values + num
        num += m
        run = level + 1
        if budget is not None and run < levels:
            pool = torch.sort(cand_scores[1:num], descending=True).values[:total_tokens].exp()  # [<=N]
            if not budget.keep_growing(pool, cand_scores[frontier].exp(), run):
                break

    # Best-first selection from the root == global top-`total_tokens` when scores decrease along paths,
    # and always ancestor-closed.
    scores, parents_all = cand_scores[1:num], cand_parents[:num]
    ranked = torch.sort(scores, descending=True, stable=True).indices + 1  # [C-1] candidate ids, best first
    rank = torch.empty(num, dtype=torch.long)  # [C]
    rank[0] = -1
    rank[ranked] = torch.arange(num - 1)
    taken = ranked[:total_tokens]  # [n]
    if bool((rank[parents_all[taken]] < rank[taken]).all()):
        selected = torch.cat([torch.zeros(1, dtype=torch.long), taken])  # [N], root first, best first
    else:  # a child outranks its parent: only the best-first search is ancestor-closed
        selected = torch.tensor(_best_first(parents_all.tolist(), cand_scores[:num].tolist(), total_tokens),
                                dtype=torch.long)
    if budget is not None:  # any prefix of the selection order is ancestor-closed
        selected = selected[:1 + budget.choose(cand_scores[selected[1:]].exp(), run)]
    # Topological order: by depth, then generation order.
    selected = selected[torch.sort(cand_depth[selected] * num + selected).indices]  # [N]
    new_index = torch.empty(num, dtype=torch.long)  # [C]
    new_index[selected] = torch.arange(selected.shape[0])
    parents = new_index[cand_parents[selected].clamp(min=0)]  # [N]
    parents[0] = -1
    return DraftTree(cand_tokens[selected], parents, cand_depth[selected], None, deterministic=True,
                     path_probs=cand_scores[selected].exp())
