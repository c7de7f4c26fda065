"""A small async client for OpenAI-compatible ``/v1/chat/completions`` servers (vLLM, SGLang).

Standard library only: each request is one blocking ``http.client`` POST run on a thread pool sized to the
concurrency bound, so ``asyncio`` code can keep many requests in flight without an HTTP dependency.

    client = ChatClient(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], model="smollm2",
                        concurrency=64, timeout=120)
    results = client.chat_many_sync([[{"role": "user", "content": "Hi"}]], max_tokens=64)

- several servers: requests are spread round-robin; a retry goes to the next server in the list;
- bounded concurrency: at most ``concurrency`` requests are in flight at once;
- per-request timeout: a request that takes longer raises ``RequestTimeout``, which names the URL
  (timeouts are not retried by default: a slow server stays slow);
- retries with exponential backoff for connection errors and 5xx answers (a server that died, restarts,
  or is overloaded); 4xx answers are the request's fault and raise ``ServerError`` at once;
- ``chat_many`` returns one ``Completion`` per input, in input order, each answered exactly once.

Token ids: vLLM (0.10+) returns them when the request sets ``return_token_ids`` (``choices[i].token_ids`` and
``prompt_token_ids``); SGLang and older servers can be asked for ``logprobs`` with token-id strings
(``"token_id:123"``, vLLM's ``--return-tokens-as-token-ids``). ``Completion.token_ids`` reads either and is
None where the answer has neither.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

Messages = list[dict[str, Any]]


class ServingError(RuntimeError):
    """A request failed; ``url`` is the server that answered (or did not)."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


class RequestTimeout(ServingError, TimeoutError):
    """The server at ``url`` did not answer within the request timeout."""


class ServerError(ServingError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, url: str, status: int):
        super().__init__(message, url)
        self.status = status


class ServerUnreachable(ServingError):
    """The connection failed or broke before an answer (refused, reset, closed)."""


@dataclass
class Completion:
    """One chat completion: the first choice, plus where it came from."""

    text: str
    finish_reason: str | None
    usage: dict[str, int] = field(default_factory=dict)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    url: str = ""
    attempts: int = 1
    latency_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def completion_tokens(self) -> int:
        if "completion_tokens" in self.usage:
            return int(self.usage["completion_tokens"])
        return len(self.token_ids) if self.token_ids is not None else 0


def _token_ids_from_logprobs(choice: dict[str, Any]) -> list[int] | None:
    """Token ids from ``logprobs.content[*].token`` when the server spells tokens as ``token_id:N``."""
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None
    ids = []
    for entry in content:
        token = str(entry.get("token", ""))
        if not token.startswith("token_id:"):
            return None
        ids.append(int(token.removeprefix("token_id:")))
    return ids


def parse_completion(body: dict[str, Any], *, url: str = "") -> Completion:
    """A ``Completion`` from a decoded ``chat.completion`` body (first choice)."""
    choices = body.get("choices") or []
    if not choices:
        raise ServingError(f"{url}: answer has no choices: {str(body)[:200]}", url)
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = _token_ids_from_logprobs(choice)
    return Completion(
        text=(choice.get("message") or {}).get("content") or "",
        finish_reason=choice.get("finish_reason"),
        usage=dict(body.get("usage") or {}),
        token_ids=list(token_ids) if token_ids is not None else None,
        prompt_token_ids=body.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        url=url, raw=body)


