"""Finished evaluations are reused by content (``draftlab.eval.reuse``): the key, the store, a job run twice,
and a multirun killed between jobs and run again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftlab.eval import content, reuse
from tests.test_configs import _compose

ENV = {"python": "3", "torch": "2", "transformers": "4", "accelerator": "cpu"}  # a fixed machine for key tests
# A training-free method on the 2-layer random target, one question of a few tokens.
EVAL = ["experiment=tiny_base", "method=prompt_lookup", "logger=csv", "bench.limit=1", "eval.max_new_tokens=8"]


def _key(tmp_path, *overrides, sha=None, code="c0", trained=None, run="run"):
    cfg = _compose([*EVAL, f"paths.artifacts={tmp_path / 'art'}", *overrides], tmp_path / run, "eval")
    return reuse.eval_key(cfg, draft_sha=sha, code=code, trained=trained, env=ENV)


# --- the key ---------------------------------------------------------------------------------------------------

def test_key_follows_what_is_measured(tmp_path):
    base = _key(tmp_path)
    assert base == _key(tmp_path)
    changed = [_key(tmp_path, "eval.temperature=0.7"), _key(tmp_path, "seed=1"), _key(tmp_path, "bench.limit=2"),
               _key(tmp_path, "method.drafter.nodes=3"), _key(tmp_path, "eval.max_new_tokens=9"),
               _key(tmp_path, "target.device=meta"), _key(tmp_path, sha="a" * 64), _key(tmp_path, code="c1"),
               _key(tmp_path, trained={"module": {"ttt_length": 3}})]
    assert base not in changed and len(set(changed)) == len(changed)
    other_machine = reuse.eval_key(_compose([*EVAL, f"paths.artifacts={tmp_path / 'art'}"], tmp_path, "eval"),
                                   draft_sha=None, code="c0", env={**ENV, "accelerator": "another"})
    assert other_machine != base


def test_key_ignores_where_and_how_a_job_runs(tmp_path):
    base = _key(tmp_path)
    same = [_key(tmp_path, run="elsewhere"), _key(tmp_path, "logger=wandb"), _key(tmp_path, "wandb.group=g"),
            _key(tmp_path, f"paths.log_dir={tmp_path / 'logs'}"), _key(tmp_path, "train.checkpoint_every_n_steps=7"),
            _key(tmp_path, "eval.reuse=false"), _key(tmp_path, "draft_path=/drafts/x"),
            # Settings only training reads: a draft they change enters the key by its weights.
            _key(tmp_path, "data.sources.sharegpt.limit=3"), _key(tmp_path, "trainer.max_steps=5")]
    assert set(same) == {base}
    # The store's place is not part of what is measured either.
    cfg = _compose([*EVAL, f"paths.artifacts={tmp_path / 'other'}"], tmp_path / "run", "eval")
    assert reuse.eval_key(cfg, draft_sha=None, code="c0", env=ENV) == base


def test_key_follows_the_question_file_and_the_target_weights_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(content, "_CACHE", None)
    questions = tmp_path / "questions.jsonl"
    original = '{"question_id": 1, "category": "writing", "turns": ["Write a haiku."]}\n'
    questions.write_text(original)
    weights = tmp_path / "target"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\0" * 64)
    where = [f"bench.path={questions}", f"target.source={weights}"]
    base = _key(tmp_path, *where)
    questions.write_text(original.replace("haiku", "limerick"))  # edited in place: same path, same config
    edited = _key(tmp_path, *where)
    (weights / "model.safetensors").write_bytes(b"\1" * 64)  # weights replaced under the same path
    replaced = _key(tmp_path, *where)
    assert len({base, edited, replaced}) == 3
    questions.write_text(original)
    (weights / "model.safetensors").write_bytes(b"\0" * 64)
    assert _key(tmp_path, *where) == base  # content, not history


def test_a_file_is_hashed_once_while_its_size_and_time_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(content, "_CACHE", None)
    reads = []
    monkeypatch.setattr(content, "sha256_file", lambda p: reads.append(p) or "d" * 64)
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc")
    assert content.file_digest(f) == content.file_digest(f) and len(reads) == 1
    monkeypatch.setattr(content, "_CACHE", None)  # a new process reads the kept digests
    content.file_digest(f)
    assert len(reads) == 1
    f.write_bytes(b"abcd")
    content.file_digest(f)
    assert len(reads) == 2


def test_source_version_changes_with_any_source_edit(tmp_path):
    src = tmp_path / "pkg"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "sub" / "b.py").write_text("y = 2\n")
    first = reuse.source_version(src)
    (src / "notes.txt").write_text("not code")
    assert reuse.source_version(src) == first
    (src / "sub" / "b.py").write_text("y = 3\n")
    edited = reuse.source_version(src)
    assert edited != first
    (src / "sub" / "b.py").rename(src / "sub" / "c.py")
    assert reuse.source_version(src) not in (first, edited)
    assert len(reuse.source_version()) == 64  # the installed package, no git needed


# --- the store -------------------------------------------------------------------------------------------------

def _finished_run(run: Path) -> tuple[dict, dict]:
    (run / "answers").mkdir(parents=True)
    (run / "answers" / "m.jsonl").write_text('{"a": 1}\n')
    (run / "eval_table.txt").write_text("table\n")
    record = {"answer_files": {"m": str(run / "answers" / "m.jsonl")}, "export": str(run / "served" / "draft"),
              "columns": {"AVG": {"tau": 1.5}}}
    return record, {"eval/b/AVG/tau": 1.5}


def test_a_kept_evaluation_comes_back_into_another_run_dir(tmp_path):
    record, metrics = _finished_run(tmp_path / "first")
    entry = reuse.store(tmp_path / "art" / "eval" / "k1", "k1", {"p": 1}, tmp_path / "first", record, metrics)
    stored = reuse.load(entry, "k1")
    assert stored is not None and stored.run_dir == str(tmp_path / "first")
    new_record, new_metrics = reuse.bring(stored, tmp_path / "second")
    assert new_metrics == metrics
    # Paths into the copied files name the copies; others keep naming where they were written.
    assert new_record["answer_files"]["m"] == str(tmp_path / "second" / "answers" / "m.jsonl")
    assert new_record["export"] == record["export"] and new_record["columns"] == record["columns"]
    assert (tmp_path / "second" / "answers" / "m.jsonl").read_text() == '{"a": 1}\n'
    assert (tmp_path / "second" / "eval_table.txt").read_text() == "table\n"
    assert reuse.load(entry, "another-key") is None


def test_an_unfinished_entry_is_never_reused(tmp_path, monkeypatch):
    record, metrics = _finished_run(tmp_path / "run")
    entry = reuse.store(tmp_path / "eval" / "k", "k", {}, tmp_path / "run", record, metrics)
    (entry / "complete.json").unlink()  # everything but the marker
    assert reuse.load(entry, "k") is None
    # A crash while the entry is written leaves no entry at all, only nothing or a hidden temporary.
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(reuse.shutil, "copy2", crash)
    with pytest.raises(OSError):
        reuse.store(tmp_path / "eval" / "k2", "k2", {}, tmp_path / "run", record, metrics)
    assert not (tmp_path / "eval" / "k2").exists() and reuse.load(tmp_path / "eval" / "k2", "k2") is None
    assert not [p for p in (tmp_path / "eval").iterdir() if not p.name.startswith(".") and p.name != "k"]


# --- jobs run again --------------------------------------------------------------------------------------------

@pytest.fixture
def counted(monkeypatch, shared_data):
    """Calls of the evaluation stage, and the package's log lines."""
    import draftlab.stages.evaluate as stage

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    calls = []
    real = stage.evaluate
    monkeypatch.setattr(stage, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("draftlab").addHandler(handler)
    yield calls, lines
    logging.getLogger("draftlab").removeHandler(handler)


def _moved(obj, old: Path, new: Path):
    return json.loads(json.dumps(obj).replace(str(old), str(new)))


def test_the_same_job_twice_evaluates_once(tmp_path, counted):
    from draftlab.stages.pipeline import run_pipeline

    calls, lines = counted
    art = f"paths.artifacts={tmp_path / 'art'}"

    def job(run: str, *extra):
        return run_pipeline(_compose([*EVAL, art, *extra], tmp_path / run, "eval"), stage="eval")

    first = job("a")
    assert len(calls) == 1 and first["eval_reuse"]["reused_from"] is None
    key = first["eval_reuse"]["key"]
    second = job("b")
    assert len(calls) == 1
    entry = tmp_path / "art" / "eval" / key
    assert f"eval reused: {key} from {entry} (eval.reuse=false to run it again)" in lines
    assert second["eval_reuse"]["reused_from"] == str(entry)
    assert second["eval_reuse"]["measured_in"] == str(tmp_path / "a")
    assert second["eval"] == _moved(first["eval"], tmp_path / "a", tmp_path / "b")
    assert second["metrics"] == first["metrics"]
    assert json.loads((tmp_path / "b" / "record.json").read_text())["eval"] == second["eval"]
    for name in ("eval_table.txt", *(f"answers/{p.name}" for p in (tmp_path / "a" / "answers").iterdir())):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name
    assert all(Path(f).parent == tmp_path / "b" / "answers" for f in second["eval"]["answer_files"].values())

    forced = job("c", "eval.reuse=false")
    assert len(calls) == 2 and forced["eval_reuse"]["reused_from"] is None
    assert forced["eval_reuse"]["key"] == key
    job("d", "eval.max_new_tokens=6")  # another measured setting: another key
    assert len(calls) == 3
    (entry / "complete.json").unlink()  # an entry without its marker is not reused
    job("e")
    assert len(calls) == 4 and (entry / "complete.json").exists()


def test_a_trained_draft_is_reused_with_its_evaluation(tmp_path, counted):
    from draftlab.stages.pipeline import run_pipeline

    calls, lines = counted
    train = ["experiment=tiny", "logger=csv", "regen.enabled=false", "data.sources.sharegpt.limit=4",
             "trainer.max_epochs=1", "trainer.max_steps=2", "trainer.precision=32-true", "bench.limit=1",
             "eval.max_new_tokens=8", "train.checkpoint_every_n_steps=0", f"paths.artifacts={tmp_path / 'art'}"]
    first = run_pipeline(_compose(train, tmp_path / "a", "train"), stage="train")
    second = run_pipeline(_compose(train, tmp_path / "b", "train"), stage="train")
    assert len(calls) == 1 and second["train"]["reused"] is True
    assert second["draft"]["sha256"] == first["draft"]["sha256"]
    assert second["eval_reuse"]["reused_from"] and second["eval_reuse"]["key"] == first["eval_reuse"]["key"]
    assert second["eval"] == _moved(first["eval"], tmp_path / "a", tmp_path / "b")
    # The same draft given by place (draft_path), evaluated with the same settings: reused too.
    draft = first["artifacts"]["draft"]
    again = run_pipeline(_compose([*train, f"draft_path={draft}"], tmp_path / "c", "train"), stage="eval")
    assert len(calls) == 1 and again["eval_reuse"]["key"] == first["eval_reuse"]["key"]


# --- a sweep killed between jobs -------------------------------------------------------------------------------

def _sweep_args(sweep: Path, tmp: Path) -> list[str]:
    # The third job writes many more tokens, so the sweep can be killed while it runs.
    return [sys.executable, "-m", "draftlab.cli.eval", "-m", *EVAL[:-1], "eval.max_new_tokens=6,8,384",
            f"hydra.sweep.dir={sweep}", f"paths.log_dir={tmp}", f"paths.artifacts={tmp / 'art'}"]


def _table(tmp: Path, *paths: Path) -> str:
    from analysis.table import main

    out = tmp / f"table-{len(list(tmp.glob('table-*')))}.md"
    assert main([*map(str, paths), "--layout", "methods", "--out", str(out)]) == 0
    return out.read_text()


def test_a_killed_sweep_run_again_evaluates_only_its_missing_job(tmp_path, shared_data):
    env = {**os.environ, "DRAFTLAB_SHARED_DATA": str(shared_data), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    first, second = tmp_path / "first", tmp_path / "second"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(_sweep_args(first, tmp_path), cwd=tmp_path, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 120
        while not (first / "1" / "record.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (first / "1" / "record.json").exists(), (tmp_path / "first.log").read_text()[-3000:]
    assert not (first / "2" / "record.json").exists(), "the sweep finished before it could be killed"
    assert len(list((tmp_path / "art" / "eval").glob("*/complete.json"))) == 2  # job 2 left nothing finished

    rerun = subprocess.run(_sweep_args(second, tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-3000:]
    assert out.count("eval reused: ") == 2 and out.count("outputs differing from AR") == 1, out[-3000:]
    records = [json.loads((second / str(i) / "record.json").read_text()) for i in range(3)]
    assert [r["eval_reuse"]["measured_in"] for r in records[:2]] == [str(first / "0"), str(first / "1")]
    assert records[2]["eval_reuse"]["reused_from"] is None
    # The re-run's table is the finished jobs' table: the first sweep's two jobs and the one fresh job.
    assert _table(tmp_path, second) == _table(tmp_path, first / "0", first / "1", second / "2")
    shutil.rmtree(first)  # the kept evaluations stand on their own
    third = subprocess.run(_sweep_args(tmp_path / "third", tmp_path), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 0 and (third.stdout + third.stderr).count("eval reused: ") == 3
    assert _table(tmp_path, tmp_path / "third") == _table(tmp_path, second)
