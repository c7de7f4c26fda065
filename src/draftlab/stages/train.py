"""The train/eval pipeline behind ``draftlab-train`` and ``draftlab-eval``.

``run_pipeline(cfg)``: target -> (trained methods) data stage -> training -> exported draft -> drafter ->
benchmark vs AR -> ``record.json`` + W&B. Training is content-addressed: the draft lives under
``<artifacts>/<method>/<train_key>/`` where the key hashes everything that changes the weights (target,
data, vocabulary, draft variant, TTT and optimiser settings, trainer limits, seed) and nothing that does
not (evaluation settings). A finished key is reused without training; an unfinished one resumes from its
last checkpoint. So an evaluation sweep over the same drafts trains nothing, and a training sweep shares
the regenerated data and the offline target features (keyed by target + data only).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from draftlab import tracking
from draftlab.decoding.engine import GenerationConfig
from draftlab.utils.hashing import content_key
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

# Keys of cfg.train that only change how a run is executed, not the weights it produces.
_TRAIN_KEYS_NOT_IN_KEY = {"checkpoint_every_n_steps", "features", "feature_dtype"}
_TRAINER_KEYS_IN_KEY = ("max_epochs", "max_steps", "accumulate_grad_batches", "gradient_clip_val", "precision",
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


def save_trained_draft(draft, out_dir: Path, target) -> Path:
    """EAGLE-3: the native SGLang/vLLM directory; ConFu: draftlab's own format (no engine serves it yet)."""
    from draftlab.methods.confu.model import ConFuDraft

    if isinstance(draft, ConFuDraft):
        from draftlab.methods.confu.artifact import save_confu

        return save_confu(draft, out_dir)
    from draftlab.export.native import save_native

    return save_native(draft, out_dir, verifier=target)


def load_trained_draft(path: Path, target):
    from draftlab.methods.confu.artifact import is_confu_artifact, load_confu

    if is_confu_artifact(path):
        return load_confu(path, target=target)
    from draftlab.export.convert import load_draft

    return load_draft(path, target=target)


class HistoryCallback(L.Callback):
    """Collects logged metrics into a list of dicts (training curves for the record and the report)."""

    def __init__(self, every: int):
        self.every = max(1, every)
        self.rows: list[dict[str, Any]] = []

    def _row(self, trainer, prefix: str) -> None:
        row = {"step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
        row.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)})
        if len(row) > 2:
            self.rows.append(row)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self._row(trainer, "train/")

    def on_validation_end(self, trainer, pl_module):
        # Not on_validation_epoch_end: Lightning runs callbacks' epoch-end hooks before the module's, where
        # the val metrics are logged, so there the row would hold the previous epoch's values.
        if not trainer.sanity_checking:
            self._row(trainer, "val/")

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = list(state.get("rows", []))


class ResumeCheckpoint(L.Callback):
    """Writes ``path`` every ``every`` optimiser steps and at each epoch end: the point a re-run resumes from."""

    def __init__(self, path: Path, every: int):
        self.path, self.every = str(path), every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every > 0 and trainer.global_step % self.every == 0:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def _target_id(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.target, resolve=True)


def train_key(cfg: DictConfig, data_key: str) -> str:
    train = {k: v for k, v in OmegaConf.to_container(cfg.train, resolve=True).items() if k not in _TRAIN_KEYS_NOT_IN_KEY}
    trainer = {k: cfg.trainer.get(k) for k in _TRAINER_KEYS_IN_KEY}
    method = OmegaConf.to_container(cfg.method, resolve=True)
    method = {k: method.get(k) for k in ("name", "draft", "module")} | _init_key(method.get("init"))
    return content_key("train/1", method, _target_id(cfg), data_key, cfg.vocab.draft_vocab_size, train, trainer,
                       cfg.seed)


def _init_key(init: dict | None) -> dict:
    """``method.init`` enters the training key only where it changes the starting weights (default: no entry)."""
    init = {k: v for k, v in (init or {}).items() if v is not None}
    return {} if init in ({}, {"lm_head": "random"}) else {"init": init}


