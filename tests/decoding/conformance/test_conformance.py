"""Every ``conf/method/*.yaml``, built through the registry, against the engine's contract.

Per method: the draft and drafter build from the config; greedy speculative decoding equals AR on the
tiny target (and, marked slow, on SmolLM2 with Spec-Bench prompts); the tokens of a drafter's first round
follow the target's law at T > 0 (``checks.check_first_round_law``: an exact-null test whose false-failure
rate is stated, over independent trials from one prompt of the drafts' corpus), as configured and, for
drafters that size their trees, with ``tree: auto`` under a sloped verify cost that really cuts; every
proposed tree satisfies the tree invariants and fits the rows the drafter declares; the trained artifact
survives save/load. ``test_mutants.py`` and ``test_drafter_mutants.py`` show that broken engines and
drafters fail these very checks.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.decoding.budget import TreeBudget
from draftlab.decoding.cost import VerifyCost
from draftlab.decoding.drafter import Drafter
from draftlab.decoding.engine import GenerationConfig, autoregressive_generate, speculative_generate
from tests.decoding.conformance.checks import check_first_round_law, check_greedy_equals_ar
from tests.decoding.conformance.methods import (
    FIRST_ROUND_T,
    FIRST_ROUND_TRIALS,
    METHODS,
    first_losses,
    first_round_prompt,
    per_method,
    quick_train,
    sequences,
    spec,
    vocab_for,
)
from tests.methods.corpus import TRAIN_PROMPTS, UNSEEN_PROMPT

_trained: dict[str, object] = {}


@pytest.fixture(scope="module")
def make_drafter(tiny_target):
    """name -> a factory of fresh drafters (trainable methods: around one quickly trained draft)."""

    def factory(name: str):
        s = spec(name)
        if not s.trainable:
            return lambda: s.build_drafter()
        if name not in _trained:
            _trained[name] = quick_train(s, tiny_target)
        draft = _trained[name]
        return lambda: s.build_drafter(draft)

    return factory


@pytest.mark.parametrize("name", METHODS)
def test_builds_from_config(tiny_target, name):
    s = spec(name)
    drafter = s.build_drafter(s.build_draft(tiny_target, None if s.draft_vocab_size is None else _vocab(s, tiny_target))
                              ) if s.trainable else s.build_drafter()
    assert isinstance(drafter, Drafter)  # subclasses the protocol: the engine's defaults are inherited
    rows = drafter.scratch_rows(GenerationConfig())
    assert rows is None or rows >= 1
    taps = drafter.taps(tiny_target)
    if taps is not None:
        tiny_target.check_layer_ids(taps)
    drafter.close()  # what builds a drafter closes it


def _vocab(s, target):
    return vocab_for(s, target, sequences(target))


@pytest.mark.parametrize("name", per_method(METHODS))
def test_greedy_equals_ar_tiny(tiny_target, make_drafter, name):
    accepted = check_greedy_equals_ar(tiny_target, make_drafter(name), [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 20)
    if spec(name).trainable:
        # Trained on the target's own continuations, the draft must be accepted, or equality proves little.
        # (Training-free drafters such as n-gram lookup find nothing to reuse in tiny_random's random text.)
        assert accepted > 0, "no draft token was ever accepted: the check proves little"


@pytest.mark.parametrize("name", per_method(METHODS))
def test_greedy_equals_ar_compiled(tiny_target, compiled_tiny_target, make_drafter, name):
    """``engine.compile=on``: every config's drafter over the compiled tiny target (decode and verify passes
    through torch.compile, targets/compiled.py) emits what the eager target's AR does, token for token."""
    prompts = [TRAIN_PROMPTS[1], UNSEEN_PROMPT]
    before = compiled_tiny_target.compile_stats()["compiled_passes"]
    check_greedy_equals_ar(compiled_tiny_target, make_drafter(name), prompts, 20)  # compiled spec == compiled AR
    # At least the AR steps ran compiled; verify passes too unless the method's pass is one the graphs leave eager
    # (ConFu's pinned soft prompts, SparseSpec-L's attention mass, SpecBound's own layer passes).
    assert compiled_tiny_target.compile_stats()["compiled_passes"] >= before + 2 * 19
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.0, stop_on_eos=False)
    for prompt in prompts:  # compiled AR == eager AR
        assert autoregressive_generate(compiled_tiny_target, prompt, cfg)[0] == \
            autoregressive_generate(tiny_target, prompt, cfg)[0]
    assert compiled_tiny_target.compile_stats()["recompiles"] == 0, compiled_tiny_target.compile_stats()


