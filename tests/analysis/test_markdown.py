"""Markdown tables as the experiment scripts write them: exact rules, cells as given."""

from __future__ import annotations

import pytest

from analysis.markdown import markdown_table, table_row


def test_left_and_right_rules_with_spaces():
    lines = markdown_table(["run", "step", "τ"], [["sft", "0", "1.234"], ["opd", 12, "1.500"]], "lrr")
    assert lines == ["| run | step | τ |", "| --- | ---: | ---: |", "| sft | 0 | 1.234 |", "| opd | 12 | 1.500 |"]


def test_explicit_left_rule():
    assert markdown_table(["a", "b"], [], "Lr")[1] == "| :--- | ---: |"


def test_tight_rule_keeps_spaced_header_and_rows():
    lines = markdown_table(["context", "ms"], [["1024", "3.6"]], "rr", tight_rule=True)
    assert lines == ["| context | ms |", "|---:|---:|", "| 1024 | 3.6 |"]


def test_cells_are_written_as_given():
    # formatted text (bold, dashes, parentheses) passes through untouched; numbers are str()-ed, not re-formatted
    assert table_row(["**1.23**", "—", "0.93 (1.36)", 0.1 + 0.2]) == "| **1.23** | — | 0.93 (1.36) | 0.30000000000000004 |"


def test_empty_cell_is_one_space():
    assert table_row(["features", "484", "", "1.73x of 280"]) == "| features | 484 | | 1.73x of 280 |"


def test_rows_may_be_a_generator():
    assert markdown_table(["x"], ([str(i)] for i in range(2)), "l")[2:] == ["| 0 |", "| 1 |"]


@pytest.mark.parametrize("headers, rows, align, match", [
    (["a", "b"], [], "l", "2 headers but 1 alignment"),
    (["a", "b"], [], "lc", "l, r or L"),
    (["a", "b"], [["1"]], "lr", "row 0 has 1 cells for 2 headers"),
])
def test_mismatches_are_errors(headers, rows, align, match):
    with pytest.raises(ValueError, match=match):
        markdown_table(headers, rows, align)
