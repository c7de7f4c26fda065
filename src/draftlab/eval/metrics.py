"""Spec-Bench metrics from answer files: mean accepted length τ, speed-up ratio SR, acceptance survival.

The definitions follow Spec-Bench's ``evaluation/speed.py``:

* **τ** is ``mean`` of the *pooled* per-round ``accept_lengths`` of every question in a group (so a
  question with more rounds weighs more). It counts the bonus token and is 1.00 for vanilla decoding.
* A question's throughput is ``sum(new_tokens) / sum(wall_time)`` over its turns. With
  ``timing="decode"`` it is ``sum(new_tokens) / (sum(wall_time) - sum(prefill_time))`` instead: on long
  prompts a CPU prefill takes tens of seconds and would swamp the decoding being compared (the prefill
  is the same for every method), so only the time after it counts. The token sampled from the prefill's
  logits is still counted, as ``wall`` counts it.
* **SR** is ``mean(method throughputs) / mean(AR throughputs)`` over the questions of a group: a
  ratio of means of per-question throughputs, not a mean of per-question ratios.
* Every group's τ and SR come with a percentile-bootstrap interval over its questions (``tau_ci``,
  ``speedup_ci``; SR paired with AR), computed from the per-question rows of :func:`question_rows` by
  ``draftlab.eval.uncertainty``.

Two deliberate differences from ``speed.py``:

* The AR token count is its recorded ``new_tokens``. ``speed.py`` instead re-tokenizes the
  decoded AR text and subtracts one (the BOS its Llama/Vicuna tokenizer prepends). A recount
  drifts from what was generated (an EOS or other special tokens are stripped by decoding, merges can
  differ after a decode/encode round trip) and needs the tokenizer at analysis time; counting both
  sides from the recorded numbers measures them the same way.
* The AR answers are matched to the method's questions by ``question_id``, where ``speed.py`` takes
  every AR line of the category. The two agree when both files answer the same questions; with a
  method run on a subset, matching keeps the AR mean over the same questions, and a method
  question with no AR answer is an error instead of a silently different population.

Only ``choices[0]`` is read, as in ``speed.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from draftlab.data.benchmarks import CONFU_COLUMNS, category_column
from draftlab.data.errors import DataError
from draftlab.eval.answers import load_answers
from draftlab.eval.uncertainty import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    MIN_QUESTIONS,
    group_intervals,
    mean_of_groups_intervals,
)

Answers = Sequence[Mapping[str, Any]] | str | Path


def _records(answers: Answers) -> list[Mapping[str, Any]]:
    if isinstance(answers, (str, Path)):
        return load_answers(answers)
    return list(answers)


def _choice(record: Mapping[str, Any]) -> Mapping[str, Any]:
    return record["choices"][0]


Timing = Literal["wall", "decode"]
TIMINGS = ("wall", "decode")


def question_throughput(record: Mapping[str, Any], timing: Timing = "wall") -> float:
    """Tokens per second of one answered question over its turns: ``sum(new_tokens) / sum(wall_time)``,
    or with ``timing="decode"`` over the time after each turn's prefill (``wall_time - prefill_time``)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'wall' or 'decode', got {timing!r}")
    choice = _choice(record)
    seconds = sum(choice["wall_time"])
    what = "total wall_time"
    if timing == "decode":
        if not isinstance(choice.get("prefill_time"), list):
            raise DataError(f"question {record['question_id']!r}: decode timing needs choices[0].prefill_time, "
                            "which this answer file lacks (written before it was recorded?); use timing 'wall'")
        seconds -= sum(choice["prefill_time"])
        what = "decode time (wall_time - prefill_time)"
    if seconds <= 0:
        raise DataError(f"question {record['question_id']!r}: {what} is {seconds}, cannot divide by it")
    return sum(choice["new_tokens"]) / seconds


def _by_id(records: Iterable[Mapping[str, Any]], what: str) -> dict[Any, Mapping[str, Any]]:
    out: dict[Any, Mapping[str, Any]] = {}
    for r in records:
        if r["question_id"] in out:
            raise DataError(f"{what}: question {r['question_id']!r} appears twice")
        out[r["question_id"]] = r
    return out