@pytest.mark.parametrize("name", per_method(METHODS))
def test_greedy_equals_ar_with_eos(tiny_target, make_drafter, name):
    # EOS can cut a round mid-path: the drafter must absorb a partial path (tiny_target's EOS ids).
    check_greedy_equals_ar(tiny_target, make_drafter(name), [TRAIN_PROMPTS[0]], 16, stop_on_eos=True)


def _drafter_block(name: str) -> str:
    block = spec(name).cfg.get("drafter")
    return json.dumps(None if block is None else OmegaConf.to_container(block, resolve=False), sort_keys=True,
                      default=str) + ("" if block is not None else name)  # no block: a drafter of its own


# One config per distinct drafter block: configs whose drafter block is identical (confu_no_moe and
# confu_no_moe_no_rep are ConFu's, eagle3_continue EAGLE-3's) differ only in how their draft was trained,
# and the law of the first round is a property of the drafter's code and settings, which the check runs
# once for each. Those variants still decode with their own weights in every greedy check above.
FIRST_ROUND_METHODS = [m for i, m in enumerate(METHODS) if _drafter_block(m) not in map(_drafter_block, METHODS[:i])]


@pytest.mark.parametrize("name", per_method(FIRST_ROUND_METHODS))
def test_first_round_follows_the_target(tiny_target, make_drafter, name):
    """Every drafter configuration, as configured, through the exact-null check of the first round's tokens."""
    check_first_round_law(tiny_target, make_drafter(name), first_round_prompt(tiny_target),
                          temperature=FIRST_ROUND_T, trials=FIRST_ROUND_TRIALS)


@pytest.mark.parametrize("name", per_method(m for m in METHODS if spec(m).trainable))
def test_artifact_round_trip(tiny_target, make_drafter, name, tmp_path):
    s = spec(name)
    make_drafter(name)  # trains once
    draft = _trained[name]
    path = s.save(draft, tmp_path / "artifact", tiny_target)
    loaded = s.load(path, tiny_target).float().eval()
    a, b = draft.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k].to(a[k].dtype), a[k], rtol=0, atol=0, msg=k)
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.0, stop_on_eos=False)
    ref, ref_stats = speculative_generate(tiny_target, UNSEEN_PROMPT, s.build_drafter(draft), cfg, trace=True)
    out, stats = speculative_generate(tiny_target, UNSEEN_PROMPT, s.build_drafter(loaded), cfg, trace=True)
    assert out == ref and stats.accept_lengths == ref_stats.accept_lengths
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(stats.trace, ref_stats.trace))


PINNED_LOSSES = Path(__file__).with_name("pinned_losses.json")


@pytest.mark.parametrize("name", [m for m in METHODS if spec(m).trainable])
def test_first_training_losses_are_pinned(tiny_target, name):
    """The first 4 losses of a seeded fresh draft on the tiny target, against the committed values: a change
    to a method's loss, data handling or initialisation shows here. ``DRAFTLAB_UPDATE_GOLDEN=1`` rewrites the
    file (review the diff: only intended changes may move these numbers)."""
    losses = first_losses(spec(name), tiny_target)
    pinned = json.loads(PINNED_LOSSES.read_text()) if PINNED_LOSSES.exists() else {}
    if os.environ.get("DRAFTLAB_UPDATE_GOLDEN") == "1":
        # Each call rewrites the whole file: parallel workers would drop each other's entries.
        assert int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) == 1, "update the pinned losses with -n 0"
        pinned[name] = losses
        PINNED_LOSSES.write_text(json.dumps(dict(sorted(pinned.items())), indent=1) + "\n")
    assert name in pinned, f"no pinned losses for {name}: run with DRAFTLAB_UPDATE_GOLDEN=1 and commit the file"
    # Relative 1e-4: float32 sums on another CPU round differently; any change of the loss itself moves more.
    assert losses == pytest.approx(pinned[name], rel=1e-4), (name, losses, pinned[name])
    assert losses[-1] < losses[0], "the first steps did not lower the loss"


def _drafter_of(name: str) -> tuple:
    d = spec(name).block("drafter")
    return d.get("_target_"), d.get("learned_target")


# One method per drafter class on SmolLM2: variants that only change training (a continued draft, an
# ablation, on-policy training of a base's draft) decode through the same code, which the tiny-target
# checks above run with each variant's own trained weights.
# Block drafters built on DFlash's (DFlash2's selector walk, DSpark's Markov head) run DFlash's block pass and
# context bookkeeping unchanged and differ only in how the slots become a tree (``_proposal``), which never
# touches the target: DFlash's SmolLM2 run covers their target path, the tiny-target checks their walks
# (``test_block_successors_meet_the_target_through_dflash_code`` keeps the claim true).
SAME_TARGET_PATH = {"dflash2": "dflash", "dspark": "dflash"}
_OWN_DRAFT_FIRST = sorted(METHODS, key=lambda m: spec(m).base is not None)
SMOLLM2_METHODS = sorted(m for i, m in enumerate(_OWN_DRAFT_FIRST)
                         if _drafter_of(m) not in {_drafter_of(o) for o in _OWN_DRAFT_FIRST[:i]}
                         and m not in SAME_TARGET_PATH)