def _post_json(url: str, path: str, payload: dict[str, Any], timeout: float,
               headers: dict[str, str]) -> dict[str, Any]:
    """One blocking POST; maps every failure onto the ``ServingError`` family."""
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    data = json.dumps(payload).encode()
    try:
        conn.request("POST", parts.path.rstrip("/") + path, body=data,
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        raw = resp.read()
    except TimeoutError as e:
        raise RequestTimeout(f"{url}: no answer within {timeout:g} s", url) from e
    except (OSError, http.client.HTTPException) as e:  # refused, reset, remote closed, bad status line
        raise ServerUnreachable(f"{url}: {type(e).__name__}: {e}", url) from e
    finally:
        conn.close()
    if resp.status >= 400:
        raise ServerError(f"{url}: HTTP {resp.status}: {raw[:300].decode(errors='replace')}", url, resp.status)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ServerError(f"{url}: answer is not JSON: {raw[:200]!r}", url, resp.status) from e


def get_json(url: str, path: str, timeout: float = 10.0) -> dict[str, Any]:
    """One blocking GET of a JSON document (``/version``, ``/v1/models``), failures as ``ServingError``s."""
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + path)
        resp = conn.getresponse()
        raw = resp.read()
    except TimeoutError as e:
        raise RequestTimeout(f"{url}: no answer to GET {path} within {timeout:g} s", url) from e
    except (OSError, http.client.HTTPException) as e:
        raise ServerUnreachable(f"{url}: {type(e).__name__}: {e}", url) from e
    finally:
        conn.close()
    if resp.status >= 400:
        raise ServerError(f"{url}{path}: HTTP {resp.status}: {raw[:300].decode(errors='replace')}", url, resp.status)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ServerError(f"{url}{path}: answer is not JSON: {raw[:200]!r}", url, resp.status) from e


class ChatClient:
    """Async chat completions over one or more OpenAI-compatible servers (see the module docstring).

    ``defaults`` are merged into every request body (e.g. ``{"temperature": 0, "return_token_ids": True}``);
    keyword arguments of ``chat`` / ``chat_many`` override them.
    """

    def __init__(self, urls: str | Sequence[str], model: str, *, concurrency: int = 8, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0,
                 retry_timeouts: bool = False, api_key: str | None = None,
                 defaults: dict[str, Any] | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("ChatClient needs at least one server URL")
        if concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("concurrency >= 1, retries >= 0 and timeout > 0 are required")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.retry_timeouts = retry_timeouts
        self.defaults = dict(defaults or {})
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._next = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self._semaphore: asyncio.Semaphore | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="chat-client")
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.concurrency)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
        self._semaphore = None  # bound to the loop that made it

    async def __aenter__(self) -> ChatClient:
        self._ensure_started()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------------------
    def _retryable(self, err: ServingError) -> bool:
        if isinstance(err, RequestTimeout):
            return self.retry_timeouts
        if isinstance(err, ServerError):
            return err.status >= 500
        return isinstance(err, ServerUnreachable)

    async def chat(self, messages: Messages, **params: Any) -> Completion:
        """One chat completion; retried on the next server after connection errors and 5xx answers."""
        self._ensure_started()
        payload = {"model": self.model, "messages": messages, **self.defaults, **params}
        start = next(self._next)
        loop = asyncio.get_running_loop()
        async with self._semaphore:
            for attempt in range(self.retries + 1):
                url = self.urls[(start + attempt) % len(self.urls)]
                t0 = time.perf_counter()
                try:
                    # The socket timeout bounds each blocking read; wait_for bounds the whole request.
                    body = await asyncio.wait_for(
                        loop.run_in_executor(self._pool, _post_json, url, "/v1/chat/completions", payload,
                                             self.timeout, self._headers),
                        timeout=self.timeout + 1.0)
                except ServingError as e:  # before TimeoutError: RequestTimeout is one
                    err = e
                except asyncio.TimeoutError as e:
                    err = RequestTimeout(f"{url}: no answer within {self.timeout:g} s", url)
                    err.__cause__ = e
                else:
                    done = parse_completion(body, url=url)
                    done.attempts, done.latency_s = attempt + 1, time.perf_counter() - t0
                    return done
                if attempt == self.retries or not self._retryable(err):
                    raise err
                await asyncio.sleep(min(self.backoff * 2 ** attempt, self.max_backoff))
        raise AssertionError("unreachable")

    async def chat_many(self, conversations: Sequence[Messages], *, return_exceptions: bool = False,
                        **params: Any) -> list[Completion | ServingError]:
        """One completion per conversation, in input order. The first failure is raised (the rest are
        cancelled) unless ``return_exceptions``, which puts the error in that request's slot instead."""
        self._ensure_started()
        tasks = [asyncio.ensure_future(self.chat(list(m), **params)) for m in conversations]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for t in tasks:
                t.cancel()

    def chat_many_sync(self, conversations: Sequence[Messages], **params: Any) -> list[Completion | ServingError]:
        """``chat_many`` from synchronous code (runs its own event loop, then releases the threads)."""

        async def _run():
            try:
                return await self.chat_many(conversations, **params)
            finally:
                self.close()

        return asyncio.run(_run())
