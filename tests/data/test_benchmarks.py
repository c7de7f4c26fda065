from __future__ import annotations

import json
from collections import Counter

import pytest

from draftlab.data import (
    CONFU_COLUMNS,
    SPECBENCH_CATEGORY_TO_COLUMN,
    DataError,
    Question,
    category_column,
    load_humaneval,
    load_question_jsonl,
    select_questions,
)


def test_spec_bench_file(shared_data):
    questions = load_question_jsonl(shared_data / "spec_bench" / "question.jsonl")
    assert len(questions) == 480
    counts = Counter(q.category for q in questions)
    assert len(counts) == 13
    assert set(counts) <= set(SPECBENCH_CATEGORY_TO_COLUMN)
    by_column = Counter(category_column(q.category) for q in questions)
    assert sorted(by_column) == sorted(CONFU_COLUMNS)
    assert by_column["M/R"] == 100 and by_column["TRAN"] == 80 and by_column["WRIT"] == 10
    assert questions[0].question_id == 81 and len(questions[0].turns) == 2
    assert all(len(q.turns) == 1 for q in questions if q.category in ("translation", "qa", "rag"))


def test_mt_bench_file(shared_data):
    questions = load_question_jsonl(shared_data / "mt_bench" / "question.jsonl")
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    assert {q.category for q in questions} <= set(SPECBENCH_CATEGORY_TO_COLUMN)


def test_columns_cover_mapping():
    assert sorted(set(SPECBENCH_CATEGORY_TO_COLUMN.values())) == sorted(CONFU_COLUMNS)
    assert [category_column(c) for c in ("reasoning", "math", "math_reasoning")] == ["M/R"] * 3
    with pytest.raises(DataError, match="poetry"):
        category_column("poetry")


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"question_id": 1, "category": "qa"}', "turns"),
        ('{"question_id": 1, "category": "qa", "turns": []}', "turns"),
        ('{"question_id": 1, "category": "qa", "turns": ["a", 2]}', "turns[1]"),
        ('{"category": "qa", "turns": ["a"]}', "question_id"),
        ('{"question_id": 1, "turns": ["a"]}', "category"),
        ('{"question_id": 1, "category": "qa", "turns": ["a"]', None),
    ],
)
def test_bad_question_lines(tmp_path, line, field):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 0, "category": "qa", "turns": ["ok"]}\n' + line + "\n")
    with pytest.raises(DataError) as exc:
        load_question_jsonl(path)
    assert exc.value.line == 2 and exc.value.field == field and str(exc.value).startswith(f"{path}:2")


def test_humaneval(tmp_path):
    rows = [
        {
            "task_id": "HumanEval/0",
            "prompt": 'def add(a, b):\n    """Add."""\n',
            "canonical_solution": "    return a + b\n",
        },
        {"task_id": "HumanEval/1", "prompt": "def neg(a):\n"},
    ]
    path = tmp_path / "he.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    qs = load_humaneval(path)
    assert [q.question_id for q in qs] == ["HumanEval/0", "HumanEval/1"]
    assert (
        qs[0].category == "humaneval" and qs[0].reference == "    return a + b\n" and qs[1].reference is None
    )
    assert qs[0].turns == [
        'Complete the following Python function:\n```python\ndef add(a, b):\n    """Add."""\n```'
    ]
    path.write_text(json.dumps({"task_id": "HumanEval/2"}) + "\n")
    with pytest.raises(DataError) as exc:
        load_humaneval(path)
    assert exc.value.field == "prompt"


def test_select_questions():
    qs = [Question(i, cat, [f"q{i}"]) for i, cat in enumerate(["a", "a", "b", "a", "c", "b", "c"])]
    assert [q.question_id for q in select_questions(qs, categories=["b", "c"])] == [2, 4, 5, 6]
    assert [q.question_id for q in select_questions(qs, per_category=1)] == [0, 2, 4]
    assert [q.question_id for q in select_questions(qs, per_category=2, limit=3)] == [0, 1, 2]
    assert [q.question_id for q in select_questions(qs, categories=["c"], limit=1)] == [4]
    assert select_questions(qs) == qs
    with pytest.raises(DataError, match="unknown categories"):
        select_questions(qs, categories=["z"])


def test_select_spec_bench_subset(shared_data):
    qs = load_question_jsonl(shared_data / "spec_bench" / "question.jsonl")
    subset = select_questions(qs, per_category=2)
    assert len(subset) == 26 and subset == select_questions(qs, per_category=2)
