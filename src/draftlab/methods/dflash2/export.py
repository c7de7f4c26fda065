"""The DFlash2 HF format (vLLM ``DFlash2DraftModel``): DFlash's directory with DFlash2's fields and tensors.

``config.json`` is DFlash's (``dflash/export.py``) with ``architectures: ["DFlash2DraftModel"]`` and four more
``dflash_config`` keys, as vLLM's ``qwen3_dflash2.py`` reads them: ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``. ``model.safetensors`` adds, per layer, ``attention_conv`` / ``mlp_conv``
(``base_kernel [2, k, d]``, ``kernel_projection.weight [2 k groups, d]``) and the ``candidate_selector``'s
``predecessor_codebook`` / ``successor_codebook [V, r]`` and ``hidden_projection.weight [r, d]`` (vLLM prefixes
``model.`` to every name, as for DFlash). The fields vLLM reads with defaults (``input_embedding_scale``,
``output_multiplier``, ``final_logit_softcapping``) are left out: a DFlash2 draft here has none of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftlab.methods.dflash import export as dflash_export
from draftlab.methods.dflash2.config import DFlash2Config
from draftlab.methods.dflash2.model import DFlash2Draft

save = dflash_export.save  # the config and tensors follow the draft's own class
chain_knobs = dflash_export.chain_knobs


def validate(path: str | Path, *, target=None) -> list[str]:
    """Every problem vLLM's DFlash2 loader would hit with the export at ``path`` (empty = valid)."""
    return dflash_export.validate(path, target=target, config_class=DFlash2Config)


def load(path: str | Path, *, target, dtype: str | torch.dtype | None = None) -> DFlash2Draft:
    """The DFlash2 draft saved at ``path`` (validated first), sharing ``target``'s embedding and LM head."""
    return dflash_export.load(path, target=target, dtype=dtype, draft_class=DFlash2Draft)


def architecture(path: str | Path) -> str | None:
    """The first architecture ``config.json`` at ``path`` names (None when unreadable)."""
    import json

    try:
        archs = json.loads((Path(path) / dflash_export.CONFIG_FILE).read_text()).get("architectures") or [None]
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0]
