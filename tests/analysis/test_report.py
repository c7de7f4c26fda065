"""draftlab-report on synthetic records: files written, PNGs real, deltas the right numbers, W&B guarded."""

from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path

import pytest
from PIL import Image as PILImage

from analysis.report import Heading, Image, Para, Report, TableBlock, build_report, main, publish_wandb_report
from analysis.results import RecordWarning, load_records
from draftlab.eval.metrics import speed_metrics
from draftlab.eval.uncertainty import MIN_QUESTIONS, paired_difference
from tests.analysis.synthetic import columns, make_record, write_sweep


def _single(tmp_path: Path, name: str, record: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "record.json").write_text(json.dumps(record))
    return d


def _table_rows(md: str, heading: str) -> dict[str, list[str]]:
    """Rows of the first Markdown table after ``heading``, keyed by their first cell."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("| :---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture
def two_runs(tmp_path):
    a = _single(tmp_path, "eagle", make_record(label="EAGLE-3", cols=columns(3.0, 1.5),
                                               accept_lengths={"1": 2, "2": 1, "4": 1}))
    # ConFu: CODE τ pinned below EAGLE-3's (3.0 vs 3.2), RAG missing
    b = _single(tmp_path, "confu", make_record(label="ConFu", cols=columns(3.4, 1.7, skip=("RAG",),
                                                                           override={("CODE", "tau"): 3.0}),
                                               accept_lengths={"2": 1, "3": 2, "5": 1}))
    history = [{"step": s, "train/loss": 3.0 - 0.1 * s, "val/simulated_tau": 1.0 + 0.2 * s,
                "train/ploss_3": 2.0} for s in range(6)]  # ploss_3: not a default curve
    t = write_sweep(tmp_path / "train", [
        make_record(label="ConFu", kind="train", history=history, run_name="ttt4"),
        make_record(label="ConFu", kind="train", history=history[:4], run_name="ttt7"),
    ])
    return a, b, t


def test_two_runs_markdown_and_html(two_runs, tmp_path):
    a, b, t = two_runs
    out = tmp_path / "report"
    assert main([str(a), str(b), str(t), "--out", str(out), "--format", "both"]) == 0
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()

    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["group0_speedup.png", "group0_survival.png", "group0_tau.png",
                                      "train_train_loss.png", "train_val_simulated_tau.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        with PILImage.open(p) as im:
            im.verify()
        with PILImage.open(p) as im:
            assert im.size[0] >= 400 and im.size[1] >= 300
        assert f"]({p.name})" in md  # linked from the Markdown, relative
    # the HTML stands alone: every figure inlined, nothing linked
    assert html.count('src="data:image/png;base64,') == len(pngs) and 'src="group' not in html

    deltas = _table_rows(md, "Δ vs eagle")
    assert list(deltas) == ["Entry", "confu"]
    cells = dict(zip(["WRIT", "RP", "CODE", "EXT", "STEM", "HUM", "SUMM", "TRAN", "QA", "RAG", "M/R", "AVG",
                      "AVG relative"], deltas["confu"]))
    assert cells["WRIT"] == "+0.40 / +0.20"  # (3.4 - 3.0) / (1.7 - 1.5)
    assert cells["CODE"] == "-0.20 / +0.20"  # 3.0 - (3.0 + 0.2); SR 1.8 - 1.6
    assert cells["RAG"] == "– / –"  # missing on one side
    # AVG: τ 4.5 vs 4.1 -> +0.40 and +9.8 %; SR 2.25 vs 2.05 -> +0.20 and +9.8 %
    assert cells["AVG"] == "+0.40 / +0.20" and cells["AVG relative"] == "+9.8% / +9.8%"

    values = _table_rows(md, "Values")
    assert values["eagle"][0] == "3.00 / 1.50" and values["confu"][9] == "– / –"

    # survival, draft tokens = length - 1: eagle {0:2, 1:1, 3:1} of 4, confu {1:1, 2:2, 4:1} of 4
    surv = _table_rows(md, "Acceptance survival")
    assert surv["l"] == ["eagle", "confu"]
    assert [surv[str(n)] for n in range(5)] == [["1.000", "1.000"], ["0.500", "1.000"], ["0.250", "0.750"],
                                                ["0.250", "0.250"], ["0.000", "0.250"]]
    # two train records in one source: named by run
    assert "train/ttt4" in md and "train/ttt7" in md


def test_sweeps_are_compared_per_setting(main_sweep, tmp_path):
    better = write_sweep(tmp_path / "new", [
        make_record(label="ConFu", temperature=0.0, cols=columns(3.6, 1.9)),
        make_record(label="ConFu", temperature=0.7, cols=columns(3.3, 1.6)),
    ])
    with pytest.warns(RecordWarning):
        sources = [("old", load_records(main_sweep)), ("new", load_records(better))]
    report = build_report(sources, tmp_path / "out", reference="new/ConFu")
    from analysis.report import render_markdown

    md = render_markdown(report, tmp_path / "out")
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings[:4] == ["## Runs", "## specbench, nodes=30, T=0.0", "## specbench, nodes=30, T=0.7",
                            "## specbench, nodes=60, T=0.0"]
    # within (30, 0.0) the reference is new/ConFu (τ 3.6, SR 1.9 at WRIT); old EAGLE-3 runs are 2.9 and 3.1
    section = md.split("## specbench, nodes=30, T=0.0")[1].split("## specbench")[0]
    deltas = _table_rows(section, "Δ vs new/ConFu")
    assert list(deltas) == ["Entry", "old/EAGLE-3 [0]", "old/ConFu", "old/EAGLE-3 [2]"]
    assert deltas["old/ConFu"][0] == "-0.20 / -0.20"  # 3.4 - 3.6, 1.7 - 1.9
    assert (tmp_path / "out" / "group2_tau.png").is_file()
    assert not list((tmp_path / "out").glob("group2_survival.png"))  # no accept lengths recorded


def test_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no run records under empty" in capsys.readouterr().err


def test_wandb_is_guarded(tmp_path, monkeypatch):
    report = Report("r", blocks=[Heading(2, "Runs"), TableBlock(["Entry", "WRIT"], [["a", "3.00 / 1.50"]]),
                                 Para("text"), Heading(3, "sub"), Image(tmp_path / "out" / "x.png", "x")])
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.warns(RuntimeWarning, match="offline"):
        assert publish_wandb_report(report, tmp_path / "out", project="p") is None

    # online, with a stand-in for wandb_workspaces so nothing leaves the machine
    monkeypatch.setenv("WANDB_MODE", "online")
    saved = []

    class _Block:
        def __init__(self, text=None):
            self.text = text

    class _Report:
        def __init__(self, **kwargs):
            self.kwargs, self.blocks, self.url = kwargs, [], "https://example.invalid/r"

        def save(self):
            saved.append(self)

    wr = types.SimpleNamespace(Report=_Report, H1=_Block, H2=_Block, P=_Block, MarkdownBlock=_Block)
    pkg = types.ModuleType("wandb_workspaces")
    reports = types.ModuleType("wandb_workspaces.reports")
    v2 = types.ModuleType("wandb_workspaces.reports.v2")
    v2.__dict__.update(vars(wr))
    pkg.reports, reports.v2 = reports, v2
    monkeypatch.setitem(sys.modules, "wandb_workspaces", pkg)
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports", reports)
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", v2)
    assert publish_wandb_report(report, tmp_path / "out", project="p", entity="e") == "https://example.invalid/r"
    assert saved[0].kwargs["project"] == "p" and saved[0].kwargs["entity"] == "e"
    texts = [blk.text for blk in saved[0].blocks]
    assert texts == ["Runs", "| Entry | WRIT |\n| :--- | ---: |\n| a | 3.00 / 1.50 |\n", "text", "sub", "[figure: x.png]"]

    def boom(self):
        raise ConnectionError("no network")

    monkeypatch.setattr(_Report, "save", boom)
    with pytest.warns(RuntimeWarning, match="no network"):
        assert publish_wandb_report(report, tmp_path / "out", project="p") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.delitem(sys.modules, "wandb_workspaces.reports.v2")
        monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", None)  # import now fails
        with pytest.raises(RuntimeWarning, match="not installed"):
            publish_wandb_report(report, tmp_path / "out", project="p")


def test_curves_all_plots_every_logged_metric(two_runs, tmp_path):
    a, b, t = two_runs
    out = tmp_path / "report"
    assert main([str(t), "--out", str(out), "--curves", "all"]) == 0
    assert sorted(p.name for p in out.glob("train_*.png")) == [
        "train_train_loss.png", "train_train_ploss_3.png", "train_val_simulated_tau.png"]


def test_curves_against_training_seconds(tmp_path, monkeypatch):
    """``--curve-x seconds`` draws each run against its training wall-clock: equal-time arms line up there."""
    import analysis.report as report

    drawn = {}
    monkeypatch.setattr(report, "plot_curves",
                        lambda series, key, path, x_label: drawn.setdefault(key, (series, x_label)) and path)
    fast = [{"step": s, "seconds": 2.0 * s, "val/simulated_tau": 1.0 + 0.1 * s} for s in range(4)]
    slow = [{"step": s, "seconds": 5.0 * s, "val/simulated_tau": 1.0 + 0.2 * s} for s in range(3)]
    t = write_sweep(tmp_path / "train", [make_record(label="A", kind="train", history=fast, run_name="a"),
                                         make_record(label="B", kind="train", history=slow, run_name="b")])
    assert main([str(t), "--out", str(tmp_path / "r"), "--curves", "val/simulated_tau", "--curve-x", "seconds"]) == 0
    series, x_label = drawn["val/simulated_tau"]
    assert x_label == "seconds"
    assert sorted(x for points in series.values() for x, _ in points) == [0.0, 0.0, 2.0, 4.0, 5.0, 6.0, 10.0]


def _answer(qid, category, accept_lengths, tps):
    tokens = sum(accept_lengths)
    return {"question_id": qid, "category": category, "answer_id": f"a{qid}", "model_id": "m", "tstamp": 0.0,
            "choices": [{"index": 0, "turns": ["x"], "decoding_steps": [len(accept_lengths)], "new_tokens": [tokens],
                         "wall_time": [tokens / tps], "accept_lengths": accept_lengths}]}


# Four writing (WRIT) and four coding (CODE) questions, four verify rounds each. The second run accepts one
# more token in two of the four rounds on every writing question (τ +0.5 on each) and, on coding, +0.5 and
# -0.5 on alternate questions; it is 10 % faster on writing and as fast on coding.
_EAGLE = [[2, 2, 2, 2], [2, 3, 3, 3], [3, 3, 3, 3], [2, 2, 3, 3], [3, 3, 3, 3], [2, 3, 3, 3], [3, 3, 4, 4], [2, 2, 3, 3]]
_STEP = [[1, 1, 0, 0], [-1, -1, 0, 0]]
_AR_TPS = [20.0, 30.0, 25.0, 40.0, 22.0, 35.0, 28.0, 31.0]
_EAGLE_TPS = [50.0, 66.0, 70.0, 90.0, 60.0, 70.0, 80.0, 75.0]


def _category(i):
    return "writing" if i < 4 else "coding"


def _eval_record(label, *, better: bool, drop: int | None = None, rows: bool = True) -> dict:
    method, ar = [], []
    for i, (accept, tps, ar_tps) in enumerate(zip(_EAGLE, _EAGLE_TPS, _AR_TPS)):
        if i == drop:
            continue
        if better:
            step = _STEP[0] if i < 4 or i % 2 == 0 else _STEP[1]
            accept, tps = [a + s for a, s in zip(accept, step)], tps * (1.1 if i < 4 else 1.0)
        method.append(_answer(i, _category(i), accept, tps))
        ar.append(_answer(i, _category(i), [1] * 10, ar_tps))
    m = speed_metrics(method, ar, min_questions=1)  # intervals on groups this small, to check their arithmetic
    record = make_record(label=label, cols=dict(m["columns"]) | {"AVG": m["AVG"]})
    if rows:
        record["eval"]["questions"] = m["questions"]
        record["eval"]["interval"] = m["interval"]
    return record


def test_deltas_carry_paired_intervals(tmp_path, monkeypatch):
    import analysis.report_model as report_model

    monkeypatch.setattr(report_model, "MIN_QUESTIONS", 4)  # the four-question columns here get intervals
    a = _single(tmp_path, "eagle", _eval_record("EAGLE-3", better=False))
    b = _single(tmp_path, "confu", _eval_record("ConFu", better=True))
    out = tmp_path / "report"
    assert main([str(a), str(b), "--out", str(out), "--format", "both"]) == 0
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    cells = dict(zip(["WRIT", "RP", "CODE", "EXT", "STEM", "HUM", "SUMM", "TRAN", "QA", "RAG", "M/R", "AVG"],
                     _table_rows(md, "Δ vs eagle")["confu"]))
    tau_writ, sr_writ = cells["WRIT"].split(" / ")
    # every writing question gains exactly 0.5: every resample of them does too
    assert tau_writ == "+0.50 [+0.50, +0.50] *"
    # coding: +0.5, -0.5, +0.5, -0.5 (equal rounds). A resample of four questions that are all -0.5
    # (or all +0.5) has probability 2 / 16 each way, more than 2.5 %, so the 95 % interval is [-0.5, +0.5]
    tau_code, sr_code = cells["CODE"].split(" / ")
    assert tau_code == "+0.00 [-0.50, +0.50]"
    # SR on writing: 10 % faster on every question, so every resample is better (the interval excludes 0)
    eagle_rows = _eval_record("x", better=False)["eval"]["questions"]
    confu_rows = _eval_record("x", better=True)["eval"]["questions"]
    writing = paired_difference([r for r in confu_rows if r["category"] == "writing"],
                                [r for r in eagle_rows if r["category"] == "writing"])["speedup"]
    lo, hi = writing["ci"]
    assert writing["diff"] > 0 and lo > 0
    assert sr_writ == f"{writing['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}] *"
    assert sr_code == "+0.00 [+0.00, +0.00]"  # the same speed on every coding question
    # AVG pools all eight questions: (4 x 2 + 2 - 2 + 2 - 2 accepted) / 32 rounds = +0.25
    assert cells["AVG"].split(" / ")[0].startswith("+0.25 [")
    assert cells["RAG"] == "– / –"  # no questions in that column
    note = "Brackets: 95% paired bootstrap interval of the difference"
    assert note in md and note in html and "Bare deltas" not in md
    # the values carry the evaluation's own intervals: WRIT of eagle τ 2.5625 over (2, 2.75, 3, 2.5)
    values = _table_rows(md, "Values")
    assert values["eagle"][0].startswith("2.56 [2.") and " / " in values["eagle"][0]
    assert "the evaluation's 95% bootstrap interval over questions" in md


def test_columns_with_too_few_questions_show_bare_deltas(tmp_path):
    # By default a column needs MIN_QUESTIONS questions: the four-question columns show the bare difference,
    # with no interval and no mark, while AVG (eight questions) keeps its interval.
    a = _single(tmp_path, "eagle", _eval_record("EAGLE-3", better=False))
    b = _single(tmp_path, "confu", _eval_record("ConFu", better=True))
    out = tmp_path / "report"
    assert main([str(a), str(b), "--out", str(out), "--format", "md"]) == 0
    md = (out / "report.md").read_text()
    cells = _table_rows(md, "Δ vs eagle")["confu"]
    assert MIN_QUESTIONS > 4 and cells[0].split(" / ")[0] == "+0.50"  # WRIT: bare, not "[+0.50, +0.50] *"
    assert cells[11].split(" / ")[0].startswith("+0.25 [")
    assert f"fewer than {MIN_QUESTIONS} questions shows the bare difference" in md


def test_deltas_without_rows_are_bare_with_a_note(tmp_path):
    a = _single(tmp_path, "eagle", _eval_record("EAGLE-3", better=False, rows=False))
    b = _single(tmp_path, "confu", _eval_record("ConFu", better=True))
    out = tmp_path / "report"
    assert main([str(a), str(b), "--out", str(out), "--format", "both"]) == 0
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    writ = _table_rows(md, "Δ vs eagle")["confu"][0]
    assert writ.startswith("+0.50 / +") and "[" not in writ
    note = "Bare deltas: intervals need records with per-question answers (eval.questions), which eagle lacks."
    assert note in md and note in html
    assert "paired bootstrap interval" not in md


def test_deltas_over_different_questions_are_bare(tmp_path):
    a = _single(tmp_path, "eagle", _eval_record("EAGLE-3", better=False))
    b = _single(tmp_path, "confu", _eval_record("ConFu", better=True, drop=5))
    out = tmp_path / "report"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "[" not in _table_rows(md, "Δ vs eagle")["confu"][0]
    assert ("No interval for confu: the runs answered different questions: 0 only in confu (none), "
            "1 only in eagle (5).") in md


def test_malformed_question_rows_are_a_one_line_error(tmp_path, capsys):
    bad = _eval_record("ConFu", better=True)
    bad["eval"]["questions"] = [{"question_id": 1}]
    a = _single(tmp_path, "eagle", _eval_record("EAGLE-3", better=False))
    b = _single(tmp_path, "confu", bad)
    assert main([str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "confu/record.json: 'eval.questions' must be a list of objects with keys question_id" in err
    assert len(err.splitlines()) == 1


def test_served_checks_are_plotted_beside_the_simulated_tau(tmp_path):
    """A run trained with callbacks=served_eval: one plot of the engine's tau and the simulated tau, and a
    table of the checks in which a failed check is listed (not plotted) with the simulated tau before it."""
    history = [{"step": s, "seconds": 10.0 * s, "train/loss": 3.0 - 0.1 * s} for s in range(1, 7)]
    history += [{"step": 2, "seconds": 20.0, "val/simulated_tau": 1.4}, {"step": 4, "seconds": 40.0, "val/simulated_tau": 1.8}]
    history += [{"step": 2, "seconds": 21.0, "served/tau": 1.3, "served/failed": 0, "served/acc_0": 0.3,
                 "served/startup_s": 95.0},
                {"step": 4, "seconds": 41.0, "served/failed": 1, "served/attempts": 3},
                {"step": 6, "seconds": 61.0, "served/tau": 1.7, "served/failed": 0, "served/acc_0": 0.6,
                 "served/reload_s": 2.5}]
    t = write_sweep(tmp_path / "train", [make_record(label="EAGLE-3", kind="train", history=history, run_name="a")])
    out = tmp_path / "report"
    assert main([str(t), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    png = out / "train_served_vs_simulated_tau.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in md
    section = md.split("Served vs simulated")[1].split("| Run | Best")[0]
    rows = [line for line in section.splitlines() if line.startswith("| train")]
    assert [r.split(" | ")[1:4] for r in rows] == [["2", "1.3", "1.4"], ["4", "FAILED", "1.8"], ["6", "1.7", "1.8"]]
