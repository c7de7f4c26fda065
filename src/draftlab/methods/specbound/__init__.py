"""SpecBound (Wen & Feng, Findings of ACL 2026, arXiv:2604.12247): bounded early-exit self-speculation.

The target drafts for itself: each new token runs the target's first layers until a trained exit head's
annealed confidence passes a threshold (then its argmax is the next draft token) or a depth bound is hit
(a difficult token: the round stops); at most ``w_max`` tokens are drafted per round. The shallow K/V of
drafted tokens stays in the target's cache, and one pass completes every pending token through the
remaining layers: its final-layer logits are the verification.

- ``heads.py``: the exit heads (a learned d x d map before the target's frozen final norm + LM head) and
  the annealed confidence threshold;
- ``module.py``: their training (KL to the final layer, base model frozen) and held-out calibration metrics;
- ``drafter.py``: drafting and the completion pass over the layer-level cache;
- ``build.py``: the registry's draft builder and artifact format.
"""

from draftlab.methods.specbound.heads import ExitHeads, SpecBoundConfig, act_temperature

__all__ = ["ExitHeads", "SpecBoundConfig", "act_temperature"]