def test_block_successors_meet_the_target_through_dflash_code():
    from hydra.utils import get_class

    for name, base in SAME_TARGET_PATH.items():
        cls, base_cls = (get_class(spec(m).block("drafter")["_target_"]) for m in (name, base))
        assert issubclass(cls, base_cls) and base in SMOLLM2_METHODS
        for member in ("propose", "_block_pass", "reset", "update", "taps", "check_compatible", "_append"):
            assert getattr(cls, member) is getattr(base_cls, member), f"{name} overrides {member}: give it a SmolLM2 run"


# The Spec-Bench prompts (last 192 tokens, by index in the category round-robin) every method decodes on
# SmolLM2, each there for a path: extraction copies spans of its prompt (lookup and hybrid drafts accepted,
# suffix trees built from the request), coding rarely does (drafts rejected, lookups that find nothing).
SMOLLM2_PROMPTS = {1: "extraction: copied spans, drafts accepted", 0: "coding: drafts rejected, empty lookups"}


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOLLM2_METHODS)
def test_greedy_equals_ar_specbench_smollm2(smollm2, shared_data, name):
    from tests.decoding.test_engine_model import _specbench_prompts

    s = spec(name)
    everything = _specbench_prompts(shared_data, smollm2.tokenizer, max(SMOLLM2_PROMPTS) + 1)
    prompts = [everything[i][-192:] for i in SMOLLM2_PROMPTS]
    # 4 steps: enough for an EAGLE-3 draft to be accepted on these prompts (measured: 6 tokens; 10 steps: 4)
    draft = quick_train(s, smollm2, steps=4) if s.trainable else None
    check_greedy_equals_ar(smollm2, (lambda: s.build_drafter(draft)) if s.trainable else s.build_drafter,
                           prompts, 32, fixed_target=True)


# Methods whose drafter sizes its trees (``drafter.tree: fixed | auto``): with ``auto`` every round's tree is
# chosen from the measured verify cost of the target and the draft's scores, and it must still be lossless.
# One method per drafter class (variants that only change training share the drafter's code path).
AUTO_TREE = [m for m in METHODS if OmegaConf.select(spec(m).cfg, "drafter.tree", default=None) is not None]
AUTO_TREE = [m for i, m in enumerate(AUTO_TREE) if _drafter_of(m) not in {_drafter_of(o) for o in AUTO_TREE[:i]}]


def _auto(name: str, draft):
    s = copy.deepcopy(spec(name))
    OmegaConf.update(s.cfg, "drafter.tree", "auto")
    drafter = s.build_drafter(draft) if s.trainable else s.build_drafter()
    return drafter


@pytest.mark.parametrize("name", per_method(["eagle3"]))
def test_first_round_follows_the_target_compiled(compiled_tiny_target, make_drafter, name):
    """The same exact-null check with the target's passes compiled (``engine.compile=on``): sampling through
    the compiled verify pass still draws from the target's law. One tree drafter with draft laws stands for
    all: the compiled pass changes the target's logits path, not the drafters'."""
    check_first_round_law(compiled_tiny_target, make_drafter(name), first_round_prompt(compiled_tiny_target),
                          temperature=FIRST_ROUND_T, trials=FIRST_ROUND_TRIALS)
    assert compiled_tiny_target.compile_stats()["compiled_passes"] > FIRST_ROUND_TRIALS


def test_the_first_round_check_covers_every_drafter_configuration():
    assert {"confu", "dflash", "draft_opd", "eagle3", "specbound", "ssd", "ssd_eagle3", "sparsespec_l"} <= \
        set(FIRST_ROUND_METHODS)
    assert {_drafter_block(m) for m in METHODS} == {_drafter_block(m) for m in FIRST_ROUND_METHODS}


def test_every_tree_building_method_offers_auto():
    assert {"eagle3", "confu", "suffix", "eagle3_suffix", "dflash"} <= set(AUTO_TREE)


def _budgets(drafter) -> list:
    """The TreeBudget objects of a drafter and its components (EAGLE-3 inside ConFu, the hybrid's parts)."""
    parts = [drafter] + [getattr(drafter, a) for a in ("tree", "learned", "lookup") if hasattr(drafter, a)]
    return [p.budget for p in parts if isinstance(getattr(p, "budget", None), TreeBudget)]


