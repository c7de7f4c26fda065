"""Reading a Lightning training checkpoint and its draft weights, for any method (export and methods alike).

Every method's training module holds its draft under the ``draft`` attribute, so ``ckpt["state_dict"]``
holds ``draft.<name>`` for each of the draft's own tensors (torch.compile inserts ``_orig_mod.``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.utils.errors import ArtifactError

DRAFT_PREFIX = "draft."
_COMPILED = "_orig_mod."


def read_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dict; ``ArtifactError`` naming the file for a truncated, corrupt or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        # Lightning checkpoints pickle hyper-parameters and loop state, so weights_only loading refuses them;
        # only load checkpoints you trust.
        ckpt: Any = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # truncated zips, bad pickles and short reads raise unrelated types
        raise ArtifactError(f"cannot read Lightning checkpoint (truncated or corrupt?): {type(e).__name__}: {e}",
                            file=path) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ArtifactError("not a Lightning checkpoint (no 'state_dict')", file=path)
    return ckpt


def draft_state(ckpt: dict[str, Any], path: str | Path) -> dict[str, torch.Tensor]:
    """The draft's tensors of a checkpoint dict, under the draft's own names."""
    tensors = {key.removeprefix(DRAFT_PREFIX).replace(_COMPILED, ""): t for key, t in ckpt["state_dict"].items()
               if key.startswith(DRAFT_PREFIX)}
    if not tensors:
        raise ArtifactError(f"state_dict has no '{DRAFT_PREFIX}*' entries", file=Path(path))
    return tensors
