"""A target built for a device is wholly on it (checked with ``meta``: no memory, no GPU needed)."""

from __future__ import annotations

import torch

from draftlab.targets import load_target


def test_tiny_random_is_built_on_the_device_asked_for():
    t = load_target("tiny_random", device="meta")
    assert t.device.type == "meta"
    assert {p.device.type for p in t.model.parameters()} == {"meta"}
    # The fused per-layer weights the verify passes read, too (they are built from the model's own).
    fused = [w for layer in t._layers for w in layer.values() if isinstance(w, torch.Tensor)]
    assert fused and {w.device.type for w in fused} == {"meta"}
