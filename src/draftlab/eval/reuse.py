"""Finished evaluations reused by content: a re-run sweep evaluates only the jobs it is missing.

Every evaluation that finishes is kept under ``<paths.artifacts>/eval/<key>/``. A later job whose key is the
same does not evaluate again: it brings that evaluation into its own run directory (the eval record and flat
metrics into its ``record.json``; ``answers/``, ``eval_table.txt``, ``eval_comparison.txt`` and
``served_comparison.txt`` as files) and logs ``eval reused: <key> from <entry> (eval.reuse=false to run it
again)``. So a sweep killed at job 90 of 100, run again (into a new sweep directory or the same one), trains
and evaluates only jobs 90-99, and ``draftlab-table`` over it prints what an uninterrupted sweep would have.
``eval.reuse=false`` evaluates afresh (and the fresh evaluation replaces the kept one).

The key (:func:`eval_key`) names what decides the numbers an evaluation measures:

- the job's resolved config, less the settings that change where things are written or how a run is logged,
  never what it measures (``UNMEASURED``: paths and output directories, loggers, W&B, Hydra, the entry
  point's task name, ``eval.enabled`` / ``eval.reuse``), and less the settings only training reads
  (``train.*``, ``trainer``, ``callbacks``, ``data``, ``regen``, ``init``) and ``draft_path``: they change an
  evaluation only through the draft's weights, which the key names by content. The seed stays: it decides
  sampled outputs at T>0. The target, the bench, the method (its drafter) and ``eval.*`` stay as resolved;
- the evaluated draft's weights, by the sha256 of ``methods.artifact.DraftArtifact`` (None for a training-free
  method), and the training config of its artifact, from which the record takes the axes on training settings;
- the code: a sha256 over every ``draftlab/**/*.py`` file as installed (:func:`source_version`), so any edit
  of the source, committed or not, evaluates again; it needs no git;
- the machine's software and accelerator (:func:`environment`), since throughputs are part of what is measured.

- the bench's question file and the target's weight files, by content (:mod:`draftlab.eval.content`: each file
  hashed once and cached by size and modification time), so editing a question file or replacing weights in
  place evaluates again.

What the key cannot see is left to the user: a served evaluation against running servers (``eval.served.urls``)
is named by their URLs, not by what they serve; after changing those, run with ``eval.reuse=false``.

A reused evaluation's throughputs (tok/s, speed-ups) are those measured when it first ran: the job's record
says so in ``eval_reuse`` (``reused_from``: the kept entry; ``measured_in``: the run directory that measured
it; ``measured_at``; ``hardware``: the machine it ran on). A fresh evaluation's record names its key there
with ``reused_from: null``.

An entry is written into a hidden temporary directory and renamed into place whole, its ``complete.json``
written last: a crashed or killed evaluation leaves nothing that is mistaken for a finished one, and an
entry without a ``complete.json`` naming its key is never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftlab.utils.atomic import atomic_dir
from draftlab.utils.hashing import content_key

STORE = "eval"  # <paths.artifacts>/eval/<key>/
SCHEMA = "draftlab.eval_store/1"
KEY_VERSION = "eval/2"  # 2: the inputs (question file, target weights) by content
# What an evaluation leaves in its run directory, brought over as a whole (a directory with all its files).
RUN_FILES = ("answers", "eval_table.txt", "eval_comparison.txt", "served_comparison.txt")
# Top-level settings that decide where a job writes and how it logs (task_name: the entry point's name), and
# those only training reads: what training made enters the key as the draft's weights, by content, as does a
# draft given by place (draft_path).
UNMEASURED = ("paths", "hydra", "logger", "wandb", "task_name", "train", "trainer", "callbacks", "data", "regen",
              "init", "draft_path", "trust_checkpoint")
UNMEASURED_EVAL = ("enabled", "reuse")
_MARKER = "complete.json"
_DATA = "eval.json"
_FILES = "files"


def source_version(root: str | Path | None = None) -> str:
    """sha256 over the ``*.py`` files under ``root`` (default: the installed ``draftlab`` package): each file's
    path relative to ``root`` and its bytes, in path order."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def environment(device: str | None = None) -> dict[str, Any]:
    """The software and the accelerator an evaluation on ``device`` (the target's) runs with."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    on_gpu = str(device or "cpu").startswith("cuda") and torch.cuda.is_available()
    accelerator = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": pkg("transformers"),
            "accelerator": accelerator}


def measured_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config less ``UNMEASURED`` (and ``eval.enabled`` / ``eval.reuse``)."""
    conf = OmegaConf.to_container(cfg, resolve=True)  # resolved whole: measured settings may point into paths.*
    conf = {k: v for k, v in conf.items() if k not in UNMEASURED}
    conf["eval"] = {k: v for k, v in (conf.get("eval") or {}).items() if k not in UNMEASURED_EVAL}
    return conf


