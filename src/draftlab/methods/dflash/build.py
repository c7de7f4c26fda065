"""DFlash's registry entries (``conf/method/dflash.yaml``): the draft builder and the artifact save/load.

The pipeline calls these through ``draftlab.methods.registry.MethodSpec``; the artifact is the DFlash HF
directory (``export.py``), so a trained draft is servable as it stands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.methods.dflash.config import DFlashConfig, default_mask_token_id, default_taps
from draftlab.methods.dflash.model import DFlashDraft
from draftlab.nn import LlamaLayerGeometry
from draftlab.nn.placement import target_device
from draftlab.targets.base import LayerConvention, to_convention
from draftlab.utils.errors import ConfigError


def build_draft(target, vocab=None, *, taps: list[int] | None = None, num_layers: int = 5, num_taps: int = 5,
                block_size: int = 16, mask_token_id: int | None = None, intermediate_size: int | None = None,
                init_norm_from_target: bool = True, seed: int | None = None, init: dict | None = None,
                **overrides: Any) -> DFlashDraft:
    """A fresh DFlash draft sized like ``target`` and sharing its (frozen) embedding and LM head, or one
    continued from ``init.from`` (a DFlash artifact directory: on-policy training starts from a trained draft);
    either on the target's device.

    taps             target layers to read, in ``target.layer_convention``; None = DFlash's ``num_taps``
                     layers spread over the target's depth (``config.default_taps``, counted output_of).
    num_layers       draft decoder layers (DFlash: 5; fewer for a small CPU target).
    block_size       B: the anchor plus B-1 proposals per round.
    mask_token_id    None = ``config.default_mask_token_id(target)``.
    intermediate_size  MLP width; None = the target's.
    init_norm_from_target  start the draft's final ``norm`` from the target's final norm: its output
                     feeds the target's LM head, which expects that scale.
    seed             seed of the random init (None: the global RNG).
    overrides        any other ``DFlashConfig`` field (``rms_norm_eps``, ``rope_theta``, ``sliding_window``, ...).
    """
    if vocab is not None:
        raise ConfigError("DFlash (conf/method/dflash.yaml) predicts through the target's own LM head over the "
                          "full vocabulary; set method.draft_vocab_size: null (an experiment's draft vocabulary for "
                          "other methods belongs in their tuning files)")
    init = {k: v for k, v in (init or {}).items() if v is not None}
    if init.get("from"):
        draft = load_artifact(init["from"], target=target)
        asked = {"num_layers": num_layers, "block_size": block_size, "target_layer_ids": taps,
                 "mask_token_id": mask_token_id, "intermediate_size": intermediate_size, **overrides}
        clash = {k: (v, getattr(draft.config, k)) for k, v in asked.items()
                 if v is not None and getattr(draft.config, k) != (list(v) if k == "target_layer_ids" else v)}
        if clash:
            raise ConfigError(f"method.draft.init.from={init['from']} disagrees with method.draft "
                              f"(configured, loaded): {clash}")
        draft.to(device=target_device(target), dtype=target.dtype).share_target_weights(target)
        return draft
    g = target.geometry
    conv = LayerConvention(target.layer_convention)
    if taps is None:
        taps = [to_convention(i, LayerConvention.OUTPUT_OF, conv) for i in default_taps(g.num_layers, num_taps)]
    taps = [int(i) for i in taps]
    check = getattr(target, "check_layer_ids", None)
    if check is not None:
        check(taps)
    layer = LlamaLayerGeometry.from_target(target, default_eps=1e-6).fields()
    if intermediate_size:
        layer["intermediate_size"] = int(intermediate_size)
    fields: dict[str, Any] = dict(
        layer, vocab_size=g.vocab_size, num_layers=int(num_layers), block_size=int(block_size),
        mask_token_id=int(mask_token_id) if mask_token_id is not None else default_mask_token_id(target),
        target_layer_ids=taps, layer_convention=conv.value, num_target_layers=g.num_layers,
    )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    config = DFlashConfig(**fields)
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        draft = DFlashDraft(config)  # drawn on the CPU: a seed gives the same draft on any device
    draft.to(device=target_device(target), dtype=target.dtype).share_target_weights(target)
    if init_norm_from_target:
        with torch.no_grad():
            draft.norm.weight.copy_(target.model.model.norm.weight.to(draft.norm.weight.dtype))
    return draft


def save_artifact(draft: DFlashDraft, out_dir: str | Path, *, target=None) -> Path:
    """The trained draft as a DFlash HF directory (``export.save``)."""
    from draftlab.methods.dflash.export import save

    return save(draft, out_dir, target=target)


def load_artifact(path: str | Path, *, target) -> DFlashDraft:
    """A DFlash HF directory (draftlab's export or a z-lab checkpoint built for ``target``)."""
    from draftlab.methods.dflash.export import load

    return load(path, target=target)
