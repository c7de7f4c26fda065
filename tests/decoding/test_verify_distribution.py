"""The lossless proof, statistically: speculative output is distributed exactly as target sampling.

A bigram (Markov) stub target and a different bigram draft over a tiny vocabulary. Each trial decodes
from a fixed root token until two tokens are emitted (a second round is run when the first emits only
its bonus token, exactly as the engine would), and the empirical distribution of the first emitted
token and of the first two is compared with ``logits_to_probs`` of the target.

Every source of randomness is seeded, so the outcome is deterministic. The thresholds are such that a
correct rule would fail them, whatever the seed, with probability about 1e-3 (chi-square) and 1e-8 (TV);
the negative controls show that wrong rules do fail the very same checks.
"""

from __future__ import annotations

import bisect
import math
import random

import pytest
import torch
from scipy import stats as scipy_stats

from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import VerifyResult, verify

V = 6
ROOT = 0
# 8k trials per case (8k-16k verify rounds: a two-token trial needs a second round whenever the first
# emits only its bonus) keeps the file near 10 s on an idle 2-core CPU, where per-op overhead on tiny
# tensors makes a verify round cost 0.1-0.3 ms.
N_TRIALS = 8_000
P_VALUE_MIN = 1e-3


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Row t holds the logits of the token that follows t; scale 1.5 makes target and draft disagree a
    # lot (TV between them well above the test's resolution) so the negative controls have teeth.
    target = 1.5 * torch.randn(V, V, generator=gen)  # [V, V]
    draft = 1.5 * torch.randn(V, V, generator=gen)  # [V, V]
    return target, draft


TARGET_LOGITS, DRAFT_LOGITS = _tables()
Q = logits_to_probs(DRAFT_LOGITS, 1.0)  # [V, V] draft distribution after each token
Q_CUM = [list(row) for row in Q.double().cumsum(-1).tolist()]


def tv_bound(support: int, n: int) -> float:
    # E[TV(empirical, p)] <= 1/2 * sum_i sqrt(p_i / n) <= 1/2 * sqrt(K / n) (Cauchy-Schwarz over the K
    # bins), and TV moves by at most 1/n when one sample changes, so McDiarmid gives
    # P(TV > E[TV] + 3/sqrt(n)) <= exp(-2 * 9) ~ 1.5e-8. A correct sampler passes with that certainty.
    return 0.5 * math.sqrt(support / n) + 3.0 / math.sqrt(n)


def distribution_check(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, float]:
    """Return (chi-square p-value, TV distance, TV bound) of ``counts`` against ``probs``."""
    counts = counts.flatten().double()  # [K]
    probs = probs.flatten().double()  # [K]
    probs = probs / probs.sum()
    n = counts.sum().item()
    support = probs > 0
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    bound = tv_bound(int(support.sum()), int(n))
    if counts[~support].sum() > 0:
        # A token the target can never emit was emitted: no statistics needed.
        return 0.0, tv, bound
    obs, exp = counts[support], probs[support] * n
    # Chi-square needs expected counts >= 5 per bin: pool the small bins into one.
    small = exp < 5
    if small.any():
        pooled_obs, pooled_exp = obs[small].sum(), exp[small].sum()
        obs, exp = obs[~small], exp[~small]
        if pooled_exp >= 5 or len(exp) == 0:
            obs, exp = torch.cat([obs, pooled_obs[None]]), torch.cat([exp, pooled_exp[None]])
        else:
            obs[exp.argmin()] += pooled_obs
            exp[exp.argmin()] += pooled_exp
    p_value = float(scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue)
    return p_value, tv, bound


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    p_value, tv, bound = distribution_check(counts, probs)
    assert p_value > P_VALUE_MIN, f"chi-square p-value {p_value:.2e} (TV {tv:.4f})"
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"


