"""ConFu (Contemplate the Future, arXiv 2603.08899): EAGLE-3 plus contemplate tokens and a future token."""

from draftlab.methods.confu.config import ConFuConfig
from draftlab.methods.confu.contemplate import contemplate, verify_extra_rows
from draftlab.methods.confu.drafter import ConFuDrafter
from draftlab.methods.confu.model import (
    ConFuDraft,
    EmbeddingMoE,
    FutureTTTAttention,
    build_confu_draft,
    future_ttt_attention,
    future_visibility,
    naive_future_ttt_attention,
)
from draftlab.methods.confu.module import ConFuModule, sample_anchors, sample_lags

__all__ = ["ConFuConfig", "ConFuDraft", "ConFuDrafter", "ConFuModule", "EmbeddingMoE", "FutureTTTAttention",
           "build_confu_draft", "contemplate", "future_ttt_attention", "future_visibility",
           "naive_future_ttt_attention", "sample_anchors", "sample_lags", "verify_extra_rows"]
