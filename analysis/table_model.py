"""The table draftlab-table builds: rows of pooled cells, the setting groups that bold is judged in, the
provenance marks of rows whose code is not exactly a commit, and the half-widths of the cells' bootstrap
intervals (``--ci``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from analysis.results import Record
from draftlab.data.benchmarks import category_column
from draftlab.data.errors import DataError
from draftlab.eval.uncertainty import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    MIN_QUESTIONS,
    align_questions,
    pooled_interval,
)

# Row-label marks for rows whose code is not exactly a commit, and the note printed under a table using one.
PROVENANCE_MARKS = {"dirty": ("†", r"$^\dagger$"), "unknown": ("‡", r"$^\ddagger$")}
PROVENANCE_NOTES = {"dirty": "run from a working tree with uncommitted changes (the record's git.dirty), "
                             "so not exactly the code of its commit",
                    "unknown": "the record does not say which commit it ran or whether the tree was clean"}


def provenance(records: Sequence[Record]) -> str:
    """``dirty`` if any record ran from a dirty tree, else ``unknown`` if any does not say, else ``clean``."""
    states = {r.dirty for r in records}
    if True in states:
        return "dirty"
    return "unknown" if None in states else "clean"


class TableError(ValueError):
    """The records cannot form the requested table (mixed benches, colliding rows, ...)."""


@dataclass
class Row:
    group: tuple
    keys: list[str | None]
    values: dict[str, dict[str, float | None]]
    n_runs: int = 1  # records pooled: repeats of one configuration (shown as the Runs column when any is > 1)
    provenance: str = "clean"  # "clean", "dirty" or "unknown": see PROVENANCE_MARKS
    # With intervals asked for (build_table(ci=True)): {column: {metric: half-width or None}}, or None when the
    # row's records cannot give one (the table's ci_notes say why).
    spread: dict[str, dict[str, float | None]] | None = None


@dataclass
class Table:
    layout: str
    key_headers: list[str]
    metrics: list[str]
    columns: list[str]
    rows: list[Row] = field(default_factory=list)
    precision: int = 2
    # None without intervals; else the lines under the table saying what ± means and which rows have none.
    ci_notes: list[str] | None = None

    def half_width(self, i: int, col: str, metric: str) -> float | None:
        """The ± of row ``i``'s cell, or None (no intervals asked for, or none for this cell)."""
        return (self.rows[i].spread or {}).get(col, {}).get(metric)

    def fmt(self, v: float | None) -> str | None:
        return None if v is None else f"{v:.{self.precision}f}"

    def best(self) -> set[tuple[int, str, str]]:
        """``(row index, column, metric)`` of every cell that is best in its group."""
        out = set()
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            groups.setdefault(row.group, []).append(i)
        for members in groups.values():
            for col in self.columns:
                for m in self.metrics:
                    shown = {i: self.fmt(self.rows[i].values.get(col, {}).get(m)) for i in members}
                    shown = {i: float(s) for i, s in shown.items() if s is not None}
                    if len(shown) < 2:
                        continue
                    top = max(shown.values())
                    out.update((i, col, m) for i, v in shown.items() if v == top)
        return out


# --ci: the half-width of each cell's bootstrap interval (analysis.table's docstring, "Intervals").
CI_KEYS = {"tau": "tau_ci", "speedup": "speedup_ci"}


def _half_width(ci: Sequence[float] | None) -> float | None:
    return None if ci is None else (ci[1] - ci[0]) / 2


def _column_of(category: str) -> str | None:
    try:
        return category_column(category)
    except DataError:  # a category without a table column counts in AVG only, as in the evaluation
        return None


def column_questions(rows: Sequence[dict], column: str) -> list[dict]:
    """The question rows behind one table column: those whose category maps to it, every one for AVG."""
    return list(rows) if column == "AVG" else [r for r in rows if _column_of(r["category"]) == column]


def bootstrap_settings(record: Record) -> dict[str, Any]:
    """``{"resamples", "level", "seed", "min_questions"}`` the record's intervals used (defaults where unsaid)."""
    stored = record.eval.get("interval") or {}
    defaults = {"resamples": DEFAULT_RESAMPLES, "level": DEFAULT_LEVEL, "seed": DEFAULT_SEED,
                "min_questions": MIN_QUESTIONS}
    return {k: stored.get(k) if stored.get(k) is not None else v for k, v in defaults.items()}


