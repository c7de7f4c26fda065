"""Per-category τ, SR and mean exit layer of every SpecBound setting of one evaluation run.

    python experiments/specbound/categories.py runs/specbound/eval --out experiments/specbound/table_categories

Reads the run's record and its answer files (the drafter's per-turn ``drafter_stats``: drafted tokens and
their mean exit layer). SR is each question's tokens/s over AR's on the same question, averaged per
category, as Spec-Bench's ``speed.py`` does. Writes ``<out>.md``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from analysis.results import RecordError, eval_answer_files
from draftlab.eval.answers import load_answers


def per_category(answers: list[dict], base: dict) -> dict[str, dict[str, float]]:
    groups: dict[str, list] = defaultdict(list)
    for a in answers:
        groups[a["category"]].append(a)
    out = {}
    for cat, rows in sorted(groups.items()) + [("AVG", answers)]:
        sr, tokens, steps, drafted, depth = [], 0, 0, 0, 0.0
        for a in rows:
            c, b = a["choices"][0], base[a["question_id"]]["choices"][0]
            sr.append((sum(c["new_tokens"]) / sum(c["wall_time"])) / (sum(b["new_tokens"]) / sum(b["wall_time"])))
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
    base = {a["question_id"]: a for a in load_answers(files.pop("ar") if "ar" in files else files.pop("baseline"))}
    tables = {name: per_category(load_answers(path), base) for name, path in files.items()}
    cats = list(next(iter(tables.values())))
    lines = ["SR / τ / mean exit layer of the drafted tokens, per Spec-Bench category (T = 0, AR on the same "
             "questions in the same process).", "",
             "| setting | " + " | ".join(cats) + " |", "| --- |" + " ---: |" * len(cats)]
    for name, t in tables.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{t[c]['sr']:.2f} / {t[c]['tau']:.2f} / {t[c]['exit_layer']:.1f}" for c in cats) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
