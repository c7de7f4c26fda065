"""Regenerate ConFu's Spec-Bench tables from sweep directories, as Markdown and/or LaTeX.

Layouts (rows are built from records with an ``eval`` block; pure training records are ignored):

* ``table1`` (Tables 1-3): rows Method x Nodes x T, every column with τ and SR; best per (Nodes, T).
* ``table4`` (ablation): rows by label within each T; best per T.
* ``table6`` (training length): rows by ``eval.ttt_length`` within each (Nodes, T), τ only; best per (Nodes, T).

Columns are the eleven ConFu columns then AVG. A best value is bolded in its setting group and column
when at least two rows of the group have a value there (ties at the printed precision are all bold).
Missing cells print as "–" (Markdown) or "--" (LaTeX). Rows that share a key (repeated runs) are averaged,
as Spec-Bench's ``--mean-report`` averages its three runs; ``--duplicates error`` refuses instead.

A row any of whose records ran from a tree with uncommitted changes (``git.dirty``) has its label marked
``†``; a row with a record that does not say (no commit or dirty flag) is marked ``‡``, not passed as
clean. A note under the table says what each mark shown means.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from analysis.results import (
    TABLE_COLUMNS,
    Record,
    RecordError,
    format_temperature,
    load_records,
    sort_key,
)

LAYOUTS = ("table1", "table4", "table6", "methods")
METRIC_NAMES = {"tau": ("τ", r"$\tau$"), "speedup": ("SR", "SR")}
MISSING_MD = "–"
MISSING_TEX = "--"


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
    n_runs: int = 1
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


def _select(records: Sequence[Record], *, bench=None, target=None, labels=None, nodes=None, temperatures=None
            ) -> list[Record]:
    rs = [r for r in records if r.has_eval]
    if bench is not None:
        rs = [r for r in rs if r.bench == bench]
    if target is not None:
        rs = [r for r in rs if r.target == target]
    if labels:
        rs = [r for r in rs if r.label in labels]
    if nodes:
        rs = [r for r in rs if r.draft_nodes in nodes]
    if temperatures:
        rs = [r for r in rs if r.temperature is not None and any(abs(r.temperature - t) < 1e-9 for t in temperatures)]
    setups = sorted({(r.bench, r.target) for r in rs}, key=lambda s: (sort_key(s[0]), sort_key(s[1])))
    if len(setups) > 1:
        shown = ", ".join(f"bench={b} target={t}" for b, t in setups)
        raise TableError(f"records mix {len(setups)} bench/target setups ({shown}); choose one with --bench/--target")
    return rs


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def build_table(
    records: Sequence[Record],
    layout: str = "table1",
    *,
    labels: Sequence[str] | None = None,
    bench: str | None = None,
    target: str | None = None,
    nodes: Sequence[int] | None = None,
    temperatures: Sequence[float] | None = None,
    duplicates: str = "mean",
    precision: int = 2,
) -> Table:
    """Rows and cells of one layout from eval records; filters as the CLI's options.

    ``labels`` both filters and orders the method rows (else first appearance order).
    """
    if layout not in LAYOUTS:
        raise TableError(f"unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})")
    if duplicates not in ("mean", "error"):
        raise TableError(f"duplicates must be 'mean' or 'error', got {duplicates!r}")
    rs = _select(records, bench=bench, target=target, labels=labels, nodes=nodes, temperatures=temperatures)
    if not rs:
        raise TableError("no eval records left to tabulate")

    label_order = list(labels) if labels else list(dict.fromkeys(r.label for r in rs))
    rank = {lab: i for i, lab in enumerate(label_order)}
    if layout == "table1":
        key_headers, metrics = ["Method", "Nodes", "T"], ["tau", "speedup"]

        def keyed(r: Record):
            return (r.draft_nodes, r.temperature), (r.label, r.draft_nodes, r.temperature), rank[r.label]
    elif layout == "table4":
        key_headers, metrics = ["Method", "T"], ["tau", "speedup"]
        node_values = sorted({r.draft_nodes for r in rs}, key=sort_key)
        if len(node_values) > 1:
            raise TableError(f"table4 holds one tree budget but records have draft_nodes {node_values}; "
                             "choose one with --nodes")

        def keyed(r: Record):
            return (r.temperature,), (r.label, r.temperature), rank[r.label]
    elif layout == "methods":
        # Methods with different knobs side by side (a tree budget for EAGLE-3, a block size for DFlash):
        # each row is one method at one setting of the axes its config declares.
        key_headers, metrics = ["Method", "Setting", "T"], ["tau", "speedup"]

        def keyed(r: Record):
            setting = setting_text(r)
            return (r.temperature,), (r.label, setting, r.temperature), (rank[r.label], *r.axes.values())
    else:
        key_headers, metrics = ["Length", "Nodes", "T"], ["tau"]
        skipped = [r for r in rs if r.ttt_length is None]
        rs = [r for r in rs if r.ttt_length is not None]
        if skipped:
            print(f"draftlab-table: {len(skipped)} record(s) without eval.ttt_length left out of table6",
                  file=sys.stderr)
        if not rs:
            raise TableError("no eval records with eval.ttt_length for table6")
        used = sorted({r.label for r in rs})
        if len(used) > 1:
            raise TableError(f"table6 compares training lengths of one method, records have labels {used}; "
                             "choose one with --label")

        def keyed(r: Record):
            return (r.draft_nodes, r.temperature), (r.ttt_length, r.draft_nodes, r.temperature), r.ttt_length

    merged: dict[tuple, list[Record]] = {}
    placement: dict[tuple, tuple] = {}
    for r in rs:
        group, key, within = keyed(r)
        merged.setdefault(key, []).append(r)
        within = tuple(sort_key(w) for w in within) if isinstance(within, tuple) else sort_key(within)
        placement[key] = (tuple(sort_key(g) for g in group), within)
    table = Table(layout, key_headers, metrics, list(TABLE_COLUMNS), precision=precision)
    for key in sorted(merged, key=lambda k: placement[k]):
        group_records = merged[key]
        if len(group_records) > 1 and duplicates == "error":
            paths = ", ".join(str(r.path) for r in group_records)
            raise TableError(f"{len(group_records)} records for row {key}: {paths}")
        values = {col: {m: _mean([r.value(col, m) for r in group_records]) for m in metrics}
                  for col in table.columns}
        group, _, _ = keyed(group_records[0])
        cells = [format_temperature(k) if h == "T" else (None if k is None else str(k))
                 for h, k in zip(key_headers, key)]
        table.rows.append(Row(group=group, keys=cells, values=values, n_runs=len(group_records),
                              provenance=provenance(group_records)))
    return table


def setting_text(r: Record) -> str:
    """``name=value`` for every axis of the record's method, in declaration order (``methods`` layout)."""
    return ", ".join(f"{k}={v}" for k, v in r.axes.items()) or "-"


