"""Accept/reject logic against stub targets that emit fixed logits (litgpt's speculative tests style)."""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.tree import DraftTree, retrieve_indices
from draftlab.decoding.verify import VerifyResult, verify

V = 10
NEG = float("-inf")


def argmax_logits(rows: list[int], vocab: int = V) -> torch.Tensor:
    """Logits whose row i is sharply peaked (but not one-hot) on ``rows[i]``."""
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(len(rows)))  # [N, V]
    logits[torch.arange(len(rows)), rows] = 20.0
    return logits


def point_mass_logits(rows: list[int], vocab: int = V) -> torch.Tensor:
    """Logits whose row i gives probability exactly 1 to ``rows[i]`` at any temperature."""
    logits = torch.full((len(rows), vocab), NEG)  # [N, V]
    logits[torch.arange(len(rows)), rows] = 0.0
    return logits


def sampled(tree: DraftTree, seed: int = 0) -> DraftTree:
    """The same tree, marked as sampled from arbitrary (full-support) draft distributions."""
    q = torch.softmax(torch.randn(tree.size, V, generator=torch.Generator().manual_seed(seed)), -1)  # [N, V]
    return DraftTree(tree.tokens, tree.parents, tree.depth, q, deterministic=False)


# root 9 -> 5, 6, 7 ; 6 -> 8, 9   (node indices 0..5)
TREE = DraftTree.from_parents([9, 5, 6, 7, 8, 9], [-1, 0, 0, 0, 2, 2])
CHAIN = DraftTree.chain(9, [1, 2, 3])


# ---- greedy ---------------------------------------------------------------------------------------


def test_greedy_chain_accept_all():
    result = verify(argmax_logits([1, 2, 3, 4]), CHAIN, temperature=0.0)
    assert result == VerifyResult(path=[0, 1, 2, 3], bonus_token=4)
    assert result.accepted_tokens(CHAIN) == [1, 2, 3, 4]
    assert result.accept_length == 4


def test_greedy_chain_reject_all():
    result = verify(argmax_logits([5, 2, 3, 4]), CHAIN, temperature=0.0)
    assert result == VerifyResult(path=[0], bonus_token=5, rejected=[1])
    assert result.accepted_tokens(CHAIN) == [5] and result.accept_length == 1


def test_greedy_chain_partial():
    result = verify(argmax_logits([1, 2, 7, 4]), CHAIN, temperature=0.0)
    assert result.path == [0, 1, 2] and result.accepted_tokens(CHAIN) == [1, 2, 7]


def test_greedy_tree_follows_the_matching_branch():
    # Root argmax 6 -> node 2; node 2 argmax 9 -> node 5 (a leaf); bonus = argmax after node 5.
    logits = argmax_logits([6, 8, 9, 0, 1, 3])
    result = verify(logits, TREE, temperature=0.0)
    assert result.path == [0, 2, 5] and result.accepted_tokens(TREE) == [6, 9, 3]
    assert result.rejected == []  # the walk ended at a leaf
    # Root argmax 7 -> node 3, a leaf with no children.
    result = verify(argmax_logits([7, 8, 9, 4, 1, 3]), TREE, temperature=0.0)
    assert result.path == [0, 3] and result.accepted_tokens(TREE) == [7, 4] and result.rejected == []
    # Top-k / top-p cannot change the argmax, so greedy ignores them.
    assert verify(logits, TREE, temperature=0.0, top_k=1, top_p=0.1).path == [0, 2, 5]


def test_greedy_takes_the_first_of_duplicate_siblings():
    tree = DraftTree.from_parents([0, 4, 4], [-1, 0, 0])
    assert verify(argmax_logits([4, 1, 2]), tree, temperature=0.0).path == [0, 1]


