"""The data stage: target -> conversations -> regeneration -> rendered samples + loss masks -> vocab map.

Every expensive product is a content-addressed artifact under ``paths.artifacts``: regenerated data is
keyed by (target, data, regeneration settings), the vocab map by (data, template, tokenizer, max length,
V_d). Re-running with the same settings reuses them; an interrupted regeneration resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from draftlab.data.regenerate import (
    RegenConfig,
    RegenReport,
    load_regenerated,
    regen_key_config,
    regenerate,
)
from draftlab.data.template import RenderedSample, RenderReport, render_conversations, require_chat_template
from draftlab.data.vocab import VocabMapping, load_or_build_vocab_mapping, vocab_mapping_cache_key
from draftlab.methods.registry import MethodSpec
from draftlab.serving.regen_server import engine_identity, open_engine
from draftlab.training import ranks
from draftlab.utils.atomic import atomic_write_text
from draftlab.utils.hashing import content_key
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


# Target settings that only say which hidden states a forward captures, which of two equal products a
# small-row pass uses, or whether passes are compiled (the same sums in another order): they change no token the target produces, so neither regenerated data nor a
# training key depends on them (methods choose their taps; the row kernels are a per-machine choice).
_CAPTURE_KEYS = ("aux_layer_ids", "layer_convention", "row_kernels", "compile")


def target_identity(cfg: DictConfig) -> dict:
    """The target config minus capture settings: what decides the tokens the target produces.

    The device enters by its type only: ``cuda:1`` computes what ``cuda:0`` and ``cuda`` do (so every rank of a
    DDP job, and every job of a parallel sweep, shares one regeneration and one feature store), while a CPU and
    a GPU do not produce identical numbers.
    """
    ident = OmegaConf.to_container(cfg.target, resolve=True)
    if ident.get("device") is not None:
        ident["device"] = str(ident["device"]).split(":", 1)[0]
    return {k: v for k, v in ident.items() if k not in _CAPTURE_KEYS}


@dataclass
class DataStageResult:
    target: object
    samples: list[RenderedSample]
    render_report: RenderReport
    regen_report: RegenReport | None
    vocab: VocabMapping | None
    data_key: str
    regen_path: Path | None
    # What decides the target's tokens (``target_identity``): computed here once, and read by every later key
    # (offline features, the training key) beside ``data_key``.
    target_id: dict | None = None

    def summary(self) -> dict:
        return {
            "data_key": self.data_key,
            "samples": len(self.samples),
            "render": asdict(self.render_report),
            "regeneration": None if self.regen_report is None else {
                k: v for k, v in asdict(self.regen_report).items() if k != "paths"} | {"path": str(self.regen_path)},
            "vocab": None if self.vocab is None else {"draft_vocab_size": int(self.vocab.d2t.numel()),
                                                      "coverage": self.vocab.coverage},
        }


def run_data_stage(cfg: DictConfig, spec: MethodSpec | None, target=None) -> DataStageResult:
    """The data stage; in a multi-process job rank 0 builds every product and the other ranks then load them.

    ``spec``: the run's method (``MethodSpec(cfg.method)``, built once by the caller; None: no vocabulary map),
    whose draft vocabulary size decides the vocabulary map."""
    with ranks.main_first("data"):
        return _run_data_stage(cfg, target, spec)


def _run_data_stage(cfg: DictConfig, target, spec: MethodSpec | None) -> DataStageResult:
    t0 = time.perf_counter()
    target = target if target is not None else instantiate(cfg.target)
    log.info("target %s: %s", getattr(target, "name", "?"), target.geometry)
    if spec is not None:
        spec.for_target(target)  # draft_vocab_size: auto -> the number, in the run's config itself
    require_chat_template(target.tokenizer)
    data = instantiate(cfg.data, _convert_="object")
    convs, _ = data.load()
    # Capture settings (which layers a forward taps) change no generated token: not part of the key.
    target_id = target_identity(cfg)
    data_key = content_key(data.fingerprint())
    regen_report, regen_path = None, None
    if cfg.regen.enabled:
        rcfg = RegenConfig(**{k: v for k, v in OmegaConf.to_container(cfg.regen, resolve=True).items() if k != "enabled"},
                           seed=cfg.seed)
        # max_batches / max_attempts only decide how far and how persistently runs go, and the server settings
        # where requests go, not what they write; a serving engine's name and version do enter the key.
        key_cfg = regen_key_config(rcfg, engine_identity(rcfg))
        data_key = content_key(target_id, data.fingerprint(), key_cfg)
        # One pool per (target, files, settings): a larger slice of the same files resumes a smaller one.
        pool_key = content_key(target_id, data.pool_fingerprint(), key_cfg)
        regen_path = Path(cfg.paths.artifacts) / "regen" / pool_key / "regenerated.jsonl"
        if ranks.is_main():  # only rank 0 regenerates (and starts a server, with regen.server.launch)
            with open_engine(target, rcfg) as engine:
                regen_report = regenerate(target, convs, regen_path, rcfg, engine=engine)
            log.info("%s", regen_report)
        else:
            # Only load: regenerate() would resume, i.e. retry rank 0's failures and go on past its max_batches,
            # and this rank would train on other conversations than rank 0.
            log.info("rank %d: loading rank 0's regenerated data", ranks.rank())
        log.info("regenerated data: %s", regen_path)
        convs = load_regenerated(regen_path, ids=[c.id for c in convs])
    samples, render_report = render_conversations(target.tokenizer, convs, max_length=data.max_length,
                                                  truncation=data.truncation)
    log.info("%s", render_report)
    vocab = None
    draft_vocab_size = spec.draft_vocab_size if spec is not None else None
    if draft_vocab_size:
        vkey = vocab_mapping_cache_key(data_key, target.tokenizer.chat_template, getattr(target, "name", ""),
                                       data.max_length, draft_vocab_size)
        vocab = load_or_build_vocab_mapping(lambda: samples, cache_dir=cfg.paths.artifacts, key=vkey,
                                            vocab_size=target.geometry.vocab_size,
                                            draft_vocab_size=draft_vocab_size)
        log.info("draft vocabulary: %d of %d tokens cover %.2f%% of assistant tokens",
                 draft_vocab_size, target.geometry.vocab_size, 100 * vocab.coverage)
    result = DataStageResult(target, samples, render_report, regen_report, vocab, data_key, regen_path, target_id)
    log.info("data stage done in %.1f s", time.perf_counter() - t0)
    return result


def write_summary(result: DataStageResult, out_dir: str | Path) -> Path:
    return atomic_write_text(Path(out_dir) / "data_summary.json", json.dumps(result.summary(), indent=2, default=str))
