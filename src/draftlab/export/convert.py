"""Load a draft from any supported source and write it in one or both export formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.export.common import (
    CONFIG_FILE,
    is_target_factory,
    read_config,
    resolve_max_positions,
    verifier_info,
)
from draftlab.export.lightning_ckpt import draft_from_lightning_checkpoint
from draftlab.export.native import load_native, save_native
from draftlab.export.speculators import load_speculators, save_speculators
from draftlab.export.validate import check_valid
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.utils.atomic import atomic_dir
from draftlab.utils.errors import ArtifactError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

SOURCE_KINDS = ("lightning", "native", "speculators")
EXPORT_FORMATS = ("native", "speculators", "both")


def detect_source(path: str | Path) -> str:
    """``"lightning"`` for a checkpoint file, ``"native"`` / ``"speculators"`` for an export directory."""
    path = Path(path)
    if path.is_file():
        return "lightning"
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ValueError(f"{path} is a directory without {CONFIG_FILE}: not a draft export")
        return "speculators" if "speculators_model_type" in read_config(path) else "native"
    raise FileNotFoundError(f"checkpoint {path} does not exist")


def load_draft(path: str | Path, *, target=None, require_embedding: bool = True,
               dtype: str | torch.dtype | None = None) -> Eagle3Draft:
    """Load a draft from a Lightning ``.ckpt`` or a native / speculators directory (see ``detect_source``).

    ``target`` (a Target or a zero-argument function returning one) supplies the embedding when the source
    has none; ``require_embedding=False`` accepts its absence (the embedding is then NaN-filled).
    """
    kind = detect_source(path)
    if target is not None and not is_target_factory(target):
        check_fits_target(path, target)  # before any weight is read
    loader = {"lightning": draft_from_lightning_checkpoint, "native": load_native,
              "speculators": load_speculators}[kind]
    return loader(path, target=target, require_embedding=require_embedding, dtype=dtype)


def check_fits_target(path: str | Path, target) -> None:
    """``ArtifactError`` naming the export's ``config.json`` and field when the draft was built for another
    target geometry (its embedding is the target's, its fc reads the target's hidden states). Reads only
    the config; Lightning checkpoints hold their config beside the weights and are checked on load."""
    kind = detect_source(path)
    if kind == "lightning":
        return
    file = Path(path) / CONFIG_FILE
    cfg = read_config(path)
    layer = (cfg.get("transformer_layer_config") or {}) if kind == "speculators" else cfg
    prefix = "transformer_layer_config." if kind == "speculators" else ""
    g, name = target.geometry, getattr(target, "name", "the target")
    checks = [(prefix + "hidden_size", layer.get("hidden_size"), g.hidden_size, "hidden size (the shared embedding)"),
              ("target_hidden_size", cfg.get("target_hidden_size") or layer.get("hidden_size"), g.hidden_size,
               "hidden size of the features its fc reads"),
              (prefix + "vocab_size", layer.get("vocab_size"), g.vocab_size, "vocabulary")]
    for field, value, want, what in checks:
        if value is not None and int(value) != int(want):
            raise ArtifactError(f"the draft was built for a target with {what} {value}, but {name} has {want}",
                                file=file, field=field)


def _source_max_positions(path: Path, kind: str) -> int | None:
    if kind == "lightning":
        return None
    cfg = read_config(path)
    if kind == "speculators":
        cfg = cfg.get("transformer_layer_config") or {}
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def export_checkpoint(checkpoint: str | Path, output_dir: str | Path, *, format: str = "both",
                      dtype: str | torch.dtype | None = None, include_embedding: bool = False, target=None,
                      max_position_embeddings: int | None = None, verifier_name_or_path: str | None = None,
                      verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                      validate: bool = True) -> dict[str, Path]:
    """Export ``checkpoint`` (Lightning ``.ckpt`` or an export directory) as ``format``; returns ``{format: dir}``.

    ``format="both"`` writes ``output_dir/native`` and ``output_dir/speculators``; a single format writes
    ``output_dir`` itself. ``target`` (a Target or a zero-argument function returning one) is only used,
    and only built, when ``include_embedding`` is set and the source has no embedding; a target built here
    also names the verifier and its context length. With ``validate`` every written directory is checked
    (``ValueError`` listing all problems).
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; use one of {EXPORT_FORMATS}")
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    kind = detect_source(checkpoint)

    built: dict[str, Any] = {}

    def get_target():
        if "target" not in built:
            built["target"] = target() if is_target_factory(target) else target
        return built["target"]

    use_target = get_target if (include_embedding and target is not None) else None
    draft = load_draft(checkpoint, target=use_target, require_embedding=include_embedding)
    log.info("loaded %s draft from %s (%d layer(s), V_d=%d)", kind, checkpoint, draft.config.num_layers,
             draft.config.draft_vocab_size)

    verifier = built.get("target")
    if not is_target_factory(target) and target is not None:
        verifier = target
    info = verifier_info(verifier)
    if max_position_embeddings is None:
        max_position_embeddings = info.get("max_position_embeddings") or _source_max_positions(checkpoint, kind)
    max_position_embeddings = resolve_max_positions(max_position_embeddings, info)

    formats = ["native", "speculators"] if format == "both" else [format]
    written: dict[str, Path] = {}
    for fmt in formats:
        out = output_dir / fmt if format == "both" else output_dir
        # Written and validated in a hidden sibling, then renamed: a failed validation leaves nothing behind.
        with atomic_dir(out) as tmp:
            if fmt == "native":
                save_native(draft, tmp, dtype=dtype, include_embedding=include_embedding,
                            verifier=verifier if verifier is not None else verifier_name_or_path,
                            max_position_embeddings=max_position_embeddings)
            else:
                save_speculators(draft, tmp, verifier_name_or_path=verifier_name_or_path or info.get("name") or "",
                                 verifier_architectures=verifier_architectures or info.get("architectures"),
                                 speculative_tokens=speculative_tokens, dtype=dtype,
                                 include_embedding=include_embedding, max_position_embeddings=max_position_embeddings)
            if validate:
                check_valid(tmp, fmt)
        log.info("wrote %s export to %s", fmt, out)
        written[fmt] = out
    return written


__all__ = ["EXPORT_FORMATS", "SOURCE_KINDS", "detect_source", "export_checkpoint", "load_draft"]
