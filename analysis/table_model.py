"""The table draftlab-table builds: rows of pooled cells, the setting groups that bold is judged in, and the
provenance marks of rows whose code is not exactly a commit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from analysis.results import Record

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


@dataclass
class Table:
    layout: str
    key_headers: list[str]
    metrics: list[str]
    columns: list[str]
    rows: list[Row] = field(default_factory=list)
    precision: int = 2

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