# Verify costs for ``tree: auto`` (seconds: 0.01 + per_row * (rows - 1)): free rows grow the capped tree wherever
# the draft gives a node any chance; sloped rows make the first node pay only when its path probability is above
# ~0.005 (times the budget's calibration), which a few-step draft's scores straddle, so rounds are cut at
# different sizes; rows that cost ten steps never pay.
PER_ROW = {"cheap": 0.0, "sloped": 5e-5, "dear": 0.1}


@pytest.mark.parametrize("rows", list(PER_ROW))
@pytest.mark.parametrize("name", per_method(AUTO_TREE))
def test_auto_tree_greedy_equals_ar_and_sampling_follows_the_target(tiny_target, make_drafter, name, rows):
    """``tree: auto`` with a given verify cost (a timed curve would make the trees depend on the machine's
    load): greedy output equals AR at every cost; with sloped rows the cut really happens and the first
    round's tokens still follow the target (the powered check)."""
    make_drafter(name)  # trains once (trainable methods)
    draft = _trained.get(name)
    sizes, seen = [], []

    def fresh():
        drafter = _auto(name, draft)
        budgets = _budgets(drafter)
        assert budgets, "tree: auto built no TreeBudget"
        for b in budgets:
            b.cost, b.fixed_level, b._level_s = VerifyCost.linear(0.01, PER_ROW[rows]), 0.0, 0.0
            sizes.append(b.sizes)
        seen.extend(budgets)
        return drafter

    accepted = check_greedy_equals_ar(tiny_target, fresh, [TRAIN_PROMPTS[1], UNSEEN_PROMPT], 20)
    # Every budget that sized a round was told the context it verifies over (its cost curve is indexed by it).
    assert all(b.context and b.context > 1 for b in seen if b.sizes), "a budget planned blind to the context"
    chosen = [n for s in sizes for n in s]
    if rows == "dear":
        assert all(n == 0 for n in chosen), "rows at ten AR steps each should never pay"
        return
    # (Training-free lookups find little to reuse in tiny_random's random text: only the learned drafts are
    # held to proposing and to being cut.)
    if rows == "cheap":
        if spec(name).trainable:
            assert any(n > 0 for n in chosen), "no round verified a draft node"
            assert accepted > 0, "no draft token was ever accepted: the check proves little"
        return
    check_first_round_law(tiny_target, fresh, first_round_prompt(tiny_target), temperature=FIRST_ROUND_T,
                          trials=FIRST_ROUND_TRIALS)
    chosen = [n for s in sizes for n in s]
    if spec(name).trainable:
        assert len(set(chosen)) > 1 and max(chosen) > 0, f"sloped rows gave sizes {set(chosen)}: no cut exercised"


@pytest.mark.parametrize("name", per_method(METHODS))
def test_outcome_drafter_drafts_after_any_sequence(tiny_target, make_drafter, name):
    """``Drafter.outcome_drafter``: None (drafts only from verified state), or an ``OutcomeDrafter`` whose chain, glue pass,
    branches and portable copy agree with each other (greedy), each told the verified prompt the same way
    (``absorb(verified(state))``: the target's features of its rows for a feature draft, nothing for a draft model)."""
    from contextlib import closing

    from draftlab.decoding.drafter import DecodeState
    from draftlab.decoding.outcome_drafter import DraftsOutcomes, OutcomeDrafter, Sampling
    from draftlab.targets.base import PassRequest

    with closing(make_drafter(name)()) as drafter:
        if not isinstance(drafter, DraftsOutcomes):
            return
        spec = drafter.outcome_drafter(tiny_target)
        assert isinstance(spec, OutcomeDrafter)
        greedy, ctx = Sampling(0.0), list(TRAIN_PROMPTS[1])
        taps = drafter.taps(tiny_target)
        aux = None
        if taps is not None:  # the prefill over the prompt (the context before its root) with the drafter's taps
            ids = torch.tensor([ctx[:-1]], device=tiny_target.device)
            aux = tiny_target.forward(ids, request=PassRequest(aux=taps)).aux_hidden[0]  # [P, n_taps*d]
        state = DecodeState(target=tiny_target, cache=None, tokens=ctx, prompt_len=len(ctx) - 1, temperature=0.0,
                            accepted_aux=aux)
        verified = spec.verified(state)
        spec.absorb(verified)
        chain = spec.chain(ctx, 3, greedy).tokens
        assert len(chain) == 3
        copy = spec.portable()()
        copy.absorb(verified)
        assert copy.chain(ctx, 3, greedy).tokens == chain  # an independent copy drafts the same
        z = spec.glue(ctx, chain)  # [4, V]
        assert z.shape[0] == 4 and z[:3].argmax(-1).tolist() == chain
        a, b = spec.branches([(0, chain[0]), (3, 5)], 2, greedy)
        assert a.tokens == chain[1:3]  # branching at the drafted token continues the chain
        assert b.tokens == copy.chain(ctx + chain + [5], 2, greedy).tokens
