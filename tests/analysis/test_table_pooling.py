"""What a table row averages: repeats of one configuration, counted; never runs whose settings differ."""

from __future__ import annotations

import pytest

from analysis.results import TABLE_COLUMNS
from analysis.table import LAYOUTS, TableError, build_table, load_records, main, render_latex, render_markdown
from tests.analysis.synthetic import columns, make_record, write_sweep

SHA = ("ab" * 32, "cd" * 32, "ef" * 32)


def _sweep_demo(tmp_path):
    """As experiment=sweep_demo: TTT length 2, 4 x T 0, 0.7 x nodes 4, 8, one EAGLE-3 record each."""
    recs = []
    for ttt in (2, 4):
        for t in (0.0, 0.7):
            for nodes in (4, 8):
                tau = 1.0 + ttt / 10 + nodes / 100 + t / 1000
                recs.append(make_record(label="EAGLE-3", nodes=nodes, temperature=t, ttt_length=ttt,
                                        cols=columns(tau, tau / 2)))
    return write_sweep(tmp_path / "sweep_demo", recs)


def test_table1_refuses_to_average_ttt_lengths_and_names_the_way_out(tmp_path, capsys):
    root = _sweep_demo(tmp_path)
    assert main([str(root), "--layout", "table1"]) == 2
    err = capsys.readouterr().err
    assert err == ("draftlab-table: error: table1 has no column for ttt_length (records have 2, 4): use --layout "
                   "table6 or the methods layout, or keep one with --ttt-length 4\n")
    # the filter it names gives one TTT length's rows, each the value of its one record
    table = build_table(load_records(root), "table1", ttt_lengths=[4])
    assert [r.keys for r in table.rows] == [["EAGLE-3", "4", "0.0"], ["EAGLE-3", "4", "0.7"],
                                            ["EAGLE-3", "8", "0.0"], ["EAGLE-3", "8", "0.7"]]
    by_key = {(r.nodes, r.temperature): r.value("WRIT", "tau") for r in load_records(root) if r.ttt_length == 4}
    for row in table.rows:
        assert row.n_runs == 1 and row.values["WRIT"]["tau"] == by_key[(int(row.keys[1]), float(row.keys[2]))]
    # the layouts the message names show both lengths as rows of their own
    assert len(build_table(load_records(root), "table6").rows) == 8
    methods = build_table(load_records(root), "methods")
    assert len(methods.rows) == 8 and {r.keys[1].split(", ")[1] for r in methods.rows} == {"ttt_length=2",
                                                                                         "ttt_length=4"}


