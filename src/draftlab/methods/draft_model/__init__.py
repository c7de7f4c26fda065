"""A standalone draft model: any causal LM sharing the target's tokenizer drafts with its own KV cache (the
classic speculative-sampling baseline), e.g. the target's own first layers."""

from draftlab.methods.draft_model.drafter import DraftModelDrafter
from draftlab.methods.draft_model.lm import DraftLM

__all__ = ["DraftLM", "DraftModelDrafter"]
