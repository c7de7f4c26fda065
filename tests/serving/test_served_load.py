"""Served throughput under load (``draftlab.eval.served_load``) and its experiment script
(``experiments/serving/concurrency.py``) against stand-in servers: requests in flight, each prompt answered once,
the tok/s and latency arithmetic, the spec-decode counter delta and τ, speed-ups, and resuming a sweep."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
from stub_load import LoadStub

from draftlab.eval import served_load
from draftlab.eval.served_load import (
    WARMUP_PROMPT,
    in_flight,
    measure_load,
    percentile,
    resume_sweep,
    settings_conflicts,
    speedups,
    summarise_level,
    summarise_run,
    sweep,
)
from draftlab.serving.stub import StubServer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"question {i}" for i in range(12)]


def _rounds(prompt: str) -> list[int]:
    """Accepted tokens per draft round of each prompt's answer (the warm-up gets rounds too: they must not count)."""
    if prompt == WARMUP_PROMPT:
        return [3, 3, 3, 3]
    i = int(prompt.split()[-1])
    return [i % 4, (i + 1) % 3][: 1 + i % 2]


@pytest.mark.parametrize("c", [1, 4, 12])
def test_c_requests_in_flight_and_every_prompt_answered_once(c):
    with LoadStub(delay=0.2) as stub:  # no plan: a plain server, with no spec-decode counters
        run = measure_load(stub.url, PROMPTS, c, max_tokens=64, model="stub")
        assert stub.max_in_flight == c  # the server saw c at once, never more
    assert Counter(stub.answered) == Counter(PROMPTS + [WARMUP_PROMPT])
    assert run["n_requests"] == len(PROMPTS) and run["concurrency"] == c
    assert run["in_flight"]["max"] == c  # as the client saw it
    assert run["in_flight"]["mean"] == pytest.approx(c, rel=0.35)
    waves = -(-len(PROMPTS) // c)
    assert run["wall_s"] >= 0.2 * waves
    tokens = sum(len("echo: " + p) for p in PROMPTS)
    assert run["output_tokens"] == tokens and run["tps"] == pytest.approx(tokens / run["wall_s"])
    assert run["counters"] == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": [0.0, 0.0, 0.0]}
    assert run["tau"] is None and run["position_rates"] == []
    assert run["finish_reasons"] == {"stop": len(PROMPTS)}


def test_more_in_flight_means_more_throughput_at_a_fixed_request_time():
    with StubServer(delay=0.1) as stub:
        one, four = (measure_load(stub.url, PROMPTS[:8], c, max_tokens=64, model="stub") for c in (1, 4))
    assert four["tps"] / one["tps"] > 2.5  # 8 waves against 2: ideally 4x
    assert one["latency_s"]["p50"] == pytest.approx(0.1, abs=0.05) and four["latency_s"]["p50"] < 0.2


def test_run_arithmetic_tokens_over_wall_percentiles_and_in_flight():
    requests = [{"output_tokens": 10, "prompt_tokens": 5, "latency_s": 1.0, "end_s": 1.0, "finish_reason": "stop"},
                {"output_tokens": 20, "prompt_tokens": 5, "latency_s": 2.0, "end_s": 2.0, "finish_reason": "length"},
                {"output_tokens": 30, "prompt_tokens": 5, "latency_s": 3.0, "end_s": 3.5, "finish_reason": "length"}]
    run = summarise_run(2, requests, 4.0, None)
    assert run["output_tokens"] == 60 and run["prompt_tokens"] == 15
    assert run["tps"] == pytest.approx(15.0)  # Σ tokens / wall, not the mean of per-request rates
    assert run["latency_s"] == {"p50": 2.0, "p90": pytest.approx(2.8), "mean": 2.0, "max": 3.0}
    assert run["request_tps"] == {"p50": 10.0, "mean": 10.0}
    assert run["in_flight"] == {"max": 3.0, "mean": pytest.approx(6.0 / 4.0)}  # spans (0,1) (0,2) (0.5,3.5)
    assert run["finish_reasons"] == {"stop": 1, "length": 2}
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5) and percentile([], 50) is None
    # back to back is not overlapping
    assert in_flight([(0.0, 1.0), (1.0, 2.0)], 2.0) == {"max": 1.0, "mean": 1.0}


def test_counter_delta_over_the_batch_gives_tau_and_position_rates():
    # earlier traffic, a warm-up with rounds of its own, and counters recorded after the answer (lag)
    with LoadStub(k=3, plan=_rounds, lag=0.05, start_counts=(100, 90), delay=0.02) as stub:
        run = measure_load(stub.url, PROMPTS, 4, max_tokens=64, model="stub", settle=0.15)
    everything = [a for p in PROMPTS for a in _rounds(p)]
    assert run["counters"]["drafts"] == len(everything)
    assert run["counters"]["accepted"] == sum(everything)
    assert run["counters"]["draft_tokens"] == 3 * len(everything)
    assert run["tau"] == pytest.approx(1 + sum(everything) / len(everything))
    assert run["position_rates"] == pytest.approx([sum(a > i for a in everything) / len(everything) for i in range(3)])


