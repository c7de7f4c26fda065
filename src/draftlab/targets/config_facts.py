"""A target's model config (its ``config.json``) without its weights or tokenizer.

What a run will need (draft sizes, the draft vocabulary, feature storage) follows from the target's shape
alone, which its HF config gives before anything is loaded. Where the config comes from:

* ``tiny_random``: the shape :func:`draftlab.targets.tiny.tiny_random_target` builds with the configured keywords
  (its vocabulary is the tokenizer's: the SmolLM2 tokenizer asset's).
* ``asset:<name>``: the fetched asset's ``config.json`` when it is already on this machine, else the published
  config shipped with draftlab (``hub_configs/asset--<name>.json``); nothing is fetched.
* a local directory: its ``config.json``.
* a hub id: ``transformers.AutoConfig`` (the local cache only under ``HF_HUB_OFFLINE``), else the published
  config shipped for the targets in ``conf/target/`` (``hub_configs/<org>--<name>.json``).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftlab.targets.base import Geometry, LayerConvention, default_aux_layer_ids

_SHIPPED = Path(__file__).with_name("hub_configs")
# The SmolLM2 tokenizer asset the tiny target shares (tiny_random_target's ``tokenizer_asset`` default).
_TINY_DEFAULT_TOKENIZER = "smollm2-135m-instruct"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (as huggingface_hub reads it): the hub is not asked, only its local cache."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def shipped_config_name(source: str) -> str:
    """The file name of ``source``'s shipped config: ``org/name`` -> ``org--name.json``, ``asset:x`` ->
    ``asset--x.json``."""
    return source.replace("asset:", "asset/", 1).replace("/", "--") + ".json"


def shipped_config(source: str) -> dict[str, Any] | None:
    """The published ``config.json`` fields shipped for ``source`` (keys starting with ``_`` are notes), or None."""
    path = _SHIPPED / shipped_config_name(source)
    return json.loads(path.read_text()) if path.exists() else None


def config_from_dict(fields: dict[str, Any]):
    """A ``transformers`` config of ``fields['model_type']`` holding ``fields`` (notes and the dtype left out:
    the dtype a target runs in is its own setting)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in fields.items() if not k.startswith("_") and k not in ("model_type", "torch_dtype",
                                                                                       "dtype")}
    return AutoConfig.for_model(str(fields["model_type"]), **kwargs)


class _ConfigHolder:
    """Stands where a loaded target keeps its model: ``.config`` only."""

    def __init__(self, config):
        self.config = config


@dataclass
class ConfiguredTarget:
    """A target as its config describes it, without weights: what sizing code reads of a loaded target
    (``geometry``, ``dtype``, ``layer_convention``, ``aux_layer_ids``, ``model.config``)."""

    name: str
    config: Any  # transformers.PretrainedConfig
    origin: str  # where ``config`` came from
    dtype: torch.dtype
    layer_convention: LayerConvention = LayerConvention.OUTPUT_OF
    aux_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        from draftlab.targets.hf import geometry_of_config

        self.layer_convention = LayerConvention(self.layer_convention)
        self.geometry: Geometry = geometry_of_config(self.config)
        if not self.aux_layer_ids:
            self.aux_layer_ids = default_aux_layer_ids(self.geometry.num_layers, self.layer_convention)
        self.model = _ConfigHolder(self.config)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))


def target_hf_config(target_cfg) -> ConfiguredTarget:
    """``target_cfg`` (a ``conf/target/<t>.yaml`` node or a mapping of its keys) as a :class:`ConfiguredTarget`.

    Loads no weights, tokenizer or model code and reaches no network under ``HF_HUB_OFFLINE``. A hub id with
    neither a cached config nor a shipped one is a ``ValueError`` naming both ways to provide it."""
    from draftlab.targets.hf import resolve_dtype

    keys = dict(target_cfg.items()) if hasattr(target_cfg, "items") else dict(target_cfg)
    source = str(keys["source"])
    config, origin = _config_of(source, keys)
    aux = keys.get("aux_layer_ids")
    return ConfiguredTarget(name=source, config=config, origin=origin, dtype=resolve_dtype(str(keys.get("dtype",
                            "float32"))), layer_convention=keys.get("layer_convention") or "output_of",
                            aux_layer_ids=[] if aux is None else [int(i) for i in aux])


def _config_of(source: str, keys: dict[str, Any]):
    if source == "tiny_random":
        return _tiny_config(keys), "tiny_random_target's shape"
    if source.startswith("asset:"):
        from draftlab.assets import cache_root

        name = source.removeprefix("asset:")
        marker = cache_root() / "assets" / name / "asset.json"
        if marker.exists():
            local = marker.parent / json.loads(marker.read_text()).get("path", "")
            if (local / "config.json").exists():
                return _auto_config(local, local_only=True), f"{local / 'config.json'}"
        return _shipped(source)
    if Path(source).expanduser().is_dir():
        local = Path(source).expanduser()
        return _auto_config(local, local_only=True), f"{local / 'config.json'}"
    try:
        config = _auto_config(source, local_only=hub_offline())
    except (OSError, ValueError):
        return _shipped(source)
    return config, "transformers.AutoConfig" + (" (local cache)" if hub_offline() else "")


def _auto_config(source, *, local_only: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(source), local_files_only=local_only)


def _shipped(source: str):
    fields = shipped_config(source)
    if fields is None:
        raise ValueError(f"target '{source}': no config.json on this machine (cached hub copy or local directory) "
                         f"and none shipped with draftlab ({_SHIPPED / shipped_config_name(source)})")
    return config_from_dict(fields), f"shipped {shipped_config_name(source)} ({fields.get('_source', 'published')})"


def _tiny_config(keys: dict[str, Any]):
    """The ``LlamaConfig`` shape ``tiny_random_target(**keys)`` builds (its defaults where ``keys`` are silent)."""
    from transformers import LlamaConfig

    from draftlab.targets.tiny import tiny_random_target

    params = {n: p.default for n, p in inspect.signature(tiny_random_target).parameters.items()
              if p.default is not inspect.Parameter.empty}
    params.update({k: v for k, v in keys.items() if k in params and v is not None})
    vocab = params.get("vocab_size")
    if vocab is None:
        # The tokenizer's size: the shared SmolLM2 tokenizer (a local ``tokenizer`` directory holds the same).
        tokenizer_source = f"asset:{params.get('tokenizer_asset') or _TINY_DEFAULT_TOKENIZER}"
        vocab = _config_of(tokenizer_source, {})[0].vocab_size
    return LlamaConfig(vocab_size=int(vocab), hidden_size=int(params["hidden_size"]),
                       intermediate_size=int(params["intermediate_size"]),
                       num_hidden_layers=int(params["num_layers"]), num_attention_heads=int(params["num_heads"]),
                       num_key_value_heads=int(params["num_kv_heads"]), max_position_embeddings=4096,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)
