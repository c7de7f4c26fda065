"""Side-by-side comparison of runs or sweeps: per-column deltas, bar charts, acceptance survival, training curves.

Every positional path is one *source* (a run directory, a sweep directory or a ``record.json``). Its eval
records become *entries*. When every source holds exactly one eval record the entries are compared
directly; otherwise entries are grouped by setting (bench, draft nodes, temperature) and compared within
each setting, so two sweeps over the same grid line up cell by cell. The first entry of a group (or the
one named by ``--reference``) is the reference the deltas are taken against.

Output goes to ``--out DIR``: ``report.md`` with PNGs beside it, and/or ``report.html`` with the same
PNGs embedded as base64 so the file stands alone. Figures are drawn with Matplotlib's Agg canvas
directly, never through pyplot, so nothing global (backend, open figures) changes.
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.results import (
    TABLE_COLUMNS,
    Record,
    RecordError,
    format_temperature,
    load_records,
    sort_key,
)
from draftlab.eval.metrics import accept_length_survival

METRICS = (("tau", "τ"), ("speedup", "SR"))


# --- the document: a list of blocks rendered to Markdown or HTML -------------------------------------

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


def _md_cell(text: str) -> str:
    return str(text).replace("|", r"\|").replace("\n", " ")


def render_markdown(report: Report, out_dir: Path) -> str:
    """The report as Markdown; images are linked relative to ``out_dir``."""
    lines = [f"# {report.title}", ""]
    for b in report.blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            lines += [b.text, ""]
        elif isinstance(b, TableBlock):
            align = b.align or "l" + "r" * (len(b.header) - 1)
            lines.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            lines.append("| " + " | ".join(":---" if a == "l" else "---:" for a in align) + " |")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            lines.append("")
        elif isinstance(b, Image):
            lines += [f"![{b.alt}]({b.path.relative_to(out_dir).as_posix()})", ""]
    return "\n".join(lines)


def render_html(report: Report) -> str:
    """The report as one HTML page with every image embedded as a base64 data URI."""
    esc = html.escape
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{esc(report.title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1400px;margin:auto;padding:1em}"
             "table{border-collapse:collapse;margin:1em 0;font-size:90%}"
             "td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}img{max-width:100%}</style>",
             "</head><body>", f"<h1>{esc(report.title)}</h1>"]
    for b in report.blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            parts.append(f"<p>{esc(b.text)}</p>")
        elif isinstance(b, TableBlock):
            align = b.align or "l" + "r" * (len(b.header) - 1)
            style = ['' if a == "r" else ' style="text-align:left"' for a in align]
            parts.append("<table><thead><tr>" + "".join(f"<th{st}>{esc(h)}</th>" for h, st in zip(b.header, style))
                         + "</tr></thead><tbody>")
            parts += ["<tr>" + "".join(f"<td{st}>{esc(str(c))}</td>" for c, st in zip(row, style)) + "</tr>"
                      for row in b.rows]
            parts.append("</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.path.read_bytes()).decode("ascii")
            parts.append(f"<figure><img alt=\"{esc(b.alt)}\" src=\"data:image/png;base64,{data}\"></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# --- figures -------------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_bars(entries: Sequence[Entry], metric: str, symbol: str, path: Path, title: str) -> Path:
    """Grouped bars: one group per table column, one bar per entry; missing cells are left out."""
    fig = _figure(12, 4)
    ax = fig.subplots()
    n = max(1, len(entries))
    width = 0.8 / n
    for k, e in enumerate(entries):
        xs, ys = [], []
        for j, col in enumerate(TABLE_COLUMNS):
            v = e.record.value(col, metric)
            if v is not None:
                xs.append(j - 0.4 + width * (k + 0.5))
                ys.append(v)
        ax.bar(xs, ys, width=width, label=e.name)
    ax.set_xticks(range(len(TABLE_COLUMNS)), TABLE_COLUMNS)
    ax.set_ylabel(symbol)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_survival(curves: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    """P(at least l draft tokens accepted) against l, one step line per entry (ConFu's Figure 5)."""
    fig = _figure(6, 4)
    ax = fig.subplots()
    for name, curve in curves.items():
        # Points joined by lines, not steps: the survival is only defined at whole token counts.
        ax.plot([n for n, _ in curve], [p for _, p in curve], marker="o", label=name)
    ax.set_xlabel("l (accepted draft tokens)")
    ax.set_ylabel("P(accepted ≥ l)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_curves(series: dict[str, list[tuple[float, float]]], metric: str, path: Path) -> Path:
    fig = _figure(6, 4)
    ax = fig.subplots()
    for name, points in series.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# --- comparison ------------------------------------------------------------------------------------------

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
) -> Report:
    """Lay out the comparison and write its PNGs into ``out_dir``; render with :func:`render_markdown` or
    :func:`render_html`. ``sources`` is ``[(name, records)]``; ``train_curves`` names the training metrics to plot
    (None: every logged one -- about 60 for a TTT-7 run)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(title=title)
    blocks = report.blocks
    entries = collect_entries(sources)
    groups = comparison_groups(sources, entries)
    for _, group in groups:
        _dedupe(group)

    blocks.append(Heading(2, "Runs"))
    blocks.append(TableBlock(
        ["Entry", "Kind", "Label", "Method", "Target", "Bench", "Nodes", "T", "TTT length", "Mismatches vs AR",
         "Commit", "Record"],
        [[e.name, e.record.kind, e.record.label, e.record.method or "–", e.record.target or "–",
          e.record.bench or "–", _fmt_int(e.record.draft_nodes), format_temperature(e.record.temperature) or "–",
          _fmt_int(e.record.ttt_length), _fmt_int(e.record.mismatches_vs_ar),
          (e.record.get("git.commit") or "–")[:10] + ("+dirty" if e.record.get("git.dirty") else ""),
          str(e.record.path)] for e in entries], align="llllllrrrrll"))
    if not entries:
        blocks.append(Para("No eval records found."))

    for g, (group_title, group) in enumerate(groups):
        group = _reorder(group, reference)
        ref = group[0]
        blocks.append(Heading(2, group_title))
        blocks.append(Para(f"τ = mean accepted tokens per verify round (bonus included); SR = speed-up over "
                      f"autoregressive decoding. Reference: {ref.name}."))
        blocks.append(Heading(3, "Values (τ / SR)"))
        blocks.append(TableBlock(["Entry", *TABLE_COLUMNS], [
            [e.name] + [f"{_fmt(e.record.value(c, 'tau'), precision)} / {_fmt(e.record.value(c, 'speedup'), precision)}"
                        for c in TABLE_COLUMNS] for e in group]))
        if len(group) > 1:
            blocks.append(Heading(3, f"Δ vs {ref.name} (Δτ / ΔSR)"))
            rows = []
            for e in group[1:]:
                row = [e.name]
                for c in TABLE_COLUMNS:
                    row.append(f"{_delta(e.record.value(c, 'tau'), ref.record.value(c, 'tau'), precision)} / "
                               f"{_delta(e.record.value(c, 'speedup'), ref.record.value(c, 'speedup'), precision)}")
                row.append(f"{_relative(e.record.value('AVG', 'tau'), ref.record.value('AVG', 'tau'))} / "
                           f"{_relative(e.record.value('AVG', 'speedup'), ref.record.value('AVG', 'speedup'))}")
                rows.append(row)
            blocks.append(TableBlock(["Entry", *TABLE_COLUMNS, "AVG relative"], rows))
        for metric, symbol in METRICS:
            path = plot_bars(group, metric, symbol, out_dir / f"group{g}_{metric}.png", f"{symbol} per column — {group_title}")
            report.images.append(path)
            blocks.append(Image(path, f"{symbol} per column, {group_title}"))

        curves = {e.name: accept_length_survival(e.record.accept_lengths) for e in group if e.record.accept_lengths}
        if curves:
            blocks.append(Heading(3, "Acceptance survival P(accepted draft tokens ≥ l)"))
            longest = max(len(c) for c in curves.values())
            blocks.append(TableBlock(["l", *curves], [
                [str(n)] + [f"{c[n][1]:.3f}" if n < len(c) else "0.000" for c in curves.values()]
                for n in range(longest)]))
            path = plot_survival(curves, out_dir / f"group{g}_survival.png", f"Acceptance survival — {group_title}")
            report.images.append(path)
            blocks.append(Image(path, f"acceptance survival, {group_title}"))

    trained = [(name, r) for name, recs in sources for r in recs if r.history]
    if trained:
        blocks.append(Heading(2, "Training curves"))
        names = _curve_names(trained)
        keys: list[str] = []
        for _, r in trained:
            for h in r.history:
                keys += [k for k, v in h.items() if k not in ("step", "tokens") and k not in keys and _is_plottable(v)]
        if train_curves is not None:
            keys = [k for k in train_curves if k in keys]
        for key in keys:
            series = {}
            for (_, r), name in zip(trained, names):
                points = [(h["step"], h[key]) for h in r.history if _is_plottable(h.get(key))]
                if points:
                    series[name] = points
            path = plot_curves(series, key, out_dir / f"train_{_slug(key)}.png")
            report.images.append(path)
            blocks.append(Image(path, f"training curve {key}"))
        best_rows = [[name, ", ".join(f"{k}={_short(v)}" for k, v in (r.train.get("best") or {}).items()) or "–"]
                     for (_, r), name in zip(trained, names)]
        blocks.append(TableBlock(["Run", "Best"], best_rows, align="ll"))
    return report


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


def write_report(report: Report, out_dir: str | Path, fmt: str = "md") -> list[Path]:
    """Write ``report.md`` and/or ``report.html`` (``fmt`` ``md``, ``html`` or ``both``) into ``out_dir``."""
    out_dir = Path(out_dir)
    written = []
    if fmt in ("md", "both"):
        path = out_dir / "report.md"
        path.write_text(render_markdown(report, out_dir), encoding="utf-8")
        written.append(path)
    if fmt in ("html", "both"):
        path = out_dir / "report.html"
        path.write_text(render_html(report), encoding="utf-8")
        written.append(path)
    return written


# --- W&B (optional) ------------------------------------------------------------------------------------

def publish_wandb_report(report: Report, out_dir: Path, *, project: str, entity: str | None = None) -> str | None:
    """Publish the text and tables as a W&B report; returns its URL, or ``None`` when not possible.

    Only tried when W&B is not in offline/disabled mode and ``wandb_workspaces`` is importable; any
    failure (no login, no network) is a warning, never an error, because the local files are the report.
    Images are not uploaded: the report lists their local file names instead.
    """
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        warnings.warn(f"WANDB_MODE={mode}: W&B report not published", RuntimeWarning, stacklevel=2)
        return None
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError:
        warnings.warn("wandb_workspaces is not installed (pip install wandb-workspaces): W&B report not published",
                      RuntimeWarning, stacklevel=2)
        return None
    blocks = []
    for b in report.blocks:
        if isinstance(b, Heading):
            blocks.append((wr.H1 if b.level <= 2 else wr.H2)(b.text))
        elif isinstance(b, Para):
            blocks.append(wr.P(b.text))
        elif isinstance(b, TableBlock):
            md = render_markdown(Report(title="", blocks=[b]), out_dir).split("\n", 2)[2]
            blocks.append(wr.MarkdownBlock(text=md))
        elif isinstance(b, Image):
            blocks.append(wr.P(f"[figure: {b.path.name}]"))
    try:
        kwargs = {"project": project, "title": report.title, "description": "draftlab-report"}
        if entity:
            kwargs["entity"] = entity
        wb = wr.Report(**kwargs)
        wb.blocks = blocks
        wb.save()
        return getattr(wb, "url", None)
    except Exception as exc:  # publishing is best effort; the local report is already written
        warnings.warn(f"W&B report not published: {exc}", RuntimeWarning, stacklevel=2)
        return None


# --- command line ----------------------------------------------------------------------------------------

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
    report = build_report(sources, args.out, title=args.title, reference=args.reference, precision=args.precision,
                          train_curves=train_curves)
    for path in write_report(report, args.out, args.format):
        print(f"draftlab-report: wrote {path}", file=sys.stderr)
    if args.wandb_project:
        url = publish_wandb_report(report, args.out, project=args.wandb_project, entity=args.wandb_entity)
        if url:
            print(f"draftlab-report: W&B report {url}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
