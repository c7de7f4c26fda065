"""The Draft-OPD ablation table from kept records: training steps, rollout τ per phase, Spec-Bench τ / SR.

    python experiments/draft_opd/ablations.py experiments/draft_opd/records/ablations --out experiments/draft_opd/ablations

Reads, per arm, ``<arm>.json`` (the training record; or ``<arm>_train_summary.json``, the artifact's
``train_summary.json``, where the run directory is gone), ``<arm>_metrics.csv`` (its ``opd/*`` log; absent for the
supervised start) ``eval_<arm>.json`` (its Spec-Bench record, with its own AR run) and, where measured, ``gsm8k_<arm>.json`` (GSM8K
test questions: Spec-Bench's math_reasoning rows). Writes ``<out>.md``
and ``<out>.png`` (rollout τ of each phase, per arm).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import columns_from_metrics

ARMS = {  # arm -> (label, what changed against the Draft-OPD arm)
    "sft": ("SFT (start)", "the supervised draft every arm starts from"),
    "sft_more": ("SFT continued", "supervised training instead, 5 min (first cell)"),
    "opd": ("Draft-OPD", "none: forward KL accepted + reverse KL rejected, γ 0.8, error anchors (first cell)"),
    "opd_seed1": ("Draft-OPD, seed 1", "seed: 1 (other prompts and order; same session as the ablations)"),
    "opd_forward": ("all forward KL", "divergence: forward"),
    "opd_reverse": ("all reverse KL", "divergence: reverse"),
    "opd_random": ("random anchors", "anchors: random"),
    "opd_nodecay": ("no decay", "gamma: 1.0"),
    "opd_sampled": ("sampled estimators", "estimator: sampled"),
}

HEADERS = ["arm", "change", "optimiser steps", "rollout τ, first → last phase", "Spec-Bench τ (AVG)", "SR (AVG)",
           "AR tok/s", "GSM8K test τ (10)", "outputs ≠ AR"]


def rollout_taus(path: Path) -> list[float]:
    if not path.exists():
        return []
    rows = list(csv.DictReader(path.open()))
    # Logged once per phase, but repeated on the logging steps until the next phase: keep each value once.
    out: list[float] = []
    for r in rows:
        if r.get("opd/rollout_tau") and (not out or float(r["opd/rollout_tau"]) != out[-1]):
            out.append(float(r["opd/rollout_tau"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows, curves = [], {}
    for arm, (label, change) in ARMS.items():
        ev_path = args.records / f"eval_{arm}.json"
        if not ev_path.exists():
            continue
        m = json.loads(ev_path.read_text())["metrics"]
        # AR tok/s: "ar_tps" in new records, "baseline_tps" in older ones; the reader takes either.
        ar_tps = columns_from_metrics(m, "specbench")["AVG"]["ar_tps"]
        record = args.records / f"{arm}.json"
        train = (json.loads(record.read_text())["train"] if record.exists()
                 else json.loads((args.records / f"{arm}_train_summary.json").read_text()))
        steps = (train.get("best") or {}).get("step", "-") if arm != "sft" else "-"
        gsm = args.records / f"gsm8k_{arm}.json"
        g = json.loads(gsm.read_text())["metrics"] if gsm.exists() else None
        gsm_tau = f"{g['eval/specbench/AVG/tau']:.3f}" if g else "-"
        mismatches = int(m["eval/specbench/mismatches_vs_ar"]) + int(g["eval/specbench/mismatches_vs_ar"] if g else 0)
        taus = rollout_taus(args.records / f"{arm}_metrics.csv")
        curves[label] = taus
        trend = f"{taus[0]:.2f} → {taus[-1]:.2f} ({len(taus)} phases)" if taus else "-"
        rows.append([label, change, steps, trend, f"{m['eval/specbench/AVG/tau']:.3f}",
                     f"{m['eval/specbench/AVG/speedup']:.3f}", f"{ar_tps:.1f}", gsm_tau, mismatches])
    lines = markdown_table(HEADERS, rows, "llrlrrrrr")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, taus in curves.items():
        if taus:
            ax.plot(range(1, len(taus) + 1), taus, marker="o", ms=3, label=label)
    ax.set_xlabel("phase (a rollout of 4 fresh training prompts, then 8 replay steps)")
    ax.set_ylabel("rollout τ (tokens per verify round)")
    ax.set_title("Draft-OPD ablations from the same start, 5 min each", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
