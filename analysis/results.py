"""Load run records (``record.json``) from run and sweep directories, and group them into table rows.

The contract this module reads (schema ``draftlab.record/1``; one file per run directory, a Hydra
multirun sweep being ``<sweep>/<job_num>/record.json``)::

    {"schema": "draftlab.record/1", "kind": "eval" | "train", "run_name": str, "group": str, "tags": [str],
     "choices": {"method": ..., "target": ..., "bench": ..., ...},   # Hydra group choices
     "overrides": [str], "config": {...}, "git": {"commit": str, "dirty": bool}, "hardware": {...},
     "artifacts": {"draft": str | null, "data": str | null},
     "draft": {"path": str | null, "sha256": str | null, "step": int | null},   # the evaluated draft (optional)
     "metrics": {"eval/specbench/CODE/tau": float, "eval/specbench/AVG/speedup": float, ...},
     "eval": {"bench", "method", "label", "temperature",
              "axes": {"nodes": int, "ttt_length": int, ...},    # declared by conf/method/<m>.yaml
              "method_config": {...},                           # the resolved method config (drafter included)
              "max_new_tokens": int, "timing": str,
              "columns": {"WRIT": {"tau", "speedup", "n_questions", "method_tps", "ar_tps",
                                   "tau_ci": [lo, hi], "speedup_ci": [lo, hi]}, ..., "AVG": {...}},
              "accept_lengths": {"1": count, ...}, "mismatches_vs_ar": int | null,
              "questions": [{"question_id", "category", "accepted": int, "rounds": int, "tps", "ar_tps"}],  # τ, SR and
              "interval": {"method", "resamples", "level", "seed", "min_questions"},  # *_ci come from (not in older records)
              "baselines": {name: {"method", "label", "axes", "columns", "categories", "accept_lengths",
                                   "mismatches_vs_ar"}}} | null,      # drafters run beside it (optional)
     "train": {"history": [{"step": int, "<metric>": float, ...}], "best": {...}} | null}

``git.dirty`` says whether the job ran from a tree with uncommitted changes; a record without it (or
without a commit) is of unknown provenance, never taken for clean. ``draft`` names the weights evaluated
(``sha256`` over the draft's state dict, ``step`` the training step they were saved at); records written
before it existed have none.

Each entry of ``eval.baselines`` answered the same questions in the same process against the same AR
run; :func:`load_records` returns it as a record of its own (:func:`baseline_records`), so tables hold
those rows beside the method's. Only ``schema``, ``kind`` and ``run_name`` are required; every other key may be absent or null. When an
eval record has no ``eval.columns``, the columns are rebuilt from the flat ``metrics`` keys
``eval/<bench>/<column>/<name>`` (a column name may itself contain a slash, as ``M/R`` does). The AR
throughput of a cell is ``ar_tps``; records written before that name call it ``baseline_tps``, read here as
``ar_tps`` (cells only ever hold the new name).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftlab.data.benchmarks import CONFU_COLUMNS

SCHEMA_PREFIX = "draftlab.record/"
SCHEMA_VERSION = 1
RECORD_FILE = "record.json"
TABLE_COLUMNS: list[str] = [*CONFU_COLUMNS, "AVG"]
CELL_KEYS = ("tau", "speedup", "n_questions", "method_tps", "ar_tps")
# Cell names older records used -> the name cells carry now.
OLD_CELL_KEYS = {"baseline_tps": "ar_tps"}
# Setting names older run configs used -> the name settings carry now (README "Glossary").
OLD_SETTING_NAMES = {"top_k": "top_k_sampling"}
# Evaluation settings (``eval.<name>``, else the run config's ``eval.<name>`` / ``bench.<name>``) that change
# what a row's τ and SR mean besides bench, target, temperature and the method's axes: tables key rows by them.
EVAL_SETTINGS = (("max_new_tokens", "eval"), ("timing", "eval"), ("max_turns", "eval"), ("top_p", "eval"),
                 ("top_k", "eval"), ("categories", "bench"), ("per_category", "bench"), ("limit", "bench"))


class RecordError(ValueError):
    """A file that claims to be a run record but does not follow the contract; the message names it."""


class RecordWarning(UserWarning):
    """A JSON file skipped because it is not a run record."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Record:
    """One run's record, with accessors for the fields tables and reports use."""

    path: Path
    data: dict

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def kind(self) -> str:
        return self.data["kind"]

    @property
    def has_eval(self) -> bool:
        """Whether the run evaluated something (``draftlab-train`` jobs evaluate after training too)."""
        return bool(self.data.get("eval"))

    @property
    def run_name(self) -> str:
        return self.data["run_name"]

    @property
    def choices(self) -> dict:
        return self.data.get("choices") or {}

    @property
    def metrics(self) -> dict:
        return self.data.get("metrics") or {}

    @property
    def eval(self) -> dict:
        return self.data.get("eval") or {}

    @property
    def train(self) -> dict:
        return self.data.get("train") or {}

    @property
    def label(self) -> str:
        """Row label: ``eval.label``, else the method name, else the run name."""
        return self.eval.get("label") or self.method or self.run_name

    @property
    def method(self) -> str | None:
        return self.eval.get("method") or self.choices.get("method")

    @property
    def bench(self) -> str | None:
        return self.eval.get("bench") or self.choices.get("bench")

    @property
    def target(self) -> str | None:
        return self.choices.get("target")

    @property
    def temperature(self) -> float | None:
        return self.eval.get("temperature")

    @property
    def axes(self) -> dict[str, Any]:
        """The comparison axes the run's method declares (``eval.axes``); records written before axes
        existed carry ``eval.draft_nodes`` / ``eval.ttt_length``, read here as ``nodes`` / ``ttt_length``."""
        axes = dict(self.eval.get("axes") or {})
        for old, new in (("draft_nodes", "nodes"), ("ttt_length", "ttt_length")):
            if new not in axes and self.eval.get(old) is not None:
                axes[new] = self.eval[old]
        return axes

    def axis(self, name: str) -> Any:
        return self.axes.get(name)

    @property
    def nodes(self) -> int | None:
        """Tree nodes per round (axis ``nodes``); None for methods without a tree budget."""
        return self.axis("nodes")

    def eval_setting(self, name: str) -> Any:
        """One of :data:`EVAL_SETTINGS`: the ``eval`` block's value, else the run config's (``None`` when
        neither says); lists come back as tuples so that settings can key rows."""
        section = dict(EVAL_SETTINGS)[name]
        value = self.eval.get(name) if section == "eval" else None
        if value is None:
            block = (self.data.get("config") or {}).get(section) or {}
            value = block.get(name)
            if value is None and name in OLD_SETTING_NAMES:  # a record written before the rename
                value = block.get(OLD_SETTING_NAMES[name])
        return tuple(value) if isinstance(value, list) else value

    @property
    def eval_settings(self) -> dict[str, Any]:
        """Every :data:`EVAL_SETTINGS` entry of this record, in that order."""
        return {name: self.eval_setting(name) for name, _ in EVAL_SETTINGS}

    @property
    def ttt_length(self) -> int | None:
        return self.axis("ttt_length")

    @property
    def mismatches_vs_ar(self) -> int | None:
        return self.eval.get("mismatches_vs_ar")

    @property
    def columns(self) -> dict[str, dict[str, Any]]:
        """``{column: {"tau", "speedup", ...}}`` from ``eval.columns``, else rebuilt from ``metrics``; an old
        cell's ``baseline_tps`` is read as ``ar_tps``."""
        if self.eval.get("columns"):
            return {col: _renamed_cell(cell) for col, cell in self.eval["columns"].items()}
        return columns_from_metrics(self.metrics, self.bench)

    @property
    def questions(self) -> list[dict] | None:
        """The per-question rows (``eval.questions``); None for a record written before they were kept."""
        return list(self.eval["questions"]) if self.eval.get("questions") else None

    @property
    def accept_lengths(self) -> dict[int, int]:
        """Histogram of per-round accept lengths (bonus included), keys as ints, sorted."""
        raw = self.eval.get("accept_lengths") or {}
        return dict(sorted((int(k), int(v)) for k, v in raw.items()))

    @property
    def dirty(self) -> bool | None:
        """Whether the job ran from a tree with uncommitted changes; None when the record does not say
        (no git block, no commit, or no dirty flag)."""
        git = self.data.get("git") or {}
        if not git.get("commit") or not isinstance(git.get("dirty"), bool):
            return None
        return git["dirty"]

    @property
    def draft(self) -> dict[str, Any]:
        """``{"path", "sha256", "step"}`` of the evaluated draft; all None in records that predate it."""
        d = self.data.get("draft") or {}
        return {k: d.get(k) for k in ("path", "sha256", "step")}

    @property
    def history(self) -> list[dict]:
        return self.train.get("history") or []

    def get(self, dotted: str, default: Any = None) -> Any:
        """A nested value by dotted path (``"choices.target"``), or ``default`` when any part is absent."""
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def value(self, column: str, key: str) -> float | None:
        """One table cell: ``columns[column][key]``, or ``None`` when missing."""
        v = self.columns.get(column, {}).get(key)
        return v if _is_number(v) else None


