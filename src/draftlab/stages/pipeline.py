"""One ``draftlab-train`` / ``draftlab-eval`` job: target -> (trainable methods) data -> train -> eval -> record.

``run_pipeline(cfg)`` composes the stages; the method is whatever ``cfg.method`` declares (see
``draftlab.methods.registry``). A trainable method either trains (content-addressed, reused or resumed)
or, with ``draft_path=DIR``, evaluates an existing artifact; a training-free method goes straight to
evaluation. An evaluation already finished under the same key (config, draft weights, code) is brought
into the run directory instead of run again (``draftlab.eval.reuse``; ``eval.reuse=false`` runs it). The
job's record (``<run dir>/record.json``) and W&B run name the commit the job started on (and whether the
tree was dirty) and the evaluated draft by path, weights hash and training step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from draftlab import tracking
from draftlab.eval import reuse
from draftlab.methods.artifact import DraftArtifact
from draftlab.methods.registry import MethodSpec
from draftlab.training import ranks
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


def run_pipeline(cfg: DictConfig, *, stage: str = "train") -> dict[str, Any] | None:
    """Run one job; returns its record (also written to ``<run dir>/record.json``), or None on a rank other
    than 0 of a multi-process job (which trains but neither evaluates nor records)."""
    from draftlab.stages.evaluate import eval_timing, evaluate
    from draftlab.stages.train import train_draft

    if cfg.eval.enabled:
        eval_timing(cfg)  # a typo in eval.timing fails now, not after training
    ctx = tracking.hydra_context()
    git = tracking.git_info()  # the code this job runs, not what HEAD is when it ends
    code = reuse.source_version() if cfg.eval.enabled else None  # likewise, for the evaluation's key
    run_dir = Path(ctx.get("output_dir") or cfg.paths.output_dir)
    identity = tracking.run_identity(cfg, ctx)
    loggers = tracking.make_loggers(cfg, identity)
    torch.manual_seed(cfg.seed)
    ranks.begin_job(cfg.paths.artifacts, ctx.get("job_num"))
    try:
        target = _build_target(cfg)
        # draft_vocab_size: auto becomes the number for this target in cfg itself (keys, record, W&B summary).
        spec = MethodSpec(cfg.method).for_target(target)
        artifacts: dict[str, Any] = {"draft": None, "data": None}
        metrics: dict[str, float] = {}
        train_info = None
        draft_dir = None  # the trained artifact (a training-free method has none)
        if spec.trainable:
            if cfg.get("draft_path"):
                draft_dir = Path(str(cfg.draft_path)).expanduser()
            elif stage == "eval":
                raise ValueError(f"method '{spec.name}' needs a trained draft: pass draft_path=DIR "
                                 "(an artifact written by draftlab-train) or run draftlab-train")
            else:
                from draftlab.stages.data import run_data_stage

                data = run_data_stage(cfg, spec, target)
                artifacts["data"] = data.data_key
                result = train_draft(cfg, target, data, spec, loggers)
                draft_dir = result.draft_dir
                artifacts["train_key"] = result.key
                train_info = {"key": result.key, "reused": result.reused, "history": result.history,
                              "best": result.best, "train_seconds": result.train_seconds}
                metrics.update({k: v for k, v in result.best.items() if k.startswith("val/")})
                metrics["train/seconds"] = result.train_seconds
                metrics["train/reused"] = float(result.reused)
        if not ranks.is_main():
            log.info("rank %d: done; rank 0 evaluates and writes the record", ranks.rank())
            return None
        artifact = None
        if spec.trainable:
            artifacts["draft"] = str(draft_dir)
            # Read once: the draft, its weights' hash as saved (before the cast below), step and training config.
            artifact = DraftArtifact.open(spec, draft_dir, target)
            artifact.draft.to(target.dtype).eval()
            drafter = spec.build_drafter(artifact.draft)
            draft_id = artifact.identity()
        else:
            drafter = spec.build_drafter()
            draft_id = tracking.no_draft_identity()
        _summarise_identity(loggers, git, draft_id)

        eval_record = reused = None
        if cfg.eval.enabled:
            def fresh():
                return evaluate(cfg, target, drafter, run_dir, spec, loggers, artifact=artifact)

            eval_record, eval_metrics, reused = _evaluate_or_reuse(cfg, fresh, drafter, run_dir, loggers,
                                                                    draft_id, artifact, code)
            metrics.update(eval_metrics)
        record = tracking.build_record(cfg, kind=stage, identity=identity, metrics=metrics, artifacts=artifacts,
                                       eval_result=eval_record, train=train_info, ctx=ctx, git=git, draft=draft_id)
        if reused is not None:
            record["eval_reuse"] = reused
        path = tracking.write_record(run_dir, record)
        log.info("run record: %s", path)
        from draftlab.eval.gate import raise_if_failed

        raise_if_failed(eval_record)  # an overfit gate that failed ends the job with an error, its record kept
        return record
    finally:
        ranks.end_job()
        tracking.finish_wandb()


def _evaluate_or_reuse(cfg: DictConfig, fresh: Callable[[], tuple[dict, dict]], drafter, run_dir: Path,
                       loggers: list, draft_id: dict[str, Any], artifact: DraftArtifact | None, code: str
                       ) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """The evaluation kept under this job's key (``draftlab.eval.reuse``), brought into ``run_dir``, or
    ``fresh()`` run and kept; returns (eval record, flat metrics, the record's ``eval_reuse``)."""
    trained = artifact.trained_config if artifact is not None else None
    parts = reuse.key_parts(cfg, draft_sha=draft_id.get("sha256"), code=code, trained=trained)
    key = reuse.key_of(parts)
    entry = reuse.entry_dir(cfg, key)
    stored = reuse.load(entry, key) if cfg.eval.get("reuse", True) else None
    if stored is not None:
        drafter.close()  # built but never run: closed here, as the evaluation stage closes the drafters it runs
        eval_record, eval_metrics = reuse.bring(stored, run_dir)
        info = reuse.reuse_info(key, stored, code)
        log.info("eval reused: %s from %s (eval.reuse=false to run it again)", key, entry)
        reuse.log_reused(loggers, eval_metrics, info)
        return eval_record, eval_metrics, info
    eval_record, eval_metrics = fresh()
    try:
        reuse.store(entry, key, parts, run_dir, eval_record, eval_metrics, tracking.hardware_info())
    except OSError as exc:  # the job's own results stand; only a later re-run loses the shortcut
        log.warning("evaluation not kept for reuse at %s: %s", entry, exc)
    return eval_record, eval_metrics, reuse.reuse_info(key, None, code)


def _build_target(cfg: DictConfig):
    """The target on this process's device: ``cuda`` becomes ``cuda:<local rank>`` under several ranks, or the
    job's GPU in a parallel local sweep (``ranks.local_device``)."""
    device = cfg.target.get("device")
    if device is None:
        return instantiate(cfg.target)
    placed = ranks.local_device(str(device))
    if placed != str(device):
        log.info("target on %s (target.device=%s, rank %d)", placed, device, ranks.rank())
    return instantiate(cfg.target, device=placed)


def _summarise_identity(loggers: list, git: dict[str, Any], draft_id: dict[str, Any]) -> None:
    """The commit, dirty flag and draft identity in the W&B run's summary, as in the record, so runs can be
    filtered by what they measured without opening their records."""
    run = tracking.wandb_run(loggers)
    if run is None:
        return
    run.summary.update({"git/commit": git.get("commit"), "git/dirty": git.get("dirty"),
                        **{f"draft/{k}": v for k, v in draft_id.items()}})
