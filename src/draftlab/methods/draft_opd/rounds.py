"""Verification rounds at chosen positions of a committed sequence (the ``random_rounds`` anchor rule).

Draft-OPD's anchors are the roots of the rounds a rollout happened to run. To ask whether *where* the
anchors sit matters, with everything else held fixed, the draft must be verified at other positions of the
same rollout, by the same drafter (tree, temperature) and the same target, so that each of those anchors is
a real round: accepted path, first rejected node (and its suffix), rejected siblings and the target
log-probs of the verify pass, exactly what ``anchors.round_anchor`` reads from an engine trace.

A fresh prefill per position would cost a full target pass over the prefix for each of them (about as
many as there are rounds, i.e. most response positions of a weak draft). Instead one pass walks the
committed sequence left to right, keeping the target's KV cache and the drafter's own state in step with
it, as the engine does:

- at a chosen position q (cache = tokens[:q], root = tokens[q]) the drafter proposes and one target pass
  verifies its tree, as an engine round; the round is traced;
- the round's own outcome is then committed as far as it agrees with the committed sequence and does not
  run past the next chosen position (at T=0 the accepted path and the bonus *are* the committed tokens, so
  this is the engine's own step, cut short like a round cut at the token budget);
- any remaining gap up to the next chosen position is fed as a forced chain (root + committed tokens, all
  "accepted"), one target pass whose K/V and tapped features the drafter absorbs through ``update`` as if
  a round had accepted them.

So the target processes each committed token about once, plus one tree per chosen position. Every step is
the engine's own (``start_sequence``, ``verify_pass`` / ``run_verify_pass``, ``verify``, ``commit_round``):
only the choice of what to commit differs. The drafter's
state at a chosen position depends only on the committed prefix and the target's features of it, which
are the same (up to float rounding) whichever rounds led there. Drafters that add rows to the verify pass
(``extra_rows``: ConFu's contemplate rows) carry state the forced chains would not give them, and are
refused.
"""

from __future__ import annotations

import torch

from draftlab.decoding.drafter import Drafter
from draftlab.decoding.engine import (
    GenerationConfig,
    RoundTrace,
    commit_round,
    pass_request,
    round_trace,
    run_verify_pass,
    scratch_for,
    start_sequence,
    verify_pass,
)
from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import VerifyResult, verify


def _checked_positions(positions: list[int], prompt_len: int, T: int) -> list[int]:
    """``positions`` sorted, refused when repeated or outside ``[prompt_len, T - 2]`` (a root needs a next token)."""
    positions = sorted(int(p) for p in positions)
    if len(set(positions)) != len(positions):
        raise ValueError("positions must be distinct")
    if positions and (positions[0] < prompt_len or positions[-1] > T - 2):
        raise ValueError(f"positions must lie in [{prompt_len}, {T - 2}], got {positions[0]}..{positions[-1]}")
    if prompt_len < 1:
        raise ValueError("need a non-empty prompt")
    return positions


def rounds_at(target, drafter: Drafter, tokens: list[int], prompt_len: int, positions: list[int],
              cfg: GenerationConfig, *, generator: torch.Generator | None = None,
              trace_dtype: torch.dtype = torch.float32) -> list[RoundTrace]:
    """One traced verification round of ``drafter`` at each of ``positions`` of the committed ``tokens``.

    tokens      prompt + committed response (a rollout's sequence).
    positions   root positions, each in ``[prompt_len, len(tokens) - 2]`` (a root needs a committed next
                token); distinct. Returned in ascending order, one ``RoundTrace`` each (``anchor`` = its root).
    cfg         the rollout's decoding settings (temperature, top-k/p decide the verify rule).
    generator   the sampling generator at T > 0 (the rounds' outcomes are then draws, not the committed
                tokens: only the part that agrees with the committed sequence is committed).
    """
    T = len(tokens)
    positions = _checked_positions(positions, prompt_len, T)
    if not positions:
        return []
    request = pass_request(target, drafter)
    if request.attn_mass_rows:
        raise ValueError("rounds_at does not serve drafters that read the verify passes' attention mass")
    # Room for the longest pass: a forced chain can span the whole response, a tree the drafter's rows. The
    # root is the committed first response token (at T=0 the prefill's own argmax), not a new draw.
    scratch = max(scratch_for(cfg, drafter), T)
    state = start_sequence(target, list(tokens[:prompt_len]), drafter, cfg, generator, request, scratch,
                           root=int(tokens[prompt_len]), capacity=T + scratch)

    def commit(tree: DraftTree, vpass, vout, result: VerifyResult, rows: list[int]) -> None:
        # The engine's commit of tree ``rows`` (root first); their tokens' successors are the committed ones.
        n = len(state.tokens)
        drafter.update(state, commit_round(state, vpass, vout, tree, result, list(tokens[n:n + len(rows)]), rows))

    def force(until: int) -> None:
        # Committed tokens from the root up to position ``until`` (the next root) as one accepted chain.
        root = len(state.tokens) - 1
        if until <= root:
            return
        chain = DraftTree.chain(tokens[root], tokens[root + 1: until], deterministic=True)
        vpass = verify_pass(target, chain, None, state.cache.length, request)
        vout = vpass.run(target, state.cache)
        commit(chain, vpass, vout, VerifyResult(list(range(chain.size)), int(tokens[until]), []),
               list(range(chain.size)))

    traces: list[RoundTrace] = []
    for i, q in enumerate(positions):
        force(q)
        assert state.cache.length == q and len(state.tokens) == q + 1
        tree = drafter.propose(state)
        if drafter.extra_rows(state, tree) is not None:
            raise ValueError(f"{type(drafter).__name__} adds rows to the verify pass; rounds_at cannot keep "
                             "their state through forced chains")
        vpass = verify_pass(target, tree, None, state.cache.length, request, scratch)
        vout = run_verify_pass(target, drafter, state, tree, vpass)  # the engine's round pass
        logits = vout.logits[0, :tree.size]  # [N, V]
        result = verify(logits, tree, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        generator=generator)
        traces.append(round_trace(q, tree, logits, result, len(result.path), trace_dtype))
        if i + 1 == len(positions):
            break  # nothing after the last chosen position is needed
        # Keep the round's outcome while it agrees with the committed tokens, up to the next root.
        emitted = result.accepted_tokens(tree)
        agree = 0
        while agree < len(emitted) and q + 1 + agree < T and emitted[agree] == tokens[q + 1 + agree]:
            agree += 1
        commit(tree, vpass, vout, result, result.path[: min(agree, positions[i + 1] - q)])
    return traces

