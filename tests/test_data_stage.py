"""The data stage end to end on the tiny target, through the real configs; a re-run reuses everything."""

from __future__ import annotations

import subprocess
import sys

from tests.test_configs import _compose


def test_data_stage_runs_and_reuses_artifacts(tmp_path, monkeypatch):

    overrides = ["target=tiny_random", "debug=default", "regen.max_new_tokens=4", "method.draft_vocab_size=256",
                 f"paths.artifacts={tmp_path / 'artifacts'}"]
    cfg = _compose(overrides, tmp_path)
    first = _data_stage(cfg)
    assert first.regen_report.complete and first.regen_report.success == 8
    assert first.regen_report.resumed_done == 0
    assert len(first.samples) == first.render_report.kept > 0
    assert first.vocab.d2t.numel() == 256 and 0 < first.vocab.coverage <= 1
    second = _data_stage(_compose(overrides, tmp_path))
    assert second.regen_report.resumed_done == 8 and second.regen_report.new_tokens == 0
    assert second.data_key == first.data_key
    assert [s.input_ids for s in second.samples] == [s.input_ids for s in first.samples]


def test_cli_entry_point_composes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "draftlab.cli.data", "--cfg", "job", "experiment=quickstart"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "task_name: data" in out.stdout and "max_new_tokens: 96" in out.stdout


def test_raising_a_limit_continues_the_earlier_regeneration(tmp_path):
    """Regenerated turns are pooled per (target, files, settings): 8 conversations after 4 regenerate only 4."""

    base = ["target=tiny_random", "debug=default", "regen.max_new_tokens=4", "method.draft_vocab_size=256",
            f"paths.artifacts={tmp_path / 'artifacts'}"]
    small = _data_stage(_compose(base + ["data.sources.sharegpt.limit=4"], tmp_path))
    assert small.regen_report.success == 4 and small.regen_report.resumed_done == 0
    large = _data_stage(_compose(base, tmp_path))
    assert large.regen_path == small.regen_path
    assert large.regen_report.resumed_done == 4 and large.regen_report.success == 8
    assert large.data_key != small.data_key  # features, vocab and drafts still follow the exact slice
    again = _data_stage(_compose(base + ["data.sources.sharegpt.limit=4"], tmp_path))
    assert [s.input_ids for s in again.samples] == [s.input_ids for s in small.samples]


def _data_stage(cfg):
    """The data stage for ``cfg``'s method, as the pipeline runs it."""
    from draftlab.methods.registry import MethodSpec
    from draftlab.stages.data import run_data_stage

    return run_data_stage(cfg, MethodSpec(cfg.method))
