"""Run identity, W&B loggers and the self-describing run record.

Every job (one ``draftlab-train`` / ``draftlab-eval`` invocation, or one job of a Hydra multirun) gets

- a W&B run whose name, group and tags derive from the Hydra choices and overrides: name
  ``<method>-<target>-<bench>[-<overrides>]``, group = ``wandb.group`` or the experiment (else task)
  name, suffixed with ``/<sweep dir name>`` inside a multirun, tags ``group:option`` for each choice plus each override. Offline unless
  ``WANDB_MODE=online`` / ``DRAFTLAB_WANDB_OFFLINE=false``; the run is finished explicitly at the end of the
  job, because Hydra's sequential launcher runs all jobs in one process and W&B would otherwise keep
  logging the next job into the first job's run;
- ``record.json`` in its run directory (schema ``draftlab.record/1``): resolved config, choices,
  overrides, metrics, eval tables, training history, artifact keys, git commit (and whether the tree had
  uncommitted changes), the evaluated draft's identity (``draft``: path, weights sha256, training step) and
  hardware, so ``analysis/`` needs no server.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftlab.utils.atomic import atomic_write_text
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

RECORD_SCHEMA = "draftlab.record/1"
# Choices worth naming a run by, in this order.
_NAME_GROUPS = ("method", "target", "bench")
_TAG_GROUPS = ("method", "target", "data", "bench", "trainer", "experiment")


def hydra_context() -> dict[str, Any]:
    """Choices, overrides, output dir and (multirun) sweep dir of the running Hydra job; {} outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except Exception:  # noqa: BLE001 - not running under Hydra (tests, notebooks)
        return {}
    def get(key: str, default=None):
        # Composed-but-not-launched configs (tests, notebooks) leave runtime fields unset.
        return OmegaConf.select(hc, key, default=default, throw_on_missing=False)

    choices = {k: v for k, v in dict(get("runtime.choices", {}) or {}).items()
               if not k.startswith("hydra/") and v is not None}
    multirun = str(get("mode")) == "RunMode.MULTIRUN"
    return {"choices": choices, "overrides": list(get("overrides.task", []) or []),
            "output_dir": get("runtime.output_dir"), "sweep_dir": str(get("sweep.dir")) if multirun else None,
            "job_num": get("job.num") if multirun else None}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", text).strip("_")


def _tag(text: str, limit: int = 64) -> str:
    """A W&B tag (at most 64 characters): long overrides, such as paths, keep their start and a hash."""
    tag = _slug(text)
    if len(tag) <= limit:
        return tag
    digest = hashlib.sha1(tag.encode()).hexdigest()[:8]
    return f"{tag[:limit - 9]}~{digest}"


