"""Draft-law slips of a sampling drafter, killed by the first-round check once the draft is accepted.

With the CI draft (one of the tiny target's two layers) a first-round proposal is rarely accepted, and a law
reported wrongly shows only in the rounds that accept it: the check saw these slips at p ~ 1e-3 .. 1e-4, above
its floor. Here the draft model is the target's own two layers, so its law is the target's and its first
proposal is accepted in most rounds: the check's power goes where these slips act. Each mutant patches the
one sampling step every draft-model drafter (and SSD's base) draws through, ``Sampling.draw_rows``.

Margins (one run each, floor 1e-4, the Monte-Carlo floor 4e-5): at 300 trials the real drafter gives p = 1.0
(plain and under top-p 0.7); the law reported at 1.25x the temperature and the top-p draw reported without the
nucleus cut reach the floor, the drafted tokens' rank bins at |z| 5.8 and 5.1. The law at 1.1x the temperature
is a smaller slip: |z| 4.2 at 600 trials (p 1e-3), 5.4 at 1500 (the floor), so it runs at 2000 trials in the
heavy tier (``-m heavy``; about 30 s).
"""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

import draftlab.decoding.outcome_drafter as outcome_module
from draftlab.decoding.sampling import logits_to_probs, sample
from tests.decoding.conformance.checks import check_first_round_law
from tests.decoding.conformance.methods import FIRST_ROUND_T, first_round_prompt, spec

TRIALS = 300
HEAVY_TRIALS = 2000  # the 1.1x slip: see the module docstring
TOP_P = 0.7


def _law_at_temperature(factor: float):
    """Draws at the engine's temperature, reports the law at ``factor`` times it."""
    def draw_rows(self, z, reshape=None, position=0):
        if self.temperature == 0:
            return z.argmax(-1).tolist(), None
        q = logits_to_probs(z, self.temperature, self.top_k, self.top_p)
        return sample(q, self.generator).tolist(), logits_to_probs(z, self.temperature * factor, self.top_k, self.top_p)
    return draw_rows


def _law_without_nucleus(self, z, reshape=None, position=0):
    """Draws under top-p, reports the law without the nucleus cut."""
    if self.temperature == 0:
        return z.argmax(-1).tolist(), None
    q = logits_to_probs(z, self.temperature, self.top_k, self.top_p)
    return sample(q, self.generator).tolist(), logits_to_probs(z, self.temperature, self.top_k, None)


# name: (patched Sampling.draw_rows, top_p the check runs under, trials)
MUTANTS = {"law_at_1.1x_temperature": (_law_at_temperature(1.1), None, HEAVY_TRIALS),
           "law_at_1.25x_temperature": (_law_at_temperature(1.25), None, TRIALS),
           "top_p_draw_reported_without_nucleus": (_law_without_nucleus, TOP_P, TRIALS)}


@pytest.fixture(scope="module")
def whole_target_draft(tiny_target):
    s = copy.deepcopy(spec("draft_model"))
    OmegaConf.update(s.cfg, "drafter.layers", tiny_target.geometry.num_layers)  # the target's own law
    OmegaConf.update(s.cfg, "drafter.depth", 2)
    return s.build_drafter


@pytest.mark.parametrize("top_p", [None, TOP_P], ids=["plain", "top_p"])
def test_the_real_draft_model_passes(tiny_target, whole_target_draft, top_p):
    result = check_first_round_law(tiny_target, whole_target_draft, first_round_prompt(tiny_target),
                                   temperature=FIRST_ROUND_T, trials=TRIALS, top_p=top_p)
    assert result["accepted"] > TRIALS, f"the draft is not accepted often enough to give power: {result}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if MUTANTS[n][2] > TRIALS else n
                                  for n in MUTANTS])
def test_draft_law_mutant_is_killed(tiny_target, whole_target_draft, name, monkeypatch):
    draw_rows, top_p, trials = MUTANTS[name]
    monkeypatch.setattr(outcome_module.Sampling, "draw_rows", draw_rows)
    with pytest.raises(AssertionError, match="do not follow the target"):
        check_first_round_law(tiny_target, whole_target_draft, first_round_prompt(tiny_target),
                              temperature=FIRST_ROUND_T, trials=trials, top_p=top_p)