def _build_draft(cfg: DictConfig, target, vocab):
    from draftlab.methods.eagle3 import Eagle3Draft

    overrides = {k: v for k, v in OmegaConf.to_container(cfg.method.draft, resolve=True).items() if v is not None}
    if cfg.method.name == "confu":
        from draftlab.methods.confu.model import build_confu_draft

        return build_confu_draft(target, vocab_mapping=vocab, **overrides)
    init = cfg.method.get("init") or {}
    if init.get("from"):
        # Continue training an existing draft (its vocabulary mapping included): ConFu's "same steps" control.
        from draftlab.export.convert import load_draft

        draft = load_draft(str(init["from"]), target=target).float()
        clash = {k: (v, getattr(draft.config, k)) for k, v in overrides.items() if getattr(draft.config, k) != v}
        if clash:
            raise ValueError(f"method.init.from={init['from']} disagrees with method.draft (configured, loaded): {clash}")
        return draft
    draft = Eagle3Draft.from_target(target, vocab_mapping=vocab, **overrides)
    lm_head = init.get("lm_head", "random")
    if lm_head == "target":
        init_head_from_target(draft, target)
    elif lm_head != "random":
        raise ValueError(f"method.init.lm_head must be 'random' or 'target', got '{lm_head}'")
    return draft


@torch.no_grad()
def init_head_from_target(draft, target) -> None:
    """Start ``lm_head`` (and the final norm) from the target's: row i = the target's row for draft id i.

    EAGLE/SpecForge initialise the head randomly; speculators copies the target's rows (and freezes them).
    Copying without freezing gives a short CPU run a head that already speaks the target's vocabulary.
    """
    head = target.model.get_output_embeddings().weight  # [V, d]
    if head.shape[1] != draft.config.hidden_size:
        raise ValueError(f"target head width {head.shape[1]} != draft hidden size {draft.config.hidden_size}")
    draft.lm_head.weight.copy_(head[draft.target_ids().to(head.device)].to(draft.lm_head.weight.dtype))
    final_norm = target.model.model.norm.weight
    draft.norm.weight.copy_(final_norm.to(draft.norm.weight.dtype))


def _feature_dir(cfg: DictConfig, target, data) -> Path | None:
    """The offline target-feature store for ``data`` (computed once, shared by every run on the same data)."""
    from draftlab.methods.eagle3.features import feature_key, precompute_features

    if cfg.train.features not in ("online", "offline"):
        raise ValueError(f"train.features must be 'online' or 'offline', got '{cfg.train.features}'")
    # ConFu's contemplate rows attend to the target's KV of their prefix: the target runs in every step.
    if cfg.train.features == "online" or cfg.method.name == "confu":
        return None
    convention = target.layer_convention
    fkey = feature_key(_target_id(cfg), data.data_key, target.aux_layer_ids,
                       convention.value if hasattr(convention, "value") else str(convention),
                       cfg.train.feature_dtype, len(data.samples))
    return precompute_features(target, data.samples, Path(cfg.paths.artifacts) / "features" / fkey,
                               dtype=cfg.train.feature_dtype)


