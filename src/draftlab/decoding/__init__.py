"""The lossless speculative-decoding engine: cache, tree utilities, the verifier, the loop, baselines.

The loop (``decoding.engine``) is loaded on first use: it drives a target (``draftlab.targets``), whose
backends in turn keep their KV in ``decoding.cache``. Importing the engine eagerly here would make
``import draftlab.targets`` and ``import draftlab.decoding`` each depend on the other finishing first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from draftlab.decoding.cache import KVCache, PinnedKV, SparseView
from draftlab.decoding.drafter import DecodeState, Drafter, ExtraOutput, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.dynamic_tree import build_dynamic_tree
from draftlab.decoding.reference_drafters import OracleDrafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.decoding.verify import VerifyResult, verify

if TYPE_CHECKING:
    from draftlab.decoding.engine import (
        DecodeStats,
        GenerationConfig,
        RoundTrace,
        autoregressive_generate,
        speculative_generate,
    )

_ENGINE = ("DecodeStats", "GenerationConfig", "RoundTrace", "autoregressive_generate", "speculative_generate")

__all__ = ["DecodeState", "DecodeStats", "DraftTree", "Drafter", "ExtraOutput", "ExtraRows", "GenerationConfig",
           "KVCache", "NoDrafter", "OracleDrafter", "PinnedKV", "RoundTrace", "SparseView", "VerifyOutput",
           "VerifyResult", "ancestor_mask", "autoregressive_generate", "build_dynamic_tree", "logits_to_probs",
           "sample", "speculative_generate", "verify"]


def __getattr__(name: str):
    if name in _ENGINE:
        return getattr(importlib.import_module("draftlab.decoding.engine"), name)
    raise AttributeError(f"module 'draftlab.decoding' has no attribute '{name}'")
