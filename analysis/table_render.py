"""Markdown and LaTeX (booktabs) text of a :class:`analysis.table_model.Table`."""

from __future__ import annotations

from analysis.table_model import PROVENANCE_MARKS, PROVENANCE_NOTES, Row, Table

METRIC_NAMES = {"tau": ("τ", r"$\tau$"), "speedup": ("SR", "SR")}
MISSING_MD = "–"
MISSING_TEX = "--"
PLUS_MINUS_TEX = r"$\pm$"


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


def _cell_text(table: Table, i: int, col: str, metric: str, best: set, bold: str, missing: str, pm: str) -> str:
    s = table.fmt(table.rows[i].values.get(col, {}).get(metric))
    if s is None:
        return missing
    s = bold.format(s) if (i, col, metric) in best else s
    half = table.half_width(i, col, metric)  # bold stays on the value, the ± follows it
    return s if half is None else f"{s} {pm} {table.fmt(half)}"


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
            parts = [_cell_text(table, i, col, m, best, "**{}**", MISSING_MD, "±") for m in table.metrics]
            cells += parts if split else [" / ".join(parts)]
        lines.append("| " + " | ".join(cells) + " |")
    for p in _notes(table):  # a paragraph each, so renderers keep them on their own lines
        lines += ["", f"{PROVENANCE_MARKS[p][0]} {PROVENANCE_NOTES[p]}."]
    for note in table.ci_notes or ():
        lines += ["", note]
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
            parts = [_cell_text(table, i, col, m, best, r"\textbf{{{}}}", MISSING_TEX, PLUS_MINUS_TEX) for m in table.metrics]
            cells += parts if split else [" / ".join(parts)]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    # Below the tabular, inside whatever float holds it; \par puts each note on its own line.
    lines += [rf"\par{{\footnotesize {PROVENANCE_MARKS[p][1]} {_tex_escape(PROVENANCE_NOTES[p])}.}}"
              for p in _notes(table)]
    lines += [rf"\par{{\footnotesize {_tex_escape(note).replace('±', PLUS_MINUS_TEX)}}}" for note in table.ci_notes or ()]
    return "\n".join(lines) + "\n"
