"""Per-prompt acceptance in the served-vs-draftlab record: each prompt's per-position acceptance rates of the
served engine (its counter deltas) and of draftlab's chain (its accept lengths counted as vLLM counts them)."""

from __future__ import annotations

import pytest

from draftlab.eval.answers import acceptance_rates
from draftlab.eval.served_metrics import ChainAnswer, ServedAnswer, SpecCounters, chain_counters, compare

K = 3
# Accepted draft tokens per round, per prompt: what the engine reports and what draftlab's chain accepted.
SERVED = [[3, 1, 0], [2, 2], [0, 0, 0, 1]]
CHAIN = [[3, 0, 0], [2, 2], [1, 0, 0, 1]]


def _served(rounds: list[int], tokens: list[int]) -> ServedAnswer:
    counters = SpecCounters(len(rounds), K * len(rounds), sum(rounds),
                            tuple(float(sum(r > i for r in rounds)) for i in range(K)))
    return ServedAnswer(tokens, "", [1, 2], 1.0, 10.0, counters, len(tokens))


def _records():
    tokens = [[7, 8, 9], [5, 6], [4]]
    spec = [_served(r, t) for r, t in zip(SERVED, tokens)]
    plain = [_served([], t) for t in tokens]
    chain = [ChainAnswer([1, 2], t, 10.0, chain_counters([a + 1 for a in r], K), 0.3) for r, t in zip(CHAIN, tokens)]
    return compare(plain, spec, chain, k=K, resamples=50)


def test_each_prompt_carries_both_sides_position_rates():
    rows = _records()["per_prompt"]
    assert len(rows) == len(SERVED)
    for row, served, chain in zip(rows, SERVED, CHAIN):
        assert row["served_acceptance"] == pytest.approx([sum(r > i for r in served) / len(served) for i in range(K)])
        assert row["draftlab_acceptance"] == pytest.approx([sum(r > i for r in chain) / len(chain) for i in range(K)])
    assert rows[0]["served_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert rows[0]["draftlab_acceptance"] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    # the earlier per-prompt keys are unchanged
    assert rows[1]["served_tau"] == pytest.approx(3.0) and rows[1]["draftlab_tau"] == pytest.approx(3.0)


def test_per_prompt_rates_match_the_answer_files_rates():
    # draftlab's answer records count acceptance the same way, stopping at the longest accepted run
    rows = _records()["per_prompt"]
    for row, chain in zip(rows, CHAIN):
        own = acceptance_rates([a + 1 for a in chain])
        assert row["draftlab_acceptance"][: len(own)] == pytest.approx(own)
        assert all(r == 0 for r in row["draftlab_acceptance"][len(own):])


def test_a_prompt_without_drafts_has_no_rates():
    tokens = [3]
    spec, plain = [_served([], tokens)], [_served([], tokens)]
    chain = [ChainAnswer([1, 2], tokens, 10.0, SpecCounters(), 0.1)]
    (row,) = compare(plain, spec, chain, k=K, resamples=10)["per_prompt"]
    assert row["served_acceptance"] == [] and row["draftlab_acceptance"] == []
    assert row["served_tau"] is None
