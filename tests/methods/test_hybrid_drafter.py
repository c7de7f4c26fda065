"""Hybrid drafting: the trie union of two trees, and the learned + lookup drafter on the tiny target (the
conformance suite runs the shipped `eagle3_suffix` config through every check as well)."""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.tree import DraftTree
from draftlab.methods.eagle3 import Eagle3Draft
from draftlab.methods.eagle3.drafter import Eagle3Drafter
from draftlab.methods.hybrid import HybridDrafter, union_tree
from draftlab.methods.prompt_lookup import PromptLookupDrafter
from draftlab.methods.registry import MethodSpec
from draftlab.methods.suffix import SuffixDrafter


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = [()] * len(toks)
    for i in range(1, len(toks)):
        out[i] = out[pars[i]] + (toks[i],)
    return set(out[1:])


def test_union_merges_shared_paths_and_maps_every_node():
    a = DraftTree.from_parents(torch.tensor([5, 1, 2, 3]), torch.tensor([-1, 0, 1, 0]))  # 5 -> 1 -> 2, 5 -> 3
    b = DraftTree.chain(5, [1, 2, 4])  # shares "1 2" with a
    merged, (ma, mb) = union_tree([a, b])
    assert _paths(merged) == _paths(a) | _paths(b)
    assert merged.size == 1 + 4  # 1, 2, 3, 4: the shared prefix once
    assert ma[:3] == mb[:3] == [0, 1, 2]
    for tree, m in ((a, ma), (b, mb)):
        assert merged.tokens[m].tolist() == tree.tokens.tolist()
    assert merged.deterministic


def test_union_refuses_sampled_trees_and_different_roots():
    q = torch.full((2, 8), 1 / 8)
    with pytest.raises(ValueError, match="deterministic"):
        union_tree([DraftTree.chain(5, [1]), DraftTree.chain(5, [1], draft_probs=q[1:])])
    with pytest.raises(ValueError, match="root"):
        union_tree([DraftTree.chain(5, [1]), DraftTree.chain(6, [1])])


@pytest.mark.parametrize("lookup", [SuffixDrafter, PromptLookupDrafter])
def test_hybrid_is_lossless_and_proposes_both_trees(tiny_target, lookup):
    torch.manual_seed(0)
    learned = Eagle3Drafter(Eagle3Draft.from_target(tiny_target, draft_vocab_size=256), branching=2, depth=3,
                            nodes=4)
    drafter = HybridDrafter(learned, lookup())
    prompt = tiny_target.tokenizer.encode("one two three four one two three four one two")
    cfg = GenerationConfig(max_new_tokens=24, temperature=0.0, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, prompt, drafter, cfg, trace=True)
    assert out == autoregressive_generate(tiny_target, prompt, cfg)[0]
    assert max(r.tokens.numel() for r in stats.trace) > 1 + 4  # lookup nodes beyond the learned tree's four
    assert drafter.scratch_rows(cfg) == learned.scratch_rows(cfg) + drafter.lookup.scratch_rows(cfg) - 1


def test_the_shipped_hybrid_reuses_the_eagle3_training_key():
    hybrid, eagle3 = MethodSpec.from_name("eagle3_suffix"), MethodSpec.from_name("eagle3")
    assert hybrid.key_config() == eagle3.key_config()
    assert hybrid.label != eagle3.label and "lookup_nodes" in hybrid.axes()


def test_each_sized_component_learns_from_its_own_accepted_nodes():
    from draftlab.decoding.budget import TreeBudget
    from draftlab.decoding.cost import VerifyCost
    from draftlab.decoding.drafter import Drafter, VerifyOutput
    from draftlab.decoding.verify import VerifyResult

    class Fixed(Drafter):
        def __init__(self, tree):
            self.tree, self.budget, self.updates = tree, TreeBudget(VerifyCost.linear(1.0, 0.0), level_seconds=0.0), 0

        def propose(self, state):
            self.budget.choose(torch.full((self.tree.size - 1,), 0.5), 1)
            return self.tree

        def update(self, state, out):
            self.budget.observe(len(out.result.path) - 1)  # what a component sees: the merged path
            self.updates += 1

    learned = Fixed(DraftTree.chain(5, [1, 2]))
    lookup = Fixed(DraftTree.chain(5, [3, 4, 6]))
    drafter = HybridDrafter(learned, lookup)
    merged = drafter.propose(None)
    path = [0] + [i for i in range(1, merged.size) if merged.tokens[i] in (3, 4)]  # lookup's branch, 2 nodes
    out = VerifyOutput(tree=merged, result=VerifyResult(path=path, bonus_token=7), logits=torch.zeros(merged.size, 8),
                       aux=None, accepted_aux=None, extra=None, kept=len(path))
    drafter.update(None, out)
    assert learned.updates == lookup.updates == 1
    d = learned.budget.decay
    assert learned.budget._accepted == pytest.approx(d * 1.0 + (1 - d) * 0)  # none of its nodes were accepted
    assert lookup.budget._accepted == pytest.approx(d * 1.0 + (1 - d) * 2)


