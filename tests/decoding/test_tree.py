from __future__ import annotations

import math

import pytest
import torch

from draftlab.decoding.dynamic_tree import FrontierBatch, build_dynamic_tree
from draftlab.decoding.tree import (
    DraftTree,
    ancestor_mask,
    children_lists,
    retrieve_indices,
    root_to_leaf_paths,
)

# root(0) -> 1, 2, 3 ; 2 -> 4, 5 ; 5 -> 6
PARENTS = [-1, 0, 0, 0, 2, 2, 5]


def test_from_parents_computes_depth_and_properties():
    tree = DraftTree.from_parents([10, 11, 12, 13, 14, 15, 16], PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert tree.size == 7 and tree.max_depth == 3
    assert tree.deterministic is True and tree.draft_probs is None


@pytest.mark.parametrize(
    "parents",
    [
        [0, 0, 1],  # root must have parent -1
        [-1, 0, 2],  # a node cannot be its own parent
        [-1, 2, 0],  # parent after child: not topological
        [-1, -1, 0],  # a second root
        [-1, 0],  # length mismatch with three tokens
    ],
)
def test_from_parents_rejects_malformed_trees(parents):
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2, 3], parents)
    with pytest.raises(ValueError):
        DraftTree.from_parents([], [])


def test_sampled_tree_needs_draft_probs():
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2], [-1, 0], deterministic=False)
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2], [-1, 0], draft_probs=torch.ones(3, 4))


def test_chain_layout_and_draft_prob_rows():
    q = torch.softmax(torch.randn(3, 8), -1)  # [K, V]
    tree = DraftTree.chain(5, [1, 2, 3], q)
    assert tree.tokens.tolist() == [5, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 2, 3]
    assert tree.deterministic is False
    assert tree.draft_probs.shape == (4, 8)
    torch.testing.assert_close(tree.draft_probs[1:], q)
    # Already in tree layout: kept as is.
    full = torch.softmax(torch.randn(4, 8), -1)
    assert torch.equal(DraftTree.chain(5, [1, 2, 3], full).draft_probs, full)
    # No draft probabilities: a deterministic chain (n-gram lookup, greedy draft).
    assert DraftTree.chain(5, torch.tensor([1, 2])).deterministic is True
    assert DraftTree.chain(5, []).size == 1


def test_ancestor_mask():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0],
            [1, 0, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(PARENTS), expected)
    assert torch.equal(ancestor_mask(torch.tensor(PARENTS)), expected)
    assert torch.equal(ancestor_mask([-1]), torch.ones(1, 1, dtype=torch.bool))


def test_children_paths_and_retrieve_indices():
    assert children_lists(PARENTS) == [[1, 2, 3], [], [4, 5], [], [], [6], []]
    assert root_to_leaf_paths(PARENTS) == [[0, 1], [0, 3], [0, 2, 4], [0, 2, 5, 6]]
    assert retrieve_indices(torch.tensor(PARENTS)).tolist() == [
        [0, 1, -1, -1],
        [0, 3, -1, -1],
        [0, 2, 4, -1],
        [0, 2, 5, 6],
    ]
    assert root_to_leaf_paths([-1]) == [[0]]
    assert retrieve_indices([-1]).tolist() == [[0]]


# ---- EAGLE-2 dynamic tree --------------------------------------------------------------------------

# Draft distribution of the next token given the current token (vocabulary of 4, no ties).
DRAFT = {
    0: [0.05, 0.60, 0.30, 0.05],
    1: [0.70, 0.05, 0.05, 0.20],
    2: [0.05, 0.15, 0.10, 0.70],
    3: [0.50, 0.40, 0.05, 0.05],
}


class FakeDrafter:
    """Log-probs that depend on the frontier node's token only; records every frontier it is shown."""

    def __init__(self, table=DRAFT):
        self.table = torch.tensor([table[t] for t in sorted(table)]).log()  # [V, V]
        self.calls: list[FrontierBatch] = []

    def __call__(self, frontier: FrontierBatch) -> torch.Tensor:
        self.calls.append(frontier)
        return self.table[frontier.tokens]  # [F, V]