def test_greedy_rejected_nodes():
    # Root wants 6 (node 2); node 2 wants 0, which neither of its children (8, 9) is: both rejected.
    result = verify(argmax_logits([6, 1, 0, 1, 1, 1]), TREE, temperature=0.0)
    assert result.path == [0, 2] and result.rejected == [4, 5] and result.bonus_token == 0
    # Nothing under the root matches: all three root children are rejected, in index order.
    result = verify(argmax_logits([4, 1, 0, 1, 1, 1]), TREE, temperature=0.0)
    assert result.path == [0] and result.rejected == [1, 2, 3]
    # A chain rejected in the middle: the one child of the last accepted node.
    result = verify(argmax_logits([1, 2, 7, 4]), CHAIN, temperature=0.0)
    assert result.path == [0, 1, 2] and result.rejected == [3]
    # Duplicate siblings are both rejected.
    tree = DraftTree.from_parents([0, 4, 4, 5], [-1, 0, 0, 0])
    assert verify(argmax_logits([3, 1, 2, 1]), tree, temperature=0.0).rejected == [1, 2, 3]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_speculation_equals_greedy_decoding(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 5
    bigram = torch.randn(vocab, vocab, generator=gen)  # [V, V] target logits after each token

    reference, token = [], 0
    for _ in range(40):
        token = int(bigram[token].argmax())
        reference.append(token)

    output, root = [], 0
    while len(output) < 40:
        # Random tree with random tokens: sometimes right, mostly wrong.
        size = int(torch.randint(1, 8, (), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
        tokens = [root] + torch.randint(0, vocab, (size - 1,), generator=gen).tolist()
        tree = DraftTree.from_parents(tokens, parents)
        result = verify(bigram[tree.tokens], tree, temperature=0.0)
        # The accepted path is the longest root-to-leaf prefix that greedy decoding agrees with.
        best = 0
        for path in retrieve_indices(tree.parents).tolist():
            path = [i for i in path if i >= 0]
            agree = 1
            while agree < len(path) and tokens[path[agree]] == int(bigram[tokens[path[agree - 1]]].argmax()):
                agree += 1
            best = max(best, agree)
        assert result.accept_length == best
        output += result.accepted_tokens(tree)
        root = output[-1]
    assert output[:40] == reference


# ---- sampling, both rules ----------------------------------------------------------------------------

RULES = {"deterministic": lambda tree: tree, "sampled": sampled}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_accept_all(rule, temperature):
    tree = RULES[rule](CHAIN)
    for seed in range(20):
        result = verify(point_mass_logits([1, 2, 3, 4]), tree, temperature=temperature,
                        generator=torch.Generator().manual_seed(seed))
        assert result.path == [0, 1, 2, 3] and result.bonus_token == 4


@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_reject_all_never_emits_a_rejected_token(rule):
    tree = RULES[rule](TREE)
    logits = torch.zeros(TREE.size, V)  # [N, V]
    logits[0, [5, 6, 7]] = NEG  # the target cannot emit any root child
    bonuses = set()
    for seed in range(50):
        result = verify(logits, tree, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert result.path == [0]
        bonuses.add(result.bonus_token)
    assert bonuses.isdisjoint({5, 6, 7}) and len(bonuses) > 1


@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_partial_chain(rule):
    tree = RULES[rule](CHAIN)
    logits = point_mass_logits([1, 2, 4, 0])  # accepts 1, 2; the target wants 4 where the draft has 3
    for seed in range(10):
        result = verify(logits, tree, temperature=0.7, generator=torch.Generator().manual_seed(seed))
        assert result.path == [0, 1, 2] and result.accepted_tokens(tree) == [1, 2, 4]


@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_partial_tree(rule):
    tree = RULES[rule](TREE)
    # Root wants 6 (node 2, after rejecting node 1's 5); node 2 wants 0, which neither child proposes.
    logits = point_mass_logits([6, 1, 0, 1, 1, 1])
    for seed in range(10):
        result = verify(logits, tree, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert result.path == [0, 2] and result.accepted_tokens(tree) == [6, 0]
        # Node 1 (token 5) was rejected on the way, but the walk stopped at node 2: its children are the
        # rejected nodes.
        assert result.rejected == [4, 5]


@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_rejected_nodes(rule):
    tree = RULES[rule](TREE)
    # The target cannot emit any root child: all three are tried and rejected.
    logits = torch.zeros(TREE.size, V)
    logits[0, [5, 6, 7]] = NEG
    for seed in range(10):
        result = verify(logits, tree, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert result.path == [0] and result.rejected == [1, 2, 3]
    # Accepted to a leaf: nothing rejected at the stopping node.
    result = verify(point_mass_logits([7, 1, 1, 2, 1, 1]), tree, temperature=1.0,
                    generator=torch.Generator().manual_seed(0))
    assert result.path == [0, 3] and result.rejected == [] and result.bonus_token == 2


@pytest.mark.parametrize("rule", ["greedy", *RULES])
@pytest.mark.parametrize("seed", range(5))
def test_rejected_nodes_are_the_children_where_the_walk_stopped(rule, seed):
    # Random trees and logits: ``rejected`` is exactly the children of the last accepted node, and under
    # greedy / the deterministic rule the bonus is never one of their tokens (their mass was removed).
    gen = torch.Generator().manual_seed(seed)
    size = 12
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    tokens = torch.randint(0, 4, (size,), generator=gen)  # few distinct tokens: acceptances and duplicates
    tree = DraftTree.from_parents(tokens, parents)
    tree = tree if rule in ("greedy", "deterministic") else sampled(tree, seed)
    logits = torch.randn(size, V, generator=gen)
    logits[:, :4] += 2.0
    children = [[c for c in range(size) if parents[c] == i] for i in range(size)]
    for trial in range(20):
        result = verify(logits, tree, temperature=0.0 if rule == "greedy" else 1.0,
                        generator=torch.Generator().manual_seed(trial))
        assert result.rejected == children[result.path[-1]]
        if rule != "sampled":
            assert result.bonus_token not in tokens[result.rejected].tolist()


def test_deterministic_rule_renormalises_after_a_rejection():
    # p = (0.5, 0.5) on the two children: the first is accepted half the time, and once it is rejected
    # the second holds all the remaining mass, so a bonus is never drawn at the root.
    tree = DraftTree.from_parents([9, 0, 1], [-1, 0, 0])
    logits = torch.full((3, V), NEG)
    logits[0, :2] = 0.0
    logits[1:, 3] = 0.0
    paths = [verify(logits, tree, temperature=1.0, generator=torch.Generator().manual_seed(s)).path
             for s in range(60)]
    assert {tuple(p) for p in paths} == {(0, 1), (0, 2)}


def test_deterministic_rule_residual_excludes_rejected_tokens():
    tree = DraftTree.from_parents([9, 0], [-1, 0])
    logits = torch.full((2, V), NEG)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    logits[1, 5] = 0.0
    outcomes = set()
    for seed in range(100):
        result = verify(logits, tree, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        outcomes.add(tuple(result.accepted_tokens(tree)) if result.path == [0] else ("accepted",))
    assert outcomes == {("accepted",), (1,), (2,)}


def test_sampled_rule_residual_is_max_p_minus_q():
    # p = (0.5, 0.5), q = (1, 0): the child (token 0) is accepted with probability p/q = 0.5 and the
    # residual max(0, p - q) puts all its mass on token 1.
    q = torch.zeros(2, V)
    q[1, 0] = 1.0
    tree = DraftTree.from_parents([9, 0], [-1, 0], draft_probs=q)
    logits = torch.full((2, V), NEG)
    logits[0, :2] = 0.0
    logits[1, 5] = 0.0
    outcomes = {tuple(verify(logits, tree, temperature=1.0,
                             generator=torch.Generator().manual_seed(s)).accepted_tokens(tree))
                for s in range(60)}
    assert outcomes == {(0, 5), (1,)}


def test_sampled_rule_falls_back_to_the_target_on_an_empty_residual():
    # An inconsistent draft: token 1 "sampled" from q = one-hot(0). p = one-hot(0) too, so p(1) = 0
    # rejects it and max(0, p - q) is all zero; the bonus must come from the target, not crash.
    q = torch.zeros(2, V)
    q[1, 0] = 1.0
    tree = DraftTree.from_parents([9, 1], [-1, 0], draft_probs=q)
    result = verify(point_mass_logits([0, 0]), tree, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert result == VerifyResult(path=[0], bonus_token=0, rejected=[1])


@pytest.mark.parametrize("rule", list(RULES))
def test_truncated_tokens_are_never_accepted(rule):
    tree = RULES[rule](TREE)
    logits = torch.zeros(TREE.size, V)
    logits[0, 3] = 5.0  # top_k=1 keeps token 3 only: no child of the root can be accepted
    for seed in range(20):
        result = verify(logits, tree, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(seed))
        assert result == VerifyResult(path=[0], bonus_token=3, rejected=[1, 2, 3])


@pytest.mark.parametrize("rule", list(RULES))
def test_generator_makes_verification_reproducible(rule):
    tree = RULES[rule](TREE)
    logits = torch.randn(TREE.size, V, generator=torch.Generator().manual_seed(3))
    runs = [[verify(logits, tree, temperature=0.9, generator=gen) for _ in range(20)]
            for gen in (torch.Generator().manual_seed(1), torch.Generator().manual_seed(1))]
    assert runs[0] == runs[1]


def test_low_precision_logits():
    logits = argmax_logits([1, 2, 3, 4]).to(torch.bfloat16)
    assert verify(logits, CHAIN, temperature=0.0).path == [0, 1, 2, 3]
    assert verify(point_mass_logits([1, 2, 3, 4]).half(), sampled(CHAIN), temperature=1.0).path == [0, 1, 2, 3]


def test_shape_errors():
    with pytest.raises(ValueError):
        verify(torch.zeros(3, V), CHAIN, temperature=1.0)
    bad_vocab = DraftTree(CHAIN.tokens, CHAIN.parents, CHAIN.depth, torch.ones(4, V + 1), deterministic=False)
    with pytest.raises(ValueError):
        verify(torch.zeros(4, V), bad_vocab, temperature=1.0)
