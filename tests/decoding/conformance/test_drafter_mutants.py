"""The powered sampling check kills drafters that break the rule of ``decoding.drafter`` (what is verified may
depend on the draft distribution, never on the sampled values, and each sampled node reports the law it was
drawn from).

A quickly trained draft is rarely accepted at T > 0 on the tiny target (its block slots barely agree with
the target), and a bias in how a proposal is drawn shows only in the rounds that accept it. So these checks
run DFlash's real drafter (its block sampling, its ``tree: auto`` cut, its chain) with the draft network's
slot logits replaced by a target-informed stand-in, ``InformedBlock``: every slot reads the target's own
next-token logits after the root plus fixed per-slot noise, so the first slot is accepted in most rounds,
its law is far from uniform, and each slot's law differs from the next one's. Each mutant changes one step
of the drafter, as a slip in ``methods/dflash/drafter.py`` would, and must fail ``check_first_round_law``,
which the real drafter passes (``test_the_real_drafter_passes``) with the same stand-in, prompt and trials.

Margins at 600 trials (one run; the check fails below p = 1e-4, and 5e-5 is the Monte-Carlo floor of
40k null replicates): the real drafter's largest |z| is 1.6, 1.6 and 1.3 over the three cases (p = 1.0);
the mutants' are 7.1 (cut on the draws), 12.1 (untempered q) and 6.3 (dropped slot q), each with no null
replicate as extreme (p at the floor). The drafter as it was before the cut was fixed fails
``auto_close`` and ``auto_keeps_first`` the same way (its cut is ``CutOnSampledProbability``'s).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.decoding.cost import VerifyCost
from draftlab.decoding.sampling import logits_to_probs, sample
from draftlab.methods.dflash.drafter import DFlashDrafter, draw_block
from tests.decoding.conformance.checks import check_first_round_law
from tests.decoding.conformance.methods import first_round_prompt, spec

TEMPERATURE = 0.3  # tiny_random's top token then carries ~0.4 of the mass on average: far from uniform
TRIALS = 600  # the stand-in cases: enough that each mutant lands far past the Monte-Carlo floor


@dataclass(frozen=True)
class Case:
    """A stand-in draft and a verify cost. ``noise``: std of the logit noise of the first slot and of the
    others (before tempering, so x 1/T after it); ``later_scale``: the other slots read the target's logits
    times this (above 1: a sharper law than the first slot's); ``per_row``: verify cost
    ``0.01 + per_row (rows - 1)`` seconds, under which a slot is worth its row when its score is above
    ``per_row / 0.01`` (the budget's calibration held at its prior, 1, so the threshold does not drift)."""

    tree: str
    noise: tuple[float, float]
    per_row: float = 0.0
    later_scale: float = 1.0


CASES = {
    # The first slot close to the target, a threshold of 0.15: a draw of the slot's favourite token is worth
    # its row, most other draws are not, so a cut on the draws keeps the favourite far too often.
    "auto_close": Case("auto", (0.05, 0.5), 0.0015),
    # The first slot close to the target, the others sharper (twice its logits), a threshold of 0.05: the
    # cut keeps the first slot in nearly every round, so the q reported for it decides its acceptance;
    # reported with a sharper law, the target's favourite is rejected too often.
    "auto_keeps_first": Case("auto", (0.05, 0.05), 0.0005, later_scale=2.0),
    # A first slot far from the target, the whole block verified: wrong q's change what is accepted.
    "fixed_far": Case("fixed", (0.5, 0.5)),
}


class InformedBlock(DFlashDrafter):
    """DFlash's drafter whose block logits come from the target: slot j = ``scale[j]`` x the target's logits
    after the root + ``noise[j]`` (the draft network still runs its context bookkeeping; its outputs are
    unused)."""

    def propose(self, state):
        self._seq = state.tokens
        self._target = state.target
        return super().propose(state)

    def _block_pass(self, inputs):
        hidden, _ = super()._block_pass(inputs)
        with torch.no_grad():
            base = self._target.forward(torch.tensor([self._seq])).logits[0, -1]  # [V]
        return hidden, (base[None] * self.scale + self.noise)[: self.block_size - 1]  # [bs-1, d], [bs-1, V]


class CutOnSampledProbability(InformedBlock):
    """Keeps the prefix that pays by the probability of the tokens drawn (the drafter before the fix)."""

    def _draw_chain(self, logits, state):
        if self.budget is None or state.temperature == 0:
            return super()._draw_chain(logits, state)
        return _old_draw_block(logits, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
                               generator=state.generator, budget=self.budget)


def _old_draw_block(logits, *, temperature, generator, budget, top_k=None, top_p=None, **_):
    # The cut as it was: scored by the probability of the tokens drawn.
    probs = logits_to_probs(logits, temperature, top_k, top_p)  # [bs-1, V]
    tokens = sample(probs, generator)  # [bs-1]
    keep = budget.choose(probs.gather(-1, tokens[:, None])[:, 0].double().cumprod(0), 0)
    return tokens[:keep], None if keep == 0 else probs[:keep]


class UntemperedQ(InformedBlock):
    """Draws at the sampling temperature, reports the law of the raw logits (T = 1)."""

    def _draw_chain(self, logits, state):
        tokens, probs = super()._draw_chain(logits, state)
        if probs is None:
            return tokens, probs
        return tokens, torch.softmax(logits[: len(tokens)].float(), -1)


class DroppedSlotQ(InformedBlock):
    """After the cut, the rows of q lose the first slot's: each kept token is reported with the next
    slot's law (the last one with its own)."""

    def _draw_chain(self, logits, state):
        tokens, probs = super()._draw_chain(logits, state)
        if probs is None:
            return tokens, probs
        full = logits_to_probs(logits, state.temperature, state.top_k, state.top_p)  # [bs-1, V]
        shifted = torch.cat([full[1:], full[-1:]])  # [bs-1, V]
        return tokens, shifted[: len(tokens)]


# name: (drafter, the case that kills it)
MUTANTS = {"cut_on_sampled_probability": (CutOnSampledProbability, "auto_close"),
           "untempered_q": (UntemperedQ, "fixed_far"),
           "dropped_slot_q": (DroppedSlotQ, "auto_keeps_first")}


@pytest.fixture(scope="module")
def block_drafter(tiny_target):
    """``cls, case -> factory`` of DFlash drafters around an untrained draft from the shipped config."""
    s = copy.deepcopy(spec("dflash"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draft = s.build_draft(tiny_target, None)
        unit = torch.randn(draft.config.block_size, tiny_target.geometry.vocab_size)  # [bs, V]

    def factory(cls, name: str):
        case = CASES[name]
        scale = torch.tensor([case.noise[0]] + [case.noise[1]] * (unit.shape[0] - 1))[:, None]  # [bs, 1]

        def make():
            c = copy.deepcopy(s)
            OmegaConf.update(c.cfg, "drafter.tree", case.tree)
            drafter = c.build_drafter(draft)
            drafter.__class__ = cls
            drafter.noise = unit * scale
            drafter.scale = torch.tensor([1.0] + [case.later_scale] * (unit.shape[0] - 1))[:, None]  # [bs, 1]
            if drafter.budget is not None:
                b = drafter.budget
                b.cost, b.fixed_level, b._level_s, b.decay = VerifyCost.linear(0.01, case.per_row), 0.0, 0.0, 1.0
            return drafter
        return make

    return factory


def _prompt(target) -> list[int]:
    return first_round_prompt(target)


@pytest.mark.parametrize("case", list(CASES))
def test_the_real_drafter_passes(tiny_target, block_drafter, case):
    result = check_first_round_law(tiny_target, block_drafter(InformedBlock, case), _prompt(tiny_target),
                                   temperature=TEMPERATURE, trials=TRIALS)
    assert result["accepted"] > TRIALS / 5, f"the stand-in draft is accepted too rarely to give power: {result}"


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_killed(tiny_target, block_drafter, name):
    cls, case = MUTANTS[name]
    with pytest.raises(AssertionError, match="do not follow the target"):
        check_first_round_law(tiny_target, block_drafter(cls, case), _prompt(tiny_target), temperature=TEMPERATURE,
                              trials=TRIALS)


def test_every_mutant_names_a_case_the_real_drafter_passes():
    assert {case for _, case in MUTANTS.values()} <= set(CASES) and len(MUTANTS) >= 3


def test_draw_block_never_looks_at_the_draws():
    """The cut is a function of the slots' laws: two generators give different tokens, the same length."""
    logits = torch.randn(5, 50)
    lengths = set()
    for seed in range(20):
        from draftlab.decoding.budget import TreeBudget

        budget = TreeBudget(VerifyCost.linear(0.01, 0.005), level_seconds=0.0)
        budget.context = 10
        tokens, probs = draw_block(logits, temperature=0.7, generator=torch.Generator().manual_seed(seed),
                                   budget=budget)
        lengths.add(len(tokens))
        assert probs is None or probs.shape == (len(tokens), 50)
    assert len(lengths) == 1


# ---- the two-token case: the real block sampler, the real budget, the real verifier ---------------------

ROUNDS = 20_000
# Two-sided exact binomial p-value below which the first token's frequency is called biased: an exact
# sampler fails with probability at most this (by the definition of a p-value), and the biased cut below
# (0.549 instead of 0.5 over 20k rounds, z ~ 14) falls 30 orders of magnitude beyond it.
P_BINOMIAL = 1e-6


def _token_frequency(draw, slots, target_rows, position: int, rounds: int) -> tuple[float, float]:
    """(frequency of token 0 as the round's ``position``-th emitted token, its binomial p-value against 0.5) over
    ``rounds`` rounds of ``draw`` on slot logits ``slots [bs-1, V]``, verified against ``target_rows [N, V]``
    (log-probs), under a verify pass of r rows at 0.01 + 0.005 (r - 1) seconds: a prefix is worth its rows
    exactly when its score is above 0.5 (the budget's calibration held at its prior, 1)."""
    from scipy.stats import binomtest

    from draftlab.decoding.budget import TreeBudget
    from draftlab.decoding.tree import DraftTree
    from draftlab.decoding.verify import verify

    budget = TreeBudget(VerifyCost.linear(0.01, 0.005), level_seconds=0.0, decay=1.0)
    budget.context = 1
    gen = torch.Generator().manual_seed(0)
    zeros = 0
    for _ in range(rounds):
        tokens, probs = draw(slots, temperature=1.0, generator=gen, budget=budget)
        tree = DraftTree.chain(0, tokens, draft_probs=probs)
        result = verify(target_rows[: tree.size], tree, temperature=1.0, generator=gen)
        budget.observe(len(result.path) - 1)
        zeros += result.accepted_tokens(tree)[position] == 0
    return zeros / rounds, binomtest(zeros, rounds, 0.5).pvalue


def _first_token_frequency(draw) -> tuple[float, float]:
    """Target p = (0.5, 0.5), one draft slot q = (0.9, 0.1): the draw 0 (q 0.9) is worth its row, the draw 1
    (q 0.1) is not; the first emitted token over ROUNDS rounds (``_token_frequency``)."""
    slot = torch.tensor([[0.9, 0.1]]).log()  # [1, 2]
    return _token_frequency(draw, slot, torch.zeros(2, 2), 0, ROUNDS)  # p = (0.5, 0.5) at every node


def _second_slot_cut_on_its_draw(logits, *, temperature, generator, budget, top_k=None, top_p=None, **_):
    # A slip in the cut: the first slot scored by E_q[q] as it should be, the second by q of the token it drew,
    # so one slot's draw leaks into whether it is verified.
    probs = logits_to_probs(logits, temperature, top_k, top_p)  # [bs-1, V]
    tokens = sample(probs, generator)  # [bs-1]
    scores = (probs.double() ** 2).sum(-1)
    scores[1] = probs[1, tokens[1]].double()
    keep = budget.choose(scores.cumprod(0), 0)
    return tokens[:keep], None if keep == 0 else probs[:keep]


def _second_token_frequency(draw) -> tuple[float, float]:
    """A two-slot block: the first slot certain (q = p = token 0), the second q = (0.9, 0.1) against
    p = (0.5, 0.5). E_q[q] = 0.82 keeps both slots in every round; q of the draw keeps the second only after
    drawing 0. The second emitted token over ROUNDS / 2 rounds (``_token_frequency``)."""
    slots = torch.tensor([[1.0, 1e-12], [0.9, 0.1]]).log()  # [2, 2]
    target_rows = torch.tensor([[1.0, 1e-12], [0.5, 0.5], [0.5, 0.5]]).log()  # [N <= 3, V]
    return _token_frequency(draw, slots, target_rows, 1, ROUNDS // 2)


# name: (the emitted token it looks at, the slip it catches). The first-token slip is the cut as it was before the
# fix (0.549 against 0.5 over 20k rounds). The second-slot slip: exact value 0.9 x min(1, 0.5 / 0.9) + 0.1 x 0.5
# = 0.55; one run over 10k rounds gave the real cut 0.493 (p = 0.15), the slip 0.545 (p = 3e-19). The
# first-round check on the tiny target does not see it (p ~ 0.5 at 300 trials): the second slot is rarely kept
# and accepted there.
TWO_TOKEN = {"first_token": (_first_token_frequency, _old_draw_block),
             "second_token": (_second_token_frequency, _second_slot_cut_on_its_draw)}


@pytest.mark.parametrize("case", list(TWO_TOKEN))
def test_the_auto_cut_is_exact(case):
    frequency, _ = TWO_TOKEN[case]
    freq, p = frequency(draw_block)
    assert p > P_BINOMIAL, f"{case}: token 0 at frequency {freq:.4f} (p = {p:.1e}); the target's is 0.5"


@pytest.mark.parametrize("case", list(TWO_TOKEN))
def test_a_cut_on_the_draws_is_caught(case):
    frequency, slip = TWO_TOKEN[case]
    freq, p = frequency(slip)
    assert p < P_BINOMIAL and freq > 0.53, (freq, p)
