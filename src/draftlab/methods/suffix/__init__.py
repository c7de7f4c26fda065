"""Suffix decoding: training-free speculation from suffix tries over the request and earlier outputs."""

from draftlab.methods.suffix.drafter import SuffixDrafter
from draftlab.methods.suffix.suffix_trie import SuffixTrie

__all__ = ["SuffixDrafter", "SuffixTrie"]
