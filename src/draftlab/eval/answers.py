"""Answer files in Spec-Bench's format: one JSON object per question, one line each.

A line, as Spec-Bench's ``evaluation/eval.py`` writes it::

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "...", "tstamp": 1.7e9,
     "choices": [{"index": 0,
                  "turns": ["answer to turn 1", "answer to turn 2"],   # decoded text per turn
                  "decoding_steps": [31, 40],                          # target verify passes per turn
                  "new_tokens": [120, 161],                            # generated tokens per turn
                  "wall_time": [1.92, 2.41],                           # seconds per turn
                  "prefill_time": [0.31, 0.35],                        # of which prefill, per turn
                  "accept_lengths": [4, 3, 1, ...],                    # per verify round, all turns pooled
                  "tau": [3.0, 2.4],                                   # per turn (draftlab's addition)
                  "acceptance": [[0.9, 0.7, 0.4], [0.8, 0.6]]}]}       # per turn, per draft position

``accept_lengths`` counts the tokens committed in each round, the bonus token included, so vanilla
decoding writes a list of ones. ``prefill_time`` (draftlab's addition, optional so that older files and
Spec-Bench's own still load) is the part of each turn's ``wall_time`` spent on the prompt, which decode-only
timing subtracts (``draftlab.eval.metrics``). Spec-Bench's name for the per-turn step count is ``decoding_steps``;
it is kept so its own ``speed.py`` and ``equal.py`` read these files unchanged. Extra keys (in the record
or in a choice) are allowed and kept.

``tau`` and ``acceptance`` (draftlab's additions, optional: files written before them still load) are the
per-request numbers that ``accept_lengths`` loses by pooling the turns. A turn's ``tau`` is its mean accept
length, the bonus token included (:func:`turn_tau`, ``DecodeStats.tau``; ``null`` for a turn without a verify
round). Its ``acceptance`` holds, per draft position i, the share of its rounds that accepted more than i
drafted tokens (:func:`acceptance_rates`): vLLM's per-position acceptance rate, so a served answer and a
draftlab answer compare entry by entry. The two agree by construction: ``tau = 1 + sum(acceptance)``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftlab.data.errors import DataError

_REQUIRED_CHOICE_LISTS = ("turns", "new_tokens", "wall_time", "accept_lengths")


def answer_record(question, turns: Sequence, model_id: str, *, index: int = 0, **extra: Any) -> dict:
    """Build one answer record from a :class:`~draftlab.data.benchmarks.Question` and its answered turns.

    ``turns`` are the :class:`~draftlab.eval.turns.TurnAnswer` objects that
    :func:`~draftlab.eval.turns.answer_question` returns (anything with ``text`` and a
    :class:`~draftlab.decoding.engine.DecodeStats` ``stats``). ``extra`` keys go into the top-level record.
    """
    choice = {
        "index": index,
        "turns": [t.text for t in turns],
        "decoding_steps": [t.stats.rounds for t in turns],
        "new_tokens": [t.stats.new_tokens for t in turns],
        "wall_time": [t.stats.wall_time for t in turns],
        "prefill_time": [t.stats.prefill_time for t in turns],
        "accept_lengths": [a for t in turns for a in t.stats.accept_lengths],
        # seconds in the drafter's propose and in the verify passes, per turn (cost models read them)
        "draft_time": [sum(t.stats.draft_times) for t in turns],
        "verify_time": [sum(t.stats.verify_times) for t in turns],
        "tau": [turn_tau(t.stats.accept_lengths) for t in turns],
        "acceptance": [acceptance_rates(t.stats.accept_lengths) for t in turns],
    }
    drafter_stats = [getattr(t.stats, "drafter_stats", None) for t in turns]
    if any(d is not None for d in drafter_stats):
        choice["drafter_stats"] = drafter_stats  # per turn, what the drafter reported (e.g. exit depths)
    record = {
        "question_id": question.question_id,
        "category": question.category,
        "answer_id": uuid.uuid4().hex,
        "model_id": model_id,
        "choices": [choice],
        "tstamp": time.time(),
    }
    record.update(extra)
    return record


def turn_tau(accept_lengths: Sequence[int]) -> float | None:
    """Tokens committed per verify round, the bonus token included (``None`` without a round).

    The mean of the accept lengths, not ``new_tokens / rounds``: the first new token comes from the prefill,
    not from a verify round, so counting it would put AR above 1 and diverge from the pooled τ of
    :mod:`draftlab.eval.metrics` and from a served engine's ``1 + accepted / drafts``.
    """
    return sum(accept_lengths) / len(accept_lengths) if accept_lengths else None


def acceptance_rates(accept_lengths: Sequence[int]) -> list[float]:
    """Per draft position i, the share of rounds whose accepted draft tokens (accept length - 1) exceed i.

    The list stops at the longest accepted run: the engine's statistics do not record how deep the drafter
    proposed, and a position past the end has rate 0 (no round got past it). AR rounds accept nothing, so
    AR gives ``[]``, as does a turn without a round.
    """
    if not accept_lengths:
        return []
    accepted = [a - 1 for a in accept_lengths]
    return [sum(a > i for a in accepted) / len(accepted) for i in range(max(0, max(accepted)))]


def validate_answer(record: Any, *, file: str | Path | None = None, line: int | None = None) -> dict:
    """Check one answer record's shape; raises :class:`DataError` naming ``file:line`` and the field."""

    def fail(message: str, field: str | None = None) -> DataError:
        return DataError(message, file=file, line=line, field=field)

    if not isinstance(record, dict):
        raise fail(f"expected a JSON object, got {type(record).__name__}")
    qid = record.get("question_id")
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise fail("missing, or not an int or string", "question_id")
    if not isinstance(record.get("category"), str):
        raise fail("missing or not a string", "category")
    choices = record.get("choices")
    if not isinstance(choices, list) or not choices:
        raise fail("missing or not a non-empty list", "choices")
    for c, choice in enumerate(choices):
        where = f"choices[{c}]"
        if not isinstance(choice, dict):
            raise fail(f"expected a JSON object, got {type(choice).__name__}", where)
        for key in _REQUIRED_CHOICE_LISTS:
            if not isinstance(choice.get(key), list):
                raise fail("missing or not a list", f"{where}.{key}")
        n_turns = len(choice["turns"])
        if n_turns == 0:
            raise fail("no turns", f"{where}.turns")
        for key in ("new_tokens", "wall_time", "decoding_steps"):
            if key in choice and (not isinstance(choice[key], list) or len(choice[key]) != n_turns):
                raise fail(f"expected a list with one entry per turn ({n_turns})", f"{where}.{key}")
        for i, text in enumerate(choice["turns"]):
            if not isinstance(text, str):
                raise fail(f"expected a string, got {type(text).__name__}", f"{where}.turns[{i}]")
        for key in ("new_tokens", "accept_lengths", "decoding_steps"):
            for i, v in enumerate(choice.get(key, [])):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise fail(f"expected a non-negative int, got {v!r}", f"{where}.{key}[{i}]")
        stats = choice.get("drafter_stats")
        if stats is not None:
            if not isinstance(stats, list) or len(stats) != n_turns:
                raise fail(f"expected a list with one entry per turn ({n_turns})", f"{where}.drafter_stats")
            for i, d in enumerate(stats):
                if d is not None and not (isinstance(d, dict) and all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values())):
                    raise fail(f"expected null or an object of numbers, got {d!r}", f"{where}.drafter_stats[{i}]")
        for i, v in enumerate(choice["wall_time"]):
            if not _non_negative_number(v):
                raise fail(f"expected a non-negative number, got {v!r}", f"{where}.wall_time[{i}]")
        _check_prefill_time(choice, n_turns, where, fail)
        _check_per_turn_metrics(choice, n_turns, where, fail)
    return record


