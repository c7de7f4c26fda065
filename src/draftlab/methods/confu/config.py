"""Configuration of a ConFu draft: an EAGLE-3 draft plus the contemplate / future-token knobs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from draftlab.methods.eagle3.config import Eagle3Config


@dataclass
class ConFuConfig(Eagle3Config):
    """``Eagle3Config`` plus ConFu's fields (all with defaults, so any EAGLE-3 config extends to one).

    The replication fields belong to the model, not only to training: they decide which draft rows see a
    future token, and the drafter must apply the same rule at inference as the trainer did.
    """

    # s learnable soft-prompt embeddings (target embedding space), seen only by contemplate rows.
    num_soft_prompts: int = 16
    # The two dynamic-token MoEs ([con] for the target, [f] for the draft): n experts, top-k gating.
    n_experts: int = 8
    top_k_experts: int = 2
    # False: each MoE is a single learned embedding (the "-MoE" ablation).
    moe: bool = True
    # True: a separate fc_f (3*d_t -> d) maps the contemplate state to f; False reuses the draft's fc.
    separate_fc_f: bool = False
    # Future prediction replication: draft row t sees the future token of the latest anchor a <= t while
    # t - a < replicate_length; False restricts it to the anchor row itself (window 1).
    replicate: bool = True
    replicate_length: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_soft_prompts < 0:
            raise ValueError(f"num_soft_prompts must be >= 0, got {self.num_soft_prompts}")
        if self.n_experts < 1 or not 1 <= self.top_k_experts <= self.n_experts:
            raise ValueError(f"need n_experts >= 1 and 1 <= top_k_experts <= n_experts, got "
                             f"{self.n_experts}, {self.top_k_experts}")
        if self.replicate_length < 1:
            raise ValueError(f"replicate_length must be >= 1, got {self.replicate_length}")

    @property
    def future_window(self) -> int:
        """How many draft rows, from the anchor on, see one anchor's future token."""
        return self.replicate_length if self.replicate else 1

    @classmethod
    def confu_field_names(cls) -> set[str]:
        """The fields ConFu adds to ``Eagle3Config``."""
        return {f.name for f in fields(cls)} - {f.name for f in fields(Eagle3Config)}

    @classmethod
    def from_eagle3(cls, config: Eagle3Config, **confu: Any) -> ConFuConfig:
        """The EAGLE-3 config ``config`` extended with ConFu fields ``confu`` (defaults otherwise)."""
        unknown = set(confu) - cls.confu_field_names()
        if unknown:
            raise ValueError(f"unknown ConFu config fields {sorted(unknown)}")
        base = {f.name: getattr(config, f.name) for f in fields(Eagle3Config)}
        return cls(**base, **confu)
