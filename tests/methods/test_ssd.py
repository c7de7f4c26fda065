"""SSD / Saguaro: fan-outs and σ_{F,C}; every cached chain is what the base drafts after the real sequence
(a cache serving the wrong key or a stale one is caught); greedy == AR and the powered sampling check on the
rounds that cached chains serve, both backups, C < 1 (verifying with the un-rescaled q is caught); the worker
process never outlives its drafter, not even a parent killed mid-round."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import closing

import pytest
import torch

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.decoding.outcome_drafter import Sampling
from draftlab.decoding.sampling import logits_to_probs
from draftlab.methods.registry import MethodSpec
from draftlab.methods.ssd import SSDDrafter
from draftlab.methods.ssd.cache import OutcomeCache
from draftlab.methods.ssd.saguaro import (
    Reshaper,
    candidates,
    geometric_fanout,
    saguaro_reshape,
    stop_law,
    uniform_fanout,
)
from tests.decoding.conformance.checks import check_first_round_law, check_greedy_equals_ar
from tests.decoding.conformance.methods import first_round_prompt
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT

# ---- Saguaro's pieces ----------------------------------------------------------------------------------


def test_a_base_that_cannot_speculate_is_refused_by_name(tiny_target):
    from draftlab.decoding.drafter import Drafter
    from draftlab.methods.prompt_lookup import PromptLookupDrafter

    assert not hasattr(Drafter, "outcome_drafter")  # the seam every drafter implements does not carry SSD's hook
    with closing(SSDDrafter(base=PromptLookupDrafter(), worker="inline")) as ssd:
        with pytest.raises(ValueError, match="PromptLookupDrafter cannot draft after an unverified outcome"):
            speculative_generate(tiny_target, UNSEEN_PROMPT[:8], ssd, GenerationConfig(max_new_tokens=4))


def test_fanouts():
    assert uniform_fanout(3, 4) == [3, 3, 3, 3, 3]
    law = stop_law(0.5, 3)
    assert law == [0.5, 0.25, 0.125, 0.125] and sum(law) == 1.0
    f = geometric_fanout(12, 3, accept=0.5, r=1.0)
    # F_j ∝ P(j)^(1/2): sqrt(.5, .25, .125, .125) = .707, .5, .354, .354 of 1.914 -> 4.43, 3.13, 2.22, 2.22 of 12
    assert f == [5, 3, 2, 2] and sum(f) == 12
    assert geometric_fanout(4, 6, accept=0.9, r=0.5) == [1, 1, 0, 0, 0, 0, 2] or sum(geometric_fanout(4, 6, accept=0.9, r=0.5)) == 4
    with pytest.raises(ValueError, match="0 < accept < 1"):
        geometric_fanout(12, 3, accept=1.0, r=1.0)


def test_candidates_leave_out_the_drafted_token():
    z = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0])
    assert candidates(z, 2, None) == [1, 2]
    assert candidates(z, 2, 1) == [2, 3]
    assert candidates(z, 0, None) == []


def test_saguaro_reshape_scales_the_top_tokens():
    z = torch.tensor([0.0, 3.0, 2.0, 1.0])
    q = torch.softmax(z, -1)
    out = saguaro_reshape(q, z, 2, 0.5)
    expected = q.clone()
    expected[[1, 2]] *= 0.5
    torch.testing.assert_close(out, expected / expected.sum())
    assert torch.equal(saguaro_reshape(q, z, 2, 1.0), q)
    assert Reshaper([2, 0], 0.5)(1, z, q) is q  # no candidates at that position: nothing to push mass onto


# ---- the cache serves what the base drafts --------------------------------------------------------


class Checked(SSDDrafter):
    """The real drafter (inline worker, so a cache class can be swapped in) checked against a fresh copy of the
    base's outcome_drafter, kept one round behind (in the verified state the cache was built in). At T = 0,
    after every lookup, the whole cache must be the cache of the chain proposed the round
    before: its keys the candidates of that chain's fresh glue pass, each entry the fresh chain after
    ``context + chain[:j] + [t]``; and a served chain must be the fresh chain after the real sequence. At T > 0
    a served chain's reported rows must be the fresh laws (σ-reshaped) of its tokens after the real sequence."""

    cache_cls = OutcomeCache

    def _start(self, target):
        super()._start(target)
        self.worker.cache = self.cache_cls(self.worker.cache.outcome_drafter)
        self.fresh = self._outcome_drafter.portable()()
        self.checked = 0
        self._last = None

    def reset(self, state):
        super().reset(state)
        self._last = None

    def _check_cache(self, context: list[int], chain: list[int]) -> None:
        z = self.fresh.glue(context, chain)  # [K+1, V]
        keys = {(j, t) for j in range(len(chain) + 1)
                for t in candidates(z[j], self.fanout[j], chain[j] if j < len(chain) else None)}
        entries = self.worker.cache.entries
        assert set(entries) == keys, "stale cache: its keys are not this chain's outcomes"
        for (j, t), spec in entries.items():
            assert self._greedy_chain_is(context + chain[:j] + [t], spec.tokens), f"stale cache entry {(j, t)}"

    def _greedy_chain_is(self, context: list[int], tokens: list[int]) -> bool:
        """Whether ``tokens`` is the fresh copy's greedy chain after ``context``, up to ties: where they part,
        the two tokens' draft log-probs may differ by float rounding only (rows batched differently)."""
        fresh = self.fresh.chain(context, self.depth, Sampling(0.0)).tokens
        if tokens == fresh:
            return True
        k = next(i for i, (a, b) in enumerate(zip(tokens, fresh)) if a != b)
        z = self.fresh.glue(context, fresh)  # [K+1, V]
        return abs(float(z[k, tokens[k]] - z[k, fresh[k]])) < 1e-4

    def propose(self, state):
        looked_up = self._outstanding
        verified = self._outcome_drafter.verified(state)
        tree = super().propose(state)
        if state.temperature == 0 and looked_up and self._last is not None:
            self._check_cache(*self._last)
        if self._hit:
            served = tree.tokens[1:].tolist()
            if state.temperature == 0:
                assert self._greedy_chain_is(list(state.tokens), served), "stale chain"
            else:
                z = self.fresh.glue(state.tokens, served)[:-1]  # [K, V]
                reshape = Reshaper(self.fanout, self.scale)
                laws = torch.stack([reshape(j, z[j], logits_to_probs(z[j], state.temperature, state.top_k,
                                                                      state.top_p)) for j in range(len(served))])
                torch.testing.assert_close(tree.draft_probs[1:], laws, rtol=1e-4, atol=1e-6, msg="stale law")
            self.checked += 1
        self.fresh.absorb(verified)  # the verified state this round's cache is built in
        self._last = (list(state.tokens), tree.tokens[1:].tolist())
        return tree


