"""Drafts from Lightning training checkpoints.

The EAGLE-3 training module stores the draft under its ``draft`` attribute, so ``ckpt["state_dict"]`` holds
``draft.<native key>`` (never ``draft.embed_tokens.weight``: checkpoints carry no target weights), and
``ckpt["eagle3_config"]`` holds ``Eagle3Config.to_dict()``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.export.common import assemble_draft
from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.training.checkpoint import draft_state, read_checkpoint
from draftlab.utils.errors import ArtifactError


def _config(ckpt: dict, path: Path) -> Eagle3Config:
    if "eagle3_config" not in ckpt:
        raise ArtifactError("holds no 'eagle3_config': it was not written by the EAGLE-3 training module", file=path)
    try:
        return Eagle3Config.from_dict(dict(ckpt["eagle3_config"]))
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"invalid: {e}", file=path, field="eagle3_config") from e


def read_lightning_config(path: str | Path) -> Eagle3Config:
    """The draft config of a Lightning ``.ckpt``, without reading its weights (they are memory-mapped)."""
    path = Path(path)
    return _config(read_checkpoint(path, mmap=True), path)


def read_lightning_checkpoint(path: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """``(config, draft tensors under native names)`` from a Lightning ``.ckpt``; clear errors naming the file."""
    path = Path(path)
    ckpt = read_checkpoint(path)
    config = _config(ckpt, path)
    # Other modules of the training module (e.g. loss buffers) are not part of the draft.
    tensors = draft_state(ckpt, path)
    return config, tensors


def draft_from_lightning_checkpoint(path: str | Path, *, target=None, require_embedding: bool = True,
                                    dtype: str | torch.dtype | None = None,
                                    device: torch.device | str | None = None) -> Eagle3Draft:
    """Rebuild the trained ``Eagle3Draft`` from a Lightning checkpoint.

    The checkpoint has no embedding, so it is copied from ``target`` (a Target, or a zero-argument function
    returning one); without a target, ``require_embedding=True`` raises and ``False`` leaves the embedding
    NaN-filled (enough to export). A truncated or corrupt file raises ``ValueError`` naming it. The draft
    comes back on ``device``, else on the target's device, else on the CPU (``assemble_draft``).
    """
    config, tensors = read_lightning_checkpoint(path)
    return assemble_draft(config, tensors, source=str(path), target=target,
                          require_embedding=require_embedding, dtype=dtype, device=device)


__all__ = ["draft_from_lightning_checkpoint", "read_lightning_checkpoint", "read_lightning_config"]
