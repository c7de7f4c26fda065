"""Served checks during training (``callbacks=served_eval``, ``draftlab.eval.served_callback``) against stand-in
engines with spec-decode counters: served τ logged beside the simulated τ, into the history the report reads and
a CSV; a server killed mid-run costs checks, never the training; a dead or altered warm server is relaunched."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from stub_metrics import SpecStub

from draftlab.eval.served_callback import ServedEval

TRAIN = ["experiment=tiny", "logger=csv", "trainer.max_epochs=3", "bench.limit=3", "callbacks=served_eval",
         "callbacks.served_eval.every_n_steps=2", "callbacks.served_eval.prompts=2",
         "callbacks.served_eval.max_tokens=8", "callbacks.served_eval.retries=1", "callbacks.served_eval.retry_wait=0"]


def _full(prompt: str) -> list[int]:
    return [3, 3, 2]  # accepted draft tokens per round: tau = 1 + 8 / 3


def _train(overrides, tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline
    from tests.test_configs import _compose

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    cfg = _compose([*TRAIN, *overrides, f"paths.artifacts={tmp_path / 'art'}"], tmp_path / "run")
    return run_pipeline(cfg, stage="train")


def test_served_tau_is_logged_beside_simulated_tau_and_a_killed_server_does_not_stop_training(
        tmp_path, monkeypatch, shared_data):
    checks = []
    with SpecStub(k=3, plan=_full) as stub:
        real = ServedEval.check

        def check_then_kill(self, trainer, pl_module):
            row = real(self, trainer, pl_module)
            checks.append(row)
            if len(checks) == 1:  # the engine dies after the first check
                stub.__exit__(None, None, None)
            return row

        monkeypatch.setattr(ServedEval, "check", check_then_kill)
        out = _train([f"callbacks.served_eval.url={stub.url}"], tmp_path, monkeypatch, shared_data)
    root = Path(out["artifacts"]["draft"]).parent
    summary = json.loads((root / "train_summary.json").read_text())
    served = [r for r in summary["history"] if any(k.startswith("served/") for k in r)]
    assert len(checks) >= 3 and len(served) == len(checks)  # every check, the final one included, reached the history
    assert served[0]["served/tau"] == pytest.approx(1 + 8 / 3) and served[0]["served/failed"] == 0
    assert served[0]["served/acc_0"] == 1.0 and served[0]["served/acc_2"] == pytest.approx(2 / 3)
    assert all(r["served/failed"] == 1 and r["served/attempts"] == 2 for r in served[1:])  # retried, then skipped
    assert any("val/simulated_tau" in r for r in summary["history"])  # the simulated tau it is plotted beside
    with open(root / "served_eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(checks) and "Connection refused" in rows[-1]["errors"]
    assert float(rows[0]["tau"]) == pytest.approx(1 + 8 / 3) and any(r["simulated_tau"] for r in rows)
    assert [int(r["step"]) for r in rows] == sorted({int(r["step"]) for r in rows})  # one check per step


class _Launched:
    """A stand-in for a launched server: a SpecStub that can be killed, with the launcher's attributes."""

    def __init__(self, plan, changed=frozenset()):
        self.stub = SpecStub(k=3, plan=plan, changed=changed).__enter__()
        self.url, self.startup_s, self.running = self.stub.url, 0.01, True

    def stop(self):
        if self.running:
            self.stub.__exit__(None, None, None)
        self.running = False


class _Trainer:
    def __init__(self):
        self.global_step, self.current_epoch, self.is_global_zero = 0, 0, True
        self.callback_metrics, self.loggers, self.callbacks = {"val/simulated_tau": 1.5}, [], []


def _bound(monkeypatch, tmp_path, servers):
    cb = ServedEval(every_n_steps=1, prompts=2, max_tokens=6, retries=1, retry_wait=0)
    cb._run = {"settings": {"request_timeout": 5}, "prompts": ["alpha", "bravo"], "out": tmp_path / "served_eval",
               "monitor": "val/simulated_tau"}
    monkeypatch.setattr(cb, "_export", lambda pl_module: 0.0)
    monkeypatch.setattr(cb, "_launch", lambda *a, **k: servers.pop(0))
    reloads = []
    monkeypatch.setattr(cb, "_reload", lambda url: reloads.append(url))
    return cb, reloads


def test_a_warm_server_reloads_the_draft_and_is_relaunched_when_it_dies(monkeypatch, tmp_path):
    first, second = _Launched(_full), _Launched(_full)
    cb, reloads = _bound(monkeypatch, tmp_path, [first, second])
    trainer = _Trainer()
    modes = []
    for step in (1, 2, 3):
        trainer.global_step = step
        if step == 3:
            first.stub.__exit__(None, None, None)  # stops answering between checks (its process still up):
            # the reload fails, the retry launches afresh
            monkeypatch.setattr(cb, "_reload", lambda url: (_ for _ in ()).throw(ConnectionRefusedError(url)))
        modes.append(cb.check(trainer, None))
    cb.close()
    assert [m["mode"] for m in modes] == ["launch", "reload", "launch"]
    assert reloads == [first.url] and modes[2]["attempts"] == 2 and "ConnectionRefusedError" in modes[2]["errors"][0]
    assert all(m["tau"] == pytest.approx(1 + 8 / 3) for m in modes) and not second.running


def test_answers_that_change_after_a_reload_start_a_fresh_server(monkeypatch, tmp_path):
    """At T = 0 a lossless engine answers every check alike: different answers mean the reload touched the
    target, so the check is retried on a fresh server (whose answers become the reference)."""
    first = _Launched(_full)
    cb, _ = _bound(monkeypatch, tmp_path, [first, _Launched(_full)])
    trainer = _Trainer()
    trainer.global_step = 1
    cb.check(trainer, None)
    first.stub.changed = {"alpha"}  # the warm server now answers "alpha" differently
    trainer.global_step = 2
    row = cb.check(trainer, None)
    cb.close()
    assert row["mode"] == "launch" and row["attempts"] == 2 and "changed since the first check" in row["errors"][0]


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps"):
        ServedEval(every_n_steps=0)


def test_verify_reload_ends_with_a_fresh_launch_on_the_final_export(monkeypatch, tmp_path):
    servers = [_Launched(_full), _Launched(lambda p: [3, 0, 1])]  # the fresh server accepts less: both recorded
    cb, reloads = _bound(monkeypatch, tmp_path, servers[:])
    cb.verify_reload = True
    trainer = _Trainer()
    trainer.global_step = 1
    cb.check(trainer, None)
    trainer.global_step = 2
    cb.on_train_end(trainer, None)  # the final check (a reload), then the fresh launch
    end, fresh = cb.rows[-2:]
    assert end["mode"] == "reload" and fresh["mode"] == "fresh"
    assert fresh["reloaded_tau"] == pytest.approx(1 + 8 / 3) and fresh["fresh_tau"] == pytest.approx(1 + 4 / 3)
    assert not servers[0].running and not servers[1].running  # both stopped


def test_an_engine_the_checks_cannot_start_fails_before_training(tmp_path, monkeypatch, shared_data):
    from draftlab.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="callbacks.served_eval.served.python") as err:
        _train([f"callbacks.served_eval.served.python={sys.executable}"], tmp_path, monkeypatch, shared_data)
    assert "vllm is not importable" in str(err.value)
    assert not list((tmp_path / "art").rglob("checkpoints"))  # no training step was taken
