"""Exact tokens and counts through the whole engine with fixed-logit stub targets (chain and tree)."""

import torch

from draftlab.decoding.drafter import Drafter
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree
from tests.stubs import TableTarget

# Greedy continuation: 1 -> 2 -> 3 -> 4 -> 5 -> 6 -> 7 -> 8 -> 9 -> 1 ...
CYCLE = {i: i % 9 + 1 for i in range(1, 10)}
CYCLE[0] = 1


class FixedDrafter(Drafter):
    """Proposes the trees it is given, one per round (the last one repeats)."""

    def __init__(self, make_tree):
        self.make_tree = make_tree
        self.rounds = 0

    def propose(self, state):
        self.rounds += 1
        return self.make_tree(state.root)


def _chain(root, toks):
    return DraftTree.chain(root, toks)


def test_accept_all_chain():
    target = TableTarget(CYCLE)
    drafter = FixedDrafter(lambda r: _chain(r, [CYCLE[r], CYCLE[CYCLE[r]], CYCLE[CYCLE[CYCLE[r]]]]))
    out, stats = speculative_generate(target, [0], drafter, GenerationConfig(max_new_tokens=13, stop_on_eos=False))
    calls = list(target.calls)
    ref, _ = autoregressive_generate(target, [0], GenerationConfig(max_new_tokens=13, stop_on_eos=False))
    assert out == ref == [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    # first token comes from prefill; then 3 rounds of 3 drafts + bonus = 12 tokens
    assert stats.accept_lengths == [4, 4, 4]
    assert stats.tau == 4.0 and stats.accept_histogram == {4: 3}
    assert calls == [1, 4, 4, 4]  # prefill + three verify passes of 4 rows


def test_reject_all_chain():
    target = TableTarget(CYCLE)
    wrong = lambda r: _chain(r, [(CYCLE[r] + 3) % 9 + 1, 5])  # noqa: E731  first draft never matches
    out, stats = speculative_generate(target, [0], FixedDrafter(wrong), GenerationConfig(max_new_tokens=5, stop_on_eos=False))
    assert out == [1, 2, 3, 4, 5]
    assert stats.accept_lengths == [1, 1, 1, 1]


def test_partial_chain_and_max_new_tokens_mid_path():
    target = TableTarget(CYCLE)
    # two right, then a wrong one: each round yields 2 accepted + bonus = 3
    drafter = FixedDrafter(lambda r: _chain(r, [CYCLE[r], CYCLE[CYCLE[r]], 9 if CYCLE[CYCLE[CYCLE[r]]] != 9 else 8]))
    out, stats = speculative_generate(target, [0], drafter, GenerationConfig(max_new_tokens=8, stop_on_eos=False))
    assert out == [1, 2, 3, 4, 5, 6, 7, 8]
    # 1 (prefill) + 3 + 3 = 7, then the last round is cut to the 1 token left in the budget
    assert stats.accept_lengths == [3, 3, 1]


def test_eos_mid_path_stops_generation():
    target = TableTarget(CYCLE, eos=4)
    drafter = FixedDrafter(lambda r: _chain(r, [CYCLE[r], CYCLE[CYCLE[r]], CYCLE[CYCLE[CYCLE[r]]]]))
    out, stats = speculative_generate(target, [0], drafter, GenerationConfig(max_new_tokens=50))
    assert out == [1, 2, 3, 4]  # EOS included, nothing after it
    assert stats.accept_lengths == [3]


def test_tree_partial_acceptance():
    target = TableTarget(CYCLE)

    def tree(r):
        a = CYCLE[r]
        b = CYCLE[a]
        # root -> {wrong, a}; a -> {wrong, b}; b -> {wrong}
        tokens = torch.tensor([r, (a % 9) + 1 if (a % 9) + 1 != a else 1, a, 7 if b != 7 else 6, b, 9 if CYCLE[b] != 9 else 8])
        parents = torch.tensor([-1, 0, 0, 2, 2, 4])
        return DraftTree.from_parents(tokens, parents)

    out, stats = speculative_generate(target, [0], FixedDrafter(tree), GenerationConfig(max_new_tokens=10, stop_on_eos=False))
    assert out == [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    # each round: a, b accepted + bonus = 3
    assert stats.accept_lengths == [3, 3, 3]
    assert stats.tree_sizes == [6, 6, 6]
