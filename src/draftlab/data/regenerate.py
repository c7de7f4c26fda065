"""Regenerate every assistant turn with the target (SpecForge's "data regeneration").

A draft trained on the target's own outputs learns the distribution it will be verified against, not the
one of whichever model wrote the original chat. Each assistant turn is regenerated *turn by turn*,
conditioned on the already regenerated history, so later turns see what the target itself said.

Crash safety. Output is append-only JSONL in three files next to each other:
``<out>`` (success records), ``<out>.errors.jsonl`` and ``<out>.skipped.jsonl``. The ids in them are the
done-ids. Conversations are cut into fixed batches over the *whole* input, each batch is generated under a
seed derived from (seed, batch index), and records are flushed and fsync'd one by one. A killed run is
resumed by re-running the same command: a torn last line is dropped, finished batches are skipped, and a
half-written batch is generated again with the same composition and seed, writing only its missing ids.
So an interrupted run ends with exactly the records of an uninterrupted one: nothing lost, nothing twice.

Failures are retried. A conversation whose generation raised (out of memory, an interrupted worker, a
template that rejects its history) gets an error record with the reason and its attempt number, and is
*not* done: the next run generates its batch again, up to ``max_attempts`` attempts in all. Only then is it
given up and reported by id. A later success supersedes earlier error records of the same id.
An error that is the run's rather than a conversation's (inputs on another device than the weights)
is not recorded: it ends the run.

Engines. ``engine: hf`` generates with the target's own ``model.generate`` in batches; ``engine: server`` sends
each turn as a chat completion to OpenAI-compatible servers (vLLM, SGLang), running or launched for the run
(``draftlab.serving.regen_server``). Both write the same records; ``meta.engine`` says which engine (and version)
made a record and where its token counts come from (``generated`` by HF, returned by the ``server``, or
``retokenized`` from the server's text). A server that cannot be reached or times out is the run's error (the
run ends, the rerun resumes); a request the server rejects is that conversation's error (retried as above).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftlab.data.conversations import Conversation
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class RegenConfig:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256
    max_prompt_tokens: int = 2048
    batch_size: int = 8
    seed: int = 0
    # Regenerate at most this many assistant turns per conversation and cut the rest (None = all turns).
    # Long ShareGPT chats make every later turn's prompt longer; on CPU the first turns are the cheap ones.
    max_assistant_turns: int | None = None
    # Stop after this many batches (None = all); the next run resumes. Handy for budgeted CPU runs.
    max_batches: int | None = None
    # Attempts per conversation, over all runs, before a failing one is given up (reported by id).
    max_attempts: int = 3
    # hf: the target's model.generate in batches; server: OpenAI-compatible servers (``server`` settings,
    # see draftlab.serving.regen_server.ServerSettings).
    engine: str = "hf"
    server: dict | None = None

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"regen.max_attempts must be >= 1, got {self.max_attempts}")
        if self.engine not in ("hf", "server"):
            raise ValueError(f"regen.engine must be 'hf' or 'server', got {self.engine!r}")

    def record_settings(self) -> dict:
        """The settings written into each record (the server's addresses and limits are not the data's)."""
        return {k: v for k, v in asdict(self).items() if k != "server"}


# Settings that decide how far and how persistently runs go, or where requests are sent, not what they write.
_EXECUTION_KEYS = ("max_batches", "max_attempts", "engine", "server")


def regen_key_config(cfg: RegenConfig, engine_identity: dict | None = None) -> dict:
    """The regeneration settings that enter the data key. HF generation keeps the key it always had; any other
    engine adds its identity (name and version), so HF- and server-made data (or two engine versions) never
    share a pool."""
    key = {k: v for k, v in asdict(cfg).items() if k not in _EXECUTION_KEYS}
    if cfg.engine != "hf":
        if not engine_identity:
            raise ValueError(f"regen.engine={cfg.engine} needs the engine's identity for the data key")
        key["engine"] = {k: engine_identity[k] for k in ("name", "version")}
    return key


@dataclass
class RegenReport:
    input: int
    success: int = 0
    error: int = 0
    skipped: int = 0
    resumed_done: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    pending: int = 0  # not attempted yet (max_batches reached)
    retry_ids: list[str] = field(default_factory=list)  # failed, attempts left: the next run retries them
    failed_ids: list[str] = field(default_factory=list)  # failed max_attempts times: given up
    paths: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.success + self.error + self.skipped == self.input

    def __str__(self) -> str:
        tps = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"regeneration: {self.input} input = {self.success} success + {self.error} error + "
                f"{self.skipped} skipped + {self.pending} pending ({self.resumed_done} already done before this run; "
                f"{self.new_tokens} new tokens at {tps:.1f} tok/s)"
                + (f"; {len(self.retry_ids)} failed with attempts left, re-run to retry them" if self.retry_ids else "")
                + (f"; given up after all attempts: {', '.join(self.failed_ids)}" if self.failed_ids else ""))


def _side_paths(out: Path) -> tuple[Path, Path]:
    stem = str(out)[: -len(".jsonl")] if str(out).endswith(".jsonl") else str(out)
    return Path(stem + ".errors.jsonl"), Path(stem + ".skipped.jsonl")


def _read_done_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; a torn last line (killed mid-write) is cut off the file."""
    return set(_read_ids(path))


