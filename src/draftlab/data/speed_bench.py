"""NVIDIA's SPEED-Bench (hub dataset ``nvidia/SPEED-Bench``), read from a local copy.

The dataset has six configs, each with one ``test`` split and the same columns: ``question_id`` (str),
``category``, ``sub_category``, ``turns`` (list of user turns), ``source``, ``src_id``, ``difficulty`` and
``multiturn`` (bool). ``qualitative`` (880 prompts, 80 in each of 11 categories: coding, humanities, math,
multilingual, qa, rag, reasoning, roleplay, stem, summarization, writing) measures acceptance;
``throughput_1k`` / ``_2k`` / ``_8k`` / ``_16k`` / ``_32k`` (1,536 prompts each of about that many input
tokens) have the categories ``low_entropy`` / ``mixed`` / ``high_entropy`` (512 each). This is the layout of
the dataset card's ``dataset_info`` and of NVIDIA's own loader (Model-Optimizer
``examples/specdec_bench/specdec_bench/datasets/speed.py``); it could not be checked against a download here.

Where the files are looked for, under ``bench.path``, for ``bench.split`` = S:

* ``S/`` and the folders below it: every ``*.parquet``, ``*.jsonl`` and ``*.json`` in name order. The hub
  download keeps one folder per config (``qualitative/test-00000-of-00001.parquet``), and NVIDIA's
  ``prepare_data.py`` writes ``<output_dir>/speed/S/test.parquet`` (so ``bench.path`` is ``<output_dir>/speed``);
* else ``S.parquet``, ``S.jsonl`` or ``S.json`` directly in ``bench.path``.

A JSON row may carry OpenAI-style ``messages`` (``[{"role", "content"}]``, as AIPerf's SPEED-Bench JSONL does)
instead of ``turns``; its user messages are the turns. The model answers every turn itself, as for MT-bench.

Rows whose source licence forbids redistribution ship with a placeholder in place of the prompt (about half of
``qualitative``), to be filled in by NVIDIA's ``prepare_data.py``. A placeholder is an error by default, since
evaluating it would measure the placeholder; ``unresolved: skip`` drops those rows instead, and says how many.
Categories that match Spec-Bench's (coding, math, ...) land in the same table columns; the others
(multilingual, the entropy tiers) are reported by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftlab.data.benchmarks import Question, select_questions
from draftlab.data.conversations import RecordLocation, iter_json_records
from draftlab.data.errors import DataError
from draftlab.data.sources import resolve_path
from draftlab.utils.errors import ConfigError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

HUB_ID = "nvidia/SPEED-Bench"
SPLITS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k", "throughput_32k")
UNRESOLVED = ("error", "skip")
# The text the published files carry in place of a prompt that must be fetched from its source.
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SUFFIXES = (".parquet", ".jsonl", ".json")
PREPARE = ("NVIDIA Model-Optimizer's examples/specdec_bench/prepare_data.py --config {split} --output_dir <dir> "
           "fills them in (point bench.path at <dir>/speed)")


@dataclass
class SpeedBench:
    """SPEED-Bench questions of one split; a Hydra ``_target_`` like :class:`~draftlab.data.sources.BenchmarkSpec`.

    ``path`` is the folder holding the local copy (see the module docstring for its layout), ``split`` a
    config name of :data:`SPLITS`; ``categories`` / ``per_category`` / ``limit`` select as for every bench.
    """

    name: str = "speedbench"
    path: str = ""
    split: str = "qualitative"
    categories: list[str] | None = None
    per_category: int | None = None
    limit: int | None = None
    unresolved: str = "error"  # error | skip

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"expected one of {', '.join(SPLITS)}, got {self.split!r}", field="bench.split")
        if self.unresolved not in UNRESOLVED:
            raise ConfigError(f"expected one of {', '.join(UNRESOLVED)}, got {self.unresolved!r}",
                              field="bench.unresolved")
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("missing: the folder holding the local copy of SPEED-Bench", field="bench.path")

    def load(self, tokenizer: Any = None) -> list[Question]:
        """The selected questions of ``split``. ``tokenizer`` is accepted and ignored, as by ``BenchmarkSpec``."""
        questions: list[Question] = []
        first_seen: dict[Any, str] = {}
        skipped = 0
        for file in split_files(Path(resolve_path(self.path)), self.split):
            for where, q in _read_file(file):
                if q is None:
                    skipped += 1
                    if self.unresolved == "error":
                        raise where.error(f"still the download's placeholder: {PREPARE.format(split=self.split)}, "
                                          "or set bench.unresolved=skip to leave such rows out", "turns")
                    continue
                if q.question_id in first_seen:
                    raise where.error(f"id {q.question_id!r} already used at {first_seen[q.question_id]}",
                                      "question_id")
                first_seen[q.question_id] = _at(where)
                questions.append(q)
        if skipped:
            log.warning("%s/%s: %d row(s) left out, still placeholders (%s)", self.name, self.split, skipped,
                        PREPARE.format(split=self.split))
        if not questions:
            raise DataError(f"no usable questions in split {self.split!r}"
                            + (f" ({skipped} placeholder rows: {PREPARE.format(split=self.split)})" if skipped else ""),
                            file=self.path)
        return select_questions(questions, categories=self.categories, per_category=self.per_category,
                                limit=self.limit)


def _at(where) -> str:
    if where.line is not None:
        return f"{where.file}:{where.line}"
    return f"{where.file}: record {where.record}"


def _download_hint(root: Path) -> str:
    return (f"put a local copy of the hub dataset {HUB_ID} there: on a machine with Hugging Face access, "
            f"`huggingface-cli download {HUB_ID} --repo-type dataset --local-dir {root.absolute()}` (accept the dataset's "
            f"licence on its page first), then copy the folder here, or set bench.path to where it is")


def split_files(root: Path, split: str) -> list[Path]:
    """The data files of ``split`` under ``root`` (layouts in the module docstring); a clear error when none."""
    if not root.is_dir():
        raise DataError(f"SPEED-Bench not found: {_download_hint(root)}", file=root)
    folder = root / split
    if folder.is_dir():
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    else:
        files = [root / f"{split}{s}" for s in SUFFIXES if (root / f"{split}{s}").is_file()]
    if not files:
        present = sorted(s for s in SPLITS if (root / s).is_dir() or any((root / f"{s}{x}").is_file() for x in SUFFIXES))
        raise DataError(f"no {split!r} files ({split}/*.parquet|jsonl|json or {split}.parquet|jsonl|json); splits "
                        f"present: {', '.join(present) or 'none'}; {_download_hint(root)}", file=root)
    return files


def _rows(file: Path) -> Iterator[tuple[RecordLocation, Any]]:
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(file).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"unreadable parquet file: {exc}", file=file) from exc
        for i, row in enumerate(rows):
            yield RecordLocation(str(file), record=i), row
        return
    yield from iter_json_records(file)


def _read_file(file: Path) -> Iterator[tuple[RecordLocation, Question | None]]:
    """``(where, question)`` per row, every field checked; the question is ``None`` for a placeholder row."""
    for where, row in _rows(file):
        if not isinstance(row, dict):
            raise where.error(f"expected an object, got {type(row).__name__}")
        qid = row.get("question_id")
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or qid == "":
            raise where.error("missing, or not a non-empty string or an int", "question_id")
        if not isinstance(row.get("category"), str) or not row["category"]:
            raise where.error("missing or not a non-empty string", "category")
        turns = _turns(row, where)
        if any(t.startswith(PLACEHOLDER) for t in turns):
            yield where, None
            continue
        yield where, Question(qid, row["category"], turns)


def _turns(row: dict, where: RecordLocation) -> list[str]:
    if row.get("turns") is None and isinstance(row.get("messages"), list):
        return _user_messages(row["messages"], where)
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        raise where.error("missing or not a non-empty list (or give 'messages')", "turns")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise where.error(f"expected a non-empty string, got {turn!r:.40}", f"turns[{i}]")
    return list(turns)


def _user_messages(messages: list, where: RecordLocation) -> list[str]:
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise where.error("expected an object with a string 'role'", f"messages[{i}]")
        if m["role"] != "user":
            continue  # the model answers each turn itself
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise where.error(f"expected a non-empty string, got {m.get('content')!r:.40}", f"messages[{i}].content")
        turns.append(m["content"])
    if not turns:
        raise where.error("no user message", "messages")
    return turns
