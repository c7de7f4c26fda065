"""Throughput under load through a served engine: output tok/s and τ at several concurrency levels, with and
without the draft, and the speed-up at each level.

Batch 1 (``served``) says whether a draft pays off for one user; a server's question is whether it still pays
off with several requests sharing each forward pass, where verification competes with other requests for the
same compute. Per level ``c`` (:func:`measure_load`) every prompt is sent once as a one-turn chat (greedy by
default) with ``c`` requests kept in flight (``ChatClient(concurrency=c)``: a new request starts as soon as one
finishes), after one untimed warm-up request. Measured over the batch:

- aggregate output tok/s = Σ ``usage.completion_tokens`` / wall time of the whole batch (first request sent to
  last answer read), as vLLM's ``benchmarks/serve`` reports output throughput; the drain at the end, when fewer
  than ``c`` requests are left, is part of it;
- request latency p50 / p90 (send to answer, without the client's queueing) and per-request tok/s
  (tokens / latency); time to first token needs streaming, which this client does not do, so it is not here;
- requests in flight as the client saw them: the most at once and the mean (Σ latency / wall), which says how
  close to ``c`` the level really ran;
- the engine's speculative-decoding counters over the batch (``/metrics`` read, settled, before and after):
  τ = 1 + accepted / drafts and per-position acceptance (``served_metrics``); none on a plain server.

``repeats`` runs each level R times; a level reports the mean tok/s and the min / max over its runs. The
speed-up per level (:func:`speedups`) is draft tok/s / plain tok/s of the means; with repeats, its interval is
the min / max of the ratio over every (draft run, plain run) pair. The two servers run one after the other (one
machine), so runs are not paired: that range is what the repeats say about run-to-run noise, not a confidence
interval. :func:`resume_sweep` skips levels a record already holds, so a long sweep survives a restart.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import urllib.error
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

from draftlab.eval.served_metrics import SpecCounters, _settled_counters

LEVELS = (1, 4, 16)
WARMUP_PROMPT = "Hello!"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def in_flight(spans: Sequence[tuple[float, float]], wall: float) -> dict[str, float]:
    """The most requests in flight at once over ``(start, end)`` spans, and the mean (Σ durations / wall). A
    request that ends exactly when another starts does not overlap it."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda ev: (ev[0], ev[1]))
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return {"max": float(most), "mean": sum(e - s for s, e in spans) / wall if wall > 0 else 0.0}


def _as_dict(counters: SpecCounters) -> dict[str, Any]:
    """The counters as JSON keeps them (``per_pos`` a list), so a record read back equals the one measured."""
    return {**asdict(counters), "per_pos": list(counters.per_pos)}


