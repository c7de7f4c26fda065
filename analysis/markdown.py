"""Markdown tables from already formatted cells, as the experiment scripts write them.

Cells are written as given (``str()`` of each; no escaping of ``|``), so a script keeps full control of
number formats. Alignment is one letter per column: ``l`` (left, rule ``---``), ``r`` (right, ``---:``) or
``L`` (explicitly left, ``:---``). An empty cell is written as ``| |``, the usual Markdown spelling.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RULES = {"l": "---", "r": "---:", "L": ":---"}


def table_row(cells: Sequence[object]) -> str:
    """One ``| a | b |`` line; an empty cell keeps a single space between its bars."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def markdown_table(headers: Sequence[object], rows: Iterable[Sequence[object]], align: str, *,
                   tight_rule: bool = False) -> list[str]:
    """The lines of a Markdown table: header, rule, then one line per row.

    ``align`` holds one of ``l``/``r``/``L`` per column (see the module docstring). ``tight_rule`` writes
    the rule without spaces (``|---:|---:|``), as some committed tables have it. Every row must have one
    cell per header: a short row would shift the columns that follow it.
    """
    if len(align) != len(headers):
        raise ValueError(f"{len(headers)} headers but {len(align)} alignment letters ({align!r})")
    unknown = sorted(set(align) - set(RULES))
    if unknown:
        raise ValueError(f"alignment letters must be l, r or L, got {unknown}")
    rules = [RULES[a] for a in align]
    rule = "|" + "|".join(rules) + "|" if tight_rule else table_row(rules)
    lines = [table_row(headers), rule]
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells for {len(headers)} headers: {list(row)}")
        lines.append(table_row(row))
    return lines
