"""Percentile-bootstrap intervals for τ and SR, resampling benchmark questions.

The unit resampled is the question, never the verify round: rounds within one question share its prompt,
its answer length and its difficulty, so they are correlated, and treating a question's hundreds of rounds
as independent draws would give intervals far too narrow. A resample draws the group's questions with
replacement (each question keeps all of its rounds and both of its timings) and recomputes the statistic
exactly as ``draftlab.eval.metrics`` does: τ = Σ accepted / Σ rounds, SR = mean(method tok/s) / mean(AR
tok/s). SR is paired with AR: the method and AR answered the same questions in one process, so one set of
question indices serves both means, and a question that is slow for both (a long answer, a cold cache)
moves numerator and denominator together instead of adding to the spread. A difference between two runs
on the same questions is paired the same way (one index set per resample for both runs). Repeats of one
configuration answer the same questions, so questions are crossed with runs rather than nested in them:
a resample draws one set of questions shared by every run and, independently, the runs themselves (see
:func:`pooled_interval`). Intervals are the ``(1 - level) / 2`` and ``(1 + level) / 2`` percentiles of
the resampled statistic, linearly interpolated between order statistics (numpy's default). Draws come from
``numpy.random.default_rng(seed).integers(0, n, size=(resamples, n))``, so a seed fixes every interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from draftlab.data.errors import DataError

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0
# Fewer questions than this get no interval where results are reported (eval records, tables, report deltas):
# a bootstrap over one question has no spread at all and over a handful it badly understates the real one,
# so a per-category cell of one question shows its bare value rather than a falsely tight interval.
MIN_QUESTIONS = 5

Row = Mapping[str, Any]  # one question: question_id, category, accepted, rounds, tps, ar_tps


def _check(rows: Sequence[Row], resamples: int, level: float) -> None:
    if not rows:
        raise DataError("no questions to resample")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level!r}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples!r}")


def _arrays(rows: Sequence[Row]) -> tuple[np.ndarray, ...]:
    """Per-question accepted tokens, rounds, method tok/s and AR tok/s, in row order."""
    return tuple(np.asarray([r[k] for r in rows], dtype=np.float64) for k in ("accepted", "rounds", "tps", "ar_tps"))


def resample_indices(n: int, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``(resamples, n)`` question indices drawn with replacement; the draws every interval here uses."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(values: np.ndarray, level: float = DEFAULT_LEVEL) -> list[float] | None:
    """``[lo, hi]`` percentiles of the finite resampled values (a resample with no rounds has no τ)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return [float(lo), float(hi)]


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return num / den  # 0 / 0 -> nan, dropped by percentile_interval


def tau_of(rows: Sequence[Row]) -> float | None:
    """Pooled τ of the rows: Σ accepted / Σ rounds; None when they have no rounds."""
    rounds = sum(r["rounds"] for r in rows)
    return sum(r["accepted"] for r in rows) / rounds if rounds else None


def speedup_of(rows: Sequence[Row]) -> float | None:
    """SR of the rows: mean method tok/s over mean AR tok/s."""
    ar = sum(r["ar_tps"] for r in rows)
    return sum(r["tps"] for r in rows) / ar if rows and ar else None


def _tau_draws(acc: np.ndarray, rounds: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return _ratio(acc[idx].sum(axis=1), rounds[idx].sum(axis=1))


def _speedup_draws(tps: np.ndarray, ar: np.ndarray, idx: np.ndarray, ar_idx: np.ndarray | None = None) -> np.ndarray:
    return _ratio(tps[idx].mean(axis=1), ar[idx if ar_idx is None else ar_idx].mean(axis=1))


def tau_interval(rows: Sequence[Row], *, resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                 seed: int = DEFAULT_SEED) -> list[float] | None:
    """Percentile interval of τ over questions resampled with replacement."""
    _check(rows, resamples, level)
    acc, rounds, _, _ = _arrays(rows)
    return percentile_interval(_tau_draws(acc, rounds, resample_indices(len(rows), resamples, seed)), level)


def speedup_interval(rows: Sequence[Row], *, paired: bool = True, resamples: int = DEFAULT_RESAMPLES,
                     level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED) -> list[float] | None:
    """Percentile interval of SR. ``paired`` (the default, and the right reading of one evaluation) resamples
    each question's method and AR speeds together; ``paired=False`` draws the AR side's questions
    independently, as if the two had answered unrelated question sets."""
    _check(rows, resamples, level)
    _, _, tps, ar = _arrays(rows)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(rows), size=(resamples, len(rows)))
    ar_idx = None if paired else rng.integers(0, len(rows), size=(resamples, len(rows)))
    return percentile_interval(_speedup_draws(tps, ar, idx, ar_idx), level)


