"""Held-out acceptance against training tokens, from ``draftlab-train`` records.

    python experiments/smollm2_eagle3/curve.py RUN [RUN ...] --name NAME [--name NAME ...] \
        --out experiments/smollm2_eagle3/curve

Each record's validation rows give ``val/acc_0`` and ``val/simulated_tau`` (the held-out chain of that
run). Rows written by the current training stage carry ``tokens``, the training tokens seen (exact).
Older records are estimated as ``step x (training-split tokens / batches per epoch)``, with the split
rebuilt from the record's own config: the data stage reruns from its cache (seconds), and the split
depends only on the sample ids, so it is the split the run trained on. Writes ``<out>.md`` (the points)
and ``<out>.png`` (both metrics against tokens, one line per run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import training_record


def tokens_per_batch(config: dict) -> float:
    """Mean training tokens per batch of the run with ``config`` (its own data, split and batch size)."""
    from omegaconf import OmegaConf

    from draftlab.data.datamodule import ConversationDataModule
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.data import run_data_stage

    cfg = OmegaConf.create(config)
    data = run_data_stage(cfg, MethodSpec(cfg.method))
    m = cfg.method.data
    dm = ConversationDataModule(data.samples, batch_size=int(m.batch_size), val_fraction=float(m.val_fraction))
    dm.setup("fit")
    return sum(len(s.input_ids) for s in dm.train_samples) / len(dm.train_dataloader())


def points(record) -> tuple[list[tuple[float, float, float]], bool]:
    """(tokens, acc_0, simulated tau) per validation, and whether the tokens are exact."""
    rows = [h for h in record.history if "val/simulated_tau" in h]
    exact = all("tokens" in h for h in rows)
    per_batch = None if exact else tokens_per_batch(record.data["config"])
    out = [(float(h["tokens"]) if exact else h["step"] * per_batch, h["val/acc_0"], h["val/simulated_tau"])
           for h in rows]
    return out, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories or record.json files of draftlab-train")
    ap.add_argument("--name", action="append", required=True, help="one line label per run, in order")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if len(args.name) != len(args.runs):
        ap.error(f"{len(args.runs)} runs but {len(args.name)} --name labels")
    series, rows = {}, []
    for name, run in zip(args.name, args.runs):
        pts, exact = points(training_record(run))
        series[name] = pts
        rows += [[name, f"{t:,.0f}{'' if exact else ' (est.)'}", f"{acc:.3f}", f"{tau:.3f}"] for t, acc, tau in pts]
    lines = markdown_table(["run", "tokens seen", "val/acc_0", "simulated τ"], rows, "lrrr")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, pts in series.items():
        xs = [t / 1e6 for t, _, _ in pts]
        axes[0].plot(xs, [a for _, a, _ in pts], marker="o", label=name)
        axes[1].plot(xs, [s for _, _, s in pts], marker="o", label=name)
    for ax, title in zip(axes, ("held-out acc_0", "held-out simulated τ (7-step chain)")):
        ax.set_xlabel("training tokens seen (millions)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
