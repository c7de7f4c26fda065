"""Building blocks shared by draft architectures: norms, rotary embeddings, layer geometry, metrics.

Methods take these from here rather than from one another, so no method depends on a sibling's internals.
"""

from draftlab.nn.geometry import LlamaLayerGeometry
from draftlab.nn.metrics import simulated_tau
from draftlab.nn.norm import RMSNorm, compute_dtype
from draftlab.nn.rope import Rotary, apply_rotary, rope_from_hf_config, rope_inv_freq

__all__ = ["LlamaLayerGeometry", "RMSNorm", "Rotary", "apply_rotary", "compute_dtype", "rope_from_hf_config",
           "rope_inv_freq", "simulated_tau"]