def _renamed_cell(cell: dict) -> dict:
    """``cell`` with its old names (:data:`OLD_CELL_KEYS`) under the new ones; a new name already there wins."""
    if not any(old in cell for old in OLD_CELL_KEYS):
        return cell
    out = {k: v for k, v in cell.items() if k not in OLD_CELL_KEYS}
    for old, new in OLD_CELL_KEYS.items():
        if old in cell and out.get(new) is None:
            out[new] = cell[old]
    return out


def columns_from_metrics(metrics: dict, bench: str | None = None) -> dict[str, dict[str, Any]]:
    """Rebuild per-column cells from flat ``eval/<bench>/<column>/<name>`` metric keys (old cell names, as
    ``baseline_tps``, read as the new ones)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        if not key.startswith("eval/"):
            continue
        rest = key[len("eval/"):]
        bench_name, sep, rest = rest.partition("/")
        if not sep or (bench is not None and bench_name != bench):
            continue
        column, sep, name = rest.rpartition("/")
        if sep and column and (name in CELL_KEYS or name in OLD_CELL_KEYS):
            out.setdefault(column, {})[name] = value
    return {col: _renamed_cell(cell) for col, cell in out.items()}


# One row of eval.questions: its question, accepted tokens and verify rounds, method and AR tok/s.
_QUESTION_CHECKS = (("question_id", lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a string or int"),
                    ("category", lambda v: isinstance(v, str), "a string"),
                    ("accepted", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative int"),
                    ("rounds", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative int"),
                    ("tps", lambda v: _is_number(v) and v >= 0, "a non-negative number"),
                    ("ar_tps", lambda v: _is_number(v) and v >= 0, "a non-negative number"))


def question_problem(rows: Any, where: str) -> str | None:
    """What is wrong with the per-question rows at ``where`` (``eval.questions``), or None when nothing is."""
    rule = f"'{where}' must be a list of objects with keys {', '.join(k for k, _, _ in _QUESTION_CHECKS)}"
    if rows is not None and not isinstance(rows, list):
        return f"{rule}, got {type(rows).__name__}"
    for i, row in enumerate(rows or ()):
        bad = [(k, what) for k, ok, what in _QUESTION_CHECKS if not ok(row.get(k))] if isinstance(row, dict) else []
        if not isinstance(row, dict) or bad:
            return (f"{rule}: '{where}[{i}]' is {row!r}" if not bad
                    else f"{rule}: '{where}[{i}].{bad[0][0]}' must be {bad[0][1]}, got {row.get(bad[0][0])!r}")
    return None


def _check_record(data: dict, path: Path) -> None:
    def fail(message: str) -> RecordError:
        return RecordError(f"{path}: {message}")

    schema = data["schema"]
    version = schema[len(SCHEMA_PREFIX):]
    if version != str(SCHEMA_VERSION):
        raise fail(f"unsupported schema {schema!r} (this reader knows {SCHEMA_PREFIX}{SCHEMA_VERSION})")
    if data.get("kind") not in ("eval", "train"):
        raise fail(f"'kind' must be 'eval' or 'train', got {data.get('kind')!r}")
    if not isinstance(data.get("run_name"), str):
        raise fail("'run_name' missing or not a string")
    for key, types in (("group", str), ("tags", list), ("choices", dict), ("overrides", list), ("config", dict),
                       ("git", dict), ("hardware", dict), ("artifacts", dict), ("metrics", dict), ("eval", dict),
                       ("train", dict)):
        if data.get(key) is not None and not isinstance(data[key], types):
            raise fail(f"'{key}' must be a {types.__name__} or null, got {type(data[key]).__name__}")
    git = data.get("git") or {}
    if git.get("commit") is not None and not isinstance(git["commit"], str):
        raise fail(f"'git.commit' must be a string or null, got {git['commit']!r}")
    if git.get("dirty") is not None and not isinstance(git["dirty"], bool):
        raise fail(f"'git.dirty' must be a boolean or null, got {git['dirty']!r}")
    draft = data.get("draft")
    if draft is not None:
        if not isinstance(draft, dict):
            raise fail(f"'draft' must be an object or null, got {type(draft).__name__}")
        for key, ok, what in (("path", lambda v: isinstance(v, str), "a string"),
                              ("sha256", lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v),
                               "a sha256 hex digest"),
                              ("step", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                               "a non-negative int")):
            if draft.get(key) is not None and not ok(draft[key]):
                raise fail(f"'draft.{key}' must be {what} or null, got {draft[key]!r}")
    ev = data.get("eval") or {}
    for key, ok, what in (("label", lambda v: isinstance(v, str), "a string"),
                          ("temperature", _is_number, "a number"),
                          ("draft_nodes", lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
                          ("ttt_length", lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
                          ("axes", lambda v: isinstance(v, dict), "an object"),
                          ("columns", lambda v: isinstance(v, dict), "an object"),
                          ("accept_lengths", lambda v: isinstance(v, dict), "an object")):
        if ev.get(key) is not None and not ok(ev[key]):
            raise fail(f"'eval.{key}' must be {what} or null, got {ev[key]!r}")
    for column, cell in (ev.get("columns") or {}).items():
        if not isinstance(cell, dict):
            raise fail(f"'eval.columns.{column}' must be an object")
        for key in ("tau", "speedup"):
            if cell.get(key) is not None and not _is_number(cell[key]):
                raise fail(f"'eval.columns.{column}.{key}' must be a finite number or null, got {cell[key]!r}")
        for key in ("tau_ci", "speedup_ci"):
            ci = cell.get(key)
            if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(map(_is_number, ci))):
                raise fail(f"'eval.columns.{column}.{key}' must be [lo, hi] or null, got {ci!r}")
    if problem := question_problem(ev.get("questions"), "eval.questions"):
        raise fail(problem)
    for length, count in (ev.get("accept_lengths") or {}).items():
        if not re.fullmatch(r"\d+", str(length)) or not isinstance(count, int) or count < 0:
            raise fail(f"'eval.accept_lengths' entry {length!r}: {count!r} is not a length -> count")
    history = (data.get("train") or {}).get("history")
    if history is not None:
        if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
            raise fail("'train.history' must be a list of objects")
        for i, h in enumerate(history):
            if not isinstance(h.get("step"), int):
                raise fail(f"'train.history[{i}].step' missing or not an int")


def read_record(path: str | Path) -> Record | None:
    """Read one file: a :class:`Record`, ``None`` (with a :class:`RecordWarning`) for JSON that is not a
    run record, or :class:`RecordError` for a broken record or a file that is not JSON at all."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot read: {exc}") from exc
    schema = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        warnings.warn(f"{path}: not a draftlab run record (no '{SCHEMA_PREFIX}*' schema); skipped",
                      RecordWarning, stacklevel=2)
        return None
    _check_record(data, path)
    return Record(path=path, data=data)