def _run(c: int, tps: float, *, counters: dict | None = None, p50: float = 1.0) -> dict:
    return {"concurrency": c, "tps": tps, "latency_s": {"p50": p50, "p90": 2 * p50}, "request_tps": {"mean": tps / c},
            "in_flight": {"mean": float(c)}, "counters": counters}


def test_levels_pool_repeats_and_speedups_are_ratios_with_a_pairwise_range():
    spec = {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 5.0, "per_pos": [4.0, 1.0, 0.0]}
    plain = {"1": summarise_level([_run(1, 10.0), _run(1, 12.0)]),
             "4": summarise_level([_run(4, 30.0, p50=2.0)])}
    draft = {"1": summarise_level([_run(1, 15.0, counters=spec), _run(1, 18.0, counters=spec)]),
             "4": summarise_level([_run(4, 24.0, counters=spec, p50=3.0)]),
             "16": summarise_level([_run(16, 50.0, counters=spec)])}
    assert plain["1"]["tps"] == 11.0 and (plain["1"]["tps_min"], plain["1"]["tps_max"]) == (10.0, 12.0)
    assert draft["1"]["counters"]["drafts"] == 20.0 and draft["1"]["tau"] == pytest.approx(1.5)
    assert draft["1"]["position_rates"] == pytest.approx([0.4, 0.1, 0.0])
    rows = speedups(plain, draft)
    assert [r["concurrency"] for r in rows] == [1, 4]  # 16: no plain level to compare with
    one, four = rows
    assert one["speedup"] == pytest.approx(16.5 / 11.0)
    assert one["interval"] == pytest.approx([15.0 / 12.0, 18.0 / 10.0]) and "2x2 pairs" in one["interval_over"]
    assert four["speedup"] == pytest.approx(0.8) and four["interval"] is None and four["interval_over"] is None
    assert (four["plain_latency_p50_s"], four["draft_latency_p50_s"]) == (2.0, 3.0)
    assert four["tau"] == pytest.approx(1.5) and four["repeats"] == {"plain": 1, "draft": 1}


def test_compare_servers_measures_both_sides_at_each_level():
    with StubServer(delay=0.03) as plain, LoadStub(k=3, plan=_rounds, delay=0.03) as draft:
        out = served_load.compare_servers(plain.url, draft.url, PROMPTS[:6], [1, 3], max_tokens=64, model="stub")
    assert plain.max_in_flight == draft.max_in_flight == 3
    assert [r["concurrency"] for r in out["speedups"]] == [1, 3]
    everything = [a for p in PROMPTS[:6] for a in _rounds(p)]
    for row in out["speedups"]:
        c = str(row["concurrency"])
        assert row["speedup"] == pytest.approx(out["draft"][c]["tps"] / out["plain"][c]["tps"])
        assert row["tau"] == pytest.approx(1 + sum(everything) / len(everything))
    assert out["plain"]["1"]["tau"] is None


def test_resume_skips_levels_already_measured_and_starts_no_server_when_all_are():
    servers: dict = {}
    starts, saves = [], []
    with LoadStub(k=3, plan=_rounds, delay=0.05) as stub:
        @contextlib.contextmanager
        def start():
            starts.append(1)
            yield stub.url

        def save():
            saves.append(json.loads(json.dumps(servers)))  # what a record written now would hold

        resume_sweep(servers, "k3", start, PROMPTS[:4], [1, 2], save=save, max_tokens=16, model="stub")
        assert (len(starts), len(saves), stub.requests) == (1, 2, 2 * 5)  # 4 prompts + a warm-up per level
        assert list(saves[0]["k3"]["levels"]) == ["1"]  # saved after each level
        resume_sweep(servers, "k3", start, PROMPTS[:4], [1, 2, 4], save=save, max_tokens=16, model="stub")
        assert (len(starts), stub.requests) == (2, 3 * 5)  # only c=4 was asked
        assert stub.max_in_flight == 4

        def never():
            raise AssertionError("a server was started with every level measured")

        resume_sweep(servers, "k3", never, PROMPTS[:4], [4, 1], save=save, max_tokens=16, model="stub")
        assert stub.requests == 3 * 5
    assert sorted(servers["k3"]["levels"], key=int) == ["1", "2", "4"]
    assert sweep("http://unused", PROMPTS, [1], done=servers["k3"]["levels"]) == servers["k3"]["levels"]


