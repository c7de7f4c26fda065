"""Side-by-side comparison of runs or sweeps: per-column deltas, bar charts, acceptance survival, training curves.

Every positional path is one *source* (a run directory, a sweep directory or a ``record.json``). Its eval
records become *entries*. When every source holds exactly one eval record the entries are compared
directly; otherwise entries are grouped by setting (bench, draft nodes, temperature) and compared within
each setting, so two sweeps over the same grid line up cell by cell. The first entry of a group (or the
one named by ``--reference``) is the reference the deltas are taken against. Where both records carry
per-question rows (``eval.questions``) a delta shows its paired bootstrap interval over the questions both
answered and a ``*`` when that interval excludes 0 (``draftlab.eval.uncertainty``); older records get the
bare delta and a line saying why.

Output goes to ``--out DIR``: ``report.md`` with PNGs beside it, and/or ``report.html`` with the same
PNGs embedded as base64 so the file stands alone. Figures are drawn with Matplotlib's Agg canvas
directly, never through pyplot, so nothing global (backend, open figures) changes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from analysis.report_model import (
    Entry,
    Heading,
    Image,
    Para,
    Report,
    TableBlock,
    _dedupe,
    _delta,
    _delta_interval,
    _relative,
    _reorder,
    _slug,
    _value_interval,
    collect_entries,
    comparison_groups,
    has_value_intervals,
    paired_deltas,
    question_rows,
)
from analysis.report_plots import plot_bars, plot_curves, plot_survival
from analysis.report_render import publish_wandb_report, render_html, render_markdown, write_report
from analysis.results import TABLE_COLUMNS, Record, RecordError, format_temperature, load_records
from draftlab.eval.metrics import accept_length_survival
from draftlab.eval.uncertainty import DEFAULT_RESAMPLES, MIN_QUESTIONS

__all__ = ["DEFAULT_CURVES", "Entry", "Heading", "Image", "Para", "Report", "TableBlock", "build_report",
           "collect_entries", "comparison_groups", "main", "plot_bars", "plot_curves", "plot_survival",
           "publish_wandb_report", "render_html", "render_markdown", "write_report"]

METRICS = (("tau", "τ"), ("speedup", "SR"))


# The training curves a comparison usually needs; ``--curves all`` plots every logged metric.
DEFAULT_CURVES = ("train/loss", "train/acc_0", "val/loss", "val/acc_0", "val/simulated_tau")


def build_report(
    sources: Sequence[tuple[str, list[Record]]],
    out_dir: str | Path,
    *,
    title: str = "draftlab comparison",
    reference: str | None = None,
    precision: int = 2,
    train_curves: Sequence[str] | None = DEFAULT_CURVES,
    curve_x: str = "step",
) -> Report:
    """Lay out the comparison and write its PNGs into ``out_dir``; render with :func:`render_markdown` or
    :func:`render_html`. ``sources`` is ``[(name, records)]``; ``train_curves`` names the training metrics to plot
    (None: every logged one -- about 60 for a TTT-7 run), against ``curve_x`` (``step``, ``seconds`` of training
    wall-clock or training ``tokens``: runs of equal training time compare on ``seconds``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(title=title)
    entries = collect_entries(sources)
    groups = comparison_groups(sources, entries)
    for _, group in groups:
        _dedupe(group)
    _add_runs(report, entries)
    for g, (group_title, group) in enumerate(groups):
        _add_group(report, out_dir, g, group_title, _reorder(group, reference), precision)
    trained = [(name, r) for name, recs in sources for r in recs if r.history]
    if trained:
        _add_training(report, out_dir, trained, train_curves, curve_x)
    return report


def _add_image(report: Report, path: Path, alt: str) -> None:
    report.images.append(path)
    report.blocks.append(Image(path, alt))


def _add_runs(report: Report, entries: list[Entry]) -> None:
    """The table of every compared entry and where it came from."""
    blocks = report.blocks
    blocks.append(Heading(2, "Runs"))
    blocks.append(TableBlock(
        ["Entry", "Kind", "Label", "Method", "Target", "Bench", "Nodes", "T", "TTT length", "Mismatches vs AR",
         "Commit", "Record"],
        [[e.name, e.record.kind, e.record.label, e.record.method or "–", e.record.target or "–",
          e.record.bench or "–", _fmt_int(e.record.nodes), format_temperature(e.record.temperature) or "–",
          _fmt_int(e.record.ttt_length), _fmt_int(e.record.mismatches_vs_ar),
          (e.record.get("git.commit") or "–")[:10] + ("+dirty" if e.record.get("git.dirty") else ""),
          str(e.record.path)] for e in entries], align="llllllrrrrll"))
    if not entries:
        blocks.append(Para("No eval records found."))


def _add_group(report: Report, out_dir: Path, g: int, group_title: str, group: list[Entry], precision: int) -> None:
    """One comparison: values, deltas against the group's first entry, bar charts, acceptance survival."""
    blocks = report.blocks
    ref = group[0]
    blocks.append(Heading(2, group_title))
    blocks.append(Para(f"τ = mean accepted tokens per verify round (bonus included); SR = speed-up over "
                  f"autoregressive decoding. Reference: {ref.name}."))
    blocks.append(Heading(3, "Values (τ / SR)"))
    blocks.append(TableBlock(["Entry", *TABLE_COLUMNS], [
        [e.name] + [f"{_value_interval(e.record, c, 'tau', precision)} / "
                    f"{_value_interval(e.record, c, 'speedup', precision)}" for c in TABLE_COLUMNS] for e in group]))
    if any(has_value_intervals(e.record) for e in group):
        levels = {(e.record.eval.get("interval") or {}).get("level") for e in group if has_value_intervals(e.record)}
        level = f"{levels.pop():.0%} " if len(levels) == 1 and None not in levels else ""
        blocks.append(Para(f"Brackets (and error bars in the figures): the evaluation's {level}bootstrap interval "
                           f"over questions (SR paired with AR)."))
    if len(group) > 1:
        _add_deltas(blocks, group, precision)
    for metric, symbol in METRICS:
        path = plot_bars(group, metric, symbol, out_dir / f"group{g}_{metric}.png", f"{symbol} per column — {group_title}")
        _add_image(report, path, f"{symbol} per column, {group_title}")

    curves = {e.name: accept_length_survival(e.record.accept_lengths) for e in group if e.record.accept_lengths}
    if curves:
        blocks.append(Heading(3, "Acceptance survival P(accepted draft tokens ≥ l)"))
        longest = max(len(c) for c in curves.values())
        blocks.append(TableBlock(["l", *curves], [
            [str(n)] + [f"{c[n][1]:.3f}" if n < len(c) else "0.000" for c in curves.values()]
            for n in range(longest)]))
        path = plot_survival(curves, out_dir / f"group{g}_survival.png", f"Acceptance survival — {group_title}")
        _add_image(report, path, f"acceptance survival, {group_title}")


def _add_deltas(blocks: list, group: list[Entry], precision: int) -> None:
    """Deltas against the group's first entry: with the paired interval where both records carry per-question
    rows and answered the same questions, bare otherwise, with a line saying which and why."""
    ref = group[0]
    rows, paired, apart = [], [], []
    for e in group[1:]:
        deltas, why = paired_deltas(e, ref)
        rows.append(_delta_row(e, ref, precision, deltas))
        if deltas is not None:
            paired.append(e.name)
        elif why:
            apart.append(f"{e.name}: {why}")
    lacking = [e.name for e in group if question_rows(e.record) is None]
    blocks.append(Heading(3, f"Δ vs {ref.name} (Δτ / ΔSR)"))
    blocks.append(TableBlock(["Entry", *TABLE_COLUMNS, "AVG relative"], rows))
    if paired:
        blocks.append(Para(f"Brackets: 95% paired bootstrap interval of the difference, resampling the questions "
                           f"both runs answered ({DEFAULT_RESAMPLES} resamples); * marks an interval that excludes 0. "
                           f"A column of fewer than {MIN_QUESTIONS} questions shows the bare difference."))
    if lacking:
        blocks.append(Para(f"Bare deltas: intervals need records with per-question answers (eval.questions), "
                           f"which {', '.join(lacking)} {'lack' if len(lacking) > 1 else 'lacks'}."))
    for line in apart:
        blocks.append(Para(f"No interval for {line}."))


def _delta_row(e: Entry, ref: Entry, precision: int, deltas: dict[str, dict | None] | None = None) -> list[str]:
    row = [e.name]
    for c in TABLE_COLUMNS:
        if deltas is not None:
            cell = deltas[c] or {}
            row.append(f"{_delta_interval(cell.get('tau'), precision)} / "
                       f"{_delta_interval(cell.get('speedup'), precision)}")
            continue
        row.append(f"{_delta(e.record.value(c, 'tau'), ref.record.value(c, 'tau'), precision)} / "
                   f"{_delta(e.record.value(c, 'speedup'), ref.record.value(c, 'speedup'), precision)}")
    row.append(f"{_relative(e.record.value('AVG', 'tau'), ref.record.value('AVG', 'tau'))} / "
               f"{_relative(e.record.value('AVG', 'speedup'), ref.record.value('AVG', 'speedup'))}")
    return row


CURVE_X = ("step", "seconds", "tokens")


def _add_training(report: Report, out_dir: Path, trained: list[tuple[str, Record]],
                  train_curves: Sequence[str] | None, curve_x: str = "step") -> None:
    """One plot per logged training metric (all runs on it) and each run's best checkpoint."""
    report.blocks.append(Heading(2, "Training curves"))
    names = _curve_names(trained)
    keys: list[str] = []
    for _, r in trained:
        for h in r.history:
            keys += [k for k, v in h.items() if k not in CURVE_X and k not in keys and _is_plottable(v)]
    if train_curves is not None:
        keys = [k for k in train_curves if k in keys]
    for key in keys:
        series = {}
        for (_, r), name in zip(trained, names):
            # histories written before a row carried ``seconds`` have no point on that axis
            points = [(h[curve_x], h[key]) for h in r.history if _is_plottable(h.get(key)) and curve_x in h]
            if points:
                series[name] = points
        path = plot_curves(series, key, out_dir / f"train_{_slug(key)}.png", x_label=curve_x)
        _add_image(report, path, f"training curve {key}")
    _add_served_checks(report, out_dir, trained, names, curve_x)
    best_rows = [[name, ", ".join(f"{k}={_short(v)}" for k, v in (r.train.get("best") or {}).items()) or "–"]
                 for (_, r), name in zip(trained, names)]
    report.blocks.append(TableBlock(["Run", "Best"], best_rows, align="ll"))


SIMULATED_TAU = "val/simulated_tau"


def _add_served_checks(report: Report, out_dir: Path, trained: list[tuple[str, Record]], names: list[str],
                       curve_x: str) -> None:
    """Runs trained with served checks (``callbacks=served_eval``): the engine's τ and the simulated τ on one
    plot, and each check's numbers (failed checks listed, never plotted)."""
    series: dict[str, list[tuple[float, float]]] = {}
    rows = []
    for (_, r), name in zip(trained, names):
        checks = [h for h in r.history if "served/failed" in h and curve_x in h]
        if not checks:
            continue
        series[f"{name} served"] = [(h[curve_x], h["served/tau"]) for h in checks if _is_plottable(h.get("served/tau"))]
        series[f"{name} simulated"] = [(h[curve_x], h[SIMULATED_TAU]) for h in r.history
                                       if _is_plottable(h.get(SIMULATED_TAU)) and curve_x in h]
        for h in checks:
            simulated = [v for x, v in series[f"{name} simulated"] if x <= h[curve_x]]
            tau = h.get("served/tau", h.get("served/fresh_tau"))  # a fresh launch's row ends a verified run
            rows.append([name, _short(h[curve_x]), "FAILED" if h["served/failed"] else _short(tau),
                         _short(simulated[-1]) if simulated else "–",
                         " ".join(f"{h[k]:.2f}" for k in sorted(h) if k.startswith("served/acc_")) or "–",
                         _served_how(h), _short(h.get("served/reload_s", h.get("served/startup_s", "–")))])
    if not rows:
        return
    report.blocks.append(Heading(3, "Served vs simulated τ (served checks during training)"))
    path = plot_curves({k: v for k, v in series.items() if v}, "tau: served (engine) vs simulated",
                       out_dir / "train_served_vs_simulated_tau.png", x_label=curve_x)
    _add_image(report, path, "served vs simulated tau")
    report.blocks.append(TableBlock(["Run", curve_x, "served τ", "simulated τ (last)", "served acc@i", "server",
                                     "reload / start s"], rows, align="llrrllr"))


def _served_how(h: dict[str, Any]) -> str:
    """How a check got its server (the history keeps numbers only, so it is read from which ones it has)."""
    return ("fresh launch" if "served/fresh_tau" in h else "reload" if "served/reload_s" in h
            else "launch" if "served/startup_s" in h else "–")


def _curve_names(trained: list[tuple[str, Record]]) -> list[str]:
    per_source: dict[str, int] = {}
    for source, _ in trained:
        per_source[source] = per_source.get(source, 0) + 1
    return [source if per_source[source] == 1 else f"{source}/{r.run_name}" for source, r in trained]


def _is_plottable(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _fmt_int(v: int | None) -> str:
    return "–" if v is None else str(v)


def _source_names(paths: Sequence[Path], names: Sequence[str] | None) -> list[str]:
    if names:
        if len(names) != len(paths):
            raise SystemExit(f"draftlab-report: error: {len(names)} --name values for {len(paths)} paths")
        return list(names)
    out: list[str] = []
    for p in paths:
        d = (p.parent if p.is_file() else p).resolve()
        # A Hydra job directory is just a number; its sweep's name says more.
        base = f"{d.parent.name}/{d.name}" if d.name.isdigit() else d.name
        name, k = base, 2
        while name in out:
            name, k = f"{base}#{k}", k + 1
        out.append(name)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftlab-report",
        description="Compare runs or sweeps side by side: deltas per column, bar charts, acceptance survival "
                    "(ConFu Fig. 5) and training curves, as Markdown or self-contained HTML.")
    p.add_argument("paths", nargs="+", type=Path, help="run or sweep directories, or record.json files")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--format", choices=("md", "html", "both"), default="md")
    p.add_argument("--name", action="append", dest="names", help="display name per path, in order (repeatable)")
    p.add_argument("--reference", help="entry or source name the deltas are taken against (default: first)")
    p.add_argument("--title", default="draftlab comparison")
    p.add_argument("--precision", type=int, default=2)
    p.add_argument("--curve-x", choices=CURVE_X, default="step",
                   help="the training curves' x axis: optimiser step, training seconds (wall-clock) or tokens")
    p.add_argument("--curves", nargs="+", default=list(DEFAULT_CURVES),
                   help="training metrics to plot (default: %(default)s); 'all' plots every logged metric")
    p.add_argument("--wandb-project", help="also publish a W&B report to this project (needs wandb_workspaces)")
    p.add_argument("--wandb-entity")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``draftlab-report``."""
    args = _parser().parse_args(argv)
    names = _source_names(args.paths, args.names)
    try:
        sources = [(name, load_records(path, baselines=False)) for name, path in zip(names, args.paths)]
    except RecordError as exc:
        print(f"draftlab-report: error: {exc}", file=sys.stderr)
        return 2
    empty = [name for name, recs in sources if not recs]
    if empty:
        print(f"draftlab-report: error: no run records under {', '.join(empty)}", file=sys.stderr)
        return 2
    train_curves = None if args.curves == ["all"] else args.curves
    try:
        report = build_report(sources, args.out, title=args.title, reference=args.reference,
                              precision=args.precision, train_curves=train_curves, curve_x=args.curve_x)
    except RecordError as exc:  # a malformed eval.questions is only read while the deltas are laid out
        print(f"draftlab-report: error: {exc}", file=sys.stderr)
        return 2
    for path in write_report(report, args.out, args.format):
        print(f"draftlab-report: wrote {path}", file=sys.stderr)
    if args.wandb_project:
        url = publish_wandb_report(report, args.out, project=args.wandb_project, entity=args.wandb_entity)
        if url:
            print(f"draftlab-report: W&B report {url}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
