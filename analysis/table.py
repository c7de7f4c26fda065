"""Regenerate ConFu's Spec-Bench tables from sweep directories, as Markdown and/or LaTeX.

Layouts (rows are built from records with an ``eval`` block; pure training records are ignored):

* ``table1`` (Tables 1-3): rows Method x Nodes x T, every column with τ and SR; best per (Nodes, T).
* ``table4`` (ablation): rows by label within each T; best per T.
* ``table6`` (training length): rows by TTT length (axis ``ttt_length``) within each (Nodes, T), τ only, one
  method; best per (Nodes, T).
* ``methods``: rows Method x Setting x T, Setting naming every axis the method declares, then each evaluation
  setting (max_new_tokens, timing, the question set, ...) that differs between records of one method, axes
  and T; best per T.

Columns are the eleven ConFu columns then AVG. A best value is bolded in its setting group and column
when at least two rows of the group have a value there (ties at the printed precision are all bold).
Missing cells print as "–" (Markdown) or "--" (LaTeX).

What a row pools (:mod:`analysis.table_keys`): each row is one configuration, keyed by every setting of its
records (label, method, the method's axes, T, the evaluation settings). Records of one configuration (other
seeds, another draft trained under the same settings, the same config evaluated twice) are averaged, as
Spec-Bench's ``--mean-report`` averages its runs, and a ``Runs`` column after the key columns says how many each
row pools (only when some row pools more than one); ``--duplicates error`` refuses them instead. Records whose
settings differ are never averaged: ``table1``, ``table4`` and ``table6`` have no column for a setting other
than the ones they print, so when two configurations would print the same key they refuse with that setting,
its values and the layout or filter (``--ttt-length``, ``--nodes``, ``--setting NAME=VALUE``) that shows it.
The paper layouts stay the paper's shape that way; ``methods`` prints every axis and never needs to refuse. A
setting a layout does not print may still differ between rows that its key tells apart (each method label
with its own TTT length in ``table1``).

A row any of whose records ran from a tree with uncommitted changes (``git.dirty``) has its label marked
``†``; a row with a record that does not say (no commit or dirty flag) is marked ``‡``, not passed as
clean. A note under the table says what each mark shown means.

Intervals (``--ci``, ``build_table(ci=True)``): each τ and SR cell is printed ``value ± h``, ``h`` being half
the width of the cell's percentile-bootstrap interval over questions, ``(hi - lo) / 2`` (SR paired with AR;
:mod:`draftlab.eval.uncertainty`). Half the width rather than the larger distance from the point because a
pooled row's printed value is not the interval's own point (below); a percentile interval need not be
centred, so ``±`` summarises its width, and the bounds themselves are in the records. A row of one record
shows its stored ``tau_ci`` / ``speedup_ci`` (computed from its questions when it stored none). A row pooling
repeats keeps the value printed without ``--ci`` (the mean of its records' values) and takes ``h`` from
:func:`~draftlab.eval.uncertainty.pooled_interval` over the records' question rows in that column (all of them
for AVG), which resamples the questions once for all runs and the runs themselves, so it adds the run-to-run
spread. Bootstrap settings (resamples, level, seed, fewest questions) are the first record's ``eval.interval``.
A row whose records lack per-question answers, or whose repeats answered different questions, prints bare
values, and a line under the table names it; so does a cell of too few questions to resample.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis.results import TABLE_COLUMNS, Record, RecordError, format_temperature, load_records, sort_key
from analysis.table_keys import (
    LAYOUTS,
    check_distinct,
    config_key,
    layout_for,
    parse_setting_filters,
    select,
    setting_text,
)
from analysis.table_model import (
    PROVENANCE_MARKS,
    PROVENANCE_NOTES,
    Row,
    Table,
    TableError,
    add_intervals,
    provenance,
)
from analysis.table_render import render_latex, render_markdown

__all__ = ["LAYOUTS", "PROVENANCE_MARKS", "PROVENANCE_NOTES", "Row", "Table", "TableError", "build_table",
           "load_records", "main", "provenance", "render_latex", "render_markdown", "setting_text"]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _with_ttt_length(rs: list[Record]) -> list[Record]:
    """table6's records: those that name a TTT length (the others are left out, with a note on stderr)."""
    kept = [r for r in rs if r.ttt_length is not None]
    if len(kept) < len(rs):
        print(f"draftlab-table: {len(rs) - len(kept)} record(s) without eval.ttt_length left out of table6",
              file=sys.stderr)
    if not kept:
        raise TableError("no eval records with eval.ttt_length for table6")
    return kept


