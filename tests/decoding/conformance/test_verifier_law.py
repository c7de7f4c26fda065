"""The verifier's output law, measured exactly where its rules act: later depths of an accepted chain and the
second of two sampled siblings. Slips there pass the first-round check (a draft on the tiny target is rarely
accepted past its first token), so this check builds drafts that are: small vocabularies, target and draft
laws given in closed form, the emitted pair ``(y1, y2)`` of each round counted against its exact law
``p(y1) p(y2 | y1)`` (a round that emits one token continues with ``y2 ~ p(. | y1)``, as the engine's next
round would). Pearson's chi-square over the cells, failing below ``P_FLOOR``: an exact verifier fails with
probability at most that.

Power at ``ROUNDS`` = 6000 (one run each, about a second): the real verifier's p-values are 0.66 (chain) and 0.19
(siblings); the shared-coin verifier (one uniform for every depth of a chain, so a token accepted with a small
coin makes the next acceptance likelier) gives 1e-28 and the unnormalised residual (the second sibling tried
against ``max(p - q, 0)`` before dividing by its mass, so it is accepted too rarely) 8e-26."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from scipy.stats import chisquare

from draftlab.decoding.tree import DraftTree
from draftlab.decoding.verify import verify

# The module itself (``draftlab.decoding`` re-exports the function under the same name).
verify_module = importlib.import_module("draftlab.decoding.verify")

ROUNDS = 6_000
P_FLOOR = 1e-6

# Target laws over V = 3 tokens: p(y1), p(y2 | y1), p(y3 | y1, y2) (rows of a verify pass).
P1 = torch.tensor([0.5, 0.35, 0.15])
P2 = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]])
P3 = torch.full((3, 3, 3), 1 / 3)
# Draft laws, far enough from the target's that min(1, p/q) < 1 for likely tokens at both depths; after the
# first sibling's rejection the residual keeps two tokens (0.4, 0.15), so whether it is normalised decides
# how often the second sibling's token 1 is accepted (1 against 0.75).
Q1 = torch.tensor([0.1, 0.2, 0.7])
Q2 = torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6]])


def _chain(gen) -> tuple[DraftTree, torch.Tensor]:
    """A sampled chain root -> x1 ~ Q1 -> x2 ~ Q2[x1] and its target rows ``[3, V]`` (log-probs)."""
    x1 = int(torch.multinomial(Q1, 1, generator=gen))
    x2 = int(torch.multinomial(Q2[x1], 1, generator=gen))
    q = torch.stack([Q1, Q1, Q2[x1]])  # row i: the law node i's token was drawn from (row 0 unused)
    tree = DraftTree.chain(0, [x1, x2], draft_probs=q[1:])
    return tree, torch.stack([P1, P2[x1], P3[x1, x2]]).log()


def _siblings(gen) -> tuple[DraftTree, torch.Tensor]:
    """Two siblings drawn i.i.d. from Q1 under the root, each with no children; target rows ``[3, V]``."""
    a, b = (int(t) for t in torch.multinomial(Q1, 2, replacement=True, generator=gen))
    tree = DraftTree(torch.tensor([0, a, b]), torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]),
                     torch.stack([Q1, Q1, Q1]), deterministic=False)
    return tree, torch.stack([P1, P2[a], P2[b]]).log()


def pair_law_p_value(make_round, verify_fn=verify, rounds: int = ROUNDS, seed: int = 0) -> float:
    """Chi-square p-value of the emitted pairs of ``rounds`` rounds against ``p(y1) p(y2 | y1)``."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(3, 3)
    for _ in range(rounds):
        tree, rows = make_round(gen)
        out = verify_fn(rows, tree, temperature=1.0, generator=gen)
        emitted = out.accepted_tokens(tree)
        y1 = emitted[0]
        y2 = emitted[1] if len(emitted) > 1 else int(torch.multinomial(P2[y1], 1, generator=gen))
        counts[y1, y2] += 1
    expected = (P1[:, None] * P2).flatten() * rounds
    return float(chisquare(counts.flatten().numpy(), expected.numpy()).pvalue)


def shared_coin(monkeypatch):
    """One uniform for every node of the tree (the verifier's ``torch.rand(n)`` made one draw repeated)."""
    real = torch

    def rand(n, *, generator=None, device=None):
        return real.rand(1, generator=generator, device=device).repeat(n)

    names = {k: getattr(real, k) for k in dir(real) if not k.startswith("__")}
    monkeypatch.setattr(verify_module, "torch", types.SimpleNamespace(**{**names, "rand": rand}))


def unnormalised_residual(monkeypatch):
    """The residual ``max(p - q, 0)`` left unnormalised before the next sibling is tried."""
    real = verify_module._or_fallback
    monkeypatch.setattr(verify_module, "_or_fallback",
                        lambda residual, target_p, *, normalise=False: real(residual, target_p, normalise=False))


# name: (the slip, the tree where it acts)
MUTANTS = {"shared_coin_across_depths": (shared_coin, _chain),
           "unnormalised_residual_before_next_sibling": (unnormalised_residual, _siblings)}


@pytest.mark.parametrize("tree", [_chain, _siblings], ids=["chain", "siblings"])
def test_the_real_verifier_emits_the_target_law(tree):
    assert pair_law_p_value(tree) > P_FLOOR


@pytest.mark.parametrize("name", list(MUTANTS))
def test_verifier_mutant_is_killed(name, monkeypatch):
    slip, tree = MUTANTS[name]
    slip(monkeypatch)
    p = pair_law_p_value(tree)
    assert p < P_FLOOR, f"{name}: p = {p:.2e}"
