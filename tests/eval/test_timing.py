"""Decode-only timing: throughputs over wall time less prefill time, and the prefill_time answer field."""

from __future__ import annotations

import pytest

from draftlab.data.benchmarks import Question
from draftlab.data.errors import DataError
from draftlab.decoding.engine import DecodeStats
from draftlab.eval.answers import answer_record, validate_answer
from draftlab.eval.metrics import question_throughput, speed_metrics
from draftlab.eval.runner import EvalResult, format_table, report_groups
from draftlab.eval.turns import TurnAnswer


def _answer(qid, category, new_tokens, wall_time, prefill_time=None, accept_lengths=(1,)):
    choice = {"index": 0, "turns": ["t"] * len(new_tokens), "new_tokens": new_tokens, "wall_time": wall_time,
              "accept_lengths": list(accept_lengths)}
    if prefill_time is not None:
        choice["prefill_time"] = prefill_time
    return {"question_id": qid, "category": category, "choices": [choice]}


# Method:   q1 decode 12/(4.0-3.0) = 12.0, wall 12/4.0 = 3.0;  q2 decode (6+6)/((2+3)-(1+1)) = 4.0, wall 12/5 = 2.4
# Baseline: q1 decode 12/(9.0-3.0) =  2.0, wall 12/9.0;       q2 decode 12/((3+4)-(1+1)) = 2.4,  wall 12/7
METHOD = [_answer("a", "niah_16k", [12], [4.0], [3.0], [4, 4, 4]),
          _answer("b", "news_summ", [6, 6], [2.0, 3.0], [1.0, 1.0], [3, 3, 3, 3])]
BASELINE = [_answer("a", "niah_16k", [12], [9.0], [3.0], [1] * 12),
            _answer("b", "news_summ", [6, 6], [3.0, 4.0], [1.0, 1.0], [1] * 12)]


def test_decode_timing_subtracts_prefill():
    assert question_throughput(METHOD[0], "decode") == pytest.approx(12.0)
    assert question_throughput(METHOD[0]) == pytest.approx(3.0)
    assert question_throughput(METHOD[1], "decode") == pytest.approx(4.0)
    m = speed_metrics(METHOD, BASELINE, column_of=lambda c: None, timing="decode")
    assert m["timing"] == "decode" and m["columns"] == {}
    # AVG: mean(12, 4) / mean(2, 2.4) = 8 / 2.2; per category: a 12/2 = 6, b 4/2.4
    assert m["AVG"]["speedup"] == pytest.approx(8 / 2.2)
    assert m["categories"]["niah_16k"]["speedup"] == pytest.approx(6.0)
    assert m["categories"]["news_summ"]["speedup"] == pytest.approx(4 / 2.4)
    wall = speed_metrics(METHOD, BASELINE, column_of=lambda c: None)
    assert wall["timing"] == "wall"
    assert wall["AVG"]["speedup"] == pytest.approx((3.0 + 2.4) / 2 / ((12 / 9 + 12 / 7) / 2))


def test_decode_timing_needs_prefill_time():
    old = [_answer("a", "niah_16k", [12], [4.0])]  # a file written before prefill_time was recorded
    with pytest.raises(DataError, match="prefill_time.*timing 'wall'"):
        speed_metrics(old, old, timing="decode", column_of=lambda c: None)
    assert speed_metrics(old, old, column_of=lambda c: None)["AVG"]["speedup"] == pytest.approx(1.0)
    with pytest.raises(DataError, match="decode time"):
        question_throughput(_answer("z", "x", [1], [2.0], [2.0]), "decode")
    with pytest.raises(ValueError, match="timing"):
        speed_metrics(METHOD, BASELINE, timing="cpu")


def test_categories_without_a_column_are_reported():
    # Long-context categories have no ConFu column: each is a row of its own, beside AVG.
    m = speed_metrics(METHOD, BASELINE, column_of=lambda c: None, timing="decode")
    assert list(report_groups(m)) == ["niah_16k", "news_summ", "AVG"]
    res = EvalResult(bench="long_context", method="pld", gen=None, metrics=m, accept_histogram={},
                     mismatches_vs_ar=None, timing="decode")
    flat = res.flat_metrics()
    assert flat["eval/long_context/niah_16k/speedup"] == pytest.approx(6.0)
    assert flat["eval/long_context/AVG/tau"] == pytest.approx(24 / 7)  # pooled [4,4,4,3,3,3,3]


def test_format_table_lists_uncolumned_categories():
    from draftlab.decoding.engine import GenerationConfig

    m = speed_metrics(METHOD, BASELINE, column_of=lambda c: None, timing="decode")
    res = EvalResult(bench="long_context", method="pld", gen=GenerationConfig(max_new_tokens=12), metrics=m,
                     accept_histogram={}, mismatches_vs_ar=0, timing="decode")
    text = format_table(res)
    assert "timing=decode" in text and "niah_16k" in text and "news_summ" in text and "AVG" in text


def test_answer_record_carries_prefill_time_and_validation_checks_it():
    stats = DecodeStats(new_tokens=3, accept_lengths=[1, 2], prefill_time=0.25, wall_time=1.0)
    record = answer_record(Question("q", "niah_16k", ["hi"]), [TurnAnswer([1], [2, 3, 4], "abc", stats)], "m")
    assert record["choices"][0]["prefill_time"] == [0.25]
    assert validate_answer(record) is record
    old = _answer("q", "x", [3], [1.0])
    assert validate_answer(old) is old  # optional: older files have none
    for bad, field in (([0.1, 0.2], "choices[0].prefill_time"), ("0.1", "choices[0].prefill_time"),
                       ([-0.1], "choices[0].prefill_time[0]"), ([True], "choices[0].prefill_time[0]"),
                       ([2.0], "choices[0].prefill_time[0]")):  # more than the turn's wall time
        with pytest.raises(DataError) as exc:
            validate_answer(_answer("q", "x", [3], [1.0], bad), file="a.jsonl", line=4)
        assert exc.value.field == field and exc.value.line == 4 and exc.value.file == "a.jsonl"
