"""A trained draft as one run uses it: read from its directory once, then passed down.

A run that evaluates a trained draft needs four things of its artifact directory: the draft itself
(``spec.load``), the sha256 of its weights as saved (what the record's ``draft`` block and the evaluation-reuse
key name), the training step they were saved at (``train_summary.json``) and the method config it was trained
with (``train_config.json``, which the tables' axes read). ``DraftArtifact.open`` reads them together; the
pipeline, the record, the reuse key and the evaluation stage take the one object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from draftlab.tracking import draft_step, weights_sha256


@dataclass
class DraftArtifact:
    dir: Path  # the artifact's ``draft/`` directory
    draft: nn.Module  # as loaded (the caller may cast it to the target's dtype: ``sha256`` names it as saved)
    sha256: str
    step: int | None  # the training step of the saved weights; None for a draft from elsewhere
    trained_config: dict[str, Any] | None  # the method config it was trained with; None for a draft from elsewhere

    @classmethod
    def open(cls, spec, draft_dir: str | Path, target) -> DraftArtifact:
        """Load ``draft_dir`` with ``spec`` (a ``MethodSpec``) beside ``target``, hashing the weights as saved."""
        from draftlab.methods.registry import trained_method_config

        draft_dir = Path(draft_dir)
        draft = spec.load(draft_dir, target)
        return cls(draft_dir, draft, weights_sha256(draft), draft_step(draft_dir), trained_method_config(draft_dir))

    def identity(self) -> dict[str, Any]:
        """The run record's ``draft`` block: ``{"path", "sha256", "step"}``."""
        return {"path": str(self.dir), "sha256": self.sha256, "step": self.step}
