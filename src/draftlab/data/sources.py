"""Config-facing specs: which conversations and which benchmark questions a run uses.

``path`` may be a local file or directory, ``asset:<name>`` (see ``draftlab.assets``) or, with
``format: hf``, anything ``datasets.load_dataset`` accepts. Hydra instantiates these from ``conf/data``
and ``conf/bench``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from draftlab.utils.hashing import file_fingerprint
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


def resolve_path(path: str) -> str:
    if path.startswith("asset:"):
        from draftlab.assets import fetch

        return str(fetch(path.removeprefix("asset:")))
    return path


@dataclass
class ConversationSource:
    path: str
    format: str = "auto"  # auto | sharegpt | jsonl | hf | gsm8k
    name: str | None = None
    offset: int = 0
    limit: int | None = None
    split: str = "train"

    def load(self):
        from draftlab.data.conversations import load_conversations, load_gsm8k

        path = resolve_path(self.path)
        if self.format == "gsm8k":
            convs = load_gsm8k(path)
        elif self.format == "hf":
            convs = load_conversations(path, format="hf", split=self.split)
        else:
            convs = load_conversations(path, format=self.format)
        end = None if self.limit is None else self.offset + self.limit
        convs = convs[self.offset:end]
        prefix = self.name or Path(str(self.path)).stem
        for c in convs:  # ids stay unique when several sources are mixed
            c.id = f"{prefix}/{c.id}"
        return convs

    def fingerprint(self) -> dict:
        path = resolve_path(self.path)
        fp = file_fingerprint(path) if Path(path).is_file() else path
        return {"data": fp, "format": self.format, "offset": self.offset, "limit": self.limit, "split": self.split}

    def pool_fingerprint(self) -> dict:
        """The file a conversation comes from, without the slice taken of it (see ``DataSpec.pool_fingerprint``)."""
        return {k: v for k, v in self.fingerprint().items() if k not in ("offset", "limit")}


@dataclass
class DataSpec:
    """The conversations of a run. ``sources`` maps a name (the id prefix of its conversations) to a source:
    ``{sharegpt: {path, format, limit}, gsm8k: {...}}`` in config, so an experiment changes one setting of
    one source (``data.sources.sharegpt.limit=64``) or drops one (``data.sources.gsm8k=null``) without
    restating the others. They are read in the mapping's order."""

    sources: dict[str, ConversationSource] = field(default_factory=dict)
    max_length: int = 2048
    truncation: str = "truncate"  # truncate | drop
    val_fraction: float = 0.05
    drop_system: bool = False

    def __post_init__(self):
        self.sources = _sources(self.sources)

    def load(self):
        """All sources, normalised; returns (conversations, normalise report)."""
        from draftlab.data.conversations import normalize

        if not self.sources:
            raise ValueError("data spec has no sources")
        convs = [c for s in self.sources.values() for c in s.load()]
        kept, report = normalize(convs, drop_system=self.drop_system)
        log.info("%s", report)
        return kept, report

    def fingerprint(self) -> dict:
        # A list in the mapping's order, without the names: the key the same sources had as a list (names
        # only prefix conversation ids, which the regenerated data stores itself).
        return {"sources": [s.fingerprint() for s in self.sources.values()], "drop_system": self.drop_system}

    def pool_fingerprint(self) -> dict:
        """Identity of the conversation pool, ignoring each source's offset/limit.

        Regenerated turns live under this key, so raising a limit continues the earlier run instead of
        starting a new one; which conversations a run uses is still decided by the full spec.
        """
        return {"sources": sorted((s.pool_fingerprint() for s in self.sources.values()), key=repr),
                "drop_system": self.drop_system}


def _sources(sources) -> dict[str, ConversationSource]:
    """``{name: ConversationSource}`` from the config mapping (plain settings or built sources; a null entry is
    a source an experiment dropped). In config a list is the retired form: refused, naming the new one;
    built sources (Python callers) may come as a list, keyed by their names."""
    from dataclasses import fields

    from draftlab.utils.errors import ConfigError

    if isinstance(sources, (list, tuple)) and sources and all(isinstance(s, ConversationSource) for s in sources):
        sources = {s.name or Path(str(s.path)).stem: s for s in sources}
    if isinstance(sources, (list, tuple)):
        raise ConfigError("is a list; sources are a mapping keyed by name now: data.sources.<name>: "
                          "{path, format, limit, ...}", field="data.sources")
    known = {f.name for f in fields(ConversationSource)}
    out = {}
    for name, src in (sources or {}).items():
        if src is None:
            continue
        if not isinstance(src, ConversationSource):
            src = dict(src)
            src.pop("_target_", None)
            unknown = sorted(set(src) - known)
            if unknown:
                raise ConfigError(f"unknown setting(s) {unknown}; a source takes {sorted(known)}",
                                  field=f"data.sources.{name}")
            if "path" not in src:
                raise ConfigError("has no path", field=f"data.sources.{name}")
            src = ConversationSource(**{"name": str(name), **src})
        if src.name is None:
            src.name = str(name)
        out[str(name)] = src
    return out


@dataclass
class BenchmarkSpec:
    name: str
    path: str
    format: str = "question_jsonl"  # question_jsonl | humaneval
    categories: list[str] | None = None
    per_category: int | None = None
    limit: int | None = None

    def load(self, tokenizer=None):
        """The selected questions. ``tokenizer`` is accepted and ignored: the evaluate stage passes the
        target's to every bench, and only long-context ones (``LongContextBench``) fit prompts with it."""
        from draftlab.data.benchmarks import load_humaneval, load_question_jsonl, select_questions

        path = resolve_path(self.path)
        qs = load_humaneval(path) if self.format == "humaneval" else load_question_jsonl(path)
        return select_questions(qs, categories=self.categories, per_category=self.per_category, limit=self.limit)


@dataclass
class ConversationBench:
    """The run's own training conversations as benchmark questions (their user turns, normalised as the data
    stage normalises them): an overfit check asks a draft what it was trained on (``experiment=gate``)."""

    data: DataSpec
    name: str = "train_conversations"
    limit: int | None = 1

    def load(self, tokenizer=None):
        from draftlab.data.benchmarks import Question

        convs, _ = self.data.load()
        out = []
        for c in convs[: self.limit]:
            turns = [m["content"] for m in c.messages if m.get("role") == "user"]
            if turns:
                out.append(Question(question_id=c.id, category="train", turns=turns))
        if not out:
            raise ValueError("the data sources hold no conversation with a user turn to ask")
        return out
