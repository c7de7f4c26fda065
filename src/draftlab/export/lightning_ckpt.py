"""Draft weights from a Lightning training checkpoint into a draft the method built (``draftlab-export``)."""

from __future__ import annotations

from pathlib import Path

import torch

from draftlab.training.checkpoint import draft_state, read_checkpoint
from draftlab.utils.errors import ArtifactError


def load_into(draft: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load the draft weights of the checkpoint at ``path`` into ``draft`` (built by the method) strictly."""
    tensors = draft_state(read_checkpoint(path), path)
    try:
        draft.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ArtifactError(f"draft weights do not fit the configured method (train and export with the same "
                            f"method settings): {e}", file=Path(path)) from e
    return draft
