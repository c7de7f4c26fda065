"""Spec-Bench metrics on a hand-made pair of answer files, every expected number worked out by hand."""

from __future__ import annotations

import json

import pytest

from draftlab.data.benchmarks import Question
from draftlab.data.errors import DataError
from draftlab.decoding.engine import DecodeStats
from draftlab.eval.answers import answer_record, load_answers, write_answer
from draftlab.eval.metrics import (
    accept_histogram,
    accept_length_survival,
    mismatched_questions,
    mismatches,
    question_rows,
    speed_metrics,
)
from draftlab.eval.turns import TurnAnswer
from draftlab.eval.uncertainty import MIN_QUESTIONS, group_intervals


def _answer(qid, category, turns, new_tokens, wall_time, accept_lengths):
    return {"question_id": qid, "category": category, "answer_id": f"a{qid}", "model_id": "m", "tstamp": 0.0,
            "choices": [{"index": 0, "turns": turns, "decoding_steps": [1] * len(turns), "new_tokens": new_tokens,
                         "wall_time": wall_time, "accept_lengths": accept_lengths}]}


# Method: per-question throughput sum(new_tokens)/sum(wall_time)
#   q1 writing         (6+4)/(1.0+1.0) = 5.0   accept [3,3,2,2]
#   q2 math            9/1.5           = 6.0   accept [4,4,1]
#   q3 math_reasoning  8/2.0           = 4.0   accept [2,2,4]
#   q4 coding          12/2.0          = 6.0   accept [5,5,2]
METHOD = [
    _answer(1, "writing", ["w1", "w2"], [6, 4], [1.0, 1.0], [3, 3, 2, 2]),
    _answer(2, "math", ["m"], [9], [1.5], [4, 4, 1]),
    _answer(3, "math_reasoning", ["g"], [8], [2.0], [2, 2, 4]),
    _answer(4, "coding", ["spec code"], [12], [2.0], [5, 5, 2]),
]
# AR (vanilla, accept lengths all 1):
#   q1 (6+4)/(2.0+3.0) = 2.0, q2 9/4.5 = 2.0, q3 8/4.0 = 2.0, q4 12/3.0 = 4.0,
#   q5 is a qa question the method never answered: matched by id, so it must not count.
BASELINE = [
    _answer(1, "writing", ["w1", "w2"], [6, 4], [2.0, 3.0], [1] * 10),
    _answer(2, "math", ["m"], [9], [4.5], [1] * 9),
    _answer(3, "math_reasoning", ["g"], [8], [4.0], [1] * 8),
    _answer(4, "coding", ["ar code"], [12], [3.0], [1] * 12),
    _answer(5, "qa", ["q"], [5], [0.5], [1] * 5),
]


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, rows in (("method", METHOD), ("ar", BASELINE)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def _close(got: dict, expected: dict):
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_columns_categories_and_pooled_avg(files):
    m = speed_metrics(files["method"], files["ar"])
    assert list(m["columns"]) == ["WRIT", "CODE", "M/R"]  # ConFu's column order, absent columns left out
    # WRIT: tau mean[3,3,2,2] = 10/4 = 2.5; SR 5.0/2.0 = 2.5
    _close(m["columns"]["WRIT"], {"tau": 2.5, "speedup": 2.5, "n_questions": 1, "method_tps": 5.0,
                                  "ar_tps": 2.0})
    # CODE: tau (5+5+2)/3 = 4.0; SR 6.0/4.0 = 1.5
    _close(m["columns"]["CODE"], {"tau": 4.0, "speedup": 1.5, "n_questions": 1})
    # M/R pools math and math_reasoning: tau (4+4+1+2+2+4)/6 = 17/6 = 2.8333;
    # SR mean(6.0,4.0)/mean(2.0,2.0) = 5.0/2.0 = 2.5
    _close(m["columns"]["M/R"], {"tau": 2.8333333333, "speedup": 2.5, "n_questions": 2, "method_tps": 5.0,
                                 "ar_tps": 2.0})
    # categories keep the two M/R parts apart: math tau 9/3 = 3.0, SR 6/2 = 3.0; math_reasoning 8/3, 4/2 = 2.0
    assert set(m["categories"]) == {"writing", "math", "math_reasoning", "coding"}
    _close(m["categories"]["math"], {"tau": 3.0, "speedup": 3.0, "n_questions": 1})
    _close(m["categories"]["math_reasoning"], {"tau": 2.6666666667, "speedup": 2.0, "n_questions": 1})
    # AVG pooled over all 4 questions: tau (10+9+8+12)/(4+3+3+3) = 39/13 = 3.0;
    # method tps mean(5,6,4,6) = 5.25, AR mean(2,2,2,4) = 2.5 (q5 excluded), SR 5.25/2.5 = 2.1
    # (a mean of per-question ratios would give (2.5+3+2+1.5)/4 = 2.25 instead)
    assert m["avg"] == "pooled"
    _close(m["AVG"], {"tau": 3.0, "speedup": 2.1, "n_questions": 4, "method_tps": 5.25, "ar_tps": 2.5})


def test_mean_of_columns_avg(files):
    m = speed_metrics(files["method"], files["ar"], avg="columns")
    # tau (2.5 + 4.0 + 17/6)/3 = 3.1111; SR (2.5 + 1.5 + 2.5)/3 = 2.1667; n = 1+1+2 = 4
    _close(m["AVG"], {"tau": 3.1111111111, "speedup": 2.1666666667, "n_questions": 4})
    with pytest.raises(ValueError, match="avg must be"):
        speed_metrics(files["method"], files["ar"], avg="median")


def test_category_filter(files):
    m = speed_metrics(METHOD, BASELINE, categories=["math", "math_reasoning"])
    assert list(m["columns"]) == ["M/R"] and set(m["categories"]) == {"math", "math_reasoning"}
    # AVG is the pooled figure of the subset, equal to the M/R column: tau 17/6, SR 5.0/2.0
    _close(m["AVG"], {"tau": 2.8333333333, "speedup": 2.5, "n_questions": 2})
    with pytest.raises(DataError, match="no method answers in categories"):
        speed_metrics(METHOD, BASELINE, categories=["roleplay"])


def test_swapped_files_give_reciprocal_speedup(files):
    forward = speed_metrics(METHOD, BASELINE[:4])
    backward = speed_metrics(BASELINE[:4], METHOD)
    # 2.5 / 5.25 = 1 / 2.1 = 0.47619; the vanilla side's tau is exactly 1
    assert backward["AVG"]["speedup"] == pytest.approx(0.4761904762)
    assert backward["AVG"]["speedup"] * forward["AVG"]["speedup"] == pytest.approx(1.0)
    for col in forward["columns"]:
        assert backward["columns"][col]["speedup"] == pytest.approx(1 / forward["columns"][col]["speedup"])
    assert backward["AVG"]["tau"] == 1.0
    # the AR file has q5, which the method file lacks
    with pytest.raises(DataError, match=r"the AR answers have no answer for 1 method question\(s\): 5"):
        speed_metrics(BASELINE, METHOD)


def test_column_of_none_counts_in_avg_only():
    method = METHOD + [_answer(9, "humaneval", ["h"], [4], [1.0], [4])]
    base = BASELINE + [_answer(9, "humaneval", ["h"], [4], [2.0], [1] * 4)]
    m = speed_metrics(method, base, column_of=lambda c: None if c == "humaneval" else "X")
    assert list(m["columns"]) == ["X"] and m["columns"]["X"]["n_questions"] == 4
    assert m["AVG"]["n_questions"] == 5 and "humaneval" in m["categories"]
    with pytest.raises(DataError, match="no table column"):
        speed_metrics(method, base)


def test_mismatches_and_histogram(files):
    assert mismatches(files["method"], files["ar"]) == 1  # q4's turn differs
    assert mismatched_questions(METHOD, BASELINE) == [4]
    assert mismatches(BASELINE[:4], BASELINE[:4]) == 0
    # pooled lengths [3,3,2,2] [4,4,1] [2,2,4] [5,5,2] -> 1:1, 2:2+2+1=5, 3:2, 4:2+1=3, 5:2
    assert accept_histogram(METHOD) == {1: 1, 2: 5, 3: 2, 4: 3, 5: 2}


def test_accept_length_survival():
    # lengths count the bonus token: [1,2,2,4] -> draft tokens [0,1,1,3]
    # P(>=0)=4/4, P(>=1)=3/4, P(>=2)=1/4, P(>=3)=1/4
    expected = [(0, 1.0), (1, 0.75), (2, 0.25), (3, 0.25)]
    assert accept_length_survival([1, 2, 2, 4]) == expected
    assert accept_length_survival({"1": 1, "2": 2, "4": 1}) == expected  # histogram form, JSON keys
    assert accept_length_survival([1, 2, 2, 4], bonus_included=False) == [
        (0, 1.0), (1, 1.0), (2, 0.75), (3, 0.25), (4, 0.25)]
    assert accept_length_survival([]) == []
    with pytest.raises(ValueError):
        accept_length_survival([0])


def test_write_load_round_trip_and_record_builder(tmp_path):
    stats = [DecodeStats(new_tokens=5, accept_lengths=[3, 1], wall_time=0.5),
             DecodeStats(new_tokens=3, accept_lengths=[2], wall_time=0.25)]
    turns = [TurnAnswer([1], [7] * 5, "first", stats[0]), TurnAnswer([1], [7] * 3, "second", stats[1])]
    record = answer_record(Question(7, "writing", ["a", "b"]), turns, "eagle3-smollm2", temperature=0.0)
    choice = record["choices"][0]
    assert choice["turns"] == ["first", "second"] and choice["new_tokens"] == [5, 3]
    assert choice["accept_lengths"] == [3, 1, 2] and choice["decoding_steps"] == [2, 1]
    assert record["temperature"] == 0.0 and record["model_id"] == "eagle3-smollm2"
    path = tmp_path / "sub" / "answers.jsonl"
    write_answer(path, record)
    write_answer(path, _answer(8, "coding", ["x"], [2], [0.1], [2]))
    loaded = load_answers(path)
    assert [r["question_id"] for r in loaded] == [7, 8] and loaded[0] == record


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", r"answers\.jsonl:2: malformed JSON"),
        (json.dumps({"question_id": 2, "category": "qa"}), r"answers\.jsonl:2: field 'choices'"),
        (json.dumps(_answer(2, "qa", ["a", "b"], [1], [1.0], [1])), r":2: field 'choices\[0\]\.new_tokens'"),
        (json.dumps(_answer(2, "qa", ["a"], [1], [-1.0], [1])), r":2: field 'choices\[0\]\.wall_time\[0\]'"),
        (json.dumps(_answer(1, "qa", ["a"], [1], [1.0], [1])), r":2: field 'question_id': .*already answered on line 1"),
    ],
)
def test_load_answers_errors_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps(_answer(1, "qa", ["a"], [1], [1.0], [1])) + "\n" + line + "\n")
    with pytest.raises(DataError, match=match):
        load_answers(path)


