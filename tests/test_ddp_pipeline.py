"""``draftlab-train`` on 2 gloo processes (trainer=ddp on CPU), end to end on the tiny target.

Lightning's ``ddp`` launcher re-runs the command for rank 1 from the top, so every stage runs on both ranks:
the data stage, feature extraction, training, the draft artifact, evaluation and the record. Rank 0 alone must
regenerate, extract features, write the draft and the record, and evaluate; rank 1 waits and loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("ddp_pipeline")  # two processes of its own: not beside other heavy tests

# Lines each stage logs once per process that runs it (the processes share the test's stderr).
REGEN_REPORT = "regeneration: 8 input"
FEATURES = "target features"
DRAFT_SAVED = "trained draft saved to"
RECORD = "run record:"


def _run(tmp_path: Path, shared_data: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTLAB_SHARED_DATA": str(shared_data), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "DRAFTLAB_RUN_TOKEN"):
        env.pop(var, None)  # this test's own launch, not one inherited from a surrounding job
    args = [sys.executable, "-m", "draftlab.cli.train", "experiment=tiny", "trainer=ddp", "trainer.accelerator=cpu",
            "trainer.devices=2", "logger=csv", "bench.limit=1", "eval.max_new_tokens=8", "trainer.max_epochs=1",
            f"hydra.run.dir={tmp_path / 'run'}", f"paths.log_dir={tmp_path}",
            f"paths.artifacts={tmp_path / 'artifacts'}", *overrides]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_ddp_train_on_two_processes_does_each_job_once(tmp_path, shared_data):
    proc = _run(tmp_path, shared_data)
    out = proc.stdout + proc.stderr
    # Lightning's rank 0 does not wait for rank 1's exit status: its failure shows only in the output.
    assert proc.returncode == 0 and "Traceback" not in out, out[-6000:]
    # Both ranks took part in training (Lightning reports the world it set up).
    assert "distributed_backend=gloo" in out and "All distributed processes registered" in out, out[-4000:]
    # One regeneration: rank 1 loads rank 0's conversations instead of resuming (and so re-trying) them.
    assert out.count(REGEN_REPORT) == 1, out[-6000:]
    regen = list((tmp_path / "artifacts" / "regen").glob("*/regenerated.jsonl"))
    ids = [json.loads(line)["id"] for line in regen[0].read_text().splitlines()] if len(regen) == 1 else []
    assert ids and len(set(ids)) == len(ids), "a conversation regenerated twice"
    # One writer for the draft, the record and the evaluation.
    assert out.count(DRAFT_SAVED) == 1 and out.count(RECORD) == 1, out[-6000:]
    drafts = list((tmp_path / "artifacts").glob("*/*/draft"))
    assert len(drafts) == 1 and not list(drafts[0].parent.glob(".draft.*")), "a draft written twice"
    summary = json.loads((drafts[0].parent / "train_summary.json").read_text())
    assert summary["history"], "no training curve in the summary"
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["train"]["reused"] is False and record["artifacts"]["draft"] == str(drafts[0])
    assert record["eval"]["mismatches_vs_ar"] == 0
    answers = list((tmp_path / "run" / "answers").glob("*.jsonl"))
    assert answers and all(len(p.read_text().splitlines()) == 1 for p in answers), "answers written twice"
