"""The lossless speculative-decoding engine: tree utilities, the verifier, reference drafters.

The loop itself is ``draftlab.decoding.engine`` (``speculative_generate``, ``autoregressive_generate``,
``GenerationConfig``). The KV cache belongs to the targets (``draftlab.targets.cache``), the layer below.
"""

from draftlab.decoding.drafter import DecodeState, Drafter, ExtraOutput, ExtraRows, NoDrafter, VerifyOutput
from draftlab.decoding.dynamic_tree import build_dynamic_tree
from draftlab.decoding.reference_drafters import OracleDrafter
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, ancestor_mask
from draftlab.decoding.verify import VerifyResult, verify

__all__ = ["DecodeState", "DraftTree", "Drafter", "ExtraOutput", "ExtraRows", "NoDrafter",
           "OracleDrafter", "VerifyOutput", "VerifyResult", "ancestor_mask",
           "build_dynamic_tree", "logits_to_probs", "sample", "verify"]
