"""Cost-aware tree sizing (``tree: auto``): the verify cost curve, the size rule, and the trees it yields."""

from __future__ import annotations

import pytest
import torch

from draftlab.decoding.budget import TreeBudget, tree_budget
from draftlab.decoding.cost import (
    ContextVerifyCost,
    VerifyCost,
    measure_context_cost,
    measure_verify_cost,
    verify_cost,
)
from draftlab.decoding.dynamic_tree import build_dynamic_tree
from tests.decoding.test_tree import FakeDrafter

# ---- the verify cost curve ---------------------------------------------------------------------------


def test_verify_cost_interpolates_and_extrapolates():
    cost = VerifyCost((1, 4, 8), (1.0, 1.6, 3.0))
    assert cost(1) == 1.0 and cost(4) == pytest.approx(1.6) and cost(8) == pytest.approx(3.0)
    assert cost(2) == pytest.approx(1.2) and cost(6) == pytest.approx(2.3)
    assert cost(16) == pytest.approx(3.0 + 8 * 0.35)  # the last segment's slope
    assert cost.step == 1.0
    assert VerifyCost.linear(0.05, 0.01)(11) == pytest.approx(0.15)
    with pytest.raises(ValueError):
        VerifyCost((4, 1), (1.0, 2.0))


def test_context_cost_interpolates_between_context_lengths():
    short, long = VerifyCost((1, 8), (1.0, 2.0)), VerifyCost((1, 8), (2.0, 2.5))
    cost = ContextVerifyCost((100, 300), (short, long))
    assert cost(8) == cost(8, None) == cost(8, 50) == 2.0  # no context, or below the shortest: its curve
    assert cost(1, 200) == pytest.approx(1.5) and cost(8, 200) == pytest.approx(2.25)
    assert cost(1, 500) == pytest.approx(3.0)  # past the longest: the last two curves' slope in the context
    assert cost.step == 1.0 and cost.rows == (1, 8)
    with pytest.raises(ValueError):
        ContextVerifyCost((300, 100), (short, long))


def test_measured_curve_on_a_real_target(tiny_target):
    cost = measure_verify_cost(tiny_target, rows=(1, 2, 8, 32), context=16, reps=3)
    assert cost.rows == (1, 2, 8, 32) and all(s > 0 for s in cost.seconds)
    grid = measure_context_cost(tiny_target, rows=(1, 4), contexts=(16, 64), reps=3)
    assert grid.contexts == (16, 64) and all(s > 0 for c in grid.curves for s in c.seconds)
    assert verify_cost(tiny_target) is verify_cost(tiny_target)  # measured once per target object


# ---- the size rule -----------------------------------------------------------------------------------


def _best_by_brute_force(probs, step, per_row, level_s, levels, a=1.0):
    best, best_rate = 0, -1.0
    for n in range(len(probs) + 1):
        tokens = 1 + sum(min(a * p, 1.0) for p in probs[:n])
        rate = tokens / ((levels + 1) * level_s + step + per_row * n)
        if rate > best_rate + 1e-12:
            best, best_rate = n, rate
    return best


@pytest.mark.parametrize("per_row", [0.0005, 0.005, 0.02, 0.2])
def test_choose_maximises_expected_tokens_per_second(per_row):
    probs = [0.9, 0.8, 0.5, 0.4, 0.3, 0.1, 0.05, 0.02]
    budget = TreeBudget(VerifyCost.linear(0.05, per_row), level_seconds=0.003)
    n = budget.choose(torch.tensor(probs), levels=3)
    assert n == _best_by_brute_force(probs, 0.05, per_row, 0.003, 3)
    assert budget.sizes == [n] and budget.predicted_last == (pytest.approx(sum(probs[:n])) if n else None)


def test_a_long_context_is_planned_with_its_own_curve():
    """Over a long prompt a step costs more while a row adds less (attention over the cache dominates):
    the same scores buy a bigger tree there than a short-context curve would allow."""
    short = VerifyCost.linear(0.040, 0.004)
    long = VerifyCost.linear(0.056, 0.0027)
    probs = torch.tensor([0.3, 0.12, 0.1, 0.08, 0.05])
    budget = TreeBudget(ContextVerifyCost((128, 1536), (short, long)), level_seconds=0.004)
    n_short = budget.choose(probs, 2)
    budget.context = 1536
    n_long = budget.choose(probs, 2)
    assert (n_short, n_long) == (_best_by_brute_force(probs.tolist(), 0.040, 0.004, 0.004, 2),
                                 _best_by_brute_force(probs.tolist(), 0.056, 0.0027, 0.004, 2))
    assert n_long > n_short


def _best_beside(probs, step, per_row, level_s, levels, companion_tokens, companion_rows):
    best, best_rate = 0, -1.0
    for n in range(len(probs) + 1):
        tokens = 1 + companion_tokens + sum(probs[:n])
        rate = tokens / ((levels + 1) * level_s + step + per_row * (n + companion_rows))
        if rate > best_rate + 1e-12:
            best, best_rate = n, rate
    return best


