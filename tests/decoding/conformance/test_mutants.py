"""The conformance checks have teeth: deliberately broken engines and drafters fail them."""

from __future__ import annotations

import pytest
import torch

import draftlab.decoding.engine as engine_module
from draftlab.decoding.drafter import Drafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import VerifyResult, verify
from tests.decoding.conformance.checks import (
    check_first_round_law,
    check_greedy_equals_ar,
    check_sampling_temperatures,
)
from tests.decoding.conformance.methods import (
    FIRST_ROUND_T,
    FIRST_ROUND_TRIALS,
    first_round_prompt,
    quick_train,
    spec,
)
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT


def skip_correction(target_logits, tree, *, temperature, top_k=None, top_p=None, generator=None):
    """The verifier with the correction skipped after a rejected branch: the bonus comes from the plain
    target distribution instead of the residual (rejected tokens are emitted again)."""
    result = verify(target_logits, tree, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    if result.rejected and temperature > 0:
        p = logits_to_probs(target_logits[result.path[-1]], temperature, top_k, top_p)
        result.bonus_token = int(sample(p, generator))
    return result


def accept_first_child(target_logits, tree, *, temperature, top_k=None, top_p=None, generator=None):
    """The verifier that trusts the drafter's first guess at the root."""
    result = verify(target_logits, tree, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    kids = [i for i, p in enumerate(tree.parents.tolist()) if p == 0]
    if result.path == [0] and kids:
        return VerifyResult([0, kids[0]], int(target_logits[kids[0]].argmax()))
    return result


class ClaimsSampled(Drafter):
    """Wraps a deterministic drafter and claims its candidates were drawn from a uniform q (min(1, p/q) on
    top-k candidates: the classic lossiness bug)."""

    def __init__(self, inner):
        self.inner = inner

    def taps(self, target):
        return self.inner.taps(target)

    def scratch_rows(self, cfg):
        return self.inner.scratch_rows(cfg)

    def reset(self, state):
        self.inner.reset(state)

    def propose(self, state):
        tree = self.inner.propose(state)
        vocab = state.target.geometry.vocab_size
        q = torch.full((tree.size, vocab), 1.0 / vocab)
        return DraftTree(tree.tokens, tree.parents, tree.depth, q, deterministic=False)

    def update(self, state, out):
        self.inner.update(state, out)


class TargetArgmax(Drafter):
    """Proposes the target's own argmax after the root (one cache-free target pass): a drafter whose
    candidates carry most of the target's mass, so a rule that mishandles rejections shows at once."""

    def scratch_rows(self, cfg):
        return 2

    def propose(self, state):
        with torch.no_grad():
            logits = state.target.forward(torch.tensor([state.tokens])).logits[0, -1]  # [V]
        return DraftTree.chain(state.root, [int(logits.argmax())])


class WrongRoot(Drafter):
    """Proposes trees rooted at the wrong token."""

    def scratch_rows(self, cfg):
        return 2

    def propose(self, state):
        return DraftTree.chain(state.root + 1, [state.root])


@pytest.fixture(scope="module")
def eagle3(tiny_target):
    s = spec("eagle3")
    draft = quick_train(s, tiny_target)
    return lambda: s.build_drafter(draft)


def _sampling(target, make) -> int:
    return check_sampling_temperatures(target, make, [TRAIN_PROMPTS[1], TRAIN_PROMPTS[2]], n=40, seeds=range(3))


def test_skipped_correction_fails_the_sampling_check(tiny_target, monkeypatch):
    assert _sampling(tiny_target, TargetArgmax) > 0  # the real engine passes
    monkeypatch.setattr(engine_module, "verify", skip_correction)
    with pytest.raises(AssertionError, match="do not follow the target"):
        _sampling(tiny_target, TargetArgmax)


def test_trusting_the_first_guess_fails_the_greedy_check(tiny_target, eagle3, monkeypatch):
    monkeypatch.setattr(engine_module, "verify", accept_first_child)
    with pytest.raises(AssertionError, match="differs from AR"):
        check_greedy_equals_ar(tiny_target, eagle3, [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 20)


def test_top_k_candidates_claimed_as_sampled_fail_the_first_round_check(tiny_target, eagle3):
    # min(1, p/q) against a uniform q accepts nearly any top-k candidate: the first round emits the draft's
    # favourite instead of a draw from p. The marginal checks above sat at the edge of their power here; the
    # first-round check sees it at once.
    with pytest.raises(AssertionError, match="do not follow the target"):
        check_first_round_law(tiny_target, lambda: ClaimsSampled(eagle3()), first_round_prompt(tiny_target),
                              temperature=FIRST_ROUND_T, trials=FIRST_ROUND_TRIALS)


def test_a_malformed_tree_fails_the_invariants(tiny_target):
    with pytest.raises(AssertionError, match="node 0"):
        check_greedy_equals_ar(tiny_target, WrongRoot, [UNSEEN_PROMPT], 4)
