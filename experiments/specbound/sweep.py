"""One line per point of a decoded SpecBound sweep: its exit rule, AVG τ, AVG SR, mean exit layer, and a plot.

    python experiments/specbound/sweep.py runs/specbound/sweep_bounds --out experiments/specbound/sweep_bounds

Each point of a Hydra multirun is its own process with its own AR run (``eval.baselines=null``). τ, SR and the
mean exit layer of the drafted tokens come from the point's answer files (``categories.per_category``: SR per
question over AR's on the same question, averaged). Writes ``<out>.md`` and ``<out>.png`` (AVG SR against
AVG τ, one marker per point, labelled with its setting).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from categories import per_category  # noqa: E402

from analysis.markdown import markdown_table  # noqa: E402
from analysis.results import RecordError, eval_answer_files, read_record  # noqa: E402
from draftlab.eval.answers import load_answers  # noqa: E402

AXES = ("alpha", "tau", "d_max", "w_max")


def point(run: Path) -> dict:
    """The settings and AVG numbers of one sweep point (a run directory holding one ``record.json``)."""
    ev, files = eval_answer_files(run)
    ar_answers = files.pop("ar")
    base = {a["question_id"]: a for a in load_answers(ar_answers)}
    (name, path), = files.items()
    avg = per_category(load_answers(path), base)["AVG"]
    ar = read_record(run / "record.json").value("AVG", "ar_tps")  # "baseline_tps" in older records, read as ar_tps
    return {**{k: ev["axes"].get(k) for k in AXES}, "tau_avg": avg["tau"], "sr": avg["sr"],
            "exit_layer": avg["exit_layer"], "ar_tps": ar, "mismatches": ev["mismatches_vs_ar"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", type=Path, help="a multirun directory (one numbered run directory per point)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = sorted((p.parent for p in args.sweep.glob("*/record.json")), key=lambda p: p.name)
    if not runs:
        raise SystemExit(f"{args.sweep}: no */record.json")
    try:
        points = [point(r) for r in runs]
    except RecordError as e:
        raise SystemExit(str(e)) from None
    points.sort(key=lambda p: tuple(p[k] for k in AXES))
    best = max(p["sr"] for p in points)
    rows = [[p["alpha"], p["tau"], p["d_max"], p["w_max"], f"{p['tau_avg']:.2f}",
             f"**{p['sr']:.2f}**" if p["sr"] == best else f"{p['sr']:.2f}",  # the best point in bold
             f"{p['exit_layer']:.1f}", f"{p['ar_tps']:.1f}", p["mismatches"]] for p in points]
    lines = markdown_table(["α", "τ", "d_max", "w_max", "AVG τ", "AVG SR", "mean exit layer", "AR tok/s", "mismatches"],
                           rows, "r" * 9)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for p in points:
        ax.scatter(p["tau_avg"], p["sr"], s=18 + 6 * p["w_max"], c=[[p["d_max"] / 30, 0.3, 1 - p["d_max"] / 30]])
        ax.annotate(f"τ{p['tau']} d{p['d_max']} w{p['w_max']}", (p["tau_avg"], p["sr"]), fontsize=7,
                    xytext=(3, 3 if p["w_max"] > 3 else -10), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("AVG τ (tokens per verify round)")
    ax.set_ylabel("AVG SR (tok/s over AR, same process)")
    ax.set_title("SpecBound decoded sweep (Spec-Bench, 1 question per category, T=0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