def test_zero_wall_time_is_an_error():
    with pytest.raises(DataError, match="question 1: total wall_time is 0"):
        speed_metrics([_answer(1, "qa", ["a"], [1], [0.0], [1])], [_answer(1, "qa", ["a"], [1], [1.0], [1])])


def test_question_rows_are_the_per_question_sums():
    rows = question_rows(METHOD, BASELINE)
    assert [r["question_id"] for r in rows] == [1, 2, 3, 4]  # q5 (AR only) has no row
    # q1: accepted 3+3+2+2 = 10 over 4 rounds, method 5.0 tok/s, AR 2.0; q4: 5+5+2 = 12 over 3, 6.0 vs 4.0
    assert rows[0] == {"question_id": 1, "category": "writing", "accepted": 10, "rounds": 4, "tps": 5.0,
                       "ar_tps": 2.0}
    assert rows[3] == {"question_id": 4, "category": "coding", "accepted": 12, "rounds": 3, "tps": 6.0,
                       "ar_tps": 4.0}
    with pytest.raises(DataError, match="the AR answers have no answer"):
        question_rows(BASELINE, METHOD)
    with pytest.raises(DataError, match="question 2 is 'math' in the method answers but 'qa' in the AR answers"):
        question_rows(METHOD[:2], [BASELINE[0], _answer(2, "qa", ["m"], [9], [4.5], [1] * 9)])