def _callbacks(cfg: DictConfig, root: Path) -> tuple[list, HistoryCallback]:
    """The configured callbacks, pointed at the artifact directory, plus history and resume checkpoints."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [cb for cb in (instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c) if cb is not None]
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint):
            # The artifact directory, not the run directory: a re-run with the same key resumes from it.
            cb.dirpath = str(root / "checkpoints")
            # Best = highest held-out simulated tau (SpecForge selects on its simulated acceptance length).
            cb.monitor, cb.mode = ("val/simulated_tau", "max") if cfg.train.val_fraction > 0 else (None, "max")
    history = HistoryCallback(int(cfg.trainer.get("log_every_n_steps", 10)))
    resume = ResumeCheckpoint(root / "checkpoints" / "resume.ckpt", int(cfg.train.checkpoint_every_n_steps))
    return [*callbacks, history, resume], history


def train_draft(cfg: DictConfig, target, data, loggers: list | None = None) -> TrainResult:
    """Train (or reuse / resume) the draft for ``cfg`` on the data stage's samples; export the best one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from draftlab.methods.eagle3.data import Eagle3DataModule

    key = train_key(cfg, data.data_key)
    root = Path(cfg.paths.artifacts) / str(cfg.method.name) / key
    draft_dir = root / "draft"
    if (draft_dir / "config.json").exists():
        summary = json.loads((root / "train_summary.json").read_text())
        log.info("reusing trained draft %s (training skipped)", draft_dir)
        return TrainResult(key, root, draft_dir, reused=True, history=summary.get("history", []),
                           best=summary.get("best", {}), train_seconds=0.0)
    root.mkdir(parents=True, exist_ok=True)
    (root / "train_config.json").write_text(json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=2, default=str))
    t0 = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True)
    draft = _build_draft(cfg, target, data.vocab)

    dm = Eagle3DataModule(data.samples, feature_dir=_feature_dir(cfg, target, data), batch_size=cfg.train.batch_size,
                          val_fraction=cfg.train.val_fraction, seed=cfg.seed,
                          pad_token_id=target.tokenizer.pad_token_id or 0)
    module = instantiate(cfg.method.module)(draft=draft, target=target)
    callbacks, history = _callbacks(cfg, root)
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                          default_root_dir=str(root), use_distributed_sampler=False)
    resume = root / "checkpoints" / "resume.ckpt"
    ckpt_path = str(resume) if resume.exists() else None
    if ckpt_path:
        log.info("resuming training from %s", ckpt_path)
    with warnings.catch_warnings():
        # Our DataModule restores the data position itself; Lightning cannot see that and warns.
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    if trainer.global_rank != 0:
        return TrainResult(key, root, draft_dir, reused=False)

    best = {}
    best_path = next((cb.best_model_path for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.best_model_path), "")
    if best_path:
        state = torch.load(best_path, map_location="cpu", weights_only=False)
        module.on_load_checkpoint(state)
        module.load_state_dict(state["state_dict"])
        best = {"checkpoint": best_path, "step": int(state.get("global_step", -1))}
    val_rows = [r for r in history.rows if "val/simulated_tau" in r]
    if val_rows:
        best.update(max(val_rows, key=lambda r: r["val/simulated_tau"]))
    save_trained_draft(module.draft, draft_dir.with_suffix(".tmp"), target)
    seconds = time.perf_counter() - t0
    (root / "train_summary.json").write_text(json.dumps({"key": key, "history": history.rows, "best": best,
                                                         "train_seconds": seconds}, indent=2))
    draft_dir.with_suffix(".tmp").rename(draft_dir)  # the marker of a finished key
    log.info("trained draft exported to %s (%.0f s)", draft_dir, seconds)
    return TrainResult(key, root, draft_dir, reused=False, history=history.rows, best=best, train_seconds=seconds)


def generation_config(cfg: DictConfig) -> GenerationConfig:
    e = cfg.eval
    return GenerationConfig(max_new_tokens=int(e.max_new_tokens), temperature=float(e.temperature),
                            top_k=e.get("top_k_sampling"), top_p=e.get("top_p"), seed=int(cfg.seed),
                            max_tree_rows=max(128, int(e.draft_nodes) + 8))


