"""EAGLE-3's registry entries (``conf/method/eagle3.yaml``): draft builder, artifact save/load, features.

The pipeline calls these through ``draftlab.methods.registry.MethodSpec``; nothing outside this folder
knows that an EAGLE-3 draft is saved in the SGLang/vLLM native format or taps three target layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.methods.eagle3.model import Eagle3Draft
from draftlab.targets.base import default_aux_layer_ids
from draftlab.utils.errors import ConfigError


def build_draft(*, target, vocab=None, taps: list[int] | None = None, init: dict | None = None,
                **overrides: Any) -> Eagle3Draft:
    """A fresh draft sized like ``target`` (``overrides``: Eagle3Config fields), or one continued from ``init.from``.

    ``taps``: the 3 target layers (target's convention) the draft reads; None = EAGLE-3's defaults
    ``[1, L//2-1, L-4]`` (output_of) / ``[2, L//2, L-3]`` (input_to). ``init.lm_head``: ``random``
    (EAGLE/SpecForge) or ``target`` (the target's rows for the draft vocabulary, as speculators does).
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    init = {k: v for k, v in (init or {}).items() if v is not None}
    if init.get("from"):
        # Continue training an existing draft (its vocabulary mapping included): ConFu's "same steps" control.
        from draftlab.methods.eagle3.export.convert import load_draft

        draft = load_draft(str(init["from"]), target=target).float()
        clash = {k: (v, getattr(draft.config, k)) for k, v in overrides.items() if getattr(draft.config, k) != v}
        if clash:
            raise ConfigError(f"method.draft.init.from={init['from']} disagrees with method.draft "
                              f"(configured, loaded): {clash}")
        return draft
    if taps is None:
        taps = default_aux_layer_ids(target.geometry.num_layers, target.layer_convention)
    draft = Eagle3Draft.from_target(target, vocab_mapping=vocab, aux_layer_ids=list(taps), **overrides)
    lm_head = init.get("lm_head", "random")
    if lm_head == "target":
        init_head_from_target(draft, target)
    elif lm_head != "random":
        raise ConfigError(f"must be 'random' or 'target', got '{lm_head}'", field="method.draft.init.lm_head")
    return draft


@torch.no_grad()
def init_head_from_target(draft: Eagle3Draft, target) -> None:
    """Start ``lm_head`` (and the final norm) from the target's: row i = the target's row for draft id i.

    EAGLE/SpecForge initialise the head randomly; speculators copies the target's rows (and freezes them).
    Copying without freezing gives a short CPU run a head that already speaks the target's vocabulary.
    """
    head = target.model.get_output_embeddings().weight  # [V, d]
    if head.shape[1] != draft.config.hidden_size:
        raise ValueError(f"target head width {head.shape[1]} != draft hidden size {draft.config.hidden_size}")
    draft.lm_head.weight.copy_(head[draft.target_ids().to(head.device)].to(draft.lm_head.weight.dtype))
    draft.norm.weight.copy_(target.model.model.norm.weight.to(draft.norm.weight.dtype))


def save_artifact(draft: Eagle3Draft, out_dir: str | Path, *, target) -> Path:
    """The trained draft as a native SGLang/vLLM EAGLE-3 directory."""
    from draftlab.methods.eagle3.export.native import save_native

    return save_native(draft, out_dir, verifier=target)


def load_artifact(path: str | Path, *, target) -> Eagle3Draft:
    """A native / speculators directory or a Lightning checkpoint of an EAGLE-3 draft."""
    from draftlab.methods.eagle3.export.convert import load_draft

    return load_draft(path, target=target)
