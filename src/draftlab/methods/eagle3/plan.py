"""EAGLE-3's part of a training plan (``draftlab.stages.plan``): the draft's sizes and the teacher's chunking.

Computed from a target's config alone (``draftlab.targets.config_facts.ConfiguredTarget``): the draft is built
on the ``meta`` device from the same ``Eagle3Config.from_target`` a run uses, so its parameter count is the
real model's, with no memory and no weights.
"""

from __future__ import annotations

from typing import Any

import torch

from draftlab.targets.base import default_aux_layer_ids

# Keys of the method's ``draft`` block that are not Eagle3Config fields.
_NOT_CONFIG = ("_target_", "_partial_", "init")


def plan(target, *, draft_vocab_size: int, taps: list[int] | None, draft: dict[str, Any]) -> dict[str, Any]:
    """``{"taps", "draft", "teacher"}`` for an EAGLE-3 draft of ``target`` (``draft``: the method's draft block)."""
    from draftlab.methods.eagle3.config import Eagle3Config
    from draftlab.methods.eagle3.model import Eagle3Draft
    from draftlab.methods.eagle3.ttt import _TargetSide

    if taps is None:
        taps = default_aux_layer_ids(target.geometry.num_layers, target.layer_convention)
    overrides = {k: v for k, v in draft.items() if k not in _NOT_CONFIG and v is not None}
    config = Eagle3Config.from_target(target, draft_vocab_size=int(draft_vocab_size), aux_layer_ids=list(taps),
                                      **overrides)
    with torch.device("meta"):
        model = Eagle3Draft(config)
    total = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the target's embedding copy
    V = target.geometry.vocab_size
    return {
        "taps": [int(i) for i in taps],
        "draft": {
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "num_layers": config.num_layers, "fc_in_features": config.fc_in_features,
            "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
            "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
            "parameters": {"total": total, "trainable": total - frozen, "frozen_embedding": frozen,
                           "lm_head": model.lm_head.weight.numel()},
        },
        # The TTT loss reads the target's full-vocabulary logits in chunks of this many rows (fp32).
        "teacher": {"chunk_elements": _TargetSide.CHUNK_ELEMENTS,
                    "chunk_rows": max(1, _TargetSide.CHUNK_ELEMENTS // max(V, 1))},
    }
