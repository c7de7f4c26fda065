"""The offline feature store is sized to the target: stored in the target's dtype by default, its size said
before anything is written, and refused in one line when the disk cannot hold it."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file

from draftlab.data.features import check_room, offline_features, store_dtype_name
from draftlab.data.template import RenderedSample


class Taps:
    """What the store reads of a draft: the layers it taps."""

    def taps(self, target):
        return [0, 1, 1]


def _samples(n=3, t=12):
    return [RenderedSample(input_ids=list(range(100 + i, 100 + i + t)), loss_mask=[1] * t, id=str(i)) for i in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_stores_the_targets_dtype(tmp_path, dtype):
    from draftlab.targets import load_target

    target = load_target("tiny_random", dtype=dtype)
    assert store_dtype_name("auto", target) == dtype and store_dtype_name("float32", target) == "float32"
    root = offline_features(target=target, draft=Taps(), samples=_samples(), root=tmp_path, key=({"t": 1}, "data"))
    stored = load_file(str(next(root.glob("*.safetensors"))))
    assert stored["aux"].dtype == getattr(torch, dtype) and stored["last"].dtype == getattr(torch, dtype)


def test_the_size_is_said_and_a_short_disk_is_refused(tiny_target, tmp_path, monkeypatch, caplog):
    d = tiny_target.geometry.hidden_size
    lengths = [12, 12, 12]
    need = check_room(tmp_path, lengths, 4 * d, torch.bfloat16)
    assert need == 36 * 4 * d * 2  # tokens x (3 taps + last) x d x 2 bytes
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    with pytest.raises(OSError) as err:
        offline_features(target=tiny_target, draft=Taps(), samples=_samples(), root=tmp_path, key=({"t": 1}, "d"))
    msg = str(err.value)
    assert "\n" not in msg and "GiB" in msg and "features.dtype" in msg
    assert not list(tmp_path.rglob("*.safetensors"))  # refused before anything was written
