"""DSpark's registry entries (``conf/method/dspark.yaml``): the draft builder and the artifact save/load.

A DSpark draft is a DFlash draft with two heads, so the builder asks DFlash's for the block pass (fresh, or
continued from a DFlash artifact with ``init.from``) and adds fresh heads; ``init.from`` a DSpark artifact
continues that draft, heads included. The artifact is the vLLM ``Qwen3DSparkModel`` directory (``export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftlab.methods.dflash.build import build_draft as build_dflash_draft
from draftlab.methods.dspark.config import DSparkConfig
from draftlab.methods.dspark.model import DSparkDraft
from draftlab.nn.placement import target_device
from draftlab.utils.errors import ConfigError


def _architectures(path: str | Path) -> list[str]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"method.draft.init.from={path} holds no config.json (a DFlash or DSpark artifact)")
    return list(json.loads(file.read_text()).get("architectures") or [])


def build_draft(target, vocab=None, *, markov_rank: int = 32, enable_confidence_head: bool = True,
                seed: int | None = None, init: dict | None = None, **dflash: Any) -> DSparkDraft:
    """A DSpark draft sized like ``target``, on its device, sharing its (frozen) embedding and LM head.

    markov_rank             r of the Markov head (``2 V r`` parameters).
    enable_confidence_head  train and ship the confidence head that sizes each round's block.
    init.from               a DFlash artifact (its block pass, fresh heads: decodes greedily as that draft until
                            trained) or a DSpark artifact (continued as it is; the head settings must agree).
    seed                    seed of the random init (None: the global RNG).
    dflash                  every other keyword is DFlash's builder's (``num_layers``, ``block_size``, ``taps``, ...).
    """
    init = {k: v for k, v in (init or {}).items() if v is not None}
    source = init.get("from")
    if source and DSparkConfig.architecture in _architectures(source):
        draft = load_artifact(source, target=target)
        asked = {"markov_rank": int(markov_rank), "enable_confidence_head": bool(enable_confidence_head)}
        clash = {k: (v, getattr(draft.config, k)) for k, v in asked.items() if getattr(draft.config, k) != v}
        if clash:
            raise ConfigError(f"method.draft.init.from={source} disagrees with method.draft (configured, loaded): {clash}")
        draft.to(device=target_device(target), dtype=target.dtype).share_target_weights(target)
        return draft
    base = build_dflash_draft(target, vocab, seed=seed, init=init, **dflash)
    draft = DSparkDraft.from_dflash(base, markov_rank=markov_rank, enable_confidence_head=enable_confidence_head,
                                    seed=None if seed is None else seed + 1)
    draft.share_target_weights(target)
    return draft


def save_artifact(draft: DSparkDraft, out_dir: str | Path, *, target=None) -> Path:
    """The trained draft as a vLLM DSpark directory (``export.save``)."""
    from draftlab.methods.dspark.export import save

    return save(draft, out_dir, target=target)


def load_artifact(path: str | Path, *, target) -> DSparkDraft:
    """A DSpark directory written by ``export.save`` for ``target``."""
    from draftlab.methods.dspark.export import load

    return load(path, target=target)