def _read_ids(path: Path) -> list[str]:
    """Every record's id in ``path``, repeats included (one error record per failed attempt)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
        log.warning("%s: dropped a torn last line left by an interrupted run", path)
        data = data[:cut]
    return [json.loads(line)["id"] for line in data.decode("utf-8").splitlines() if line.strip()]


class _Appender:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _batch_seed(seed: int, batch_index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{batch_index}".encode()).digest()[:4], "little")


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _model_device(model) -> torch.device:
    dev = getattr(model, "device", None)  # HF models say where they are; a plain module by its weights
    return dev if isinstance(dev, torch.device) else next(model.parameters()).device


# Errors of the run's own code, not of one conversation: inputs and weights on different devices fail every
# generate call alike, so recording them per conversation (and retrying) would only hide the bug behind a
# run that "completes" with nothing in it. They end the run instead.
_RUN_ERRORS = ("Expected all tensors to be on the same device", "Expected object of device type",
               "should be either on cpu or on the same device")


def _is_run_error(e: Exception) -> bool:
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _RUN_ERRORS)


@torch.no_grad()
def _generate(model, tokenizer, prompts: list[list[int]], cfg: RegenConfig, eos_ids: list[int]) -> list[tuple[list[int], str]]:
    """Batched sampling with left padding; returns (new token ids, finish reason) per prompt."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    dev = _model_device(model)  # HF generate does not move its inputs: they go where the weights are
    ids, att = ids.to(dev), att.to(dev)
    sample = cfg.temperature > 0
    kw = dict(do_sample=sample, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad, eos_token_id=eos_ids)
    if sample:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids, attention_mask=att, **kw)[:, width:]  # [B, new]
    results = []
    for row in out.tolist():
        stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
        results.append((row[:stop], "stop") if stop is not None else (row, "length"))
    return results


@dataclass
class TurnRequest:
    """One assistant turn to generate: the conversation, which turn, the history so far and its prompt ids."""

    conv_id: str
    turn: int
    messages: list[dict]
    prompt_ids: list[int]


@dataclass
class TurnResult:
    """A generated turn: its text, the number of new tokens, why it stopped, and where the count comes from."""

    text: str
    new_tokens: int
    finish: str
    token_ids: str = "generated"  # generated (HF) | server | retokenized


class HFEngine:
    """The target's own ``model.generate``: each batch under a seed derived from (seed, batch index)."""

    def __init__(self, target, cfg: RegenConfig):
        import transformers

        self.target, self.cfg = target, cfg
        self.identity = {"name": "hf", "version": transformers.__version__}

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start_batch(self, batch_index: int) -> None:
        torch.manual_seed(_batch_seed(self.cfg.seed, batch_index))

    def generate(self, requests: list[TurnRequest]) -> list[TurnResult | Exception]:
        tok = self.target.tokenizer
        try:
            outs = _generate(self.target.model, tok, [r.prompt_ids for r in requests], self.cfg,
                             self.target.eos_token_ids)
        except Exception as e:
            if _is_run_error(e):
                raise
            return [e] * len(requests)
        return [TurnResult(tok.decode(ids, skip_special_tokens=True), len(ids), why) for ids, why in outs]


