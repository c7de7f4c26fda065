"""Regeneration through a server (``regen.engine: server``) against the stand-in server: the same records as
HF generation, a server dying mid-run (the rerun completes, each conversation exactly once), timeouts that
name the URL, per-request failures retried by later runs, and a data key that separates engines."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftlab.data.conversations import Conversation
from draftlab.data.regenerate import RegenConfig, load_regenerated, regen_key_config, regenerate
from draftlab.serving.client import RequestTimeout, ServerUnreachable
from draftlab.serving.regen_server import ServerEngine, ServerSettings, engine_identity, open_engine
from draftlab.serving.stub import StubServer
from draftlab.utils.hashing import content_key


def _regen(target, convs, out, cfg, **kw):
    """``regenerate`` through the engine ``cfg`` names, opened and closed as the data stage does."""
    with open_engine(target, cfg) as engine:
        return regenerate(target, convs, out, cfg, engine=engine, **kw)


def _convs(n=10):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "old answer"}]
        if i % 3 == 0:  # multi-turn: the second request must carry the regenerated first answer
            msgs += [{"role": "user", "content": f"More {i}"}, {"role": "assistant", "content": "old"}]
        out.append(Conversation(id=f"c{i}", messages=msgs))
    out.append(Conversation(id="no-assistant", messages=[{"role": "user", "content": "hello"}]))
    return out


def _cfg(server: dict, **kw) -> RegenConfig:
    base = dict(temperature=0.8, top_p=0.95, max_new_tokens=40, batch_size=3, seed=7, engine="server",
                server={"concurrency": 3, "timeout": 5, "max_retries": 0, **server})
    return RegenConfig(**{**base, **kw})


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_server_records_have_the_hf_schema(tiny_target, tmp_path):
    hf_out, srv_out, retok_out = tmp_path / "hf.jsonl", tmp_path / "srv.jsonl", tmp_path / "retok.jsonl"
    regenerate(tiny_target, _convs(), hf_out, RegenConfig(max_new_tokens=5, batch_size=3, seed=7), progress=False)
    with StubServer() as stub:
        rep = _regen(tiny_target, _convs(), srv_out, _cfg({"urls": [stub.url]}), progress=False)
        _regen(tiny_target, _convs(), retok_out, _cfg({"urls": [stub.url], "return_token_ids": False}),
                   progress=False)
    assert rep.complete and (rep.success, rep.error, rep.skipped) == (10, 0, 1)
    hf, srv, retok = _records(hf_out), _records(srv_out), _records(retok_out)
    assert [r["id"] for r in hf] == [r["id"] for r in srv] == [r["id"] for r in retok]
    for h, s in zip(hf, srv):
        assert h.keys() == s.keys() and h["meta"].keys() == s["meta"].keys()
        assert h["meta"]["engine"].keys() == s["meta"]["engine"].keys()
        assert [m["role"] for m in h["conversations"]] == [m["role"] for m in s["conversations"]]
    assert hf[0]["meta"]["engine"]["name"] == "hf" and hf[0]["meta"]["engine"]["token_ids"] == "generated"
    assert srv[0]["meta"]["engine"] == {"name": "draftlab-stub", "version": "stub-1", "token_ids": "server"}
    assert retok[0]["meta"]["engine"]["token_ids"] == "retokenized"
    # Turn by turn: the second turn's request saw the first regenerated answer; counts are the server's ids.
    c0 = {c.id: c for c in load_regenerated(srv_out)}["c0"].messages
    assert [m["content"] for m in c0] == ["Question 0", "echo: Question 0", "More 0", "echo: More 0"]
    assert srv[0]["meta"]["new_tokens"] == [len("echo: Question 0"), len("echo: More 0")]
    assert srv[0]["meta"]["regen"]["engine"] == "server" and "server" not in srv[0]["meta"]["regen"]


def test_server_dying_mid_run_then_rerun_completes_each_conversation_once(tiny_target, tmp_path):
    full = tmp_path / "full" / "regen.jsonl"
    with StubServer() as stub:
        _regen(tiny_target, _convs(), full, _cfg({"urls": [stub.url]}), progress=False)

    out = tmp_path / "part" / "regen.jsonl"
    with StubServer(die_after=5) as dying:  # dies during the second batch (3 + 1 requests per batch)
        with pytest.raises(ServerUnreachable) as err:
            _regen(tiny_target, _convs(), out, _cfg({"urls": [dying.url]}), progress=False)
    assert dying.url in str(err.value)
    first = _records(out)
    assert 0 < len(first) < 10
    # A dead server is the run's failure, not the conversations': no attempt was spent on it.
    assert _records(out.with_name("regen.errors.jsonl")) == []

    with StubServer() as fresh:  # the rerun (another server, another URL: same data)
        rep = _regen(tiny_target, _convs(), out, _cfg({"urls": [fresh.url]}), progress=False)
    assert rep.complete and rep.resumed_done == len(first) + 0 and (rep.success, rep.error) == (10, 0)
    ids = Counter(r["id"] for r in _records(out))
    assert ids == Counter(f"c{i}" for i in range(10))  # nothing lost, nothing twice
    assert out.read_text() == full.read_text()


def test_a_second_server_takes_over_from_a_dying_one_in_the_same_run(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    with StubServer(die_after=4) as dying, StubServer() as healthy:
        rep = _regen(tiny_target, _convs(), out,
                         _cfg({"urls": [dying.url, healthy.url], "max_retries": 2}), progress=False)
    assert rep.complete and (rep.success, rep.error, rep.skipped) == (10, 0, 1)
    assert Counter(r["id"] for r in _records(out)) == Counter(f"c{i}" for i in range(10))
    assert dying.served == 4 and healthy.served == 14 - 4  # 14 turns in all, none answered twice


def test_launched_server_killed_mid_run_is_stopped_and_the_rerun_completes(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    launch = {"builder": "stub", "extra": {"die_after": 6}, "startup_timeout": 60, "log_path": str(tmp_path / "s.log")}
    engine = ServerEngine(tiny_target, _cfg({"launch": launch}))
    with pytest.raises(ServerUnreachable), engine:
        regenerate(tiny_target, _convs(), out, engine.cfg, progress=False, engine=engine)
    assert engine.process is not None and not engine.process.running  # stopped on the way out
    done = len(_records(out))
    assert 0 < done < 10
    rep = _regen(tiny_target, _convs(), out, _cfg({"launch": {**launch, "extra": {}}}), progress=False)
    assert rep.complete and rep.resumed_done == done and rep.success == 10
    assert Counter(r["id"] for r in _records(out)) == Counter(f"c{i}" for i in range(10))


def test_slow_server_times_out_naming_its_url(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    with StubServer(delay=3.0) as slow:
        with pytest.raises(RequestTimeout, match=slow.url.replace(".", r"\.")):
            _regen(tiny_target, _convs(3), out, _cfg({"urls": [slow.url], "timeout": 0.5}), progress=False)
    assert _records(out) == [] and _records(out.with_name("regen.errors.jsonl")) == []


def test_rejected_requests_are_conversation_errors_retried_by_the_next_run(tiny_target, tmp_path):
    out = tmp_path / "regen.jsonl"
    with StubServer(fail_first=2) as stub:  # the first two requests get HTTP 503, not retried (max_retries 0)
        first = _regen(tiny_target, _convs(), out, _cfg({"urls": [stub.url]}), progress=False)
        assert first.complete and first.error == 2 and len(first.retry_ids) == 2
        errors = _records(out.with_name("regen.errors.jsonl"))
        assert [e["attempt"] for e in errors] == [1, 1] and all("503" in e["error"] for e in errors)
        second = _regen(tiny_target, _convs(), out, _cfg({"urls": [stub.url]}), progress=False)
    assert second.complete and (second.success, second.error) == (10, 0)
    assert Counter(r["id"] for r in _records(out)) == Counter(f"c{i}" for i in range(10))


def test_data_key_differs_between_engines_and_versions():
    hf = RegenConfig(max_new_tokens=5, seed=7)
    srv = RegenConfig(max_new_tokens=5, seed=7, engine="server", server={"urls": ["http://a:1"], "concurrency": 4})
    legacy = {k: v for k, v in asdict(hf).items() if k not in ("max_batches", "max_attempts", "engine", "server")}
    assert regen_key_config(hf) == legacy  # HF keeps the key it always had: existing data stays valid
    vllm32 = content_key(regen_key_config(srv, {"name": "vllm", "version": "0.32.0"}))
    assert content_key(regen_key_config(hf)) != vllm32
    assert content_key(regen_key_config(srv, {"name": "vllm", "version": "0.33.0"})) != vllm32
    assert content_key(regen_key_config(srv, {"name": "sglang", "version": "0.32.0"})) != vllm32
    # Where requests go and how many at once is not the data's.
    other = RegenConfig(max_new_tokens=5, seed=7, engine="server", server={"urls": ["http://b:2"], "concurrency": 64})
    assert content_key(regen_key_config(other, {"name": "vllm", "version": "0.32.0"})) == vllm32
    with pytest.raises(ValueError, match="identity"):
        regen_key_config(srv)


def test_engine_identity_of_running_servers():
    with StubServer(version="1.0") as a, StubServer(version="1.0") as b, StubServer(version="2.0") as c:
        assert engine_identity(_cfg({"urls": [a.url, b.url]})) == {"name": "draftlab-stub", "version": "1.0"}
        with pytest.raises(RuntimeError, match="different engines or versions"):
            engine_identity(_cfg({"urls": [a.url, c.url]}))
    assert engine_identity(RegenConfig()) is None


def test_settings_from_the_train_config():
    conf = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "train.yaml")
    regen = {k: v for k, v in OmegaConf.to_container(conf.regen).items() if k != "enabled"}
    cfg = RegenConfig(**regen)
    assert cfg.engine == "hf"
    with pytest.raises(ValueError, match="exactly one of"):
        ServerSettings.of(cfg.server)  # neither urls nor launch
    with pytest.raises(ValueError, match="unknown regen.server"):
        ServerSettings.of({"urls": ["http://a:1"], "concurency": 2})
    with pytest.raises(ValueError, match="regen.engine"):
        RegenConfig(engine="vllm")