def run_pipeline(cfg: DictConfig, *, stage: str = "train") -> dict[str, Any]:
    """Run one job; returns its record (also written to ``<run dir>/record.json``)."""
    from draftlab.eval.runner import format_table, run_benchmark

    ctx = tracking.hydra_context()
    git = tracking.git_info()  # the code this job runs, not what HEAD is when it ends
    run_dir = Path(ctx.get("output_dir") or cfg.paths.output_dir)
    identity = tracking.run_identity(cfg, ctx)
    loggers = tracking.make_loggers(cfg, identity)
    torch.manual_seed(cfg.seed)
    try:
        target = instantiate(cfg.target)
        method = cfg.method
        artifacts: dict[str, Any] = {"draft": None, "data": None}
        metrics: dict[str, float] = {}
        train_info = None
        if method.get("trainable"):
            if cfg.get("draft_path"):
                draft_dir = Path(str(cfg.draft_path)).expanduser()
            elif stage == "eval":
                raise ValueError(f"method '{method.name}' needs a trained draft: pass draft_path=DIR "
                                 "(an export written by draftlab-train) or run draftlab-train")
            else:
                from draftlab.stages.data import run_data_stage

                data = run_data_stage(cfg, target)
                artifacts["data"] = data.data_key
                result = train_draft(cfg, target, data, loggers)
                draft_dir = result.draft_dir
                artifacts["train_key"] = result.key
                train_info = {"key": result.key, "reused": result.reused, "history": result.history,
                              "best": result.best, "train_seconds": result.train_seconds}
                metrics.update({k: v for k, v in result.best.items() if k.startswith("val/")})
                metrics["train/seconds"] = result.train_seconds
                metrics["train/reused"] = float(result.reused)
            artifacts["draft"] = str(draft_dir)
            draft = load_trained_draft(draft_dir, target).to(target.dtype).eval()
            drafter = instantiate(method.drafter)(draft)
        else:
            drafter = instantiate(method.drafter)

        eval_record = None
        if cfg.eval.enabled:
            bench = instantiate(cfg.bench, _convert_="object")
            questions = bench.load()
            gen = generation_config(cfg)
            # ConFu adds a contemplate row per node plus soft prompts to every verify pass.
            gen.max_tree_rows = max(gen.max_tree_rows, int(getattr(drafter, "verify_rows", 0)) + 8)
            res = run_benchmark(target, questions, drafter, gen, run_dir, bench=bench.name, method=str(method.name),
                                warmup=int(cfg.eval.warmup), max_turns=cfg.eval.get("max_turns"))
            table = format_table(res)
            print(table)
            (run_dir / "eval_table.txt").write_text(table + "\n")
            metrics.update(res.flat_metrics())
            eval_record = {"bench": bench.name, "method": str(method.name), "label": str(method.get("label", method.name)),
                           "temperature": gen.temperature, "draft_nodes": int(cfg.eval.draft_nodes),
                           "depth": int(cfg.eval.depth), "top_k": int(cfg.eval.top_k),
                           "ttt_length": int(cfg.train.ttt_length) if method.get("trainable") else None,
                           "max_new_tokens": gen.max_new_tokens, "columns": dict(res.metrics["columns"]) | {"AVG": res.metrics["AVG"]},
                           "categories": res.metrics["categories"],
                           "accept_lengths": {str(k): v for k, v in res.accept_histogram.items()},
                           "mismatches_vs_ar": res.mismatches_vs_ar, "answer_files": res.answer_files}
            _log_eval_to_wandb(loggers, res, metrics)
        record = tracking.build_record(cfg, kind=stage, identity=identity, metrics=metrics, artifacts=artifacts,
                                       eval_result=eval_record, train=train_info, ctx=ctx, git=git)
        path = tracking.write_record(run_dir, record)
        log.info("run record: %s", path)
        return record
    finally:
        tracking.finish_wandb()


def _log_eval_to_wandb(loggers: list, res, metrics: dict[str, float]) -> None:
    run = tracking.wandb_run(loggers)
    if run is None:
        return
    import wandb

    run.log({k: v for k, v in metrics.items() if k.startswith("eval/")})
    cols = ["column", "n_questions", "tau", "speedup", "method_tps", "baseline_tps"]
    groups = dict(res.metrics["columns"]) | {"AVG": res.metrics["AVG"]}
    table = wandb.Table(columns=cols, data=[[c] + [m.get(k) for k in cols[1:]] for c, m in groups.items()])
    hist = wandb.Table(columns=["accept_length", "rounds"], data=[[int(k), int(v)] for k, v in res.accept_histogram.items()])
    run.log({f"eval/{res.bench}/table": table,
             f"eval/{res.bench}/accept_lengths": wandb.plot.bar(hist, "accept_length", "rounds",
                                                                 title="accepted tokens per round")})