class _Counting(Eagle3Drafter):
    """The EAGLE-3 drafter, counting how often it is asked to propose."""

    proposals = 0

    def propose(self, state):
        self.proposals += 1
        return super().propose(state)


@pytest.mark.parametrize("skip_at", [0.5, 1e9])
def test_gated_hybrid_skips_the_learned_draft_when_the_lookup_is_confident(tiny_target, skip_at):
    torch.manual_seed(0)
    learned = _Counting(Eagle3Draft.from_target(tiny_target, draft_vocab_size=256), branching=2, depth=3, nodes=4)
    drafter = HybridDrafter(learned, SuffixDrafter(), skip_learned_at=skip_at)
    # A prompt that repeats itself: the suffix trie soon matches long, confident continuations.
    prompt = tiny_target.tokenizer.encode("one two three four one two three four one two three four one two")
    cfg = GenerationConfig(max_new_tokens=24, temperature=0.0, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, prompt, drafter, cfg, trace=True)
    assert out == autoregressive_generate(tiny_target, prompt, cfg)[0]
    counts = stats.drafter_stats
    assert counts["rounds"] == len(stats.trace) and counts["learned_rounds"] == learned.proposals
    if skip_at > 1e6:  # never confident enough: the learned draft runs every round
        assert learned.proposals == counts["rounds"]
    else:
        assert 0 <= learned.proposals < counts["rounds"]


def test_gating_reads_the_lookup_trees_expected_tokens():
    from draftlab.decoding.drafter import Drafter

    class Fixed(Drafter):
        def __init__(self, tree):
            self.tree, self.calls = tree, 0

        def propose(self, state):
            self.calls += 1
            return self.tree

    sure = DraftTree.from_parents(torch.tensor([5, 3, 4]), torch.tensor([-1, 0, 1]), path_probs=torch.tensor([1.0, 0.9, 0.8]))
    assert sure.expected_tokens == pytest.approx(1.7)
    learned = Fixed(DraftTree.chain(5, [1, 2]))
    drafter = HybridDrafter(learned, Fixed(sure), skip_learned_at=1.5)
    assert drafter.propose(None) is sure and learned.calls == 0
    drafter.skip_learned_at = 2.0  # 1.7 expected tokens no longer suffice: both trees, merged
    assert drafter.propose(None).size == 5 and learned.calls == 1
    with pytest.raises(ValueError, match="skip_learned_at"):
        HybridDrafter(learned, Fixed(sure), skip_learned_at=0)


def test_trees_carry_the_drafters_path_probabilities(tiny_target):
    from draftlab.decoding.dynamic_tree import build_dynamic_tree

    torch.manual_seed(0)
    logits = torch.randn(4, 16)

    def expand(batch):
        return torch.log_softmax(logits[batch.depth].expand(batch.node_ids.shape[0], -1), -1)

    tree = build_dynamic_tree(0, expand, branching=2, depth=3, nodes=5)
    assert tree.path_probs[0] == 1.0
    for i in range(1, tree.size):  # a child's path probability is its parent's times its own
        parent = int(tree.parents[i])
        own = torch.log_softmax(logits[int(tree.depth[parent])], -1)[int(tree.tokens[i])].exp()
        assert tree.path_probs[i] == pytest.approx(float(tree.path_probs[parent] * own), rel=1e-5)
    # The suffix drafter's tree carries its count ratios: a fully repeated pattern is certain.
    suffix = SuffixDrafter()
    from draftlab.decoding.drafter import DecodeState

    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    state = DecodeState(target=None, cache=None, tokens=tokens, prompt_len=len(tokens), temperature=0.0)
    suffix.reset(state)
    proposed = suffix.propose(state)
    assert proposed.tokens[1] == 3 and proposed.path_probs[1] == pytest.approx(1.0)
    assert proposed.expected_tokens == pytest.approx(float(proposed.path_probs[1:].sum()))
