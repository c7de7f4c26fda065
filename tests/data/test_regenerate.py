"""Regeneration: turn by turn, counts that add up, and an interrupted run that ends identical."""

from __future__ import annotations

import json

import pytest

from draftlab.data import regenerate as regen_mod
from draftlab.data.conversations import Conversation
from draftlab.data.regenerate import RegenConfig, load_regenerated, regenerate


def _convs(n=10):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}: tell me about the number {i}."},
                {"role": "assistant", "content": "old answer"}]
        if i % 3 == 0:  # multi-turn: the second turn must see the regenerated first answer
            msgs += [{"role": "user", "content": "And twice that?"}, {"role": "assistant", "content": "old"}]
        out.append(Conversation(id=f"c{i}", messages=msgs))
    out.append(Conversation(id="no-assistant", messages=[{"role": "user", "content": "hello"}]))
    return out


CFG = RegenConfig(temperature=0.8, top_p=0.95, max_new_tokens=5, batch_size=3, seed=7)


def test_regeneration_replaces_every_assistant_turn(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    report = regenerate(tiny_target, _convs(), out, CFG, progress=False)
    assert report.complete and (report.success, report.error, report.skipped) == (10, 0, 1)
    regen = {c.id: c for c in load_regenerated(out)}
    assert len(regen) == 10
    for c in regen.values():
        assert all(m["content"] not in {"old answer", "old"} for m in c.messages if m["role"] == "assistant")
    assert [m["role"] for m in regen["c0"].messages] == ["user", "assistant", "user", "assistant"]
    skipped = [json.loads(x) for x in out.with_name("regen.skipped.jsonl").read_text().splitlines()]
    assert [s["id"] for s in skipped] == ["no-assistant"]


def test_interrupted_run_resumes_to_identical_output(tiny_target, tmp_path, monkeypatch):
    full = tmp_path / "full" / "regen.jsonl"
    regenerate(tiny_target, _convs(), full, CFG, progress=False)

    part = tmp_path / "part" / "regen.jsonl"
    real_write = regen_mod._Appender.write
    calls = {"n": 0}

    def dying_write(self, record):
        calls["n"] += 1
        if calls["n"] == 5:  # killed in the middle of the second batch
            raise KeyboardInterrupt
        real_write(self, record)

    monkeypatch.setattr(regen_mod._Appender, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_target, _convs(), part, CFG, progress=False)
    monkeypatch.setattr(regen_mod._Appender, "write", real_write)
    with open(part, "a") as f:  # and a torn line, as a kill during a write leaves
        f.write('{"id": "c9", "conversations": [{"ro')
    assert len(part.read_text().splitlines()) == 5

    report = regenerate(tiny_target, _convs(), part, CFG, progress=False)
    assert report.resumed_done == 4 and report.complete
    assert part.read_text() == full.read_text()
    for suffix in (".errors.jsonl", ".skipped.jsonl"):
        assert part.with_name("regen" + suffix).read_text() == full.with_name("regen" + suffix).read_text()


def test_budgeted_runs_add_up(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    cfg = RegenConfig(**{**CFG.__dict__, "max_batches": 2})
    first = regenerate(tiny_target, _convs(), out, cfg, progress=False)
    assert first.pending > 0 and first.success + first.error + first.skipped + first.pending == first.input
    second = regenerate(tiny_target, _convs(), out, CFG, progress=False)
    assert second.complete and second.pending == 0


def test_duplicate_ids_rejected(tiny_target, tmp_path):
    convs = _convs(2) + _convs(1)
    with pytest.raises(ValueError, match="unique conversation ids"):
        regenerate(tiny_target, convs, tmp_path / "x.jsonl", CFG, progress=False)


def _flaky_generate(monkeypatch, fail_batches: set[int]):
    # ``_generate`` raising (as out-of-memory would) on its calls numbered in ``fail_batches`` (0-based).
    real, calls = regen_mod._generate, {"n": 0}

    def flaky(*args, **kwargs):
        n = calls["n"]
        calls["n"] += 1
        if n in fail_batches:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(regen_mod, "_generate", flaky)


def test_a_failed_generation_is_retried_by_the_next_run(tiny_target, tmp_path, monkeypatch):
    """A generation call that fails once, then succeeds: the failed conversations are recorded with their
    reason, counted as errors (to retry), and the next run regenerates them -- identical to a run that
    never failed."""
    full = tmp_path / "full" / "regen.jsonl"
    regenerate(tiny_target, _convs(), full, CFG, progress=False)

    out = tmp_path / "flaky" / "regen.jsonl"
    _flaky_generate(monkeypatch, {0})  # the first call: turn 1 of the first batch (c0, c1, c2)
    first = regenerate(tiny_target, _convs(), out, CFG, progress=False)
    assert first.complete and (first.success, first.error, first.skipped) == (7, 3, 1)
    assert first.retry_ids == ["c0", "c1", "c2"] and first.failed_ids == []
    errors = [json.loads(x) for x in out.with_name("regen.errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["attempt"]) for e in errors] == [("c0", 1), ("c1", 1), ("c2", 1)]
    assert all("out of memory" in e["error"] for e in errors)

    monkeypatch.undo()  # the generation works again
    second = regenerate(tiny_target, _convs(), out, CFG, progress=False)
    assert second.complete and (second.success, second.error, second.skipped) == (10, 0, 1)
    assert second.retry_ids == [] and second.failed_ids == []
    # Same batch composition and seed: the retried records equal those of the run that never failed.
    assert {c.id: c.messages for c in load_regenerated(out)} == {c.id: c.messages for c in load_regenerated(full)}


def test_a_conversation_that_always_fails_is_given_up_after_max_attempts(tiny_target, tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    cfg = RegenConfig(**{**CFG.__dict__, "max_attempts": 2})
    _flaky_generate(monkeypatch, set(range(1000)))  # every call fails
    reports = [regenerate(tiny_target, _convs(4), out, cfg, progress=False) for _ in range(3)]
    assert [r.retry_ids for r in reports[:1]] == [["c0", "c1", "c2", "c3"]]
    assert reports[1].failed_ids == ["c0", "c1", "c2", "c3"] and reports[1].retry_ids == []
    assert all(r.complete and r.error == 4 and r.skipped == 1 for r in reports)
    # The third run attempts nothing: every failure used its attempts.
    assert len(out.with_name("regen.errors.jsonl").read_text().splitlines()) == 8
    assert "given up after all attempts: c0, c1, c2, c3" in str(reports[2])
    with pytest.raises(ValueError, match="max_attempts"):
        RegenConfig(max_attempts=0)
