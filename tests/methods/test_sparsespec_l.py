"""SparseSpec-L: slot selection, the entropy controller, and the drafter over a strictly sparse view.

The conformance suite runs the shipped config (whose 128-slot minimum budget covers tiny prompts, i.e. a
dense view); here the budget is cut far below the context so that drafts are really rejected.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from draftlab.decoding.sampling import logits_to_probs
from draftlab.methods.sparsespec_l import (
    EntropyController,
    FixedK,
    MassHistory,
    SparseSpecDrafter,
    budget_slots,
    select_slots,
)
from tests.decoding.conformance.checks import check_greedy_equals_ar, check_sampling
from tests.methods.corpus import TRAIN_PROMPTS

PROMPT = [int(t) for t in torch.randint(0, 5000, (160,), generator=torch.Generator().manual_seed(7))]


def sparse(**kw):
    cfg = dict(budget=0.1, min_budget=12, sinks=2, window=4, stat_rows=8, k=3, k_max=6)
    return SparseSpecDrafter(**(cfg | kw))


@pytest.fixture(scope="module")
def own_text(tiny_target):
    """A prompt continued by tiny_random itself: its random attention is spread thin, so on random context a
    sparse view is never accepted; on its own continuation a 60 % view sometimes is."""
    cont, _ = autoregressive_generate(tiny_target, TRAIN_PROMPTS[1], GenerationConfig(max_new_tokens=150,
                                                                                      stop_on_eos=False))
    return TRAIN_PROMPTS[1] + cont


# ---- selection -----------------------------------------------------------------------------------------


def test_budget_slots():
    assert budget_slots(8000, 0.1, 128) == 800
    assert budget_slots(500, 0.1, 128) == 128
    assert budget_slots(100, 0.1, 128) == 100  # never more than the context


def test_select_keeps_sinks_window_and_the_heaviest_slots_per_head():
    scores = torch.zeros(2, 2, 20)
    scores[0, 0, [7, 9, 11]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 1, [5, 6]] = 5.0
    scores[1, :, 10] = 1.0
    idx = select_slots(scores, 24, 2 + 3 + 2, sinks=2, window=3)  # slots 20-23 have no score yet
    assert idx.shape == (2, 2, 7)
    assert idx[0, 0].tolist() == [0, 1, 7, 9, 21, 22, 23]  # sinks, top-2 by mass, window
    assert idx[0, 1].tolist() == [0, 1, 5, 6, 21, 22, 23]  # per head
    assert {0, 1, 10, 21, 22, 23} <= set(idx[1, 0].tolist())
    for row in idx.reshape(-1, 7):
        assert row.unique().numel() == 7 and torch.equal(row, row.sort().values)
    assert torch.equal(select_slots(scores, 20, 20, sinks=2, window=3)[1, 1], torch.arange(20))


def test_history_sums_the_last_rows_and_a_dropped_slot_comes_back():
    h = MassHistory(rows=4)
    one_hot = lambda i: torch.zeros(1, 1, 12).index_fill_(-1, torch.tensor([i]), 1.0)  # noqa: E731
    h.add(one_hot(5) * 4, 4)
    pick = lambda: select_slots(h.scores(12), 12, 2, sinks=1, window=0)[0, 0].tolist()  # noqa: E731
    assert pick() == [0, 5]
    h.add(one_hot(8) * 2, 2)  # the older pass still covers 2 of the 4 rows
    assert torch.equal(h.scores(12)[0, 0, [5, 8]], torch.tensor([4.0, 2.0]))
    h.add(one_hot(8) * 2, 2)
    h.add(one_hot(8) * 2, 2)  # now the last 4 rows are the two newest passes: slot 5 leaves the view
    assert pick() == [0, 8]
    h.add(one_hot(5) * 9, 4)  # the target attends to slot 5 again: it is recalled from the dense cache
    assert pick() == [0, 5]


# ---- controller ----------------------------------------------------------------------------------------


def test_entropy_controller_follows_the_cost_model():
    c = EntropyController(k_init=2, k_max=8, mu_acc=1.0, mu_rej=3.0, row_cost=0.0)
    assert c.p_accept(1.0) > 0.85 and c.p_accept(3.0) < 0.15 and math.isclose(c.p_accept(2.0), 0.5)
    c.start_round()
    assert c.keep_going(1, 0.5) and not c.keep_going(2, 0.5)  # no costs measured yet: k_init tokens
    # Cheap drafts, expensive verify: confident tokens keep going up to k_max.
    c.record_costs(view_s=0.0, step_s=0.01, verify_s=1.0, rows=3)
    c.start_round()
    drafted = 1
    while c.keep_going(drafted, 0.2):
        drafted += 1
    assert drafted == 8
    # Drafts as expensive as a verify pass and uncertain: one token, then stop.
    c = EntropyController(k_init=2, k_max=8, row_cost=0.0)
    c.record_costs(view_s=0.0, step_s=1.0, verify_s=1.0, rows=2)
    c.start_round()
    assert not c.keep_going(1, 3.0)
    # Entropies move the running centres: accepted drafts towards mu_acc, the first rejected to mu_rej.
    c.observe([0.0, 0.0, 5.0, 0.0], accepted=2)
    assert c.mu_acc < 1.0 and c.mu_rej > 3.0
    f = FixedK(3)
    assert [f.keep_going(i, 9.0) for i in (1, 2, 3)] == [True, True, False]
    with pytest.raises(ValueError):
        FixedK(0)


# ---- the drafter ---------------------------------------------------------------------------------------


def test_a_whole_context_budget_drafts_exactly_what_the_target_says(tiny_target):
    d = SparseSpecDrafter(budget=1.0, controller="fixed", k=4, k_max=4)
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    out, stats = speculative_generate(tiny_target, PROMPT, d, cfg)
    assert out == autoregressive_generate(tiny_target, PROMPT, cfg)[0]
    s = stats.drafter_stats
    assert s["draft_accept_rate"] == 1.0 and s["kv_read_fraction"] == 1.0 and s["k_mean"] == 4


@pytest.mark.parametrize("controller", ["fixed", "entropy"])
def test_a_sparse_view_is_lossy_as_a_draft_and_lossless_as_output(tiny_target, own_text, controller):
    check_greedy_equals_ar(tiny_target, lambda: sparse(controller=controller), [PROMPT, PROMPT[:90]], 24)
    make = lambda: sparse(controller=controller, budget=0.6)  # noqa: E731
    assert check_greedy_equals_ar(tiny_target, make, [own_text], 24) > 0
    _, stats = speculative_generate(tiny_target, own_text, make(), GenerationConfig(max_new_tokens=24,
                                                                                    stop_on_eos=False), trace=True)
    s = stats.drafter_stats
    assert 0 < s["draft_accept_rate"] < 1
    assert s["kv_read_fraction"] < 0.65 and s["budget_mean"] < s["context_mean"]
    check_stats_against_the_engine(stats, budget=0.6, min_budget=12)
    if controller == "entropy":  # no costs measured before the first round: it drafts k tokens
        assert stats.tree_sizes[0] == 3 + 1


def check_stats_against_the_engine(stats, *, budget: float, min_budget: int, k_max: int = 6) -> None:
    """The drafter's own report, recomputed from what the engine recorded of the same rounds.

    A round's context is the committed length before it (the trace's anchor); its view keeps
    ``budget_slots(context)`` slots per KV head, and each of its drafted tokens reads that fraction.
    """
    s, trace, rounds = stats.drafter_stats, stats.trace, stats.rounds
    drafted = [n - 1 for n in stats.tree_sizes]
    keep = [budget_slots(r.anchor, budget, min_budget) for r in trace]
    assert all(1 <= k <= k_max for k in drafted) and all(r.deterministic for r in trace)
    assert s["k_mean"] == pytest.approx(sum(drafted) / rounds, rel=1e-12)
    assert s["draft_accept_rate"] == pytest.approx(sum(len(r.path) - 1 for r in trace) / sum(drafted), rel=1e-12)
    assert s["context_mean"] == pytest.approx(sum(r.anchor for r in trace) / rounds, rel=1e-12)
    assert s["budget_mean"] == pytest.approx(sum(keep) / rounds, rel=1e-12)
    read = sum(k * b / r.anchor for k, b, r in zip(drafted, keep, trace)) / sum(drafted)
    assert s["kv_read_fraction"] == pytest.approx(read, rel=1e-12)
    # Times: the view and the draft steps run inside the engine's propose interval; the drafter's verify
    # interval (end of propose to start of update) covers the engine's verify interval and lies inside the round.
    draft_s, verify_s = sum(stats.draft_times), sum(stats.verify_times)
    own_draft_s = (s["view_ms"] * rounds + s["draft_step_ms"] * sum(drafted)) / 1e3
    assert 0 < own_draft_s <= draft_s * (1 + 1e-9)
    assert verify_s <= s["verify_ms"] * rounds / 1e3 * (1 + 1e-9) <= (draft_s + verify_s) * (1 + 1e-9)


def test_sampling_over_a_sparse_view_follows_the_target(tiny_target):
    # A 10 % view of random context is rarely accepted; what must hold is that the output still follows the
    # target (check_sampling asserts it) and that drafts were accepted at all, so the min(1, p/q) path ran.
    res = check_sampling(tiny_target, lambda: sparse(controller="fixed"), [PROMPT[:120]], n=40, seeds=range(4),
                         temperature=1.0)
    assert res["accepted"] > 0


def test_a_dense_view_reports_the_target_sampling_distribution_as_q(tiny_target):
    # With every slot kept the draft pass is the target's own forward, so each reported q row must be the
    # target's sampling distribution at that position, temperature, top-k and top-p applied; then
    # min(1, p/q) accepts every sampled draft.
    t, top_k, top_p = 0.7, 50, 0.9
    cfg = GenerationConfig(max_new_tokens=24, temperature=t, top_k=top_k, top_p=top_p, seed=3, stop_on_eos=False)
    d = SparseSpecDrafter(budget=1.0, controller="fixed", k=4, k_max=4)
    _, stats = speculative_generate(tiny_target, PROMPT[:120], d, cfg, trace=True)
    for r in stats.trace:
        assert not r.deterministic and r.draft_probs.shape[0] == len(r.tokens) == 5
        p = logits_to_probs(r.target_logprobs[:-1], t, top_k, top_p)  # row i: the token of node i + 1
        torch.testing.assert_close(r.draft_probs[1:].float(), p, atol=1e-5, rtol=0)
    assert stats.drafter_stats["draft_accept_rate"] == 1.0


def test_bad_settings_are_refused():
    for kw in ({"budget": 0.0}, {"budget": 1.5}, {"controller": "oracle"}, {"stat_rows": 0},
               {"controller": "fixed", "k": 9, "k_max": 4}):
        with pytest.raises(ValueError):
            SparseSpecDrafter(**kw)
