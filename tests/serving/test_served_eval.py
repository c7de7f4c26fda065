"""Served evaluation (``draftlab.eval.served``) against a stand-in engine with spec-decode counters: τ from
``/metrics`` deltas, identical outputs, the parity check, ``eval.engine`` composition and dispatch; and an
opt-in run of the real thing with vLLM (marker ``serving``, skipped unless ``DRAFTLAB_VLLM_PYTHON`` is set)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from stub_metrics import SpecStub

from draftlab.eval import served
from draftlab.eval.served_metrics import (
    ChainAnswer,
    ServedAnswer,
    SpecCounters,
    chain_counters,
    compare,
    format_chains,
    format_served,
    parity_check,
    parse_spec_counters,
    query_server,
)
from draftlab.utils.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
PROMPTS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]


def test_counters_parse_prometheus_text_and_ignore_created_twins():
    with SpecStub(k=3, start_counts=(10, 4)) as stub:
        stub.count([3, 1, 0, 2])
        c = parse_spec_counters(stub.metrics())
    assert (c.drafts, c.draft_tokens, c.accepted) == (14.0, 42.0, 10.0)
    assert c.per_pos == (4.0 + 3, 2.0, 1.0)
    # two engines' label sets add up
    two = parse_spec_counters(stub.metrics() + stub.metrics().replace('engine="0"', 'engine="1"'))
    assert two.drafts == 28.0 and two.per_pos == (14.0, 4.0, 2.0)


def test_tau_from_counter_deltas_per_prompt_and_per_run():
    plan = {p: [i % 4, 3, 0][: 1 + i % 3] for i, p in enumerate(PROMPTS)}  # accepted per round, per prompt
    # earlier traffic in the counters, and counters recorded after the answer (lag): only deltas may count
    with SpecStub(k=3, plan=plan.__getitem__, lag=0.05, start_counts=(100, 90)) as stub:
        answers, run = query_server(stub.url, PROMPTS, max_tokens=8, model="target", settle=0.15)
    for prompt, a in zip(PROMPTS, answers):
        rounds = plan[prompt]
        assert a.counters.drafts == len(rounds) and a.counters.accepted == sum(rounds)
        assert a.counters.tau == pytest.approx(1 + sum(rounds) / len(rounds))
        assert a.token_ids == [ord(ch) for ch in ("echo: " + prompt)[:8]] and a.tps > 0
    everything = [r for p in PROMPTS for r in plan[p]]
    assert run.tau == pytest.approx(1 + sum(everything) / len(everything))  # vLLM: 1 + accepted / drafts
    assert run.position_rates == pytest.approx([sum(r > i for r in everything) / len(everything) for i in range(3)])
    assert run.draft_tokens == 3 * run.drafts


def test_served_requests_and_draftlab_side_show_progress_per_prompt(capsys, tiny_target):
    from draftlab.eval.served_metrics import draftlab_chain

    with SpecStub(k=3) as stub:
        query_server(stub.url, PROMPTS, max_tokens=8, model="target", settle=0.01, desc="vllm k=3")
    draftlab_chain(tiny_target, None, PROMPTS[:2], k=0, max_tokens=4)
    err = capsys.readouterr().err
    assert "vllm k=3: 100%" in err and f"{len(PROMPTS)}/{len(PROMPTS)}" in err
    assert "draftlab AR: 100%" in err and "2/2" in err


def test_chain_counters_count_draftlab_rounds_as_vllm_does():
    c = chain_counters([4, 1, 2, 1], k=3)  # accept lengths include the bonus token
    assert (c.drafts, c.draft_tokens, c.accepted, c.per_pos) == (4.0, 12.0, 4.0, (2.0, 1.0, 1.0))
    assert c.tau == pytest.approx(2.0)  # = DecodeStats.tau: 8 tokens / 4 rounds


def _chain(plan, prompts, ids=None):
    return [ChainAnswer(list(map(ord, p)), ids[p] if ids else [ord(c) for c in "echo: " + p][:8], 1.0,
                               chain_counters([a + 1 for a in plan(p)], 3)) for p in prompts]


def test_identical_outputs_are_counted_against_plain_and_draftlab():
    plan = lambda p: [1, 2]  # noqa: E731
    with SpecStub(k=3) as plain_stub, SpecStub(k=3, plan=plan, changed={"bravo", "echo"}) as spec_stub:
        plain, _ = query_server(plain_stub.url, PROMPTS, max_tokens=8, model="target", settle=0.01)
        spec, _ = query_server(spec_stub.url, PROMPTS, max_tokens=8, model="target", settle=0.01)
    rec = compare(plain, spec, _chain(plan, PROMPTS), k=3, resamples=200)
    assert rec["identical_to_plain"] == 4
    assert rec["same_tokens_as_draftlab"] == 4 and rec["same_prompt_ids"] == 6
    assert rec["served"]["tau"] == rec["draftlab"]["tau"] == pytest.approx(2.5)
    assert "identical to vllm plain: 4/6" in format_served(rec)


def test_speedups_are_aggregate_token_rates_side_by_side():
    def ans(tokens, seconds):
        return ServedAnswer(None, "", None, seconds, tokens / seconds, SpecCounters(), tokens)

    def run(tokens, seconds):
        return ChainAnswer([], [0] * tokens, tokens / seconds, SpecCounters(), seconds)

    plain, spec = [ans(10, 1.0), ans(30, 1.0)], [ans(10, 0.5), ans(30, 1.5)]  # Σ 40 / 2 s vs Σ 40 / 2 s
    ar, chain = [run(10, 2.0), run(10, 2.0)], [run(10, 1.0), run(10, 1.0)]
    rec = compare(plain, spec, chain, k=3, resamples=50, ar=ar)
    assert rec["speed"]["served_speedup"] == pytest.approx(1.0)  # per-prompt means would say 1.33
    assert rec["speed"]["draftlab_speedup"] == pytest.approx(2.0)
    assert compare(plain, spec, chain, k=3, resamples=50)["speed"]["draftlab_speedup"] is None
    rec2 = compare(plain, spec, chain, k=2, resamples=50, ar=ar)
    lines = format_chains([rec2, rec]).splitlines()
    assert len(lines) == 3 and lines[1].split()[0] == "2" and lines[2].split()[-2:] == ["1.00", "2.00"]


def test_a_gap_from_acceptances_past_max_tokens_is_named_not_flagged_as_a_convention():
    def ans(accepted, drafts=30):
        return ServedAnswer(None, "", None, 1.0, 8.0, SpecCounters(float(drafts), 3.0 * drafts, float(accepted), ()), 8)

    def run(accepted, n_tokens=8, drafts=30):
        return ChainAnswer([], [0] * n_tokens, 8.0, SpecCounters(float(drafts), 3.0 * drafts, float(accepted), ()), 1.0)

    # the engine counts one more accepted token in the last round of every prompt that hit the limit
    spec, chain = [ans(a + 1) for a in (10, 12, 9, 11, 10, 13)], [run(a) for a in (10, 12, 9, 11, 10, 13)]
    rec = compare(spec, spec, chain, k=3, resamples=200, max_tokens=8)
    assert rec["parity"]["flagged"] and rec["parity"]["last_round_excess"] == {"prompts": 6, "tokens": 6}
    text = format_served(rec)
    assert "past max_tokens" in text and "aux layer ids" not in text
    # not explained: a prompt that stopped early, more rounds on one side, or more than k extra
    for bad_chain, bad_spec in (([run(a, n_tokens=5) for a in (10, 12, 9, 11, 10, 13)], spec),
                                (chain, [ans(a + 1, drafts=31) for a in (10, 12, 9, 11, 10, 13)]),
                                (chain, [ans(a + 4) for a in (10, 12, 9, 11, 10, 13)])):
        other = compare(bad_spec, bad_spec, bad_chain, k=3, resamples=200, max_tokens=8)
        assert other["parity"]["last_round_excess"] is None and "aux layer ids" in format_served(other)


def _counters(rates: list[tuple[int, int]]) -> list[SpecCounters]:
    return [SpecCounters(float(d), 3.0 * d, float(a), ()) for a, d in rates]


def test_parity_flags_a_planted_gap_and_not_equal_rates():
    trained = _counters([(40, 30), (35, 30), (50, 32), (28, 30), (45, 31), (38, 30)])
    same = parity_check(trained, _counters([(40, 30), (35, 30), (50, 32), (28, 30), (45, 31), (38, 30)]))
    assert not same.flagged and same.gap == 0.0 and same.ci == (0.0, 0.0)
    # the served draft accepts about a third as much on every prompt (a convention read differently)
    low = parity_check(_counters([(13, 30), (12, 30), (16, 32), (9, 30), (15, 31), (13, 30)]), trained)
    assert low.flagged and low.ci[1] < 0 and low.gap == pytest.approx(low.served_tau - low.draftlab_tau)
    # noise: prompts that disagree both ways do not flag
    noisy = parity_check(_counters([(45, 30), (30, 30), (55, 32), (25, 30), (40, 31), (42, 30)]), trained)
    assert not noisy.flagged and noisy.ci[0] < 0 < noisy.ci[1]


def test_flagged_report_prints_the_checklist():
    plan_served, plan_trained = (lambda p: [0, 0, 1]), (lambda p: [3, 2, 3])
    with SpecStub(k=3) as plain_stub, SpecStub(k=3, plan=plan_served) as spec_stub:
        plain, _ = query_server(plain_stub.url, PROMPTS, max_tokens=8, model="target", settle=0.01)
        spec, _ = query_server(spec_stub.url, PROMPTS, max_tokens=8, model="target", settle=0.01)
    text = format_served(compare(plain, spec, _chain(plan_trained, PROMPTS), k=3, resamples=200))
    assert "GAP beyond noise" in text and "aux layer ids" in text and "d2t" in text and "rope" in text
    equal = format_served(compare(plain, spec, _chain(plan_served, PROMPTS), k=3, resamples=200))
    assert "no gap beyond noise" in equal and "aux layer ids" not in equal


def _compose(overrides, name="eval"):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_eval_engine_composes_with_served_settings():
    cfg = _compose(["eval.engine=vllm", "eval.served.num_speculative_tokens=4", "method=eagle3"])
    assert served.check_engine(cfg) == "vllm"
    s = served.served_settings(cfg)
    assert s["chain"] == {"branching": 1, "depth": 4, "nodes": 4} and s["max_tokens"] == 64
    assert set(cfg.eval.served) == set(served.DEFAULTS)  # conf/eval.yaml and the code defaults agree
    train = _compose(["eval.engine=vllm"], name="train")  # a train run has no served block: code defaults
    assert served.served_settings(train)["chain"]["depth"] == 3
    dflash = _compose(["eval.engine=vllm", "eval.served.num_speculative_tokens=5", "method=dflash"])
    assert served.served_settings(dflash)["chain"] == {"block_size": 6}  # the method's chain: k + 1 slots
    several = _compose(["eval.engine=vllm", "eval.served.num_speculative_tokens=[1,3]", "method=dflash"])
    assert served.served_settings(several)["chains"] == {1: {"block_size": 2}, 3: {"block_size": 4}}
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        served.check_engine(_compose(["eval.engine=vllm", "eval.served.num_speculative_tokens=[2,0]"]))
    with pytest.raises(ConfigError, match="several lengths"):
        served.check_engine(_compose(["eval.engine=vllm", "eval.served.num_speculative_tokens=[1,2]",
                                      "eval.served.chain={branching: 1}"]))
    assert served.serve_plan(dflash, "vllm") == {"format": "dflash", "method": "dflash"}
    assert served.serve_plan(cfg, "sglang") == {"format": "sglang", "method": "EAGLE3"}
    given = _compose(["eval.engine=vllm", "method=eagle3", "eval.served.chain={branching: 2, depth: 3, nodes: 5}"])
    assert served.served_settings(given)["chain"] == {"branching": 2, "depth": 3, "nodes": 5}
    with pytest.raises(ConfigError, match=r"no way for vllm to serve.*conf/method/confu.yaml"):
        served.check_engine(_compose(["eval.engine=vllm", "method=confu"]))
    assert served.check_engine(_compose([], name="train")) == "draftlab"
    with pytest.raises(ConfigError, match="eval.engine"):
        served.check_engine(_compose(["eval.engine=tgi"]))
    with pytest.raises(ConfigError, match="eval.served"):
        served.check_engine(_compose(["eval.engine=vllm", "+eval.served.chian=1"]))


def test_evaluate_dispatches_on_eval_engine(monkeypatch, tmp_path):
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.evaluate import evaluate

    calls = []
    monkeypatch.setattr(served, "served_evaluate", lambda *a: calls.append(a) or ({"engine": "vllm"}, {}))
    cfg = _compose(["eval.engine=vllm", "method=eagle3"])
    artifact = object()  # the pipeline's DraftArtifact, passed through untouched
    spec = MethodSpec(cfg.method)
    assert evaluate(cfg, None, None, tmp_path, spec, artifact=artifact) == ({"engine": "vllm"}, {})
    assert [a[:4] for a in calls] == [(cfg, None, artifact, tmp_path)]
    assert calls[0][4] is spec  # the method spec, built once and passed down


def test_sglang_not_importable_fails_clearly_with_its_command(tmp_path):
    s = served.served_settings(_compose(["eval.engine=sglang", f"eval.served.python={sys.executable}"]))
    try:
        import sglang  # noqa: F401
        pytest.skip("sglang is importable here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="sglang is not importable") as err:
        served.require_engine("sglang", s, "/models/target", tmp_path / "draft", "eagle3")
    assert "sglang.launch_server" in str(err.value) and "--speculative-num-steps 3" in str(err.value)


VLLM_PYTHON = os.environ.get("DRAFTLAB_VLLM_PYTHON", "")


@pytest.mark.serving
@pytest.mark.timeout(2400)
@pytest.mark.skipif(not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
                    reason="no vLLM environment: set DRAFTLAB_VLLM_PYTHON to its python")
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_served_vs_draftlab_round_trip(method, tmp_path, shared_data):
    """Export, serve (vLLM: plain, then the draft as chains of 1 and 3; a minute or more per launch on CPU) and
    compare with draftlab's chains: a trained draft from the artifact cache, or DRAFTLAB_VLLM_ARTIFACT_<METHOD>."""
    from draftlab.stages.pipeline import run_pipeline

    artifact = os.environ.get(f"DRAFTLAB_VLLM_ARTIFACT_{method.upper()}") or str(
        next(Path(f"~/.cache/draftlab/artifacts/{method}").expanduser().glob("*/draft"), ""))
    if not artifact:
        pytest.skip(f"no trained {method} artifact: train one or set DRAFTLAB_VLLM_ARTIFACT_{method.upper()}")
    cfg = _compose([f"method={method}", f"draft_path={artifact}", "eval.engine=vllm", f"eval.served.python={VLLM_PYTHON}",
                    "eval.served.prompts=2", "eval.served.max_tokens=24", "eval.served.num_speculative_tokens=[1,3]",
                    "eval.served.extra=[--enforce-eager]", "bench=specbench", "eval.reuse=false",
                    f"paths.output_dir={tmp_path}", f"paths.shared_data={shared_data}"])
    record = run_pipeline(cfg, stage="eval")
    recs = record["eval"]["served"]
    assert [r["num_speculative_tokens"] for r in recs] == [1, 3]
    for k, rec in zip((1, 3), recs):
        counters = rec["served"]["counters"]
        assert rec["identical_to_plain"] == 2 and counters["drafts"] > 0
        assert counters["draft_tokens"] == k * counters["drafts"]
        assert not rec["parity"]["flagged"], rec["parity"]
    print((tmp_path / "served_comparison.txt").read_text())
