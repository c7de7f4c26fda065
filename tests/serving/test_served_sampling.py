"""Served parity at T > 0 (``draftlab.eval.served_sampling``): seeded sampled requests to a stand-in engine,
acceptance compared as distributions with a cluster bootstrap over prompts, the verdict both ways with the
pattern's hint, interval coverage on a known case, and ``eval.temperature`` reaching the sampled branch of
``served_evaluate`` (stub servers through ``eval.served.urls``, a fake draftlab side)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from stub_metrics import SpecStub

from draftlab.eval import served, served_sampling
from draftlab.eval.served_metrics import ChainAnswer, SpecCounters, chain_counters
from draftlab.eval.served_sampling import (
    cluster_bootstrap,
    draftlab_seeded,
    format_sampled,
    pattern_of,
    query_seeded,
    sampled_compare,
    sampled_metrics,
    seed_list,
)
from draftlab.utils.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
PROMPTS = [f"prompt {i}" for i in range(12)]
SEEDS = [0, 1, 2]
ROUNDS = 20  # draft rounds per answer


def _rounds(rng: random.Random, cond: tuple[float, ...], n: int = ROUNDS) -> list[int]:
    """Accepted drafts per round of a chain: position i accepted with probability cond[i] once reached."""
    out = []
    for _ in range(n):
        a = 0
        while a < len(cond) and rng.random() < cond[a]:
            a += 1
        out.append(a)
    return out


def _ease(prompt: str) -> float:
    return 0.6 + 0.4 * (int(prompt.split()[-1]) % 4) / 3  # prompts differ in how easy they are to draft


def _scaled(cond: tuple[float, ...], prompt: str) -> tuple[float, ...]:
    return tuple(c * _ease(prompt) for c in cond)


def _served_draw(cond: tuple[float, ...]):
    def draw(prompt: str, request: dict) -> list[int]:
        return _rounds(random.Random(f"served/{prompt}/{request.get('seed')}"), _scaled(cond, prompt))
    return draw


def _draftlab(cond: tuple[float, ...], prompts=PROMPTS, seeds=SEEDS, rule="deterministic", k=3) -> dict:
    """A fake draftlab side: the same chain model drawn with its own randomness, counted as draftlab counts."""
    counters = [[chain_counters([a + 1 for a in _rounds(random.Random(f"draftlab/{p}/{s}"), _scaled(cond, p))], k)
                 for s in seeds] for p in prompts]
    return {"counters": counters, "tokens": [[[s, len(p)] for s in seeds] for p in prompts], "rule": rule}


def _served(cond: tuple[float, ...], *, ignore_temperature=False, temperature=0.7) -> tuple[dict, list[dict]]:
    with SpecStub(k=3, draw=_served_draw(cond), ignore_temperature=ignore_temperature) as stub:
        side = query_seeded(stub.url, PROMPTS, temperature=temperature, seeds=SEEDS, max_tokens=16, model="target",
                            settle=0.01)
    return side, stub.requests


BASE = (0.7, 0.5, 0.4)


def test_sampled_requests_carry_temperature_seed_and_neutral_sampling_fields():
    side, requests = _served(BASE)
    assert len(requests) == len(PROMPTS) * len(SEEDS)
    assert {r["seed"] for r in requests} == set(SEEDS)
    for r in requests:  # no field left for the server's generation_config to fill
        assert r["temperature"] == 0.7 and r["top_p"] == 1.0 and r["top_k"] == -1
        assert r["min_p"] == 0.0 and r["repetition_penalty"] == 1.0 and r["return_token_ids"] is True
    # [prompt][seed], each answer's own counter delta
    rounds = _served_draw(BASE)(PROMPTS[2], {"seed": 1})
    c = side["counters"][2][1]
    assert (c.drafts, c.accepted) == (ROUNDS, sum(rounds))
    assert side["hit"] == len(PROMPTS) * len(SEEDS)  # every stub answer is cut at max_tokens
    assert served_sampling.varied(side["tokens"]) == len(PROMPTS)


def test_same_acceptance_distribution_agrees():
    side, _ = _served(BASE)
    rec = sampled_compare(side, _draftlab(BASE), k=3, temperature=0.7, seeds=SEEDS, resamples=1000)
    assert rec["verdict"] == "agree" and rec["causes"] == [] and rec["pattern"] is None
    gaps = rec["gaps"]
    assert all(e["ci"][0] <= 0 <= e["ci"][1] for e in [gaps["tau"], *gaps["positions"]])
    assert rec["served"]["tau"] != rec["draftlab"]["tau"]  # different draws: outputs and counts differ
    assert "agree within noise" in format_sampled(rec)
    assert rec["n_prompts"] == 12 and rec["seeds"] == SEEDS and len(rec["served"]["position_ci"]) == 3


def test_served_accepting_far_more_at_position_1_differs_and_names_it():
    side, _ = _served((0.7, 0.95, 0.4))
    rec = sampled_compare(side, _draftlab((0.7, 0.3, 0.4), rule="sampled"), k=3, temperature=0.7, seeds=SEEDS,
                          resamples=1000)
    assert rec["verdict"] == "differ" and rec["pattern"] == "deeper positions"
    assert rec["gaps"]["positions"][1]["ci"][0] > 0 and rec["gaps"]["tau"]["gap"] > 0
    # position 0 is the same chain model on both sides: its conditional gap stays within noise
    c0 = rec["gaps"]["conditional"][0]["ci"]
    assert c0[0] <= 0 <= c0[1]
    text = format_sampled(rec)
    assert "DIFFER (deeper positions; served more)" in text
    assert "different lossless rules" in text and "draft_sample_method" in text  # draftlab sampled its drafts
    assert "draft's own context" in text
    assert sampled_metrics([rec])["eval/served/k3/t0.7/differ"] == 1.0


def test_a_shift_at_position_0_only_is_told_apart_from_a_deeper_one():
    side, _ = _served((0.95, 0.5, 0.4))
    rec = sampled_compare(side, _draftlab((0.35, 0.5, 0.4)), k=3, temperature=0.7, seeds=SEEDS, resamples=1000)
    assert rec["verdict"] == "differ" and rec["pattern"] == "position 0 only"
    assert any("first draft position" in c for c in rec["causes"])
    assert any("one rule" in c for c in rec["causes"])  # argmax drafts both sides: not the rule
    # every unconditional rate moved (position 0 carries into the rest); the conditional ones did not
    assert all(e["ci"][0] > 0 for e in rec["gaps"]["positions"])


def test_a_server_that_ignores_the_temperature_is_named():
    side, _ = _served((0.95, 0.9, 0.8), ignore_temperature=True)
    rec = sampled_compare(side, _draftlab(BASE), k=3, temperature=0.7, seeds=SEEDS, resamples=500)
    assert rec["served"]["varied"] == 0 and rec["draftlab"]["varied"] == len(PROMPTS)
    assert rec["verdict"] == "differ" and "decoded greedily" in rec["causes"][0]


def test_bootstrap_intervals_cover_a_known_truth():
    """Rounds from a known chain model (same for every prompt): τ = 1 + 0.7 + 0.7·0.5 + 0.7·0.5·0.3; the side's
    95% interval must hold it in most replications, and the gap's (same model both sides) must hold 0."""
    cond, truth = (0.7, 0.5, 0.3), 1 + 0.7 + 0.35 + 0.105
    truth_rates = [0.7, 0.35, 0.105]
    tau_in = rate_in = zero_in = 0
    reps = 40
    for rep in range(reps):
        rng = random.Random(rep)
        sides = [[[chain_counters([a + 1 for a in _rounds(rng, cond, 8)], 3) for _ in SEEDS] for _ in range(15)]
                 for _ in range(2)]
        boot = cluster_bootstrap(*sides, k=3, resamples=400, seed=rep)
        lo, hi = boot["served"]["tau_ci"]
        tau_in += lo <= truth <= hi
        rate_in += all(c[0] <= t <= c[1] for c, t in zip(boot["served"]["position_ci"], truth_rates))
        zero_in += all(e["ci"][0] <= 0 <= e["ci"][1] for e in [boot["gaps"]["tau"], *boot["gaps"]["positions"]])
    assert tau_in >= 0.8 * reps and rate_in >= 0.7 * reps and zero_in >= 0.85 * reps
    # a degenerate case: identical prompts, every resample the same, the interval a point at the truth
    same = [[SpecCounters(10.0, 30.0, 15.0, (8.0, 5.0, 2.0))] for _ in range(5)]
    point = cluster_bootstrap(same, same, k=3, resamples=50)
    assert point["served"]["tau_ci"] == [2.5, 2.5] and point["gaps"]["tau"]["ci"] == [0.0, 0.0]
    assert point["served"]["conditional_rates"] == pytest.approx([0.8, 5 / 8, 2 / 5])


