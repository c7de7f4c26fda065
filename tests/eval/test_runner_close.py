"""The eval stage owns the drafters it runs: each is closed (``Drafter.close``) when it is done, also when
decoding raises, so a drafter holding a worker process or a connection does not leak it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from draftlab.data.benchmarks import Question
from draftlab.decoding.drafter import DecodeState, Drafter, closing_all
from draftlab.decoding.tree import DraftTree
from draftlab.methods.registry import MethodSpec
from draftlab.stages import evaluate as stage

CONF = Path(__file__).resolve().parents[2] / "conf"


class OneQuestion:
    """A one-question bench (``cfg.bench``), so the stage decodes one short answer per drafter."""

    name = "one"

    def __init__(self, **_):
        pass

    def load(self, tokenizer=None) -> list[Question]:
        return [Question("q0", "writing", ["Say hello."])]


class Counted(Drafter):
    """Proposes the root alone (an AR step per round) or raises on its ``fail_at``-th proposal; counts closes."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.proposals, self.closed = fail_at, 0, 0

    def propose(self, state: DecodeState) -> DraftTree:
        self.proposals += 1
        if self.proposals == self.fail_at:
            raise RuntimeError("drafting failed")
        return DraftTree.chain(state.root, [])

    def close(self) -> None:
        self.closed += 1


def _cfg(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["method=suffix", "+method@eval.baselines.pld=prompt_lookup",
                                                     "eval.warmup=0", "eval.max_new_tokens=4"])
    OmegaConf.update(cfg, "bench", {"_target_": f"{__name__}.OneQuestion"}, merge=False)
    return cfg


@pytest.fixture
def built(monkeypatch):
    """The baseline drafters the stage builds, wrapped to count their closes."""
    made: list[Counted] = []

    def build(self, draft=None):
        made.append(Counted())
        return made[-1]

    monkeypatch.setattr(stage.MethodSpec, "build_drafter", build)
    return made


@pytest.mark.parametrize("fail_at", [None, 2])
def test_evaluate_closes_the_drafter_and_baselines(tiny_target, tmp_path, built, fail_at):
    drafter = Counted(fail_at)
    cfg = _cfg(tmp_path)
    if fail_at is None:
        record, _ = stage.evaluate(cfg, tiny_target, drafter, tmp_path, MethodSpec(cfg.method))
        assert record["mismatches_vs_ar"] == 0 and "pld" in record["baselines"]
    else:
        with pytest.raises(RuntimeError, match="drafting failed"):
            stage.evaluate(cfg, tiny_target, drafter, tmp_path, MethodSpec(cfg.method))
    assert drafter.proposals >= 1 and drafter.closed == 1
    assert len(built) == 1 and built[0].closed == 1


def test_closing_all_closes_every_drafter_when_one_close_raises():
    class Raising(Counted):
        def close(self) -> None:
            super().close()
            raise OSError("worker gone")

    a, b = Counted(), Raising()
    with pytest.raises(OSError, match="worker gone"):
        with closing_all(a, None, b):
            pass
    assert a.closed == b.closed == 1
