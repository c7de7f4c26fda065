"""SSD over a trained EAGLE-3 draft (``method=ssd_eagle3``): the speculator drafts past the verified rows on the
draft's own states, the worker's copy is kept in step by each round's verified features, every cached chain
is what the primary drafts in the verified state the cache was built in, and decoding stays exact (greedy ==
AR for every worker and backup, the powered check on the cached rounds)."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.speculator import Sampling
from draftlab.methods.registry import MethodSpec
from draftlab.methods.ssd import SSDDrafter
from draftlab.methods.ssd.cache import SpeculationCache
from tests.decoding.conformance.checks import check_first_round_law, check_greedy_equals_ar
from tests.decoding.conformance.methods import first_round_prompt, quick_train
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT
from tests.methods.test_ssd import Checked, UnrescaledQ

_draft = {}


def _trained(target):
    if "d" not in _draft:
        _draft["d"] = quick_train(MethodSpec.from_name("ssd_eagle3", ci=True), target)
    return _draft["d"]


def _spec(**kw) -> MethodSpec:
    return MethodSpec.from_name("ssd_eagle3", [f"method.drafter.{k}={v}" for k, v in kw.items()], ci=True)


def test_speculator_follows_the_verified_rows(tiny_target):
    """After absorbing a round, the speculator's committed rows are the drafter's (same features, same
    states); drafting past them equals drafting after a sequence it was told nothing about beyond its tokens."""
    from draftlab.methods.eagle3.drafter import Eagle3Drafter

    draft = _trained(tiny_target)
    drafter = Eagle3Drafter(draft, branching=1, depth=3, nodes=3)
    spec = drafter.speculator(tiny_target)
    greedy = Sampling(0.0)
    seen = []

    class Recorder(Eagle3Drafter):
        def reset(self, state):
            super().reset(state)
            seen.append(spec.verified(state))

        def update(self, state, out):
            super().update(state, out)
            seen.append(spec.verified(state))

    rec = Recorder(draft, branching=1, depth=3, nodes=3)
    out, _ = speculative_generate(tiny_target, TRAIN_PROMPTS[1], rec, GenerationConfig(max_new_tokens=12,
                                                                                        stop_on_eos=False))
    for v in seen:
        spec.absorb(v)
    tokens = seen[-1][0]
    assert spec.tokens == tokens == TRAIN_PROMPTS[1] + out
    assert spec.rows.committed == rec.rows.committed == len(tokens) - 1
    torch.testing.assert_close(spec.rows.h_last, rec.rows.h_last)
    chain = spec.chain(tokens, 3, greedy).tokens
    # The chain's first token is the committed row's argmax: what the drafter's own tree proposes first.
    assert chain[0] == int(rec.rows.root_logprobs.argmax())
    copy = spec.portable()()
    for v in seen:
        copy.absorb(v)
    assert copy.chain(tokens, 3, greedy).tokens == chain
    z = spec.glue(tokens, chain)  # [4, V]
    assert z[:3].argmax(-1).tolist() == chain
    a, b = spec.branches([(0, chain[0]), (2, 7)], 2, greedy)
    assert a.tokens == chain[1:3]
    assert b.tokens == copy.chain(tokens + chain[:2] + [7], 2, greedy).tokens
    with pytest.raises(ValueError, match="verified sequence it absorbed"):
        spec.chain(tokens[:-2] + [9, 9], 2, greedy)  # not a continuation of what it was told
    with pytest.raises(RuntimeError, match="absorb every round"):
        spec.absorb((tokens[:5] + [1] * 7, seen[1][1]))  # a round of another sequence


@pytest.mark.parametrize("temperature", [0.0, 0.05])
def test_every_hit_is_what_the_primary_drafts(tiny_target, temperature):
    draft = _trained(tiny_target)
    spec = _spec(worker="inline", width=8, scale=0.25 if temperature else 1.0)
    primary = spec.build_drafter(draft).primary
    cfg = spec.resolved()["drafter"]
    kw = {k: cfg[k] for k in ("depth", "width", "scale")}
    with closing(Checked(primary=primary, worker="inline", **kw)) as d:
        for i, prompt in enumerate([TRAIN_PROMPTS[1], UNSEEN_PROMPT, TRAIN_PROMPTS[0], TRAIN_PROMPTS[2]]):
            speculative_generate(tiny_target, prompt, d, GenerationConfig(max_new_tokens=40, temperature=temperature,
                                                                           seed=i, stop_on_eos=False))
        assert d.checked >= 5, d.checked  # hits happened and were checked


SETTINGS = {"jit_process": dict(worker="process"), "fast_process": dict(worker="process", backup="fast"),
            "jit_inline_geometric": dict(worker="inline", fanout="geometric", budget=8, accept=0.5),
            "no_worker": dict(worker="none")}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_equals_ar(tiny_target, setting):
    draft = _trained(tiny_target)
    check_greedy_equals_ar(tiny_target, lambda: _spec(**SETTINGS[setting]).build_drafter(draft),
                           [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 24)


# At T = 0.1 a quickly trained draft's caches hit (a uniform fan-out of 8, C = 0.25); tokens 6 and 7 come from
# the second round, the first a cache can serve.
POWERED = {"jit": (SpeculationCache, "jit"), "fast": (SpeculationCache, "fast"), "unrescaled": (UnrescaledQ, "jit")}


@pytest.mark.parametrize("case", list(POWERED))
def test_powered_sampling_check_on_cached_rounds(tiny_target, case):
    cache_cls, backup = POWERED[case]
    draft = _trained(tiny_target)
    made = []

    def make():
        d = _spec(worker="inline", width=8, scale=0.25, backup=backup).build_drafter(draft)
        start = d._start

        def swapped(target):
            start(target)
            d.worker.cache = cache_cls(d.worker.cache.speculator)

        d._start = swapped
        made.append(d)
        return d

    prompt = first_round_prompt(tiny_target)
    if cache_cls is SpeculationCache:
        result = check_first_round_law(tiny_target, make, prompt, temperature=0.1, trials=300, at=6)
        assert result["accepted"] > 300
        assert made[0].sequence_stats()["hit_rate"] > 0.15, made[0]._stats
    else:
        with pytest.raises(AssertionError, match="do not follow the target"):
            check_first_round_law(tiny_target, make, prompt, temperature=0.1, trials=300, at=6)


def test_ssd_taps_what_its_primary_reads(tiny_target):
    """SSD asks its primary for the taps a feature draft reads, so the engine captures them."""
    draft = _trained(tiny_target)
    d = _spec(worker="none").build_drafter(draft)
    assert isinstance(d, SSDDrafter)
    assert d.taps(tiny_target) == draft.taps(tiny_target)