def test_pattern_reads_conditional_gaps_first():
    def e(lo, hi):
        return {"gap": (lo + hi) / 2, "ci": [lo, hi]}

    inside, above = e(-0.1, 0.1), e(0.1, 0.3)
    gaps = {"tau": above, "positions": [above, above], "conditional": [inside, above]}
    assert pattern_of(gaps) == "deeper positions"
    assert pattern_of(gaps | {"conditional": [above, above]}) == "position 0 and deeper"
    assert pattern_of({"tau": above, "positions": [inside], "conditional": [inside]}) == "tau only"
    assert pattern_of({"tau": inside, "positions": [inside], "conditional": [inside]}) is None


def test_seeds_setting_is_a_count_or_a_list():
    assert seed_list(3) == [0, 1, 2] and seed_list([7, 11]) == [7, 11]
    for bad in (0, [], [1, 1], "3", [1.5], True):
        with pytest.raises(ConfigError, match="eval.served.seeds"):
            seed_list(bad)


def test_draftlab_side_samples_per_seed_and_reports_its_rule(tiny_target):
    from draftlab.methods.dflash import DFlashDrafter, build_draft

    draft = build_draft(tiny_target, num_layers=1, block_size=4, seed=0)
    prompts = ["Hello there", "Name a colour"]
    kw = dict(k=3, max_tokens=8, temperature=1.0, seeds=[0, 1])
    sampled = draftlab_seeded(tiny_target, DFlashDrafter(draft, sampling="sample"), prompts, **kw)
    assert sampled["rule"] == "sampled" and len(sampled["counters"]) == 2 and len(sampled["counters"][0]) == 2
    assert all(c.drafts > 0 and c.draft_tokens == 3 * c.drafts for row in sampled["counters"] for c in row)
    assert served_sampling.varied(sampled["tokens"]) == 2  # seeds give different answers at T = 1
    again = draftlab_seeded(tiny_target, DFlashDrafter(draft, sampling="sample"), prompts, **kw)
    assert again["tokens"] == sampled["tokens"]  # a seed fixes the answer
    argmax = draftlab_seeded(tiny_target, DFlashDrafter(draft, sampling="argmax"), prompts[:1], **kw)
    assert argmax["rule"] == "deterministic"