def test_settings_conflicts_name_each_difference():
    assert settings_conflicts({"a": 1, "b": 2}, {"a": 1, "b": 3}, ["a", "b"]) == ["b: 2 -> 3"]
    assert settings_conflicts({"a": 1}, {"a": 1, "c": 9}, ["a"]) == []


# -- the experiment script, with running stand-ins in place of vLLM ---------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("concurrency_script", ROOT / "experiments/serving/concurrency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_writes_a_record_resumes_it_and_refuses_other_settings(tmp_path, monkeypatch, capsys):
    from analysis.table import main as table_main

    monkeypatch.chdir(ROOT)  # paths.shared_data is relative to the repository
    script, out = _script(), tmp_path / "concurrency_stub.json"
    with StubServer(delay=0.1) as plain, LoadStub(k=3, plan=lambda p: [1, 0], delay=0.1) as draft:
        argv = ["--plain-url", plain.url, "--draft-url", draft.url, "--per-category", "1", "--prompts", "5",
                "--max-tokens", "16", "--levels", "1", "2", "--name", "stub", "--out", str(out),
                "--work", str(tmp_path / "work")]
        assert script.main(argv) == 0
        asked = (plain.requests, draft.requests)
        assert asked == (2 * 6, 2 * 6)
        record = json.loads(out.read_text())
        assert script.main([*argv[:-6], "--levels", "1", "2", "4", *argv[-6:]]) == 0  # only c=4 is new
        assert (plain.requests, draft.requests) == (3 * 6, 3 * 6) and draft.max_in_flight == 4
        with pytest.raises(SystemExit, match="max_tokens: 16 -> 8"):
            script.main([*argv, "--max-tokens", "8"])
    block = record["eval"]["concurrency"]
    assert record["schema"] == "draftlab.record/1" and record["kind"] == "eval"
    assert set(record["git"]) == {"commit", "dirty"} and block["machine"]["cores"] >= 1
    assert record["config"]["prompts"] == 5 and block["n_prompts"] == 5
    assert [r["concurrency"] for r in block["speedups"]["k3"]] == [1, 2]
    assert block["speedups"]["k3"][0]["tau"] == pytest.approx(1.5)
    assert record["metrics"]["served_load/k3/c2/tau"] == pytest.approx(1.5)
    again = json.loads(out.read_text())["eval"]["concurrency"]
    assert again["servers"]["plain"]["levels"]["1"] == block["servers"]["plain"]["levels"]["1"]  # kept, not redone
    assert "| stub | 3 | 4 |" in out.with_suffix(".md").read_text()
    capsys.readouterr()
    assert table_main([str(out), "--layout", "served"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "| stub |" in line]
    assert [r.split(" | ")[3] for r in rows] == ["1", "2", "4"]


def test_script_launches_plain_then_one_server_per_chain_length(tmp_path, monkeypatch):
    """The launch path with a stand-in for vLLM's interpreter: it reads the port from the vLLM command line and
    serves the stub there, so the commands, start-ups and logs can be checked without vLLM."""
    import stat
    import sys

    monkeypatch.chdir(ROOT)
    fake = tmp_path / "fake_vllm_python"
    fake.write_text("#!/bin/bash\n"
                    'while [ $# -gt 0 ]; do [ "$1" = --port ] && port=$2; shift; done\n'
                    f'exec {sys.executable} -m draftlab.serving.stub --port "$port"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out, work = tmp_path / "concurrency_fake.json", tmp_path / "work"
    (tmp_path / "export").mkdir()
    argv = ["--export", str(tmp_path / "export"), "--model", str(tmp_path / "model"), "--python", str(fake),
            "--num-speculative-tokens", "1", "2", "--levels", "1", "2", "--per-category", "1", "--prompts", "3",
            "--max-tokens", "8", "--enforce-eager", "--name", "fake", "--out", str(out), "--work", str(work)]
    assert _script().main(argv) == 0
    servers = json.loads(out.read_text())["eval"]["concurrency"]["servers"]
    assert list(servers) == ["plain", "k1", "k2"]
    for name, k in (("plain", None), ("k1", 1), ("k2", 2)):
        (start,) = servers[name]["startups"]
        cmd = start["cmd"]
        assert cmd[0] == str(fake) and "--enforce-eager" in cmd and cmd[cmd.index("--model") + 1] == str(tmp_path / "model")
        if k is None:
            assert "--speculative-config" not in cmd
        else:
            assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
                "method": "eagle3", "model": str(tmp_path / "export"), "num_speculative_tokens": k}
        assert start["startup_s"] > 0 and Path(start["log"]).is_file() and start["log"].startswith(str(work))
        assert sorted(servers[name]["levels"], key=int) == ["1", "2"]
    assert _script().main(argv) == 0  # everything measured: no server starts again
    assert all(len(s["startups"]) == 1 for s in json.loads(out.read_text())["eval"]["concurrency"]["servers"].values())
