"""Rendering a ``Report`` to Markdown, self-contained HTML, or a W&B report."""

from __future__ import annotations

import base64
import html
import os
import warnings
from pathlib import Path

from analysis.report_model import Heading, Image, Para, Report, TableBlock


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
