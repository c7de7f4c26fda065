"""Loading chat conversations from the formats draft-model recipes use, and cleaning them for training.

Every loader returns ``list[Conversation]`` whose messages are ``{"role", "content"}`` dicts with roles
in ``{"system", "user", "assistant", "tool"}``, so the chat-template stage never sees source-specific
role names. Loaders are strict: a malformed line, a missing field or an unknown role raises
:class:`DataError` naming the file, line (or record) and field, because silently skipping rows changes
the training distribution without anyone noticing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from draftlab.data.errors import DataError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

ROLES = ("system", "user", "assistant", "tool")

# ShareGPT dumps name the same speaker many ways (one file holds "gpt", "chatgpt" and "bing" turns).
ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

Schema = Literal["sharegpt", "role_content", "auto"]
_TURN_KEYS = {"sharegpt": ("from", "value"), "role_content": ("role", "content")}
_CONVERSATION_FIELDS = ("conversations", "messages")


@dataclass
class Conversation:
    """One chat: an id and ``{"role", "content"}`` messages with canonical role names."""

    id: str
    messages: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The SpecForge role/content record for this conversation (what ``load_role_content_jsonl`` reads)."""
        return {"id": self.id, "conversations": [dict(m) for m in self.messages]}


# ----------------------------------------------------------------------------------------------------
# reading records


@dataclass
class RecordLocation:
    """Where a record came from, so every error can point at it."""

    file: str
    line: int | None = None
    record: int | None = None

    def error(self, message: str, field: str | None = None) -> DataError:
        return DataError(message, file=self.file, line=self.line, field=field, record=self.record)


