"""Configuration of a DFlash2 draft: DFlash's fields plus the convolutions' and the selector's sizes.

Field names are the ``dflash_config`` keys vLLM's ``qwen3_dflash2.py`` reads (``conv_kernel_size``,
``conv_group_size``, ``selector_rank``, ``selector_top_k``), so the exporter writes them through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from draftlab.methods.dflash.config import DFlashConfig

_OWN = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlash sizes plus: taps of the block convolutions (``conv_kernel_size``), channels sharing one dynamic
    coefficient (``conv_group_size``), the selector's codebook rank and how many unary candidates it re-ranks."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    architecture: ClassVar[str] = "DFlash2DraftModel"

    def __post_init__(self) -> None:
        super().__post_init__()
        for k in _OWN:
            setattr(self, k, int(getattr(self, k)))
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k={self.selector_top_k} exceeds the {self.vocab_size}-token vocabulary")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def extra_dflash_config(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _OWN}

    @classmethod
    def fields_from_dflash_config(cls, dflash_config: dict[str, Any]) -> dict[str, Any]:
        return {k: int(dflash_config[k]) for k in _OWN}

    def extra_shapes(self) -> dict[str, tuple[int, ...]]:
        d, taps, r, V = self.hidden_size, self.conv_kernel_size, self.selector_rank, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(self.num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                p = f"layers.{i}.{conv}."
                shapes[p + "base_kernel"] = (2, taps, d)
                shapes[p + "kernel_projection.weight"] = (2 * taps * self.conv_groups, d)
        shapes.update({"candidate_selector.predecessor_codebook": (V, r),
                       "candidate_selector.successor_codebook": (V, r),
                       "candidate_selector.hidden_projection.weight": (r, d)})
        return shapes
