"""Hybrid drafting: a learned draft's tree and a lookup drafter's tree verified in one pass."""

from draftlab.methods.hybrid.drafter import HybridDrafter, learned_plus_lookup, union_tree

__all__ = ["HybridDrafter", "learned_plus_lookup", "union_tree"]