def test_a_confident_companion_leaves_fewer_nodes_worth_verifying():
    """A lookup tree verified in the same pass raises the rate every learned node must beat."""
    probs = [0.6, 0.4, 0.3, 0.2, 0.15, 0.1]
    budget = TreeBudget(VerifyCost.linear(0.05, 0.01), level_seconds=0.002)
    alone = budget.choose(torch.tensor(probs), 2)
    budget.alongside(4.0, 6)
    beside = budget.choose(torch.tensor(probs), 2)
    assert alone == _best_beside(probs, 0.05, 0.01, 0.002, 2, 0.0, 0)
    assert beside == _best_beside(probs, 0.05, 0.01, 0.002, 2, 4.0, 6)
    assert beside < alone
    assert budget.choose(torch.tensor(probs), 2) == alone  # the companion was for one round only


def test_choose_spans_the_whole_range():
    probs = torch.tensor([0.9, 0.8, 0.5, 0.4])
    free = TreeBudget(VerifyCost.linear(0.05, 0.0), level_seconds=0.0)
    dear = TreeBudget(VerifyCost.linear(0.05, 1.0), level_seconds=0.0)
    assert free.choose(probs, 1) == 4  # extra rows cost nothing: verify everything
    assert dear.choose(probs, 1) == 0  # a row costs 20 AR steps: verify the root alone


def test_calibration_follows_what_verification_accepted():
    probs = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    budget = TreeBudget(VerifyCost.linear(0.05, 0.001), level_seconds=0.0)
    first = budget.choose(probs, 1)
    assert first == 6
    sizes = []
    for _ in range(60):  # the draft is overconfident: nothing it proposes is accepted
        sizes.append(budget.choose(probs, 1))
        budget.observe(0)
    assert budget.calibration < 0.1 and 0 in sizes  # it stops verifying proposals ...
    for _ in range(200):
        sizes.append(budget.choose(probs, 1))
        budget.observe(0)
    assert sizes[-1] > 0 or any(n > 0 for n in sizes[-100:])  # ... but tries again now and then
    for _ in range(80):  # underconfident: everything proposed is accepted
        n = budget.choose(probs, 1)
        budget.observe(n)
    assert budget.calibration > 1.5 and budget.choose(probs, 1) == 6


def test_growth_stops_once_another_level_cannot_pay():
    probs = torch.tensor([0.9, 0.5])
    budget = TreeBudget(VerifyCost.linear(0.05, 0.001), level_seconds=0.01)
    assert budget.keep_growing(probs, torch.tensor([0.9, 0.5]), 1)  # up to 1.4 tokens for one level: worth it
    assert not budget.keep_growing(probs, torch.tensor([1e-4, 1e-5]), 1)  # at most 1e-4 tokens: not worth it


def test_tree_setting_is_checked():
    assert tree_budget("fixed") is None and isinstance(tree_budget("auto"), TreeBudget)
    with pytest.raises(ValueError, match="tree must be"):
        tree_budget("big")


# ---- trees sized by the budget -----------------------------------------------------------------------


def _kept(tree):
    """Kept nodes as root paths of tokens (a size-independent name for each node)."""
    paths, parents, tokens = [], tree.parents.tolist(), tree.tokens.tolist()
    for i in range(tree.size):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        paths.append(tuple(reversed(path)))
    return set(paths)


@pytest.mark.parametrize("per_row", [0.0, 0.004, 0.02, 0.08, 1.0])
def test_auto_tree_is_the_best_first_prefix_of_the_fixed_tree(per_row):
    fixed = build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=10)
    budget = TreeBudget(VerifyCost.linear(0.05, per_row), level_seconds=0.0)
    auto = build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=10, budget=budget)
    n = budget.sizes[-1]
    assert auto.size == n + 1
    assert _kept(auto) <= _kept(fixed)  # a subset of the same proposals ...
    same_n = build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=n)
    assert _kept(auto) == _kept(same_n)  # ... namely the fixed tree of the chosen size


def test_auto_tree_skips_levels_that_cannot_pay():
    drafter = FakeDrafter()
    # Each draft level costs 40 AR steps: not even the first children can pay for a second level.
    budget = TreeBudget(VerifyCost.linear(0.05, 0.0), level_seconds=2.0)
    tree = build_dynamic_tree(0, drafter, branching=2, depth=3, nodes=10, budget=budget)
    assert len(drafter.calls) == 1 and tree.max_depth == 1
    cheap = FakeDrafter()
    build_dynamic_tree(0, cheap, branching=2, depth=3, nodes=10,
                       budget=TreeBudget(VerifyCost.linear(0.05, 0.0), level_seconds=1e-5))
    assert len(cheap.calls) == 3


def test_measured_level_time_is_folded_in():
    budget = TreeBudget(VerifyCost.linear(0.05, 0.001))
    build_dynamic_tree(0, FakeDrafter(), branching=2, depth=3, nodes=10, budget=budget)
    assert budget.level_seconds > 0.0
