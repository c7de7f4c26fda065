"""Configuration of a DSpark draft: a DFlash block draft plus a low-rank Markov head and a confidence head.

Field names follow the vLLM ``Qwen3DSparkModel`` ``config.json`` (``markov_rank``,
``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``), so the exporter
writes them through. Two of vLLM's variants are fixed here on purpose:

- ``sample_from_anchor = False``: the block is DFlash's fill-in layout ``[anchor, MASK x (B-1)]`` where the
  mask slot k predicts the token at ``anchor + k`` (vLLM's "speculators" layout), so a DSpark draft starts
  from a DFlash draft and trains with DFlash's blocks unchanged;
- ``confidence_head_with_markov = False``: the confidence head reads the slot's block state only. With the
  Markov embedding of the previously drawn token as input, the estimate would depend on drawn tokens, and
  a block length chosen from it would condition the kept draws on their own values (``decoding.drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from draftlab.methods.dflash.config import DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    """A :class:`DFlashConfig` plus the DSpark heads.

    markov_rank             r of the transition bias ``markov_w2 @ markov_w1[prev]`` (``V x r`` and ``r x V``).
    enable_confidence_head  a per-slot acceptance estimate ``sigmoid(proj(h_k))`` that sizes each round's block.
    """

    markov_rank: int = 32
    enable_confidence_head: bool = True

    architecture: ClassVar[str] = "Qwen3DSparkModel"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.markov_rank = int(self.markov_rank)
        self.enable_confidence_head = bool(self.enable_confidence_head)
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {self.markov_rank}")

    def extra_dflash_config(self) -> dict[str, Any]:
        # Also under dflash_config, so a config.json without the draftlab block still reads back exactly.
        return {"markov_rank": self.markov_rank, "enable_confidence_head": self.enable_confidence_head}

    @classmethod
    def fields_from_dflash_config(cls, dflash_config: dict[str, Any]) -> dict[str, Any]:
        return {"markov_rank": int(dflash_config["markov_rank"]),
                "enable_confidence_head": bool(dflash_config.get("enable_confidence_head", False))}

    def extra_shapes(self) -> dict[str, tuple[int, ...]]:
        """The heads' tensors under the names vLLM's ``Qwen3DSparkModel`` loads (the ``model.`` prefix is
        vLLM's own, added at load time)."""
        V, r = self.vocab_size, self.markov_rank
        shapes: dict[str, tuple[int, ...]] = {"markov_head.markov_w1.weight": (V, r),
                                              "markov_head.markov_w2.weight": (V, r)}
        if self.enable_confidence_head:
            shapes.update({"confidence_head.proj.weight": (1, self.hidden_size), "confidence_head.proj.bias": (1,)})
        return shapes

    @classmethod
    def from_dflash(cls, base: DFlashConfig, **fields: Any) -> DSparkConfig:
        """The DSpark config of a DFlash draft ``base`` with the heads' ``fields``."""
        return cls(**{**base.to_dict(), **fields})
