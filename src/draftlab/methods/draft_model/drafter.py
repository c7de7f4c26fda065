"""The draft-model drafter: a separate causal LM proposes a chain of ``depth`` tokens (or a top-k tree) each round.

Leviathan et al. / Chen et al.'s speculative sampling with a small model of the target's family, the
baseline vLLM, SGLang and SSD all ship. At T = 0 the chain is the draft's argmax; at T > 0 each token is
drawn from the draft's sampling distribution ``q`` (the engine's temperature, top-k and top-p), which the
tree carries as ``draft_probs`` so the verifier's ``min(1, p/q)`` rule keeps the output exact. With
``branching > 1`` the draft grows an EAGLE-2 dynamic tree instead (top-k candidates: the deterministic rule).

The draft is built at the first sequence from the target it runs beside (``source: truncate``: the target's
first ``layers`` layers; or a model directory / hub id / ``asset:`` name sharing the target's tokenizer).
"""

from __future__ import annotations

from draftlab.decoding.drafter import DecodeState, Drafter, VerifyOutput
from draftlab.decoding.outcome_drafter import Sampling
from draftlab.decoding.tree import DraftTree
from draftlab.methods.draft_model.lm import DraftLM
from draftlab.methods.draft_model.model import load_draft_model


class DraftModelDrafter(Drafter):
    """source     ``truncate`` (the target's first ``layers`` layers, final norm and LM head) or a causal LM.
    layers     decoder layers of the draft (``truncate``; for another model: its first ``layers``, null = all).
    depth      tokens drafted per round (a chain), or the depth of the tree.
    branching  1: a chain; > 1: a top-``branching`` dynamic tree keeping ``nodes`` nodes.
    """

    def __init__(self, *, source: str = "truncate", layers: int | None = None, depth: int = 4, branching: int = 1,
                 nodes: int = 16):
        if int(depth) < 0 or int(branching) < 1 or int(nodes) < 0:
            raise ValueError(f"need depth >= 0, branching >= 1, nodes >= 0; got {depth}, {branching}, {nodes}")
        self.source, self.layers = str(source), None if layers is None else int(layers)
        self.depth, self.branching, self.nodes = int(depth), int(branching), int(nodes)
        self.lm: DraftLM | None = None
        self._target_id: int | None = None
        self._drafted = 0

    def scratch_rows(self, cfg) -> int:
        return 1 + (self.depth if self.branching == 1 else self.nodes)

    def draft_lm(self, target) -> DraftLM:
        """The draft model beside ``target`` (built once per target)."""
        if self.lm is None or self._target_id != id(target):
            self.lm = DraftLM(load_draft_model(self.source, target, self.layers))
            self._target_id = id(target)
        return self.lm

    def outcome_drafter(self, target) -> DraftLM:
        """The draft model drafts after any sequence (``decoding.outcome_drafter``): SSD's base."""
        return self.draft_lm(target)

    def reset(self, state: DecodeState) -> None:
        self.draft_lm(state.target)
        self._drafted = 0

    def propose(self, state: DecodeState) -> DraftTree:
        lm = self.draft_lm(state.target)
        if self.branching > 1:
            tree = lm.tree(state.tokens, depth=self.depth, branching=self.branching, nodes=self.nodes)
        else:
            tree = lm.chain(state.tokens, self.depth, Sampling.of(state)).tree(state.root)
        self._drafted += tree.size - 1
        return tree

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        pass  # the next ``propose`` syncs the draft's cache with the committed tokens

    def sequence_stats(self) -> dict[str, float]:
        return {"drafted": self._drafted}
