"""An eval record names the draft it measured: weights hash (stable across save/load) and training step; the run
reads the draft directory once and builds its method's ``MethodSpec`` once."""

from __future__ import annotations

import json

import pytest
import torch

from draftlab import tracking
from draftlab.methods.registry import MethodSpec
from tests.test_pipeline import _cfg, _env


@pytest.fixture
def eagle3_artifact(tmp_path, tiny_target):
    """An EAGLE-3 artifact laid out as draftlab-train leaves it: ``draft/`` plus the training summary."""
    from draftlab.methods.eagle3 import Eagle3Draft

    spec = MethodSpec.from_name("eagle3")
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(tiny_target, draft_vocab_size=512)
    root = tmp_path / "artifact"
    draft_dir = spec.save(draft, root / "draft", tiny_target)
    (root / "train_summary.json").write_text(json.dumps({"key": "k", "history": [],
                                                         "best": {"checkpoint": "x.ckpt", "step": 120}}))
    return spec, draft, draft_dir


def test_weights_hash_survives_save_and_load(tmp_path, tiny_target, eagle3_artifact):
    spec, draft, draft_dir = eagle3_artifact
    loaded = spec.load(draft_dir, tiny_target)
    assert tracking.weights_sha256(loaded) == tracking.weights_sha256(draft)
    # Saved again from the loaded copy: still the same weights, so the same hash.
    again = spec.load(spec.save(loaded, tmp_path / "again" / "draft", tiny_target), tiny_target)
    assert tracking.weights_sha256(again) == tracking.weights_sha256(draft)


def test_weights_hash_changes_with_one_weight(tiny_target, eagle3_artifact):
    spec, draft, _ = eagle3_artifact
    before = tracking.weights_sha256(draft)
    with torch.no_grad():
        draft.fc.weight[0, 0] += 1e-3
    assert tracking.weights_sha256(draft) != before


def test_step_is_the_one_the_artifact_was_saved_at(tmp_path, eagle3_artifact):
    _, _, draft_dir = eagle3_artifact
    assert tracking.draft_step(draft_dir) == 120
    # A draft from elsewhere (no training summary beside it) has no step.
    assert tracking.draft_step(tmp_path / "nowhere" / "draft") is None


def test_eval_record_names_the_draft_and_the_commit(tmp_path, monkeypatch, shared_data, tiny_target,
                                                    eagle3_artifact):
    from draftlab.methods import artifact, registry
    from draftlab.stages.pipeline import run_pipeline

    spec, draft, draft_dir = eagle3_artifact
    _env(monkeypatch, tmp_path, shared_data)
    reads = []  # every reader of the artifact directory, wrapped: the run opens the directory once

    def counted(name, fn):
        def wrapper(*a, **kw):
            reads.append(name)
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(MethodSpec, "load", counted("draft", MethodSpec.load))
    monkeypatch.setattr(artifact, "draft_step", counted("step", tracking.draft_step))
    monkeypatch.setattr(tracking, "draft_step", counted("step", tracking.draft_step))
    monkeypatch.setattr(registry, "trained_method_config", counted("config", registry.trained_method_config))
    built, init = [], MethodSpec.__init__  # every MethodSpec made: the run's method is built once, then passed

    def counted_init(self, cfg):
        built.append(str(cfg.get("name")))
        init(self, cfg)

    monkeypatch.setattr(MethodSpec, "__init__", counted_init)
    record = run_pipeline(_cfg(tmp_path, "method=eagle3", f"draft_path={draft_dir}"), stage="eval")
    assert sorted(reads) == ["config", "draft", "step"]
    assert built.count("eagle3") == 1, built
    assert record["draft"] == {"path": str(draft_dir), "sha256": tracking.weights_sha256(draft), "step": 120}
    assert json.loads((tmp_path / "record.json").read_text())["draft"] == record["draft"]
    # An eval-only job still names its commit and whether the tree was dirty.
    assert isinstance(record["git"]["commit"], str) and isinstance(record["git"]["dirty"], bool)


def test_a_training_free_record_has_no_draft(tmp_path, monkeypatch, shared_data):
    from draftlab.stages.pipeline import run_pipeline

    _env(monkeypatch, tmp_path, shared_data)
    record = run_pipeline(_cfg(tmp_path, "method=prompt_lookup", experiment="tiny_base"), stage="eval")
    assert record["draft"] == {"path": None, "sha256": None, "step": None}
