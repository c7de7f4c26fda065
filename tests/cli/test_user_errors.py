"""User mistakes at the command line: one line on stderr, ``error: <where>: <what>``, exit code 2; the traceback
only with ``DRAFTLAB_DEBUG=1``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from draftlab.cli import reject_unread_appends
from draftlab.utils.errors import ConfigError


def _cli(module: str, *args: str, tmp_path, debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env.pop("DRAFTLAB_DEBUG", None)
    if debug:
        env["DRAFTLAB_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path / 'run'}",
                           f"paths.artifacts={tmp_path / 'artifacts'}"],
                          capture_output=True, text=True, timeout=300, env=env)


def _one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_an_appended_setting_nothing_reads_is_rejected_by_name(tmp_path):
    proc = _cli("draftlab.cli.train", "experiment=tiny", "+train.lrr=1e-3", tmp_path=tmp_path)
    line = _one_line(proc)
    assert "field 'train.lrr'" in line and "+train.lrr=1e-3" in line and "checkpoint_every_n_steps" in line
    assert not (tmp_path / "artifacts").exists()  # rejected before any work


def test_malformed_jsonl_is_one_line_with_file_and_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    good = '{"id": "a", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    bad.write_text(good + "\n" + '{"id": "b", "conversations": [\n')
    proc = _cli("draftlab.cli.data", "target=tiny_random", "data=jsonl", f"data.sources.jsonl.path={bad}",
                tmp_path=tmp_path)
    line = _one_line(proc)
    assert f"{bad}:2" in line and "malformed JSON" in line
    debug = _cli("draftlab.cli.data", "target=tiny_random", "data=jsonl", f"data.sources.jsonl.path={bad}",
                 tmp_path=tmp_path, debug=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_appends_under_instantiated_blocks_and_group_choices_pass():
    cfg = OmegaConf.create({"train": {"checkpoint_every_n_steps": 50},
                            "trainer": {"_target_": "lightning.Trainer", "max_epochs": 1},
                            "method": {"module": {"_target_": "x.Module", "lr": 1.0}}})
    reject_unread_appends(cfg, ["+trainer.gradient_clip_val=1.0", "+method.module.extra.depth=2", "++train.x=1",
                                "train.checkpoint_every_n_steps=10"])
    with pytest.raises(ConfigError, match="'train.lrr'.*read by nothing.*checkpoint_every_n_steps"):
        reject_unread_appends(cfg, ["+train.lrr=1e-3"])
    with pytest.raises(ConfigError, match="'nowhere'"):
        reject_unread_appends(cfg, ["+nowhere=1"])


def test_a_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path):
    # The command loads the default target first: fetch it here, or on a fresh cache the subprocess's
    # one-time download and conversion progress would share stderr with the one line under test.
    from draftlab.assets import fetch

    fetch("smollm2-135m-instruct")
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"PK\x03\x04 truncated zip")
    proc = _cli("draftlab.cli.export", f"checkpoint={ckpt}", f"output_dir={tmp_path / 'out'}", tmp_path=tmp_path)
    line = _one_line(proc)
    assert line.startswith(f"error: {ckpt}: ") and "truncated or corrupt" in line
    assert not (tmp_path / "out").exists()