def _md_escape(text: str) -> str:
    return text.replace("|", r"\|")


_TEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex_escape(text: str) -> str:
    out = "".join(_TEX_SPECIALS.get(ch, ch) for ch in text)
    # An ablation label "-MoE" means "without MoE"; typeset the sign as a minus, as the paper does.
    if out.startswith("-"):
        out = "$-$" + out[1:]
    return out


def _marked(row: Row, cells: list[str], fmt: int) -> list[str]:
    """The row's key cells with its provenance mark (``fmt`` 0: Markdown, 1: LaTeX) after the first one."""
    if row.provenance == "clean" or not cells:
        return cells
    return [cells[0] + PROVENANCE_MARKS[row.provenance][fmt], *cells[1:]]


def _notes(table: Table) -> list[str]:
    """The provenance states the table marks, in mark order (each gets a note under the table)."""
    used = {row.provenance for row in table.rows}
    return [p for p in PROVENANCE_MARKS if p in used]


def _cell_text(table: Table, i: int, col: str, metric: str, best: set, bold: str, missing: str) -> str:
    s = table.fmt(table.rows[i].values.get(col, {}).get(metric))
    if s is None:
        return missing
    return bold.format(s) if (i, col, metric) in best else s


def render_markdown(table: Table, *, cell: str = "split") -> str:
    """GitHub-flavoured Markdown; ``cell="split"`` gives τ and SR their own columns, ``"joint"`` one "τ / SR" cell."""
    best = table.best()
    split = cell == "split" or len(table.metrics) == 1
    header = list(table.key_headers)
    for col in table.columns:
        if split and len(table.metrics) > 1:
            header += [f"{col} {METRIC_NAMES[m][0]}" for m in table.metrics]
        elif split:
            header.append(col)
        else:
            header.append(f"{col} " + " / ".join(METRIC_NAMES[m][0] for m in table.metrics))
    align = [":---"] + ["---:"] * (len(table.key_headers) - 1) + ["---:"] * (len(header) - len(table.key_headers))
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    for i, row in enumerate(table.rows):
        cells = _marked(row, [MISSING_MD if k is None else _md_escape(k) for k in row.keys], 0)
        for col in table.columns:
            parts = [_cell_text(table, i, col, m, best, "**{}**", MISSING_MD) for m in table.metrics]
            cells += parts if split else [" / ".join(parts)]
        lines.append("| " + " | ".join(cells) + " |")
    for p in _notes(table):  # a paragraph each, so renderers keep them on their own lines
        lines += ["", f"{PROVENANCE_MARKS[p][0]} {PROVENANCE_NOTES[p]}."]
    return "\n".join(lines) + "\n"


