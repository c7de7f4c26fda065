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
"""

from __future__ import annotations

import hashlib
import json
import os
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

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"regen.max_attempts must be >= 1, got {self.max_attempts}")


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


def regenerate(target, conversations: Sequence[Conversation], out_path: str | Path, cfg: RegenConfig | None = None,
               *, progress: bool = True) -> RegenReport:
    """Regenerate the assistant turns of ``conversations`` with ``target`` into ``out_path`` (resumable)."""
    import time

    cfg = cfg or RegenConfig()
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
    writers = {"success": _Appender(out_path), "error": _Appender(err_path), "skipped": _Appender(skip_path)}
    tok, model, eos = target.tokenizer, target.model, target.eos_token_ids
    bs = max(1, cfg.batch_size)
    batches = [list(range(i, min(i + bs, len(conversations)))) for i in range(0, len(conversations), bs)]
    todo = [(b, idx) for b, idx in enumerate(batches) if any(conversations[i].id not in all_done for i in idx)]
    if cfg.max_batches is not None:
        todo = todo[: cfg.max_batches]
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="batch", disable=not progress)
    try:
        for b, idx in todo:
            torch.manual_seed(_batch_seed(cfg.seed, b))
            convs = [conversations[i] for i in idx]
            # Turn-by-turn over the whole batch: turn j of every conversation that has one, in one generate call.
            history: list[list[dict]] = [[] for _ in convs]
            status: list[str | None] = [None] * len(convs)
            reason: list[str] = [""] * len(convs)
            finish: list[list[str]] = [[] for _ in convs]
            cursors = [0] * len(convs)
            while True:
                active, prompts = [], []
                for k, c in enumerate(convs):
                    if status[k] is not None:
                        continue
                    msgs = c.messages
                    j = cursors[k]
                    while j < len(msgs) and msgs[j]["role"] != "assistant":
                        history[k].append(dict(msgs[j]))
                        j += 1
                    cursors[k] = j
                    done_turns = sum(m["role"] == "assistant" for m in history[k])
                    if cfg.max_assistant_turns is not None and done_turns >= cfg.max_assistant_turns:
                        status[k] = "success"
                        continue
                    if j >= len(msgs):
                        status[k] = "success" if any(m["role"] == "assistant" for m in history[k]) else "skipped"
                        reason[k] = reason[k] or "no assistant turn to regenerate"
                        continue
                    try:
                        p = _prompt_ids(tok, history[k])
                    except Exception as e:  # a template that rejects this history
                        status[k], reason[k] = "error", f"chat template failed: {type(e).__name__}: {e}"
                        continue
                    if len(p) > cfg.max_prompt_tokens:
                        # Later turns only grow: keep the turns regenerated so far if there are any.
                        has_turn = any(m["role"] == "assistant" for m in history[k])
                        status[k] = "success" if has_turn else "skipped"
                        reason[k] = f"prompt of {len(p)} tokens exceeds max_prompt_tokens={cfg.max_prompt_tokens}"
                        if has_turn:
                            finish[k].append("truncated_conversation")
                        continue
                    active.append(k)
                    prompts.append(p)
                if not active:
                    break
                try:
                    outs = _generate(model, tok, prompts, cfg, eos)
                except Exception as e:
                    if _is_run_error(e):
                        raise
                    for k in active:
                        status[k], reason[k] = "error", f"generation failed: {type(e).__name__}: {e}"
                    continue
                for k, (new_ids, why) in zip(active, outs):
                    history[k].append({"role": "assistant", "content": tok.decode(new_ids, skip_special_tokens=True)})
                    finish[k].append(why)
                    report.new_tokens += len(new_ids)
                    cursors[k] += 1  # past the original assistant turn we replaced
            for k, c in enumerate(convs):
                if c.id in all_done:
                    continue
                st = status[k]
                if st == "success":
                    # A training sample ends on an assistant answer: drop trailing user/system turns.
                    while history[k] and history[k][-1]["role"] != "assistant":
                        history[k].pop()
                    rec = {"id": c.id, "conversations": history[k],
                           "meta": {"finish": finish[k], "regen": asdict(cfg), "target": getattr(target, "name", None)}}
                    if reason[k] and finish[k] and finish[k][-1] == "truncated_conversation":
                        rec["meta"]["note"] = reason[k]
                elif st == "skipped":
                    rec = {"id": c.id, "reason": reason[k]}
                else:
                    attempts[c.id] += 1
                    rec = {"id": c.id, "error": reason[k], "attempt": attempts[c.id]}
                    if attempts[c.id] < cfg.max_attempts:
                        log.warning("conversation %s failed (attempt %d of %d; the next run retries it): %s",
                                    c.id, attempts[c.id], cfg.max_attempts, reason[k])
                    else:
                        log.error("conversation %s failed %d times, giving up: %s", c.id, attempts[c.id], reason[k])
                writers[st].write(rec)
                all_done.add(c.id)  # within this run; a failure with attempts left is retried by the next
            bar.update(1)
            bar.set_postfix(tok_s=f"{report.new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}")
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    report.seconds = time.perf_counter() - t0
    # Totals over all runs so far, so the invariant success + error + skipped (+ pending) == input is visible.
    idset = set(ids)
    success, skipped = _read_done_ids(out_path) & idset, _read_done_ids(skip_path) & idset
    attempts = Counter(i for i in _read_ids(err_path) if i in idset)
    failing = [i for i in ids if i in attempts and i not in success and i not in skipped]  # input order
    report.success, report.skipped, report.error = len(success), len(skipped), len(failing)
    report.failed_ids = [i for i in failing if attempts[i] >= cfg.max_attempts]
    report.retry_ids = [i for i in failing if attempts[i] < cfg.max_attempts]
    report.pending = report.input - report.success - report.error - report.skipped
    return report


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