def group_intervals(rows: Sequence[Row], *, resamples: int = DEFAULT_RESAMPLES, level: float = DEFAULT_LEVEL,
                    seed: int = DEFAULT_SEED) -> dict[str, list[float] | None]:
    """``{"tau_ci", "speedup_ci"}`` of one group, both from the same question draws (SR paired with AR)."""
    _check(rows, resamples, level)
    acc, rounds, tps, ar = _arrays(rows)
    idx = resample_indices(len(rows), resamples, seed)
    return {"tau_ci": percentile_interval(_tau_draws(acc, rounds, idx), level),
            "speedup_ci": percentile_interval(_speedup_draws(tps, ar, idx), level)}


def mean_of_groups_intervals(groups: Sequence[Sequence[Row]], *, resamples: int = DEFAULT_RESAMPLES,
                             level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED) -> dict[str, list[float] | None]:
    """``{"tau_ci", "speedup_ci"}`` of the unweighted mean of several groups' τ and SR (an AVG taken over
    table columns): each group's questions are resampled within the group (a stratified bootstrap, so every
    group keeps its size) and the groups' resampled values are averaged."""
    groups = [g for g in groups if g]
    if not groups:
        raise DataError("no questions to resample")
    rng = np.random.default_rng(seed)
    taus, srs = [], []
    for rows in groups:
        _check(rows, resamples, level)
        acc, rounds, tps, ar = _arrays(rows)
        idx = rng.integers(0, len(rows), size=(resamples, len(rows)))
        if tau_of(rows) is not None:
            taus.append(_tau_draws(acc, rounds, idx))
        if speedup_of(rows) is not None:
            srs.append(_speedup_draws(tps, ar, idx))
    return {"tau_ci": percentile_interval(np.mean(taus, axis=0), level) if taus else None,
            "speedup_ci": percentile_interval(np.mean(srs, axis=0), level) if srs else None}


def align_questions(rows_a: Sequence[Row], rows_b: Sequence[Row], names: tuple[str, str] = ("the first", "the second")
                    ) -> list[Row]:
    """``rows_b`` reordered to ``rows_a``'s question order; the two must hold the same questions (``names``
    are the two runs' names in the error)."""
    by_id: dict[Any, Row] = {}
    for r in rows_b:
        if r["question_id"] in by_id:
            raise DataError(f"question {r['question_id']!r} appears twice in {names[1]}'s rows")
        by_id[r["question_id"]] = r
    ids_a = [r["question_id"] for r in rows_a]
    if len(set(ids_a)) != len(ids_a):
        raise DataError(f"a question appears twice in {names[0]}'s rows")
    only_a = [q for q in ids_a if q not in by_id]
    only_b = [q for q in by_id if q not in set(ids_a)]
    if only_a or only_b:
        raise DataError(f"the runs answered different questions: {len(only_a)} only in {names[0]} "
                        f"({_shown(only_a)}), {len(only_b)} only in {names[1]} ({_shown(only_b)})")
    for r in rows_a:
        other = by_id[r["question_id"]]["category"]
        if other != r["category"]:
            raise DataError(f"question {r['question_id']!r} is {r['category']!r} in {names[0]} and {other!r} in "
                            f"{names[1]}")
    return [by_id[q] for q in ids_a]


def _shown(ids: Sequence[Any]) -> str:
    return ", ".join(repr(q) for q in ids[:5]) + (" ..." if len(ids) > 5 else "") if ids else "none"