def render_latex(table: Table, *, cell: str = "split") -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), rules between setting groups."""
    best = table.best()
    nk, nm = len(table.key_headers), len(table.metrics)
    split = cell == "split" and nm > 1
    per_col = nm if split else 1
    spec = "l" + "r" * (nk - 1) + "c" * (per_col * len(table.columns))
    keys_tex = [r"$T$" if h == "T" else h for h in table.key_headers]
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
    if split:
        top = keys_tex + [rf"\multicolumn{{{nm}}}{{c}}{{{_tex_escape(c)}}}" for c in table.columns]
        lines.append(" & ".join(top) + r" \\")
        rules = [rf"\cmidrule(lr){{{nk + 1 + j * nm}-{nk + (j + 1) * nm}}}" for j in range(len(table.columns))]
        lines.append(" ".join(rules))
        sub = [""] * nk + [METRIC_NAMES[m][1] for m in table.metrics] * len(table.columns)
        lines.append(" & ".join(sub) + r" \\")
    else:
        lines.append(" & ".join(keys_tex + [_tex_escape(c) for c in table.columns]) + r" \\")
        if nm > 1:
            sub = [""] * nk + [" / ".join(METRIC_NAMES[m][1] for m in table.metrics)] * len(table.columns)
            lines.append(" & ".join(sub) + r" \\")
    lines.append(r"\midrule")
    previous = None
    for i, row in enumerate(table.rows):
        if previous is not None and row.group != previous:
            lines.append(r"\midrule")
        previous = row.group
        cells = _marked(row, [MISSING_TEX if k is None else _tex_escape(k) for k in row.keys], 1)
        for col in table.columns:
            parts = [_cell_text(table, i, col, m, best, r"\textbf{{{}}}", MISSING_TEX) for m in table.metrics]
            cells += parts if split else [" / ".join(parts)]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    # Below the tabular, inside whatever float holds it; \par puts each note on its own line.
    lines += [rf"\par{{\footnotesize {PROVENANCE_MARKS[p][1]} {_tex_escape(PROVENANCE_NOTES[p])}.}}"
              for p in _notes(table)]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftlab-table",
        description="Regenerate ConFu-style Spec-Bench tables (tau / SR per column) from sweep directories.")
    p.add_argument("paths", nargs="+", type=Path, help="sweep or run directories, or record.json files")
    p.add_argument("--layout", choices=(*LAYOUTS, "served"), default="table1",
                   help="table1: Method x Nodes x T (Tables 1-3); table4: ablation rows by label; "
                        "table6: rows by training (TTT) length, tau only; methods: Method x its own axes x T "
                        "(methods with different knobs side by side); served: served vs draftlab tau per chain "
                        "length (eval.engine=vllm|sglang runs; markdown only)")
    p.add_argument("--format", choices=("markdown", "latex", "both"), default="markdown")
    p.add_argument("--out", type=Path, help="output file; with --format both, FILE.md and FILE.tex")
    p.add_argument("--cell", choices=("split", "joint"), default="split",
                   help="split: separate tau and SR sub-columns; joint: one 'tau / SR' cell")
    p.add_argument("--label", action="append", dest="labels", metavar="LABEL",
                   help="keep only this row label (repeatable; the order given is the row order); "
                        "write --label=-MoE for a label that starts with '-'")
    p.add_argument("--name", action="append", dest="names", metavar="LABEL",
                   help="row label of the records under each path, one per path in order (arms that evaluated "
                        "one method with different drafts: continued SFT, Draft-OPD, ...); the drafters run "
                        "beside them (eval.baselines) keep their own labels")
    p.add_argument("--bench", help="keep only this bench (needed when records mix benches)")
    p.add_argument("--target", help="keep only this target (needed when records mix targets)")
    p.add_argument("--nodes", type=int, action="append", help="keep only this draft-tree budget (repeatable)")
    p.add_argument("--temperature", type=float, action="append", dest="temperatures",
                   help="keep only this temperature (repeatable)")
    p.add_argument("--precision", type=int, default=2, help="decimals printed (default 2)")
    p.add_argument("--duplicates", choices=("mean", "error"), default="mean",
                   help="rows with the same key: average them (default) or fail")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="leave out the drafters a run evaluated beside its method (eval.baselines)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``draftlab-table``."""
    # Intermixed: each path may be followed by its --name.
    args = _parser().parse_intermixed_args(argv)
    if args.names and len(args.names) != len(args.paths):
        print(f"draftlab-table: error: {len(args.names)} --name for {len(args.paths)} paths; give one per path",
              file=sys.stderr)
        return 2
    try:
        if args.names:
            records = [r for path, name in zip(args.paths, args.names)
                       for r in load_records(path, baselines=args.baselines, label=name)]
        else:
            records = load_records(*args.paths, baselines=args.baselines)
        if args.layout == "served":
            return _write(args, [(".md", _served_markdown(records, args.precision))])
        if records and all((r.eval or {}).get("served") and not r.columns for r in records):
            raise TableError("these records hold served evaluations (eval.engine=vllm|sglang): use --layout served")
        table = build_table(records, args.layout, labels=args.labels, bench=args.bench, target=args.target,
                            nodes=args.nodes, temperatures=args.temperatures, duplicates=args.duplicates,
                            precision=args.precision)
    except (RecordError, TableError) as exc:
        print(f"draftlab-table: error: {exc}", file=sys.stderr)
        return 2
    outputs = []
    if args.format in ("markdown", "both"):
        outputs.append((".md", render_markdown(table, cell=args.cell)))
    if args.format in ("latex", "both"):
        outputs.append((".tex", render_latex(table, cell=args.cell)))
    return _write(args, outputs)


def _served_markdown(records, precision: int) -> str:
    from analysis.served_table import render_served_markdown

    try:
        return render_served_markdown(records, precision)
    except ValueError as exc:
        raise TableError(str(exc)) from exc


def _write(args, outputs: list[tuple[str, str]]) -> int:
    if args.out is None:
        sys.stdout.write("\n".join(text for _, text in outputs))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in outputs:
        path = args.out.with_suffix(suffix) if len(outputs) > 1 else args.out
        path.write_text(text, encoding="utf-8")
        print(f"draftlab-table: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
