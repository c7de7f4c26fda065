"""draftlab-table --ci: cells as "value ± half-width" of their bootstrap interval over questions."""

from __future__ import annotations

import re

import pytest

from analysis.results import load_records
from analysis.table import build_table, main, render_latex, render_markdown
from analysis.table_model import column_questions
from draftlab.data.benchmarks import category_column
from draftlab.eval.uncertainty import pooled_interval
from tests.analysis.synthetic import make_record, question_rows, with_questions, write_sweep

# WRIT's questions spread widely, CODE's barely: their intervals differ by more than ten times.
SPREADS = {"writing": (2.0, 1.0), "coding": (3.0, 0.02), "math": (2.5, 0.3)}


def _half(ci) -> float:
    return (ci[1] - ci[0]) / 2


def _cell(v: float, h: float) -> str:
    return f"{v:.2f} ± {h:.2f}"


def _evaluated(label: str = "ConFu", seed: int = 0, spreads=SPREADS, per_category: int = 10, **kw) -> dict:
    return with_questions(make_record(label=label, **kw), question_rows(spreads, per_category=per_category, seed=seed))


def _in(rows: list[dict], column: str) -> list[dict]:
    # Written out here rather than taken from the table code, so that a wrong column choice there shows.
    return list(rows) if column == "AVG" else [r for r in rows if category_column(r["category"]) == column]


def test_single_run_row_prints_the_stored_interval(tmp_path):
    rec = _evaluated()
    rec["eval"]["columns"]["M/R"]["tau_ci"] = [1.0, 1.5]  # a stored interval is printed, not recomputed
    (record,) = load_records(write_sweep(tmp_path / "s", [rec]))
    table = build_table([record], "table1", ci=True)
    row = table.rows[0]
    cols = rec["eval"]["columns"]
    for col in ("WRIT", "CODE", "AVG"):
        for metric in ("tau", "speedup"):
            assert row.spread[col][metric] == pytest.approx(_half(cols[col][f"{metric}_ci"]))
    assert row.spread["M/R"]["tau"] == pytest.approx(0.25)
    md = render_markdown(table)
    assert _cell(cols["WRIT"]["tau"], _half(cols["WRIT"]["tau_ci"])) in md
    assert _cell(cols["CODE"]["speedup"], _half(cols["CODE"]["speedup_ci"])) in md
    assert _cell(cols["M/R"]["tau"], 0.25) in md
    assert "± : half-width of the 95% bootstrap interval over questions; SR paired with AR." in md
    assert "pooled rows" not in md  # no row pools anything
    # a column without questions (and so without a value) stays missing, without a ±
    assert "| – | – |" in md


def test_stored_interval_is_the_one_the_questions_give(tmp_path):
    """The evaluation's stored interval and a recomputation from the record's questions agree (same draws)."""
    rec = _evaluated()
    (record,) = load_records(write_sweep(tmp_path / "s", [rec]))
    stored = build_table([record], "table1", ci=True).rows[0].spread
    for cell in rec["eval"]["columns"].values():  # keep the questions, drop every stored interval
        cell.pop("tau_ci", None)
        cell.pop("speedup_ci", None)
    (bare,) = load_records(write_sweep(tmp_path / "t", [rec]))
    recomputed = build_table([bare], "table1", ci=True).rows[0].spread
    for col in ("WRIT", "CODE", "M/R", "AVG"):
        for metric in ("tau", "speedup"):
            assert recomputed[col][metric] == pytest.approx(stored[col][metric], abs=1e-12)


def _pooled_sweep(tmp_path, n: int = 3):
    return load_records(write_sweep(tmp_path / "pooled", [_evaluated(seed=s) for s in range(n)]))


def test_pooled_row_adds_the_pooled_interval_to_the_mean(tmp_path):
    records = _pooled_sweep(tmp_path)
    table = build_table(records, "table1", ci=True)
    (row,) = table.rows
    assert row.n_runs == 3
    plain = build_table(records, "table1")
    runs = [r.eval["questions"] for r in records]
    md = render_markdown(table)
    for col in ("WRIT", "CODE", "M/R", "AVG"):
        expected = pooled_interval([_in(q, col) for q in runs], resamples=400, seed=0)
        for metric in ("tau", "speedup"):
            half = _half(expected[f"{metric}_ci"])
            assert row.spread[col][metric] == pytest.approx(half, abs=1e-12)
            # the printed value is the table's mean of the runs, as without --ci
            value = plain.rows[0].values[col][metric]
            assert row.values[col][metric] == value
            assert value == pytest.approx(sum(r.value(col, metric) for r in records) / 3)
            assert _cell(value, half) in md
    assert md.splitlines()[0].startswith("| Method | Nodes | T | Runs | WRIT τ |")
    assert "; SR paired with AR; pooled rows add run-to-run spread." in md


