"""The overfit gate (``experiment=gate``, ``draftlab.eval.gate``): the real config composed for every method with
a vLLM export, trained for a few steps on one conversation with the tiny target and served by a stand-in engine
whose counters say how much it accepted: the gate passes on near-full acceptance, fails the job (record kept)
on low acceptance or on outputs that differ from plain decoding."""

from __future__ import annotations

import json

import pytest
from stub_metrics import SpecStub

from draftlab.eval.gate import GateFailed, gate_verdict

GATED = ("eagle3", "dflash")  # the methods whose conf declares export.serve.vllm


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """One artifact store for the module: the failing run reuses the passing run's data and trained draft."""
    return tmp_path_factory.mktemp("gate_art")


def _run(method, tmp_path, monkeypatch, shared_data, urls, art):
    from draftlab.stages.pipeline import run_pipeline
    from tests.test_configs import _compose

    monkeypatch.setenv("DRAFTLAB_SHARED_DATA", str(shared_data))
    cfg = _compose(["experiment=gate", f"method={method}", "target=tiny_random", "trainer.max_steps=3",
                    "regen.max_new_tokens=12", "eval.served.max_tokens=8", "+eval.served.bootstrap=50",
                    f"+eval.served.urls={{plain: '{urls[0]}', spec: '{urls[1]}'}}", f"paths.artifacts={art}",
                    "eval.reuse=false"], tmp_path / "run")
    return run_pipeline(cfg, stage="train")


@pytest.mark.parametrize("method", GATED)
def test_gate_passes_on_full_served_acceptance(method, tmp_path, monkeypatch, shared_data, art):
    with SpecStub(k=3, plan=lambda p: [3, 3, 3, 2]) as plain, SpecStub(k=3, plan=lambda p: [3, 3, 3, 2]) as spec:
        record = _run(method, tmp_path, monkeypatch, shared_data, (plain.url, spec.url), art)
    gate = record["eval"]["gate"]
    assert gate["passed"] and gate["chains"][0]["served_acceptance"] == pytest.approx(11 / 12)
    assert record["eval"]["served"][0]["n_prompts"] == 1  # the one training conversation's first turn


def test_gate_fails_the_job_on_low_acceptance_and_keeps_the_record(tmp_path, monkeypatch, shared_data, art):
    with SpecStub(k=3, plan=lambda p: [1, 0, 0, 2]) as plain, SpecStub(k=3, plan=lambda p: [1, 0, 0, 2]) as spec:
        with pytest.raises(GateFailed, match=r"served acceptance 0\.250 at k=3 < 0\.80"):
            _run("eagle3", tmp_path, monkeypatch, shared_data, (plain.url, spec.url), art)
    (record,) = (tmp_path / "run").rglob("record.json")
    gate = json.loads(record.read_text())["eval"]["gate"]
    assert not gate["passed"] and gate["chains"][0]["position_rates"] == pytest.approx([0.5, 0.25, 0.0])


def _rec(accepted, draft_tokens, identical=1, n=1):
    side = {"counters": {"accepted": accepted, "draft_tokens": draft_tokens}, "tau": 1 + accepted / (draft_tokens / 3),
            "position_rates": [1.0, 1.0, 0.5]}
    return {"num_speculative_tokens": 3, "n_prompts": n, "identical_to_plain": identical, "served": side,
            "draftlab": side}


def test_verdict_needs_both_acceptance_and_lossless_outputs():
    assert gate_verdict([_rec(24, 30)], min_acceptance=0.8)["passed"]
    assert not gate_verdict([_rec(23, 30)], min_acceptance=0.8)["passed"]  # 0.767 < 0.8
    assert not gate_verdict([_rec(30, 30, identical=0)], min_acceptance=0.8)["passed"]  # a lossy engine fails
    assert not gate_verdict([_rec(30, 30), _rec(3, 30)], min_acceptance=0.8)["passed"]  # every chain must pass
    with pytest.raises(ValueError, match="served evaluation"):
        gate_verdict([], min_acceptance=0.8)