def iter_json_records(path: Path) -> Iterator[tuple[RecordLocation, Any]]:
    """Yield ``(location, object)`` for a JSONL file or a file holding one JSON array."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"malformed JSON: {exc.msg} (column {exc.colno})", file=path, line=exc.lineno
                ) from exc
            for i, row in enumerate(rows):
                yield RecordLocation(str(path), record=i), row
            return
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"malformed JSON: {exc.msg} (column {exc.colno})", file=path, line=lineno
                ) from exc
            yield RecordLocation(str(path), line=lineno), row


def _canonical_role(raw: Any, loc: RecordLocation, field_name: str) -> str:
    if not isinstance(raw, str) or raw.strip().lower() not in ROLE_ALIASES:
        known = ", ".join(sorted(ROLE_ALIASES))
        raise loc.error(f"unknown role {raw!r} (known: {known})", field_name)
    return ROLE_ALIASES[raw.strip().lower()]


def _turn_schema(turn: dict, schema: Schema) -> str:
    if schema != "auto":
        return schema
    # datasets unifies struct fields across rows, so absent keys show up as None rather than missing.
    if turn.get("from") is not None or turn.get("value") is not None:
        return "sharegpt"
    return "role_content"


def _parse_record(
    row: Any,
    loc: RecordLocation,
    *,
    schema: Schema,
    conversations_field: str | None = None,
    default_id: str,
) -> Conversation:
    if not isinstance(row, dict):
        raise loc.error(f"expected a JSON object, got {type(row).__name__}")
    if conversations_field is not None:
        candidates: Sequence[str] = (conversations_field,)
    else:
        candidates = _CONVERSATION_FIELDS
    conv_field = next((c for c in candidates if c in row), None)
    if conv_field is None:
        raise loc.error(f"missing field (expected one of: {', '.join(candidates)})", candidates[0])
    turns = row[conv_field]
    if not isinstance(turns, list):
        raise loc.error(f"expected a list of turns, got {type(turns).__name__}", conv_field)

    messages = []
    for i, turn in enumerate(turns):
        where = f"{conv_field}[{i}]"
        if not isinstance(turn, dict):
            raise loc.error(f"expected a turn object, got {type(turn).__name__}", where)
        role_key, content_key = _TURN_KEYS[_turn_schema(turn, schema)]
        if turn.get(role_key) is None:
            raise loc.error("missing field", f"{where}.{role_key}")
        role = _canonical_role(turn[role_key], loc, f"{where}.{role_key}")
        content = turn.get(content_key)
        if content is None:
            content = ""  # some dumps store null for empty turns; normalize() drops them
        if not isinstance(content, str):
            raise loc.error(f"expected a string, got {type(content).__name__}", f"{where}.{content_key}")
        messages.append({"role": role, "content": content})

    raw_id = row.get("id")
    return Conversation(id=default_id if raw_id is None else str(raw_id), messages=messages)


def _default_id(path: Path | str, loc: RecordLocation) -> str:
    index = loc.line if loc.line is not None else loc.record
    return f"{Path(str(path)).stem}-{index}"


def _load_json_file(
    path: str | Path, schema: Schema, conversations_field: str | None = None
) -> list[Conversation]:
    path = Path(path)
    if not path.is_file():
        raise DataError("file not found", file=path)
    convs = [
        _parse_record(
            row,
            loc,
            schema=schema,
            conversations_field=conversations_field,
            default_id=_default_id(path, loc),
        )
        for loc, row in iter_json_records(path)
    ]
    if not convs:
        raise DataError("no conversations", file=path)
    log.info("loaded %d conversations from %s", len(convs), path)
    return convs


def load_sharegpt(path: str | Path) -> list[Conversation]:
    """Load ShareGPT records ``{"id", "conversations": [{"from", "value"}]}`` from JSONL or a JSON array.

    Speaker names are mapped through :data:`ROLE_ALIASES` (human/user -> user; gpt/chatgpt/bard/bing/
    assistant/model -> assistant; system; tool/function/observation -> tool).
    """
    return _load_json_file(path, "sharegpt")


def load_role_content_jsonl(path: str | Path) -> list[Conversation]:
    """Load SpecForge role/content records ``{"id", "conversations"|"messages": [{"role", "content"}]}``."""
    return _load_json_file(path, "role_content")


_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def load_hf_dataset(
    path_or_name: str,
    split: str = "train",
    *,
    data_files: Any = None,
    conversations_field: str | None = None,
    **kwargs: Any,
) -> list[Conversation]:
    """Load conversations through ``datasets.load_dataset`` (hub names, builder names or local files).

    A path to a local ``.json``/``.jsonl``/``.parquet``/``.csv``/``.arrow`` file is loaded with the
    matching builder. ShareGPT (``from``/``value``) and role/content turns are detected per turn; the
    list of turns is read from ``conversations_field`` or else ``conversations``/``messages``. Rows
    without an ``id`` get ``<name>-<row>``; a ``prompt_id`` (UltraChat) is used when present.
    """
    import datasets

    local = Path(path_or_name)
    if data_files is None and local.is_file() and local.suffix in _HF_BUILDERS:
        builder, data_files = _HF_BUILDERS[local.suffix], str(local)
    else:
        builder = path_or_name
    if data_files is not None:
        kwargs["data_files"] = data_files
    ds = datasets.load_dataset(builder, split=split, **kwargs)

    name = Path(path_or_name).stem if local.exists() else path_or_name.replace("/", "_")
    convs = []
    for i, row in enumerate(ds):
        loc = RecordLocation(path_or_name, record=i)
        if row.get("id") is None and row.get("prompt_id") is not None:
            row = {**row, "id": row["prompt_id"]}
        convs.append(
            _parse_record(
                row, loc, schema="auto", conversations_field=conversations_field, default_id=f"{name}-{i}"
            )
        )
    if not convs:
        raise DataError("no conversations", file=path_or_name)
    log.info("loaded %d conversations from %s (%s)", len(convs), path_or_name, split)
    return convs


_ANNOTATION = re.compile(r"<<[^<>]*>>")


def load_gsm8k(path: str | Path, *, strip_annotations: bool = True) -> list[Conversation]:
    """Load GSM8K ``{"question", "answer"}`` rows as one user -> assistant exchange each.

    ``strip_annotations`` removes the calculator annotations (``<<48/2=24>>``): they are an artefact
    of how the dataset was written, not text a chat target produces, so training a drafter on them
    would teach it tokens the target never emits. Ids are ``gsm8k-<line>``.
    """
    path = Path(path)
    convs = []
    for loc, row in iter_json_records(path):
        if not isinstance(row, dict):
            raise loc.error(f"expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise loc.error("missing or not a string", key)
        answer = _ANNOTATION.sub("", row["answer"]) if strip_annotations else row["answer"]
        index = loc.line if loc.line is not None else loc.record
        convs.append(
            Conversation(
                id=f"gsm8k-{index}",
                messages=[
                    {"role": "user", "content": row["question"]},
                    {"role": "assistant", "content": answer},
                ],
            )
        )
    if not convs:
        raise DataError("no conversations", file=path)
    return convs


def _sniff_json(path: Path) -> str:
    """Guess the loader for a JSON/JSONL file from its first record."""
    for loc, row in iter_json_records(path):
        if not isinstance(row, dict):
            raise loc.error(f"expected a JSON object, got {type(row).__name__}")
        if "question" in row and "answer" in row and not any(k in row for k in _CONVERSATION_FIELDS):
            return "gsm8k"
        return "auto"
    raise DataError("no conversations", file=path)


def load_conversations(
    source: str | Path,
    format: Literal["auto", "sharegpt", "jsonl", "hf", "gsm8k"] = "auto",
    **kw: Any,
) -> list[Conversation]:
    """Load conversations from ``source`` with the loader named by ``format``.

    ``auto`` reads local ``.json``/``.jsonl`` files directly (ShareGPT or role/content turns detected per
    turn, GSM8K rows by their ``question``/``answer`` keys) and hands anything else (other file types,
    directories, hub names) to :func:`load_hf_dataset`. Extra keywords go to the chosen loader.
    """
    if format == "sharegpt":
        return load_sharegpt(source, **kw)
    if format == "jsonl":
        return load_role_content_jsonl(source, **kw)
    if format == "hf":
        return load_hf_dataset(str(source), **kw)
    if format == "gsm8k":
        return load_gsm8k(source, **kw)
    if format != "auto":
        raise DataError(f"unknown format {format!r} (expected auto, sharegpt, jsonl, hf or gsm8k)")
    path = Path(source)
    if path.is_file() and path.suffix in (".json", ".jsonl"):
        if _sniff_json(path) == "gsm8k":
            return load_gsm8k(path, **kw)
        return _load_json_file(path, "auto", **kw)
    return load_hf_dataset(str(source), **kw)


# ----------------------------------------------------------------------------------------------------
# normalisation


@dataclass
class NormalizeReport:
    """What :func:`normalize` did, in counts. ``input == kept + dropped_*`` always holds."""

    input: int = 0
    kept: int = 0
    dropped_empty: int = 0
    dropped_no_pair: int = 0
    dropped_short: int = 0
    reanchored: int = 0
    removed_leading_turns: int = 0
    removed_empty_turns: int = 0
    merged_turns: int = 0
    trimmed_trailing_turns: int = 0
    removed_system: int = 0
    added_system: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_empty + self.dropped_no_pair + self.dropped_short

    def __str__(self) -> str:
        counts = ", ".join(
            f"{f.name}={getattr(self, f.name)}" for f in fields(self)[2:] if getattr(self, f.name)
        )
        return f"normalize: kept {self.kept}/{self.input} conversations" + (f" ({counts})" if counts else "")


def normalize(
    convs: Iterable[Conversation],
    *,
    system_prompt: str | None = None,
    drop_system: bool = False,
    min_turns: int = 1,
) -> tuple[list[Conversation], NormalizeReport]:
    """Clean conversations for training; returns the kept conversations (new objects) and a report.

    In order, per conversation:

    1. Turns whose content is empty or whitespace are removed; a conversation left with nothing is
       dropped (``dropped_empty``). An empty assistant turn would teach the drafter to end the turn at
       once, and an empty user turn carries nothing to condition on.
    2. ``drop_system`` removes every system turn; ``system_prompt`` is then prepended when the
       conversation does not start with a system turn (so both together replace the system prompt).
    3. Re-anchoring: every non-system turn before the first user turn is removed (``reanchored``).
       ShareGPT V3 splits long chats into continuations that start mid-dialogue with an assistant
       reply; kept as is, the template would render that reply directly after the system prompt and
       the drafter would be trained to answer a question nobody asked.
    4. Consecutive turns of the same role are merged, joined by a blank line (``merged_turns``).
       Merging keeps every supervised token, whereas dropping would lose content; and several
       templates (Mistral, Gemma) reject non-alternating roles outright.
    5. Turns after the last assistant turn are trimmed (``trimmed_trailing_turns``): they carry no loss
       and only cost sequence length.
    6. Conversations with no user -> assistant exchange are dropped (``dropped_no_pair``), and those
       with fewer than ``min_turns`` assistant turns (``dropped_short``).
    """
    report = NormalizeReport()
    kept: list[Conversation] = []
    for conv in convs:
        report.input += 1
        msgs = [dict(m) for m in conv.messages if isinstance(m.get("content"), str) and m["content"].strip()]
        report.removed_empty_turns += len(conv.messages) - len(msgs)
        if not msgs:
            report.dropped_empty += 1
            continue

        if drop_system:
            before = len(msgs)
            msgs = [m for m in msgs if m["role"] != "system"]
            report.removed_system += before - len(msgs)
        if system_prompt is not None and (not msgs or msgs[0]["role"] != "system"):
            msgs.insert(0, {"role": "system", "content": system_prompt})
            report.added_system += 1

        start = 1 if msgs and msgs[0]["role"] == "system" else 0
        first_user = next((i for i in range(start, len(msgs)) if msgs[i]["role"] == "user"), len(msgs))
        if first_user > start:
            report.reanchored += 1
            report.removed_leading_turns += first_user - start
            msgs = msgs[:start] + msgs[first_user:]

        merged: list[dict] = []
        for m in msgs:
            if merged and merged[-1]["role"] == m["role"]:
                merged[-1]["content"] = merged[-1]["content"] + "\n\n" + m["content"]
                report.merged_turns += 1
            else:
                merged.append(m)
        msgs = merged

        last_assistant = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
        if last_assistant < 0 or not any(m["role"] == "user" for m in msgs[:last_assistant]):
            report.dropped_no_pair += 1
            continue
        report.trimmed_trailing_turns += len(msgs) - last_assistant - 1
        msgs = msgs[: last_assistant + 1]
        if sum(m["role"] == "assistant" for m in msgs) < min_turns:
            report.dropped_short += 1
            continue
        kept.append(Conversation(id=conv.id, messages=msgs))
        report.kept += 1
    return kept, report
