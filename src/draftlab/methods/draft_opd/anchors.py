"""Verification-exposed anchors: what one speculative round tells on-policy training.

Draft-OPD (arXiv:2605.29343) replays drafting from every verification anchor of a rollout. For a round
the engine traced (``decoding.engine.RoundTrace``) the anchor is the root's sequence position ``a``; the
replayed chain is the accepted root-to-leaf path ``d_1..d_r`` followed, when something was rejected, by the
first rejected node ``d_{r+1}`` (the lowest-numbered rejected child of the last accepted node: for EAGLE's
top-k trees the draft's best guess) and, with ``rejected_suffix``, that node's own first-child descendants
(for a chain drafter: the whole rejected suffix, as the paper's DFlash blocks have it). The rejected set of
the round is the first rejected node and its rejected siblings (all children of the last accepted node);
they are proposals from the same draft distribution, the one at chain position r+1.

Target log-probs come from the verify pass that decided the round: node i's row is the target's
distribution of the token after node i given the prefix and the path to i, so chain position k (the
distribution of d_k) reads the row of chain node k-1. No extra target pass is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.decoding.engine import RoundTrace


@dataclass
class Anchor:
    """One round, as replay consumes it.

    root             sequence position of the round's root token (context: ``tokens[:root + 1]``).
    chain            [K] draft tokens d_1..d_K (target ids), at positions root+1..root+K.
    accepted         r: d_1..d_r were accepted; positions r+1..K are rejected (the first one and its suffix).
    target_logprobs  [K, V] row k-1 = the target's log-probs of position root+k given the context and d_<k,
                     over the columns ``vocab_ids`` selected (full softmax values, not renormalised).
    rejected         target ids of every rejected proposal at position root+r+1 (first rejected + siblings).
    committed        the token the round emitted at position root+r+1 (the correction or bonus token).
    """

    root: int
    chain: torch.Tensor
    accepted: int
    target_logprobs: torch.Tensor
    rejected: list[int]
    committed: int

    @property
    def length(self) -> int:
        return int(self.chain.shape[0])


def _first_child(parents: list[int], node: int) -> int | None:
    return next((c for c in range(node + 1, len(parents)) if parents[c] == node), None)


def chain_nodes(trace: RoundTrace, *, rejected_suffix: bool = True) -> list[int]:
    """Tree nodes of the replayed chain, root first: the accepted path, then the first rejected node and
    (``rejected_suffix``) its first-child descendants."""
    nodes = list(trace.path)
    if trace.rejected:
        parents = trace.parents.tolist()
        node = min(trace.rejected)
        nodes.append(node)
        while rejected_suffix and (node := _first_child(parents, node)) is not None:
            nodes.append(node)
    return nodes


def round_anchor(trace: RoundTrace, *, vocab_ids: torch.Tensor | None = None, rejected_suffix: bool = True,
                 dtype: torch.dtype = torch.float32) -> Anchor | None:
    """The anchor of one traced round, or None for a round that proposed nothing (a root-only tree).

    ``vocab_ids`` [V_d]: keep only these target-vocabulary columns of the target log-probs (the draft's
    vocabulary: the objective is computed there); None keeps the whole vocabulary.
    """
    nodes = chain_nodes(trace, rejected_suffix=rejected_suffix)
    if len(nodes) < 2:
        return None
    logp = trace.target_logprobs[nodes[:-1]]  # [K, V] row k-1: distribution of chain position k
    if vocab_ids is not None:
        logp = logp.index_select(-1, vocab_ids.to(logp.device))  # [K, V_d]
    return Anchor(root=trace.anchor, chain=trace.tokens[nodes[1:]].clone(), accepted=len(trace.path) - 1,
                  target_logprobs=logp.to(dtype).contiguous(), rejected=trace.tokens[trace.rejected].tolist(),
                  committed=int(trace.bonus))


def trace_anchors(trace: list[RoundTrace], **kwargs) -> list[Anchor]:
    """Every round's anchor (rounds that proposed nothing are left out); ``kwargs`` as ``round_anchor``."""
    return [a for a in (round_anchor(r, **kwargs) for r in trace) if a is not None]
