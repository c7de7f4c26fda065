"""The lossless proof, statistically: speculative output is distributed exactly as target sampling.

The bigram harness (tests/decoding/bigram.py): a stub target and a different draft over a tiny
vocabulary; each trial decodes from a fixed root token until one or two tokens are emitted, and the
empirical laws of the first emitted token and of the first two are compared with ``logits_to_probs`` of
the target by ``stats.assert_matches`` (pooled chi-square and a TV bound). Losslessness alone is also
met by a verifier that never accepts a draft, so every case also asserts a floor on the drafts accepted
in the first round: half the exact rule's analytic mean.

Every source of randomness is seeded, so the outcome is deterministic. Over seeds, an exact sampler
fails a case's distribution checks by chance at these rates, measured offline by ``python -m
tests.decoding.stats`` (500k numpy multinomial samples of each case's exact law, n = 8k, through the
very same checks; method in tests/decoding/stats.py): top_k_tree_T0.7_top_p 0.023%,
oracle_top_k_tree_T1 0.051%, greedy_chain_T1 0.051%, sampled_chain_T0.7_top_k 0.064%, sampled_tree_T1
0.028% (binomial standard error <= 0.004%). The acceptance assertions add ~1e-6 (Hoeffding).

The negative controls show that wrong rules do fail the very same checks; test_verify_mutants.py
plants one wrong rule at a time.
"""

from __future__ import annotations

import math

import pytest

from tests.decoding.bigram import (
    N_TRIALS,
    ROOT,
    Q,
    always_accept,
    expected,
    expected_accepted,
    greedy_chain,
    never_accept,
    oracle_top_k_tree,
    run_trials,
    sampled_chain,
    sampled_tree,
    top_k_tree,
)
from tests.decoding.stats import assert_matches, assert_min_acceptance, assert_rejected

CASES = {
    # name: (proposer, temperature, top_k, top_p, tokens needed per trial). Both acceptance rules at
    # both temperatures, one truncated case each; the two-token cases also check the joint law. The
    # oracle-ranked tree gives its first child most of the target's mass, so the deterministic rule's
    # renormalisation after a rejection changes what later siblings emit (in the T=0.7/top-p case the
    # first child has p = 0 and renormalising changes nothing).
    "top_k_tree_T0.7_top_p": (top_k_tree, 0.7, None, 0.8, 1),
    "oracle_top_k_tree_T1": (oracle_top_k_tree, 1.0, None, None, 2),
    "greedy_chain_T1": (greedy_chain, 1.0, None, None, 2),
    "sampled_chain_T0.7_top_k": (sampled_chain, 0.7, 4, None, 2),
    "sampled_tree_T1": (sampled_tree, 1.0, None, None, 1),
}


def exact_laws() -> dict:
    """name -> (trials, exact law of a trial's counted outcome, whether its first-token marginal is
    checked too): what ``python -m tests.decoding.stats`` simulates."""
    laws = {}
    for name, (_, temperature, top_k, top_p, tokens_needed) in CASES.items():
        p_first, p_pairs = expected(temperature, top_k, top_p)
        laws[name] = (N_TRIALS, (p_first if tokens_needed == 1 else p_pairs).numpy(), tokens_needed == 2)
    return laws


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target(case):
    propose, temperature, top_k, top_p, tokens_needed = CASES[case]
    first, pairs, accepted = run_trials(propose, temperature=temperature, top_k=top_k, top_p=top_p,
                                        tokens_needed=tokens_needed)
    p_first, p_pairs = expected(temperature, top_k, top_p)
    assert_matches(first, p_first)
    if tokens_needed == 2:
        assert_matches(pairs, p_pairs)
    mean = expected_accepted(propose, temperature, top_k, top_p)
    assert_min_acceptance(accepted, mean)
    # The floor's analytic mean is right: by Hoeffding the mean of n rounds of 0..2 accepted drafts is
    # within 2 * sqrt(ln(2e6) / 2n) of it but with probability 1e-6.
    assert abs(accepted - mean) < 2 * math.sqrt(math.log(2e6) / (2 * N_TRIALS))


def test_renormalisation_matters_in_the_oracle_tree():
    # Accepting the second child with p(x2) instead of p(x2) / (1 - p(x1)) must change its law a lot,
    # or the oracle case would not test the deterministic rule's renormalisation.
    tree = oracle_top_k_tree(ROOT, None)
    p_root, _ = expected(1.0)
    x1, x2 = tree.tokens[1:3].tolist()
    assert p_root[x1] > 0.3 and p_root[x2] / (1 - p_root[x1]) - p_root[x2] > 0.2


def test_the_harness_is_meaningful():
    # The draft really is a different distribution, so acceptance is far from trivial.
    p_first, _ = expected(1.0)
    assert 0.5 * (Q[ROOT].double() - p_first).abs().sum() > 0.2


def test_negative_control_never_accept_is_exact_but_fails_the_acceptance_floor():
    # Rejecting every draft and drawing the bonus from p is distribution-exact: only the floor sees it.
    first, _, accepted = run_trials(sampled_chain, temperature=1.0, verifier=never_accept, tokens_needed=1,
                                    n=N_TRIALS // 4)
    p_first, _ = expected(1.0)
    assert_matches(first, p_first)
    assert accepted == 0
    with pytest.raises(AssertionError, match="mean accepted drafts"):
        assert_min_acceptance(accepted, expected_accepted(sampled_chain, 1.0))


def test_negative_control_always_accept_is_rejected():
    # A quarter of the trials already gives a decisive failure: a wrong rule that fails with fewer
    # samples fails a fortiori with more.
    first, pairs, _ = run_trials(sampled_chain, temperature=1.0, verifier=always_accept, n=N_TRIALS // 4)
    p_first, p_pairs = expected(1.0)
    assert_rejected(first, p_first)
    assert_rejected(pairs, p_pairs)


def test_negative_control_min_p_over_q_on_top_k_candidates_is_rejected():
    # min(1, p/q) is only exact when the children were drawn from q; applied to top-k candidates it
    # over-emits them. A quarter of the trials already exposes it.
    first, _, _ = run_trials(lambda root, rng: top_k_tree(root, rng, mark_sampled=True), temperature=1.0,
                             tokens_needed=1, n=N_TRIALS // 4)
    p_first, _ = expected(1.0)
    assert_rejected(first, p_first)