class WrongKey(OutcomeCache):
    """Mutant: serves another outcome's chain whenever the right one is cached."""

    def lookup(self, key):
        if key not in self.entries:
            return None
        others = [k for k in self.entries if k != key]
        return self.entries[others[0]] if others else None


class StaleAfterMiss(OutcomeCache):
    """Mutant: after a miss it keeps the cache built for the chain before (the backup's chain is not built)."""

    def __init__(self, outcome_drafter):
        super().__init__(outcome_drafter)
        self.served = True

    def build(self, **request):
        if self.served:
            super().build(**request)

    def lookup(self, key):
        spec = super().lookup(key)
        self.served = spec is not None
        return spec


class StaleDraftKV(OutcomeCache):
    """Mutant: the worker's draft cache is never rolled back (a rejected suffix stays as context)."""

    def build(self, **request):
        lm = self.outcome_drafter
        if lm.context:
            request = dict(request, context=lm.context + request["context"][len(lm.context):])
        super().build(**request)


class KeyedWithoutBonus(OutcomeCache):
    """Mutant: entries looked up by the accept length j alone; the bonus token t is not part of the key."""

    def lookup(self, key):
        if key is None:
            return None
        return next((spec for (j, _), spec in self.entries.items() if j == key[0]), None)


def _ssd(layers: int, cache_cls=OutcomeCache, **kw) -> Checked:
    from draftlab.methods.draft_model import DraftModelDrafter

    cls = type("C", (Checked,), {"cache_cls": cache_cls})
    return cls(base=DraftModelDrafter(layers=layers, depth=4), depth=4, worker="inline", **kw)


