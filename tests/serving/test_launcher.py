"""``draftlab.serving.launcher``: a stand-in server process is waited for, used, and stopped on every exit."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from draftlab.serving.client import ChatClient
from draftlab.serving.launcher import (
    SGLANG_HEALTH,
    ServerProcess,
    ServerStartError,
    free_port,
    sglang_command,
    vllm_command,
)


def _stub_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "draftlab.serving.stub", "--port", str(port), *extra]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _gone(pid: int, wait: float = 5.0) -> bool:
    """The process no longer exists (reaped) or is a zombie (dead, not yet reaped by its parent)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_waits_for_health_serves_and_stops(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with ServerProcess(_stub_cmd(port, "--ready-after", "0.6"), port=port, startup_timeout=30,
                       poll_interval=0.05, log_path=log) as server:
        assert server.running and server.startup_s >= 0.6  # not before /health said 200
        [r] = ChatClient(server.url, model="stub").chat_many_sync([[{"role": "user", "content": "hi"}]])
        assert r.text == "echo: hi"
    assert not server.running and not _answers(server.url)
    assert "stub serving on" in log.read_text()


def test_a_server_start_says_where_it_listens_and_logs(tmp_path):
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("draftlab").addHandler(handler)
    try:
        port, log = free_port(), tmp_path / "server.log"
        with ServerProcess(_stub_cmd(port), port=port, startup_timeout=30, poll_interval=0.05, log_path=log):
            pass
    finally:
        logging.getLogger("draftlab").removeHandler(handler)
    assert any(line.startswith("starting server") and str(log) in line and f":{port}" in line for line in lines)
    assert any(f":{port} ready in" in line for line in lines)


def test_exception_in_block_stops_the_server():
    port = free_port()
    server = ServerProcess(_stub_cmd(port), port=port, startup_timeout=30, poll_interval=0.05)
    with pytest.raises(RuntimeError, match="boom"):
        with server:
            assert _answers(server.url)
            raise RuntimeError("boom")
    assert server.proc.returncode is not None and not _answers(server.url)


def test_keyboard_interrupt_during_startup_stops_the_server(monkeypatch):
    port = free_port()
    server = ServerProcess(_stub_cmd(port), port=port, startup_timeout=30, poll_interval=0.05)
    calls = []

    def interrupted(self):
        calls.append(self.proc.pid)
        if len(calls) > 2:  # after the process is surely up
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(ServerProcess, "healthy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with server:
            pytest.fail("the block must not run")
    assert server.proc.returncode is not None and _gone(server.proc.pid)


def test_whole_process_group_is_stopped(tmp_path):
    # The stub runs as a grandchild (sh -> python), as engine workers do; stopping the leader alone would
    # leave it serving.
    port = free_port()
    pid_file = tmp_path / "pid"
    stub = " ".join(_stub_cmd(port))
    cmd = ["sh", "-c", f"{stub} & echo $! > {pid_file}; wait"]
    with ServerProcess(cmd, port=port, startup_timeout=30, poll_interval=0.05) as server:
        assert _answers(server.url)
        grandchild = int(pid_file.read_text())
        assert grandchild != server.proc.pid
    assert _gone(grandchild) and not _answers(server.url)


def test_server_exiting_early_is_reported_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('cannot load model'); sys.exit(3)"]
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="code 3") as info:
        ServerProcess(cmd, port=free_port(), startup_timeout=30, log_path=tmp_path / "log").start()
    assert "cannot load model" in str(info.value) and time.monotonic() - t0 < 10


def test_startup_timeout_stops_the_server():
    port = free_port()
    server = ServerProcess(_stub_cmd(port, "--ready-after", "60"), port=port, startup_timeout=1.0,
                           poll_interval=0.05)
    with pytest.raises(ServerStartError, match="not healthy"):
        server.start()
    assert server.proc.returncode is not None and _gone(server.proc.pid)


def test_sglang_health_falls_back_to_model_info():
    # A server without /health but with /get_model_info counts as healthy with SGLang's paths.
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/get_model_info" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    http = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        port = http.server_address[1]
        assert ServerProcess(["true"], port=port, health_paths=SGLANG_HEALTH).healthy()
        assert not ServerProcess(["true"], port=port).healthy()  # vLLM's /health alone: 404
    finally:
        http.shutdown()
        http.server_close()


def test_vllm_command_flags():
    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    cmd = vllm_command("/m", port=8001, dtype="float32", max_model_len=2048, speculative_config=spec,
                       python="/venv/bin/python", extra={"enforce_eager": True, "seed": 0, "quantization": None})
    assert cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    args = cmd[5:]
    assert args[args.index("--port") + 1] == "8001" and args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--max-model-len") + 1] == "2048"
    assert json.loads(args[args.index("--speculative-config") + 1]) == spec
    assert "--enforce-eager" in args and args[args.index("--seed") + 1] == "0" and "--quantization" not in args
    plain = vllm_command("/m", port=1, extra=["--swap-space", "1"])
    assert "--speculative-config" not in plain and plain[-2:] == ["--swap-space", "1"]


def test_sglang_command_flags():
    cmd = sglang_command("/m", port=30000, draft_model_path="/d", num_steps=3, eagle_topk=1, num_draft_tokens=4,
                         python="py")
    assert cmd[:5] == ["py", "-m", "sglang.launch_server", "--model-path", "/m"]
    pairs = dict(zip(cmd[5::2], cmd[6::2]))
    assert pairs == {"--host": "127.0.0.1", "--port": "30000", "--speculative-algorithm": "EAGLE3",
                     "--speculative-draft-model-path": "/d", "--speculative-num-steps": "3",
                     "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4"}
    assert not any(a.startswith("--speculative") for a in sglang_command("/m", port=1))


def test_stop_is_idempotent_and_safe_before_start():
    assert ServerProcess(["true"], port=free_port()).stop() is None
    port = free_port()
    with ServerProcess(_stub_cmd(port), port=port, startup_timeout=30, poll_interval=0.05) as server:
        pass
    code = server.proc.returncode
    assert code is not None and server.stop() == code
