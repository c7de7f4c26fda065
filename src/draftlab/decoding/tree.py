"""Draft trees: the one structure every drafter hands to the verifier, and the index helpers around it.

EAGLE-2 dynamic tree building lives in ``decoding.dynamic_tree``.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
