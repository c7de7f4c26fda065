"""The report as data: document blocks (rendered by ``analysis.report_render``), the grouping of eval
entries into comparisons, and the paired per-question differences behind the delta intervals."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.results import TABLE_COLUMNS, Record, RecordError, format_temperature, sort_key
from draftlab.data.benchmarks import category_column
from draftlab.data.errors import DataError
from draftlab.eval.uncertainty import MIN_QUESTIONS, align_questions, paired_difference


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str


@dataclass
class TableBlock:
    header: list[str]
    rows: list[list[str]]
    align: str | None = None  # one "l"/"r" per column; default: first left, the rest right


@dataclass
class Image:
    path: Path
    alt: str


@dataclass
class Entry:
    name: str
    record: Record
    source: str


@dataclass
class Report:
    title: str
    blocks: list[Any] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)


def _fmt(v: float | None, precision: int = 2) -> str:
    return "–" if v is None else f"{v:.{precision}f}"


def _delta(v: float | None, ref: float | None, precision: int = 2) -> str:
    if v is None or ref is None:
        return "–"
    return f"{v - ref:+.{precision}f}"


def _delta_interval(d: dict[str, Any] | None, precision: int = 2) -> str:
    """``+0.12 [+0.05, +0.19] *``: a paired difference, its interval, and ``*`` when the interval excludes 0."""
    if d is None or d["diff"] is None:
        return "–"
    text = f"{d['diff']:+.{precision}f}"
    if d["ci"] is not None:
        lo, hi = d["ci"]
        text += f" [{lo:+.{precision}f}, {hi:+.{precision}f}]"
    return text + (" *" if d["excludes_zero"] else "")


def _value_interval(record: Record, column: str, key: str, precision: int = 2) -> str:
    """A table value with the interval the evaluation stored beside it (``<key>_ci``), when there is one."""
    text = _fmt(record.value(column, key), precision)
    cell = record.columns.get(column) or {}
    ci = cell.get(f"{key}_ci")
    if (cell.get("n_questions") or 0) < MIN_QUESTIONS:
        ci = None  # written before intervals needed MIN_QUESTIONS questions: too few to mean anything
    if text != "–" and isinstance(ci, list) and len(ci) == 2 and all(isinstance(v, (int, float)) for v in ci):
        text += f" [{ci[0]:.{precision}f}, {ci[1]:.{precision}f}]"
    return text


def has_value_intervals(record: Record) -> bool:
    """Whether any of the record's table cells carries a stored interval (``tau_ci`` / ``speedup_ci``)."""
    return any(isinstance(cell, dict) and ("tau_ci" in cell or "speedup_ci" in cell)
               for cell in record.columns.values())


def _relative(v: float | None, ref: float | None) -> str:
    if v is None or not ref:
        return "–"
    return f"{100 * (v - ref) / ref:+.1f}%"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def _setting(r: Record) -> tuple:
    return (r.bench, r.nodes, r.temperature)


def _setting_title(setting: tuple) -> str:
    bench, nodes, t = setting
    return f"{bench or '?'}, nodes={'–' if nodes is None else nodes}, T={format_temperature(t) or '–'}"


def collect_entries(sources: Sequence[tuple[str, list[Record]]]) -> list[Entry]:
    """Eval entries of all sources, named by source, plus the row label when a source holds several."""
    entries: list[Entry] = []
    for source, records in sources:
        evals = [r for r in records if r.has_eval]
        for r in evals:
            name = source if len(evals) == 1 else f"{source}/{r.label}"
            entries.append(Entry(name=name, record=r, source=source))
    return entries


def _dedupe(group: list[Entry]) -> None:
    # Repeated runs of one row in a sweep share name and setting; their job directory tells them apart.
    counts: dict[str, int] = {}
    for e in group:
        counts[e.name] = counts.get(e.name, 0) + 1
    for e in group:
        if counts[e.name] > 1:
            e.name = f"{e.name} [{e.record.run_dir.name}]"


def comparison_groups(sources: Sequence[tuple[str, list[Record]]], entries: Sequence[Entry]
                      ) -> list[tuple[str, list[Entry]]]:
    """``[(title, entries)]``: one group when no source has more than one eval record, else one per setting."""
    eval_counts = [sum(r.has_eval for r in recs) for _, recs in sources]
    if all(n <= 1 for n in eval_counts):  # sources holding only train records take no part here
        return [("All runs", list(entries))] if entries else []
    groups: dict[tuple, list[Entry]] = {}
    for e in entries:
        groups.setdefault(_setting(e.record), []).append(e)
    ordered = sorted(groups, key=lambda s: tuple(sort_key(x) for x in s))
    return [(_setting_title(s), groups[s]) for s in ordered]


def _reorder(group: list[Entry], reference: str | None) -> list[Entry]:
    if reference is None:
        return group
    picked = [e for e in group if e.name == reference or e.source == reference]
    return picked[:1] + [e for e in group if e is not picked[0]] if picked else group


_ROW_KEYS = ("question_id", "category", "accepted", "rounds", "tps", "ar_tps")


def question_rows(record: Record) -> list[dict] | None:
    """The per-question rows of an eval record (``eval.questions``: what its τ and SR were computed from),
    or None for a record written before they were kept."""
    rows = record.questions
    if not rows:
        return None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _ROW_KEYS) for r in rows):
        raise RecordError(f"{record.path}: 'eval.questions' must be a list of objects with keys {', '.join(_ROW_KEYS)}")
    return rows


def _in_column(rows: list[dict], column: str) -> list[dict]:
    # AVG pools every question, as the evaluation's AVG does; a category without a column is only in AVG.
    if column == "AVG":
        return list(rows)

    def column_of(category: str) -> str | None:
        try:
            return category_column(category)
        except DataError:
            return None

    return [r for r in rows if column_of(r["category"]) == column]


def paired_deltas(entry: Entry, ref: Entry) -> tuple[dict[str, dict | None] | None, str | None]:
    """``({column: paired_difference(entry, ref) or None}, None)`` over the table columns, each pairing the
    questions both records answered; ``(None, why)`` when either record has no per-question rows
    (``why`` is ``""``) or the two answered different questions (``why`` says how)."""
    rows, ref_rows = question_rows(entry.record), question_rows(ref.record)
    if rows is None or ref_rows is None:
        return None, ""
    try:
        align_questions(rows, ref_rows, names=(entry.name, ref.name))
    except DataError as exc:
        return None, str(exc)
    out: dict[str, dict | None] = {}
    for column in TABLE_COLUMNS:
        mine, theirs = _in_column(rows, column), _in_column(ref_rows, column)
        diff = paired_difference(mine, theirs) if mine else None
        if diff is not None and len(mine) < MIN_QUESTIONS:  # too few questions for an interval: the bare difference
            diff = {**diff, **{k: {**diff[k], "ci": None, "excludes_zero": False} for k in ("tau", "speedup")}}
        out[column] = diff
    return out, None
