"""ConFu's Table 1 grid with paired intervals: each row against the continued-EAGLE-3 control, cell by cell.

    python experiments/confu/grid_intervals.py experiments/confu/records/recipe_grid_intervals \
        --control eagle3_continue --out experiments/confu/table1_grid_intervals.md

``records`` holds one directory per row (``eagle3``, ``eagle3_continue``, ``confu``), each with the sweep's
job directories; jobs are matched by (nodes, T). Per cell: each row's AVG τ and SR with its 95 % bootstrap
interval over questions, and row − control paired by question (``*``: the interval excludes 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analysis.markdown import markdown_table
from draftlab.eval.uncertainty import paired_difference, speedup_interval, speedup_of, tau_interval, tau_of
from draftlab.utils.atomic import atomic_write_text


def _cells(row_dir: Path) -> dict[tuple[int, float], dict]:
    out = {}
    for rec in sorted(row_dir.glob("*/record.json")):
        ev = json.loads(rec.read_text())["eval"]
        out[(int(ev["axes"]["nodes"]), float(ev["temperature"]))] = ev
    return out


def _ci(value: float, ci) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def _delta(d: dict) -> str:
    return f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]{'*' if d['excludes_zero'] else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records")
    ap.add_argument("--control", default="eagle3_continue")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    root = Path(args.records)
    rows = {p.name: _cells(p) for p in sorted(root.iterdir()) if p.is_dir()}
    control = rows.pop(args.control)
    table = []
    for cell in sorted(control):
        ref = control[cell]["questions"]
        table.append([str(cell[0]), str(cell[1]), f"{control[cell]['label']} (control)", _ci(tau_of(ref), tau_interval(ref)),
                      _ci(speedup_of(ref), speedup_interval(ref)), "", ""])
        for cells in rows.values():
            q = cells[cell]["questions"]
            d = paired_difference(q, ref)
            table.append(["", "", cells[cell]["label"], _ci(tau_of(q), tau_interval(q)),
                          _ci(speedup_of(q), speedup_interval(q)), _delta(d["tau"]), _delta(d["speedup"])])
    n = len(control[next(iter(control))]["questions"])
    lines = [f"{n} Spec-Bench questions per cell; 95 % percentile bootstrap over questions; Δ: row − control, "
             "paired by question (`*`: the interval excludes 0).", "",
             *markdown_table(["nodes", "T", "row", "AVG τ [95 %]", "AVG SR [95 %]", "Δτ vs control", "ΔSR vs control"],
                             table, "rrlllll")]
    atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
