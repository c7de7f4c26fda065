"""DFlash2's registry entries (``conf/method/dflash2.yaml``): the draft builder and the artifact save/load.

A DFlash2 draft is DFlash's plus convolutions and a selector, so ``build_draft`` builds DFlash's fields
with DFlash's builder rules and adds DFlash2's sizes. ``init.from`` takes either a DFlash2 artifact
(continue training) or a DFlash one: its weights fill the backbone, the convolutions start at the identity
and the selector's projection at zero, so the new draft proposes exactly what the DFlash draft did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftlab.methods.dflash import build as dflash_build
from draftlab.methods.dflash.config import DFlashConfig
from draftlab.methods.dflash2 import export
from draftlab.methods.dflash2.config import DFlash2Config
from draftlab.methods.dflash2.model import DFlash2Draft
from draftlab.nn.placement import target_device
from draftlab.utils.errors import ConfigError

_OWN = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_draft(target, vocab=None, *, conv_kernel_size: int = 2, conv_group_size: int = 16,
                selector_rank: int = 256, selector_top_k: int = 16, seed: int | None = None,
                init: dict | None = None, **dflash: Any) -> DFlash2Draft:
    """A DFlash2 draft for ``target`` on its device (every DFlash knob as in ``dflash.build.build_draft``).

    conv_kernel_size  taps of the block convolutions (DFlash2: 2).
    conv_group_size   channels sharing one dynamic coefficient (DFlash2: 16; must divide the width).
    selector_rank     rank of the selector's codebooks (DFlash2: 256; the codebooks are ``V x rank``).
    selector_top_k    unary candidates per slot the selector re-ranks (DFlash2: 16).
    init.from         a DFlash2 artifact, or a DFlash one to start from (see the module docstring).
    """
    own = {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
           "selector_rank": selector_rank, "selector_top_k": selector_top_k}
    init = {k: v for k, v in (init or {}).items() if v is not None}
    source = init.get("from")
    if source and export.architecture(source) == DFlash2Config.architecture:
        draft = export.load(source, target=target)
        clash = {k: (v, getattr(draft.config, k)) for k, v in own.items() if getattr(draft.config, k) != int(v)}
        if clash:
            raise ConfigError(f"method.draft.init.from={source} disagrees with method.draft (configured, loaded): "
                              f"{clash}")
        return draft.to(device=target_device(target), dtype=target.dtype)
    # DFlash's draft (fresh, or the DFlash artifact init.from names) supplies the backbone.
    base = dflash_build.build_draft(target, vocab, seed=seed, init=init, **dflash)
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed + 1)
        draft = DFlash2Draft(DFlash2Config(**base.config.to_dict(), **own))
    draft.to(device=target_device(target), dtype=target.dtype)
    missing, unexpected = draft.load_state_dict(base.state_dict(), strict=False)
    if unexpected or not set(missing) <= set(draft.config.extra_shapes()):
        raise RuntimeError(f"DFlash weights do not fit DFlash2: missing {missing}, unexpected {unexpected}")
    draft.share_target_weights(target)
    return draft


def base_config(draft: DFlash2Draft) -> DFlashConfig:
    """The DFlash config of ``draft``'s backbone (its fields without DFlash2's)."""
    return DFlashConfig(**{k: v for k, v in draft.config.to_dict().items() if k not in _OWN})


def save_artifact(draft: DFlash2Draft, out_dir: str | Path, *, target=None) -> Path:
    """The trained draft as a DFlash2 HF directory (``export.save``)."""
    return export.save(draft, out_dir, target=target)


def load_artifact(path: str | Path, *, target) -> DFlash2Draft:
    """A DFlash2 HF directory built for ``target``."""
    return export.load(path, target=target)