def _stored_spread(r: Record, columns: Sequence[str], metrics: Sequence[str]) -> dict | None:
    cells = r.columns
    if not any(CI_KEYS[m] in cells.get(c, {}) for c in columns for m in metrics):
        return None
    # Records written before intervals needed a minimum of questions stored them for one-question cells too
    # (zero width): the rule that holds now (the record's own, else MIN_QUESTIONS) decides what is shown.
    floor = bootstrap_settings(r)["min_questions"]

    def shown(c: str, m: str) -> float | None:
        cell = cells.get(c, {})
        return _half_width(cell.get(CI_KEYS[m])) if (cell.get("n_questions") or 0) >= floor else None

    return {c: {m: shown(c, m) for m in metrics} for c in columns}


def _pooled_spread(runs: list[list[dict]], columns: Sequence[str], metrics: Sequence[str], boot: dict) -> dict:
    out = {}
    for c in columns:
        per_run = [column_questions(rows, c) for rows in runs]
        if len(per_run[0]) < max(boot["min_questions"], 1):  # too few to resample: the bare value
            out[c] = {m: None for m in metrics}
            continue
        interval = pooled_interval(per_run, resamples=boot["resamples"], level=boot["level"], seed=boot["seed"])
        out[c] = {m: _half_width(interval[CI_KEYS[m]]) for m in metrics}
    return out


def row_spread(records: Sequence[Record], columns: Sequence[str], metrics: Sequence[str]
               ) -> tuple[dict | None, str]:
    """``({column: {metric: half-width or None}}, "")`` for one row's records, or ``(None, why not)``.

    One record: its stored intervals, else recomputed from its questions (the same draws). Repeats: the
    interval pooled over their question rows (:func:`~draftlab.eval.uncertainty.pooled_interval`).
    """
    if len(records) == 1:
        stored = _stored_spread(records[0], columns, metrics)
        if stored is not None:
            return stored, ""
    runs = [r.questions for r in records]
    lacking = sum(rows is None for rows in runs)
    if lacking:
        return None, ("record has no per-question answers" if len(records) == 1 else
                      f"{lacking} of its {len(records)} records have no per-question answers")
    try:  # pooled_interval needs every repeat to have answered the same questions
        for rows in runs[1:]:
            align_questions(runs[0], rows)
    except DataError:
        return None, f"its {len(records)} records answered different questions"
    return _pooled_spread(runs, columns, metrics, bootstrap_settings(records[0])), ""


def _row_name(table: Table, row: Row) -> str:
    """``EAGLE-3, Nodes 30, T 0.0``: the row's key cells (label and setting bare), as notes under a table name it."""
    parts = [k if h in ("Method", "Setting") else f"{h} {k}" for h, k in zip(table.key_headers, row.keys)
             if k is not None]
    return ", ".join(parts)


def add_intervals(table: Table, row_records: Sequence[Sequence[Record]]) -> None:
    """Fill each row's ``spread`` (its records in ``row_records``, same order) and the table's ``ci_notes``."""
    levels: set[float] = set()
    few: set[int] = set()
    lacking: list[tuple[str, str]] = []  # (row name, why it has no interval)
    pooled = False
    for row, records in zip(table.rows, row_records):
        row.spread, why = row_spread(records, table.columns, table.metrics)
        if row.spread is None:
            lacking.append((_row_name(table, row), why))
            continue
        boot = bootstrap_settings(records[0])
        levels.add(boot["level"])
        pooled = pooled or len(records) > 1
        if any(row.values[c][m] is not None and row.spread[c][m] is None for c in table.columns
               for m in table.metrics):
            few.add(boot["min_questions"])
    notes = []
    if levels:
        level = "/".join(f"{100 * v:g}%" for v in sorted(levels))
        notes.append(f"± : half-width of the {level} bootstrap interval over questions"
                     + ("; SR paired with AR" if "speedup" in table.metrics else "")
                     + ("; pooled rows add run-to-run spread" if pooled else "") + ".")
    if few:
        notes.append(f"no interval: cells of fewer than {min(few)} questions (too few to resample).")
    if len(lacking) > 1 and len(lacking) == len(table.rows) and len({why for _, why in lacking}) == 1:
        # one line, not one per row, for a table of older records
        lacking = [("every row", lacking[0][1].replace("record has", "records have"))]
    table.ci_notes = notes + [f"no interval: {name} ({why})" for name, why in lacking]
