"""The report's figures, drawn on Matplotlib's Agg canvas directly (never through pyplot, so nothing global
such as the backend or the open-figure list changes)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from analysis.report_model import Entry
from analysis.results import TABLE_COLUMNS


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_bars(entries: Sequence[Entry], metric: str, symbol: str, path: Path, title: str) -> Path:
    """Grouped bars: one group per table column, one bar per entry; missing cells are left out. An entry whose
    every plotted cell carries its interval (``<metric>_ci``, records with per-question answers) gets error bars."""
    fig = _figure(12, 4)
    ax = fig.subplots()
    n = max(1, len(entries))
    width = 0.8 / n
    for k, e in enumerate(entries):
        xs, ys, errs = [], [], []
        for j, col in enumerate(TABLE_COLUMNS):
            v = e.record.value(col, metric)
            if v is not None:
                xs.append(j - 0.4 + width * (k + 0.5))
                ys.append(v)
                ci = (e.record.columns.get(col) or {}).get(f"{metric}_ci")
                # A percentile interval need not hold its point value (a skewed resampling): clip at the bar.
                errs.append((max(0.0, v - ci[0]), max(0.0, ci[1] - v)) if isinstance(ci, list) and len(ci) == 2
                            else None)
        yerr = None if not errs or None in errs else [[lo for lo, _ in errs], [hi for _, hi in errs]]
        ax.bar(xs, ys, width=width, label=e.name, yerr=yerr, capsize=2 if yerr else 0)
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


def plot_curves(series: dict[str, list[tuple[float, float]]], metric: str, path: Path, x_label: str = "step") -> Path:
    fig = _figure(6, 4)
    ax = fig.subplots()
    for name, points in series.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None, label=name)
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric)
    ax.set_title(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