@dataclass
class _BatchState:
    """Turn-by-turn progress of one batch of conversations."""

    convs: list[Conversation]
    history: list[list[dict]]
    status: list[str | None]
    reason: list[str]
    finish: list[list[str]]
    cursors: list[int]
    new_tokens: list[list[int]]
    token_ids: list[set]

    @classmethod
    def of(cls, convs: list[Conversation]) -> _BatchState:
        n = len(convs)
        return cls(convs, [[] for _ in convs], [None] * n, [""] * n, [[] for _ in convs], [0] * n,
                   [[] for _ in convs], [set() for _ in convs])


def _next_request(st: _BatchState, k: int, tok, cfg: RegenConfig) -> TurnRequest | None:
    """Advance conversation ``k`` to its next assistant turn; the request for it, or None when it is settled."""
    c, history = st.convs[k], st.history[k]
    msgs, j = c.messages, st.cursors[k]
    while j < len(msgs) and msgs[j]["role"] != "assistant":
        history.append(dict(msgs[j]))
        j += 1
    st.cursors[k] = j
    done_turns = sum(m["role"] == "assistant" for m in history)
    if cfg.max_assistant_turns is not None and done_turns >= cfg.max_assistant_turns:
        st.status[k] = "success"
        return None
    if j >= len(msgs):
        st.status[k] = "success" if done_turns else "skipped"
        st.reason[k] = st.reason[k] or "no assistant turn to regenerate"
        return None
    try:
        p = _prompt_ids(tok, history)
    except Exception as e:  # a template that rejects this history
        st.status[k], st.reason[k] = "error", f"chat template failed: {type(e).__name__}: {e}"
        return None
    if len(p) > cfg.max_prompt_tokens:
        # Later turns only grow: keep the turns regenerated so far if there are any.
        st.status[k] = "success" if done_turns else "skipped"
        st.reason[k] = f"prompt of {len(p)} tokens exceeds max_prompt_tokens={cfg.max_prompt_tokens}"
        if done_turns:
            st.finish[k].append("truncated_conversation")
        return None
    return TurnRequest(c.id, done_turns, [dict(m) for m in history], p)


def _run_batch(engine, tok, convs: list[Conversation], cfg: RegenConfig, report: RegenReport) -> _BatchState:
    """Turn-by-turn over the whole batch: turn j of every conversation that has one, in one engine call."""
    st = _BatchState.of(convs)
    while True:
        active, requests = [], []
        for k in range(len(convs)):
            if st.status[k] is None and (req := _next_request(st, k, tok, cfg)) is not None:
                active.append(k)
                requests.append(req)
        if not active:
            return st
        for k, res in zip(active, engine.generate(requests)):
            if isinstance(res, Exception):
                st.status[k], st.reason[k] = "error", f"generation failed: {type(res).__name__}: {res}"
                continue
            st.history[k].append({"role": "assistant", "content": res.text})
            st.finish[k].append(res.finish)
            st.new_tokens[k].append(res.new_tokens)
            st.token_ids[k].add(res.token_ids)
            report.new_tokens += res.new_tokens
            st.cursors[k] += 1  # past the original assistant turn we replaced


def _record(st: _BatchState, k: int, cfg: RegenConfig, target, engine, attempts: Counter) -> tuple[str, dict]:
    c, kind = st.convs[k], st.status[k]
    if kind == "success":
        history = st.history[k]
        # A training sample ends on an assistant answer: drop trailing user/system turns.
        while history and history[-1]["role"] != "assistant":
            history.pop()
        sources = sorted(st.token_ids[k])
        meta_engine = {**engine.identity, "token_ids": sources[0] if len(sources) == 1 else "+".join(sources)}
        rec = {"id": c.id, "conversations": history,
               "meta": {"finish": st.finish[k], "regen": cfg.record_settings(), "target": getattr(target, "name", None),
                        "engine": meta_engine, "new_tokens": st.new_tokens[k]}}
        if st.reason[k] and st.finish[k] and st.finish[k][-1] == "truncated_conversation":
            rec["meta"]["note"] = st.reason[k]
        return kind, rec
    if kind == "skipped":
        return kind, {"id": c.id, "reason": st.reason[k]}
    attempts[c.id] += 1
    if attempts[c.id] < cfg.max_attempts:
        log.warning("conversation %s failed (attempt %d of %d; the next run retries it): %s",
                    c.id, attempts[c.id], cfg.max_attempts, st.reason[k])
    else:
        log.error("conversation %s failed %d times, giving up: %s", c.id, attempts[c.id], st.reason[k])
    return "error", {"id": c.id, "error": st.reason[k], "attempt": attempts[c.id]}