def assert_rejected(counts: torch.Tensor, probs: torch.Tensor) -> None:
    p_value, tv, bound = distribution_check(counts, probs)
    assert p_value < P_VALUE_MIN and tv > bound, f"wrong rule passed: p-value {p_value:.2e}, TV {tv:.4f}"


# ---- proposers: (root token, uniform source) -> DraftTree -------------------------------------------


def _draw(parent_token: int, rng: random.Random) -> int:
    cum = Q_CUM[parent_token]
    return min(bisect.bisect_right(cum, rng.random() * cum[-1]), V - 1)


def _top(parent_token: int, k: int) -> list[int]:
    return torch.topk(Q[parent_token], k).indices.tolist()


def _draft_rows(tokens: list[int], parents: list[int]) -> torch.Tensor:
    # Row i is the distribution node i was sampled from: q(. | token of its parent); row 0 unused.
    parent_tokens = [tokens[max(parent, 0)] for parent in parents]
    return Q[parent_tokens]  # [N, V]


_DET_TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
_det_tree_cache: dict[tuple[int, bool], DraftTree] = {}


def top_k_tree(root: int, rng: random.Random, *, mark_sampled: bool = False) -> DraftTree:
    """EAGLE-style deterministic tree: the draft's top-3 children of the root, top-2 under each."""
    key = (root, mark_sampled)
    if key not in _det_tree_cache:
        level1 = _top(root, 3)
        tokens = [root, *level1] + [t for c in level1 for t in _top(c, 2)]
        if mark_sampled:
            # The bug the negative control plants: top-k candidates verified with min(1, p/q).
            tree = DraftTree.from_parents(tokens, _DET_TREE_PARENTS, _draft_rows(tokens, _DET_TREE_PARENTS), False)
        else:
            tree = DraftTree.from_parents(tokens, _DET_TREE_PARENTS, deterministic=True)
        _det_tree_cache[key] = tree
    return _det_tree_cache[key]


_CHAIN_PARENTS = torch.tensor([-1, 0, 1])
_CHAIN_DEPTH = torch.tensor([0, 1, 2])
_greedy_chain_cache: dict[int, DraftTree] = {}


def greedy_chain(root: int, rng: random.Random) -> DraftTree:
    """Deterministic depth-2 chain: the draft's argmax twice."""
    if root not in _greedy_chain_cache:
        x1 = _top(root, 1)[0]
        _greedy_chain_cache[root] = DraftTree.chain(root, [x1, _top(x1, 1)[0]])
    return _greedy_chain_cache[root]


def sampled_chain(root: int, rng: random.Random) -> DraftTree:
    """Depth-2 chain sampled from the draft."""
    x1 = _draw(root, rng)
    x2 = _draw(x1, rng)
    # Built directly rather than through DraftTree.chain: the harness runs tens of thousands of rounds.
    return DraftTree(torch.tensor([root, x1, x2]), _CHAIN_PARENTS, _CHAIN_DEPTH, Q[[root, root, x1]], False)


_SAMPLED_TREE_PARENTS = [-1, 0, 0, 0, 1, 1]
_SAMPLED_TREE_PARENTS_T = torch.tensor(_SAMPLED_TREE_PARENTS)
_SAMPLED_TREE_DEPTH = torch.tensor([0, 1, 1, 1, 2, 2])


def sampled_tree(root: int, rng: random.Random) -> DraftTree:
    """Three i.i.d. draft samples under the root, two i.i.d. samples under the first (SpecInfer)."""
    tokens = [root, _draw(root, rng), _draw(root, rng), _draw(root, rng)]
    tokens += [_draw(tokens[1], rng), _draw(tokens[1], rng)]
    return DraftTree(torch.tensor(tokens), _SAMPLED_TREE_PARENTS_T, _SAMPLED_TREE_DEPTH,
                     _draft_rows(tokens, _SAMPLED_TREE_PARENTS), False)