def _non_negative_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _check_prefill_time(choice: dict, n_turns: int, where: str, fail) -> None:
    """``prefill_time``, when present: one non-negative number per turn, each within its turn's wall time."""
    if "prefill_time" not in choice:
        return
    prefill = choice["prefill_time"]
    if not isinstance(prefill, list) or len(prefill) != n_turns:
        raise fail(f"expected a list with one entry per turn ({n_turns})", f"{where}.prefill_time")
    for i, (p, wall) in enumerate(zip(prefill, choice["wall_time"])):
        if not _non_negative_number(p):
            raise fail(f"expected a non-negative number, got {p!r}", f"{where}.prefill_time[{i}]")
        if p > wall:
            raise fail(f"prefill time {p} exceeds the turn's wall_time {wall}", f"{where}.prefill_time[{i}]")


def _check_per_turn_metrics(choice: dict, n_turns: int, where: str, fail) -> None:
    """``tau`` and ``acceptance``, when present: one entry per turn; a τ is null or at least 0, a rate in [0, 1]."""
    for key in ("tau", "acceptance"):
        if key in choice and (not isinstance(choice[key], list) or len(choice[key]) != n_turns):
            raise fail(f"expected a list with one entry per turn ({n_turns})", f"{where}.{key}")
    for i, tau in enumerate(choice.get("tau", [])):
        if tau is not None and not _non_negative_number(tau):
            raise fail(f"expected null or a non-negative number, got {tau!r}", f"{where}.tau[{i}]")
    for i, rates in enumerate(choice.get("acceptance", [])):
        if not isinstance(rates, list):
            raise fail(f"expected a list of rates, got {type(rates).__name__}", f"{where}.acceptance[{i}]")
        for j, r in enumerate(rates):
            if not _non_negative_number(r) or r > 1:
                raise fail(f"expected a rate in [0, 1], got {r!r}", f"{where}.acceptance[{i}][{j}]")


def write_answer(path: str | Path, record: dict) -> None:
    """Append one validated answer record as a line of ``path`` (created with its parents if missing).

    Appending, as Spec-Bench does, lets an interrupted run keep what it already answered.
    """
    validate_answer(record, file=path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def load_answers(path: str | Path) -> list[dict]:
    """Read an answer file; every line is validated and errors name ``file:line``.

    A question id answered twice is an error rather than last-one-wins: both copies would otherwise
    count in a speed-up and the metrics would silently weigh that question double.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError("file not found", file=path)
    records: list[dict] = []
    seen: dict[Any, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"malformed JSON: {exc.msg} (column {exc.colno})", file=path, line=lineno) from exc
            record = validate_answer(row, file=path, line=lineno)
            qid = record["question_id"]
            if qid in seen:
                raise DataError(f"question {qid!r} already answered on line {seen[qid]}", file=path, line=lineno,
                                field="question_id")
            seen[qid] = lineno
            records.append(record)
    if not records:
        raise DataError("no answers", file=path)
    return records
