"""Per-request τ and per-position acceptance in answer records: worked out by hand, written and read back,
older lines without them still loading, and malformed values named by file, line and field."""

from __future__ import annotations

import json

import pytest

from draftlab.data.benchmarks import Question
from draftlab.data.errors import DataError
from draftlab.decoding.engine import DecodeStats
from draftlab.eval.answers import acceptance_rates, answer_record, load_answers, turn_tau, write_answer
from draftlab.eval.turns import TurnAnswer


def _turn(accept_lengths: list[int], text: str = "t") -> TurnAnswer:
    # new_tokens counts the prefill's token too, which belongs to no verify round
    stats = DecodeStats(new_tokens=1 + sum(accept_lengths), accept_lengths=list(accept_lengths), wall_time=1.0)
    return TurnAnswer([1], [2], text, stats)


def test_acceptance_rates_by_hand():
    # accepted drafted tokens per round: 3, 0, 1, 2 -> past position 0: 3 of 4, past 1: 2 of 4, past 2: 1 of 4
    assert acceptance_rates([4, 1, 2, 3]) == pytest.approx([0.75, 0.5, 0.25])
    assert acceptance_rates([1, 1, 1]) == []  # AR, or a drafter that never hit
    assert acceptance_rates([]) == []
    assert acceptance_rates([2]) == [1.0]


def test_turn_tau_is_the_mean_accept_length():
    assert turn_tau([4, 1, 2, 3]) == pytest.approx(2.5)
    assert turn_tau([1, 1]) == 1.0
    assert turn_tau([]) is None


def test_answer_record_carries_per_turn_tau_and_acceptance():
    turns = [_turn([4, 1, 2, 3], "first"), _turn([1, 1], "second"), _turn([], "third")]
    choice = answer_record(Question(3, "writing", ["a", "b", "c"]), turns, "m")["choices"][0]
    assert choice["tau"] == [pytest.approx(2.5), 1.0, None]
    assert choice["acceptance"] == [pytest.approx([0.75, 0.5, 0.25]), [], []]
    # the pooled Spec-Bench list is unchanged
    assert choice["accept_lengths"] == [4, 1, 2, 3, 1, 1]
    # each turn's τ agrees with the engine's own, and with its rates: τ = 1 + Σ rates
    assert choice["tau"][0] == pytest.approx(turns[0].stats.tau)
    assert all(t == pytest.approx(1 + sum(r)) for t, r in zip(choice["tau"][:2], choice["acceptance"][:2]))


def test_round_trip_and_older_lines_without_the_keys(tmp_path):
    path = tmp_path / "answers.jsonl"
    write_answer(path, answer_record(Question(1, "qa", ["q"]), [_turn([3, 2, 1])], "m"))
    old = answer_record(Question(2, "qa", ["q"]), [_turn([2])], "m")
    for key in ("tau", "acceptance"):
        del old["choices"][0][key]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(old) + "\n")
    new, older = load_answers(path)
    assert new["choices"][0]["tau"] == [pytest.approx(2.0)]
    assert new["choices"][0]["acceptance"] == [pytest.approx([2 / 3, 1 / 3])]
    assert "tau" not in older["choices"][0] and "acceptance" not in older["choices"][0]


@pytest.mark.parametrize("key, value, field", [
    ("tau", [1.5, 2.0], "choices[0].tau"),
    ("tau", ["fast"], "choices[0].tau[0]"),
    ("tau", [-1.0], "choices[0].tau[0]"),
    ("acceptance", "high", "choices[0].acceptance"),
    ("acceptance", [0.5], "choices[0].acceptance[0]"),
    ("acceptance", [[0.5, 1.5]], "choices[0].acceptance[0][1]"),
    ("acceptance", [[True]], "choices[0].acceptance[0][0]"),
])
def test_malformed_per_turn_metrics_name_file_line_and_field(tmp_path, key, value, field):
    record = answer_record(Question(1, "qa", ["q"]), [_turn([2, 1])], "m")
    record["choices"][0][key] = value
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_answers(path)
    assert err.value.file == str(path) and err.value.line == 1 and err.value.field == field


def test_null_tau_is_valid(tmp_path):
    path = tmp_path / "answers.jsonl"
    write_answer(path, answer_record(Question(1, "qa", ["q"]), [_turn([])], "m"))
    (record,) = load_answers(path)
    assert record["choices"][0]["tau"] == [None] and record["choices"][0]["acceptance"] == [[]]