def regenerate(target, conversations: Sequence[Conversation], out_path: str | Path, cfg: RegenConfig | None = None,
               *, progress: bool = True, engine=None) -> RegenReport:
    """Regenerate the assistant turns of ``conversations`` with ``target`` into ``out_path`` (resumable).

    ``engine``: an open engine to use (default: HF ``generate``, opened and closed here; a serving engine comes
    from ``draftlab.serving.regen_server.open_engine``, the layer above this one)."""
    cfg = cfg or RegenConfig()
    if engine is None:
        if cfg.engine != "hf":
            raise ValueError(f"regeneration with engine '{cfg.engine}' needs an open engine: "
                             "draftlab.serving.regen_server.open_engine(target, cfg)")
        with HFEngine(target, cfg) as opened:
            return regenerate(target, conversations, out_path, cfg, progress=progress, engine=opened)
    out_path = Path(out_path)
    err_path, skip_path = _side_paths(out_path)
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"regeneration needs unique conversation ids; '{dup}' occurs more than once")
    success, skipped = _read_done_ids(out_path), _read_done_ids(skip_path)
    attempts = Counter(_read_ids(err_path))  # failed attempts per id
    # Done: succeeded, skipped, or failed every attempt. Other failures are generated again.
    all_done = success | skipped | {i for i, n in attempts.items() if n >= cfg.max_attempts}
    report = RegenReport(input=len(conversations), resumed_done=len(all_done & set(ids)),
                         paths={"success": str(out_path), "error": str(err_path), "skipped": str(skip_path)})
    bs = max(1, cfg.batch_size)
    batches = [list(range(i, min(i + bs, len(conversations)))) for i in range(0, len(conversations), bs)]
    todo = [(b, idx) for b, idx in enumerate(batches) if any(conversations[i].id not in all_done for i in idx)]
    if cfg.max_batches is not None:
        todo = todo[: cfg.max_batches]
    writers = {"success": _Appender(out_path), "error": _Appender(err_path), "skipped": _Appender(skip_path)}
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="batch", disable=not progress)
    try:
        for b, idx in todo:
            engine.start_batch(b)
            st = _run_batch(engine, target.tokenizer, [conversations[i] for i in idx], cfg, report)
            for k, c in enumerate(st.convs):
                if c.id not in all_done:
                    kind, rec = _record(st, k, cfg, target, engine, attempts)
                    writers[kind].write(rec)
                    all_done.add(c.id)  # within this run; a failure with attempts left is retried by the next
            bar.update(1)
            bar.set_postfix(tok_s=f"{report.new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}")
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    report.seconds = time.perf_counter() - t0
    _final_counts(report, ids, out_path, err_path, skip_path, cfg)
    return report


def _final_counts(report: RegenReport, ids: list[str], out_path: Path, err_path: Path, skip_path: Path,
                  cfg: RegenConfig) -> None:
    """Totals over all runs so far, so the invariant success + error + skipped (+ pending) == input is visible."""
    idset = set(ids)
    success, skipped = _read_done_ids(out_path) & idset, _read_done_ids(skip_path) & idset
    attempts = Counter(i for i in _read_ids(err_path) if i in idset)
    failing = [i for i in ids if i in attempts and i not in success and i not in skipped]  # input order
    report.success, report.skipped, report.error = len(success), len(skipped), len(failing)
    report.failed_ids = [i for i in failing if attempts[i] >= cfg.max_attempts]
    report.retry_ids = [i for i in failing if attempts[i] < cfg.max_attempts]
    report.pending = report.input - report.success - report.error - report.skipped


def load_regenerated(path: str | Path, ids: Sequence[str] | None = None) -> list[Conversation]:
    """Read the success records of a regeneration run back as conversations.

    With ``ids``, only those conversations are returned, in the order of ``ids`` (the regeneration
    directory is a pool that other slices of the same sources may have added to).
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(Conversation(id=rec["id"], messages=rec["conversations"]))
    if ids is None:
        return out
    by_id = {c.id: c for c in out}
    return [by_id[i] for i in ids if i in by_id]
