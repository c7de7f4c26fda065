"""``tree: auto`` against every fixed tree size of a sweep: speed-up per Spec-Bench column, and the check.

    python experiments/tree_auto/compare.py experiments/tree_auto/records [--out experiments/tree_auto/table]

Reads the run records of one method at one temperature (``draftlab-eval -m ... method.drafter.total_tokens=...``
with ``method.drafter.tree=fixed`` and ``auto``), prints one row per setting with each column's speed-up
(SR: tok/s over AR's on the same questions, in the same process) and tau, then, per column, auto's SR over
the best fixed SR. The criterion: auto within 5 % of the best fixed size on every column (ratio >= 0.95)
and above the best fixed size on the average column. Writes ``<out>.md`` and a bar plot ``<out>.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from analysis.results import TABLE_COLUMNS, load_records  # noqa: E402


def settings(records):
    """{(tree, nodes): record}, one record per setting (the last one read wins, with a warning)."""
    out = {}
    for r in records:
        key = (str(r.axis("tree") or "fixed"), int(r.draft_nodes or 0))
        if key in out:
            print(f"warning: two records for tree={key[0]} nodes={key[1]}; keeping {r.run_dir}", file=sys.stderr)
        out[key] = r
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != "fixed", kv[0][1])))


def compare(records, tolerance: float = 0.05) -> tuple[str, bool, dict]:
    rows = settings(records)
    columns = [c for c in TABLE_COLUMNS if any(r.value(c, "speedup") is not None for r in rows.values())]
    fixed = {k: r for k, r in rows.items() if k[0] == "fixed"}
    auto = {k: r for k, r in rows.items() if k[0] == "auto"}
    if not fixed or len(auto) != 1:
        raise SystemExit(f"need fixed-size records and exactly one auto record, got {sorted(rows)}")
    (auto_key, auto_rec), = auto.items()
    head = "| setting | " + " | ".join(columns) + " |"
    lines = [head, "|" + " --- |" * (len(columns) + 1)]
    for (tree, nodes), r in rows.items():
        name = f"fixed, {nodes} nodes" if tree == "fixed" else f"**auto** (cap {nodes})"
        cells = [f"{r.value(c, 'speedup'):.2f} ({r.value(c, 'tau'):.2f})" if r.value(c, "speedup") is not None else "-"
                 for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ratios, ok = {}, True
    cells = []
    for c in columns:
        best_key, best = max(((k, r.value(c, "speedup")) for k, r in fixed.items() if r.value(c, "speedup") is not None),
                             key=lambda kv: kv[1])
        ratio = auto_rec.value(c, "speedup") / best
        ratios[c] = {"auto": auto_rec.value(c, "speedup"), "best_fixed": best, "best_nodes": best_key[1], "ratio": ratio}
        passed = ratio > 1.0 if c == "AVG" else ratio >= 1.0 - tolerance
        ok &= passed
        cells.append(f"{ratio:.3f} (best {best_key[1]}){'' if passed else ' ✗'}")
    lines.append("| auto / best fixed | " + " | ".join(cells) + " |")
    return "\n".join(lines), ok, ratios


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = settings(records)
    columns = [c for c in TABLE_COLUMNS if any(r.value(c, "speedup") is not None for r in rows.values())]
    fig, ax = plt.subplots(figsize=(max(8, len(columns) * 0.9), 3.6))
    width = 0.8 / len(rows)
    for i, ((tree, nodes), r) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(columns))]
        ax.bar(xs, [r.value(c, "speedup") or 0 for c in columns], width,
               label=f"{tree} {nodes}" if tree == "fixed" else f"auto (cap {nodes})",
               color=None if tree == "fixed" else "black")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))], columns)
    ax.set_ylabel("speed-up over AR")
    ax.legend(ncol=len(rows), fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", default=None, help="write <out>.md and <out>.png")
    ap.add_argument("--tolerance", type=float, default=0.05)
    args = ap.parse_args()
    records = [r for r in load_records(*args.paths, kind="eval") if r.has_eval]
    table, ok, _ = compare(records, args.tolerance)
    verdict = (f"auto within {args.tolerance:.0%} of the best fixed size on every column and above it on AVG: "
               f"{'yes' if ok else 'no'}")
    print(table + "\n\n" + verdict)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(table + "\n\n" + verdict + "\n")
        plot(records, Path(f"{args.out}.png"))
        print(f"wrote {args.out}.md, {args.out}.png")


if __name__ == "__main__":
    main()
