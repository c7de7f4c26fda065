"""``tree: auto`` against every fixed tree size of a sweep: speed-up per Spec-Bench column, and the check.

    python experiments/tree_auto/compare.py experiments/tree_auto/records [--out experiments/tree_auto/table]
    python experiments/tree_auto/compare.py runs/recipe/trees --label EAGLE-3 --group categories --out ...

Reads the run records of one method at one temperature: separate runs (``draftlab-eval -m ...
method.drafter.nodes=...`` with ``method.drafter.tree=fixed`` and ``auto``) or one run whose
``eval.baselines`` hold the other sizes (``experiment=smollm2_eagle3_trees``); ``--label`` keeps that
method's rows only. Prints one row per setting with each group's speed-up (SR: tok/s over AR's on the same
questions, in the same process) and tau, then, per group, auto's SR over the best fixed SR. Groups are
ConFu's 11 table columns or Spec-Bench's 13 categories (``--group``). The criterion: auto within 5 % of the
best fixed size in every group (ratio >= 0.95) and above the best fixed size on the average. Writes
``<out>.md`` and a bar plot ``<out>.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from analysis.markdown import markdown_table  # noqa: E402
from analysis.results import TABLE_COLUMNS, load_records  # noqa: E402


def value(r, group: str, key: str, by: str = "columns"):
    """One cell of ``r``: a ConFu column (or AVG), or a Spec-Bench category with ``by="categories"``."""
    if by == "categories" and group != "AVG":
        v = (r.eval.get("categories") or {}).get(group, {}).get(key)
        return v if isinstance(v, (int, float)) else None
    return r.value(group, key)


def groups(rows, by: str = "columns") -> list[str]:
    if by == "categories":
        names = sorted({c for r in rows.values() for c in (r.eval.get("categories") or {})})
        return [*names, "AVG"]
    return [c for c in TABLE_COLUMNS if any(value(r, c, "speedup") is not None for r in rows.values())]


def settings(records):
    """{(tree, nodes): record}, one record per setting (the last one read wins, with a warning)."""
    out = {}
    for r in records:
        key = (str(r.axis("tree") or "fixed"), int(r.nodes or 0))
        if key in out:
            print(f"warning: two records for tree={key[0]} nodes={key[1]}; keeping {r.run_dir}", file=sys.stderr)
        out[key] = r
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] != "fixed", kv[0][1])))


def compare(records, tolerance: float = 0.05, by: str = "columns") -> tuple[str, bool, dict]:
    rows = settings(records)
    columns = groups(rows, by)
    fixed = {k: r for k, r in rows.items() if k[0] == "fixed"}
    auto = {k: r for k, r in rows.items() if k[0] == "auto"}
    if not fixed or len(auto) != 1:
        raise SystemExit(f"need fixed-size records and exactly one auto record, got {sorted(rows)}")
    (auto_key, auto_rec), = auto.items()
    table = []
    for (tree, nodes), r in rows.items():
        name = f"fixed, {nodes} nodes" if tree == "fixed" else f"**auto** (cap {nodes})"
        cells = [f"{value(r, c, 'speedup', by):.2f} ({value(r, c, 'tau', by):.2f})" if value(r, c, "speedup", by) is not None else "-"
                 for c in columns]
        table.append([name, *cells])
    ratios, ok = {}, True
    cells = []
    for c in columns:
        best_key, best = max(((k, value(r, c, "speedup", by)) for k, r in fixed.items() if value(r, c, "speedup", by) is not None),
                             key=lambda kv: kv[1])
        ratio = value(auto_rec, c, "speedup", by) / best
        ratios[c] = {"auto": value(auto_rec, c, "speedup", by), "best_fixed": best, "best_nodes": best_key[1], "ratio": ratio}
        passed = ratio > 1.0 if c == "AVG" else ratio >= 1.0 - tolerance
        ok &= passed
        cells.append(f"{ratio:.3f} (best {best_key[1]}){'' if passed else ' ✗'}")
    table.append(["auto / best fixed", *cells])
    return "\n".join(markdown_table(["setting", *columns], table, "l" * (len(columns) + 1))), ok, ratios


def plot(records, path: Path, by: str = "columns") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = settings(records)
    columns = groups(rows, by)
    fig, ax = plt.subplots(figsize=(max(8, len(columns) * 0.9), 3.6))
    width = 0.8 / len(rows)
    for i, ((tree, nodes), r) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(columns))]
        ax.bar(xs, [value(r, c, "speedup", by) or 0 for c in columns], width,
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
    ap.add_argument("--label", action="append", help="keep only rows with this label (repeatable)")
    ap.add_argument("--group", choices=("columns", "categories"), default="columns")
    args = ap.parse_args()
    # draftlab-eval writes eval records, draftlab-train train records that evaluated too: both count.
    records = [r for r in load_records(*args.paths) if r.has_eval and (not args.label or r.label in args.label)]
    table, ok, _ = compare(records, args.tolerance, args.group)
    verdict = (f"auto within {args.tolerance:.0%} of the best fixed size in every {'category' if args.group == 'categories' else 'column'} and above it on AVG: "
               f"{'yes' if ok else 'no'}")
    print(table + "\n\n" + verdict)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(table + "\n\n" + verdict + "\n")
        plot(records, Path(f"{args.out}.png"), args.group)
        print(f"wrote {args.out}.md, {args.out}.png")


if __name__ == "__main__":
    main()
