"""The drafter protocol: the one seam between a speculative method and the decoding engine.

Each round the engine asks ``drafter.propose(state)`` for a ``DraftTree`` rooted at the last committed
token, adds the drafter's ``extra_rows`` (if any) to the same verify pass, verifies the tree, commits the
accepted path and calls ``drafter.update(state, out)`` with a typed ``VerifyOutput``. The verifier and
the acceptance rule never change per method; methods differ only in how they propose.

Every member the engine calls is declared on ``Drafter`` with a default, and drafters subclass it
explicitly to inherit those defaults, so the engine never probes a drafter for optional methods:

- ``taps(target)``: target layers whose hidden states the drafter reads (target's convention).
  The engine asks the target for them (``PassRequest(aux=...)``) in the prefill and in every verify pass. ``None`` (default): no aux states are computed at all.
- ``scratch_rows(cfg)``: rows of the largest verify pass (tree nodes + extra rows); the engine sizes the
  target cache's scratch for the larger of it and ``cfg.scratch_rows`` (``engine.scratch_for``). ``None``: ``cfg.scratch_rows``.
- ``extra_rows(state, tree)``: rows appended after the tree in the verify pass (default ``None``).
- ``verify_forward(state, tree)``: the verify pass itself, for drafters that already ran part of the
  target on the tree rows (early-exit self-speculation): a ``TargetOutput`` whose ``logits [1, N, V]``
  equal a full forward over the tree, with every layer's K/V of the tree rows written at the scratch
  slots ``cache.length + i``. Default ``None``: the engine runs ``target.forward``. The verifier is the same.
- ``attention_rows()``: W, to be handed the attention mass the last W rows of the prefill and of every
  verify pass put on each cache slot, per layer and KV head (``PassRequest(attn_mass_rows=W)``), as
  ``state.attn_mass`` / ``out.attn_mass [L, Hkv, S]``. A by-product of the passes' own softmax. ``None``
  (default): not computed.
- ``reset(state)`` once per sequence after prefill, ``propose(state)`` and ``update(state, out)`` per round.
- ``sequence_stats()`` once per sequence at the end: a flat ``{name: number}`` of what the drafter did
  (SpecBound's exit depths), kept in ``DecodeStats.drafter_stats`` and in answer records. Default ``None``.
- ``close()`` once, by whoever built the drafter, when it is done with it (also after an error): a drafter
  that holds a worker process, a server connection or a file releases it here. Default: nothing held.
  Owners use ``with contextlib.closing(drafter):`` or ``closing_all`` for several.

What may decide the verified tree (the one rule every drafter keeps, whatever else it does): **what is
verified may depend on the draft distribution, never on the sampled values, unless the drafter reports the
distribution it actually induced.** The verifier's sampled rule (``decoding.verify``) needs each sampled
node's token to be distributed as its reported ``draft_probs`` row given everything before it, including
the fact that the node is in the tree. So, for a tree with ``deterministic=False``:

- whether node i is proposed may depend on the state, on the draft distributions and on the tokens of
  node i's ancestors (a chain's next slot is drafted given the previous token), but not on node i's own
  token, nor on anything drawn together with it: cutting a sampled chain where the drawn tokens are
  unlikely keeps likely draws and drops unlikely ones, and the kept token is then no longer ``q``-distributed
  (DFlash's ``tree: auto`` decides its cut from the slots' distributions before drawing them);
- the reported row is the distribution the token was drawn from, at the sampling settings it was drawn
  with (temperature, top-k, top-p), aligned with its node after any cut.

How the shipped drafters keep it: SpecBound's exit rule reads the head's confidence (a function of its
distribution) before the token is drawn, and the next token is drafted given the previous one (an
ancestor); SparseSpec-L's controller decides whether to draft another token from the entropy of the last
distribution, not from the token drawn; DFlash sizes its block before drawing. Deterministic trees
(EAGLE-3, ConFu, lookups, the hybrid, argmax chains) are verified by the deterministic-candidate rule,
which is exact for any candidate set chosen without the verifier's coins. ``tests/decoding/conformance``
checks the rule statistically for every method config (``check_first_round_law``) and kills drafters that
break it (``test_drafter_mutants.py``).

How every method on the roadmap fits:

- **EAGLE-3 (feature drafters, dynamic trees).** ``taps`` names the draft's three taps: the engine
  returns them for the prefill rows (``state.accepted_aux`` at ``reset``) and for the kept rows of every
  verify pass (``out.accepted_aux``). The drafter keeps its own draft KV cache across rounds, extends it
  with those features in ``update``, and grows an EAGLE-2 dynamic tree with ``decoding.tree.build_dynamic_tree``.
- **ConFu (contemplate rows, a carried future vector).** ``extra_rows(state, tree)`` returns extra inputs
  (embeddings + their mask rows + positions) appended after the tree in the verify pass. They attend to
  the prefix and to their own node's ancestors, nothing attends to them, and they are never committed to
  the target cache (``KVCache.commit_rows`` only keeps the accepted path). Their outputs come back typed
  as ``out.extra`` (``ExtraOutput``); the drafter picks the row of the last accepted node as its future
  vector for the next round. Rows that never see the sequence (soft prompts) are computed once and
  passed as ``ExtraRows.pinned`` keys instead of riding along in every pass.
- **Self-speculation (SpecBound early exit, SparseSpec-L sparse KV).** ``propose`` may run the target's own
  first layers / a sparse view of its cache: ``state.target`` and ``state.cache`` are exposed (draft rows
  go to scratch slots past ``cache.length``; the verify pass overwrites them, committed rows are never
  touched). A drafter whose draft rows are the tree rows (early exit) finishes them in ``verify_forward``
  instead of recomputing their shallow layers. Proposals carry their draft distribution
  (``draft_probs``) when sampled, so the min(1, p/q) rule stays exact. A sparse-KV drafter asks for
  ``attention_rows`` and ranks cache slots by the mass the verify pass already computed.
- **Block drafters (DFlash).** A block of tokens proposed in one shot is a chain: ``DraftTree.chain``.
- **OutcomeChain caches (SSD/Saguaro).** The drafter pre-computes chains for likely verification outcomes
  while the target verifies, with its base's ``outcome_drafter``; ``update(state, out)`` receives the exact
  outcome (``out.result.path`` + bonus), which is the key of its cache, and ``propose`` returns the
  pre-computed chain on a hit.
- **On-policy training.** ``out.logits`` are the target logits at every tree node (the ones the verifier
  used) and ``out.result.rejected`` the nodes where the walk stopped; ``speculative_generate(...,
  trace=True)`` records the same per round (``engine.RoundTrace``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import VerifyResult
from draftlab.targets.cache import PinnedKV


@dataclass
class ExtraRows:
    """Rows appended to a verify pass that never enter the persistent cache (ConFu's contemplate tokens)."""

    embeds: torch.Tensor  # [R, d] input embeddings
    tree_mask: torch.Tensor  # [R, N + R] bool: which tree nodes / extra rows each row sees
    position_ids: torch.Tensor  # [R]
    # [R] bool: whether each row sees the committed prefix; None = every row does. Rows that must not
    # depend on the sequence (ConFu's soft prompts) set False.
    sees_prefix: torch.Tensor | None = None
    # Which target outputs of these rows ``ExtraOutput`` carries besides the aux states (always there when
    # the drafter taps aux layers). Off by default: the LM head over R extra rows is wasted work otherwise.
    want_logits: bool = False
    want_hidden: bool = False
    # Rows computed once (``cache.PinnedKV``, e.g. ConFu's soft prompts) that these rows attend to in every
    # layer, instead of re-running them in each pass; ``pinned_mask [R, P]`` (None = every row sees all).
    # Tree rows never see them.
    pinned: PinnedKV | None = None
    pinned_mask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.embeds.shape[0])