def _paired(method: list[Mapping[str, Any]], ar: list[Mapping[str, Any]]) -> list[tuple[Mapping, Mapping]]:
    ar_by_id = _by_id(ar, "the AR answers")
    _by_id(method, "the method answers")
    missing = [r["question_id"] for r in method if r["question_id"] not in ar_by_id]
    if missing:
        shown = ", ".join(repr(q) for q in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise DataError(f"the AR answers have no answer for {len(missing)} method question(s): {shown}")
    pairs = []
    for r in method:
        b = ar_by_id[r["question_id"]]
        if b["category"] != r["category"]:
            raise DataError(f"question {r['question_id']!r} is {r['category']!r} in the method answers "
                            f"but {b['category']!r} in the AR answers")
        pairs.append((r, b))
    return pairs


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summary(pairs: Sequence[tuple[Mapping, Mapping]], timing: Timing) -> dict[str, Any]:
    pooled = [a for m, _ in pairs for a in _choice(m)["accept_lengths"]]
    method_tps = _mean([question_throughput(m, timing) for m, _ in pairs])
    ar_tps = _mean([question_throughput(b, timing) for _, b in pairs])
    speedup = method_tps / ar_tps if method_tps is not None and ar_tps else None
    return {"tau": _mean(pooled), "speedup": speedup, "n_questions": len(pairs),
            "method_tps": method_tps, "ar_tps": ar_tps}


def _mean_of_columns(columns: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n_questions": sum(c["n_questions"] for c in columns.values())}
    for key in ("tau", "speedup", "method_tps", "ar_tps"):
        out[key] = _mean([c[key] for c in columns.values() if c[key] is not None])
    return out


def _question_row(method: Mapping[str, Any], ar: Mapping[str, Any], timing: Timing) -> dict[str, Any]:
    accept = _choice(method)["accept_lengths"]
    return {"question_id": method["question_id"], "category": method["category"], "accepted": int(sum(accept)),
            "rounds": len(accept), "tps": question_throughput(method, timing), "ar_tps": question_throughput(ar, timing)}


def question_rows(method_answers: Answers, ar_answers: Answers, timing: Timing = "wall") -> list[dict[str, Any]]:
    """One row per method question, what τ, SR and their intervals are computed from::

        {"question_id", "category", "accepted": Σ accept_lengths over its turns, "rounds": its verify rounds,
         "tps": the method's tok/s, "ar_tps": AR's tok/s on the same question}

    Throughputs are :func:`question_throughput` with ``timing``; the AR answers are matched by
    ``question_id`` (every method question needs one). Rows come in the method answers' order.
    """
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'wall' or 'decode', got {timing!r}")
    return [_question_row(m, b, timing) for m, b in _paired(_records(method_answers), _records(ar_answers))]


def _selected(method: list[Mapping[str, Any]], categories: Iterable[str] | None) -> list[Mapping[str, Any]]:
    if categories is None:
        return method
    wanted = list(categories)
    present = {r["category"] for r in method}
    unknown = [c for c in wanted if c not in present]
    if unknown:
        raise DataError(f"no method answers in categories {unknown} (present: {', '.join(sorted(present))})")
    return [r for r in method if r["category"] in set(wanted)]


def _groups(items: Sequence[Any], category_of: Callable[[Any], str], column_of: Callable[[str], str | None]
            ) -> tuple[dict[str, list], dict[str, list]]:
    """``(by_column, by_category)``; columns in ConFu's order, then others in order of appearance."""
    by_category: dict[str, list] = {}
    by_column: dict[str, list] = {}
    for item in items:
        category = category_of(item)
        by_category.setdefault(category, []).append(item)
        column = column_of(category)
        if column is not None:
            by_column.setdefault(column, []).append(item)
    order = [c for c in CONFU_COLUMNS if c in by_column] + [c for c in by_column if c not in CONFU_COLUMNS]
    return {c: by_column[c] for c in order}, by_category


def _intervals(rows: Sequence[Mapping[str, Any]], boot: Mapping[str, Any], min_questions: int) -> dict[str, Any]:
    """A group's ``tau_ci`` / ``speedup_ci``; none below ``min_questions`` questions (``uncertainty.MIN_QUESTIONS``)."""
    if len(rows) < min_questions:
        return {"tau_ci": None, "speedup_ci": None}
    return group_intervals(rows, **boot)


def speed_metrics(
    method_answers: Answers,
    ar_answers: Answers,
    *,
    column_of: Callable[[str], str | None] = category_column,
    categories: Iterable[str] | None = None,
    avg: Literal["pooled", "columns"] = "pooled",
    timing: Timing = "wall",
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
    min_questions: int = MIN_QUESTIONS,
) -> dict[str, Any]:
    """τ and SR of a method against the AR answers, per category, per ConFu column and overall, with intervals.

    Each argument is a list of answer records or the path of an answer file. Returns::

        {"columns":    {"WRIT": {"tau", "speedup", "n_questions", "method_tps", "ar_tps",
                                 "tau_ci": [lo, hi], "speedup_ci": [lo, hi]}, ...},
         "categories": {"writing": {...same keys...}, ...},
         "AVG":        {...same keys...},
         "questions":  question_rows(...) of the scored questions,
         "interval":   {"method": "percentile bootstrap over questions", "level", "resamples", "seed"},
         "avg": "pooled" | "columns", "timing": "wall" | "decode"}

    Every group is computed from its questions as ``speed.py`` does for one task (pooled τ, ratio of
    mean throughputs). ``column_of`` maps a category to its table column (``"math"`` -> ``"M/R"``); a
    category it maps to ``None`` is reported under ``categories`` and counted in ``AVG`` only. Columns
    come in ConFu's order, then any others in order of appearance.

    ``AVG`` with ``avg="pooled"`` (the default) treats all questions as one group, which is what
    ``speed.py`` reports as ``overall``; its interval resamples all questions. ``avg="columns"`` gives the
    unweighted mean of the columns' values instead (``n_questions`` is then the total); its interval
    resamples each column's questions within the column and averages the resampled column values. ConFu's
    AVG is not the mean of its columns (for ConFu at 30 nodes, T=0 in its Table 1 the eleven column τ
    average 4.60 against a reported AVG of 4.41), which fits the pooled reading.

    ``categories`` keeps only those categories' questions, so ``AVG`` becomes the pooled figure of that
    subset; naming a category the method answers lack is an error.

    ``timing`` picks what a question's throughput divides by (see the module docstring): ``"wall"``
    (Spec-Bench's) or ``"decode"`` (wall time less prefill time; needs ``prefill_time`` in both files).
    ``resamples``, ``level`` and ``seed`` set the bootstrap (``draftlab.eval.uncertainty``); a fixed seed
    makes every interval reproducible. A group of fewer than ``min_questions`` questions gets no interval
    (``None``): resampling one or a few questions says nothing about the spread.
    """
    if avg not in ("pooled", "columns"):
        raise ValueError(f"avg must be 'pooled' or 'columns', got {avg!r}")
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'wall' or 'decode', got {timing!r}")
    method = _selected(_records(method_answers), categories)
    if not method:
        raise DataError("no method answers to score")
    pairs = _paired(method, _records(ar_answers))
    rows = [_question_row(m, b, timing) for m, b in pairs]
    boot = {"resamples": resamples, "level": level, "seed": seed}

    def intervals(group_rows):
        return _intervals(group_rows, boot, min_questions)

    pair_columns, pair_categories = _groups(pairs, lambda p: p[0]["category"], column_of)
    row_columns, row_categories = _groups(rows, lambda r: r["category"], column_of)
    columns = {c: _summary(p, timing) | intervals(row_columns[c]) for c, p in pair_columns.items()}
    if avg == "pooled":
        overall = _summary(pairs, timing) | intervals(rows)
    elif min(len(r) for r in row_columns.values()) < min_questions:  # a column too small to resample within
        overall = _mean_of_columns(columns) | {"tau_ci": None, "speedup_ci": None}
    else:
        overall = _mean_of_columns(columns) | mean_of_groups_intervals(list(row_columns.values()), **boot)
    return {
        "columns": columns,
        "categories": {c: _summary(p, timing) | intervals(row_categories[c])
                       for c, p in pair_categories.items()},
        "AVG": overall,
        "questions": rows,
        "interval": {"method": "percentile bootstrap over questions", **boot, "min_questions": min_questions},
        "avg": avg,
        "timing": timing,
    }


def accept_histogram(answers: Answers) -> dict[int, int]:
    """Pooled count of each per-round accept length (bonus included) over all questions, sorted by length."""
    counts = Counter(a for r in _records(answers) for a in _choice(r)["accept_lengths"])
    return dict(sorted(counts.items()))


def accept_length_survival(
    accept_lengths: Sequence[int] | Mapping[int | str, int], *, bonus_included: bool = True
) -> list[tuple[int, float]]:
    """``[(l, P(at least l draft tokens accepted in a round)), ...]`` for ``l = 0 .. max``, ConFu's Figure 5.

    ``accept_lengths`` is either the per-round lengths or a histogram ``{length: count}`` (keys may be
    strings, as in a JSON record). With ``bonus_included`` (this repository's and Spec-Bench's
    convention) a round's length counts the target's bonus token, so the accepted draft tokens are one
    fewer; pass ``False`` for counts that are already draft tokens only. An empty input gives ``[]``.
    """
    if isinstance(accept_lengths, Mapping):
        hist = Counter({int(k): int(v) for k, v in accept_lengths.items()})
    else:
        hist = Counter(int(a) for a in accept_lengths)
    shift = 1 if bonus_included else 0
    drafts = Counter()
    for length, count in hist.items():
        if count < 0 or length - shift < 0:
            raise ValueError(f"invalid accept length {length} (count {count}) with bonus_included={bonus_included}")
        drafts[length - shift] += count
    total = sum(drafts.values())
    if total == 0:
        return []
    out = []
    at_least = total
    for n in range(max(drafts) + 1):
        out.append((n, at_least / total))
        at_least -= drafts.get(n, 0)
    return out


def mismatched_questions(method_answers: Answers, ar_answers: Answers) -> list:
    """Ids of the method's questions whose answer turns differ from the AR answers' (``choices[0].turns``).

    At temperature 0 a lossless method has none, which is what Spec-Bench's ``equal.py`` checks.
    """
    pairs = _paired(_records(method_answers), _records(ar_answers))
    return [m["question_id"] for m, b in pairs if _choice(m)["turns"] != _choice(b)["turns"]]


def mismatches(method_answers: Answers, ar_answers: Answers) -> int:
    """How many of the method's questions have answer turns that differ from the AR answers'."""
    return len(mismatched_questions(method_answers, ar_answers))
