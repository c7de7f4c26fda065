"""Tables and the efficiency-inversion plot of one ``experiment=sparsespec_l_long`` evaluation run.

    python experiments/sparsespec_l/report.py runs/sparsespec_l/eval --out experiments/sparsespec_l/table

Reads the run's record and answer files. SR is decode-only throughput (tokens / (wall - prefill), as the
run's ``eval.timing=decode``) over AR's on the same prompts, as a ratio of mean per-prompt throughputs
(Spec-Bench's ``speed.py``); τ the mean tokens per verify round; k, draft acceptance and the KV fraction a
draft step reads come from the drafter's ``sequence_stats`` in the answers. Writes ``<out>.md`` and the
plot ``<out>_inversion.png`` (SR and τ against fixed k, the controller at its mean k).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import RecordError, eval_answer_files
from draftlab.eval.answers import load_answers
from draftlab.eval.metrics import question_throughput, speed_metrics
from draftlab.utils.atomic import atomic_write_text


def _stats(answers: list[dict]) -> dict[str, float]:
    """Round-weighted means of the drafter's per-turn numbers (empty for drafters that report none)."""
    sums, weight = defaultdict(float), 0.0
    for a in answers:
        for d, rounds in zip(a["choices"][0].get("drafter_stats") or [], a["choices"][0]["decoding_steps"]):
            if d:
                weight += rounds
                for k, v in d.items():
                    sums[k] += v * rounds
    return {k: v / weight for k, v in sums.items()} if weight else {}


def summarise(answers: list[dict], base_answers: list[dict], found: dict | None) -> dict:
    """SR, τ and tok/s overall and SR per category (sorted by name), as ``speed_metrics`` with decode timing
    computes them; the long-context categories have no table column, so none is asked for."""
    m = speed_metrics(answers, base_answers, column_of=lambda category: None, timing="decode")
    return {"sr": m["AVG"]["speedup"], "tau": m["AVG"]["tau"], "tps": m["AVG"]["method_tps"],
            "categories": {c: g["speedup"] for c, g in sorted(m["categories"].items())}, "stats": _stats(answers),
            "found": None if found is None else f"{found['found']}/{found['n']}"}


def tables(ev: dict, rows: dict, labels: dict, n_prompts: int, ar_tps: float) -> list[str]:
    """The ``<out>.md`` lines: a summary line, the settings table and the per-category SR table."""
    scores = ev.get("scores") or {}
    cats = list(next(iter(rows.values()))["categories"])
    lines = [f"SmolLM2-135M-Instruct, {n_prompts} long-context prompts ({', '.join(cats)}), "
             f"{ev['max_new_tokens']} new tokens, T = {ev['temperature']}, decode-only timing; AR "
             f"{ar_tps:.2f} tok/s. mismatches vs AR: "
             + ", ".join(f"{n} {ev['mismatches_vs_ar'] if n == ev['method'] else ev['baselines'][n]['mismatches_vs_ar']}"
                         for n in rows) + ".", ""]
    table = []
    for name, r in rows.items():
        s = r["stats"]

        def f(key, fmt, s=s):
            return format(s[key], fmt) if key in s else "—"

        table.append([labels.get(name, name), f"{r['sr']:.2f}", f"{r['tau']:.2f}", f"{r['tps']:.2f}",
                      f("k_mean", ".2f"), f("draft_accept_rate", ".3f"), f("kv_read_fraction", ".3f"),
                      f("draft_step_ms", ".1f"), f("verify_ms", ".1f"), r["found"] or "—"])
    if "ar" in scores:
        table.append(["AR", "1.00", "1.00", f"{ar_tps:.2f}", "—", "—", "1", "—", "—",
                      f"{scores['ar']['found']}/{scores['ar']['n']}"])
    lines += markdown_table(["setting", "SR", "τ", "tok/s", "mean k", "draft accept", "KV read / draft step",
                             "draft step ms", "verify ms", "NIAH found"], table, "l" + "r" * 9)
    lines += ["", "SR per prompt category:", ""]
    lines += markdown_table(["setting", *cats], [[labels.get(name, name), *(f"{r['categories'][c]:.2f}" for c in cats)]
                                                 for name, r in rows.items()], "l" + "r" * len(cats))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the evaluation run directory (or its record.json)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    try:
        ev, files = eval_answer_files(a.run)
    except RecordError as e:
        raise SystemExit(str(e)) from None
    labels = {ev["method"]: ev["label"]} | {n: b["label"] for n, b in (ev.get("baselines") or {}).items()}
    base_answers = load_answers(files.pop("ar"))
    scores = ev.get("scores") or {}
    rows = {name: summarise(load_answers(path), base_answers, scores.get(name)) for name, path in files.items()}
    # AR's own tok/s over all its prompts (not only those a setting answered), as the summary line states it.
    ar_tps = sum(question_throughput(x, "decode") for x in base_answers) / len(base_answers)
    lines = tables(ev, rows, labels, len({x["question_id"] for x in base_answers}), ar_tps)
    atomic_write_text(a.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))

    fixed = sorted(((rows[n]["stats"]["k_mean"], rows[n]) for n in rows
                    if n.startswith("k") and n[1:].isdigit() and rows[n]["stats"]), key=lambda t: t[0])
    if not fixed:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [k for k, _ in fixed]
    ax.plot(ks, [r["sr"] for _, r in fixed], "o-", label="SR, fixed k")
    ctl = rows[ev["method"]]
    ax.plot([ctl["stats"]["k_mean"]], [ctl["sr"]], "r*", ms=14, label="SR, entropy controller (mean k)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tokens per round (k)")
    ax.set_ylabel("speed-up over AR (decode-only)")
    ax2 = ax.twinx()
    ax2.plot(ks, [r["tau"] for _, r in fixed], "s--", color="tab:green", alpha=0.6, label="τ, fixed k")
    ax2.set_ylabel("τ (tokens per round)")
    ax.set_title("SparseSpec-L on SmolLM2-135M, long context (10 % KV view)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out.parent / f"{a.out.name}_inversion.png", dpi=120)


if __name__ == "__main__":
    main()