@dataclass
class ExtraOutput:
    """The target's outputs at the extra rows of one verify pass; row j belongs to extra row j."""

    logits: torch.Tensor | None  # [R, V] when ExtraRows.want_logits
    aux: torch.Tensor | None  # [R, n_aux*d] when the drafter taps aux layers
    hidden: torch.Tensor | None  # [R, d] final-norm hidden states when ExtraRows.want_hidden


@dataclass
class VerifyOutput:
    """Everything one verify pass produced, handed to ``Drafter.update``.

    The rows of ``logits``/``aux`` are tree nodes (row i = node i). ``kept`` tokens were emitted this round:
    the tokens of ``result.path[1:kept]`` and, when ``kept == len(result.path)``, the bonus token; a round
    cut at EOS or the token budget keeps fewer. ``accepted_aux`` are the aux rows of ``result.path[:kept]``
    (the rows whose tokens are now committed context, root first).
    """

    tree: DraftTree
    result: VerifyResult
    logits: torch.Tensor  # [N, V] target logits at the tree nodes (the ones verify used)
    aux: torch.Tensor | None  # [N, n_aux*d] aux states of every tree row
    accepted_aux: torch.Tensor | None  # [kept, n_aux*d]
    extra: ExtraOutput | None  # outputs of the drafter's extra rows
    kept: int
    # [L, Hkv, S] when the drafter asks for ``attention_rows``: the mass the pass's last rows put on each of
    # its S = past + N slots (slots >= past are this pass's tree rows)
    attn_mass: torch.Tensor | None = None

    @property
    def kept_path(self) -> list[int]:
        """Nodes whose tokens entered the committed sequence this round (the root first)."""
        return self.result.path[: self.kept]


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
    # Aux hidden states of the rows just committed ([n, n_aux*d]) when the drafter taps aux layers: the
    # prompt after prefill (what ``reset`` reads), then ``VerifyOutput.accepted_aux`` of the last round
    # (what ``extra_rows`` of the next round may key on).
    accepted_aux: torch.Tensor | None = None
    # [L, Hkv, S] when the drafter asks for ``attention_rows``: the prefill's (at ``reset``), then the last
    # verify pass's attention mass per slot
    attn_mass: torch.Tensor | None = None
    scratch: dict = field(default_factory=dict)  # per-sequence drafter state, cleared by the engine

    @property
    def root(self) -> int:
        return self.tokens[-1]


