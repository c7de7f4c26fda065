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
