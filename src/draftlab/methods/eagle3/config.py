"""Configuration of the EAGLE-3 draft model, including the variant knobs that differ across projects."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from draftlab.nn import LlamaLayerGeometry
from draftlab.nn.window import check_window
from draftlab.targets.base import LayerConvention, to_convention


@dataclass
class Eagle3Config:
    """Sizes and variant switches of an EAGLE-3 draft (one 2d-input decoder layer over fused target features).

    Field names follow the native SGLang/SpecForge ``config.json`` where one exists, so an exporter can
    write them through; ``layer_convention`` is draftlab's own and must be exported explicitly.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary V (the frozen embedding is V x d)
    draft_vocab_size: int  # V_d, rows of lm_head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope-scaling dict ({"rope_type": "llama3" | "linear", ...}); None or rope_type "default"
    # means plain RoPE. Passed through to the export unchanged.
    rope_scaling: dict[str, Any] | None = None
    # d_t, the width of each tapped target hidden state; None means equal to hidden_size.
    target_hidden_size: int | None = None
    # Layers after the first take the d-dim residual stream only (no embedding), as in vLLM/SGLang.
    num_layers: int = 1
    # Which target hidden states are concatenated (in this order) into the 3*d_t fc input, and under
    # which naming convention ("output_of" = SpecForge/SGLang, "input_to" = EAGLE/vLLM/speculators).
    aux_layer_ids: list[int] = field(default_factory=list)
    layer_convention: str = LayerConvention.OUTPUT_OF.value

    # ---- variant knobs (reference section 1.2 / 1.3); defaults reproduce native EAGLE-3 / SpecForge ----
    # EAGLE 3.1: one RMSNorm per tapped state (weights fc_norm.{0,1,2}) before the concat and fc.
    fc_norm: bool = False
    # gpt-oss / speculators style: one RMSNorm over the whole 3*d_t concat (weight input_norm) before fc.
    # Mutually exclusive with fc_norm: both normalise the same input.
    norm_before_fc: bool = False
    # speculators / vLLM-speculators default: the attention residual adds hidden_norm(h) instead of the
    # raw h. Native EAGLE-3/SpecForge checkpoints use False; vLLM assumes True when the key is absent
    # from a speculators config, so exports must always write it.
    norm_before_residual: bool = False
    # SpecForge's meaning: apply the final RMSNorm (norm.weight) before lm_head. It does NOT select what
    # is fed back across draft steps: the fed-back hidden state is always the pre-norm residual stream
    # (speculators' norm_output, which feeds the post-norm state back, is a different switch).
    norm_output: bool = True
    # Sliding-window attention (HF's sliding_window; draftlab.nn.window): a row at position p sees draft keys at
    # positions > p - W, counting its own; None = full causal attention. TTT step k of row t sits at position t + k,
    # so it sees the step-0 keys t + k - W < s <= t and its own keys of steps j > k - W (all of them once W > k).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.layer_convention = LayerConvention(self.layer_convention).value
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive (both normalise the fc input)")
        LlamaLayerGeometry.of(self)  # the decoder layer's own consistency checks
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.aux_layer_ids and len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target hidden states, got aux_layer_ids={self.aux_layer_ids}")
        # The draft decides whether to run fc by the width of its hidden input (3*d_t vs d); equal widths
        # would make the draft's own fed-back state indistinguishable from target features.
        if 3 * self.target_hidden_size == self.hidden_size:
            raise ValueError("3 * target_hidden_size == hidden_size makes fused features and draft states ambiguous")
        self.sliding_window = check_window(self.sliding_window)

    @property
    def layer(self) -> LlamaLayerGeometry:
        """The decoder layer's sizes (also what an exporter writes as the Llama fields of ``config.json``)."""
        return LlamaLayerGeometry.of(self)

    @property
    def fc_in_features(self) -> int:
        return 3 * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["sliding_window"] is None:
            # Left out at its default: a draft without a window keeps the dict (checkpoints, the exports' draftlab
            # block) it had before the field existed, and such an old dict reads back with the default.
            del out["sliding_window"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        return cls(**data)

    @classmethod
    def from_target(cls, target, *, draft_vocab_size: int, aux_layer_ids: list[int] | None = None,
                    layer_convention: str | LayerConvention | None = None, **overrides) -> Eagle3Config:
        """A draft config sized like ``target`` (a ``draftlab.targets.Target``), as EAGLE-3 recipes do.

        Without ``aux_layer_ids`` the draft taps the tensors the target is configured to capture; asking
        for a different ``layer_convention`` renames those ids, it does not change which tensors they are.
        ``overrides`` replace any other field (e.g. ``intermediate_size``, ``fc_norm``).
        """
        g = target.geometry
        src = LayerConvention(target.layer_convention)
        conv = LayerConvention(layer_convention) if layer_convention is not None else src
        if aux_layer_ids is None:
            aux_layer_ids = [to_convention(i, src, conv) for i in target.aux_layer_ids]
        fields: dict[str, Any] = dict(
            LlamaLayerGeometry.from_target(target, default_eps=1e-5).fields(), vocab_size=g.vocab_size,
            draft_vocab_size=draft_vocab_size, target_hidden_size=g.hidden_size,
            aux_layer_ids=list(aux_layer_ids), layer_convention=conv.value,
        )
        fields.update(overrides)
        return cls(**fields)
