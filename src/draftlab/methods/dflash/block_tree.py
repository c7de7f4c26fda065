"""Tree verification for block drafts: one DFlash block pass grown into a draft tree (``branching > 1``).

A block pass over ``[root, MASK x (B-1)]`` gives every slot ``t = 1..B-1`` a distribution ``q_t``. The slots
condition on the committed context and on mask tokens, never on one another's tokens, so ``q_t`` is the same
whatever token the tree holds at depth ``t-1``: given the pass, the slots are conditionally independent. A tree
can therefore hang several candidates of slot ``t`` under every kept node of depth ``t-1`` at no extra draft
cost (EAGLE-2's dynamic tree over a product of known laws; SGLang's DFlash tree verify does the same).

Shape. A node is a path of sibling ranks ``(r_1, .., r_t)``, ``0 <= r_s < branching``. Its score is
``prod_s w_s[r_s]``, where ``w_s[r]`` is the ``r``-th largest probability of slot ``s`` (the draft's softmax for
top-k trees, the sampling law ``q_s`` for drawn ones). The ``nodes`` best paths are kept best-first from the root
(a node is eligible once its parent is kept; ``w <= 1``, so a child never outscores its parent): any prefix of
that order is an ancestor-closed tree in topological order, and ``tree: auto`` keeps the prefix with the most
expected tokens per second (``decoding.budget``). Ranks with ``w = 0`` (outside a top-k / top-p support) never
enter. The shape is a function of the slots' laws alone and is fixed before any token is drawn.

Tokens, and why each mode is exact:

- Top-k (T = 0, or ``sampling="argmax"``): a rank-``r`` node holds its slot's ``r``-th most probable token.
  The candidates are chosen without the verifier's coins, so the tree is ``deterministic`` and the verifier's
  deterministic-candidate rule applies, exact for any such set (at T = 0 the greedy walk is AR, token for token).
- Drawn (T > 0, ``sampling="sample"``): under each parent the children, in index order, are drawn from ``q_t``
  without replacement (``x_j`` from ``q_t`` with ``x_1..x_{j-1}`` zeroed and renormalised), and that
  conditional law is ``x_j``'s reported ``draft_probs`` row. The verifier's sampled (multi-draft) rule needs each
  ``x_j`` distributed as its reported row given everything before it: the shape was fixed from the laws, the
  draw of ``x_j`` uses fresh randomness given exactly the earlier siblings (never the verifier's coins, which are
  drawn after the tree), and each parent's children are drawn independently of every other parent's, so the
  law of ``x_j`` given the earlier siblings, their rejections and the other subtrees is that row. Two slips
  break it: reporting the unconditional ``q_t`` for a later sibling (it can never repeat an earlier one, which
  ``q_t`` says it could), and deciding a node's presence from its drawn token's probability (the rule of
  ``decoding.drafter``). Without replacement rather than i.i.d.: exact either way, but no verify row is spent on
  a sibling that repeats a token.

The rank values only choose the shape (and feed the budget's estimate, which it calibrates online); for drawn
trees ``w_s[r]`` is the score a top-k tree of the same shape would have, a heuristic of how likely that sibling is.
"""

from __future__ import annotations

import heapq

import torch

from draftlab.decoding.budget import TreeBudget
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree


def max_nodes(slots: int, branching: int, cap: int) -> int:
    """Nodes of the full tree over ``slots`` slots with ``branching`` children each (root excluded), at most ``cap``."""
    total, level = 0, 1
    for _ in range(slots):
        level *= branching
        total += level
        if total >= cap:
            return cap
    return total


def best_first(weights: list[list[float]], nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The ``nodes`` best rank paths, root first, best first: ``(parents, ranks, path scores)``.

    ``weights[s][r]``: slot ``s``'s rank-``r`` value (descending in ``r``; ``<= 0`` = no such rank). Equal scores
    go to the earlier pushed candidate, so siblings come in rank order.
    """
    parents, ranks, depth, score = [-1], [-1], [0], [1.0]
    heap: list[tuple[float, int, int, int]] = []
    pushed = 0

    def push(node: int) -> None:
        nonlocal pushed
        if depth[node] < len(weights):
            for r, w in enumerate(weights[depth[node]]):
                if w > 0:
                    heapq.heappush(heap, (-score[node] * w, pushed, node, r))
                    pushed += 1

    push(0)
    while heap and len(parents) <= nodes:
        neg, _, parent, r = heapq.heappop(heap)
        parents.append(parent)
        ranks.append(r)
        depth.append(depth[parent] + 1)
        score.append(-neg)
        push(len(parents) - 1)
    return parents, ranks, score


def block_tree(root: int, logits: torch.Tensor, *, branching: int, nodes: int, temperature: float,
               top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
               sampling: str = "sample", budget: TreeBudget | None = None) -> DraftTree:
    """The round's tree from a block's slot logits ``[bs-1, V]`` (see the module docstring)."""
    drawn = temperature != 0 and sampling != "argmax"
    probs = logits_to_probs(logits, temperature, top_k, top_p) if drawn else logits.float().softmax(-1)  # [S, V]
    values, ids = torch.topk(probs, min(branching, probs.shape[-1]), dim=-1)  # [S, b]
    parents, ranks, score = best_first(values.tolist(), nodes)
    if budget is not None:  # a prefix of the best-first order is a tree; decided before anything is drawn
        keep = 1 + budget.choose(torch.tensor(score[1:], dtype=torch.float64), 0)
        parents, ranks, score = parents[:keep], ranks[:keep], score[:keep]
    tree = DraftTree.from_parents([root] * len(parents), parents, path_probs=torch.tensor(score))
    if len(parents) == 1:
        return tree  # root only: nothing proposed, nothing to draw
    slot = (tree.depth[1:] - 1).to(probs.device)  # [N-1]
    if not drawn:
        tree.tokens[1:] = ids[slot, torch.tensor(ranks[1:], device=probs.device)].cpu()
        return tree
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    tokens, rows = draw_siblings(probs, slot.to(probs.device), parents, generator)  # [N-1], [N-1, V]
    tree.tokens[1:] = tokens.cpu()
    tree.draft_probs = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])  # [N, V], row 0 unused
    tree.deterministic = False
    return tree


def draw_siblings(probs: torch.Tensor, slot: torch.Tensor, parents: list[int], generator: torch.Generator | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each non-root node's token ``[N-1]`` and the law it was drawn from ``[N-1, V]``: the first child of a
    parent from its slot's ``probs [S, V]``, each later child from its previous sibling's law with that sibling's
    token removed, renormalised (without replacement). One batched draw per sibling position."""
    previous, position, last = [-1] * len(parents), [0] * len(parents), {}
    for i in range(1, len(parents)):
        if parents[i] in last:
            previous[i], position[i] = last[parents[i]], position[last[parents[i]]] + 1
        last[parents[i]] = i
    tokens = torch.empty(len(parents) - 1, dtype=torch.long, device=probs.device)  # [N-1]
    rows = probs[slot].clone()  # [N-1, V]
    for j in range(max(position) + 1):
        at = [i - 1 for i in range(1, len(parents)) if position[i] == j]
        idx = torch.tensor(at, device=probs.device)  # [m]
        if j > 0:
            before = torch.tensor([previous[i + 1] - 1 for i in at], device=probs.device)  # [m]
            law = rows[before].scatter(1, tokens[before, None], 0.0)  # [m, V]
            rows[idx] = law / law.sum(-1, keepdim=True)
        tokens[idx] = sample(rows[idx], generator)
    return tokens, rows
