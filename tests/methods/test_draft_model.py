"""The draft-model drafter: the truncated draft is the target's first layers, its cache follows the committed
sequence exactly (kept chain rows, rollbacks, other sequences), mismatched models are refused, and a drafter
that reports the wrong q is caught by the powered sampling check that the real one passes."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.outcome_drafter import Sampling
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.methods.draft_model import DraftLM, DraftModelDrafter
from draftlab.methods.draft_model.model import load_draft_model, truncated_model
from tests.decoding.conformance.checks import check_first_round_law, check_greedy_equals_ar
from tests.decoding.conformance.methods import first_round_prompt
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT


def test_truncated_model_is_the_targets_first_layers(tiny_target):
    ids = torch.tensor([UNSEEN_PROMPT[:12]])
    full = truncated_model(tiny_target, 2)
    torch.testing.assert_close(full.forward(ids).logits, tiny_target.forward(ids).logits, rtol=1e-5, atol=1e-5)
    one = truncated_model(tiny_target, 1)
    assert one.geometry.num_layers == 1
    assert one.model.model.layers[0] is tiny_target.model.model.layers[0]  # shared, not copied
    h = tiny_target.embed(ids)
    ref = tiny_target.lm_head(tiny_target.forward_layers(h, 0, 1).hidden)  # the target's own first layer
    torch.testing.assert_close(one.forward(ids).logits, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"draft layers must be in \[1, 2\]"):
        truncated_model(tiny_target, 3)


@pytest.mark.xdist_group("compiled-tiny")  # the worker that already compiled the tiny target's graphs
def test_the_draft_model_of_a_compiled_target_drafts_through_compiled_passes(tiny_target, compiled_tiny_target):
    draft = truncated_model(compiled_tiny_target, 1)
    assert draft.compiled and not truncated_model(tiny_target, 1).compiled
    eager = DraftLM(truncated_model(tiny_target, 1)).chain(UNSEEN_PROMPT[:10], 4, Sampling(0.0))
    assert DraftLM(draft).chain(UNSEEN_PROMPT[:10], 4, Sampling(0.0)).tokens == eager.tokens
    stats = draft.compile_stats()
    assert stats["compiled_passes"] >= 3 and stats["recompiles"] == 0, stats  # the chain's steps after the prefill


def test_draft_cache_follows_the_sequence(tiny_target):
    """Chains drafted by one DraftLM over changing contexts (kept chain rows, rollbacks, a different sequence)
    equal those of a fresh DraftLM for each context: the cache holds exactly the committed context."""
    lm = DraftLM(truncated_model(tiny_target, 1), initial_length=8)  # small: the cache must grow on the way
    greedy = Sampling(0.0)
    base = UNSEEN_PROMPT[:10]
    first = lm.chain(base, 4, greedy)
    contexts = [base + first.tokens[:2] + [7],   # two chain tokens kept, then a correction
                base + first.tokens[:2],         # shorter than what is cached: a rollback
                TRAIN_PROMPTS[1][:9],            # another sequence
                TRAIN_PROMPTS[1][:9] + list(range(40, 80))]  # a long extension (the cache grows)
    for ctx in contexts:
        fresh = DraftLM(truncated_model(tiny_target, 1)).chain(ctx, 4, greedy)
        assert lm.chain(ctx, 4, greedy).tokens == fresh.tokens
        assert lm.context == ctx[:-1]


@pytest.mark.parametrize("kw", [dict(layers=1), dict(layers=2), dict(layers=2, branching=3, nodes=8)])
def test_greedy_equals_ar(tiny_target, kw):
    accepted = check_greedy_equals_ar(tiny_target, lambda: DraftModelDrafter(**kw), [TRAIN_PROMPTS[1], UNSEEN_PROMPT],
                                      24)
    if kw["layers"] == 2:  # the whole target drafts: its argmax chain is accepted
        assert accepted > 20


def test_a_full_depth_draft_is_always_accepted_when_sampling(tiny_target):
    """q == p when the draft is the whole target: min(1, p/q) = 1, every token of every chain is accepted."""
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.7, seed=3, stop_on_eos=False)
    with closing(DraftModelDrafter(layers=2, depth=4)) as d:
        _, stats = speculative_generate(tiny_target, UNSEEN_PROMPT, d, cfg)
    assert stats.accept_lengths[:-1] == [5] * (len(stats.accept_lengths) - 1)


class DrawnAtOne(DraftModelDrafter):
    """Mutant: draws each chain token at T = 1 but reports q at the engine's temperature (the slip of a sampler
    that forgets to temper the draw)."""

    def propose(self, state):
        lm = self.draft_lm(state.target)
        spec = lm.chain(state.tokens, self.depth, Sampling(1.0, generator=state.generator))
        n, fed = lm.length, [state.root, *spec.tokens[:-1]]
        zs = [lm.rows([t], [n + j], [n + j], [list(range(n, n + j + 1))])[0] for j, t in enumerate(fed)]
        return DraftTree.chain(state.root, spec.tokens, draft_probs=logits_to_probs(torch.stack(zs), state.temperature))


class DrawnTwice(DraftModelDrafter):
    """Mutant: draws each chain token twice and keeps the likelier draw (the proposal no longer follows q)."""

    def propose(self, state):
        tree = super().propose(state)
        if tree.draft_probs is not None and tree.size > 1:
            q = tree.draft_probs[1]
            other = int(sample(q, state.generator))
            if q[other] > q[int(tree.tokens[1])]:
                tree.tokens[1] = other
        return tree


# (drafter, draft layers): the real drafter with a one-layer draft (q far from p, ~10 % of first slots accepted)
# and with the whole target as draft (q == p: every chain accepted), where a slip in the draw shows at once.
POWERED = {"real_1": (DraftModelDrafter, 1), "real_2": (DraftModelDrafter, 2), "drawn_at_one": (DrawnAtOne, 2),
           "drawn_twice": (DrawnTwice, 2)}


@pytest.mark.parametrize("case", list(POWERED))
def test_powered_sampling_check(tiny_target, case):
    cls, layers = POWERED[case]

    def make():
        return cls(layers=layers, depth=3)

    prompt = first_round_prompt(tiny_target)
    if cls is DraftModelDrafter:
        result = check_first_round_law(tiny_target, make, prompt, temperature=0.3, trials=300)
        assert result["accepted"] > (300 if layers == 2 else 20)  # accepted often: the check has power here
    else:
        with pytest.raises(AssertionError, match="do not follow the target"):
            check_first_round_law(tiny_target, make, prompt, temperature=0.3, trials=300)


def test_mismatched_draft_model_is_refused(tiny_target, tmp_path):
    from draftlab.targets.tiny import tiny_random_target

    other = tiny_random_target(vocab_size=tiny_target.geometry.vocab_size + 8)
    other.model.save_pretrained(tmp_path / "m")
    other.tokenizer.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"vocabulary of 49160 logits.*must share the target's tokenizer"):
        load_draft_model(str(tmp_path / "m"), tiny_target, None)
    with pytest.raises(ValueError, match="needs drafter.layers"):
        load_draft_model("truncate", tiny_target, None)