# -- the config path: eval.temperature > 0 reaches the sampled branch of served_evaluate --------------------

def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="eval", overrides=overrides)


def _fake_draftlab(monkeypatch, cond):
    closed = []
    drafter = SimpleNamespace(close=lambda: closed.append(1))

    def chain(target, drafter_, prompts, *, k, max_tokens):  # the greedy side, as draftlab_chain returns it
        if drafter_ is not None:
            drafter_.close()
        return [ChainAnswer([], [ord(c) for c in ("echo: " + p)[:max_tokens]], 1.0,
                            chain_counters([2] * 5, k) if drafter_ is not None else SpecCounters(), 1.0)
                for p in prompts]

    def seeded(target, drafter_, prompts, *, k, max_tokens, temperature, seeds, top_p=None, top_k=None):
        drafter_.close()
        return _draftlab(cond, prompts, seeds, k=k) | {"temperature": temperature}

    monkeypatch.setattr(served, "_prompts", lambda cfg, s, tok: ("specbench", PROMPTS[:6]))
    monkeypatch.setattr(served, "chain_drafter", lambda cfg, draft, chain_: drafter)
    monkeypatch.setattr(served, "draftlab_chain", chain)
    monkeypatch.setattr(served_sampling, "draftlab_seeded", seeded)
    return closed


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_eval_temperature_reaches_the_sampled_branch(temperature, monkeypatch, tmp_path):
    from draftlab.methods.registry import MethodSpec

    closed = _fake_draftlab(monkeypatch, BASE)
    greedy_plan = lambda p: [1] * 5  # noqa: E731  (T = 0: the same rounds as the fake draftlab chain)
    with SpecStub(k=3) as plain, SpecStub(k=3, plan=greedy_plan, draw=lambda p, r: (
            _served_draw(BASE)(p, r) if r["temperature"] > 0 else greedy_plan(p))) as spec_stub:
        cfg = _compose(["eval.engine=vllm", "method=eagle3", f"eval.temperature={temperature}",
                        f"eval.served.urls={{plain: '{plain.url}', spec: '{spec_stub.url}'}}",
                        "eval.served.seeds=[0,1,2]", "eval.served.bootstrap=300", "eval.served.max_tokens=16"])
        target = SimpleNamespace(tokenizer=None, name="tiny", eos_token_ids=[0],
                                 model=SimpleNamespace(config=SimpleNamespace(_name_or_path="tiny")))
        artifact = SimpleNamespace(draft=object(), dir=tmp_path / "draft", trained_config=None)
        record, metrics = served.served_evaluate(cfg, target, artifact, tmp_path, MethodSpec(cfg.method))
        requests = list(spec_stub.requests)
    text = (tmp_path / "served_comparison.txt").read_text()
    assert record["served"][0]["parity"]["flagged"] is False  # the T = 0 comparison runs either way
    if temperature == 0:
        assert "served_sampled" not in record and not any(re.search(r"/t\d", key) for key in metrics)
        assert all(r["temperature"] == 0.0 and "seed" not in r for r in requests) and len(requests) == 6
        assert "T=0.7" not in text
        return
    (entry,) = record["served_sampled"]
    assert entry["temperature"] == 0.7 and entry["seeds"] == SEEDS and entry["num_speculative_tokens"] == 3
    assert set(entry) >= {"served", "draftlab", "gaps", "verdict", "causes", "n_prompts"}
    assert set(entry["served"]) >= {"tau", "tau_ci", "position_rates", "position_ci"}
    assert entry["verdict"] == "agree" and len(closed) == 2  # the greedy chain's drafter and the sampled one's
    assert {r["seed"] for r in requests if r["temperature"] == 0.7} == set(SEEDS)
    assert len(requests) == 6 + 6 * 3
    assert metrics["eval/served/k3/t0.7/tau"] == pytest.approx(entry["served"]["tau"])
    assert metrics["eval/served/k3/t0.7/differ"] == 0.0 and "eval/served/k3/tau" in metrics
    assert "Served vs draftlab acceptance at T=0.7: 6 prompts x 3 seeds" in text
