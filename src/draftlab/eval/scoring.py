"""Answer-quality scores beside the speed numbers: did each run's answer contain the reference?

Speculative decoding is lossless, so at T=0 every drafter's answer is the AR answer and these scores agree
across runs; they say what the target itself gets right on the benchmark (NIAH: whether the needle's
number was retrieved), and at T>0 they show that sampling with a drafter keeps that quality.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from draftlab.data.benchmarks import Question
from draftlab.data.long_context import reference_found
from draftlab.eval.answers import load_answers


def found_scores(answers: Iterable[Mapping[str, Any]], questions: Mapping[Any, Question]) -> dict[str, Any]:
    """``{"found": n_found, "n": n, "by_question": {id: bool}}`` over the answers to ``questions``.

    An answer's text is all its turns joined (``choices[0]``, as the speed metrics read); answers to other
    questions are ignored, and a scored question left unanswered is an error, since it would otherwise
    silently shrink ``n``.
    """
    by_question: dict[str, bool] = {}
    for record in answers:
        q = questions.get(record["question_id"])
        if q is None:
            continue
        text = "\n".join(record["choices"][0]["turns"])
        by_question[str(q.question_id)] = reference_found(text, q.reference)
    missing = [str(qid) for qid in questions if str(qid) not in by_question]
    if missing:
        raise ValueError(f"no answer to scored question(s) {missing[:5]}")
    return {"found": sum(by_question.values()), "n": len(by_question), "by_question": by_question}


def bench_scores(scored: Callable[[str], bool], questions: Iterable[Question],
                 answer_files: Mapping[str, str | Path]) -> dict[str, dict[str, Any]]:
    """Scores of every run (name -> its answer file) on the questions whose category ``scored`` accepts;
    ``{}`` when the run has none (say, a category filter kept only L-Eval prompts)."""
    wanted = {q.question_id: q for q in questions if scored(q.category)}
    if not wanted:
        return {}
    return {name: found_scores(load_answers(path), wanted) for name, path in answer_files.items()}


def format_scores(bench: str, scores: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: ``<bench> reference found: ar 3/5, eagle3 3/5``."""
    parts = [f"{name} {s['found']}/{s['n']}" for name, s in scores.items()]
    return f"{bench} reference found in answer: " + ", ".join(parts)