def _decode(target, drafter, temperature: float, n: int = 40) -> None:
    for i, prompt in enumerate([TRAIN_PROMPTS[1], UNSEEN_PROMPT, TRAIN_PROMPTS[0]]):
        cfg = GenerationConfig(max_new_tokens=n, temperature=temperature, seed=i, stop_on_eos=False)
        speculative_generate(target, prompt, drafter, cfg)


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_every_hit_is_what_the_base_drafts(tiny_target, temperature):
    with closing(_ssd(1, scale=0.5 if temperature else 1.0)) as d:
        _decode(tiny_target, d, temperature)
        # Sampled runs hit by chance: more seeds until 5 hits were checked (each one is), at most 4 passes.
        for seed in range(1, 4 if temperature else 1):
            if d.checked >= 5:
                break
            for i, prompt in enumerate([TRAIN_PROMPTS[1], UNSEEN_PROMPT, TRAIN_PROMPTS[0]]):
                speculative_generate(tiny_target, prompt, d, GenerationConfig(
                    max_new_tokens=40, temperature=temperature, seed=10 * seed + i, stop_on_eos=False))
        assert d.checked >= 5, d.checked  # hits happened and were checked


@pytest.mark.parametrize("mutant", [WrongKey, StaleAfterMiss, StaleDraftKV, KeyedWithoutBonus])
def test_cache_mutants_are_caught(tiny_target, mutant):
    with closing(_ssd(1, mutant)) as d, pytest.raises(AssertionError, match="stale"):
        _decode(tiny_target, d, 0.0)


# ---- exactness -----------------------------------------------------------------------------------------


SETTINGS = {"jit_process": dict(worker="process"), "fast_process": dict(worker="process", backup="fast"),
            "jit_inline_geometric": dict(worker="inline", fanout="geometric", candidates=8, accept=0.5)}


