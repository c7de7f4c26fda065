"""Per-category τ, SR and mean exit layer of every SpecBound setting of one evaluation run.

    python experiments/specbound/categories.py runs/specbound/eval --out experiments/specbound/table_categories

Reads the run's record and its answer files (the drafter's per-turn ``drafter_stats``: drafted tokens and
their mean exit layer). SR is each question's tokens/s over AR's on the same question, averaged per
category (a mean of ratios; see ``per_category``). Writes ``<out>.md``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from analysis.markdown import markdown_table
from analysis.results import RecordError, eval_answer_files
from draftlab.eval.answers import load_answers
from draftlab.eval.metrics import question_throughput


def per_category(answers: list[dict], base: dict) -> dict[str, dict[str, float]]:
    """``{category: {"sr", "tau", "exit_layer"}}``, categories sorted by name, then ``AVG`` over every answer.

    Not ``speed_metrics``' numbers, on purpose (the committed tables were made this way): SR is the mean of
    per-question ratios (``speed_metrics``: ratio of mean throughputs) and τ is new tokens per decoding
    step, so it counts the token sampled from the prefill (``speed_metrics``: pooled ``accept_lengths``).
    The per-question throughput is the shared one (wall timing)."""
    groups: dict[str, list] = defaultdict(list)
    for a in answers:
        groups[a["category"]].append(a)
    out = {}
    for cat, rows in sorted(groups.items()) + [("AVG", answers)]:
        sr, tokens, steps, drafted, depth = [], 0, 0, 0, 0.0
        for a in rows:
            c = a["choices"][0]
            sr.append(question_throughput(a) / question_throughput(base[a["question_id"]]))
            tokens, steps = tokens + sum(c["new_tokens"]), steps + sum(c["decoding_steps"])
            for d in c.get("drafter_stats") or []:
                if d:
                    drafted += d["drafted"]
                    depth += d["mean_exit_layer"] * d["drafted"]
        out[cat] = {"sr": sum(sr) / len(sr), "tau": tokens / max(steps, 1),
                    "exit_layer": depth / drafted if drafted else float("nan")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="an evaluation run directory (or its record.json)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        _, files = eval_answer_files(args.run)
    except RecordError as e:
        raise SystemExit(str(e)) from None
    base = {a["question_id"]: a for a in load_answers(files.pop("ar"))}
    tables = {name: per_category(load_answers(path), base) for name, path in files.items()}
    cats = list(next(iter(tables.values())))
    rows = [[name, *(f"{t[c]['sr']:.2f} / {t[c]['tau']:.2f} / {t[c]['exit_layer']:.1f}" for c in cats)]
            for name, t in tables.items()]
    lines = ["SR / τ / mean exit layer of the drafted tokens, per Spec-Bench category (T = 0, AR on the same "
             "questions in the same process).", "",
             *markdown_table(["setting", *cats], rows, "l" + "r" * len(cats))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
