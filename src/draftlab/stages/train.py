"""The training stage: a method's draft trained (or reused / resumed) on the data stage's samples.

Everything method-specific comes from ``conf/method/<m>.yaml`` through ``MethodSpec`` (draft builder,
LightningModule, DataModule, offline features, artifact format); this file names no method.
Training is content-addressed: the draft lives under ``<artifacts>/<method>/<train_key>/`` where the key
hashes everything that changes the weights (the method config minus its inference-time blocks, the target,
the data, trainer limits, seed) and nothing that does not (evaluation and execution settings). A finished
key is reused without training; an unfinished one resumes from its last checkpoint. So an evaluation sweep
trains nothing, and a training sweep shares the regenerated data and the offline target features.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf

from draftlab.methods.registry import MethodSpec
from draftlab.stages.data import target_identity
from draftlab.training import ranks
from draftlab.training.checkpoint import load_file, plain, unsafe_objects
from draftlab.training.placement import TargetPlacement
from draftlab.utils.atomic import atomic_dir, atomic_write_text
from draftlab.utils.hashing import content_key
from draftlab.utils.logging import get_logger
from draftlab.utils.precision import resolve_precision

log = get_logger(__name__)

_TRAINER_KEYS_IN_KEY = ("max_epochs", "max_steps", "max_time", "accumulate_grad_batches", "gradient_clip_val", "precision",
                        "limit_train_batches", "limit_val_batches", "val_check_interval")


@dataclass
class TrainResult:
    key: str
    dir: Path
    draft_dir: Path
    reused: bool
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    train_seconds: float = 0.0


class PlainCheckpoint(L.Callback):
    """The hyper-parameters a checkpoint stores become plain containers (a config's lists arrive as OmegaConf
    ones), so every checkpoint draftlab writes reads back with torch's ``weights_only`` unpickler."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = plain(checkpoint[key])


class HistoryCallback(L.Callback):
    """Collects logged metrics into a list of dicts (training curves for the record and the report).

    Every row also carries ``tokens``: the training tokens seen so far (non-padding positions of the
    ``attention_mask`` of every training batch; the shared data modules all yield one), so curves can be
    drawn against data rather than steps, across runs of different batch sizes; and ``seconds``: the wall-clock
    since training started (validation included, summed over resumed runs), for curves against training time.
    """

    def __init__(self, every: int):
        self.every = max(1, every)
        self.rows: list[dict[str, Any]] = []
        self.tokens = 0
        self.before = 0.0  # seconds of the runs this one resumed
        self.started: float | None = None

    def seconds(self) -> float:
        return self.before + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def on_fit_start(self, trainer, pl_module):
        self.started = time.perf_counter()

    def _row(self, trainer, prefix: str) -> None:
        row = {"step": int(trainer.global_step), "epoch": int(trainer.current_epoch), "tokens": self.tokens,
               "seconds": round(self.seconds(), 3)}
        row.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)})
        if len(row) > 4:
            self.rows.append(row)

    def add_row(self, trainer, metrics: dict[str, float]) -> None:
        """A row of metrics measured outside the module's logging (served checks), at the current step."""
        self.rows.append({"step": int(trainer.global_step), "epoch": int(trainer.current_epoch),
                          "tokens": self.tokens, "seconds": round(self.seconds(), 3), **metrics})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if mask is not None:
            self.tokens += int(mask.sum())
        if trainer.global_step % self.every == 0:
            self._row(trainer, "train/")

    def on_validation_end(self, trainer, pl_module):
        # Not on_validation_epoch_end: Lightning runs callbacks' epoch-end hooks before the module's, where
        # the val metrics are logged, so there the row would hold the previous epoch's values.
        if not trainer.sanity_checking:
            self._row(trainer, "val/")

    def state_dict(self):
        return {"rows": self.rows, "tokens": self.tokens, "seconds": self.seconds()}

    def load_state_dict(self, state):
        self.rows = list(state.get("rows", []))
        self.tokens = int(state.get("tokens", 0))
        self.before = float(state.get("seconds", 0.0))