@runtime_checkable
class Drafter(Protocol):
    """What the engine calls. Subclass it explicitly: every member but ``propose`` has a default."""

    def taps(self, target) -> list[int] | None:
        """Target layers to capture (in ``target.layer_convention``); ``None``: no aux states."""
        return None

    def scratch_rows(self, cfg) -> int | None:
        """Rows of the largest verify pass under ``cfg`` (tree + extra rows); ``None``: the engine default."""
        return None

    def attention_rows(self) -> int | None:
        """W: the prefill and every verify pass report the attention mass of their last W rows per slot
        (``state.attn_mass`` / ``out.attn_mass``); ``None``: not computed."""
        return None

    def extra_rows(self, state: DecodeState, tree: DraftTree) -> ExtraRows | None:
        """Rows to append after ``tree`` in this round's verify pass; ``None``: none."""
        return None

    def verify_forward(self, state: DecodeState, tree: DraftTree):
        """This round's verify pass computed by the drafter (a ``TargetOutput``), or ``None`` (the default):
        the engine runs ``target.forward`` over the tree. Not combined with ``extra_rows``."""
        return None

    def reset(self, state: DecodeState) -> None:
        """A new sequence starts (called once after prefill)."""

    def propose(self, state: DecodeState) -> DraftTree:
        """A draft tree whose node 0 is ``state.root``."""
        raise NotImplementedError

    def update(self, state: DecodeState, out: VerifyOutput) -> None:
        """The round's outcome; ``state.tokens`` and ``state.accepted_aux`` already include the kept tokens."""

    def sequence_stats(self) -> dict[str, float] | None:
        """Numbers about the sequence just decoded (``{name: int | float}``), or ``None`` (the default)."""
        return None

    def close(self) -> None:
        """Release what the drafter holds outside Python's reach (worker processes, connections); called once
        by its owner when done, also after an error. The default holds nothing."""


@contextmanager
def closing_all(*drafters: Drafter | None) -> Iterator[None]:
    """Close every drafter given (``None`` entries skipped) on leaving the block, even when it raises; a
    drafter whose ``close`` raises does not keep the others open."""
    with ExitStack() as stack:
        for d in drafters:
            if d is not None:
                stack.callback(d.close)
        yield


class NoDrafter(Drafter):
    """Proposes nothing: every round is one target step (used to check the engine against AR)."""

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.chain(state.root, [])
