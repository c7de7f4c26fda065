"""Records say what they measured: draftlab-table marks rows from dirty trees (and of unknown provenance),
and the record reader checks the draft identity while still reading records written before it existed."""

from __future__ import annotations

import json

import pytest

from analysis.results import RecordError, load_records, read_record
from analysis.table import build_table, render_latex, render_markdown
from tests.analysis.synthetic import columns, make_record, write_sweep

SHA = "ab" * 32


def _record(label: str, git, **kw) -> dict:
    rec = make_record(label=label, cols=columns(2.0, 1.0), **kw)
    if git is None:
        del rec["git"]
    else:
        rec["git"] = git
    return rec


@pytest.fixture
def mixed_sweep(tmp_path):
    clean = {"commit": "1" * 40, "dirty": False}
    dirty = {"commit": "2" * 40, "dirty": True}
    return write_sweep(tmp_path / "mixed", [
        _record("EAGLE-3", clean),
        _record("ConFu", dirty),
        _record("-MoE", None),                                # no git block at all
        _record("-MoE & Replicate", {"commit": None, "dirty": None}),  # git unavailable to the job
        # a row averaged over a clean and a dirty run is dirty
        _record("Replicate", clean), _record("Replicate", dirty),
    ])


def _labels(markdown: str) -> dict[str, str]:
    """{label without mark: label as printed} of every table row (header and rule lines skipped)."""
    rows = [line for line in markdown.splitlines() if line.startswith("| ")][2:]
    printed = [row[2:].split(" | ")[0] for row in rows]
    return {label.rstrip("†‡"): label for label in printed}


def test_dirty_rows_are_marked_and_clean_ones_are_not(mixed_sweep):
    table = build_table(load_records(mixed_sweep), "table4")
    assert {r.keys[0]: r.provenance for r in table.rows} == {
        "EAGLE-3": "clean", "ConFu": "dirty", "-MoE": "unknown", "-MoE & Replicate": "unknown", "Replicate": "dirty"}
    md = render_markdown(table)
    assert _labels(md) == {"EAGLE-3": "EAGLE-3", "ConFu": "ConFu†", "-MoE": "-MoE‡",
                           "-MoE & Replicate": "-MoE & Replicate‡", "Replicate": "Replicate†"}
    assert "\n† run from a working tree with uncommitted changes" in md
    assert "\n‡ the record does not say" in md
    tex = render_latex(table)
    assert r"ConFu$^\dagger$ &" in tex and r"$-$MoE$^\ddagger$ &" in tex and "EAGLE-3 &" in tex
    assert tex.splitlines()[-2:][0].startswith(r"\par{\footnotesize $^\dagger$ run from a working tree")


def test_a_table_of_clean_records_has_no_marks_or_notes(tmp_path):
    root = write_sweep(tmp_path / "clean", [_record("EAGLE-3", {"commit": "1" * 40, "dirty": False})])
    table = build_table(load_records(root), "table4")
    md, tex = render_markdown(table), render_latex(table)
    assert "†" not in md and "‡" not in md and md.endswith("|\n")
    assert "dagger" not in tex and tex.endswith("\\end{tabular}\n")


def test_draft_identity_is_read_and_checked(tmp_path):
    rec = _record("EAGLE-3", {"commit": "1" * 40, "dirty": False})
    old = tmp_path / "old.json"  # written before records named their draft: still history, still read
    old.write_text(json.dumps(rec))
    assert read_record(old).draft == {"path": None, "sha256": None, "step": None}
    rec["draft"] = {"path": "/a/draft", "sha256": SHA, "step": 120}
    new = tmp_path / "new.json"
    new.write_text(json.dumps(rec))
    assert read_record(new).draft == rec["draft"]
    for bad, match in (({"sha256": "abc"}, "draft.sha256"), ({"step": -1}, "draft.step"),
                       ({"step": "120"}, "draft.step"), ({"path": 3}, "draft.path")):
        new.write_text(json.dumps({**rec, "draft": {**rec["draft"], **bad}}))
        with pytest.raises(RecordError, match=match):
            read_record(new)
    new.write_text(json.dumps({**rec, "git": {"commit": "1" * 40, "dirty": "yes"}}))
    with pytest.raises(RecordError, match="git.dirty"):
        read_record(new)
