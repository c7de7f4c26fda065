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

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # the cache lives with the decoding loop, which imports targets
    from draftlab.targets.cache import KVCache, PinnedKV, SparseView


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
    logits: torch.Tensor  # [B, T, V] (only ``PassRequest.logits_rows`` when given)
    aux_hidden: torch.Tensor | None  # [B, T, n_aux * d], concatenated in the configured order
    last_hidden: torch.Tensor | None = None  # [B, T, d] after the final norm
    # [L, B, Hkv, S] with ``PassRequest(attn_mass_rows=W)``: attention mass the last W rows put on each slot
    attn_mass: torch.Tensor | None = None


@dataclass(frozen=True)
class PassRequest:
    """What one target pass computes besides the logits of every row: the features a method reads off it.

    ``Target.forward(input_ids, position_ids, cache, attn_mask, request)``: ids/positions/mask say which rows
    run and what they see; the request says what else comes back and which rows the pass adds. The default
    request is a plain pass (every row's logits, nothing else).
    """

    # [B, T, d] rows that are not vocabulary tokens (``input_ids`` None): soft prompts, contemplate rows
    input_embeds: torch.Tensor | None = None
    # Aux hidden states (``TargetOutput.aux_hidden``): False none; True the target's default taps
    # (``Target.aux_layer_ids``); a list of layer ids (target's convention) those, concatenated in that order.
    aux: bool | Sequence[int] = False
    logits_rows: torch.Tensor | None = None  # [R] rows that need logits (empty: skip the LM head); None all
    last_hidden: bool = False  # also return every row's final-norm hidden state ``last_hidden [B, T, d]``
    # Rows computed once (``PinnedKV``, keys outside the cache) that every layer may also read, where
    # ``pinned_mask [B|1, T, P]`` or ``[T, P]`` allows (None: every row sees all).
    pinned: PinnedKV | None = None
    pinned_mask: torch.Tensor | None = None
    # W > 0: also ``attn_mass [L, B, Hkv, S]`` (S = past + T), per layer and KV head the attention probability
    # the last W rows put on each slot, summed over the W rows and the head's query heads.
    attn_mass_rows: int = 0

    def aux_layer_ids(self, default: Sequence[int]) -> list[int]:
        """The layers to capture: ``default`` (the target's taps) when ``aux is True``."""
        if self.aux is True:
            return list(default)
        return [] if self.aux is False else list(self.aux)


@dataclass
class LayerOutput:
    """What ``Target.forward_layers`` returns."""

    hidden: torch.Tensor  # [B, T, d] residual stream after the last layer run (before the final norm)
    aux: torch.Tensor | None  # [B, T, n_aux * d] hidden states of the requested layers, in the requested order


@runtime_checkable
class Target(Protocol):
    """Everything methods and the decoding engine may use of a target model.

    Layer ids (``aux_layer_ids``, ``check_layer_ids``, ``forward_layers(aux_layer_ids=...)``) are in
    ``layer_convention``; layer *ranges* (``forward_layers(start, end)``) index decoder layers 0..L-1.
    """

    geometry: Geometry
    tokenizer: object
    name: str
    layer_convention: LayerConvention
    aux_layer_ids: list[int]  # default taps, for callers that do not name their own
    eos_token_ids: list[int]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def model(self) -> torch.nn.Module:
        """The frozen HF model (weights shared with the forward; for HF ``generate`` and weight tying)."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    def new_cache(self, batch_size: int, max_length: int) -> KVCache: ...

    def check_layer_ids(self, ids) -> list[int]:
        """``ids`` as ints, or ``ValueError`` if one is not a layer (in ``layer_convention``)."""
        ...

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                request: PassRequest | None = None) -> TargetOutput:
        """T new rows (ids [B, T] or ``request.input_embeds [B, T, d]``) through the whole model, writing
        scratch KV. ``request`` says what the pass computes besides every row's logits (``PassRequest``)."""
        ...

    def forward_with_grad(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                          request: PassRequest | None = None) -> TargetOutput:
        """``forward`` under the caller's grad mode, reading the cache only (differentiable w.r.t. embeds)."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T] -> [B, T, d]``."""
        ...

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head, ``[..., d] -> [..., d]``."""
        ...

    def lm_head(self, h: torch.Tensor, *, norm: bool = True) -> torch.Tensor:
        """``h [B, T, d] -> logits [B, T, V]``; ``norm`` applies ``final_norm`` first."""
        ...

    def forward_layers(self, hidden: torch.Tensor, start: int, end: int, *, position_ids: torch.Tensor | None = None,
                       cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                       slots: torch.Tensor | list[int] | None = None, view: SparseView | None = None,
                       aux_layer_ids: list[int] | None = None) -> LayerOutput:
        """Decoder layers ``[start, end)`` on ``hidden [B, T, d]``, K/V of just those layers at ``slots``."""
        ...
