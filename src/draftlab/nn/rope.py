"""Rotary position embeddings (plain, ``linear`` and ``llama3`` scaling) and reading them from an HF config."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from draftlab.nn.norm import compute_dtype


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp64) for plain, ``linear`` or ``llama3`` RoPE."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [hd/2]
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        # Positions divided by the factor == frequencies divided by it.
        return inv / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths (beyond the original context / low) are slowed by the full factor, short ones
        # (below context / high) are kept, and the band in between is interpolated linearly in ctx/wavelen.
        smooth = ((ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen > ctx / low, inv / factor, torch.where(wavelen < ctx / high, inv, scaled))
    raise NotImplementedError(f"rope_type '{rope_type}' is not supported by draftlab's draft layers (default, linear, llama3)")


class Rotary(nn.Module):
    """Llama rotary embedding with explicit positions; holds no state_dict entries (exports stay clean)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        # A plain attribute, not a buffer: ``model.to(bf16)`` must not round the frequencies.
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [hd/2] fp64
        self._cached: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, T, hd]`` for ``position_ids [B, T]``."""
        ct = compute_dtype(dtype)
        key = (position_ids.device, ct)
        inv = self._cached.get(key)
        if inv is None:
            inv = self._cached[key] = self._inv_freq.to(device=position_ids.device, dtype=ct)
        freqs = position_ids.to(ct)[..., None] * inv  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def rope_from_hf_config(hf_config) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from an HF config of transformers 4 or 5.

    transformers 5 moved both into ``config.rope_parameters`` (possibly one dict per attention type);
    transformers 4 keeps ``rope_theta`` and ``rope_scaling`` as attributes.
    """
    if hf_config is None:
        return 10000.0, None
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" not in params:
        # Per-layer-type parameters (e.g. sliding vs full attention): the draft layer is full attention.
        nested = params.get("full_attention") or next((v for v in params.values() if isinstance(v, dict)), None)
        params = nested
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0) or 10000.0)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if rope_type == "default" else scaling)
