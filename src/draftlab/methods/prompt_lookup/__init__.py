"""Prompt lookup decoding: a training-free n-gram drafter over the request's own context."""

from draftlab.methods.prompt_lookup.drafter import PromptLookupDrafter

__all__ = ["PromptLookupDrafter"]