def _spec_drafter(layers: int, **kw):
    over = [f"method.base.drafter.layers={layers}"] + [f"method.drafter.{k}={v}" for k, v in kw.items()]
    return MethodSpec.from_name("ssd", over).build_drafter()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_equals_ar(tiny_target, setting):
    for layers in (1, 2):
        check_greedy_equals_ar(tiny_target, lambda n=layers: _spec_drafter(n, **SETTINGS[setting]),
                               [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 24)


class UnrescaledQ(OutcomeCache):
    """Mutant: the worker samples from σ_{F,C} but reports the plain q to the verifier."""

    def build(self, **request):
        super().build(**request)
        if request["temperature"] > 0:
            for (j, t), spec in self.entries.items():
                ctx = request["context"] + request["chain"][:j] + [t]
                z = self.outcome_drafter.glue(ctx, spec.tokens)[:-1]
                spec.probs = logits_to_probs(z, request["temperature"])


class ArgmaxHitsOnly(OutcomeCache):
    """Mutant: a cached chain is served only when its first token is the argmax of its own law (a hit filtered
    on the value drawn, so what is verified depends on the draws)."""

    def lookup(self, key):
        spec = super().lookup(key)
        if spec is not None and spec.probs is not None and int(spec.probs[0].argmax()) != spec.tokens[0]:
            return None
        return spec


class SameSeedEveryRound(OutcomeCache):
    """Mutant: the worker's generator reseeded identically for every build, so the cached chains are the same
    function of their context in every sequence and round instead of fresh draws."""

    def build(self, **request):
        super().build(**dict(request, seed=0))


# The whole target as base (q == p) at T = 0.3: plain chains are always accepted; with C = 0.25 the cached
# chains' laws differ from p, so a misreported law shows. Tokens 6 and 7 are tested: the first round (a
# backup) emits tokens 1-5 when it accepts its chain, so they come from the second round, a cached chain.
# ``unrescaled`` is in the heavy tier (``-m heavy``: 300 trials of an inline worker, over a minute); the default
# run kills the same mutant in the exact check of every served law (test_a_misreported_cached_law_is_caught).
# ``fast`` is in the heavy tier too (a minute): the default run checks the fast backup's cached rounds with the
# same check in test_ssd_eagle3.py::test_powered_sampling_check[fast_cached] (the backup and the cache are the
# same code whichever base drafts), and this file's ``jit`` case keeps the draft-model base.
# ``argmax_hits`` (a cache mutant that only shows at T > 0) is killed by this check in the heavy tier (300
# trials, about a minute). ``SameSeedEveryRound`` is not: the served branch, picked by the outcome, decides which
# of the build's uniforms a hit drafted with, so its tokens stay close to fresh draws in this check; it is killed
# directly by test_every_build_draws_afresh.
POWERED = {"jit": (OutcomeCache, "jit"), "fast": (OutcomeCache, "fast"), "unrescaled": (UnrescaledQ, "jit"),
           "argmax_hits": (ArgmaxHitsOnly, "jit")}
# ``jit`` (the whole-target base, about 50 s) too: the default run checks every served chain's law exactly
# (test_every_hit_is_what_the_base_drafts, T = 0.3) and the cached rounds' output law on the EAGLE-3 base
# (test_ssd_eagle3.py::test_powered_sampling_check[fast_cached], with less power: few of its drafts are accepted).
HEAVY = {"jit", "fast", "unrescaled", "argmax_hits"}


def test_a_misreported_cached_law_is_caught(tiny_target):
    """UnrescaledQ (cached chains drawn from σ, reported as q) fails the check of every hit at T > 0: a served
    chain's reported rows must be σ's laws of its tokens."""
    with closing(_ssd(1, UnrescaledQ, scale=0.5)) as d, pytest.raises(AssertionError, match="stale law"):
        for seed in range(4):  # hits come by chance at T > 0; the first one is caught
            for i, prompt in enumerate([TRAIN_PROMPTS[1], UNSEEN_PROMPT, TRAIN_PROMPTS[0]]):
                speculative_generate(tiny_target, prompt, d, GenerationConfig(
                    max_new_tokens=40, temperature=0.3, seed=10 * seed + i, stop_on_eos=False))


def _builds_draw_afresh(tiny_target, cache_cls) -> None:
    """At T > 0 the cache's chains are draws seeded per build: the drafter passes a seed no earlier build of the
    run had, and two builds of the same outcomes under different seeds draw different chains."""
    seeds = []

    class Recording(cache_cls):
        def build(self, **request):
            seeds.append(request["seed"])
            super().build(**request)

    with closing(_ssd(2, Recording, scale=0.5)) as d:
        for i, prompt in enumerate([TRAIN_PROMPTS[1], TRAIN_PROMPTS[1]]):
            speculative_generate(tiny_target, prompt, d, GenerationConfig(max_new_tokens=12, temperature=0.7,
                                                                          seed=i, stop_on_eos=False))
        assert len(seeds) > 4 and len(set(seeds)) == len(seeds), seeds
        cache = cache_cls(d._outcome_drafter.portable()())
        chain = TRAIN_PROMPTS[1][-4:]
        drawn = []
        for seed in (1, 2):
            cache.build(context=TRAIN_PROMPTS[1], chain=chain, fanout=[3] * 5, depth=4, temperature=0.7, top_k=None,
                        top_p=None, seed=seed, scale=0.5)
            drawn.append({k: v.tokens for k, v in cache.entries.items()})
    assert drawn[0] != drawn[1], "the same chains under two seeds: the builds do not draw afresh"


def test_every_build_draws_afresh(tiny_target):
    _builds_draw_afresh(tiny_target, OutcomeCache)


def test_a_worker_reseeded_identically_is_caught(tiny_target):
    with pytest.raises(AssertionError, match="do not draw afresh"):
        _builds_draw_afresh(tiny_target, SameSeedEveryRound)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c in HEAVY else c for c in POWERED])