def key_parts(cfg: DictConfig, *, draft_sha: str | None, code: str, trained: dict | None = None,
              env: dict[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`eval_key` hashes, by name (kept beside each entry as ``key.json``)."""
    from draftlab.eval.content import input_digests

    env = environment(OmegaConf.select(cfg, "target.device")) if env is None else env
    return {"version": KEY_VERSION, "config": measured_config(cfg), "inputs": input_digests(cfg),
            "draft_sha256": draft_sha, "draft_trained_config": trained, "code": code, "environment": env}


def eval_key(cfg: DictConfig, *, draft_sha: str | None, code: str, trained: dict | None = None,
             env: dict[str, Any] | None = None) -> str:
    """The content key of the evaluation ``cfg`` asks for (see the module docstring). ``draft_sha``: the
    weights sha256 (None without a draft); ``code``: :func:`source_version`; ``trained``: the artifact's
    training config (``methods.registry.trained_method_config``); ``env``: default :func:`environment`."""
    return key_of(key_parts(cfg, draft_sha=draft_sha, code=code, trained=trained, env=env))


def key_of(parts: dict[str, Any]) -> str:
    """The key of :func:`key_parts`' answer."""
    return content_key(parts)


def entry_dir(cfg: DictConfig, key: str) -> Path:
    return Path(str(cfg.paths.artifacts)).expanduser() / STORE / key


@dataclass
class StoredEval:
    """A finished evaluation as kept: its eval record, flat metrics and where and when it was measured."""

    key: str
    entry: Path
    record: dict[str, Any]
    metrics: dict[str, float]
    run_dir: str
    measured_at: str
    hardware: dict[str, Any]


def load(entry: str | Path, key: str) -> StoredEval | None:
    """The evaluation kept at ``entry``, or None unless it is complete (its ``complete.json`` names ``key``)."""
    entry = Path(entry)
    try:
        marker = json.loads((entry / _MARKER).read_text())
        data = json.loads((entry / _DATA).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("key") != key or marker.get("schema") != SCHEMA:
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    return StoredEval(key=key, entry=entry, record=data["record"], metrics=data["metrics"], run_dir=data["run_dir"],
                      measured_at=data.get("measured_at", ""), hardware=data.get("hardware") or {})


def store(entry: str | Path, key: str, parts: dict[str, Any], run_dir: str | Path, record: dict[str, Any],
          metrics: dict[str, float], hardware: dict[str, Any] | None = None) -> Path:
    """Keep a finished evaluation of ``run_dir`` at ``entry`` (replacing an older one), whole or not at all."""
    entry, run_dir = Path(entry), Path(run_dir)
    with atomic_dir(entry) as tmp:
        files = tmp / _FILES
        files.mkdir()
        kept = []
        for name in RUN_FILES:
            src = run_dir / name
            if src.is_dir():
                shutil.copytree(src, files / name)
            elif src.is_file():
                shutil.copy2(src, files / name)
            else:
                continue
            kept.append(name)
        (tmp / "key.json").write_text(json.dumps(parts, indent=2, sort_keys=True, default=str))
        data = {"key": key, "record": record, "metrics": metrics, "run_dir": str(run_dir),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware": hardware or {}}
        (tmp / _DATA).write_text(json.dumps(data, indent=2, default=str))
        # Last: only a directory holding everything above carries the marker.
        (tmp / _MARKER).write_text(json.dumps({"schema": SCHEMA, "key": key, "files": kept}))
    return entry


def bring(stored: StoredEval, run_dir: str | Path) -> tuple[dict[str, Any], dict[str, float]]:
    """Copy a kept evaluation's files into ``run_dir``; returns its eval record, whose paths into the copied
    files now name the copies (other paths keep naming where they were written), and its flat metrics."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted((stored.entry / _FILES).iterdir()):
        if src.is_dir():
            shutil.copytree(src, run_dir / src.name, dirs_exist_ok=True)
        else:
            shutil.copy2(src, run_dir / src.name)
        copied.append(src.name)
    record = _moved(stored.record, stored.run_dir, str(run_dir), copied)
    return record, dict(stored.metrics)


def _moved(obj: Any, old: str, new: str, names: list[str]) -> Any:
    # A path under the measuring run's directory whose first part was copied names the copy.
    if isinstance(obj, dict):
        return {k: _moved(v, old, new, names) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_moved(v, old, new, names) for v in obj]
    if isinstance(obj, str) and obj.startswith(old + os.sep):
        rest = obj[len(old) + 1:]
        if rest.split(os.sep, 1)[0] in names:
            return new + os.sep + rest
    return obj


def reuse_info(key: str, stored: StoredEval | None = None, code: str | None = None) -> dict[str, Any]:
    """The record's ``eval_reuse``: the key, and for a reused evaluation where and when it was measured."""
    info: dict[str, Any] = {"key": key, "code": code, "reused_from": None}
    if stored is not None:
        info.update({"reused_from": str(stored.entry), "measured_in": stored.run_dir,
                     "measured_at": stored.measured_at, "hardware": stored.hardware,
                     "note": "throughputs and speed-ups were measured by the run in measured_in"})
    return info


def log_reused(loggers: list, metrics: dict[str, float], info: dict[str, Any]) -> None:
    """The reused evaluation's metrics in the job's W&B run, as a fresh one would log them, and where from."""
    from draftlab import tracking

    run = tracking.wandb_run(loggers)
    if run is None:
        return
    run.log({k: v for k, v in metrics.items() if k.startswith("eval/")})
    run.summary.update({"eval/reused_from": info["reused_from"], "eval/measured_in": info.get("measured_in")})
