"""A tiny OpenAI-compatible stand-in server (stdlib ``http.server``) for tests and dry runs.

It answers ``/v1/chat/completions`` by echoing the last user message (``"echo: <content>"``, the token ids
being the answer's character codes, cut at ``max_tokens``), ``/health``, ``/v1/models`` (owned by
``draftlab-stub``) and ``/version`` (as vLLM does: ``{"version": ...}``). Faults are
switches, so clients can be tested against them:

- ``delay``: seconds to sleep before each answer (a slow server);
- ``fail_first``: answer the first N completion requests with HTTP 503;
- ``die_after``: after N admitted completion requests, drop the connection of every further request without an
  answer and stop listening (a server that died mid-run);
- ``ready_after``: ``/health`` answers 503 until this many seconds after start (a server still loading).

In a thread::

    with StubServer(die_after=5) as stub:
        stub.url, stub.served, stub.requests

As a process (what the launcher tests start)::

    python -m draftlab.serving.stub --port 8123 [--ready-after 1] [--delay 0.5]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    server: _StubHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        stub = self.server.stub
        if self.path == "/health":
            ready = time.monotonic() - stub.started >= stub.ready_after
            self._send(200 if ready else 503, {"ready": ready})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list",
                             "data": [{"id": stub.model, "object": "model", "owned_by": "draftlab-stub"}]})
        elif self.path == "/version":
            self._send(200, {"version": stub.version})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        stub = self.server.stub
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length) or b"{}")
        with stub.lock:
            stub.posts += 1
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": f"no route {self.path}"})
            return
        with stub.lock:
            stub.requests += 1
            nth = stub.requests
            dead = stub.die_after is not None and stub.admitted >= stub.die_after
            stub.admitted += not dead
            stub.in_flight += 1
            stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        status = body = None
        try:
            if dead:
                stub.kill()
                self.close_connection = True  # return without an answer: the client sees the connection close
                return
            if stub.delay:
                time.sleep(stub.delay)
            status, body = (503, {"error": "overloaded"}) if nth <= stub.fail_first else (200, stub.answer(request))
        finally:
            # Out of flight once the answer is ready, before it is sent: the client may hold its slot only until
            # it has read the answer, and then send the next request while this thread is still writing.
            with stub.lock:
                stub.in_flight -= 1
                stub.served += status == 200  # counted before the client can see the answer
        self._send(status, body)


class _StubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    stub: StubServer


class StubServer:
    """The stand-in server, listening on ``host:port`` (0 picks a free port) once started."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model: str = "stub", delay: float = 0.0,
                 fail_first: int = 0, die_after: int | None = None, ready_after: float = 0.0,
                 version: str = "stub-1"):
        self.model = model
        self.version = version
        self.delay = delay
        self.fail_first = fail_first
        self.die_after = die_after
        self.ready_after = ready_after
        self.lock = threading.Lock()
        self.posts = 0  # POST requests, any path
        self.requests = 0  # completion requests received (answered or not)
        self.in_flight = self.max_in_flight = 0  # completion requests being handled now / at most at once
        self.admitted = 0  # completion requests let through before the server died
        self.served = 0  # completion requests answered with 200
        self.answered: list[str] = []  # the user messages answered, in order
        self.started = time.monotonic()
        self._http = _StubHTTPServer((host, port), _Handler)
        self._http.stub = self
        self._thread: threading.Thread | None = None
        self._killed = threading.Event()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def answer(self, request: dict) -> dict:
        user = [m for m in request.get("messages", []) if m.get("role") == "user"]
        prompt = str(user[-1]["content"]) if user else ""
        text = "echo: " + prompt
        limit = request.get("max_tokens") or request.get("max_completion_tokens")
        finish = "stop"
        if limit is not None and len(text) > int(limit):
            text, finish = text[: int(limit)], "length"
        with self.lock:
            self.answered.append(prompt)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        body = {"id": f"stub-{self.requests}", "object": "chat.completion", "model": request.get("model"),
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(text),
                          "total_tokens": len(prompt) + len(text)}}
        if request.get("return_token_ids"):
            choice["token_ids"] = [ord(c) for c in text]
            body["prompt_token_ids"] = [ord(c) for c in prompt]
        return body

    def start(self) -> StubServer:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def kill(self) -> None:
        """Stop listening (new connections are refused); requests in flight may still finish."""
        if self._killed.is_set():
            return
        self._killed.set()
        threading.Thread(target=self._shutdown, daemon=True).start()  # shutdown() blocks; not from a handler

    def _shutdown(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def stop(self) -> None:
        if not self._killed.is_set():
            self._killed.set()
            if self._thread is not None:
                self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--version", default="stub-1")
    args = p.parse_args(argv)
    stub = StubServer(host=args.host, port=args.port, model=args.model, delay=args.delay,
                      ready_after=args.ready_after, fail_first=args.fail_first, die_after=args.die_after,
                      version=args.version)
    print(f"stub serving on {stub.url}", flush=True)
    stub.started = time.monotonic()
    try:
        stub._http.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
