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

# Top-level keys fixed by how draftlab drafts (the module docstring says why), as vLLM reads them.
FIXED_KEYS = {"confidence_head_with_markov": False, "sample_from_anchor": False}


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

    def extra_hf_keys(self) -> dict[str, Any]:
        """The top-level keys vLLM's ``Qwen3DSparkModel`` and its speculator read."""
        return {"markov_rank": self.markov_rank, "enable_confidence_head": self.enable_confidence_head,
                "draft_vocab_size": self.vocab_size, **FIXED_KEYS}

    @classmethod
    def check_hf_keys(cls, cfg: dict[str, Any], problems: list[str]) -> None:
        """The top-level keys vLLM's DSpark reads, against the ``dflash_config`` copy draftlab reads back."""
        dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
        rank = cfg.get("markov_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            problems.append(f"config.json 'markov_rank' must be an integer >= 1 (vLLM sizes the Markov head by it), "
                            f"got {rank!r}")
        elif dc.get("markov_rank", rank) != rank:
            problems.append(f"config.json 'markov_rank' {rank} disagrees with dflash_config markov_rank {dc['markov_rank']}")
        conf = cfg.get("enable_confidence_head")
        if not isinstance(conf, bool):
            problems.append(f"config.json 'enable_confidence_head' must be true or false, got {conf!r}")
        elif dc.get("enable_confidence_head", conf) != conf:
            problems.append(f"config.json 'enable_confidence_head' {conf} disagrees with dflash_config's")
        for key, want in FIXED_KEYS.items():
            if cfg.get(key) is not want:
                problems.append(f"config.json '{key}' must be {str(want).lower()} (draftlab's DSpark: see "
                                f"methods/dspark/config.py), got {cfg.get(key)!r}")
        vocab = cfg.get("draft_vocab_size")
        if vocab is not None and vocab != cfg.get("vocab_size"):
            problems.append(f"config.json 'draft_vocab_size' {vocab} != vocab_size {cfg.get('vocab_size')} (the draft "
                            "predicts through the target's full LM head)")

    @classmethod
    def from_dflash(cls, base: DFlashConfig, **fields: Any) -> DSparkConfig:
        """The DSpark config of a DFlash draft ``base`` with the heads' ``fields``."""
        return cls(**{**base.to_dict(), **fields})
