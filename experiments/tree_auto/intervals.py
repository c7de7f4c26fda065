"""`tree: auto` against each fixed size of the same record, paired over questions (one process, one AR run).

    python experiments/tree_auto/intervals.py experiments/tree_auto/records_intervals/record.json \
        --out experiments/tree_auto/table_t0_intervals.md

Each setting's τ and SR with its 95 % bootstrap interval over questions, then auto minus each fixed size with
the paired interval (`draftlab.eval.uncertainty.paired_difference`; `*`: the interval excludes 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analysis.markdown import markdown_table
from draftlab.eval.uncertainty import paired_difference, speedup_interval, speedup_of, tau_interval, tau_of
from draftlab.utils.atomic import atomic_write_text


def _fmt(value: float, ci) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rec = json.loads(Path(args.record).read_text())["eval"]
    settings = {"auto": rec["questions"], **{k: v["questions"] for k, v in (rec.get("baselines") or {}).items()}}
    table = []
    for name, rows in settings.items():
        cells = [name, _fmt(tau_of(rows), tau_interval(rows)), _fmt(speedup_of(rows), speedup_interval(rows))]
        if name == "auto":
            cells += ["", ""]
        else:
            d = paired_difference(settings["auto"], rows)
            for part in ("tau", "speedup"):
                x = d[part]
                cells.append(f"{x['diff']:+.3f} [{x['ci'][0]:+.3f}, {x['ci'][1]:+.3f}]{'*' if x['excludes_zero'] else ''}")
        table.append(cells)
    lines = [f"{len(rec['questions'])} questions, T = {rec['temperature']}, one process, one AR run.", "",
             *markdown_table(["setting", "τ [95 %]", "SR [95 %]", "auto − setting: Δτ [95 %]", "ΔSR [95 %]"], table,
                             "lllll")]
    atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
