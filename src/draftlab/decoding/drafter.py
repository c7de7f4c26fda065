"""The drafter protocol: the one seam between a speculative method and the decoding engine.

Each round the engine asks ``drafter.propose(state)`` for a ``DraftTree`` rooted at the last committed
token, verifies it in one target pass, commits the accepted path and calls ``drafter.update(state, result)``.
The verifier and the acceptance rule never change per method; methods differ only in how they propose.

How every method on the roadmap fits:

- **EAGLE-3 (feature drafters, dynamic trees).** ``needs_aux = True``: the engine returns the target's
  auxiliary hidden states for the prefill rows and for the accepted rows of every verify pass
  (``state.accepted_aux``). The drafter keeps its own draft KV cache across rounds, extends it with those
  features in ``update``, and grows an EAGLE-2 dynamic tree with ``decoding.tree.build_dynamic_tree``.
- **ConFu (contemplate rows, a carried future vector).** ``extra_rows(state, tree)`` returns extra inputs
  (embeddings + their mask rows + positions) appended after the tree in the verify pass. They attend to
  the prefix and to their own node's ancestors, nothing attends to them, and they are never committed to
  the target cache (``KVCache.commit_rows`` only keeps the accepted path). The engine hands the outputs
  of those rows back through ``state.extra_out``; the drafter picks the row of the last accepted node as
  its future vector for the next round.
- **Self-speculation (SpecBound early exit, SparseSpec-L sparse KV).** ``propose`` may run the target's own
  first layers / a sparse view of its cache: ``state.target`` and ``state.cache`` are exposed read-only
  (draft rows go to scratch slots past ``cache.length``; the verify pass overwrites them). Proposals carry
  their draft distribution (``draft_probs``) when sampled, so the min(1, p/q) rule stays exact.
- **Block drafters (DFlash).** A block of tokens proposed in one shot is a chain: ``DraftTree.chain``.
- **Speculation caches (SSD/Saguaro).** The drafter pre-computes trees for likely verification outcomes
  while the target verifies; ``update(state, result)`` receives the exact outcome (accepted path + bonus
  token), which is the key of its cache, and ``propose`` returns the pre-computed tree on a hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import VerifyResult


@dataclass
class ExtraRows:
    """Rows appended to a verify pass that never enter the persistent cache (ConFu's contemplate tokens)."""

    embeds: torch.Tensor  # [R, d] input embeddings
    tree_mask: torch.Tensor  # [R, N + R] bool: which tree nodes / extra rows each row sees
    position_ids: torch.Tensor  # [R]
    # [R] bool: whether each row sees the committed prefix; None = every row does. Rows that must not
    # depend on the sequence (ConFu's soft prompts) set False.
    sees_prefix: torch.Tensor | None = None


@dataclass
class DecodeState:
    """What a drafter may read each round. ``tokens`` is the whole sequence so far (prompt + output)."""

    target: object
    cache: object
    tokens: list[int]
    prompt_len: int
    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    # Aux hidden states of the rows just committed ([n, n_aux*d]) when the drafter asked for them:
    # the prompt after prefill, then the root + accepted nodes of each verify pass.
    accepted_aux: torch.Tensor | None = None
    extra_out: object | None = None  # target outputs of the extra rows of the last verify pass
    scratch: dict = field(default_factory=dict)  # per-sequence drafter state, cleared by the engine

    @property
    def root(self) -> int:
        return self.tokens[-1]


@runtime_checkable
class Drafter(Protocol):
    needs_aux: bool

    def reset(self, state: DecodeState) -> None:
        """A new sequence starts (called once after prefill)."""

    def propose(self, state: DecodeState) -> DraftTree:
        """A draft tree whose node 0 is ``state.root``."""

    def update(self, state: DecodeState, result: VerifyResult, tree: DraftTree) -> None:
        """The round's outcome: accepted path (node indices) and bonus token; ``state`` already updated."""


class NoDrafter:
    """Proposes nothing: every round is one target step (used to check the engine against AR)."""

    needs_aux = False

    def reset(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.chain(state.root, [])

    def update(self, state: DecodeState, result: VerifyResult, tree: DraftTree) -> None:
        pass