def test_groups_carry_rows_and_intervals(files):
    m = speed_metrics(files["method"], files["ar"], resamples=500, seed=3, min_questions=1)
    assert m["questions"] == question_rows(METHOD, BASELINE)
    assert m["interval"] == {"method": "percentile bootstrap over questions", "resamples": 500, "level": 0.95,
                             "seed": 3, "min_questions": 1}
    # a single-question group cannot vary: its interval is its value
    assert m["columns"]["WRIT"]["tau_ci"] == [2.5, 2.5] and m["columns"]["CODE"]["speedup_ci"] == [1.5, 1.5]
    # M/R has two questions (tau 3.0 and 8/3, SR 6/2 and 4/2): of the 4 equally likely resamples of two,
    # {q2,q2} and {q3,q3} each have probability 1/4, far above 2.5 %, so the 95 % interval spans the two
    # single-question values exactly
    assert m["columns"]["M/R"]["tau_ci"] == pytest.approx([8 / 3, 3.0])
    assert m["columns"]["M/R"]["speedup_ci"] == pytest.approx([2.0, 3.0])
    # the pooled AVG interval is the bootstrap of all rows, and holds the point value
    assert {k: m["AVG"][k] for k in ("tau_ci", "speedup_ci")} == group_intervals(m["questions"], resamples=500,
                                                                                    seed=3)
    for group in [m["AVG"], *m["columns"].values(), *m["categories"].values()]:
        assert group["tau_ci"][0] <= group["tau"] <= group["tau_ci"][1]
        assert group["speedup_ci"][0] <= group["speedup"] <= group["speedup_ci"][1]
    assert speed_metrics(METHOD, BASELINE, resamples=500, seed=3, min_questions=1) == m  # seeded: the same again
    assert speed_metrics(METHOD, BASELINE, resamples=500, seed=4, min_questions=1)["AVG"]["tau_ci"] != m["AVG"]["tau_ci"]


