"""The frozen target behind one interface, and the two layer-id conventions for auxiliary hidden states.

Every method reads target features through ``Target.forward``. EAGLE-3-style drafters tap three hidden
states of the target; two public conventions name the same tensors differently, and mixing them up is the
most common interoperability bug, so draftlab makes the convention an explicit, typed config field:

- ``input_to`` (EAGLE, vLLM, speculators): id i is the residual stream *entering* decoder layer i, which is
  HF ``output_hidden_states[i]``. Default ids ``[2, L//2, L-3]``.
- ``output_of`` (SpecForge, SGLang): id i is the *output* of decoder layer i (0-based), i.e. HF
  ``output_hidden_states[i + 1]``. Default ids ``[1, L//2-1, L-4]``.

The defaults name the same three tensors. Note that HF's last entry ``hidden_states[L]`` is taken *after*
the final norm, whereas ``output_of L-1`` here is the raw residual stream before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

import torch


class LayerConvention(str, Enum):
    INPUT_TO = "input_to"
    OUTPUT_OF = "output_of"


def default_aux_layer_ids(num_layers: int, convention: LayerConvention | str) -> list[int]:
    convention = LayerConvention(convention)
    if convention is LayerConvention.OUTPUT_OF:
        ids = [1, num_layers // 2 - 1, num_layers - 4]
    else:
        ids = [2, num_layers // 2, num_layers - 3]
    # Very shallow models (the 2-layer test target) cannot honour the offsets; clamp into range.
    return sorted(min(max(i, 0), num_layers - 1) for i in ids)


def to_hf_hidden_index(layer_id: int, convention: LayerConvention | str) -> int:
    """Index into HF ``output_hidden_states`` of the tensor that ``layer_id`` names."""
    return layer_id + 1 if LayerConvention(convention) is LayerConvention.OUTPUT_OF else layer_id


def to_convention(layer_id: int, src: LayerConvention | str, dst: LayerConvention | str) -> int:
    """Translate a layer id between conventions (output_of i == input_to i+1)."""
    return to_hf_hidden_index(layer_id, src) - (1 if LayerConvention(dst) is LayerConvention.OUTPUT_OF else 0)


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    model_type: str


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V] (only the requested rows when ``logits_rows`` is given)
    aux_hidden: torch.Tensor | None  # [B, T, n_aux * d], concatenated in the configured order
    last_hidden: torch.Tensor | None = None  # [B, T, d] after the final norm


@runtime_checkable
class Target(Protocol):
    """What methods and the decoding engine may use of a target model."""

    geometry: Geometry
    tokenizer: object
    aux_layer_ids: list[int]
    layer_convention: LayerConvention
    eos_token_ids: list[int]

    def new_cache(self, batch_size: int, max_length: int): ...

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache=None,
                attn_mask: torch.Tensor | None = None, *, return_aux: bool = False,
                logits_rows: torch.Tensor | None = None) -> TargetOutput: ...
