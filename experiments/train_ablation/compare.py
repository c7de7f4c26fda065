"""The training-lever table and plot from the records ``run.sh`` wrote.

    python experiments/train_ablation/compare.py runs/train_ablation [--out experiments/train_ablation/table]

One row per run directory (``record.json`` of ``draftlab-train``): the variant's settings read from the
record's config, optimiser steps, measured training seconds, and the held-out metrics of the best
validation (``val/acc_0``, ``val/acc_1``, ``val/simulated_tau``: the 7-step chain for every row), and the
same at the row's first validation for rows that validated twice. Writes ``<out>.md`` and ``<out>.png``
(simulated τ of each validation against the training seconds spent up to it).

Seconds up to a validation are estimated from the records: each plain row's measured seconds per step
(``train_seconds / steps``, start-up and validations included) times the step; a curriculum row's phases
at the rates of the plain rows with the same unroll and precision.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import load_records

HEADERS = ["row", "TTT unroll", "precision", "LM head init", "steps", "train s", "val acc_0", "val acc_1", "val sim. τ",
           "first validation: step, ≈ s, acc_0, sim. τ"]


def settings(r) -> dict:
    cfg = r.data.get("config") or {}
    module = cfg.get("method", {}).get("module", {})
    trainer = cfg.get("trainer", {})
    return {"ttt": int(module.get("ttt_length", 7)), "curriculum": module.get("ttt_curriculum"),
            "bf16": "bf16" in str(trainer.get("precision", "")),
            "head": cfg.get("method", {}).get("draft", {}).get("init", {}).get("lm_head", "random")}


def seconds(s: dict, step: int, total: int, per_step: dict) -> float | None:
    """Estimated training seconds of the first ``step`` of ``total`` steps (``per_step``: (ttt, bf16) -> s)."""
    phases = sorted((float(f), int(k)) for f, k in (s["curriculum"] or []))
    out, done = 0.0, 0
    for frac, k in phases + [(1.0, s["ttt"])]:
        end = min(step, int(round(frac * total)))
        if end > done:
            if (k, s["bf16"]) not in per_step:
                return None
            out += (end - done) * per_step[(k, s["bf16"])]
            done = end
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "table")
    args = ap.parse_args()
    records = [r for r in load_records(args.root) if r.kind == "train" and r.train]
    if not records:
        raise SystemExit(f"no training records under {args.root}")
    runs = []
    for r in sorted(records, key=lambda r: str(r.run_dir)):
        s = settings(r)
        steps = max((h["step"] for h in r.history), default=0)
        runs.append((r, s, steps))
    per_step = {(s["ttt"], s["bf16"]): r.train.get("train_seconds", 0.0) / steps
                for r, s, steps in runs if not s["curriculum"] and steps}
    rows, curves = [], {}
    for r, s, steps in runs:
        vals = [h for h in r.history if "val/simulated_tau" in h]
        best = max(vals, key=lambda h: h["val/simulated_tau"]) if vals else {}
        name = r.run_dir.name
        unroll = f"{s['ttt']}" if not s["curriculum"] else \
            " → ".join([f"{k} (to {f:.0%})" for f, k in sorted(s["curriculum"])] + [str(s["ttt"])])
        first = vals[0] if len(vals) > 1 else None
        rows.append((name, unroll, "bf16-mixed" if s["bf16"] else "fp32", s["head"], steps,
                     r.train.get("train_seconds", 0.0), best.get("val/acc_0"), best.get("val/acc_1"),
                     best.get("val/simulated_tau"), first, seconds(s, first["step"], steps, per_step) if first else None))
        curves[name] = [(seconds(s, h["step"], steps, per_step), h["val/simulated_tau"]) for h in vals]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    cells = []
    for name, unroll, prec, head, steps, secs, a0, a1, tau, first, first_s in rows:
        early = "–" if first is None else (f"{first['step']}, {first_s:.0f}, {first['val/acc_0']:.3f}, "
                                           f"{first['val/simulated_tau']:.3f}")
        cells.append([name, unroll, prec, head, steps, f"{secs:.0f}", fmt(a0), fmt(a1), fmt(tau), early])
    text = "\n".join(markdown_table(HEADERS, cells, "llllrrrrrl")) + "\n"
    print(text)
    args.out.with_suffix(".md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        pts = [p for p in pts if p[0] is not None]
        ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel("held-out simulated τ (7-step chain)")
    ax.set_title("EAGLE-3 on SmolLM2-135M: training levers by CPU time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
