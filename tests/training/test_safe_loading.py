"""Checkpoints load with torch's weights_only unpickler: a pickle that would run code is refused by name, and read
only when the user trusts the file (``trust_checkpoint=true``); draftlab's own checkpoints need nothing more."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from draftlab.training.checkpoint import load_file, plain, read_checkpoint, trust_checkpoints, unsafe_objects
from draftlab.utils.errors import ArtifactError
from tests.cli.test_user_errors import _cli, _one_line


class _Opens:
    """Unpickled, it opens (creates) ``path``: what any code a pickle names could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _malicious(tmp_path):
    marker = tmp_path / "the_pickle_ran"
    ckpt = tmp_path / "colleague.ckpt"
    torch.save({"state_dict": {"draft.fc.weight": torch.zeros(2, 2)}, "hyper_parameters": _Opens(marker)}, ckpt)
    return ckpt, marker


@pytest.fixture(autouse=True)
def _untrusted():
    trust_checkpoints(False)
    yield
    trust_checkpoints(False)


def test_a_pickle_that_would_run_code_is_refused_without_running(tmp_path):
    ckpt, marker = _malicious(tmp_path)
    assert unsafe_objects(ckpt) == ["io.open"]
    with pytest.raises(ArtifactError, match=r"colleague.ckpt.*io.open.*trust_checkpoint=true") as err:
        read_checkpoint(ckpt)
    assert "\n" not in str(err.value) and not marker.exists()


def test_trusting_the_file_reads_it_knowingly(tmp_path):
    ckpt, marker = _malicious(tmp_path)
    trust_checkpoints(True)
    assert "state_dict" in read_checkpoint(ckpt) and marker.exists()  # the user's call, as documented
    marker.unlink()
    trust_checkpoints(False)
    assert "state_dict" in load_file(ckpt, trusted=True) and marker.exists()  # the run's own artifact


def test_a_checkpoint_of_plain_tensors_and_containers_needs_no_trust(tmp_path):
    ckpt = tmp_path / "plain.ckpt"
    # hyper-parameters straight from a config: PlainCheckpoint makes the OmegaConf lists plain before saving
    hp = {"ttt_length": 2, "ttt_curriculum": OmegaConf.create([[0.5, 1]])}
    torch.save({"state_dict": {"draft.w": torch.ones(1)}, "hyper_parameters": plain(hp)}, ckpt)
    assert unsafe_objects(ckpt) == []
    assert read_checkpoint(ckpt)["hyper_parameters"] == {"ttt_length": 2, "ttt_curriculum": [[0.5, 1]]}
    torch.save({"state_dict": {}, "hyper_parameters": hp}, tmp_path / "raw.ckpt")
    assert "omegaconf.listconfig.ListConfig" in unsafe_objects(tmp_path / "raw.ckpt")  # what plain() prevents


def test_the_export_command_refuses_it_in_one_line(tmp_path):
    from draftlab.assets import fetch

    fetch("smollm2-135m-instruct")  # the command loads the default target first (see test_user_errors)
    ckpt, marker = _malicious(tmp_path)
    proc = _cli("draftlab.cli.export", f"checkpoint={ckpt}", f"output_dir={tmp_path / 'out'}", tmp_path=tmp_path)
    line = _one_line(proc)
    assert line.startswith(f"error: {ckpt}: ") and "trust_checkpoint=true" in line
    assert not marker.exists() and not (tmp_path / "out").exists()