def test_groups_of_few_questions_get_no_interval(files):
    # By default a group needs MIN_QUESTIONS questions: the 4 questions here are too few for any interval,
    # while the values themselves are unchanged.
    m = speed_metrics(files["method"], files["ar"])
    assert MIN_QUESTIONS > 4 and m["interval"]["min_questions"] == MIN_QUESTIONS
    for group in [m["AVG"], *m["columns"].values(), *m["categories"].values()]:
        assert group["tau_ci"] is None and group["speedup_ci"] is None
    assert m["AVG"]["tau"] == speed_metrics(files["method"], files["ar"], min_questions=1)["AVG"]["tau"]
    four = speed_metrics(files["method"], files["ar"], min_questions=4)
    assert four["AVG"]["tau_ci"] is not None and four["columns"]["M/R"]["tau_ci"] is None


def test_mean_of_columns_interval_resamples_within_columns():
    m = speed_metrics(METHOD, BASELINE, avg="columns", min_questions=1)
    # WRIT and CODE are fixed (one question each); only M/R moves, between 8/3 and 3.0, so the mean of
    # the three column τ ranges over (2.5 + 4.0 + [8/3, 3.0]) / 3
    assert m["AVG"]["tau_ci"] == pytest.approx([(6.5 + 8 / 3) / 3, (6.5 + 3.0) / 3])
    # SR: WRIT 2.5, CODE 1.5, M/R between 2.0 and 3.0
    assert m["AVG"]["speedup_ci"] == pytest.approx([(4.0 + 2.0) / 3, (4.0 + 3.0) / 3])