class ResumeCheckpoint(Checkpoint):
    """Writes ``path`` every ``every`` optimiser steps and at each epoch end: the point a re-run resumes from.

    A re-run from it must replay exactly what the killed run would have done, so it is written only where
    the whole training state is settled. It is a ``Checkpoint`` so that Lightning runs it after the
    ``ModelCheckpoint`` in every hook: written before, it would miss the best checkpoint of the validation
    just run, and the resumed run would pick another one. A step that validation follows is written after
    that validation instead (a checkpoint from before it resumes past it, and the validation never runs):
    at the epoch end for the last batch, since that is where ``ModelCheckpoint`` records the validation,
    and at the validation's end for a ``val_check_interval`` batch.
    """

    # As ModelCheckpoint's option: the optimiser, schedule and loop state are written too (a resume needs them).
    save_weights_only = False

    def __init__(self, path: Path, every: int):
        self.path, self.every = str(path), every
        self._after_validation = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every > 0 and trainer.global_step % self.every == 0:
            if _validation_follows(trainer, batch_idx):
                self._after_validation = True
            else:
                self._write(trainer)

    def on_validation_end(self, trainer, pl_module):
        # After the last batch, the ModelCheckpoint only acts at the epoch end: so do we.
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self._after_validation and not trainer.sanity_checking and not last:
            self._after_validation = False
            self._write(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._after_validation = False
        self._write(trainer)

    def _write(self, trainer) -> None:
        trainer.save_checkpoint(self.path, self.save_weights_only)


def _validation_follows(trainer, batch_idx: int) -> bool:
    if not trainer.enable_validation:
        return False
    every = trainer.val_check_batch
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return last or (isinstance(every, int) and (batch_idx + 1) % every == 0)


def train_key(cfg: DictConfig, data_key: str, spec: MethodSpec, target_id: dict | None = None) -> str:
    """Content key of a trained draft (see the module docstring); ``spec``: the run's method, ``target_id``:
    the data stage's target identity (default: from ``cfg``). A ``draft_vocab_size: auto`` must have been
    resolved (``MethodSpec.for_target``): the key holds the number."""
    if spec.needs_vocab_size:  # the key holds the number: `auto` and the number it stands for share one key
        raise ValueError(f"method '{spec.name}': draft_vocab_size 'auto' is not resolved; the training key holds "
                         "the number (MethodSpec.for_target(target))")
    target_id = target_identity(cfg) if target_id is None else target_id
    trainer = {k: cfg.trainer.get(k) for k in _TRAINER_KEYS_IN_KEY}
    trainer["precision"] = resolve_precision(trainer["precision"], cfg.trainer.get("accelerator"))
    # The convention names the taps in the method config, so it is part of what the draft reads.
    convention = OmegaConf.select(cfg, "target.layer_convention")
    return content_key("train/2", spec.key_config(), target_id, convention, data_key, trainer, cfg.seed)


def _callbacks(cfg: DictConfig, root: Path, monitor: str | None) -> tuple[list, HistoryCallback]:
    """The configured callbacks, plus history and resume checkpoints. The configs place checkpoints by
    interpolation (``train.artifact_dir``, ``train.monitor``), filled in here for this key and method, in a
    copy: the run's config (and so its record) stays the same whether the draft is trained or reused."""
    filled = OmegaConf.merge(cfg, {"train": {"artifact_dir": str(root), "monitor": monitor}})
    callbacks = [cb for cb in (instantiate(c) for c in (filled.get("callbacks") or {}).values() if c)
                 if cb is not None]
    history = HistoryCallback(int(cfg.trainer.get("log_every_n_steps", 10)))
    resume = ResumeCheckpoint(root / "checkpoints" / "resume.ckpt", int(cfg.train.checkpoint_every_n_steps))
    return [PlainCheckpoint(), *callbacks, history, resume], history


def train_draft(cfg: DictConfig, target, data, spec: MethodSpec, loggers: list | None = None) -> TrainResult:
    """Train (or reuse / resume) the draft for ``cfg`` on the data stage's samples; save the best one.

    Under several ranks every rank trains; rank 0 alone extracts the offline features (first) and writes the
    summary and the draft (last), the others wait for each and then read them.
    """
    spec = spec.for_target(target)  # the pipeline's (already resolved there: a no-op)
    target_id = data.target_id if data.target_id is not None else target_identity(cfg)
    key = train_key(cfg, data.data_key, spec, target_id)
    root = Path(cfg.paths.artifacts) / spec.name / key
    draft_dir = root / "draft"
    if draft_dir.is_dir() and (root / "train_summary.json").exists():  # whatever files the method's format holds
        log.info("reusing trained draft %s (training skipped)", draft_dir)
        return _finished(key, root, reused=True)
    root.mkdir(parents=True, exist_ok=True)
    if ranks.is_main():
        atomic_write_text(root / "train_config.json", json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=2,
                                                                 default=str))
    t0 = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True)
    draft = spec.build_draft(target, data.vocab)
    with ranks.main_first("features"):
        features = spec.prepare_features(target=target, draft=draft, samples=data.samples,
                                         root=Path(cfg.paths.artifacts), key=(target_id, data.data_key))
    dm = spec.build_datamodule(data.samples, features=features, pad_token_id=target.tokenizer.pad_token_id or 0,
                               seed=int(cfg.seed))
    module = spec.build_module(draft, target)
    has_val = float(spec.block("data").get("val_fraction") or 0) > 0
    callbacks, history = _callbacks(cfg, root, spec.monitor if has_val else None)
    for cb in callbacks:  # callbacks that measure the run itself (served checks) learn what it trains
        if hasattr(cb, "bind_run"):
            cb.bind_run(cfg=cfg, spec=spec, target=target, root=root)
    trainer = _trainer(cfg, callbacks, loggers, root)
    resume = root / "checkpoints" / "resume.ckpt"
    ckpt_path = str(resume) if resume.exists() else None
    if ckpt_path:
        log.info("resuming training from %s", ckpt_path)
    with warnings.catch_warnings():
        # Our DataModule restores the data position itself; Lightning cannot see that and warns.
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        # Our own resume state: the weights_only reader unless an older run wrote it with config objects inside.
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=not (ckpt_path and unsafe_objects(resume)))
    with ranks.main_first("draft"):
        if trainer.global_rank == 0:
            _recover_history(history, resume)
            _save(cfg, spec, key, root, module, target, callbacks, history, has_val, trainer, t0)
    # Every rank has seen the draft: the marker directory may go (see ranks.end_job).
    ranks.barrier()
    return _finished(key, root, reused=False)


