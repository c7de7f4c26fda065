"""The one verifier: accept a root path of a draft tree against one target pass, losslessly.

Walk from the root. At the current node the target distribution ``p`` of the next token is
``logits_to_probs(target_logits[node])``. The children of the node are tried in index order; at most one
is accepted, in which case the walk moves to it and starts again with the target row of that child.
When no child is accepted (or there is none) a bonus token is drawn from the current, possibly
residual, ``p``. The emitted tokens are those of the accepted non-root nodes followed by the bonus.

Why every rule is exact. It suffices to show that at one node the emitted token ``y`` (an accepted
child's token, or the bonus) is distributed as ``p``: the walk then continues at the accepted child with
the target's conditional distribution given that token, so by induction over depth the sequence of
emitted tokens is distributed as autoregressive sampling from the target. (The subtree under a child
was drafted given that child's token only, never given the verifier's coins, so conditioning on the
acceptance does not bias what follows.)

Greedy (``temperature == 0``). ``p`` is one-hot on the argmax, so "accept the child whose token is the
argmax, else emit the argmax" emits exactly the argmax; following it repeatedly yields the longest
root-to-leaf prefix that plain greedy decoding would produce, token for token.

Deterministic candidates (``tree.deterministic``; EAGLE's rule). Children ``x_1..x_m`` were chosen
without looking at the verifier's randomness. With ``p_0 = p``: accept ``x_j`` with probability
``p_{j-1}(x_j) / sum(p_{j-1})``; on rejection ``p_j = p_{j-1}`` with ``x_j`` zeroed, renormalised. Draw
``y ~ p`` and ask "is ``y == x_1``?": yes with probability ``p(x_1)``, and given "no", ``y`` is
distributed as ``p`` with ``x_1`` removed and renormalised, i.e. ``p_1``. Repeating the argument, the
procedure is the same as drawing ``y ~ p`` once, accepting the child whose token is ``y`` if there is
one and emitting ``y`` as the bonus otherwise. So the emitted token is exactly ``p``-distributed, for any
candidate set chosen independently of the verifier's coins (duplicated siblings are harmless: the second
copy has ``p_j(x) = 0``). That includes sampled candidates: marking them deterministic stays lossless but
accepts less often (``p(x)`` instead of ``min(1, p(x)/q(x))``).

Sampled candidates (``not tree.deterministic``; Leviathan et al. 2023 / Chen et al. 2023 for a chain,
SpecInfer's multi-draft rule for siblings). Child ``x_j`` was drawn from ``q_j = draft_probs[x_j's
node]``. Accept with probability ``min(1, p_{j-1}(x_j) / q_j(x_j))``; on rejection
``p_j = norm(max(0, p_{j-1} - q_j))``. One step emits ``y`` with probability
``q_j(y) min(1, p_{j-1}(y)/q_j(y)) = min(p_{j-1}(y), q_j(y))`` by acceptance, and rejects with
probability ``1 - sum_y min(p_{j-1}, q_j)(y) = sum_y max(0, p_{j-1} - q_j)(y)``, which is exactly the
normaliser of ``p_j``. If what follows a rejection emits ``y ~ p_j``, the step emits
``min(p_{j-1}, q_j)(y) + max(0, p_{j-1} - q_j)(y) = p_{j-1}(y)``. The last fallback is the bonus drawn
from ``p_m``, so by backward induction over the siblings the node emits ``y ~ p_0 = p``. The induction
needs ``x_j`` to be distributed as ``q_j`` given everything before it (the previous siblings and their
rejections): true for i.i.d. siblings with ``q_j = q(.|parent)``, and for sampling without replacement
when ``q_j`` is the conditional distribution given the earlier siblings. It is NOT true for top-k
candidates, which is why those trees must be marked ``deterministic``.

Rejected nodes. When the walk stops at a node with children, every child was tried and rejected (in
index order, under each rule); ``VerifyResult.rejected`` lists them. That is where the draft and the
target parted: the training signal of on-policy methods. Siblings rejected higher up the path are the
children of ``path[k-1]`` with an index below ``path[k]`` (children are tried in index order, so those
were all tried and rejected before ``path[k]`` was accepted).

Numerical fallback: if a residual has no positive mass left (or is not finite), ``p`` falls back to the
unmodified target distribution at the node. In exact arithmetic this cannot happen: the residual is
empty only when the previous step's acceptance probability was 1. In floating point it can only follow
a rejection whose probability is of the order of rounding error, so the bias is of that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.decoding.tree import DraftTree, children_lists


@dataclass
class VerifyResult:
    """Outcome of one verify pass.

    ``path``: accepted node indices, starting with the root 0. ``bonus_token``: the token drawn at the
    last accepted node. ``rejected``: the children of the last accepted node, all tried and rejected, in
    the order tried (the first rejected node and its rejected siblings at that depth); empty when the
    walk ended at a leaf. ``accept_length`` (tau for this round, Spec-Bench's convention) is
    ``len(path)``: the accepted proposals plus the bonus token.
    """

    path: list[int]
    bonus_token: int
    rejected: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> int:
        """New tokens this round: accepted proposals + the bonus token."""
        return len(self.path)

    def accepted_tokens(self, tree: DraftTree) -> list[int]:
        """Tokens emitted this round: those of ``path[1:]`` followed by the bonus token."""
        tokens = tree.tokens.tolist()
        return [tokens[i] for i in self.path[1:]] + [self.bonus_token]


def _try_deterministic(
    p: torch.Tensor, kids: list[int], tokens: list[int], token_ids: torch.Tensor, coins: list[float]
) -> tuple[int | None, torch.Tensor, list[int]]:
    # EAGLE's rule at one node; returns (accepted child or None, distribution for the bonus, rejected children).
    # Zeroing a rejected token and renormalising only changes the running mass, so one gather of p at
    # the tree's tokens and host-side scalars replace a vector pass per rejection.
    p_at_nodes = p.index_select(0, token_ids).tolist()  # [N]
    mass = float(p.sum())
    rejected_tokens: list[int] = []
    rejected_nodes: list[int] = []
    for child in kids:
        x, px = tokens[child], p_at_nodes[child]
        if x in rejected_tokens:
            rejected_nodes.append(child)
            continue  # a duplicate sibling: its probability is already zero
        # u < p(x) / sum(p) without dividing by a possibly tiny mass; px > 0 keeps rounding in the
        # running mass from ever accepting a token the target cannot emit.
        if px > 0 and coins[child] * mass < px:
            return child, p, rejected_nodes
        rejected_tokens.append(x)
        rejected_nodes.append(child)
        mass -= px
    residual = p.index_fill(0, torch.tensor(rejected_tokens, device=p.device), 0.0)  # [V]
    # The running mass is exact to ~1e-7, so only a (numerically) empty one needs the exact check.
    return None, residual if mass > 1e-6 else _or_fallback(residual, p), rejected_nodes


def _try_sampled(
    p: torch.Tensor, kids: list[int], tokens: list[int], q_at_nodes: list[float], coins: list[float],
    draft_probs: torch.Tensor,
) -> tuple[int | None, torch.Tensor, list[int]]:
    # Leviathan/SpecInfer rule at one node; returns (accepted child or None, distribution for the bonus,
    # rejected children).
    target_p = p
    rejected: list[int] = []
    for child in kids:
        # u < p/q written without division: a q(x) = 0 draw (impossible in exact arithmetic) is then
        # accepted iff p(x) > 0 instead of producing NaN.
        if coins[child] * q_at_nodes[child] < float(p[tokens[child]]):
            return child, p, rejected
        rejected.append(child)
        residual = (p - draft_probs[child]).clamp_min_(0.0)  # [V]
        p = _or_fallback(residual, target_p, normalise=True)  # [V]
    return None, p, rejected


def _or_fallback(residual: torch.Tensor, target_p: torch.Tensor, *, normalise: bool = False) -> torch.Tensor:
    # The numerical fallback of the module docstring: an empty (or non-finite) residual means the
    # previous rejection only happened through rounding, so the target distribution stands in for it.
    mass = float(residual.sum())
    if not 0.0 < mass < float("inf"):
        return target_p
    return residual / mass if normalise else residual


def verify(
    target_logits: torch.Tensor,
    tree: DraftTree,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Accept a path of ``tree`` against ``target_logits [N, V]`` (row i = distribution after node i).

    ``temperature == 0`` is greedy (the output equals plain greedy decoding token for token). Otherwise
    the emitted tokens are distributed exactly as autoregressive sampling from
    ``logits_to_probs(target_logits, temperature, top_k, top_p)``; the acceptance rule is chosen by
    ``tree.deterministic`` (see the module docstring for both rules and why they are exact).
    ``generator`` drives every random draw (it must live on ``target_logits``' device); the acceptance
    rule never depends on which method produced the tree.
    """
    n = tree.size
    if target_logits.ndim != 2 or target_logits.shape[0] != n:
        raise ValueError(f"target_logits must be [N={n}, V], got {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    children = children_lists(tree.parents)
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0

    if temperature == 0:
        greedy = target_logits.argmax(dim=-1).tolist()  # [N]
        while True:
            wanted = greedy[node]
            match = next((c for c in children[node] if tokens[c] == wanted), None)
            if match is None:
                return VerifyResult(path, wanted, list(children[node]))
            path.append(match)
            node = match

    token_ids = tree.tokens.to(device=target_logits.device)  # [N]
    sampled = not tree.deterministic
    if sampled:
        if tree.draft_probs is None or tree.draft_probs.shape[-1] != vocab:
            raise ValueError(f"a sampled tree needs draft_probs [N={n}, V={vocab}]")
        draft_probs = tree.draft_probs.to(device=target_logits.device, dtype=torch.float32)  # [N, V]
        # q_i(x_i): the probability each node's token had under the distribution it was drawn from.
        q_at_nodes = draft_probs.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [N]

    # One uniform per node, drawn up front: node i's coin decides node i's acceptance. They are
    # independent of each other and of the tree, which is all the proofs need, and one draw (one host
    # sync on an accelerator) is cheaper than a draw per tried child.
    coins = torch.rand(n, generator=generator, device=target_logits.device).tolist()  # [N]

    while True:
        p = logits_to_probs(target_logits[node], temperature, top_k, top_p)  # [V]
        kids = children[node]
        if not kids:
            accepted, rejected = None, []
        elif sampled:
            accepted, p, rejected = _try_sampled(p, kids, tokens, q_at_nodes, coins, draft_probs)
        else:
            accepted, p, rejected = _try_deterministic(p, kids, tokens, token_ids, coins)
        if accepted is None:
            # sample() normalises, so the unnormalised deterministic residual is sampled as is.
            return VerifyResult(path, int(sample(p, generator)), rejected)
        path.append(accepted)
        node = accepted