def test_dynamic_tree_hand_checked():
    # Candidates in generation order (score = product of draft probs along the path):
    #   depth 1 (expand root, token 0):  c1=1 (.60)  c2=2 (.30)                       frontier c1, c2
    #   depth 2 (expand c1, c2):          c3=0 (.42)  c4=3 (.12)  c5=3 (.21)  c6=1 (.045) frontier c3, c5
    #   depth 3 (expand c3, c5):          c7=1 (.252) c8=2 (.126) c9=0 (.105) c10=1 (.084)
    # Global rerank: c1 .6 > c3 .42 > c2 .3 > c7 .252 > c5 .21 > c8 .126 > c4 .12 > c9 > c10 > c6.
    drafter = FakeDrafter()
    tree = build_dynamic_tree(0, drafter, branching=2, depth=3, nodes=5)
    # Kept {c1, c3, c2, c7, c5}, reindexed by (depth, generation order): c1 c2 | c3 c5 | c7.
    assert tree.tokens.tolist() == [0, 1, 2, 0, 3, 1]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.deterministic is True and tree.draft_probs is None
    assert ancestor_mask(tree.parents).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert retrieve_indices(tree.parents).tolist() == [[0, 2, 4, -1], [0, 1, 3, 5]]

    # What the drafter saw: one call per depth, with everything needed to run its own tree KV cache.
    assert len(drafter.calls) == 3
    root, level1, level2 = drafter.calls
    assert (root.node_ids.tolist(), root.tokens.tolist(), root.parents.tolist(), root.depth) == ([0], [0], [-1], 0)
    assert root.ancestor_mask.tolist() == [[True]]
    assert (level1.node_ids.tolist(), level1.tokens.tolist(), level1.parents.tolist(), level1.depth) == (
        [1, 2], [1, 2], [0, 0], 1)
    assert level1.ancestor_mask.int().tolist() == [[1, 1, 0], [1, 0, 1]]
    assert (level2.node_ids.tolist(), level2.tokens.tolist(), level2.parents.tolist(), level2.depth) == (
        [3, 5], [0, 3], [1, 2], 2)
    assert level2.num_candidates == 7
    assert level2.ancestor_mask.int().tolist() == [[1, 1, 0, 1, 0, 0, 0], [1, 0, 1, 0, 0, 1, 0]]
    torch.testing.assert_close(level2.scores, torch.tensor([math.log(0.42), math.log(0.21)]))


def test_dynamic_tree_larger_budget_adds_next_best():
    tree = build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=7)
    # Adds c8 (.126, child of c3) and c4 (.12, child of c1): c1 c2 | c3 c4 c5 | c7 c8.
    assert tree.tokens.tolist() == [0, 1, 2, 0, 3, 3, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3, 3]


def test_dynamic_tree_budget_above_candidates_keeps_all():
    tree = build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=100)
    assert tree.size == 1 + 2 + 2 * 4  # root + branching + (depth - 1) * branching**2
    assert tree.max_depth == 3


def test_dynamic_tree_degenerate_budgets_do_not_call_the_drafter():
    drafter = FakeDrafter()
    for kwargs in ({"depth": 0, "nodes": 5}, {"depth": 3, "nodes": 0}):
        tree = build_dynamic_tree(3, drafter, branching=2, **kwargs)
        assert tree.tokens.tolist() == [3] and tree.parents.tolist() == [-1]
    assert drafter.calls == []
    with pytest.raises(ValueError):
        build_dynamic_tree(3, drafter, branching=0, depth=2, nodes=4)


def test_dynamic_tree_ties_never_orphan_a_node():
    # Every log-prob is 0: all candidates tie with their ancestors. Whatever the budget, the kept set
    # must contain each kept node's parent, and the order must stay topological.
    uniform = FakeDrafter({t: [1.0, 1.0, 1.0, 1.0] for t in range(4)})
    for total in range(1, 12):
        tree = build_dynamic_tree(0, uniform, branching=3, depth=3, nodes=total)
        assert tree.size == total + 1
        assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()[1:], start=1))


def test_dynamic_tree_drops_impossible_tokens():
    # A reduced draft vocabulary: token 3 is never proposed (-inf log-prob), so with branching=4 only three
    # children per node exist.
    table = {t: [0.5, 0.3, 0.2, 0.0] for t in range(4)}
    tree = build_dynamic_tree(0, FakeDrafter(table), branching=4, depth=2, nodes=100)
    assert 3 not in tree.tokens.tolist()[1:]
    assert tree.size == 1 + 3 + 3 * 3


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_tree_is_the_global_top_by_cumulative_logprob(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, branching, depth, total = 9, 3, 4, 10
    table = torch.log_softmax(2 * torch.randn(vocab, vocab, generator=gen), -1)  # [V, V]

    def expand(frontier: FrontierBatch) -> torch.Tensor:
        return table[frontier.tokens]  # [F, V]

    tree = build_dynamic_tree(0, expand, branching=branching, depth=depth, nodes=total)
    assert tree.size == total + 1
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    # Recompute each kept node's score from its path, then check no discarded candidate beats the
    # weakest kept one: enumerate the candidate pool independently (EAGLE-2's beam).
    score = [0.0] * tree.size
    for i in range(1, tree.size):
        score[i] = score[parents[i]] + float(table[tokens[parents[i]], tokens[i]])
    pool, frontier = [], [(0.0, 0)]
    for _ in range(depth):
        children = []
        for parent_score, token in frontier:
            values, ids = torch.topk(table[token], branching)
            children += [(parent_score + float(v), int(t)) for v, t in zip(values, ids)]
        pool += [s for s, _ in children]
        frontier = sorted(children, key=lambda c: -c[0])[:branching]
    kept = sorted(score[1:], reverse=True)
    assert kept == pytest.approx(sorted(pool, reverse=True)[:total])
