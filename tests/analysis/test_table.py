"""draftlab-table against committed golden Markdown/LaTeX (set DRAFTLAB_UPDATE_GOLDEN=1 to rewrite them)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from analysis.results import RecordWarning
from analysis.table import TableError, build_table, load_records, main, render_markdown
from tests.analysis.synthetic import columns, make_record, write_sweep

GOLDEN = Path(__file__).parent / "golden"


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DRAFTLAB_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file"


def _run(capsys, *argv) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordWarning)
        assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "sweep, layout, fmt, cell, golden",
    [
        ("main_sweep", "table1", "markdown", "split", "table1.md"),
        ("main_sweep", "table1", "latex", "split", "table1.tex"),
        ("main_sweep", "table1", "markdown", "joint", "table1_joint.md"),
        ("ablation_sweep", "table4", "markdown", "split", "table4.md"),
        ("ablation_sweep", "table4", "latex", "split", "table4.tex"),
        ("length_sweep", "table6", "markdown", "split", "table6.md"),
        ("length_sweep", "table6", "latex", "split", "table6.tex"),
    ],
)
def test_golden(request, capsys, sweep, layout, fmt, cell, golden):
    root = request.getfixturevalue(sweep)
    out = _run(capsys, root, "--layout", layout, "--format", fmt, "--cell", cell)
    _check_golden(golden, out)


def test_cells_bold_and_missing(main_sweep):
    with pytest.warns(RecordWarning, match="not a draftlab run record"):
        records = load_records(main_sweep)
    table = build_table(records, "table1")
    rows = {tuple(r.keys): r for r in table.rows}
    # the last key column counts the runs each row pools (EAGLE-3 at (30, 0.0) was run twice)
    assert list(rows) == [("EAGLE-3", "30", "0.0", "2"), ("ConFu", "30", "0.0", "1"), ("EAGLE-3", "30", "0.7", "1"),
                          ("ConFu", "30", "0.7", "1"), ("ConFu", "60", "0.0", "1")]
    eagle = rows[("EAGLE-3", "30", "0.0", "2")]
    assert eagle.n_runs == 2
    # the two runs' WRIT cells (2.9, 1.4) and (3.1, 1.6) average to (3.0, 1.5)
    assert eagle.values["WRIT"]["tau"] == pytest.approx(3.0) and eagle.values["WRIT"]["speedup"] == pytest.approx(1.5)
    md = render_markdown(table).splitlines()
    assert md[0].startswith("| Method | Nodes | T | Runs | WRIT τ | WRIT SR | RP τ |") and md[0].endswith("AVG τ | AVG SR |")
    cells = {line.split(" | ")[0][2:] + "@" + line.split(" | ")[1] + "@" + line.split(" | ")[2]: line.split(" | ")
             for line in md[2:]}
    confu_07 = cells["ConFu@30@0.7"]
    # RAG is column 10 -> τ/SR at fields 4 + 2*9 and 4 + 2*9 + 1 (after Method, Nodes, T, Runs)
    assert confu_07[4 + 18] == "–" and confu_07[4 + 19] == "–"
    # CODE τ: EAGLE-3 pinned 5.5 beats ConFu's 3.6; WRIT τ: ConFu 3.40 beats 3.00
    assert cells["EAGLE-3@30@0.0"][4 + 4] == "**5.50**" and cells["ConFu@30@0.0"][4 + 4] == "3.60"
    assert cells["ConFu@30@0.0"][4] == "**3.40**" and cells["EAGLE-3@30@0.0"][4] == "3.00"
    # STEM τ tie at 3.20 in (30, 0.7): both bold
    assert cells["EAGLE-3@30@0.7"][4 + 8] == "**3.20**" and confu_07[4 + 8] == "**3.20**"
    # a setting with a single row bolds nothing
    assert "**" not in "".join(cells["ConFu@60@0.0"])


def test_out_file_both_formats_and_filters(main_sweep, tmp_path, capsys):
    out = tmp_path / "tables" / "t1"
    with pytest.warns(RecordWarning):
        assert main([str(main_sweep), "--format", "both", "--out", str(out), "--nodes", "30",
                     "--temperature", "0.7", "--label", "ConFu", "--label", "EAGLE-3"]) == 0
    md = (tmp_path / "tables" / "t1.md").read_text()
    tex = (tmp_path / "tables" / "t1.tex").read_text()
    lines = md.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| ConFu | 30 | 0.7 |") and lines[3].startswith("| EAGLE-3 |")
    assert tex.startswith(r"\begin{tabular}") and r"\textbf{" in tex


def test_errors(tmp_path, main_sweep, capsys):
    other = write_sweep(tmp_path / "other", [make_record(label="ConFu", target="llama3_8b", cols=columns(3, 1))])
    with pytest.warns(RecordWarning):
        assert main([str(main_sweep), str(other)]) == 2
    err = capsys.readouterr().err
    assert "mix 2 bench/target setups" in err and "--target" in err
    with pytest.warns(RecordWarning):
        assert main([str(main_sweep), str(other), "--target", "llama3_8b"]) == 0
    capsys.readouterr()

    with pytest.warns(RecordWarning), pytest.raises(TableError, match="2 records for row"):
        build_table(load_records(main_sweep), duplicates="error")
    # ConFu ran at 30 and 60 nodes: table4 has no Nodes column, so it refuses rather than average them
    with pytest.warns(RecordWarning), pytest.raises(TableError, match=r"^table4 has no column for nodes \(records "
                                                                      r"have 30, 60\): .*--nodes 60$"):
        build_table(load_records(main_sweep), "table4")

    broken = tmp_path / "broken" / "0"
    broken.mkdir(parents=True)
    (broken / "record.json").write_text(json.dumps({"schema": "draftlab.record/1", "kind": "eval", "run_name": "x",
                                                    "eval": {"temperature": "hot"}}))
    assert main([str(broken.parent)]) == 2
    err = capsys.readouterr().err
    assert str(broken / "record.json") in err and "eval.temperature" in err


def test_label_order_and_dash_labels(ablation_sweep, capsys):
    assert main([str(ablation_sweep), "--layout", "table4", "--label=-MoE", "--label", "ConFu",
                 "--temperature", "0"]) == 0
    rows = [line.split(" | ")[0][2:] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["-MoE", "ConFu"]


def test_methods_layout_keeps_each_methods_own_axes(tmp_path, capsys):
    """DFlash rows (axis block_size) next to EAGLE-3 rows (axis nodes): one row per method and setting,
    block sizes in numeric order, nothing averaged across settings; table1 would merge the DFlash rows."""
    recs = [make_record(label="EAGLE-3", nodes=8, temperature=0.0, cols=columns(1.3, 0.6))]
    for b, tau in ((16, 1.05), (4, 1.1), (8, 1.2)):
        rec = make_record(label="DFlash", nodes=None, temperature=0.0, cols=columns(tau, 0.5))
        rec["eval"]["axes"] = {"block_size": b, "draft_layers": 2}
        recs.append(rec)
    root = write_sweep(tmp_path / "cmp", recs)
    out = _run(capsys, root, "--layout", "methods", "--label", "EAGLE-3", "--label", "DFlash")
    rows = [line for line in out.splitlines() if line.startswith("| ") and ("DFlash" in line or "EAGLE-3" in line)]
    assert [r.split("|")[2].strip() for r in rows] == [
        "nodes=8", "block_size=4, draft_layers=2", "block_size=8, draft_layers=2", "block_size=16, draft_layers=2"]
    assert "1.20" in rows[2] and "1.10" in rows[1]  # WRIT τ of block 8 / block 4, unaveraged
    # why the layout exists: table1 has no column for the block size, so it refuses rather than average them
    with pytest.raises(TableError, match=r"table1 has no column for block_size \(records have 4, 8, 16, unset\)"):
        build_table(load_records(root, kind="eval"), "table1")


def test_table_rows_include_the_baselines_a_run_evaluated(tmp_path, capsys):
    from tests.analysis.synthetic import columns, make_record, write_sweep

    rec = make_record(label="EAGLE-3", nodes=32, temperature=0.0, cols=columns(1.3, 0.9))
    rec["eval"]["baselines"] = {"pld": {"method": "prompt_lookup", "label": "PLD", "columns": columns(1.2, 1.1)}}
    write_sweep(tmp_path / "grid", [rec])
    assert main([str(tmp_path / "grid"), "--layout", "methods"]) == 0
    out = capsys.readouterr().out
    assert "| EAGLE-3 |" in out and "| PLD |" in out
    assert main([str(tmp_path / "grid"), "--layout", "methods", "--no-baselines"]) == 0
    assert "| PLD |" not in capsys.readouterr().out


def test_name_labels_the_records_of_each_path(tmp_path, capsys):
    """Arms that evaluated one method from different drafts (SFT, Draft-OPD) become rows of their own."""
    rec = make_record(label="EAGLE-3", nodes=6, temperature=0.0, cols=columns(1.2, 0.7))
    rec["eval"]["baselines"] = {"pld": {"method": "prompt_lookup", "label": "PLD", "columns": columns(1.5, 1.1)}}
    write_sweep(tmp_path / "sft", [rec])
    write_sweep(tmp_path / "opd", [make_record(label="EAGLE-3", nodes=6, temperature=0.0, cols=columns(1.4, 0.8))])
    out = _run(capsys, tmp_path / "sft", tmp_path / "opd", "--name", "SFT", "--name", "Draft-OPD", "--layout", "methods")
    rows = [line.split(" | ")[0][2:] for line in out.splitlines()[2:]]
    assert rows == ["SFT", "PLD", "Draft-OPD"]  # the baseline keeps its label
    assert "1.40" in out.splitlines()[4] and "1.20" in out.splitlines()[2]
    assert main([str(tmp_path / "sft"), str(tmp_path / "opd"), "--name", "SFT"]) == 2
    assert "one per path" in capsys.readouterr().err
