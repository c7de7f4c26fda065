"""Loading run records: recursion and order, skipped non-records, errors that name the file, grouping."""

from __future__ import annotations

import json

import pytest

from analysis.results import (
    RecordError,
    RecordWarning,
    columns_from_metrics,
    format_temperature,
    group_records,
    load_records,
    training_record,
)
from tests.analysis.synthetic import columns, make_record, write_sweep


def test_recursive_natural_order_and_skips(tmp_path):
    recs = [make_record(label=f"L{i}", temperature=0.1 * i) for i in range(11)]
    sweep = write_sweep(tmp_path / "sweep", recs)
    (sweep / "3" / "record.json").write_text(json.dumps({"schema": "other/1"}))  # not ours
    (sweep / "summary.json").write_text("{}")  # only files named record.json are searched
    with pytest.warns(RecordWarning, match=r"sweep/3/record\.json: not a draftlab run record"):
        loaded = load_records(sweep, sweep / "5", sweep / "5" / "record.json")  # overlaps read once
    # Hydra job numbers sort numerically: 10 after 9
    assert [r.run_dir.name for r in loaded] == ["0", "1", "2", "4", "5", "6", "7", "8", "9", "10"]
    assert load_records(tmp_path / "sweep" / "0", kind="train") == []
    assert len(load_records(sweep / "0", kind="eval")) == 1


@pytest.mark.parametrize(
    "content, match",
    [
        ("{oops", "malformed JSON at line 1"),
        (json.dumps({"schema": "draftlab.record/2", "kind": "eval", "run_name": "x"}), "unsupported schema"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "sample", "run_name": "x"}), "'kind' must be"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "eval"}), "'run_name' missing"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "eval", "run_name": "x",
                     "eval": {"columns": {"WRIT": {"tau": "4.0"}}}}), r"'eval\.columns\.WRIT\.tau'"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "eval", "run_name": "x",
                     "eval": {"accept_lengths": {"one": 3}}}), r"'eval\.accept_lengths' entry 'one'"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "train", "run_name": "x",
                     "train": {"history": [{"loss": 1.0}]}}), r"'train\.history\[0\]\.step'"),
        (json.dumps({"schema": "draftlab.record/1", "kind": "eval", "run_name": "x", "tags": "a"}), "'tags' must be"),
    ],
)
def test_malformed_records_name_the_file(tmp_path, content, match):
    path = tmp_path / "run" / "record.json"
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(RecordError, match=match) as info:
        load_records(tmp_path)
    assert str(info.value).startswith(str(path))


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(RecordError, match="no such file"):
        load_records(tmp_path / "absent")


def test_accessors_and_columns_from_metrics(tmp_path):
    rec = make_record(label="ConFu", ttt_length=7, accept_lengths={"3": 2, "1": 5})
    rec["eval"]["columns"] = {}
    rec["metrics"] = {"eval/specbench/M/R/tau": 4.2, "eval/specbench/M/R/speedup": 2.1, "eval/specbench/AVG/tau": 4.0,
                      "eval/mtbench/WRIT/tau": 9.9, "train/acc_0": 0.5, "eval/specbench/AVG/other": 1.0}
    path = _write(tmp_path, rec)
    (r,) = load_records(path)
    assert r.columns == {"M/R": {"tau": 4.2, "speedup": 2.1}, "AVG": {"tau": 4.0}}
    assert r.value("M/R", "tau") == 4.2 and r.value("WRIT", "tau") is None and r.value("AVG", "speedup") is None
    assert r.accept_lengths == {1: 5, 3: 2}
    assert (r.label, r.method, r.bench, r.target, r.ttt_length) == ("ConFu", "confu", "specbench", "smollm2_135m", 7)
    assert r.get("git.commit") == "0" * 40 and r.get("git.nope", "d") == "d"
    assert columns_from_metrics(rec["metrics"], None)["WRIT"] == {"tau": 9.9}


def _write(tmp_path, rec):
    d = tmp_path / rec["run_name"]
    d.mkdir()
    (d / "record.json").write_text(json.dumps(rec))
    return d


def test_group_records(main_sweep):
    with pytest.warns(RecordWarning):
        rs = load_records(main_sweep, kind="eval")
    by_setting = group_records(rs, ["nodes", "temperature"])
    assert list(by_setting) == [(30, 0.0), (30, 0.7), (60, 0.0)]
    assert [r.label for r in by_setting[(30, 0.0)]] == ["EAGLE-3", "ConFu", "EAGLE-3"]
    assert list(group_records(rs, "choices.method")) == ["eagle3", "confu"]
    assert list(group_records(rs, lambda r: r.value("WRIT", "tau") > 3.05)) == [False, True]
    assert columns(1.0, 1.0)["AVG"]["tau"] == pytest.approx(2.1)


