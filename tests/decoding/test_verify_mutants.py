"""Mutation harness for the verifier: wrong acceptance rules planted in a copy of it fail the statistics.

The statistical tests of ``verify`` (test_verify_distribution.py) only mean something if a wrong rule
fails them. ``MUTANTS`` re-implements the verifier's walk (``_walk``) with one deliberate bug each, every
one a plausible slip in the rules of ``draftlab.decoding.verify``'s docstring, and names the case that
kills it. Each mutant runs through the very check the exact rule passes (``stats.assert_matches``) and
must fail it decisively (chi-square p-value < ``stats.P_VALUE_DECISIVE``); the real ``verify`` passes
the same cases, and so does ``_walk`` without a bug (so a mutant fails by its bug, not by the copy).

The cases are chosen for power: the oracle-ranked deterministic tree at T=1 puts most of the target's
mass on the first siblings (renormalisation and the running residual matter), the sampled tree has
three i.i.d. siblings at the root (the sibling rules), the near-draft tree is where residual acceptance
ratios fall in (0, 1) so the coins matter (``_near_draft``), the sampled chain checks two tokens (rows
and the bonus along the path). With 4k trials per case (8k for the near draft) the weakest kills over
20 further seeds per mutant were p = 1.8e-27 (one shared coin) and 1.2e-41 (no residual
renormalisation); most are far below.

False failures of the exact rule, measured offline by ``python -m tests.decoding.stats`` (500k numpy
multinomial samples of each case's exact law through the same checks; see tests/decoding/stats.py):
oracle_top_k_tree_T1 0.030%, sampled_tree_T1 0.066%, near_sampled_tree_T1 0.028%, sampled_chain_T1
0.066% (binomial standard error <= 0.004%).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, children_lists
from draftlab.decoding.verify import VerifyResult, verify
from tests.decoding.bigram import (
    ROOT,
    Q,
    SampledProposer,
    expected,
    expected_accepted,
    oracle_top_k_tree,
    run_trials,
    sampled_chain,
    sampled_tree,
    target_probs,
)
from tests.decoding.stats import P_VALUE_DECISIVE, assert_matches, assert_min_acceptance, distribution_check


def _near_draft() -> torch.Tensor:
    """The far draft ``Q``, except at the root: there the target's own law at T=1, with its 3rd and 4th
    most likely tokens never proposed and their mass plus 0.05 of the top token's moved to the 2nd.

    That is where one shared coin shows. After the over-proposed 2nd token (p/q = 0.64) is rejected the
    shared coin is known to be >= 0.64, while the top token's acceptance ratio against the residual is
    0.62: it is never accepted (instead of 62% of the time) and the bonus, drawn from what is left,
    over-emits the 3rd and 4th tokens. With a far draft the residual ratios are all >= 1 and one coin or
    several makes no difference at all.
    """
    p = target_probs(1.0)[ROOT].float()  # [V]
    order = torch.argsort(p, descending=True).tolist()
    row = p.clone()
    top, second, third, fourth = order[:4]
    row[second] += row[third] + row[fourth] + 0.05
    row[top] -= 0.05
    row[third] = row[fourth] = 0.0
    q = Q.clone()
    q[ROOT] = row
    return q  # [V, V]


near_sampled_tree = SampledProposer(sampled_tree.parents, _near_draft())

CASES = {
    # name: (proposer, temperature, top_k, top_p, tokens needed per trial, trials)
    "oracle_top_k_tree_T1": (oracle_top_k_tree, 1.0, None, None, 1, 4_000),
    "sampled_tree_T1": (sampled_tree, 1.0, None, None, 2, 4_000),
    "near_sampled_tree_T1": (near_sampled_tree, 1.0, None, None, 1, 8_000),
    "sampled_chain_T1": (sampled_chain, 1.0, None, None, 2, 4_000),
}


# ---- the verifier's walk, re-implemented with a pluggable per-node rule ----------------------------


@dataclass
class _TreeView:
    """What a per-node rule sees: the tree's tokens, each node's coin and, for sampled trees, the law
    each node was drawn from (``q [N, V]``) and its probability of the drawn token (``q_at``)."""

    tokens: list[int]
    coins: list[float]
    q: torch.Tensor | None
    q_at: list[float] | None


def _or_target(residual: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # An empty residual only happens through rounding (see verify's docstring): fall back to p.
    return residual if float(residual.sum()) > 0 else p


def _sampled(p, kids, t):
    """The exact sampled rule: accept with min(1, p_j(x) / q(x)); p_{j+1} = norm(max(0, p_j - q))."""
    rejected = []
    for c in kids:
        if t.coins[c] * t.q_at[c] < float(p[t.tokens[c]]):
            return c, p, rejected
        rejected.append(c)
        residual = (p - t.q[c]).clamp_min(0.0)
        p = _or_target(residual / residual.sum(), p)
    return None, p, rejected


def _deterministic(p, kids, t):
    """The exact deterministic rule: accept with p_j(x) / sum(p_j); p_{j+1} = p_j with x zeroed."""
    rejected = []
    for c in kids:
        x = t.tokens[c]
        if t.coins[c] * float(p.sum()) < float(p[x]):
            return c, p, rejected
        rejected.append(c)
        p = _or_target(p.index_fill(0, torch.tensor([x]), 0.0), p)
    return None, p, rejected


def _walk(sampled_rule=_sampled, deterministic_rule=_deterministic, *, row_lag=False, leaf_bonus_lag=False):
    """A verifier (``verify``'s signature) walking the tree like ``verify`` with the given per-node rules.

    ``row_lag``: the target row of a node's parent is used at the node (the root uses its own row).
    ``leaf_bonus_lag``: when the walk ends at a leaf below the root, the bonus is drawn from the row of
    the leaf's parent.
    """

    def verifier(target_logits, tree: DraftTree, *, temperature, top_k=None, top_p=None, generator=None):
        children, parents = children_lists(tree.parents), tree.parents.tolist()
        q = None if tree.deterministic else tree.draft_probs.float()  # [N, V]
        t = _TreeView(tree.tokens.tolist(), torch.rand(tree.size, generator=generator).tolist(), q,
                  None if q is None else q.gather(1, tree.tokens[:, None]).squeeze(1).tolist())
        rule = deterministic_rule if tree.deterministic else sampled_rule
        path = [0]
        while True:
            node = path[-1]
            row = max(parents[node], 0) if row_lag else node
            if leaf_bonus_lag and not children[node] and node != 0:
                row = parents[node]
            p = logits_to_probs(target_logits[row], temperature, top_k, top_p)  # [V]
            accepted, p, rejected = rule(p, children[node], t) if children[node] else (None, p, [])
            if accepted is None:
                return VerifyResult(path, int(sample(p, generator)), rejected)
            path.append(accepted)

    return verifier


# ---- the mutants: one wrong rule each ------------------------------------------------------------------


def _sampled_no_renormalisation(p, kids, t):
    """p_{j+1} = max(0, p_j - q) left unnormalised: later siblings are accepted too rarely."""
    rejected = []
    for c in kids:
        if t.coins[c] * t.q_at[c] < float(p[t.tokens[c]]):
            return c, p, rejected
        rejected.append(c)
        p = _or_target((p - t.q[c]).clamp_min(0.0), p)  # sample() normalises the bonus row itself
    return None, p, rejected


def _sampled_residual_not_subtracted(p, kids, t):
    """p is left as is after a rejection: later siblings and the bonus are judged against p itself."""
    rejected = []
    for c in kids:
        if t.coins[c] * t.q_at[c] < float(p[t.tokens[c]]):
            return c, p, rejected
        rejected.append(c)
    return None, p, rejected


def _sampled_bonus_from_p(p, kids, t):
    """Siblings use the right residuals, but the bonus is drawn from p, not from the last residual."""
    accepted, _, rejected = _sampled(p, kids, t)
    return accepted, p, rejected


def _sampled_shared_coin(p, kids, t):
    """One uniform for all siblings: after a rejection the coin is known to be large, so later siblings
    are accepted too rarely."""
    coin = t.coins[kids[0]]
    rejected = []
    for c in kids:
        if coin * t.q_at[c] < float(p[t.tokens[c]]):
            return c, p, rejected
        rejected.append(c)
        residual = (p - t.q[c]).clamp_min(0.0)
        p = _or_target(residual / residual.sum(), p)
    return None, p, rejected


def _sampled_stale_residual(p, kids, t):
    """p_{j+1} = norm(max(0, p_0 - q)): each residual taken from the node's original p rather than from
    the running p_j, so mass removed by earlier rejections comes back."""
    p0, rejected = p, []
    for c in kids:
        if t.coins[c] * t.q_at[c] < float(p[t.tokens[c]]):
            return c, p, rejected
        rejected.append(c)
        residual = (p0 - t.q[c]).clamp_min(0.0)
        p = _or_target(residual / residual.sum(), p0)
    return None, p, rejected


def _sampled_accept_on_q(p, kids, t):
    """The ratio upside down: accept with min(1, q(x) / p_j(x))."""
    rejected = []
    for c in kids:
        if t.coins[c] * float(p[t.tokens[c]]) < t.q_at[c]:
            return c, p, rejected
        rejected.append(c)
        residual = (p - t.q[c]).clamp_min(0.0)
        p = _or_target(residual / residual.sum(), p)
    return None, p, rejected


def _deterministic_no_renormalisation(p, kids, t):
    """Accept x_j with p(x_j) instead of p_{j-1}(x_j) / sum(p_{j-1}): the remaining mass is never
    renormalised, so siblings after a rejection are accepted too rarely."""
    p0, rejected = p, []
    for c in kids:
        x = t.tokens[c]
        if t.coins[c] < float(p0[x]):
            return c, p, rejected
        rejected.append(c)
        p = _or_target(p.index_fill(0, torch.tensor([x]), 0.0), p)
    return None, p, rejected


def _deterministic_stale_residual(p, kids, t):
    """p_j = p_0 with only x_j zeroed (from the node's original p rather than from p_{j-1}): tokens
    rejected before x_j come back into later siblings' normaliser and into the bonus."""
    p0, rejected = p, []
    for c in kids:
        x = t.tokens[c]
        if t.coins[c] * float(p.sum()) < float(p[x]):
            return c, p, rejected
        rejected.append(c)
        p = _or_target(p0.index_fill(0, torch.tensor([x]), 0.0), p0)
    return None, p, rejected


def _deterministic_bonus_from_p(p, kids, t):
    """Siblings judged right, but the bonus is drawn from p: rejected tokens are emitted again."""
    accepted, _, rejected = _deterministic(p, kids, t)
    return accepted, p, rejected


@dataclass
class Mutant:
    name: str
    verifier: Callable[..., VerifyResult]  # verify's signature
    case: str  # the key of CASES that kills it


MUTANTS = [
    Mutant("sampled_no_residual_renormalisation", _walk(_sampled_no_renormalisation), "sampled_tree_T1"),
    Mutant("sampled_residual_not_subtracted", _walk(_sampled_residual_not_subtracted), "sampled_tree_T1"),
    Mutant("sampled_bonus_from_p", _walk(_sampled_bonus_from_p), "sampled_chain_T1"),
    Mutant("sampled_one_coin_for_all_siblings", _walk(_sampled_shared_coin), "near_sampled_tree_T1"),
    Mutant("sampled_stale_residual_from_original_p", _walk(_sampled_stale_residual), "near_sampled_tree_T1"),
    Mutant("sampled_accept_on_q_over_p", _walk(_sampled_accept_on_q), "sampled_chain_T1"),
    Mutant("deterministic_no_renormalisation", _walk(deterministic_rule=_deterministic_no_renormalisation),
           "oracle_top_k_tree_T1"),
    Mutant("deterministic_stale_residual_from_original_p",
           _walk(deterministic_rule=_deterministic_stale_residual), "oracle_top_k_tree_T1"),
    Mutant("deterministic_bonus_from_p", _walk(deterministic_rule=_deterministic_bonus_from_p),
           "oracle_top_k_tree_T1"),
    Mutant("off_by_one_parent_row_at_each_node", _walk(row_lag=True), "sampled_chain_T1"),
    Mutant("off_by_one_leaf_bonus_from_parent_row", _walk(leaf_bonus_lag=True), "sampled_tree_T1"),
]
KILLED_BY = {m.name: m.case for m in MUTANTS}


def _run(verifier, case: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float, float]:
    """([(counts, exact law)] checked in ``case``, mean accepted drafts, the exact rule's mean)."""
    propose, temperature, top_k, top_p, tokens_needed, n = CASES[case]
    first, pairs, accepted = run_trials(propose, temperature=temperature, top_k=top_k, top_p=top_p,
                                        tokens_needed=tokens_needed, n=n, verifier=verifier)
    p_first, p_pairs = expected(temperature, top_k, top_p)
    laws = [(first, p_first)] + ([(pairs, p_pairs)] if tokens_needed == 2 else [])
    return laws, accepted, expected_accepted(propose, temperature, top_k, top_p)


def exact_laws() -> dict:
    """name -> (trials, exact law of a trial's counted outcome, whether its first-token marginal is
    checked too): what ``python -m tests.decoding.stats`` simulates."""
    laws = {}
    for name, (_, temperature, top_k, top_p, tokens_needed, n) in CASES.items():
        p_first, p_pairs = expected(temperature, top_k, top_p)
        laws[name] = (n, (p_first if tokens_needed == 1 else p_pairs).numpy(), tokens_needed == 2)
    return laws


@pytest.mark.parametrize("verifier", [verify, _walk()], ids=["verify", "walk_without_a_bug"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_rule_passes(case, verifier):
    laws, accepted, expected_mean = _run(verifier, case)
    for counts, probs in laws:
        assert_matches(counts, probs)
    assert_min_acceptance(accepted, expected_mean)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_rejected(mutant):
    # The same check as the exact rule's, failed decisively by at least one of the case's laws.
    laws, _, _ = _run(mutant.verifier, mutant.case)
    checks = [distribution_check(counts, probs) for counts, probs in laws]
    p_value, tv, bound = min(checks)
    assert p_value < P_VALUE_DECISIVE, f"{mutant.name} survived {mutant.case}: p-value {p_value:.2e}, TV {tv:.4f}"


def test_every_mutant_is_killed_by_a_case_the_exact_rule_passes():
    assert set(KILLED_BY.values()) <= set(CASES)
    assert len(KILLED_BY) == len(MUTANTS) >= 8
