"""The bigram harness of the verifier's statistical tests (test_verify_distribution, test_verify_mutants).

A bigram (Markov) stub target and a different bigram draft over a tiny vocabulary. Each trial decodes
from a fixed root token until one or two tokens are emitted (a second round is run when the first emits
only its bonus token, exactly as the engine would) and counts the first emitted token and the first two;
their exact laws are ``expected``. The first round of every trial starts at ROOT, so its number of
accepted drafts has a known mean, ``expected_accepted``.

Every source of randomness is seeded, so the outcome is deterministic.
"""

from __future__ import annotations

import bisect
import random

import torch

from draftlab.decoding.sampling import logits_to_probs
from draftlab.decoding.tree import DraftTree, children_lists
from draftlab.decoding.verify import VerifyResult, verify

V = 6
ROOT = 0
# 8k trials per case (8k-16k verify rounds: a two-token trial needs a second round whenever the first
# emits only its bonus) keeps each case near 1-2 s on an idle 2-core CPU, where per-op overhead on tiny
# tensors makes a verify round cost 0.1-0.3 ms.
N_TRIALS = 8_000


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Row t holds the logits of the token that follows t; scale 1.5 makes target and draft disagree a
    # lot (TV between them well above the test's resolution) so the negative controls have teeth.
    target = 1.5 * torch.randn(V, V, generator=gen)  # [V, V]
    draft = 1.5 * torch.randn(V, V, generator=gen)  # [V, V]
    return target, draft


TARGET_LOGITS, DRAFT_LOGITS = _tables()
Q = logits_to_probs(DRAFT_LOGITS, 1.0)  # [V, V] draft distribution after each token


# ---- proposers: (root token, uniform source) -> DraftTree -------------------------------------------


def _top(parent_token: int, k: int, table: torch.Tensor = Q) -> list[int]:
    return torch.topk(table[parent_token], k).indices.tolist()


def _draft_rows(tokens: list[int], parents: list[int]) -> torch.Tensor:
    # Row i is the distribution node i was sampled from: q(. | token of its parent); row 0 unused.
    parent_tokens = [tokens[max(parent, 0)] for parent in parents]
    return Q[parent_tokens]  # [N, V]


_DET_TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
_det_tree_cache: dict[tuple[int, bool, bool], DraftTree] = {}


def top_k_tree(root: int, rng: random.Random, *, mark_sampled: bool = False, oracle: bool = False) -> DraftTree:
    """EAGLE-style deterministic tree: the draft's top-3 children of the root, top-2 under each.

    ``oracle`` ranks by the target's logits instead: the first child then carries the most target mass,
    which is where the renormalisation of the deterministic rule matters most.
    """
    key = (root, mark_sampled, oracle)
    if key not in _det_tree_cache:
        table = TARGET_LOGITS if oracle else Q
        level1 = _top(root, 3, table)
        tokens = [root, *level1] + [t for c in level1 for t in _top(c, 2, table)]
        if mark_sampled:
            # The bug the negative control plants: top-k candidates verified with min(1, p/q).
            tree = DraftTree.from_parents(tokens, _DET_TREE_PARENTS, _draft_rows(tokens, _DET_TREE_PARENTS), False)
        else:
            tree = DraftTree.from_parents(tokens, _DET_TREE_PARENTS, deterministic=True)
        _det_tree_cache[key] = tree
    return _det_tree_cache[key]


def oracle_top_k_tree(root: int, rng: random.Random) -> DraftTree:
    """``top_k_tree`` ranked by the target: siblings with large target mass, rejected in turn."""
    return top_k_tree(root, rng, oracle=True)


_greedy_chain_cache: dict[int, DraftTree] = {}


def greedy_chain(root: int, rng: random.Random) -> DraftTree:
    """Deterministic depth-2 chain: the draft's argmax twice."""
    if root not in _greedy_chain_cache:
        x1 = _top(root, 1)[0]
        _greedy_chain_cache[root] = DraftTree.chain(root, [x1, _top(x1, 1)[0]])
    return _greedy_chain_cache[root]


class SampledProposer:
    """A tree of fixed shape ``parents`` whose every node is an i.i.d. draw from ``q(. | its parent's token)``
    (``q [V, V]``), nodes drawn in index order."""

    def __init__(self, parents: list[int], q: torch.Tensor = Q):
        self.parents, self.q = parents, q
        self.cum = [list(row) for row in q.double().cumsum(-1).tolist()]
        self._parents_t = torch.tensor(parents)
        self._depth_t = torch.tensor(_depths(parents))

    def __call__(self, root: int, rng: random.Random) -> DraftTree:
        tokens = [root]
        for parent in self.parents[1:]:
            cum = self.cum[tokens[parent]]
            tokens.append(min(bisect.bisect_right(cum, rng.random() * cum[-1]), V - 1))
        # Row i is the distribution node i was sampled from; row 0 unused. Built directly rather than through
        # DraftTree.from_parents: the harness runs tens of thousands of rounds.
        rows = self.q[[tokens[max(parent, 0)] for parent in self.parents]]  # [N, V]
        return DraftTree(torch.tensor(tokens), self._parents_t, self._depth_t, rows, False)


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


