"""Drafts the tests train, built once per content key per test run and shared by every test and worker.

Training a draft is the dearest set-up in the suite (the SSD checks' 300-step EAGLE-3 draft takes about a
minute), and parallel workers used to train the same one each. ``shared_draft`` keys a draft by what
determines it (the method's resolved config, the target, the training recipe), builds it under a file lock
in a directory every worker of the run shares, writes it through the method's own artifact format
(``MethodSpec.save``, whose round trip is exact: ``test_artifact_round_trip``) and hands each caller a fresh
copy loaded from there (``MethodSpec.load``), so no test sees another's in-place changes.

The directory is made per run (``pytest_configure`` in ``tests/conftest.py``) and removed after it: the key
does not cover the code, so a draft is never reused across runs of different code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

from draftlab.utils.atomic import atomic_write_text

STORE_ENV = "DRAFTLAB_TEST_DRAFT_STORE"
INFERENCE_ONLY = ("name", "label", "drafter", "axes", "ci", "export")


def store_root() -> Path:
    """The run's store; a process outside pytest (the GPU check's scripts) makes its own, which the processes
    it starts inherit, and removes it when it exits."""
    root = os.environ.get(STORE_ENV)
    if not root:
        import atexit
        import tempfile

        root = os.environ[STORE_ENV] = tempfile.mkdtemp(prefix="draftlab-test-drafts-")
        atexit.register(shutil.rmtree, root, True)
    return Path(root)


def target_identity(target) -> dict:
    """What tells two test targets apart: name, dtype, device and shape (weights follow from the name)."""
    g = target.geometry
    return {"name": target.name, "dtype": str(target.dtype), "device": str(torch.device(target.device).type),
            "geometry": {k: getattr(g, k) for k in sorted(vars(g))} if hasattr(g, "__dict__") else repr(g)}


def content_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def shared_json(parts: dict, compute: Callable[[], object]):
    """``compute()`` (a JSON value, e.g. a target's greedy continuations), computed once per run and key."""
    key = content_key(parts)
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{key}.json"
    with FileLock(str(root / f"{key}.lock")):
        if not path.exists():
            atomic_write_text(path, json.dumps(compute()))
    return json.loads(path.read_text())


def shared_draft(spec, target, recipe: dict, train: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The draft ``train()`` builds for ``spec`` on ``target`` with ``recipe`` (steps, rate, corpus ...), trained
    at most once per run: later calls, in any worker, load the stored artifact."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(spec.cfg, resolve=True)
    # What decodes, exports or labels a draft does not change it: methods that differ only there (EAGLE-3 and
    # the hybrid drafting from EAGLE-3's draft) share one. The ``ci`` block's knobs are already applied.
    training = {k: v for k, v in cfg.items() if k not in INFERENCE_ONLY}
    key = content_key({"method": training, "target": target_identity(target), "recipe": recipe})
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    done = root / key / "draft"
    with FileLock(str(root / f"{key}.lock")):
        if not (root / key / "COMPLETE").exists():
            draft = train()
            tmp = root / key / "draft.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(done, ignore_errors=True)
            where = Path(spec.save(draft, tmp, target)).resolve().relative_to(tmp.resolve())
            os.replace(tmp, done)
            # Written last: a worker killed mid-save leaves no marker, and the next caller trains again.
            atomic_write_text(root / key / "COMPLETE", json.dumps({"path": str(where), "recipe": recipe}, default=str))
    where = json.loads((root / key / "COMPLETE").read_text())["path"]
    return spec.load(done / where, target).float().eval()