def test_pooled_interval_is_wider_than_one_runs(tmp_path):
    """Runs that differ add their spread: the pooled half-width is not just one run's."""
    records = _pooled_sweep(tmp_path, n=4)
    pooled = build_table(records, "table1", ci=True).rows[0].spread
    single = build_table(records[:1], "table1", ci=True).rows[0].spread
    assert pooled["M/R"]["tau"] != pytest.approx(single["M/R"]["tau"], rel=1e-6)


@pytest.mark.parametrize("n_runs", [1, 3])
def test_each_column_takes_its_own_questions(tmp_path, n_runs):
    records = _pooled_sweep(tmp_path, n=n_runs)
    spread = build_table(records, "table1", ci=True).rows[0].spread
    # writing questions spread fifty times wider than coding ones: so must their half-widths
    assert spread["WRIT"]["tau"] > 10 * spread["CODE"]["tau"]
    runs = [r.eval["questions"] for r in records]
    for col, other in (("WRIT", "CODE"), ("CODE", "WRIT"), ("M/R", "WRIT")):
        own = _half(pooled_interval([_in(q, col) for q in runs], resamples=400, seed=0)["tau_ci"])
        wrong = _half(pooled_interval([_in(q, other) for q in runs], resamples=400, seed=0)["tau_ci"])
        assert spread[col]["tau"] == pytest.approx(own, abs=1e-12)
        assert spread[col]["tau"] != pytest.approx(wrong, rel=0.05)
    # AVG resamples every question, not one column's
    avg = _half(pooled_interval(runs, resamples=400, seed=0)["tau_ci"])
    assert spread["AVG"]["tau"] == pytest.approx(avg, abs=1e-12)
    assert column_questions(runs[0], "WRIT") == _in(runs[0], "WRIT")


def test_latex_cells_and_note_use_pm(tmp_path):
    records = _pooled_sweep(tmp_path, n=2)
    tex = render_latex(build_table(records, "table1", ci=True))
    assert re.search(r"& \d+\.\d\d \$\\pm\$ \d+\.\d\d &", tex)
    assert "±" not in tex
    assert (r"\par{\footnotesize $\pm$ : half-width of the 95\% bootstrap interval over questions; SR paired "
            r"with AR; pooled rows add run-to-run spread.}") in tex
    joint = render_latex(build_table(records, "table1", ci=True), cell="joint")
    assert re.search(r"\d \$\\pm\$ \d+\.\d\d / \d+\.\d\d \$\\pm\$ \d", joint)


def test_record_without_questions_prints_bare_values_and_a_note(tmp_path):
    old = make_record(label="EAGLE-3", cols={"WRIT": {"tau": 1.5, "speedup": 0.5}, "AVG": {"tau": 1.4,
                                                                                         "speedup": 0.4}})
    records = load_records(write_sweep(tmp_path / "s", [_evaluated(), old]))
    table = build_table(records, "table1", ci=True)
    md = render_markdown(table)
    eagle = next(line for line in md.splitlines() if line.startswith("| EAGLE-3"))
    assert "±" not in eagle and "| 1.50 | 0.50 |" in eagle
    confu = next(line for line in md.splitlines() if line.startswith("| ConFu"))
    assert confu.count("±") == 2 * 4  # τ and SR of WRIT, CODE, M/R, AVG
    assert md.endswith("\n\nno interval: EAGLE-3, Nodes 30, T 0.0 (record has no per-question answers)\n")
    tex = render_latex(table)
    assert r"\par{\footnotesize no interval: EAGLE-3, Nodes 30, T 0.0 (record has no per-question answers)}" in tex
    # only old records: bare values, no line about what ± means
    only_old = render_markdown(build_table(records[1:], "table1", ci=True))
    assert "±" not in only_old and "no interval: EAGLE-3" in only_old
    # a table of older records only: one line for all its rows
    olds = [make_record(label=lab, cols={"WRIT": {"tau": 1.5, "speedup": 0.5}}) for lab in ("EAGLE-3", "ConFu")]
    olds[1]["eval"]["axes"]["block_size"] = 8
    text = render_markdown(build_table(load_records(write_sweep(tmp_path / "old", olds)), "methods", ci=True))
    assert text.endswith("| – | – |\n\nno interval: every row (records have no per-question answers)\n")
    assert text.count("no interval") == 1 and text.count("**1.50** | **0.50**") == 2  # a tie: both bold
    olds.insert(1, _evaluated(label="ConFu"))
    text = render_markdown(build_table(load_records(write_sweep(tmp_path / "mixed", olds)), "methods", ci=True))
    assert "no interval: ConFu, nodes=30, block_size=8, T 0.0 (record has no per-question answers)" in text


def test_pooled_row_with_an_old_record_or_other_questions_has_no_interval(tmp_path):
    old = make_record(label="ConFu", cols={"WRIT": {"tau": 2.5, "speedup": 1.5}})
    md = render_markdown(build_table(load_records(write_sweep(tmp_path / "a", [_evaluated(), old])), "table1",
                                     ci=True))
    assert "±" not in md.split("\n\n")[0]
    assert "no interval: ConFu, Nodes 30, T 0.0, Runs 2" not in md  # the Runs column is not part of the name
    assert "no interval: ConFu, Nodes 30, T 0.0 (1 of its 2 records have no per-question answers)" in md
    other = _evaluated(seed=1, spreads={"writing": (2.0, 1.0), "coding": (3.0, 0.02), "math": (2.5, 0.3)},
                       per_category=11)
    md = render_markdown(build_table(load_records(write_sweep(tmp_path / "b", [_evaluated(), other])), "table1",
                                     ci=True))
    assert "no interval: ConFu, Nodes 30, T 0.0 (its 2 records answered different questions)" in md


