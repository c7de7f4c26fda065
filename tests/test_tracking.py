"""Run identity: W&B names, groups and tags from the Hydra choices and overrides."""

from __future__ import annotations

from omegaconf import OmegaConf

from draftlab.tracking import run_identity


def test_long_overrides_become_valid_distinct_tags():
    # W&B rejects tags over 64 characters; a path override (init_draft=...) easily exceeds that.
    long_a = "init_draft=/root/.cache/draftlab/artifacts/eagle3/b0a6043d055a235f/draft"
    long_b = long_a.replace("b0a6", "c1b7")
    ctx = {"choices": {"method": "confu", "experiment": "confu_table1"}, "overrides": [long_a, long_b, "seed=1"]}
    tags = run_identity(OmegaConf.create({"task_name": "t"}), ctx)["tags"]
    assert "method:confu" in tags and "seed=1" in tags
    long_tags = [t for t in tags if t.startswith("init_draft=")]
    assert len(long_tags) == 2 and len(set(long_tags)) == 2
    assert all(1 <= len(t) <= 64 for t in tags)