def build_table(
    records: Sequence[Record],
    layout: str = "table1",
    *,
    labels: Sequence[str] | None = None,
    bench: str | None = None,
    target: str | None = None,
    nodes: Sequence[int] | None = None,
    temperatures: Sequence[float] | None = None,
    ttt_lengths: Sequence[int] | None = None,
    settings: Sequence[str] | None = None,
    duplicates: str = "mean",
    precision: int = 2,
    ci: bool = False,
) -> Table:
    """Rows and cells of one layout from eval records; filters as the CLI's options (``settings``:
    ``NAME=VALUE`` strings, as ``--setting``). ``ci``: each cell gets the half-width of its bootstrap
    interval (module docstring, "Intervals"); without it cells hold bare values and nothing else changes.

    ``labels`` both filters and orders the method rows (else first appearance order). Each row is one
    configuration (:func:`analysis.table_keys.config_key`); see the module docstring for what is pooled.
    """
    if layout not in LAYOUTS:
        raise TableError(f"unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})")
    if duplicates not in ("mean", "error"):
        raise TableError(f"duplicates must be 'mean' or 'error', got {duplicates!r}")
    rs = select(records, bench=bench, target=target, labels=labels, nodes=nodes, temperatures=temperatures,
                ttt_lengths=ttt_lengths, settings=parse_setting_filters(settings))
    if not rs:
        raise TableError("no eval records left to tabulate")
    if layout == "table6":
        rs = _with_ttt_length(rs)
    spec = layout_for(layout, rs, labels)
    configs: dict[tuple, list[Record]] = {}
    for r in rs:
        configs.setdefault(config_key(r), []).append(r)
    check_distinct(spec, configs)
    if duplicates == "error":
        for group_records in configs.values():
            if len(group_records) > 1:
                paths = ", ".join(str(r.path) for r in group_records)
                key = spec.keyed(group_records[0])[1]
                raise TableError(f"{len(group_records)} records for row {key} (one configuration): {paths}")

    def placement(key: tuple) -> tuple:
        group, _, within = spec.keyed(configs[key][0])
        return tuple(sort_key(g) for g in group), tuple(sort_key(w) for w in within)

    table = Table(layout, list(spec.headers), list(spec.metrics), list(TABLE_COLUMNS), precision=precision)
    row_records = [configs[key] for key in sorted(configs, key=placement)]
    for group_records in row_records:
        group, printed, _ = spec.keyed(group_records[0])
        values = {col: {m: _mean([r.value(col, m) for r in group_records]) for m in table.metrics}
                  for col in table.columns}
        cells = [format_temperature(k) if h == "T" else (None if k is None else str(k))
                 for h, k in zip(table.key_headers, printed)]
        table.rows.append(Row(group=group, keys=cells, values=values, n_runs=len(group_records),
                              provenance=provenance(group_records)))
    if ci:
        add_intervals(table, row_records)
    if any(row.n_runs > 1 for row in table.rows):  # say what is pooled, only where something is
        table.key_headers.append("Runs")
        for row in table.rows:
            row.keys.append(str(row.n_runs))
    return table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftlab-table",
        description="Regenerate ConFu-style Spec-Bench tables (tau / SR per column) from sweep directories.")
    p.add_argument("paths", nargs="+", type=Path, help="sweep or run directories, or record.json files")
    p.add_argument("--layout", choices=(*LAYOUTS, "served"), default="table1",
                   help="table1: Method x Nodes x T (Tables 1-3); table4: ablation rows by label x T; "
                        "table6: rows by training (TTT) length x Nodes x T, tau only, one method; methods: "
                        "Method x its own axes (and the evaluation settings that differ) x T, methods with "
                        "different knobs side by side; served: served vs draftlab tau per chain length "
                        "(eval.engine=vllm|sglang runs), or throughput with and without the draft per concurrency level "
                        "(served load runs, experiments/serving/concurrency.py; markdown only). Each row is one configuration: "
                        "table1/table4/table6 refuse records that differ in a setting they have no column for "
                        "(e.g. TTT length in table1) and name the layout or filter that shows it")
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
    p.add_argument("--ttt-length", type=int, action="append", dest="ttt_lengths", metavar="N",
                   help="keep only this training (TTT) length (repeatable)")
    p.add_argument("--setting", action="append", dest="settings", metavar="NAME=VALUE",
                   help="keep only records whose setting NAME (an axis such as block_size, or an evaluation "
                        "setting such as max_new_tokens, timing, per_category) is VALUE (repeatable)")
    p.add_argument("--precision", type=int, default=2, help="decimals printed (default 2)")
    p.add_argument("--ci", action="store_true",
                   help="print each tau and SR as 'value ± h', h being half the width of its 95%% bootstrap "
                        "interval over questions (SR paired with AR; the level is the records' eval.interval): "
                        "a one-run row's stored interval, a pooled row's interval over its runs and questions "
                        "(the value stays the mean of the runs); rows whose records have no per-question answers "
                        "print bare values and are named under the table")
    p.add_argument("--duplicates", choices=("mean", "error"), default="mean",
                   help="repeats of one configuration (same settings; other seeds, drafts or runs): average "
                        "them in one row whose Runs column counts them (default), or fail")
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
        if records and all(((r.eval or {}).get("served") or (r.eval or {}).get("concurrency")) and not r.columns
                           for r in records):
            raise TableError("these records hold served evaluations (eval.engine=vllm|sglang) or served load runs "
                             "(experiments/serving/concurrency.py): use --layout served")
        table = build_table(records, args.layout, labels=args.labels, bench=args.bench, target=args.target,
                            nodes=args.nodes, temperatures=args.temperatures, ttt_lengths=args.ttt_lengths,
                            settings=args.settings, duplicates=args.duplicates, precision=args.precision,
                            ci=args.ci)
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
    from analysis.served_concurrency import is_concurrency, render_concurrency_markdown
    from analysis.served_table import render_served_markdown

    # Load runs (eval.concurrency) get their own table; served evaluations keep theirs, the two one after the other.
    load = [r for r in records if is_concurrency(r)]
    rest = [r for r in records if not is_concurrency(r)]
    try:
        parts = [render_served_markdown(rest, precision)] if not load or any(r.eval.get("served") for r in rest) else []
        return "\n".join(parts + ([render_concurrency_markdown(load, precision)] if load else []))
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