def summarise_run(concurrency: int, requests: Sequence[dict[str, Any]], wall: float,
                  counters: SpecCounters | None) -> dict[str, Any]:
    """One batch at one level. ``requests``: per request ``{"output_tokens", "prompt_tokens", "latency_s",
    "end_s", "finish_reason"}`` (``end_s`` from the batch's start); ``wall``: the batch's seconds; ``counters``:
    the spec-decode counter delta over the batch (None where the server has none)."""
    tokens = sum(int(r["output_tokens"]) for r in requests)
    latencies = [float(r["latency_s"]) for r in requests]
    per_request = [int(r["output_tokens"]) / lat for r, lat in zip(requests, latencies) if lat > 0]
    finish: dict[str, int] = {}
    for r in requests:
        finish[str(r["finish_reason"])] = finish.get(str(r["finish_reason"]), 0) + 1
    spans = [(float(r["end_s"]) - float(r["latency_s"]), float(r["end_s"])) for r in requests]
    return {
        "concurrency": concurrency, "n_requests": len(requests), "wall_s": wall, "output_tokens": tokens,
        "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in requests),
        "tps": tokens / wall if wall > 0 else None,
        "latency_s": {"p50": percentile(latencies, 50), "p90": percentile(latencies, 90),
                      "mean": sum(latencies) / len(latencies) if latencies else None,
                      "max": max(latencies, default=None)},
        "request_tps": {"p50": percentile(per_request, 50),
                        "mean": sum(per_request) / len(per_request) if per_request else None},
        "in_flight": in_flight(spans, wall), "finish_reasons": finish,
        "counters": _as_dict(counters) if counters is not None else None,
        "tau": counters.tau if counters is not None else None,
        "position_rates": counters.position_rates if counters is not None else [],
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


async def _send_all(client, prompts: Sequence[str], params: dict[str, Any], desc: str | None
                    ) -> tuple[list[dict[str, Any]], float]:
    """Every prompt once through ``client`` (its concurrency bound keeps ``c`` in flight); per request its
    tokens, latency and end time from the batch's start, and the batch's wall time."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=desc is None)
    t0 = time.perf_counter()

    async def one(prompt: str) -> dict[str, Any]:
        done = await client.chat([{"role": "user", "content": prompt}], **params)
        end = time.perf_counter() - t0
        bar.update(1)
        return {"output_tokens": done.completion_tokens, "prompt_tokens": done.usage.get("prompt_tokens"),
                "latency_s": done.latency_s, "end_s": end, "finish_reason": done.finish_reason}

    try:
        requests = await asyncio.gather(*(one(p) for p in prompts))
        return list(requests), time.perf_counter() - t0
    finally:
        bar.close()
        client.close()


def _counters(url: str, settle: float) -> SpecCounters | None:
    """A settled reading of the spec-decode counters; None when the server serves no ``/metrics``."""
    try:
        return _settled_counters(url, settle)
    except (urllib.error.URLError, OSError):
        return None


def measure_load(url: str, prompts: Sequence[str], concurrency: int, *, max_tokens: int, model: str = "target",
                 temperature: float = 0.0, timeout: float = 600.0, settle: float = 0.2, warmup: bool = True,
                 params: dict[str, Any] | None = None, desc: str | None = None) -> dict[str, Any]:
    """Send every prompt once with ``concurrency`` requests in flight; :func:`summarise_run` of the batch.

    Requests are not retried: a retry would count one request's time twice, so a failure fails the level.
    ``params`` go into every request body (e.g. ``top_p``); ``desc`` names a progress bar (None: none).
    """
    from draftlab.serving import ChatClient

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    body = {"temperature": temperature, "max_tokens": max_tokens, **(params or {})}
    client = ChatClient(url, model=model, concurrency=concurrency, timeout=timeout, retries=0)
    if warmup:  # untimed, and before the first counter reading: its drafts are not the batch's
        client.chat_many_sync([[{"role": "user", "content": WARMUP_PROMPT}]], **{**body, "max_tokens": 8})
    before = _counters(url, settle)
    requests, wall = asyncio.run(_send_all(client, prompts, body, desc))
    after = _counters(url, settle) if before is not None else None
    return summarise_run(concurrency, requests, wall, after - before if after is not None else None)


def _mean(xs: Sequence[float | None]) -> float | None:
    present = [x for x in xs if x is not None]
    return sum(present) / len(present) if present else None


def summarise_level(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level over its repeats: mean, min and max tok/s; τ from the counters summed over the runs; the mean
    of the runs' latency percentiles."""
    if not runs:
        raise ValueError("a level needs at least one run")
    tps = [r["tps"] for r in runs if r["tps"] is not None]
    counted = [SpecCounters(**{**r["counters"], "per_pos": tuple(r["counters"]["per_pos"])})
               for r in runs if r.get("counters") is not None]
    total = sum(counted, SpecCounters()) if len(counted) == len(runs) else None
    return {"concurrency": runs[0]["concurrency"], "repeats": len(runs), "tps": _mean(tps),
            "tps_min": min(tps, default=None), "tps_max": max(tps, default=None),
            "latency_p50_s": _mean([r["latency_s"]["p50"] for r in runs]),
            "latency_p90_s": _mean([r["latency_s"]["p90"] for r in runs]),
            "request_tps": _mean([r["request_tps"]["mean"] for r in runs]),
            "mean_in_flight": _mean([r["in_flight"]["mean"] for r in runs]),
            "counters": _as_dict(total) if total is not None else None,
            "tau": total.tau if total is not None else None,
            "position_rates": total.position_rates if total is not None else [], "runs": list(runs)}


def sweep(url: str, prompts: Sequence[str], levels: Sequence[int] = LEVELS, *, repeats: int = 1,
          done: dict[str, dict] | None = None, on_level: Callable[[int, dict], None] | None = None,
          desc: str = "served", **ask: Any) -> dict[str, dict]:
    """``{str(c): summarise_level}`` for each level not already in ``done`` (kept as they are); ``on_level(c,
    level)`` after each level measured (to save progress). ``ask``: :func:`measure_load`'s keywords."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out = dict(done or {})
    for c in levels:
        if str(c) in out:
            continue
        runs = [measure_load(url, prompts, c, desc=f"{desc} c={c}" + (f" run {i + 1}/{repeats}" if repeats > 1 else ""),
                             **ask) for i in range(repeats)]
        out[str(c)] = summarise_level(runs)
        if on_level is not None:
            on_level(c, out[str(c)])
    return out


def speedups(plain: dict[str, dict], draft: dict[str, dict]) -> list[dict[str, Any]]:
    """Per level both servers measured: draft tok/s / plain tok/s (means over repeats), its min / max over every
    (draft run, plain run) pair when either side repeated (``interval_over`` says so), τ of the draft server and
    each side's p50 latency."""
    rows = []
    for key in sorted(set(plain) & set(draft), key=int):
        p, d = plain[key], draft[key]
        ratio = d["tps"] / p["tps"] if d["tps"] is not None and p["tps"] else None
        pt = [r["tps"] for r in p["runs"] if r["tps"]]
        dt = [r["tps"] for r in d["runs"] if r["tps"] is not None]
        pairs = [a / b for a in dt for b in pt]
        spread = len(pt) > 1 or len(dt) > 1
        rows.append({
            "concurrency": int(key), "plain_tps": p["tps"], "draft_tps": d["tps"], "speedup": ratio,
            "interval": [min(pairs), max(pairs)] if spread and pairs else None,
            "interval_over": (f"min/max of draft/plain tok/s over all {len(dt)}x{len(pt)} pairs of repeats "
                              "(separate server launches, not paired)") if spread and pairs else None,
            "tau": d["tau"], "position_rates": d["position_rates"],
            "plain_latency_p50_s": p["latency_p50_s"], "draft_latency_p50_s": d["latency_p50_s"],
            "repeats": {"plain": p["repeats"], "draft": d["repeats"]}})
    return rows


def compare_servers(plain_url: str, draft_url: str, prompts: Sequence[str], levels: Sequence[int] = LEVELS, *,
                    repeats: int = 1, **ask: Any) -> dict[str, Any]:
    """Both servers (already running) over ``levels``, then the speed-up per level."""
    plain = sweep(plain_url, prompts, levels, repeats=repeats, desc="plain", **ask)
    draft = sweep(draft_url, prompts, levels, repeats=repeats, desc="draft", **ask)
    return {"plain": plain, "draft": draft, "speedups": speedups(plain, draft)}


def settings_conflicts(recorded: dict[str, Any], now: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """``key: recorded -> now`` for each of ``keys`` on which a record's settings and this run's differ: levels
    measured under other settings would be mixed into one table."""
    return [f"{k}: {recorded.get(k)!r} -> {now.get(k)!r}" for k in keys if recorded.get(k) != now.get(k)]


def resume_sweep(servers: dict[str, dict], name: str, start: Callable[[], AbstractContextManager[str]],
                 prompts: Sequence[str], levels: Sequence[int], *, save: Callable[[], None], repeats: int = 1,
                 **ask: Any) -> dict[str, dict]:
    """The levels of server ``name`` in ``servers`` (``{name: {"levels": {...}, ...}}``, updated in place), the
    missing ones measured on the server that ``start()`` brings up (a context manager giving its URL; not
    started when nothing is missing). ``save()`` runs after each level, so a restart loses at most one level."""
    entry = servers.setdefault(name, {})
    done = entry.setdefault("levels", {})
    if all(str(c) in done for c in levels):
        return done

    def keep(c: int, level: dict) -> None:
        done[str(c)] = level
        save()

    with start() as url:
        sweep(url, prompts, levels, repeats=repeats, done=done, on_level=keep, desc=name, **ask)
    return done
