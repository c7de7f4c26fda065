"""The report as data: document blocks (rendered by ``analysis.report_render``) and the grouping of eval
entries into comparisons."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.results import Record, format_temperature, sort_key


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


def _relative(v: float | None, ref: float | None) -> str:
    if v is None or not ref:
        return "–"
    return f"{100 * (v - ref) / ref:+.1f}%"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def _setting(r: Record) -> tuple:
    return (r.bench, r.draft_nodes, r.temperature)


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
