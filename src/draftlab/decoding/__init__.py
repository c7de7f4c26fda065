"""The lossless speculative-decoding engine: cache, tree utilities, the verifier, the loop, baselines."""

from draftlab.decoding.cache import KVCache, PinnedKV, SparseView
from draftlab.decoding.drafter import DecodeState, Drafter, ExtraOutput, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.engine import (
           DecodeStats,
           GenerationConfig,
           RoundTrace,
           autoregressive_generate,
           speculative_generate,
)
from draftlab.decoding.reference_drafters import OracleDrafter, PromptLookupDrafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, ancestor_mask, build_dynamic_tree
from draftlab.decoding.verify import VerifyResult, verify

__all__ = ["DecodeState", "DecodeStats", "DraftTree", "Drafter", "ExtraOutput", "ExtraRows", "GenerationConfig",
           "KVCache", "NoDrafter", "OracleDrafter", "PinnedKV", "SparseView", "PromptLookupDrafter", "RoundTrace", "VerifyOutput",
           "VerifyResult", "ancestor_mask",
           "autoregressive_generate", "build_dynamic_tree", "logits_to_probs", "sample", "speculative_generate",
           "verify"]
