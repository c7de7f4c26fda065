"""Load a draft from any supported source and write it in the serving formats, one directory per engine.

| format        | engine                                  | aux ids written as                    | ``norm_output`` |
|---------------|-----------------------------------------|---------------------------------------|-----------------|
| ``sglang``    | SGLang EAGLE3, SpecForge (``native``)   | ``eagle_config`` ids, ``output_of``   | final norm before lm_head (SpecForge) |
| ``vllm``      | vLLM ``method: eagle3``                 | top-level + ``eagle_config``, ``input_to`` | ``false``: pre-norm state fed back |
| ``speculators`` | ``vllm serve <dir>``                  | top-level, ``input_to``               | ``false``: pre-norm state fed back |

``all`` (alias ``both``) writes every one into ``output_dir/<format>``; ``native`` is an alias of ``sglang``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.methods.eagle3.export.common import (
    CONFIG_FILE,
    is_target_factory,
    read_config,
    resolve_max_positions,
    verifier_info,
)
from draftlab.methods.eagle3.export.lightning import draft_from_lightning_checkpoint, read_lightning_config
from draftlab.methods.eagle3.export.native import load_native, save_native
from draftlab.methods.eagle3.export.speculators import load_speculators, save_speculators
from draftlab.methods.eagle3.export.validate import check_valid
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.utils.atomic import atomic_dir
from draftlab.utils.errors import ArtifactError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)

SOURCE_KINDS = ("lightning", "native", "speculators")
# One directory per engine, each read by that engine as the draft was trained (see the module docstring).
SINGLE_FORMATS = ("sglang", "vllm", "speculators")
FORMAT_ALIASES = {"native": "sglang", "both": "all"}
EXPORT_FORMATS = (*SINGLE_FORMATS, "all", *FORMAT_ALIASES)


def export_formats(format: str) -> list[str]:
    """The single formats ``format`` stands for (``all`` / ``both``: every one)."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; use one of {EXPORT_FORMATS}")
    canonical = FORMAT_ALIASES.get(format, format)
    return list(SINGLE_FORMATS) if canonical == "all" else [canonical]


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
               dtype: str | torch.dtype | None = None, device: torch.device | str | None = None) -> Eagle3Draft:
    """Load a draft from a Lightning ``.ckpt`` or a native / speculators directory (see ``detect_source``).

    ``target`` (a Target or a zero-argument function returning one) supplies the embedding when the source
    has none; ``require_embedding=False`` accepts its absence (the embedding is then NaN-filled).
    The draft comes back on ``device`` if given, else on the target's device (a factory's only when it was
    built for the embedding), else on the CPU.
    """
    kind = detect_source(path)
    if target is not None and not is_target_factory(target):
        check_fits_target(path, target)  # before any weight is read
    loader = {"lightning": draft_from_lightning_checkpoint, "native": load_native,
              "speculators": load_speculators}[kind]
    return loader(path, target=target, require_embedding=require_embedding, dtype=dtype, device=device)


def check_fits_target(path: str | Path, target) -> None:
    """``ArtifactError`` naming the file and field when the draft was built for another target geometry (its
    embedding is the target's, its fc reads the target's hidden states). Reads only the config: an export's
    ``config.json``, or a Lightning checkpoint's ``eagle3_config`` (memory-mapped, so no weight is read)."""
    kind = detect_source(path)
    if kind == "lightning":
        c = read_lightning_config(path)
        file, prefix = Path(path), "eagle3_config."
        sizes = {"hidden_size": c.hidden_size, "target_hidden_size": c.target_hidden_size, "vocab_size": c.vocab_size}
    else:
        file = Path(path) / CONFIG_FILE
        cfg = read_config(path)
        layer = (cfg.get("transformer_layer_config") or {}) if kind == "speculators" else cfg
        prefix = "transformer_layer_config." if kind == "speculators" else ""
        sizes = {"hidden_size": layer.get("hidden_size"),
                 "target_hidden_size": cfg.get("target_hidden_size") or layer.get("hidden_size"),
                 "vocab_size": layer.get("vocab_size")}
    g, name = target.geometry, getattr(target, "name", "the target")
    checks = [(prefix + "hidden_size", sizes["hidden_size"], g.hidden_size, "hidden size (the shared embedding)"),
              # Top-level in both export formats; inside eagle3_config in a Lightning checkpoint.
              (("eagle3_config." if kind == "lightning" else "") + "target_hidden_size", sizes["target_hidden_size"],
               g.hidden_size, "hidden size of the features its fc reads"),
              (prefix + "vocab_size", sizes["vocab_size"], g.vocab_size, "vocabulary")]
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


