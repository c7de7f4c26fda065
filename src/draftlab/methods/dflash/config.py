"""Configuration of a DFlash block draft, and the defaults DFlash derives from the target.

Field names follow the DFlash HF ``config.json`` where one exists (``block_size``, ``mask_token_id``,
``target_layer_ids``), so the exporter writes them through. ``layer_convention`` is draftlab's own: it
says how ``target_layer_ids`` are counted (DFlash itself counts ``output_of``, i.e. HF
``hidden_states[i + 1]``), and the exporter converts to ``output_of`` explicitly. ``sliding_window`` is the HF
key of the same name (``draftlab.nn.window``), exported with ``layer_types`` / ``use_sliding_window``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from draftlab.nn import LlamaLayerGeometry
from draftlab.nn.window import check_window
from draftlab.targets.base import LayerConvention, to_convention

# The paper's loss-decay constants per block size (gamma in w_k = exp(-(k-1)/gamma)).
_PAPER_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


@dataclass
class DFlashConfig:
    """Sizes of a DFlash draft: ``num_layers`` Qwen3-style layers (per-head q/k RMSNorm, no biases).

    The draft's width equals the target's (``hidden_size``): its input embedding and LM head are the
    target's own, shared and frozen, so ``vocab_size`` is the full target vocabulary.

    ``sliding_window`` W (None: full attention): a block row at position ``p = anchor + k`` sees context
    position ``t`` only if ``p - W < t < anchor`` (``draftlab.nn.window``'s convention: W positions counting its
    own). The row still sees its whole block, so W must be at least ``block_size``: a serving engine's window
    (vLLM runs DFlash's bidirectional block with the symmetric window ``(W - 1, W - 1)``) then cuts no block key.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int = 0
    # Tapped target layers, in this order, concatenated into the fc input ([n_taps * hidden_size]).
    target_layer_ids: list[int] = field(default_factory=list)
    layer_convention: str = LayerConvention.OUTPUT_OF.value
    num_target_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None

    # The architecture an export names; a successor (DFlash2, DSpark) names its own and adds its fields.
    architecture: ClassVar[str] = "DFlashDraftModel"

    def extra_dflash_config(self) -> dict[str, Any]:
        """The ``dflash_config`` keys beyond mask / taps / block size that a successor's export carries."""
        return {}

    @classmethod
    def fields_from_dflash_config(cls, dflash_config: dict[str, Any]) -> dict[str, Any]:
        """This class's own fields read from an export's ``dflash_config`` (``KeyError`` when one is missing)."""
        return {}

    def extra_shapes(self) -> dict[str, tuple[int, ...]]:
        """A successor's own exported tensors and their shapes (beyond DFlash's)."""
        return {}

    def extra_hf_keys(self) -> dict[str, Any]:
        """Top-level ``config.json`` keys a successor's engine reads (beyond DFlash's)."""
        return {}

    @classmethod
    def check_hf_keys(cls, cfg: dict[str, Any], problems: list[str]) -> None:
        """Append a problem for each of a successor's top-level ``config.json`` keys that ``cfg`` gets wrong."""

    def __post_init__(self) -> None:
        self.layer_convention = LayerConvention(self.layer_convention).value
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("DFlash needs at least one tapped target layer (target_layer_ids is empty)")
        LlamaLayerGeometry.of(self)  # the decoder layers' own consistency checks
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor plus at least one proposal), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of the "
                             f"{self.vocab_size}-token vocabulary")
        self.sliding_window = check_window(self.sliding_window)
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} is shorter than the block ({self.block_size}): a "
                             "block row must see every row of its block (see DFlashConfig)")

    @property
    def layer(self) -> LlamaLayerGeometry:
        """The decoder layers' sizes (also the Llama fields an exporter writes to ``config.json``)."""
        return LlamaLayerGeometry.of(self)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def taps_in(self, convention: LayerConvention | str) -> list[int]:
        """``target_layer_ids`` renamed into ``convention`` (the same tensors)."""
        return [to_convention(i, self.layer_convention, convention) for i in self.target_layer_ids]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["sliding_window"] is None:
            # Left out at its default: a draft without a window keeps the dict (checkpoints, exports) it had
            # before the field existed, and such an old dict reads back with the default.
            del out["sliding_window"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        return cls(**data)


def default_taps(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """DFlash's tapped layers (``output_of``): ``num_taps`` ids spread uniformly over ``[1, L-3]``.

    ``round(1 + i * (L - 4) / (n - 1))`` as the reference code and SGLang compute it (for Qwen3-8B,
    L = 36: [1, 9, 17, 25, 33]); one tap sits at ``L // 2``. Targets shallower than 4 layers (test
    models) cannot keep the offsets, so the ids spread over ``[0, L-1]`` instead (repeats allowed).
    """
    L, n = int(num_target_layers), int(num_taps)
    if L < 1 or n < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_taps >= 1, got {L}, {n}")
    if n == 1:
        return [L // 2]
    lo, hi = (1, L - 3) if L >= 4 else (0, L - 1)
    return [int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for ``block_size``: the paper's 4/5/7 for B = 8/10/16, else ``7 * B / 16``."""
    return _PAPER_GAMMA.get(int(block_size), max(1.0, 7.0 * block_size / 16.0))


def position_weights(block_size: int, gamma: float) -> list[float]:
    """``w_k = exp(-(k-1)/gamma)`` for block positions ``k = 1..B-1`` (position 0, the anchor, has no label)."""
    return [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


def default_mask_token_id(target) -> int:
    """A token id for the mask slots when the config does not give one.

    In order: the tokenizer's own mask token; the first embedding row past the tokenizer (Qwen3's
    reserved rows, which is what DFlash's Qwen3 checkpoints use); else the highest added special token
    that is neither a bos/eos/pad token nor mentioned by the chat template (for SmolLM2: ``<empty_output>``,
    a code-corpus marker that chat data never contains).
    """
    tok = getattr(target, "tokenizer", None)
    vocab = int(target.geometry.vocab_size)
    mask = getattr(tok, "mask_token_id", None) if tok is not None else None
    if mask is not None and 0 <= int(mask) < vocab:
        return int(mask)
    n_tok = len(tok) if tok is not None else vocab
    if n_tok < vocab:
        return n_tok
    reserved = set(getattr(tok, "all_special_ids", []) or []) | set(getattr(target, "eos_token_ids", []) or [])
    template = getattr(tok, "chat_template", None) or ""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    candidates = [int(i) for i, t in added.items()
                  if getattr(t, "special", False) and int(i) not in reserved and str(t) not in template
                  and 0 <= int(i) < vocab]
    if not candidates:
        raise ValueError("cannot pick a DFlash mask token for this target (no mask token, no spare embedding row, "
                         "no unused special token): set method.draft.mask_token_id")
    return max(candidates)
