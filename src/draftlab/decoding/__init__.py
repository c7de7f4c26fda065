"""The lossless speculative-decoding engine: cache, tree utilities, the verifier, reference drafters.

The loop itself is ``draftlab.decoding.engine`` (``speculative_generate``, ``autoregressive_generate``,
``GenerationConfig``) and is not imported here: it drives a target (``draftlab.targets``), whose backends
keep their KV in ``decoding.cache``, so importing it with the package would make ``draftlab.targets`` and
``draftlab.decoding`` each wait on the other.
"""

from draftlab.decoding.cache import KVCache, PinnedKV, SparseView
from draftlab.decoding.drafter import DecodeState, Drafter, ExtraOutput, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.dynamic_tree import build_dynamic_tree
from draftlab.decoding.reference_drafters import OracleDrafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.decoding.verify import VerifyResult, verify

__all__ = ["DecodeState", "DraftTree", "Drafter", "ExtraOutput", "ExtraRows", "KVCache", "NoDrafter",
           "OracleDrafter", "PinnedKV", "SparseView", "VerifyOutput", "VerifyResult", "ancestor_mask",
           "build_dynamic_tree", "logits_to_probs", "sample", "verify"]