def test_powered_sampling_check_on_cached_rounds(tiny_target, case):
    cache_cls, backup = POWERED[case]
    made = []

    def make():
        from draftlab.methods.draft_model import DraftModelDrafter
        from draftlab.methods.prompt_lookup import PromptLookupDrafter

        cls = type("C", (SSDDrafter,), {"_start": lambda self, t: (SSDDrafter._start(self, t), setattr(
            self.worker, "cache", cache_cls(self.worker.cache.outcome_drafter)))})
        d = cls(base=DraftModelDrafter(layers=2, depth=4), depth=4, worker="inline", scale=0.25, backup=backup,
                fast=PromptLookupDrafter(nodes=4))
        made.append(d)
        return d

    prompt = first_round_prompt(tiny_target)
    if cache_cls is OutcomeCache:
        result = check_first_round_law(tiny_target, make, prompt, temperature=0.3, trials=300, at=6)
        stats = made[0]._stats
        assert result["accepted"] > 300
        assert made[0].sequence_stats()["hit_rate"] > 0.3, stats
    else:
        with pytest.raises(AssertionError, match="do not follow the target"):
            check_first_round_law(tiny_target, make, prompt, temperature=0.3, trials=300, at=6)


# ---- the worker process --------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited (nobody reaped it yet)
    except FileNotFoundError:
        return False


def test_close_stops_the_worker(tiny_target):
    d = _spec_drafter(1)
    speculative_generate(tiny_target, UNSEEN_PROMPT, d, GenerationConfig(max_new_tokens=6, stop_on_eos=False))
    pid = d.worker.pid
    assert _alive(pid)
    d.close()
    assert not _alive(pid)
    d.close()  # twice is harmless


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_worker_outlives_a_killed_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        from draftlab.decoding.engine import GenerationConfig, speculative_generate
        from draftlab.methods.registry import MethodSpec
        from draftlab.targets import load_target

        if __name__ == "__main__":
            target = load_target("tiny_random")
            drafter = MethodSpec.from_name("ssd", ["method.base.drafter.layers=1"]).build_drafter()
            cfg = GenerationConfig(max_new_tokens=400, stop_on_eos=False)
            prompt = list(range(100, 140))
            speculative_generate(target, prompt, drafter, GenerationConfig(max_new_tokens=4, stop_on_eos=False))
            print(drafter.worker.pid, flush=True)
            while True:
                speculative_generate(target, prompt, drafter, cfg)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        time.sleep(1.0)  # mid-decode: rounds are being verified and built
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), f"worker {worker} outlived its killed parent"
    finally:
        parent.kill()


# ---- calibration -----------------------------------------------------------------------------------------


def test_calibration_measures_and_round_trips(tiny_target, tmp_path):
    from draftlab.methods.draft_model import DraftModelDrafter
    from draftlab.methods.ssd.calibrate import fit_power, measure
    from draftlab.methods.ssd.calibration import Calibration

    assert fit_power({1: 1.0, 2: 0.5, 4: 0.25}) == pytest.approx(1.0)  # miss = 1/F exactly
    drafter = DraftModelDrafter(layers=2, depth=3)  # the whole target: every chain accepted, bonus = its argmax
    cal = measure(tiny_target, drafter, [TRAIN_PROMPTS[1], UNSEEN_PROMPT], depth=3, temperature=0.0, max_new_tokens=20)
    assert cal.rounds >= 8 and cal.accept > 0.99
    assert all(j == 3 and rank == 0 for j, rank in cal.outcomes)  # the draft's own argmax is the bonus
    assert cal.hit_rate([1, 1, 1, 1]) == 1.0 and cal.hit_rate([1, 1, 1, 0]) == 0.0
    cal.save(tmp_path / "cal.json")
    again = Calibration.load(tmp_path / "cal.json")
    assert again == cal
    d = SSDDrafter(base=drafter, depth=3, fanout="geometric", candidates=8, calibration=str(tmp_path / "cal.json"),
                   worker="inline")
    assert d.fanout == geometric_fanout(8, 3, accept=cal.accept, r=cal.power)
    with pytest.raises(ValueError, match="calibrated for chains of 3 tokens"):
        SSDDrafter(base=drafter, depth=4, fanout="geometric", calibration=str(tmp_path / "cal.json"), worker="inline")
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="field 'format'"):
        Calibration.load(tmp_path / "bad.json")