def test_cells_of_too_few_questions_stay_bare(tmp_path):
    spreads = {"writing": (2.0, 0.5), "coding": (3.0, 0.1)}
    rec = with_questions(make_record(label="ConFu"), question_rows(spreads, per_category=6)
                         + [{**row, "question_id": 100 + i} for i, row in
                            enumerate(question_rows({"qa": (1.5, 0.2)}, per_category=3))])
    for records in ([rec], [rec, rec]):
        table = build_table(load_records(write_sweep(tmp_path / str(len(records)), records)), "table1", ci=True)
        spread = table.rows[0].spread
        assert spread["QA"] == {"tau": None, "speedup": None}
        assert spread["WRIT"]["tau"] is not None and spread["AVG"]["tau"] is not None
        md = render_markdown(table)
        assert f"| {rec['eval']['columns']['QA']['tau']:.2f} | {rec['eval']['columns']['QA']['speedup']:.2f} |" in md
        assert "no interval: cells of fewer than 5 questions (too few to resample)." in md


def test_bold_stays_on_the_best_value(tmp_path):
    better = _evaluated(label="ConFu", spreads={k: (t + 1.0, s) for k, (t, s) in SPREADS.items()})
    records = load_records(write_sweep(tmp_path / "s", [_evaluated(label="EAGLE-3"), better]))
    plain, ci = build_table(records, "table1"), build_table(records, "table1", ci=True)
    assert ci.best() == plain.best() and plain.best()
    md = render_markdown(ci)
    confu = next(line for line in md.splitlines() if line.startswith("| ConFu"))
    half = ci.rows[[r.keys[0] for r in ci.rows].index("ConFu")].spread["WRIT"]["tau"]
    assert f"**{better['eval']['columns']['WRIT']['tau']:.2f}** ± {half:.2f}" in confu
    assert re.search(r"\\textbf\{\d+\.\d\d\} \$\\pm\$ \d+\.\d\d", render_latex(ci))


def test_without_ci_questions_change_nothing(tmp_path):
    recs = [_evaluated(seed=s) for s in range(2)] + [_evaluated(label="EAGLE-3")]
    with_q = load_records(write_sweep(tmp_path / "q", recs))
    for rec in recs:
        del rec["eval"]["questions"], rec["eval"]["interval"]
        for cell in rec["eval"]["columns"].values():
            del cell["tau_ci"], cell["speedup_ci"]
    without = load_records(write_sweep(tmp_path / "n", recs))
    for render in (render_markdown, render_latex):
        text = render(build_table(with_q, "table1"))
        assert text == render(build_table(without, "table1")) and "±" not in text and "pm" not in text


def test_tau_only_layout_says_nothing_of_sr(tmp_path):
    recs = [_evaluated(ttt_length=n, seed=n) for n in (4, 7)]
    md = render_markdown(build_table(load_records(write_sweep(tmp_path / "s", recs)), "table6", ci=True))
    assert "± : half-width of the 95% bootstrap interval over questions." in md
    assert md.count("±") == 1 + 2 * 4


def test_cli_ci_writes_both_formats(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s", [_evaluated(seed=s) for s in range(2)])
    out = tmp_path / "t" / "table"
    assert main([str(sweep), "--ci", "--format", "both", "--out", str(out)]) == 0
    assert "± " in out.with_suffix(".md").read_text() and r"$\pm$" in out.with_suffix(".tex").read_text()
    assert main([str(sweep)]) == 0
    assert "±" not in capsys.readouterr().out


def test_stored_intervals_of_too_few_questions_are_not_shown(tmp_path):
    """Records written before intervals needed MIN_QUESTIONS questions stored a zero-width interval for a
    one-question cell; the table shows that cell bare (and says why) while a larger cell keeps its ±."""
    rec = _evaluated(per_category=1)  # one question per category: WRIT, CODE, M/R each of one
    for col in ("WRIT", "CODE", "M/R"):
        cell = rec["eval"]["columns"][col]
        cell["tau_ci"], cell["speedup_ci"] = [cell["tau"], cell["tau"]], [cell["speedup"], cell["speedup"]]
    rec["eval"].pop("interval", None)  # an older record: no stated minimum
    (record,) = load_records(write_sweep(tmp_path / "s", [rec]))
    table = build_table([record], "table1", ci=True)
    assert table.rows[0].spread["WRIT"]["tau"] is None and table.rows[0].spread["CODE"]["speedup"] is None
    assert "no interval: cells of fewer than 5 questions" in render_markdown(table)
