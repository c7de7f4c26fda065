"""``draftlab.serving.client`` against the in-thread stand-in server: answers, retries, timeouts, concurrency."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from draftlab.serving.client import (
    ChatClient,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    parse_completion,
)
from draftlab.serving.stub import StubServer


def _convs(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}] for i in range(n)]


def test_answers_in_order_with_token_ids_and_bounded_concurrency():
    with StubServer(delay=0.05) as a, StubServer(delay=0.05) as b:
        client = ChatClient([a.url, b.url], model="stub", concurrency=3, timeout=5,
                            defaults={"return_token_ids": True})
        results = client.chat_many_sync(_convs(12), max_tokens=64)
    assert [r.text for r in results] == [f"echo: q{i}" for i in range(12)]
    for r in results:
        assert r.token_ids == [ord(c) for c in r.text]
        assert r.prompt_token_ids == [ord(c) for c in r.text.removeprefix("echo: ")]
        assert r.finish_reason == "stop" and r.attempts == 1
        assert r.usage["completion_tokens"] == len(r.text) == r.completion_tokens
    # round-robin over both servers
    assert a.served == b.served == 6
    assert {r.url for r in results} == {a.url, b.url}


def test_concurrency_is_bounded_not_serialised():
    with StubServer(delay=0.1) as s:
        ChatClient(s.url, model="stub", concurrency=3).chat_many_sync(_convs(12))
    assert 2 <= s.max_in_flight <= 3


def test_max_tokens_cuts_with_finish_reason_length():
    with StubServer() as s:
        [r] = ChatClient(s.url, model="stub").chat_many_sync(_convs(1), max_tokens=4)
    assert r.text == "echo" and r.finish_reason == "length"


def test_server_dying_mid_run_loses_and_duplicates_nothing():
    n = 40
    with StubServer(die_after=5, delay=0.02) as dying, StubServer(delay=0.02) as healthy:
        client = ChatClient([dying.url, healthy.url], model="stub", concurrency=6, timeout=5, retries=3,
                            backoff=0.01)
        results = client.chat_many_sync(_convs(n))
        answered = Counter(dying.answered + healthy.answered)
    assert len(results) == n
    assert [r.text for r in results] == [f"echo: q{i}" for i in range(n)]  # each request answered, in place
    # Only the requests the dead server dropped were sent again: no prompt was answered twice by the servers.
    assert answered == Counter(f"q{i}" for i in range(n))
    assert dying.served == 5 and healthy.served == n - 5
    retried = [r for r in results if r.attempts > 1]
    assert retried and all(r.url == healthy.url for r in retried)
    assert sum(r.url == dying.url for r in results) == 5


def test_single_dead_server_reports_unreachable_per_request():
    with StubServer(die_after=2) as s:
        client = ChatClient(s.url, model="stub", concurrency=1, retries=2, backoff=0.01, timeout=5)
        results = client.chat_many_sync(_convs(4), return_exceptions=True)
    assert [r.text for r in results[:2]] == ["echo: q0", "echo: q1"]
    for err in results[2:]:
        assert isinstance(err, ServerUnreachable) and err.url == s.url and s.url in str(err)


def test_5xx_is_retried_4xx_is_not():
    with StubServer(fail_first=2) as s:
        client = ChatClient(s.url, model="stub", concurrency=1, retries=3, backoff=0.01)
        [r] = client.chat_many_sync(_convs(1))
        assert r.text == "echo: q0" and r.attempts == 3 and s.requests == 3
    with StubServer() as s:
        client = ChatClient(s.url + "/wrong", model="stub", retries=3, backoff=0.01)
        with pytest.raises(ServerError) as info:
            client.chat_many_sync(_convs(1))
        assert info.value.status == 404 and s.posts == 1  # one try only


def test_5xx_exhausting_retries_raises_server_error():
    with StubServer(fail_first=10) as s:
        client = ChatClient(s.url, model="stub", retries=2, backoff=0.01)
        with pytest.raises(ServerError) as info:
            client.chat_many_sync(_convs(1))
    assert info.value.status == 503 and s.requests == 3


def test_slow_server_times_out_naming_the_url():
    with StubServer(delay=3.0) as slow:
        client = ChatClient(slow.url, model="stub", timeout=0.3, retries=2, backoff=0.01)
        t0 = time.perf_counter()
        with pytest.raises(RequestTimeout) as info:
            client.chat_many_sync(_convs(1))
        elapsed = time.perf_counter() - t0
        assert slow.requests == 1  # timeouts are not retried by default
    assert slow.url in str(info.value) and info.value.url == slow.url
    assert elapsed < 2.0


def test_timeouts_retry_on_the_next_server_when_asked():
    with StubServer(delay=3.0) as slow, StubServer() as fast:
        client = ChatClient([slow.url, fast.url], model="stub", timeout=0.3, retries=1, backoff=0.01,
                            retry_timeouts=True)
        [r] = client.chat_many_sync(_convs(1))
    assert r.text == "echo: q0" and r.url == fast.url and r.attempts == 2


def test_connection_refused_is_unreachable():
    with StubServer() as s:
        url = s.url
    client = ChatClient(url, model="stub", retries=1, backoff=0.01, timeout=2)
    with pytest.raises(ServerUnreachable, match=url):
        client.chat_many_sync(_convs(1))


def test_client_is_reusable_inside_one_loop():
    async def run(url):
        async with ChatClient(url, model="stub", concurrency=2) as client:
            one = await client.chat([{"role": "user", "content": "a"}])
            many = await client.chat_many(_convs(3))
        return one, many

    with StubServer() as s:
        one, many = asyncio.run(run(s.url))
    assert one.text == "echo: a" and [m.text for m in many] == ["echo: q0", "echo: q1", "echo: q2"]


def test_parse_completion_reads_token_ids_from_logprob_strings():
    body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "token_id:12"}, {"token": "token_id:7"}]}}],
            "usage": {"completion_tokens": 2}}
    c = parse_completion(body, url="u")
    assert c.token_ids == [12, 7] and c.text == "hi" and c.completion_tokens == 2
    body["choices"][0]["logprobs"]["content"][1]["token"] = "plain"
    assert parse_completion(body).token_ids is None
    with pytest.raises(Exception, match="no choices"):
        parse_completion({"choices": []}, url="u")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ChatClient([], model="m")
    with pytest.raises(ValueError):
        ChatClient("http://x", model="m", concurrency=0)