def _finished(key: str, root: Path, *, reused: bool) -> TrainResult:
    """The result of a finished key, read from its summary (the same on every rank)."""
    summary = json.loads((root / "train_summary.json").read_text())
    return TrainResult(key, root, root / "draft", reused=reused, history=summary.get("history", []),
                       best=summary.get("best", {}), train_seconds=0.0 if reused else summary.get("train_seconds", 0.0))


def _trainer(cfg: DictConfig, callbacks: list, loggers: list | None, root: Path):
    """The configured Trainer; the target follows the strategy's device (``TargetPlacement``), and a job of a
    parallel local sweep trains on its own GPU (``ranks.job_gpu``)."""
    precision = resolve_precision(cfg.trainer.get("precision"), cfg.trainer.get("accelerator"))
    if precision != cfg.trainer.get("precision"):
        log.info("trainer.precision=auto: %s on this machine", precision)
    extra = {}
    gpu = ranks.job_gpu()
    if gpu is not None and cfg.trainer.get("accelerator") in ("gpu", "cuda") and cfg.trainer.get("devices") == 1:
        extra["devices"] = [gpu]
    return instantiate(cfg.trainer, callbacks=[*callbacks, TargetPlacement()], logger=loggers or False,
                       precision=precision, default_root_dir=str(root), use_distributed_sampler=False, **extra)


def _recover_history(history: HistoryCallback, resume: Path) -> None:
    """Under ``ddp_spawn`` the curves were collected in the spawned processes, and Lightning hands back only the
    weights: take them from the last resume checkpoint (written at the last epoch end, after its validation)."""
    if history.rows or not resume.exists():
        return
    state = load_file(resume, trusted=True).get("callbacks", {})  # the run's own artifact
    saved = state.get(history.state_key)
    if saved:
        history.load_state_dict(saved)


def _save(cfg, spec, key, root, module, target, callbacks, history, has_val, trainer, t0) -> None:
    """The summary, then the draft: the best checkpoint by the held-out metric, else the final state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    best = {}
    # With a held-out metric the artifact is the best checkpoint by it. Without one there is no "best": the
    # artifact is the state training ended in (the module as fit left it). The newest checkpoint is not that
    # state when checkpoints are kept by time (train_time_interval), which also stops the epoch-end save.
    best_path = next((cb.best_model_path for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.best_model_path),
                     "") if has_val else ""
    if not has_val:
        best = {"checkpoint": None, "step": int(trainer.global_step)}
    if best_path:
        state = load_file(best_path, trusted=True)  # the run's own artifact
        module.on_load_checkpoint(state)
        module.load_state_dict(state["state_dict"])
        best = {"checkpoint": best_path, "step": int(state.get("global_step", -1))}
    val_rows = [r for r in history.rows if spec.monitor in r]
    if val_rows:
        best.update(max(val_rows, key=lambda r: r[spec.monitor]))
    seconds = time.perf_counter() - t0
    # The summary first, then the draft directory in one rename: a draft directory is the marker of a
    # finished key, and a key is only reused with its summary beside it. A kill in between re-runs the
    # (already finished) fit from the resume checkpoint and lands here again.
    atomic_write_text(root / "train_summary.json", json.dumps({"key": key, "history": history.rows, "best": best,
                                                               "train_seconds": seconds}, indent=2))
    draft_dir = root / "draft"
    with atomic_dir(draft_dir) as tmp:
        spec.save(module.draft, tmp, target)
    log.info("trained draft saved to %s (%.0f s)", draft_dir, seconds)
