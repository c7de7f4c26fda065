"""A stand-in engine for load tests: ``StubServer`` (echo answers, ``delay``, ``max_in_flight``) that also serves
speculative-decoding counters on ``/metrics`` in vLLM's names, as ``SpecStub`` does, and accepts many connections
at once.

Each answered request adds ``plan(prompt)`` (accepted tokens per draft round) to the counters; ``lag`` records
them a moment after the answer, as an engine that logs a step's stats late would. ``start_counts`` is traffic
from before the run (drafts, accepted at position 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from stub_metrics import SpecStub

from draftlab.serving import stub as stub_module
from draftlab.serving.stub import StubServer


class _Handler(stub_module._Handler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            super().do_GET()
            return
        data = self.server.stub.metrics().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LoadStub(StubServer):
    def __init__(self, *, k: int = 3, plan: Callable[[str], list[int]] | None = None, lag: float = 0.0,
                 start_counts: tuple[int, int] = (0, 0), **kwargs):
        super().__init__(**kwargs)
        self._http.RequestHandlerClass = _Handler
        # http.server listens with a backlog of 5: more simultaneous connections than that wait for a SYN retry
        # (about a second), so a level above 5 would not really have its requests in flight together.
        self._http.socket.listen(128)
        self.k, self.plan, self.lag = k, plan, lag
        self.drafts, accepted = start_counts
        self.per_pos = [accepted] + [0] * (k - 1)

    def count(self, rounds: list[int]) -> None:
        SpecStub.count(self, rounds)  # the same bookkeeping (it reads lock, drafts and per_pos only)

    def answer(self, request: dict) -> dict:
        body = super().answer(request)
        if self.plan is not None:
            rounds = self.plan(str(request["messages"][-1]["content"]))
            if self.lag:
                threading.Timer(self.lag, self.count, args=(rounds,)).start()
            else:
                self.count(rounds)
        return body

    def metrics(self) -> str:
        # The same page SpecStub serves, from this server's counts (it reads k, lock, drafts and per_pos only).
        return SpecStub.metrics(self)
