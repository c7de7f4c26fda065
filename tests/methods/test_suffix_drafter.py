"""Suffix decoding: the trie's counts, what the drafter proposes from the request and from earlier outputs,
and that the engine stays lossless with it (the conformance suite covers the config on the tiny target)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.methods.registry import MethodSpec
from draftlab.methods.suffix import SuffixDrafter, SuffixTrie
from draftlab.methods.suffix.suffix_trie import next_token_probs
from tests.stubs import TableTarget


def _state(tokens, prompt_len=None):
    return SimpleNamespace(tokens=list(tokens), root=tokens[-1], prompt_len=len(tokens) if prompt_len is None else prompt_len)


def _paths(tree) -> set[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()

    def path(i):
        return () if i == 0 else (*path(parents[i]), tokens[i])

    return {path(i) for i in range(1, tree.size)}


def test_trie_counts_substrings_up_to_its_depth():
    trie = SuffixTrie(depth=3)
    trie.extend([1, 2, 1, 2, 3])
    assert trie.root.children[1].count == 2 and trie.root.children[2].count == 2
    assert trie.root.children[1].children[2].count == 2
    assert trie.root.children[1].children[2].children[1].count == 1  # "1 2 1"
    assert trie.root.children[1].children[2].children[3].count == 1  # "1 2 3"
    assert not trie.root.children[1].children[2].children[3].children  # depth 3: nothing longer
    probs = next_token_probs(trie.root.children[1].children[2])
    assert {t: p for t, (p, _) in probs.items()} == {1: 0.5, 3: 0.5}
    trie.start_sequence()
    trie.extend([3, 1])
    assert 1 not in trie.root.children[3].children.get(3, SimpleNamespace(children={})).children
    assert trie.root.children[3].children[1].count == 1  # "3 1" only inside the new sequence


def test_match_needs_an_earlier_occurrence_with_a_continuation():
    trie = SuffixTrie(depth=8)
    context = [5, 6, 7, 9, 5, 6, 7]
    trie.extend(context)
    node, m = trie.match(context, 6)
    # "5 6 7" occurred before, followed by 9; "9 5 6 7" (its own, current occurrence) has no continuation.
    assert m == 3 and set(node.children) == {9}
    assert trie.match([4], 6) == (None, 0)


def test_proposes_the_continuation_of_the_longest_earlier_match():
    drafter = SuffixDrafter(nodes=8, max_spec_factor=2.0, min_token_prob=0.1)
    prompt = [1, 2, 3, 4, 5, 6, 10, 11, 1, 2, 3]
    drafter.reset(_state(prompt))
    tree = drafter.propose(_state(prompt))
    # Pattern "1 2 3" (3 tokens) allows ceil(2.0 * 3) = 6 nodes: the chain that followed it.
    assert tree.tokens.tolist() == [3, 4, 5, 6, 10, 11, 1] and tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert tree.deterministic


def test_a_branching_history_becomes_a_tree_and_rare_branches_are_cut():
    # After "7": 1 four times; after "7 1": 2 three times, 3 once (p 0.25).
    history = [7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 3, 7]
    for min_prob, has_rare in [(0.3, False), (0.2, True)]:
        drafter = SuffixDrafter(nodes=8, max_spec_factor=8.0, min_token_prob=min_prob, max_pattern=1)
        drafter.reset(_state(history))
        paths = _paths(drafter.propose(_state(history)))
        assert (1, 2) in paths and ((1, 3) in paths) == has_rare, paths


def test_earlier_outputs_are_speculated_from_in_later_requests():
    drafter = SuffixDrafter(nodes=4, max_spec_factor=4.0, max_cached_requests=1)
    drafter.reset(_state([9, 9]))
    drafter.update(_state([9, 9, 20, 21, 22, 23, 24], prompt_len=2), None)  # the first request's output
    drafter.reset(_state([8, 20, 21]))  # a new request whose prompt ends like that output
    assert drafter.propose(_state([8, 20, 21])).tokens.tolist() == [21, 22, 23, 24]
    # One cached request: a second finished request replaces it.
    drafter.update(_state([8, 20, 21, 30, 31], prompt_len=3), None)
    drafter.reset(_state([5, 20, 21]))
    assert list(drafter.past_outputs) == [[30, 31]]
    assert drafter.propose(_state([5, 20, 21])).tokens.tolist() == [21]  # nothing follows "20 21" any more


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="nodes"):
        SuffixDrafter(nodes=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_repetitive_text_is_accepted_and_greedy_output_is_ar(temperature):
    # The stub's greedy continuation cycles 1 -> 2 -> 3 -> 4 -> 1: the prompt shows the cycle once.
    target = TableTarget({1: 2, 2: 3, 3: 4, 4: 1}, vocab_size=8)
    prompt = [1, 2, 3, 4, 1, 2]
    cfg = GenerationConfig(max_new_tokens=24, temperature=temperature, stop_on_eos=False, seed=0)
    drafter = MethodSpec.from_name("suffix").build_drafter()
    out, stats = speculative_generate(target, prompt, drafter, cfg)
    if temperature == 0:
        assert out == autoregressive_generate(target, prompt, cfg)[0]
    assert sum(stats.accept_lengths) / len(stats.accept_lengths) > 3
