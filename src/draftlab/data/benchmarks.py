"""Evaluation prompts: Spec-Bench / MT-bench question files, HumanEval, and the ConFu table columns."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftlab.data.conversations import iter_json_records
from draftlab.data.errors import DataError

# Checked against the ConFu paper's Tables 1-4: every table has the
# columns WRIT RP CODE EXT STEM HUM SUMM TRAN QA RAG M/R (then AVG) in this order, and the captions
# define only WRIT=writing, QA=question-answer, SUMMAR=summarization, TRANS=translation, CODE=coding,
# M/R=math/reasoning. Spec-Bench has 13 categories for these 11 columns; its two MT-bench categories
# "reasoning" and "math" have no column of their own, so they fold into M/R with "math_reasoning"
# (GSM8K), as the captions' "math/reasoning" says.
SPECBENCH_CATEGORY_TO_COLUMN: dict[str, str] = {
    "writing": "WRIT",
    "roleplay": "RP",
    "coding": "CODE",
    "extraction": "EXT",
    "stem": "STEM",
    "humanities": "HUM",
    "summarization": "SUMM",
    "translation": "TRAN",
    "qa": "QA",
    "rag": "RAG",
    "reasoning": "M/R",
    "math": "M/R",
    "math_reasoning": "M/R",
}
CONFU_COLUMNS: list[str] = ["WRIT", "RP", "CODE", "EXT", "STEM", "HUM", "SUMM", "TRAN", "QA", "RAG", "M/R"]

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


@dataclass
class Question:
    """One benchmark item: an id, a category and the user turns to send one after another."""

    question_id: int | str
    category: str
    turns: list[str]
    reference: Any = None


def category_column(category: str) -> str:
    """ConFu/Spec-Bench table column of a category (``"math"`` -> ``"M/R"``)."""
    try:
        return SPECBENCH_CATEGORY_TO_COLUMN[category]
    except KeyError:
        raise DataError(
            f"category {category!r} has no table column (known: {', '.join(SPECBENCH_CATEGORY_TO_COLUMN)})"
        ) from None


def load_question_jsonl(path: str | Path) -> list[Question]:
    """Load a Spec-Bench / MT-bench question file: ``{"question_id", "category", "turns", "reference"?}``."""
    path = Path(path)
    if not path.is_file():
        raise DataError("file not found", file=path)
    questions = []
    for loc, row in iter_json_records(path):
        if not isinstance(row, dict):
            raise loc.error(f"expected a JSON object, got {type(row).__name__}")
        if not isinstance(row.get("question_id"), (int, str)) or isinstance(row.get("question_id"), bool):
            raise loc.error("missing, or not an int or string", "question_id")
        if not isinstance(row.get("category"), str):
            raise loc.error("missing or not a string", "category")
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns:
            raise loc.error("missing or not a non-empty list", "turns")
        for i, turn in enumerate(turns):
            if not isinstance(turn, str):
                raise loc.error(f"expected a string, got {type(turn).__name__}", f"turns[{i}]")
        questions.append(Question(row["question_id"], row["category"], list(turns), row.get("reference")))
    if not questions:
        raise DataError("no questions", file=path)
    return questions


def load_humaneval(path: str | Path) -> list[Question]:
    """Load HumanEval (``{"task_id", "prompt", "canonical_solution"?, ...}``) as single-turn questions.

    A chat target given a bare function stub often replies with prose, so the prompt is wrapped in
    :data:`HUMANEVAL_INSTRUCTION` (a fenced code block after "Complete the following Python function:"),
    which makes it answer with code as it would for a real coding request. The category is
    ``"humaneval"`` rather than ``"coding"`` so its numbers are never averaged into the Spec-Bench
    CODE column; ``reference`` holds the canonical solution when present.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError("file not found", file=path)
    questions = []
    for loc, row in iter_json_records(path):
        if not isinstance(row, dict):
            raise loc.error(f"expected a JSON object, got {type(row).__name__}")
        for key in ("task_id", "prompt"):
            if not isinstance(row.get(key), str):
                raise loc.error("missing or not a string", key)
        questions.append(
            Question(
                question_id=row["task_id"],
                category="humaneval",
                turns=[HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])],
                reference=row.get("canonical_solution"),
            )
        )
    if not questions:
        raise DataError("no questions", file=path)
    return questions


def select_questions(
    questions: Iterable[Question],
    *,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
    limit: int | None = None,
) -> list[Question]:
    """A deterministic subset: file order kept, then the first ``per_category`` of each category, then the first ``limit``.

    Taking leading items (rather than a random sample) matches how Spec-Bench subsets are usually
    quoted, and the same arguments give the same questions on every machine. Unknown names in
    ``categories`` raise, since a typo would otherwise silently evaluate nothing.
    """
    questions = list(questions)
    if categories is not None:
        present = {q.category for q in questions}
        missing = [c for c in categories if c not in present]
        if missing:
            raise DataError(f"unknown categories {missing} (present: {', '.join(sorted(present))})")
        wanted = set(categories)
        questions = [q for q in questions if q.category in wanted]
    if per_category is not None:
        taken: dict[str, int] = {}
        subset = []
        for q in questions:
            if taken.get(q.category, 0) < per_category:
                taken[q.category] = taken.get(q.category, 0) + 1
                subset.append(q)
        questions = subset
    if limit is not None:
        questions = questions[:limit]
    return questions