def export_checkpoint(checkpoint: str | Path, output_dir: str | Path, *, format: str = "all",
                      dtype: str | torch.dtype | None = None, include_embedding: bool = False, target=None,
                      max_position_embeddings: int | None = None, verifier_name_or_path: str | None = None,
                      verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                      validate: bool = True, verifier_config=None) -> dict[str, Path]:
    """Export ``checkpoint`` (Lightning ``.ckpt`` or an export directory) as ``format``; returns ``{format: dir}``.

    ``format``: ``sglang``, ``vllm``, ``speculators`` (one directory: ``output_dir`` itself), or ``all``
    (every one, into ``output_dir/<format>``); ``native`` = ``sglang``, ``both`` = ``all``. The returned keys
    are the formats as asked for (``all``: the single formats).

    ``max_position_embeddings``: explicit, else the target's (``verifier_config``: the target's HF config,
    a dict or a directory with its ``config.json``, read without weights; else ``target``), else the source
    export's; 2048 with a warning only when nothing names the target. ``target`` (a Target or a
    zero-argument function returning one) is built only when the embedding must be written and the source
    has none, or when it is the only source of the context length; a target it gives also names the
    verifier. With ``validate`` every written directory is checked (``ValueError`` listing all problems).
    """
    formats = export_formats(format)
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    kind = detect_source(checkpoint)

    built: dict[str, Any] = {}

    def get_target():
        if "target" not in built:
            built["target"] = target() if is_target_factory(target) else target
        return built["target"]

    use_target = get_target if (include_embedding and target is not None) else None
    # On the CPU: the draft is only written out (export_tensors reads it there), never run.
    draft = load_draft(checkpoint, target=use_target, require_embedding=include_embedding, device="cpu")
    log.info("loaded %s draft from %s (%d layer(s), V_d=%d)", kind, checkpoint, draft.config.num_layers,
             draft.config.draft_vocab_size)

    info = verifier_info(verifier_config)
    # The target is known: its context length wins over a default and over the source export's value (which
    # older exporters wrote as 2048). A target factory is built for it only when nothing cheaper names it.
    needs_target = max_position_embeddings is None and not info.get("max_position_embeddings")
    verifier = None
    if target is not None and (not is_target_factory(target) or "target" in built):
        verifier = get_target()
    elif target is not None and needs_target:
        try:
            verifier = get_target()
        except Exception as e:  # e.g. a hub target on an offline machine: then nothing names the context length
            log.warning("cannot build the target for its context length (%s: %s)", type(e).__name__, e)
    if verifier is not None:
        info = {**verifier_info(verifier), **info}
    if max_position_embeddings is None:
        max_position_embeddings = info.get("max_position_embeddings") or _source_max_positions(checkpoint, kind)
    max_position_embeddings = resolve_max_positions(max_position_embeddings, info)
    name = verifier_name_or_path or info.get("name")
    architectures = verifier_architectures or info.get("architectures")
    # What the native block records as the verifier: the Target itself when there is one, else its name.
    native_verifier = verifier if verifier is not None else name

    written: dict[str, Path] = {}
    for fmt in formats:
        out = output_dir / fmt if len(formats) > 1 else output_dir
        # Written and validated in a hidden sibling, then renamed: a failed validation leaves nothing behind.
        with atomic_dir(out) as tmp:
            if fmt == "speculators":
                save_speculators(draft, tmp, verifier_name_or_path=name or "", verifier_architectures=architectures,
                                 speculative_tokens=speculative_tokens, dtype=dtype,
                                 include_embedding=include_embedding, max_position_embeddings=max_position_embeddings)
            else:
                save_native(draft, tmp, dtype=dtype, include_embedding=include_embedding, verifier=native_verifier,
                            max_position_embeddings=max_position_embeddings, engine=fmt)
            if validate:
                check_valid(tmp, fmt)
        log.info("wrote %s export to %s", fmt, out)
        written[fmt if len(formats) > 1 else format] = out
    return written


__all__ = ["EXPORT_FORMATS", "FORMAT_ALIASES", "SINGLE_FORMATS", "SOURCE_KINDS", "detect_source", "export_checkpoint",
           "export_formats", "load_draft"]