def run_identity(cfg: DictConfig, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"name", "group", "tags"}`` for this job (see the module docstring)."""
    ctx = hydra_context() if ctx is None else ctx
    choices = ctx.get("choices", {})
    parts = [str(choices[g]) for g in _NAME_GROUPS if choices.get(g)]
    overrides = [o for o in ctx.get("overrides", []) if not o.startswith(("experiment=", "paths.", "hydra."))]
    name = "-".join(parts) or str(cfg.get("task_name", "run"))
    if overrides:
        name += "-" + ",".join(_slug(o.split(".")[-1]) for o in overrides)
    group = (cfg.get("wandb") or {}).get("group")
    if not group:
        group = str(choices.get("experiment") or cfg.get("task_name", "draftlab"))
        if ctx.get("sweep_dir"):  # every job of one multirun shares a group; separate sweeps do not
            group += "/" + Path(ctx["sweep_dir"]).name
    tags = [f"{g}:{choices[g]}" for g in _TAG_GROUPS if choices.get(g)] + [_tag(o) for o in overrides]
    return {"name": name[:128], "group": str(group), "tags": tags[:64]}


def make_loggers(cfg: DictConfig, identity: dict[str, Any]) -> list:
    """Instantiate ``cfg.logger`` (a dict of logger configs) with the run identity filled in for W&B."""
    from hydra.utils import instantiate

    loggers = []
    for key, lcfg in (cfg.get("logger") or {}).items():
        if lcfg is None or "_target_" not in lcfg:
            continue
        kwargs = {}
        if "WandbLogger" in lcfg._target_:
            kwargs = {"name": identity["name"], "group": identity["group"], "tags": identity["tags"]}
            if os.environ.get("WANDB_MODE", "").lower() == "online":
                kwargs["offline"] = False
        logger = instantiate(lcfg, **kwargs)
        # The whole resolved job config, so a run can be filtered by any setting in the W&B UI.
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        loggers.append(logger)
        log.info("logger %s: %s", key, lcfg._target_)
    return loggers


def wandb_run(loggers: list):
    """The W&B run behind the first ``WandbLogger`` (created on first access), or None."""
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger":
            return lg.experiment
    return None


def finish_wandb() -> None:
    """Close the current W&B run so the next job in this process starts a fresh one."""
    try:
        import wandb
    except ImportError:  # pragma: no cover
        return
    if wandb.run is not None:
        wandb.finish()


def git_info(repo: str | Path | None = None) -> dict[str, Any]:
    cwd = str(repo or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        # A status that failed says nothing about the tree: unknown, not clean.
        clean_known = dirty.returncode == 0
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if clean_known else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def weights_sha256(module) -> str:
    """sha256 over a module's state dict: every tensor's name, dtype, shape and bytes, in name order.

    Taken from the loaded module rather than the saved files, so a draft saved and loaded again (in any of its
    artifact formats, whatever metadata the files hold) keeps its hash, while any changed weight changes it.
    """
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # The raw bytes through a uint8 view, since numpy has no bfloat16; hashed in place, not copied.
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def draft_step(draft_dir: str | Path) -> int | None:
    """The training step a trained artifact's weights were saved at: ``best.step`` of the
    ``train_summary.json`` that ``draftlab-train`` writes beside ``draft/``; None for a draft from
    elsewhere (an export, a hand-made artifact)."""
    path = Path(draft_dir).parent / "train_summary.json"
    try:
        step = json.loads(path.read_text())["best"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(step) if isinstance(step, int) and step >= 0 else None


def no_draft_identity() -> dict[str, Any]:
    """The record's ``draft`` block of a training-free method: ``{"path", "sha256", "step"}`` all None. A trained
    draft's comes from ``methods.artifact.DraftArtifact.identity``: the path alone does not say what was
    measured (a content-addressed directory can be retrained or resumed in place), the weights' hash does."""
    return {"path": None, "sha256": None, "step": None}


def hardware_info() -> dict[str, Any]:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cpu": platform.processor()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def build_record(cfg: DictConfig, *, kind: str, identity: dict[str, Any], metrics: dict[str, float],
                 artifacts: dict[str, Any], eval_result: dict | None = None, train: dict | None = None,
                 ctx: dict[str, Any] | None = None, git: dict[str, Any] | None = None,
                 draft: dict[str, Any] | None = None) -> dict[str, Any]:
    # ``git`` is read when the job starts: a long job outlives commits made while it runs.
    # ``draft``: the evaluated draft's identity (``DraftArtifact.identity``, or :func:`no_draft_identity`).
    ctx = hydra_context() if ctx is None else ctx
    return {"schema": RECORD_SCHEMA, "kind": kind, "run_name": identity["name"], "group": identity["group"],
            "tags": identity["tags"], "choices": ctx.get("choices", {}), "overrides": ctx.get("overrides", []),
            "config": OmegaConf.to_container(cfg, resolve=True), "git": git_info() if git is None else git, "hardware": hardware_info(),
            "artifacts": artifacts, "draft": draft or no_draft_identity(), "metrics": metrics, "eval": eval_result,
            "train": train}


def write_record(run_dir: str | Path, record: dict[str, Any]) -> Path:
    return atomic_write_text(Path(run_dir) / "record.json", json.dumps(record, indent=2, default=str))