# Depth-2 chain sampled from the draft.
sampled_chain = SampledProposer([-1, 0, 1])
# Three i.i.d. draft samples under the root, two i.i.d. samples under the first (SpecInfer).
sampled_tree = SampledProposer([-1, 0, 0, 0, 1, 1])


def always_accept(target_logits, tree, *, temperature, top_k=None, top_p=None, generator=None) -> VerifyResult:
    """A deliberately wrong verifier: takes the first child at every node, never rejects."""
    children = children_lists(tree.parents)
    path = [0]
    while children[path[-1]]:
        path.append(children[path[-1]][0])
    return VerifyResult(path, int(target_logits[path[-1]].argmax()))


def never_accept(target_logits, tree, *, temperature, top_k=None, top_p=None, generator=None) -> VerifyResult:
    """Rejects every draft and draws the bonus from p: distribution-exact, and useless."""
    p = logits_to_probs(target_logits[0], temperature, top_k, top_p)  # [V]
    return VerifyResult([0], int(torch.multinomial(p, 1, generator=generator)))


# ---- the harness ---------------------------------------------------------------------------------------


def run_trials(propose, *, temperature, top_k=None, top_p=None, tokens_needed=2, n=N_TRIALS, seed=0,
               verifier=verify) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Decode ``n`` independent continuations of ROOT; return counts of the first token ``[V]``, of the
    first two tokens ``[V, V]`` (all zero when ``tokens_needed == 1``) and the mean number of drafts
    accepted in the first round (``len(path) - 1``)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    first = [0] * V
    pairs = [0] * (V * V)
    accepted = 0
    for _ in range(n):
        emitted: list[int] = []
        root = ROOT
        while len(emitted) < tokens_needed:
            tree = propose(root, rng)
            # The stub target's row for node i depends on node i's token only (a bigram model).
            result = verifier(TARGET_LOGITS[tree.tokens], tree, temperature=temperature, top_k=top_k,
                              top_p=top_p, generator=gen)
            if not emitted:
                accepted += len(result.path) - 1
            emitted += result.accepted_tokens(tree)
            root = emitted[-1]
        first[emitted[0]] += 1
        if tokens_needed >= 2:
            pairs[emitted[0] * V + emitted[1]] += 1
    return torch.tensor(first), torch.tensor(pairs).reshape(V, V), accepted / n


def target_probs(temperature, top_k=None, top_p=None) -> torch.Tensor:
    """``[V, V]`` float64: row t is the target's law of the token after t."""
    return logits_to_probs(TARGET_LOGITS, temperature, top_k, top_p).double()


def expected(temperature, top_k=None, top_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-sampling distributions: p(x1) ``[V]`` and p(x1) p(x2 | x1) ``[V, V]``."""
    p = target_probs(temperature, top_k, top_p)  # [V, V]
    return p[ROOT], p[ROOT][:, None] * p


def _sampled_accepted(p: torch.Tensor, q: torch.Tensor, token: int, shapes: list) -> float:
    # Expected accepted drafts below a node with ``token`` whose children (subtrees ``shapes``) are
    # i.i.d. draws from q(. | token). Sibling j is reached after j-1 rejections, each of probability
    # sum(max(0, p_j - q)); it is accepted with token a with probability min(p_j, q)(a), then the walk
    # continues below it.
    p_j, reach, total = p[token], 1.0, 0.0
    for child_shapes in shapes:
        accept = torch.minimum(p_j, q[token])  # [V]
        total += reach * sum(float(accept[a]) * (1.0 + _sampled_accepted(p, q, a, child_shapes))
                             for a in range(V) if accept[a] > 0)
        residual = (p_j - q[token]).clamp_min(0.0)  # [V]
        reach *= float(residual.sum())
        if reach <= 0:
            break
        p_j = residual / residual.sum()
    return total


def _shapes(parents: list[int], node: int = 0) -> list:
    return [_shapes(parents, c) for c in children_lists(parents)[node]]


def expected_accepted(propose, temperature, top_k=None, top_p=None) -> float:
    """Mean drafts accepted by the exact rule in a round rooted at ROOT (what ``run_trials`` measures)."""
    p = target_probs(temperature, top_k, top_p)  # [V, V]
    if isinstance(propose, SampledProposer):
        return _sampled_accepted(p, propose.q.double(), ROOT, _shapes(propose.parents))
    # A deterministic tree: the rule accepts the child whose token is y ~ p, so a node is on the path
    # with the product of p(token | parent's token) along its root path (a duplicated sibling never is).
    tree = propose(ROOT, random.Random(0))
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    on_path = [1.0] + [0.0] * (tree.size - 1)
    for node in range(1, tree.size):
        parent = parents[node]
        earlier = [tokens[s] for s in range(1, node) if parents[s] == parent]
        if tokens[node] not in earlier:
            on_path[node] = on_path[parent] * float(p[tokens[parent], tokens[node]])
    return sum(on_path[1:])