# For each setting a layout may not print: two records that any layout would otherwise put in one row.
HIDDEN = {
    "ttt_length": lambda rec, i: rec["eval"]["axes"].update(ttt_length=(2, 4)[i]),
    "depth": lambda rec, i: rec["eval"]["axes"].update(depth=(3, 5)[i]),
    "max_new_tokens": lambda rec, i: rec["eval"].update(max_new_tokens=(64, 128)[i]),
    "timing": lambda rec, i: rec["eval"].update(timing=("wall", "decode")[i]),
    "per_category": lambda rec, i: rec["config"].update(bench={"per_category": (1, 3)[i]}),
    "method": lambda rec, i: rec["eval"].update(method=("eagle3", "confu")[i]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("setting", HIDDEN)
def test_no_layout_averages_records_whose_settings_differ(tmp_path, layout, setting):
    recs = []
    for i in range(2):
        rec = make_record(label="ConFu", nodes=8, temperature=0.0, ttt_length=7, cols=columns(2.0 + i, 1.0 + i))
        HIDDEN[setting](rec, i)
        recs.append(rec)
    records = load_records(write_sweep(tmp_path / "pair", recs))
    try:
        table = build_table(records, layout)
    except TableError as exc:  # refused: the message names the setting, its values and where to see it
        message = str(exc)
        assert message.startswith(f"{layout} has no column for {setting} (records have ") and "\n" not in message
        assert "--" in message
        return
    # or shown: one row per record, each its own values, and the setting in a printed key cell
    assert [row.n_runs for row in table.rows] == [1, 1] and "Runs" not in table.key_headers
    assert sorted(row.values["WRIT"]["tau"] for row in table.rows) == [2.0, 3.0]
    assert all(any(setting in (k or "") for k in row.keys) for row in table.rows) or setting == "ttt_length"


def test_methods_layout_shows_the_evaluation_setting_that_tells_rows_apart(tmp_path, capsys):
    recs = [make_record(label="EAGLE-3", nodes=8, max_new_tokens=n, cols=columns(tau, 1.0))
            for n, tau in ((128, 1.5), (64, 1.25))]
    recs.append(make_record(label="EAGLE-3", nodes=8, temperature=0.7, max_new_tokens=64, cols=columns(1.1, 1.0)))
    root = write_sweep(tmp_path / "lengths", recs)
    assert main([str(root), "--layout", "methods"]) == 0
    rows = [line.split(" | ")[:4] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["| EAGLE-3", "nodes=8, max_new_tokens=64", "0.0", "1.25"],
                    ["| EAGLE-3", "nodes=8, max_new_tokens=128", "0.0", "**1.50**"],
                    ["| EAGLE-3", "nodes=8, max_new_tokens=64", "0.7", "1.10"]]
    # without the clash (one T each) the setting is not spelled out: only what tells rows apart is
    assert main([str(root), "--layout", "methods", "--setting", "max_new_tokens=64"]) == 0
    assert "max_new_tokens" not in capsys.readouterr().out
    assert main([str(root), "--layout", "table1"]) == 2
    assert "table1 has no column for max_new_tokens (records have 64, 128): use the methods layout, or keep one " \
           "with --setting max_new_tokens=128" in capsys.readouterr().err


def _repeats(tmp_path):
    """One configuration run three times: other seeds, other drafts trained under the same settings, one of
    them the same config evaluated again; plus one run of another configuration."""
    recs = [make_record(label="ConFu", nodes=8, ttt_length=7, temperature=0.0, cols=columns(tau, sr), seed=seed,
                        draft_sha256=sha, max_new_tokens=64, run_name=f"confu-seed{seed}")
            for tau, sr, seed, sha in ((2.0, 1.0, 0, SHA[0]), (2.3, 1.3, 1, SHA[1]), (2.9, 1.1, 1, SHA[1]))]
    recs.append(make_record(label="EAGLE-3", nodes=8, ttt_length=7, temperature=0.0, cols=columns(1.5, 0.9),
                            max_new_tokens=64))
    return write_sweep(tmp_path / "repeats", recs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repeats_of_one_configuration_are_pooled_and_counted(tmp_path, layout):
    root = _repeats(tmp_path)
    records = load_records(root)
    if layout == "table6":
        records = [r for r in records if r.label == "ConFu"]
    table = build_table(records, layout)
    assert table.key_headers[-1] == "Runs"
    pooled = next(row for row in table.rows if row.keys[0] in ("ConFu", "7"))
    assert pooled.keys[-1] == "3" and pooled.n_runs == 3
    confu = [r for r in records if r.label == "ConFu"]
    for col in TABLE_COLUMNS:
        for metric in table.metrics:
            expected = sum(r.value(col, metric) for r in confu) / len(confu)
            assert pooled.values[col][metric] == pytest.approx(expected)
    if layout != "table6":
        assert [row.keys[-1] for row in table.rows if row.keys[0] == "EAGLE-3"] == ["1"]
    md, tex = render_markdown(table), render_latex(table)
    assert "| Runs |" in md.splitlines()[0] and " & Runs & " in tex
    with pytest.raises(TableError, match=r"^3 records for row .* \(one configuration\): .*repeats/0/record\.json"):
        build_table(records, layout, duplicates="error")


def test_no_runs_column_when_nothing_is_pooled(tmp_path):
    root = _repeats(tmp_path)
    table = build_table(load_records(root / "0", root / "3"), "table1")
    assert table.key_headers == ["Method", "Nodes", "T"] and all(len(r.keys) == 3 for r in table.rows)


def test_setting_filter_errors_are_one_line(tmp_path, capsys):
    root = _repeats(tmp_path)
    assert main([str(root), "--setting", "max_new_tokens"]) == 2
    assert capsys.readouterr().err == ("draftlab-table: error: --setting takes NAME=VALUE (e.g. max_new_tokens=128), "
                                       "got 'max_new_tokens'\n")
    assert main([str(root), "--setting", "block_size=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftlab-table: error: --setting block_size: no record has that setting (they have ")
    assert err.count("\n") == 1 and "max_new_tokens" in err
    assert main([str(root), "--setting", "max_new_tokens=64", "--setting", "label=EAGLE-3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 1 and rows[0].startswith("| EAGLE-3 | 8 | 0.0 |")