def _natural_key(path: Path) -> list:
    # Hydra numbers jobs 0, 1, ..., 10: sort "10" after "9", not after "1".
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_record_files(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else every ``record.json`` below it, in natural order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RecordError(f"{path}: no such file or directory")
    return sorted(path.rglob(RECORD_FILE), key=_natural_key)


def baseline_records(record: Record) -> list[Record]:
    """The drafters of ``record.eval.baselines`` as eval records of their own: the run's identity, bench
    and temperature, the baseline's label, axes and cells (and no flat metrics, which are the method's)."""
    out = []
    for name, b in (record.eval.get("baselines") or {}).items():
        if not isinstance(b, dict):
            raise RecordError(f"{record.path}: eval.baselines.{name} must be an object, got {type(b).__name__}")
        ev = {"bench": record.bench, "temperature": record.temperature,
              "max_new_tokens": record.eval.get("max_new_tokens"), "method": b.get("method"),
              "label": b.get("label") or name, "axes": b.get("axes") or {}, "columns": b.get("columns") or {},
              "categories": b.get("categories") or {}, "accept_lengths": b.get("accept_lengths") or {},
              "mismatches_vs_ar": b.get("mismatches_vs_ar"), "baseline_of": record.label,
              "questions": b.get("questions"), "interval": b.get("interval")}
        if problem := question_problem(b.get("questions"), f"eval.baselines.{name}.questions"):
            raise RecordError(f"{record.path}: {problem}")
        data = {k: v for k, v in record.data.items() if k not in ("eval", "metrics", "train")}
        data.update(run_name=f"{record.run_name}/{name}", eval=ev, metrics={})
        out.append(Record(path=record.path, data=data))
    return out


def load_records(*paths: str | Path, kind: str | None = None, baselines: bool = True,
                 label: str | None = None) -> list[Record]:
    """All run records under ``paths`` (files or directories, searched recursively), each file once.

    Order follows ``paths``, then natural path order within a directory. ``kind`` keeps only ``"eval"``
    or ``"train"`` records. ``baselines``: each record's ``eval.baselines`` follow it as records of their
    own. ``label``: the row label of every eval record read (not of its baselines), for arms that
    evaluated one method from different drafts. A directory with no records is not an error (a sweep may
    still be running); a path that does not exist is.
    """
    seen: set[Path] = set()
    out: list[Record] = []
    for p in paths:
        for f in find_record_files(p):
            key = f.resolve()
            if key in seen:
                continue
            seen.add(key)
            record = read_record(f)
            if record is not None and label is not None and record.has_eval:
                record = Record(path=record.path, data={**record.data, "eval": {**record.eval, "label": label}})
            if record is not None and (kind is None or record.kind == kind):
                out.append(record)
                if baselines:
                    out.extend(baseline_records(record))
    return out


def eval_answer_files(path: str | Path) -> tuple[dict, dict[str, str]]:
    """(the ``eval`` block, {name: answer file}) of the first evaluation record under ``path``: the run's
    method, the AR run (always under ``ar``; older records said ``baseline``) and every ``eval.baselines`` drafter. A record copied out of its run
    (``experiments/*/records``) keeps its answers beside it in ``answers/``, where they are looked up when
    the recorded paths no longer exist."""
    records = [r for r in load_records(path, baselines=False) if r.data.get("eval")]
    if not records:
        raise RecordError(f"{path}: no evaluation record")
    ev = records[0].data["eval"]
    files = dict(ev["answer_files"])
    if "baseline" in files and "ar" not in files:  # older records named the AR run "baseline"
        files["ar"] = files.pop("baseline")
    for b in (ev.get("baselines") or {}).values():
        files.update({k: v for k, v in b.get("answer_files", {}).items() if k not in ("ar", "baseline")})
    here = records[0].path.parent / "answers"
    return ev, {k: v if Path(v).exists() else str(here / Path(v).name) for k, v in files.items()}


def training_record(path: str | Path) -> Record:
    """The one record with a training history under ``path`` (a run directory or its record.json); a clear
    error when there is none or more than one (a sweep directory)."""
    trained = [r for r in load_records(path, baselines=False) if r.history]
    if len(trained) != 1:
        raise RecordError(f"{path}: expected one training record, found {len(trained)}")
    return trained[0]

def group_records(records: Iterable[Record], key: str | Sequence[str] | Callable[[Record], Any]
                  ) -> dict[Any, list[Record]]:
    """Group records by ``key`` (a callable, an attribute or dotted path, or a list of them -> tuple keys),
    keeping first-seen order of groups and of records within a group."""
    if callable(key):
        fn = key
    else:
        names = [key] if isinstance(key, str) else list(key)

        def one(r: Record, name: str) -> Any:
            if "." not in name and hasattr(Record, name) and isinstance(getattr(Record, name), property):
                return getattr(r, name)
            return r.get(name)

        def fn(r: Record) -> Any:
            values = tuple(one(r, n) for n in names)
            return values[0] if isinstance(key, str) else values

    groups: dict[Any, list[Record]] = {}
    for r in records:
        groups.setdefault(fn(r), []).append(r)
    return groups


def sort_key(value: Any) -> tuple:
    """Sort key that puts ``None`` last and never compares numbers with strings."""
    if value is None:
        return (2, 0)
    if _is_number(value):
        return (0, value)
    return (1, str(value))


def format_temperature(t: float | None) -> str | None:
    """``0`` -> ``"0.0"``, ``0.75`` -> ``"0.75"``: at least one decimal, as the papers print T."""
    if t is None:
        return None
    s = f"{t:g}"
    return s if ("." in s or "e" in s) else s + ".0"
