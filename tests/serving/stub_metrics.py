"""A speculative-decoding stand-in server for the served-evaluation tests (stdlib only).

``/v1/chat/completions`` answers greedily and deterministically: the token ids are the character codes of
``"echo: <prompt>"`` cut at ``max_tokens`` (``changed`` prompts get their answer reversed, an output that differs
from the plain server's). Each answer adds ``plan(prompt)`` = accepted tokens per draft round to the counters
that ``/metrics`` serves in vLLM's names and Prometheus text format (``# HELP`` / ``# TYPE`` lines, a ``_created``
twin per counter, ``engine`` / ``position`` labels); ``lag`` delays the counter update past the answer, as an
engine recording its stats a step later would. ``start_counts`` is traffic from before the run.

``draw(prompt, request)``, when given, replaces ``plan`` for every request (the rounds may then depend on the
request's seed and temperature). A sampled request (``temperature > 0``) gets an answer that starts with its seed,
so that seeds give different outputs, unless ``ignore_temperature`` (a server that decodes greedily whatever it
is asked). Every request body is kept in ``requests``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "vllm:spec_decode_num_"


class SpecStub:
    def __init__(self, *, k: int = 3, plan: Callable[[str], list[int]] | None = None, changed: set[str] = frozenset(),
                 lag: float = 0.0, start_counts: tuple[int, int] = (0, 0),
                 draw: Callable[[str, dict], list[int]] | None = None, ignore_temperature: bool = False):
        self.k, self.plan, self.changed, self.lag = k, plan, set(changed), lag
        self.draw, self.ignore_temperature, self.requests = draw, ignore_temperature, []
        self.lock = threading.Lock()
        self.drafts, accepted = start_counts
        self.per_pos = [accepted] + [0] * (k - 1)  # earlier traffic: all accepted at position 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, data: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, stub.metrics().encode(), "text/plain; version=0.0.4")
                else:
                    self._send(200 if self.path == "/health" else 404, b"{}", "application/json")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._send(200, json.dumps(stub.answer(request)).encode(), "application/json")

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"

    def count(self, rounds: list[int]) -> None:
        with self.lock:
            self.drafts += len(rounds)
            for accepted in rounds:
                for i in range(accepted):
                    self.per_pos[i] += 1

    def answer(self, request: dict) -> dict:
        prompt = request["messages"][-1]["content"]
        sampled = float(request.get("temperature") or 0.0) > 0 and not self.ignore_temperature
        with self.lock:
            self.requests.append(request)
        text = (f"{request.get('seed')}~" * sampled + "echo: " + prompt)[: int(request.get("max_tokens") or 10**9)]
        if prompt in self.changed:
            text = text[::-1]
        plan = (lambda p: self.draw(p, request)) if self.draw is not None else self.plan
        if plan is not None:
            rounds = plan(prompt)
            if self.lag:
                threading.Timer(self.lag, self.count, args=(rounds,)).start()
            else:
                self.count(rounds)
        ids = [ord(c) for c in text]
        return {"object": "chat.completion", "prompt_token_ids": [ord(c) for c in prompt],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length",
                             "token_ids": ids}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}

    def metrics(self) -> str:
        with self.lock:
            values = {"drafts": self.drafts, "draft_tokens": self.k * self.drafts, "accepted_tokens": sum(self.per_pos)}
            per_pos = list(self.per_pos)
        lines = []
        for name, value in values.items():
            metric = f"{PREFIX}{name}"
            lines += [f"# HELP {metric}_total Number of spec decoding {name}.", f"# TYPE {metric}_total counter",
                      f'{metric}_total{{engine="0",model_name="target"}} {float(value)}',
                      f'{metric}_created{{engine="0",model_name="target"}} 1.7e+09']
        for pos, value in enumerate(per_pos):
            lines.append(f'{PREFIX}accepted_tokens_per_pos_total{{engine="0",model_name="target",position="{pos}"}} '
                         f"{float(value)}")
        return "\n".join(lines) + "\n"

    def __enter__(self) -> SpecStub:
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._http.shutdown()
        self._http.server_close()
