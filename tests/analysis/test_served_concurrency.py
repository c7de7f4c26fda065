"""``draftlab-table RECORD --layout served`` for served load runs (``eval.concurrency``): one row per (record, k,
concurrency), speed-ups with their [min, max] over repeats, τ and p50 latencies, notes saying what the bracket is."""

from __future__ import annotations

import json
from pathlib import Path

from analysis.results import load_records
from analysis.served_concurrency import concurrency_rows, is_concurrency, render_concurrency_markdown
from analysis.table import main
from draftlab.eval.served_load import speedups, summarise_level
from tests.analysis.synthetic import make_record, write_sweep


def _served_evaluation(label: str) -> dict:
    """A record of ``eval.engine=vllm`` (one chain of 2), the other thing the served layout prints."""
    rec = make_record(label=label, nodes=None)
    chain = {"n_prompts": 13, "num_speculative_tokens": 2, "engine": "vllm", "served": {"tau": 1.1},
             "draftlab": {"tau": 1.1}, "parity": {"gap": 0.0, "ci": [0.0, 0.0], "flagged": False},
             "identical_to_plain": 13, "same_tokens_as_draftlab": 13,
             "speed": {"served_speedup": 0.9, "draftlab_speedup": 0.5}}
    rec["eval"] = {"bench": "specbench", "method": "dflash", "label": label, "temperature": 0.0, "axes": {},
                   "served": [chain]}
    return rec


def _run(c: int, tps: float, *, drafted: bool, p50: float) -> dict:
    counters = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 8.0, "per_pos": [6.0, 2.0, 0.0]} if drafted else None
    return {"concurrency": c, "tps": tps, "latency_s": {"p50": p50, "p90": p50 * 2}, "request_tps": {"mean": tps / c},
            "in_flight": {"mean": float(c)}, "counters": counters}


def _record(tmp_path: Path, name: str, *, repeats: int, dirty: bool = False) -> Path:
    """A load record as experiments/serving/concurrency.py writes it: plain and k=3 at c = 1, 4, 16."""
    plain = {str(c): summarise_level([_run(c, 10.0 * c + i, drafted=False, p50=1.0 + c / 10) for i in range(repeats)])
             for c in (1, 4, 16)}
    k3 = {str(c): summarise_level([_run(c, 12.0 * c + 2 * i, drafted=True, p50=0.8 + c / 10) for i in range(repeats)])
          for c in (1, 4, 16)}
    rec = make_record(label="EAGLE-3", nodes=None, run_name=f"concurrency/{name}")
    rec["git"]["dirty"] = dirty
    rec["eval"] = {"bench": "specbench", "method": "eagle3", "label": "EAGLE-3", "temperature": 0.0, "axes": {},
                   "max_new_tokens": 64, "engine": "vllm",
                   "concurrency": {"levels": [1, 4, 16], "repeats": repeats, "n_prompts": 52, "max_tokens": 64,
                                   "temperature": 0.0, "draft_name": name,
                                   "machine": {"cpu_model": "Test CPU @ 2GHz", "cores": 2},
                                   "servers": {"plain": {"num_speculative_tokens": None, "levels": plain},
                                               "k3": {"num_speculative_tokens": 3, "levels": k3}},
                                   "speedups": {"k3": speedups(plain, k3)}}}
    path = tmp_path / f"concurrency_{name}.json"
    path.write_text(json.dumps(rec, indent=1))
    return path


def test_rows_per_k_and_level_with_speedup_range_tau_and_latency(tmp_path):
    records = load_records(_record(tmp_path, "quick", repeats=2))
    assert is_concurrency(records[0])
    rows = concurrency_rows(records)
    assert [r[3] for r in rows] == ["1", "4", "16"] and {r[2] for r in rows} == {"3"}
    one = rows[0]
    # plain runs 10, 11 (mean 10.5); draft 12, 14 (mean 13): 13 / 10.5, range [12/11, 14/10]
    assert one[:8] == ["EAGLE-3", "quick", "3", "1", "52", "2/2", "10.5", "13.0"]
    assert one[8] == f"{13 / 10.5:.2f} [{12 / 11:.2f}, {14 / 10:.2f}]"
    assert one[9] == "1.80" and one[10:] == ["1.10", "0.90"]


def test_one_run_per_level_has_no_range_and_a_dirty_tree_is_marked(tmp_path):
    records = load_records(_record(tmp_path, "once", repeats=1, dirty=True))
    rows = concurrency_rows(records)
    assert rows[1][8] == f"{48 / 40:.2f}" and "[" not in rows[1][8]
    assert rows[0][0] == "EAGLE-3†"
    text = render_concurrency_markdown(records)
    assert "uncommitted changes" in text and "Test CPU @ 2GHz, 2 cores" in text
    assert "not a confidence interval" in text


def test_draftlab_table_served_layout_prints_the_load_table(tmp_path, capsys):
    path = _record(tmp_path, "quick", repeats=2)
    assert main([str(path), "--layout", "served"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| Method | Draft | k | Concurrency |")
    assert sum(line.startswith("| EAGLE-3 | quick |") for line in out.splitlines()) == 3
    # the default layout has no columns for it and says which layout has
    assert main([str(path)]) == 2
    assert "--layout served" in capsys.readouterr().err


def test_served_evaluations_and_load_runs_print_one_table_each(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s", [_served_evaluation("DFlash")])
    load = _record(tmp_path, "quick", repeats=1)
    assert main([str(sweep), str(load), "--layout", "served"]) == 0
    out = capsys.readouterr().out
    assert "| Method | Setting | Engine |" in out and "| Method | Draft | k | Concurrency |" in out
    # a plain eval record beside a load run does not ask for the served-evaluation table
    plain = write_sweep(tmp_path / "p", [make_record(label="EAGLE-3")])
    assert main([str(plain), str(load), "--layout", "served"]) == 0
    out = capsys.readouterr().out
    assert "| Method | Setting | Engine |" not in out and "| EAGLE-3 | quick | 3 | 16 |" in out
