"""EAGLE-3: draft model (fc fusion + one 2d-input layer + reduced-vocab head) and its training-time test core."""

from draftlab.methods.eagle3.config import Eagle3Config
from draftlab.methods.eagle3.drafter import Eagle3Drafter
from draftlab.methods.eagle3.model import (
    CacheAttention,
    CausalAttention,
    DraftAttention,
    Eagle3Draft,
    causal_mask,
    masked_attention,
)
from draftlab.methods.eagle3.ttt import (
    TTTAttention,
    TTTOutput,
    naive_ttt_attention,
    ttt_attention,
    ttt_attention_mask,
    ttt_forward,
)
from draftlab.nn import rope_from_hf_config, simulated_tau

__all__ = ["CacheAttention", "CausalAttention", "DraftAttention", "Eagle3Config", "Eagle3Draft", "Eagle3Drafter",
           "TTTAttention", "TTTOutput", "causal_mask", "masked_attention", "naive_ttt_attention",
           "rope_from_hf_config", "simulated_tau", "ttt_attention", "ttt_attention_mask", "ttt_forward"]
