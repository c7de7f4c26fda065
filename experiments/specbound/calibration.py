"""SpecBound's per-layer calibration report, from the held-out validation of a ``draftlab-train`` run.

    python experiments/specbound/calibration.py RUN --out experiments/specbound/calibration

For each exit head (layer l of L) the last validation of the run gives, over every held-out loss position:
top-1 agreement with the final layer, KL(p_final || p_l), and for the exit rule ``confidence >= tau`` the
exit rate and the precision of exited tokens (agreement among them), once on the head's raw softmax and
once with ACT (logits / T_l, T_l = 1 + alpha (1 - l/L)). The drafting policy's own numbers (first exit up
to d_max, at most w_max per round) follow the table. Writes ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import training_record

COLUMNS = ("agree", "kl", "raw_exit_rate", "raw_exit_precision", "exit_rate", "exit_precision")
HEADERS = ("exit layer", "agree (top-1)", "KL", "exit rate raw", "precision raw", "exit rate ACT", "precision ACT")


def calibration(row: dict) -> dict[int, dict[str, float]]:
    """``{layer: {column: value}}`` from one validation row (keys ``val/<column>_l<layer>``)."""
    layers = sorted({int(m.group(1)) for k in row if (m := re.fullmatch(r"val/agree_l(\d+)", k))})
    if not layers:
        raise SystemExit("the record's validation rows hold no val/agree_l<layer>: not a SpecBound run")
    return {layer: {c: float(row[f"val/{c}_l{layer}"]) for c in COLUMNS} for layer in layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run directory or record.json of draftlab-train")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rec = training_record(args.run)
    rows = [h for h in rec.history if any(k.startswith("val/agree_l") for k in h)]
    if not rows:
        raise SystemExit(f"{args.run}: no validation rows in the training history")
    # The validation of the checkpoint the run saved as its draft (the best held-out simulated tau).
    best_step = (rec.data.get("train") or {}).get("best", {}).get("step")
    row = next((h for h in rows if h["step"] == best_step), rows[-1])
    table = calibration(row)
    module = rec.data["config"]["method"]["module"]
    tau, alpha = module["tau"], module["alpha"]
    lines = [f"Held-out calibration of the saved draft (step {row['step']}; tau {tau}, alpha {alpha}; "
             f"{len(rows)} validation(s) in the run, steps {', '.join(str(h['step']) for h in rows)}).", "",
             *markdown_table(HEADERS, [[layer, *(f"{m[c]:.3f}" for c in COLUMNS)] for layer, m in table.items()],
                             "r" * len(HEADERS))]
    d_max = module.get("d_max")
    lines += ["", f"Policy (first ACT exit up to d_max={d_max if d_max is not None else 'deepest head'}, "
              f"w_max={module['w_max']}): exit rate {row['val/policy_exit_rate']:.3f}, mean exit layer "
              f"{row['val/mean_exit_layer']:.2f}, simulated tokens per round {row['val/simulated_tau']:.3f}."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, style in (("raw", "raw softmax", "--"), ("", "ACT", "-")):
        prefix = f"{key}_" if key else ""
        axes[0].plot(layers, [table[i][f"{prefix}exit_rate"] for i in layers], style, marker="o", label=label)
        axes[1].plot(layers, [table[i][f"{prefix}exit_precision"] for i in layers], style, marker="o", label=label)
    axes[1].plot(layers, [table[i]["agree"] for i in layers], ":", marker="s", color="gray", label="agreement, all tokens")
    for ax, title in zip(axes, (f"exit rate (confidence >= {tau})", "precision of exited tokens")):
        ax.set_xlabel("exit layer (layers run before the head)")
        ax.set_title(title)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
