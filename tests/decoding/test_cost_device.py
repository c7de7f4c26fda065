"""The verify-cost measurement on a target that is not on the CPU: inputs on its device, timers synchronised.

A stub target on ``meta`` records the devices of what it is given (a real meta forward cannot run: it reads
tensor values); ``cost.synchronize`` is recorded to show every timer is bracketed by a device wait.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from draftlab.decoding import cost
from draftlab.targets.probe import verify_passes


class _Cache:
    def commit(self, n: int) -> None:
        pass


class _MetaTarget:
    """Only what ``verify_passes`` reads of a target; ``forward`` records its tensor arguments' devices."""

    device = torch.device("meta")
    dtype = torch.float32
    geometry = SimpleNamespace(vocab_size=1000)

    def __init__(self):
        self.seen: list[set[str]] = []

    def new_cache(self, batch_size: int, max_length: int) -> _Cache:
        return _Cache()

    def forward(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.seen.append({t.device.type for t in tensors})


def test_verify_passes_put_every_input_on_the_target_device():
    t = _MetaTarget()
    calls = verify_passes(t, (1, 2, 5), context=8)
    for call in calls:
        call()
    assert len(t.seen) == 1 + 3  # the prefill and one pass per row count
    assert t.seen[0] == {"meta"}  # the prompt
    assert all(s == {"meta"} for s in t.seen[1:]), t.seen  # tree tokens, positions, mask


def test_every_timed_call_is_bracketed_by_a_device_sync(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(cost, "synchronize", lambda device: events.append(f"sync:{torch.device(device).type}"))
    calls = [lambda j=j: events.append(f"call{j}") for j in range(2)]
    times = cost.time_interleaved(calls, reps=3, device="meta")
    assert len(times) == 2
    timed = events[2:]  # after the warm-up round (one untimed call each)
    assert events[:2] == ["call0", "call1"]
    assert timed == ["sync:meta", "call0", "sync:meta", "sync:meta", "call1", "sync:meta"] * 3


def test_measure_verify_cost_synchronises_the_targets_device(monkeypatch):
    devices: list[torch.device] = []
    monkeypatch.setattr(cost, "synchronize", lambda device: devices.append(torch.device(device)))
    cost.measure_verify_cost(_MetaTarget(), rows=(1, 2), context=4, reps=2)
    assert devices and set(devices) == {torch.device("meta")}


def test_synchronize_is_a_no_op_off_cuda():
    cost.synchronize("cpu")
    cost.synchronize(torch.device("meta"))
    cost.synchronize(None)
