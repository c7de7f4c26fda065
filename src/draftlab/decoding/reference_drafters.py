"""A reference drafter for checking the engine's accounting (the training-free baselines are methods)."""

from __future__ import annotations

from draftlab.decoding.drafter import DecodeState, Drafter
from draftlab.decoding.tree import DraftTree


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation (computed once per sequence with the AR baseline).

    Under greedy verification every proposal is accepted, so each round emits ``depth + 1`` tokens: an
    accounting check for the engine's statistics, and an upper bound on what a chain drafter can reach.
    """

    def __init__(self, depth: int = 4, reference: list[int] | None = None):
        self.depth = depth
        self.reference = reference  # a greedy AR output computed elsewhere, to avoid recomputing it

    def scratch_rows(self, cfg) -> int:
        return 1 + self.depth

    def reset(self, state: DecodeState) -> None:
        if self.reference is not None:
            state.scratch["oracle"] = list(self.reference)
            return
        from draftlab.decoding.engine import GenerationConfig, autoregressive_generate

        budget = state.cache.max_length - state.prompt_len
        prompt = state.tokens[: state.prompt_len]
        ref, _ = autoregressive_generate(state.target, prompt, GenerationConfig(max_new_tokens=budget, scratch_rows=0,
                                                                                stop_on_eos=False))
        state.scratch["oracle"] = ref

    def propose(self, state: DecodeState) -> DraftTree:
        ref = state.scratch["oracle"]
        pos = len(state.tokens) - state.prompt_len  # tokens emitted so far (the root is ref[pos-1])
        return DraftTree.chain(state.root, ref[pos: pos + self.depth])
