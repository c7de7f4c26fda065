"""Sliding-window attention for drafts: one convention everywhere, and the HF ``config.json`` keys that carry it.

The convention is HF's (``sliding_window`` of Qwen3 / Mistral configs; transformers' sliding-window mask
``kv_idx > q_idx - sliding_window``) and vLLM's (flash-attn ``window_size = (W - 1, 0)``): with window ``W``, a
query at position ``p`` may see a key at position ``s`` only if ``p - W < s``, i.e. the ``W`` positions
``p - W + 1 .. p`` counting its own. What bounds ``s`` from above (causality, DFlash's "context before the
anchor") is each method's own rule; the window only cuts keys that are too far back. ``None`` = full attention.

Exports mark every draft layer ``sliding_attention`` in ``layer_types`` (a windowed draft windows all its
layers), set ``use_sliding_window: true`` (Qwen3's HF config drops ``sliding_window`` without it) and
``sliding_window: W``; a draft without a window writes none of this beyond what its format always wrote.
"""

from __future__ import annotations

from typing import Any

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


def check_window(window: Any, *, what: str = "sliding_window") -> int | None:
    """``window`` as a positive int, or None (full attention); ``ValueError`` naming ``what`` otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{what} must be a positive integer (keys per query, its own position included) or null "
                         f"(full attention), got {window!r}")
    return int(window)


def in_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool ``[..., Q, S]``: key ``s`` is within ``window`` of query ``q`` (``key_pos[s] > query_pos[q] - window``).

    query_positions ``[..., Q]``, key_positions ``[S]`` (or broadcastable ``[..., S]``)."""
    return key_positions[..., None, :] > query_positions[..., :, None] - window


def hf_window_keys(window: int, num_layers: int) -> dict[str, Any]:
    """The ``config.json`` keys of a stack of ``num_layers`` layers that all attend within ``window``."""
    return {"layer_types": [SLIDING] * int(num_layers), "use_sliding_window": True, "sliding_window": int(window)}


def window_from_hf(cfg: dict[str, Any], num_layers: int) -> int | None:
    """The window a ``config.json`` dict gives every layer (None: full attention), as vLLM reads it: ``layer_types``
    says which layers slide, ``sliding_window`` by how much.

    ``ValueError`` for a mix of sliding and full layers (a draftlab draft windows all or none), a ``layer_types``
    of the wrong length, sliding layers without a usable ``sliding_window``, and ``use_sliding_window: true``
    without ``layer_types`` (which layers slide then depends on the reader: Qwen3's ``max_window_layers``, or
    none for vLLM's Llama layers).
    """
    types = cfg.get("layer_types")
    if types is None:
        if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
            raise ValueError("use_sliding_window without layer_types: readers disagree on which layers slide; "
                             "write layer_types")
        return None
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list '{SLIDING}' or '{FULL}' for each of the {num_layers} layers, "
                         f"got {types!r}")
    if len(set(types)) > 1:
        raise ValueError(f"layer_types {types} mixes sliding and full layers; draftlab drafts window every layer "
                         "or none")
    if types[0] == FULL:
        return None
    return check_window(cfg.get("sliding_window"), what="sliding_window of the sliding layers")


def window_problems(cfg: dict[str, Any], window: int | None, num_layers: int, where: str = "config.json"
                    ) -> list[str]:
    """What keeps ``cfg`` from telling an engine the draft's ``window`` (empty: it says exactly that)."""
    try:
        read = window_from_hf(cfg, num_layers)
    except ValueError as e:
        return [f"{where}: {e}"]
    if read != window:
        said = "full attention" if read is None else f"a sliding window of {read}"
        want = "full attention" if window is None else f"a sliding window of {window}"
        return [f"{where}: layer_types / use_sliding_window / sliding_window say {said}, the draft has {want}"]
    if window is not None and cfg.get("use_sliding_window") is not True:
        return [f"{where}: use_sliding_window must be true for a windowed draft (Qwen3's HF config drops "
                "sliding_window without it)"]
    return []
