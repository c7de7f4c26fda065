"""Long-context benchmark: L-Eval documents and needle-in-a-haystack prompts fitted to a token budget.

The files (``data/long_context/*.jsonl`` of the shared data directory, "Long-context schema" in its README) hold one
single-turn prompt per line: ``{"id", "question_id", "category", "turns": [instruction + document],
"reference": answer | [answers], "source", "chars"}``. Their integer ``question_id`` restarts in every
file, so the string ``id`` is the question id here.

Prompts run from 16k to 128k characters, most beyond an 8k-token context. With a tokenizer, each
prompt is measured exactly as the engine will see it (:func:`~draftlab.data.template.render_prompt`
on the single user turn) and one over ``max_prompt_tokens`` is fitted by its source's ``fit``:

* ``truncate`` cuts the middle of the document, keeping the head (the instruction) and the tail (the
  question), with a short marker where the cut is;
* ``drop`` removes the prompt: a cut could remove a NIAH needle, and the question would be unanswerable.

Without a tokenizer nothing is fitted (the config tests only check that the files load).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftlab.data.benchmarks import Question, select_questions
from draftlab.data.conversations import iter_json_records
from draftlab.data.errors import DataError
from draftlab.data.sources import resolve_path
from draftlab.data.template import render_prompt
from draftlab.utils.errors import ConfigError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

FITS = ("truncate", "drop")
# Put where the middle of a document was cut, so the model (and a reader of the answers) can tell.
CUT_MARKER = "\n[...]\n"


@dataclass
class LongContextSource:
    """One long-context file and what to do with its prompts that exceed the budget."""

    path: str
    fit: str = "truncate"  # truncate | drop


@dataclass
class LongContextBench:
    """A long-context question set; a Hydra ``_target_`` like :class:`~draftlab.data.sources.BenchmarkSpec`.

    ``max_prompt_tokens`` defaults to 7936 so that the prompt, 128 new tokens and the verify scratch rows
    fit an 8k context. ``score_categories`` are fnmatch patterns of the categories whose answers are
    scored by :func:`reference_found` (NIAH: is the needle's number in the answer).
    """

    name: str = "long_context"
    sources: list[Any] = field(default_factory=list)
    max_prompt_tokens: int | None = 7936
    categories: list[str] | None = None
    per_category: int | None = None
    limit: int | None = None
    score_categories: list[str] = field(default_factory=lambda: ["niah_*"])

    def __post_init__(self) -> None:
        # Hydra hands nested blocks over as dicts (or DictConfigs): turn each into a checked source.
        if not isinstance(self.sources, Sequence) or isinstance(self.sources, str) or not self.sources:
            raise ConfigError("expected a non-empty list of {path, fit}", field="bench.sources")
        self.sources = [_source(s, i) for i, s in enumerate(self.sources)]
        if self.max_prompt_tokens is not None and (
                not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens <= 0):
            raise ConfigError(f"expected a positive int or null, got {self.max_prompt_tokens!r}",
                              field="bench.max_prompt_tokens")
        if isinstance(self.score_categories, str) or not all(isinstance(p, str) for p in self.score_categories):
            raise ConfigError(f"expected a list of fnmatch patterns, got {self.score_categories!r}",
                              field="bench.score_categories")
        self.score_categories = list(self.score_categories)

    def scored(self, category: str) -> bool:
        """Whether answers in ``category`` are scored by :func:`reference_found`."""
        return any(fnmatch.fnmatchcase(category, p) for p in self.score_categories)

    def load(self, tokenizer: Any = None) -> list[Question]:
        """The questions of every source, fitted to ``max_prompt_tokens`` when a tokenizer is given, then
        selected by ``categories`` / ``per_category`` / ``limit`` (selection after fitting, so a limit
        counts prompts that will actually run)."""
        rows: list[tuple[Question, str]] = []
        first_seen: dict[str, str] = {}
        for source in self.sources:
            for loc, q in _read_source(resolve_path(source.path), self):
                if q.question_id in first_seen:
                    raise loc.error(f"id {q.question_id!r} already used at {first_seen[q.question_id]}", "id")
                first_seen[q.question_id] = f"{loc.file}:{loc.line}"
                rows.append((q, source.fit))
        if tokenizer is not None and self.max_prompt_tokens is not None:
            questions = self._fit(tokenizer, rows)
        else:
            questions = [q for q, _ in rows]
        return select_questions(questions, categories=self.categories, per_category=self.per_category,
                                limit=self.limit)

    def _fit(self, tokenizer: Any, rows: list[tuple[Question, str]]) -> list[Question]:
        kept, truncated, dropped = [], 0, 0
        for q, fit in rows:
            text = q.turns[0]
            n = prompt_tokens(tokenizer, text)
            if n <= self.max_prompt_tokens:
                kept.append(q)
            elif fit == "drop":
                dropped += 1
            else:
                cut = truncate_middle(tokenizer, text, self.max_prompt_tokens, rendered=n)
                kept.append(Question(q.question_id, q.category, [cut], q.reference))
                truncated += 1
        log.info("%s: %d of %d prompts fit %d tokens (%d cut in the middle, %d dropped)", self.name, len(kept),
                 len(rows), self.max_prompt_tokens, truncated, dropped)
        if not kept:
            raise DataError(f"{self.name}: no prompt fits max_prompt_tokens={self.max_prompt_tokens}")
        return kept


def _source(raw: Any, i: int) -> LongContextSource:
    where = f"bench.sources[{i}]"
    if isinstance(raw, LongContextSource):
        source = raw
    elif isinstance(raw, Mapping):
        unknown = set(raw) - {"path", "fit"}
        if unknown:
            raise ConfigError(f"unknown keys {sorted(unknown)} (known: path, fit)", field=where)
        source = LongContextSource(**dict(raw))
    else:
        raise ConfigError(f"expected {{path, fit}}, got {type(raw).__name__}", field=where)
    if not isinstance(source.path, str) or not source.path:
        raise ConfigError("missing or not a string", field=f"{where}.path")
    if source.fit not in FITS:
        raise ConfigError(f"expected one of {', '.join(FITS)}, got {source.fit!r}", field=f"{where}.fit")
    return source


def _read_source(path: str, bench: LongContextBench):
    """Yield ``(location, Question)`` for each row of one file, every field checked."""
    if not Path(path).is_file():
        raise DataError("file not found", file=path)
    n = 0
    for loc, row in iter_json_records(Path(path)):
        if not isinstance(row, dict):
            raise loc.error(f"expected a JSON object, got {type(row).__name__}")
        if not isinstance(row.get("id"), str) or not row["id"]:
            raise loc.error("missing or not a non-empty string", "id")
        if not isinstance(row.get("category"), str) or not row["category"]:
            raise loc.error("missing or not a non-empty string", "category")
        turns = row.get("turns")
        # One turn: a later turn would follow the model's own answer, whose length cannot be fitted here.
        if not isinstance(turns, list) or len(turns) != 1:
            raise loc.error("expected a list of exactly one turn (instruction + document)", "turns")
        if not isinstance(turns[0], str) or not turns[0].strip():
            raise loc.error(f"expected a non-empty string, got {type(turns[0]).__name__}", "turns[0]")
        reference = row.get("reference")
        if reference is not None:
            _check_reference(reference, loc)
        elif bench.scored(row["category"]):
            raise loc.error(f"missing; category {row['category']!r} is scored against it", "reference")
        n += 1
        yield loc, Question(row["id"], row["category"], [turns[0]], reference)
    if n == 0:
        raise DataError("no questions", file=path)


def _check_reference(reference: Any, loc) -> None:
    if isinstance(reference, str):
        if not reference.strip():
            raise loc.error("empty string", "reference")
        return
    if not isinstance(reference, list) or not reference:
        raise loc.error(f"expected a string or a non-empty list of strings, got {type(reference).__name__}",
                        "reference")
    for i, r in enumerate(reference):
        if not isinstance(r, str) or not r.strip():
            raise loc.error(f"expected a non-empty string, got {r!r}", f"reference[{i}]")


def prompt_tokens(tokenizer: Any, text: str) -> int:
    """Length of the prompt the engine decodes from: the chat template around one user turn."""
    return len(render_prompt(tokenizer, [{"role": "user", "content": text}]))


def truncate_middle(tokenizer: Any, text: str, budget: int, *, rendered: int | None = None) -> str:
    """``text`` with its middle replaced by :data:`CUT_MARKER` so that its rendered prompt has at most
    ``budget`` tokens, keeping as many of its first and last tokens (in equal shares) as fit.

    The cut is placed on token boundaries of ``text`` tokenised alone; re-tokenising the joined text
    inside the template can merge differently at the seams, so the result is re-measured and the kept
    share shrunk by the excess until it fits (one or two rounds in practice). ``rendered``: the
    prompt length of the whole ``text`` when the caller has measured it already (tokenising a 30k-token
    document is most of the cost).
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n_text = len(offsets)
    # Template tokens around the turn, plus the marker's own tokens.
    overhead = (prompt_tokens(tokenizer, text) if rendered is None else rendered) - n_text
    marker = len(tokenizer(CUT_MARKER, add_special_tokens=False)["input_ids"])
    keep = min(n_text - 1, budget - overhead - marker)
    for _ in range(16):
        if keep <= 1:
            break
        head = (keep + 1) // 2
        tail = keep - head
        cut = text[:offsets[head - 1][1]] + CUT_MARKER + text[offsets[n_text - tail][0]:]
        excess = prompt_tokens(tokenizer, cut) - budget
        if excess <= 0:
            return cut
        keep -= excess
    raise DataError(f"cannot cut a {n_text}-token prompt to {budget} tokens: the chat template alone takes "
                    f"{overhead} (raise max_prompt_tokens)")


def reference_found(answer_text: str, reference: str | Sequence[str]) -> bool:
    """Whether any reference string (a NIAH needle's number) appears in the answer text.

    References are compared stripped, so a stored ``"5614226\\n"`` still matches ``"... 5614226."``.
    """
    refs = [reference] if isinstance(reference, str) else list(reference)
    if not refs or not all(isinstance(r, str) and r.strip() for r in refs):
        raise ValueError(f"reference must be a non-empty string or a list of them, got {reference!r}")
    return any(r.strip() in answer_text for r in refs)