def test_format_temperature():
    assert [format_temperature(t) for t in (0, 0.0, 0.7, 1, 0.75, None)] == ["0.0", "0.0", "0.7", "1.0", "0.75", None]


def test_axes_come_from_the_record_and_old_records_still_read(tmp_path):
    from analysis.results import Record

    new = make_record(label="PLD", nodes=None)
    new["eval"]["axes"] = {"draft_tokens": 8}
    rec = Record(path=tmp_path / "record.json", data=new)
    assert rec.nodes is None and rec.axis("draft_tokens") == 8  # a training-free row has no "Nodes"
    old = make_record(label="EAGLE-3")
    old["eval"].pop("axes")
    old["eval"].update(draft_nodes=8, ttt_length=7)  # the pre-axes record layout
    rec = Record(path=tmp_path / "record.json", data=old)
    assert (rec.nodes, rec.ttt_length) == (8, 7)


def test_baselines_evaluated_beside_a_method_load_as_records_of_their_own(tmp_path):
    rec = make_record(label="EAGLE-3", nodes=32, temperature=0.7, cols=columns(1.3, 0.9), run_name="grid-1")
    rec["metrics"] = {"eval/specbench/AVG/speedup": 0.9}
    rec["eval"]["baselines"] = {
        "pld": {"method": "prompt_lookup", "label": "PLD", "axes": {"draft_tokens": 8},
                "columns": columns(1.2, 1.1), "accept_lengths": {"1": 5, "3": 2}, "mismatches_vs_ar": None},
        "hybrid": {"method": "eagle3", "label": "EAGLE-3 + suffix", "columns": columns(1.4, 1.0)}}
    write_sweep(tmp_path, [rec])
    main, pld, hybrid = load_records(tmp_path)
    assert [r.label for r in (main, pld, hybrid)] == ["EAGLE-3", "PLD", "EAGLE-3 + suffix"]
    # The run's bench, temperature and identity; the baseline's own cells, axes and histogram.
    assert pld.temperature == 0.7 and pld.bench == "specbench" and pld.run_name == "grid-1/pld"
    assert pld.value("WRIT", "speedup") == 1.1 and main.value("WRIT", "speedup") == 0.9
    assert pld.axes == {"draft_tokens": 8} and pld.nodes is None and pld.accept_lengths == {1: 5, 3: 2}
    assert pld.metrics == {} and hybrid.axes == {} and hybrid.value("AVG", "tau") == main.value("AVG", "tau") + 0.1
    assert [r.label for r in load_records(tmp_path, baselines=False)] == ["EAGLE-3"]
    rec["eval"]["baselines"]["bad"] = [1, 2]
    (tmp_path / "0" / "record.json").write_text(json.dumps(rec))
    with pytest.raises(RecordError, match="record.json: eval.baselines.bad must be an object"):
        load_records(tmp_path)


def test_training_record_is_the_one_run_with_a_history(tmp_path):
    trained = make_record(label="EAGLE-3", kind="train", history=[{"step": 1, "train/loss": 2.0}])
    write_sweep(tmp_path / "one", [trained, make_record(label="EAGLE-3")])  # an eval-only run beside it
    assert training_record(tmp_path / "one").history == [{"step": 1, "train/loss": 2.0}]
    write_sweep(tmp_path / "two", [trained, trained])
    with pytest.raises(RecordError, match="expected one training record, found 2"):
        training_record(tmp_path / "two")


def test_ar_throughput_reads_under_one_name_from_old_and_new_records(tmp_path):
    """Cells carry the AR throughput as ``ar_tps``; records written before the rename say ``baseline_tps``,
    in ``eval.columns`` or in the flat ``eval/<bench>/<col>/baseline_tps`` metrics."""
    from analysis.results import CELL_KEYS, Record

    assert "ar_tps" in CELL_KEYS and "baseline_tps" not in CELL_KEYS
    new = make_record(label="EAGLE-3", cols=columns(2.0, 1.0, override={("AVG", "ar_tps"): 41.0}))
    old = make_record(label="EAGLE-3", cols=columns(2.0, 1.0))
    for cell in old["eval"]["columns"].values():
        cell["baseline_tps"] = cell.pop("ar_tps") - 8.0
    flat = make_record(label="EAGLE-3")
    flat["metrics"] = {"eval/specbench/AVG/baseline_tps": 33.0, "eval/specbench/AVG/tau": 2.0,
                       "eval/specbench/WRIT/baseline_tps": 30.0, "eval/specbench/WRIT/ar_tps": 31.0}
    r_new, r_old, r_flat = (Record(path=tmp_path / "record.json", data=d) for d in (new, old, flat))
    assert r_new.value("AVG", "ar_tps") == 41.0 and r_old.value("AVG", "ar_tps") == 42.0
    assert r_flat.value("AVG", "ar_tps") == 33.0 and r_flat.value("WRIT", "ar_tps") == 31.0  # the new name wins
    for r in (r_new, r_old, r_flat):
        assert all("baseline_tps" not in cell for cell in r.columns.values())
    assert old["eval"]["columns"]["AVG"]["baseline_tps"] == 42.0  # the record itself is left as read


