"""A 2x2x2 Hydra multirun end to end (tiny target): records, W&B offline runs, reuse, and the table."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.wandb_files import read_run

REPO = Path(__file__).resolve().parents[1]

# One worker runs the module: its sweep fixture (eight jobs in a subprocess) would otherwise run once per worker.
pytestmark = pytest.mark.xdist_group("sweep")


def _run(args: list[str], tmp_path: Path, shared_data: Path, check: bool = True) -> subprocess.CompletedProcess:
    # Artifacts (data, features, drafts) go to the test's directory via paths.artifacts; assets (the
    # tokenizer) stay in the shared cache.
    env = {**os.environ, "DRAFTLAB_SHARED_DATA": str(shared_data),
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 or not check, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def _records(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/record.json"))]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_data):
    tmp = tmp_path_factory.mktemp("sweep")
    first = tmp / "ttt_x_temp_x_nodes"
    _run(["-m", "draftlab.cli.train", "-m", "experiment=tiny", "method.module.ttt_length=1,2", "eval.temperature=0,0.7",
          "method.drafter.nodes=4,8", f"hydra.sweep.dir={first}", f"paths.log_dir={tmp}", f"paths.artifacts={tmp / 'artifacts'}"], tmp, shared_data)
    return tmp, first


# The sweep's three axes, as config paths, and the values the command line gives each.
SWEPT = {"method.module.ttt_length": (1, 2), "eval.temperature": (0, 0.7), "method.drafter.nodes": (4, 8)}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _answers(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_every_job_trains_or_reuses_once_and_writes_a_record(sweep):
    _, first = sweep
    jobs = sorted((p for p in first.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    records = [json.loads((job / "record.json").read_text()) for job in jobs]
    assert len(records) == 8
    # The jobs' configs differ in the swept settings and nowhere else (job directories aside), and together
    # they hold each combination once.
    configs = [{k: v.replace(str(job), "<job>") if isinstance(v, str) else v for k, v in _flat(r["config"]).items()}
               for job, r in zip(jobs, records)]
    varying = {k for k in set().union(*configs) if len({json.dumps(c.get(k)) for c in configs}) > 1}
    assert varying == set(SWEPT)
    assert sorted(tuple(c[k] for k in SWEPT) for c in configs) == sorted(itertools.product(*SWEPT.values()))
    # Two TTT lengths -> two trained drafts; the other six jobs reuse the one trained with their length.
    trained = [r for r in records if not r["train"]["reused"]]
    assert sorted(r["config"]["method"]["module"]["ttt_length"] for r in trained) == [1, 2]
    keys = {}
    for r in records:
        keys.setdefault(r["config"]["method"]["module"]["ttt_length"], set()).add(
            (r["artifacts"]["train_key"], r["draft"]["sha256"]))
    assert all(len(k) == 1 for k in keys.values()) and keys[1] != keys[2]
    for job, r, c in zip(jobs, records, configs):
        assert r["schema"] == "draftlab.record/1" and r["kind"] == "train"
        assert r["git"]["commit"] and r["hardware"]["cpu_count"]
        e = r["eval"]
        # The job evaluated with its own settings ...
        assert e["temperature"] == c["eval.temperature"] and e["axes"]["nodes"] == c["method.drafter.nodes"]
        assert e["axes"]["ttt_length"] == c["method.module.ttt_length"]
        # ... into its own answer files, from which its tau and accept-length histogram are recomputed: the
        # mean of the pooled per-round accept lengths (bonus included), as Spec-Bench's speed.py defines it.
        files = e["answer_files"]
        assert {Path(f).parent for f in files.values()} == {job / "answers"}
        method, base = _answers(files["eagle3"]), _answers(files["ar"])
        lengths = [a for ans in method for a in ans["choices"][0]["accept_lengths"]]
        assert e["columns"]["AVG"]["tau"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
        assert e["accept_lengths"] == {str(k): v for k, v in sorted(Counter(lengths).items())}
        for ans in method + base:  # each turn: the prefill's token plus what its rounds committed
            ch = ans["choices"][0]
            assert sum(ch["accept_lengths"]) == sum(ch["new_tokens"]) - len(ch["turns"])
            assert len(ch["accept_lengths"]) == sum(ch["decoding_steps"])
        assert all(a == 1 for ans in base for a in ans["choices"][0]["accept_lengths"])  # vanilla decoding
        if e["temperature"] == 0:  # lossless at T=0: the same text as the AR baseline, question by question
            assert e["mismatches_vs_ar"] == 0
            assert [a["choices"][0]["turns"] for a in method] == [a["choices"][0]["turns"] for a in base]


def test_each_job_is_its_own_wandb_run_grouped_by_sweep(sweep):
    _, first = sweep
    runs = []
    for job in sorted(p for p in first.iterdir() if p.is_dir() and p.name.isdigit()):
        files = list(job.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, f"job {job.name}: {files}"
        runs.append(read_run(files[0]))
    assert len(runs) == 8
    assert len({r["name"] for r in runs}) == 8
    assert {r["group"] for r in runs} == {f"tiny/{first.name}"}
    for r in runs:
        assert r["name"].startswith("eagle3-tiny_random-mtbench-")
        assert "method:eagle3" in r["tags"] and "experiment:tiny" in r["tags"]
        assert {"eval/mt_bench/AVG/tau", "eval/mt_bench/AVG/speedup", "eval/mt_bench/WRIT/tau"} <= r["history_keys"]
        assert {"train", "eval", "method"} <= r["config_keys"]
    trained = [r for r in runs if any(k.startswith("train/acc_") for k in r["history_keys"])]
    assert len(trained) == 2  # training curves only where training ran


def test_second_eval_sweep_trains_nothing_and_table_regenerates(sweep, shared_data):
    tmp, first = sweep
    second = tmp / "nodes6"
    proc = _run(["-m", "draftlab.cli.train", "-m", "experiment=tiny", "method.module.ttt_length=1,2", "method.drafter.nodes=6",
                 f"hydra.sweep.dir={second}", f"paths.log_dir={tmp}", f"paths.artifacts={tmp / 'artifacts'}"], tmp, shared_data)
    records = _records(second)
    assert len(records) == 2 and all(r["train"]["reused"] for r in records)
    assert "reusing trained draft" in proc.stderr + proc.stdout
    assert "Epoch 0" not in proc.stderr + proc.stdout

    # table1 has no TTT column: over a sweep of two TTT lengths it refuses rather than averaging them ...
    pooled = _run(["-m", "analysis.table", str(first), "--layout", "table1"], tmp, shared_data, check=False)
    assert pooled.returncode != 0 and "ttt_length" in pooled.stderr, pooled.stderr
    # ... and shows one of them when asked
    out = _run(["-m", "analysis.table", str(first), "--layout", "table1", "--ttt-length", "2", "--format", "markdown"],
               tmp, shared_data)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("|")]
    # header + separator + one row per (nodes, T) setting of the sweep, each with the EAGLE-3 label
    assert sum("EAGLE-3" in ln for ln in lines) >= 4, out.stdout
    assert "WRIT" in out.stdout and "AVG" in out.stdout
    t6 = _run(["-m", "analysis.table", str(first), "--layout", "table6", "--format", "latex"], tmp, shared_data)
    assert "\\textbf" in t6.stdout or "\\begin{tabular}" in t6.stdout