def always_accept(target_logits, tree, *, temperature, top_k=None, top_p=None, generator=None) -> VerifyResult:
    """A deliberately wrong verifier: takes the first child at every node, never rejects."""
    children = [[] for _ in range(tree.size)]
    for i, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            children[parent].append(i)
    path = [0]
    while children[path[-1]]:
        path.append(children[path[-1]][0])
    return VerifyResult(path, int(target_logits[path[-1]].argmax()))


# ---- the harness ---------------------------------------------------------------------------------------


def run_trials(propose, *, temperature, top_k=None, top_p=None, tokens_needed=2, n=N_TRIALS, seed=0,
               verifier=verify) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``n`` independent continuations of ROOT; return counts of the first token ``[V]`` and of the
    first two tokens ``[V, V]`` (all zero when ``tokens_needed == 1``)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    first = [0] * V
    pairs = [0] * (V * V)
    for _ in range(n):
        emitted: list[int] = []
        root = ROOT
        while len(emitted) < tokens_needed:
            tree = propose(root, rng)
            # The stub target's row for node i depends on node i's token only (a bigram model).
            result = verifier(TARGET_LOGITS[tree.tokens], tree, temperature=temperature, top_k=top_k,
                              top_p=top_p, generator=gen)
            emitted += result.accepted_tokens(tree)
            root = emitted[-1]
        first[emitted[0]] += 1
        if tokens_needed >= 2:
            pairs[emitted[0] * V + emitted[1]] += 1
    return torch.tensor(first), torch.tensor(pairs).reshape(V, V)


def expected(temperature, top_k=None, top_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-sampling distributions: p(x1) ``[V]`` and p(x1) p(x2 | x1) ``[V, V]``."""
    p = logits_to_probs(TARGET_LOGITS, temperature, top_k, top_p).double()  # [V, V]
    return p[ROOT], p[ROOT][:, None] * p


CASES = {
    # name: (proposer, temperature, top_k, top_p, tokens needed per trial). Both acceptance rules at
    # both temperatures, one truncated case each; the two-token cases also check the joint law.
    "top_k_tree_T0.7_top_p": (top_k_tree, 0.7, None, 0.8, 1),
    "greedy_chain_T1": (greedy_chain, 1.0, None, None, 2),
    "sampled_chain_T0.7_top_k": (sampled_chain, 0.7, 4, None, 2),
    "sampled_tree_T1": (sampled_tree, 1.0, None, None, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target(case):
    propose, temperature, top_k, top_p, tokens_needed = CASES[case]
    first, pairs = run_trials(propose, temperature=temperature, top_k=top_k, top_p=top_p,
                              tokens_needed=tokens_needed)
    p_first, p_pairs = expected(temperature, top_k, top_p)
    assert_matches(first, p_first)
    if tokens_needed == 2:
        assert_matches(pairs, p_pairs)


def test_the_harness_is_meaningful():
    # The draft really is a different distribution, so acceptance is far from trivial.
    p_first, _ = expected(1.0)
    assert 0.5 * (Q[ROOT].double() - p_first).abs().sum() > 0.2


def test_negative_control_always_accept_is_rejected():
    # A quarter of the trials already gives a decisive failure: a wrong rule that fails with fewer
    # samples fails a fortiori with more.
    first, pairs = run_trials(sampled_chain, temperature=1.0, verifier=always_accept, n=N_TRIALS // 4)
    p_first, p_pairs = expected(1.0)
    assert_rejected(first, p_first)
    assert_rejected(pairs, p_pairs)


def test_negative_control_min_p_over_q_on_top_k_candidates_is_rejected():
    # min(1, p/q) is only exact when the children were drawn from q; applied to top-k candidates it
    # over-emits them. A quarter of the trials already exposes it.
    first, _ = run_trials(lambda root, rng: top_k_tree(root, rng, mark_sampled=True), temperature=1.0,
                          tokens_needed=1, n=N_TRIALS // 4)
    p_first, _ = expected(1.0)
    assert_rejected(first, p_first)