def test_eval_settings_come_from_the_eval_block_else_the_run_config(tmp_path):
    from analysis.results import Record

    rec = make_record(label="EAGLE-3", max_new_tokens=64)
    rec["config"].update(eval={"max_new_tokens": 128, "timing": "decode", "max_turns": 1},
                         bench={"categories": ["coding"], "per_category": 3, "limit": None})
    r = Record(path=tmp_path / "record.json", data=rec)
    assert r.eval_settings == {"max_new_tokens": 64, "timing": "decode", "max_turns": 1, "top_p": None,
                               "top_k": None, "categories": ("coding",), "per_category": 3, "limit": None}
    assert Record(path=tmp_path / "record.json", data=make_record(label="x")).eval_setting("timing") is None


GOOD_ROW = {"question_id": 7, "category": "coding", "accepted": 40, "rounds": 20, "tps": 80.0, "ar_tps": 40.0}


@pytest.mark.parametrize("questions, field", [
    ({"7": GOOD_ROW}, r"'eval\.questions' must be a list of objects with keys question_id, category, accepted, "
                      r"rounds, tps, ar_tps, got dict"),
    ([GOOD_ROW, 3], r"'eval\.questions\[1\]' is 3"),
    ([{k: v for k, v in GOOD_ROW.items() if k != "rounds"}], r"'eval\.questions\[0\]\.rounds' must be a "
                                                            r"non-negative int, got None"),
    ([{**GOOD_ROW, "accepted": 40.5}], r"'eval\.questions\[0\]\.accepted' must be a non-negative int, got 40\.5"),
    ([{**GOOD_ROW, "tps": "fast"}], r"'eval\.questions\[0\]\.tps' must be a non-negative number, got 'fast'"),
    ([{**GOOD_ROW, "question_id": True}], r"'eval\.questions\[0\]\.question_id' must be a string or int"),
])
def test_malformed_question_rows_name_the_file_and_field(tmp_path, questions, field):
    rec = make_record(label="ConFu")
    rec["eval"]["questions"] = questions
    path = write_sweep(tmp_path / "s", [rec]) / "0" / "record.json"
    with pytest.raises(RecordError, match=field) as info:
        load_records(tmp_path / "s")
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_question_rows_and_intervals_read_from_the_record_and_its_baselines(tmp_path):
    rec = make_record(label="EAGLE-3", cols=columns(2.0, 1.0, override={("AVG", "tau_ci"): [1.9, 2.2]}))
    rec["eval"].update(questions=[GOOD_ROW], interval={"level": 0.9})
    rec["eval"]["baselines"] = {"pld": {"label": "PLD", "columns": columns(1.2, 1.1),
                                        "questions": [{**GOOD_ROW, "accepted": 30}], "interval": {"level": 0.8}},
                                "old": {"label": "old", "columns": columns(1.2, 1.1)}}
    main, pld, old = load_records(write_sweep(tmp_path / "s", [rec]))
    assert main.questions == [GOOD_ROW] and pld.questions == [{**GOOD_ROW, "accepted": 30}]
    assert old.questions is None and pld.eval["interval"] == {"level": 0.8}
    assert main.columns["AVG"]["tau_ci"] == [1.9, 2.2]
    assert load_records(write_sweep(tmp_path / "o", [make_record(label="x")]))[0].questions is None
    rec["eval"]["baselines"]["pld"]["questions"] = [{**GOOD_ROW, "rounds": -1}]
    rec["eval"]["columns"]["AVG"]["tau_ci"] = [1.9]
    (tmp_path / "s" / "0" / "record.json").write_text(json.dumps(rec))
    with pytest.raises(RecordError, match=r"'eval\.columns\.AVG\.tau_ci' must be \[lo, hi\] or null, got \[1\.9\]"):
        load_records(tmp_path / "s")
    rec["eval"]["columns"]["AVG"]["tau_ci"] = None
    (tmp_path / "s" / "0" / "record.json").write_text(json.dumps(rec))
    with pytest.raises(RecordError, match=r"record\.json: 'eval\.baselines\.pld\.questions' must be .*"
                                          r"'eval\.baselines\.pld\.questions\[0\]\.rounds' must be a non-negative int"):
        load_records(tmp_path / "s")