def _difference(draws: np.ndarray, point: float | None, level: float) -> dict[str, Any]:
    ci = percentile_interval(draws, level) if point is not None else None
    return {"diff": point, "ci": ci, "excludes_zero": bool(ci is not None and (ci[0] > 0 or ci[1] < 0))}


def paired_difference(rows_a: Sequence[Row], rows_b: Sequence[Row], *, resamples: int = DEFAULT_RESAMPLES,
                      level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """τ_a - τ_b and SR_a - SR_b of two runs on the same questions, each with its paired interval.

    Questions are paired by ``question_id`` (the sets must match); every resample applies one index set to
    both runs. Each run's SR is over its own AR answers. Returns ``{"n_questions", "tau": {"diff", "ci",
    "excludes_zero"}, "speedup": {...}}``; ``excludes_zero`` marks a difference the interval does not cover 0.
    """
    _check(rows_a, resamples, level)
    rows_b = align_questions(rows_a, rows_b)
    acc_a, rounds_a, tps_a, ar_a = _arrays(rows_a)
    acc_b, rounds_b, tps_b, ar_b = _arrays(rows_b)
    idx = resample_indices(len(rows_a), resamples, seed)
    tau_a, tau_b, sr_a, sr_b = tau_of(rows_a), tau_of(rows_b), speedup_of(rows_a), speedup_of(rows_b)
    tau_point = tau_a - tau_b if tau_a is not None and tau_b is not None else None
    sr_point = sr_a - sr_b if sr_a is not None and sr_b is not None else None
    return {"n_questions": len(rows_a),
            "tau": _difference(_tau_draws(acc_a, rounds_a, idx) - _tau_draws(acc_b, rounds_b, idx), tau_point, level),
            "speedup": _difference(_speedup_draws(tps_a, ar_a, idx) - _speedup_draws(tps_b, ar_b, idx), sr_point,
                                   level)}


def pooled_interval(runs: Sequence[Sequence[Row]], *, resamples: int = DEFAULT_RESAMPLES,
                    level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """τ and SR pooled over repeats of one configuration, with intervals that add the run-to-run spread.

    Every run must have answered the same questions. The point values pool all runs' questions (τ = Σ
    accepted / Σ rounds over every run, SR = mean method tok/s / mean AR tok/s over every run's rows).
    A two-way bootstrap: each resample draws the questions with replacement once, shared by all runs,
    and the runs with replacement, then pools the drawn questions of the drawn runs. Questions are shared
    because the repeats answered the same ones: drawing them anew within each run (a nested bootstrap)
    would average question difficulty across runs and understate how much a different question set could
    move the result. With a single run this is exactly the one-run interval (same draws, same seed).
    Returns ``{"tau", "speedup", "tau_ci", "speedup_ci", "n_runs", "n_questions"}``.
    """
    if not runs:
        raise DataError("no runs to pool")
    _check(runs[0], resamples, level)
    aligned = [list(runs[0])] + [align_questions(runs[0], r) for r in runs[1:]]
    n, n_runs = len(aligned[0]), len(aligned)
    acc, rounds, tps, ar = (np.stack(a) for a in zip(*(_arrays(r) for r in aligned)))  # each (runs, questions)
    rng = np.random.default_rng(seed)
    q_idx = rng.integers(0, n, size=(resamples, n))
    r_idx = rng.integers(0, n_runs, size=(resamples, n_runs))
    # How often each run was drawn, times the per-run values: per-question totals over the drawn runs.
    counts = np.stack([np.bincount(r, minlength=n_runs) for r in r_idx]).astype(np.float64)

    def summed(values: np.ndarray) -> np.ndarray:
        return np.take_along_axis(counts @ values, q_idx, axis=1).sum(axis=1)

    flat = [row for rows in aligned for row in rows]
    return {"tau": tau_of(flat), "speedup": speedup_of(flat),
            "tau_ci": percentile_interval(_ratio(summed(acc), summed(rounds)), level),
            "speedup_ci": percentile_interval(_ratio(summed(tps), summed(ar)), level),
            "n_runs": n_runs, "n_questions": n}
