"""The shape of one Llama-family decoder layer, as every draft architecture and exporter spells it.

EAGLE-3 and DFlash drafts are built from the same layer (GQA attention with RoPE, SwiGLU MLP, RMSNorm),
sized from the target and written to ``config.json`` under the HF Llama key names. The sizes, their
consistency checks, how they are read from a target and how they are named in HF configs live here once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from draftlab.nn.rope import rope_from_hf_config


@dataclass(frozen=True)
class LlamaLayerGeometry:
    """Sizes of one decoder layer; method configs keep these as flat fields (their serialised form)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope-scaling dict ({"rope_type": "llama3" | "linear", ...}); None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def of(cls, config: Any) -> LlamaLayerGeometry:
        """The geometry fields of any config object that carries them under these names."""
        return cls(config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                   config.head_dim, config.rms_norm_eps, config.rope_theta, config.rope_scaling)

    @classmethod
    def from_target(cls, target, *, default_eps: float) -> LlamaLayerGeometry:
        """A layer sized like ``target``'s own (``target.geometry`` plus norm/RoPE settings of its HF config).

        ``default_eps`` applies when the target has no HF config saying otherwise; it differs per method
        (each follows its reference implementation).
        """
        g = target.geometry
        hf_config = getattr(getattr(target, "model", None), "config", None)
        rope_theta, rope_scaling = rope_from_hf_config(hf_config)
        return cls(g.hidden_size, g.intermediate_size, g.num_heads, g.num_kv_heads, g.head_dim,
                   float(getattr(hf_config, "rms_norm_eps", default_eps)), rope_theta, rope_scaling)

    def fields(self) -> dict[str, Any]:
        """The sizes as method-config keyword arguments."""
        return asdict(self)

    def hf_fields(self, num_layers: int) -> dict[str, Any]:
        """The Llama ``config.json`` keys for a stack of ``num_layers`` such layers.

        ``head_dim`` is always explicit: readers that derive it from ``hidden_size / heads`` go wrong for
        drafts whose layer input is wider than the stream (EAGLE-3) or whose heads are not ``d / H`` wide.
        """
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": num_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
        }
