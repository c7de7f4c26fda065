"""``draftlab-export`` for any method: a checkpoint, through the method's ``export`` block, into its formats.

The method decides everything method-specific (``conf/method/<m>.yaml`` ``export:``): its formats and
their writers, their validators, aliases, and optionally its own checkpoint exporter (EAGLE-3 reads its
export directories and Lightning checkpoints without building the target). Without one, the checkpoint is
loaded through the method (a Lightning ``.ckpt`` of its training module into a draft it builds, or its
artifact directory through ``artifact.load``) and each format is written into a hidden sibling of its
directory, validated there and only then renamed into place.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from draftlab.export.lightning_ckpt import load_into
from draftlab.methods.registry import MethodSpec, call_with_settings
from draftlab.utils.atomic import atomic_dir
from draftlab.utils.errors import ArtifactError
from draftlab.utils.logging import get_logger

log = get_logger(__name__)


def is_target_factory(target) -> bool:
    # Targets themselves are callable (forward), so only plain functions count as deferred construction.
    return inspect.isfunction(target) or inspect.ismethod(target) or isinstance(target, functools.partial)


def load_for_export(spec: MethodSpec, checkpoint: str | Path, *, target):
    """The draft in ``checkpoint``: a Lightning ``.ckpt`` of the method's module, or its artifact directory."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return load_into(spec.build_draft(target, None), checkpoint)
    if checkpoint.is_dir():
        return spec.load(checkpoint, target)
    raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")


def export_checkpoint(spec: MethodSpec, checkpoint: str | Path, output_dir: str | Path, *, format: str = "all",
                      target=None, validate: bool = True, **settings) -> dict[str, Path]:
    """Export ``checkpoint`` as ``format`` (one of the method's formats, an alias, or ``all``); ``{format: dir}``.

    One format is written into ``output_dir`` itself (keyed as asked for), ``all`` (and an alias of it) into
    ``output_dir/<format>`` for each, however many the method has.
    ``target``: a Target or a zero-argument function building one. ``settings`` (dtype,
    max_position_embeddings, ...) reach each writer that takes them. With ``validate``, every directory is
    checked by the format's validator: ``ValueError`` listing the problems, and nothing left behind.
    """
    formats = spec.resolve_export_format(format)  # an unknown format fails before anything is loaded
    own = spec.checkpoint_exporter
    if own is not None:
        return call_with_settings(own, checkpoint, output_dir, format=format, target=target, validate=validate,
                                  **settings)
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    target = target() if is_target_factory(target) else target
    draft = load_for_export(spec, checkpoint, target=target)
    log.info("loaded %s draft from %s", spec.name, checkpoint)
    every = spec.export_aliases.get(str(format), str(format)) == "all"
    written: dict[str, Path] = {}
    for fmt in formats:
        out = output_dir / fmt if every else output_dir
        with atomic_dir(out) as tmp:
            spec.export(fmt, draft, tmp, target=target, **settings)
            problems = spec.validate_export(fmt, tmp, target=target) if validate else []
            if problems:
                raise ArtifactError(f"would not be a valid {spec.name} {fmt} export: " + "; ".join(problems),
                                    file=out)
        log.info("wrote %s export to %s", fmt, out)
        written[fmt if every else str(format)] = out
    return written


__all__ = ["export_checkpoint", "is_target_factory", "load_for_export"]
