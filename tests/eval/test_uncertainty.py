"""Bootstrap intervals over questions: recomputed by hand from the same draws, enumerated for two questions,
paired against unpaired, differences that do and do not exclude 0, pooled repeats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from draftlab.data.errors import DataError
from draftlab.eval.uncertainty import (
    group_intervals,
    mean_of_groups_intervals,
    paired_difference,
    pooled_interval,
    speedup_interval,
    speedup_of,
    tau_interval,
)


def _row(qid, accepted, rounds, tps, ar_tps, category="writing"):
    return {"question_id": qid, "category": category, "accepted": accepted, "rounds": rounds, "tps": tps,
            "ar_tps": ar_tps}


ROWS = [_row(1, 10, 4, 5.0, 2.0), _row(2, 9, 3, 6.0, 2.0), _row(3, 8, 3, 4.0, 2.0), _row(4, 12, 3, 6.0, 4.0)]


def _percentile(values, q):
    """Linear interpolation between order statistics, written out: rank h = (n - 1) q."""
    v = sorted(values)
    h = (len(v) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (h - lo) * (v[hi] - v[lo])


def _draws(n, resamples, seed):
    # the documented draw: numpy's default_rng(seed).integers(0, n, size=(resamples, n))
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n)).tolist()


def test_intervals_match_a_hand_computation_on_the_same_draws():
    resamples, seed, level = 9, 11, 0.8
    taus, srs = [], []
    for draw in _draws(len(ROWS), resamples, seed):
        accepted = rounds = tps = ar = 0.0
        for i in draw:
            accepted += ROWS[i]["accepted"]
            rounds += ROWS[i]["rounds"]
            tps += ROWS[i]["tps"]
            ar += ROWS[i]["ar_tps"]
        taus.append(accepted / rounds)
        srs.append(tps / ar)  # a ratio of sums over the same questions = the ratio of their means
    expected_tau = [_percentile(taus, 0.1), _percentile(taus, 0.9)]
    expected_sr = [_percentile(srs, 0.1), _percentile(srs, 0.9)]
    assert len(set(taus)) > 3  # the draws really differ
    assert tau_interval(ROWS, resamples=resamples, seed=seed, level=level) == pytest.approx(expected_tau)
    assert speedup_interval(ROWS, resamples=resamples, seed=seed, level=level) == pytest.approx(expected_sr)
    both = group_intervals(ROWS, resamples=resamples, seed=seed, level=level)
    assert both == {"tau_ci": pytest.approx(expected_tau), "speedup_ci": pytest.approx(expected_sr)}
    # seeded: the same call gives the same interval, another seed another one
    assert tau_interval(ROWS, resamples=resamples, seed=seed, level=level) == tau_interval(
        ROWS, resamples=resamples, seed=seed, level=level)
    assert tau_interval(ROWS, resamples=resamples, seed=seed + 1, level=level) != pytest.approx(expected_tau)


def test_two_questions_enumerated():
    # Resamples of two questions: {1,1} (p 1/4), {2,2} (p 1/4), {1,2} in either order (p 1/2).
    # τ: q1 alone 10/4 = 2.5, q2 alone 9/3 = 3.0, mixed 19/7. SR: 5/2 = 2.5, 6/2 = 3.0, mixed 11/4.
    rows = ROWS[:2]
    # 95 %: the 2.5th and 97.5th percentiles fall inside the two single-question masses of 1/4 each
    assert tau_interval(rows) == pytest.approx([2.5, 3.0])
    assert speedup_interval(rows) == pytest.approx([2.5, 3.0])
    # 40 %: the 30th and 70th percentiles both fall inside the mixed mass (from 1/4 to 3/4)
    assert tau_interval(rows, level=0.4) == pytest.approx([19 / 7, 19 / 7])
    assert speedup_interval(rows, level=0.4) == pytest.approx([11 / 4, 11 / 4])
    # one question cannot vary
    assert group_intervals(rows[:1]) == {"tau_ci": [2.5, 2.5], "speedup_ci": [2.5, 2.5]}


def test_paired_speedup_interval_is_narrower_when_speeds_are_correlated():
    # AR speed varies fivefold across questions (answer length, prompt length); the method is about
    # twice as fast on every one of them, so the per-question ratio hardly moves.
    ar = [10.0, 50.0, 20.0, 45.0, 15.0, 30.0, 12.0, 40.0, 25.0, 35.0, 18.0, 48.0]
    wiggle = [1.02, 0.97, 1.01, 0.99, 1.03, 0.98, 1.0, 1.02, 0.97, 1.01, 0.99, 1.0]
    rows = [_row(i, 3, 1, 2 * a * w, a) for i, (a, w) in enumerate(zip(ar, wiggle))]
    paired = speedup_interval(rows)
    unpaired = speedup_interval(rows, paired=False)
    sr = sum(r["tps"] for r in rows) / sum(ar)
    assert paired[0] <= sr <= paired[1] and unpaired[0] <= sr <= unpaired[1]
    assert paired[1] - paired[0] < (unpaired[1] - unpaired[0]) / 5


def _shifted(rows, tau_shift, sr_factor):
    """Rows of a run whose τ differs by ``tau_shift[i]`` and whose method speed by ``sr_factor[i]`` per question."""
    return [_row(r["question_id"], r["accepted"] + d * r["rounds"], r["rounds"], r["tps"] * f, r["ar_tps"],
                 r["category"]) for r, d, f in zip(rows, tau_shift, sr_factor)]


BASE = [_row(i, acc, 10, tps, ar) for i, (acc, tps, ar) in enumerate(
    [(20, 30.0, 20.0), (40, 70.0, 30.0), (25, 35.0, 20.0), (35, 60.0, 28.0), (30, 50.0, 25.0), (22, 32.0, 21.0),
     (38, 66.0, 30.0), (28, 44.0, 24.0), (33, 55.0, 26.0), (26, 40.0, 22.0), (36, 62.0, 29.0), (24, 36.0, 20.0)])]


def test_a_consistent_difference_excludes_zero_and_noise_does_not():
    n = len(BASE)
    # better: +0.2 τ (0.15..0.25) and about 5 % faster on every question
    better = _shifted(BASE, [0.15 + 0.1 * (i % 2) for i in range(n)], [1.04 + 0.02 * (i % 2) for i in range(n)])
    d = paired_difference(better, BASE)
    assert d["n_questions"] == n
    assert d["tau"]["diff"] == pytest.approx(0.2) and d["tau"]["excludes_zero"]
    assert d["tau"]["ci"][0] > 0 and d["speedup"]["excludes_zero"] and d["speedup"]["ci"][0] > 0
    # the same +0.2 is well inside each run's own τ interval: only the pairing sees it
    own_a, own_b = tau_interval(better), tau_interval(BASE)
    assert own_a[0] < own_b[1]
    # noise: ±0.2 τ and ±5 % speed, alternating, averaging to nothing
    noisy = _shifted(BASE, [0.2 * (-1) ** i for i in range(n)], [1 + 0.05 * (-1) ** (i // 2) for i in range(n)])
    d = paired_difference(noisy, BASE)
    assert d["tau"]["ci"][0] < 0 < d["tau"]["ci"][1] and not d["tau"]["excludes_zero"]
    assert d["speedup"]["ci"][0] < 0 < d["speedup"]["ci"][1] and not d["speedup"]["excludes_zero"]
    # pairing is by question id, not position
    assert paired_difference(list(reversed(noisy)), BASE)["tau"]["diff"] == pytest.approx(d["tau"]["diff"])


def test_mismatched_questions_are_refused():
    other = BASE[:-1] + [_row(99, 30, 10, 40.0, 20.0)]
    with pytest.raises(DataError, match=r"^the runs answered different questions: 1 only in the first \(11\), "
                                        r"1 only in the second \(99\)$"):
        paired_difference(BASE, other)
    with pytest.raises(DataError, match="different questions: 0 only in the first \\(none\\), 1 only in the second"):
        paired_difference(BASE[:-1], BASE)
    recategorised = [dict(r, category="coding") if r["question_id"] == 3 else r for r in BASE]
    with pytest.raises(DataError, match="question 3 is 'writing' in the first and 'coding' in the second"):
        paired_difference(BASE, recategorised)
    with pytest.raises(DataError, match="different questions"):
        pooled_interval([BASE, other])


def test_pooled_repeats_add_the_run_to_run_spread():
    single = pooled_interval([BASE])
    assert single["n_runs"] == 1 and single["n_questions"] == len(BASE)
    assert single["tau_ci"] == pytest.approx(tau_interval(BASE))  # one run: the one-run interval, same draws
    assert single["speedup_ci"] == pytest.approx(speedup_interval(BASE))
    # three repeats of one configuration: same τ, but a machine 20 % slower or faster on some runs
    runs = [_shifted(BASE, [0.0] * len(BASE), [f] * len(BASE)) for f in (0.8, 1.0, 1.2)]
    pooled = pooled_interval(runs)
    assert pooled["n_runs"] == 3
    assert pooled["speedup"] == pytest.approx(speedup_of(BASE))  # mean factor 1
    assert pooled["tau"] == pytest.approx(single["tau"])
    width = pooled["speedup_ci"][1] - pooled["speedup_ci"][0]
    assert width > 1.5 * (single["speedup_ci"][1] - single["speedup_ci"][0])
    # identical repeats add nothing: the interval is the single run's again (questions shared across runs)
    same = pooled_interval([BASE, BASE, BASE])
    assert same["tau_ci"] == pytest.approx(single["tau_ci"]) and same["speedup_ci"] == pytest.approx(single["speedup_ci"])


def test_mean_of_groups_interval_and_bad_settings():
    # two fixed groups (one question each) average to a fixed value
    g = mean_of_groups_intervals([[ROWS[0]], [ROWS[1]]])
    assert g == {"tau_ci": pytest.approx([2.75, 2.75]), "speedup_ci": pytest.approx([2.75, 2.75])}
    with pytest.raises(ValueError, match="level must be between 0 and 1"):
        tau_interval(ROWS, level=95)
    with pytest.raises(ValueError, match="resamples must be at least 1"):
        tau_interval(ROWS, resamples=0)
    with pytest.raises(DataError, match="no questions to resample"):
        tau_interval([])
