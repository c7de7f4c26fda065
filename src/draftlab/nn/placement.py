"""Where a draft lives: on its target's device.

Users run the target on a GPU. A draft left on the CPU beside it either fails where its tensors meet the
target's (an exit head's map, DFlash's shared embedding) or, worse, works by copying the target's features
to the host every round (``aux.to(draft_device)``). So every builder and loader places the draft on the
target's device (``target_device``), and the drafters refuse a draft that is not there
(``check_on_target_device``) instead of mixing devices silently.
"""

from __future__ import annotations

import torch
from torch import nn


def target_device(target=None, device: torch.device | str | None = None) -> torch.device:
    """The device a draft for ``target`` belongs on: ``device`` when given, else the target's (its ``device``,
    else its input embedding's), else the CPU (no target)."""
    if device is not None:
        return torch.device(device)
    if target is None:
        return torch.device("cpu")
    dev = getattr(target, "device", None)
    if dev is None:
        model = getattr(target, "model", target)
        get = getattr(model, "get_input_embeddings", None)
        if callable(get):
            dev = get().weight.device
    return torch.device(dev) if dev is not None else torch.device("cpu")


def module_devices(module: nn.Module) -> set[torch.device]:
    """Every device a parameter or buffer of ``module`` is on."""
    return {t.device for t in (*module.parameters(), *module.buffers())}


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the current CUDA device is 0."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def check_on_target_device(draft: nn.Module, target, *, what: str = "the draft") -> None:
    """``ValueError`` (one line, both devices named) unless ``draft`` is wholly on ``target``'s device.

    A target without a device (a stub) is not checked."""
    if target is None or getattr(target, "device", None) is None:
        return
    want = target_device(target)
    devices = module_devices(draft)
    bad = sorted(str(d) for d in devices if not same_device(d, want))
    if bad:
        raise ValueError(f"{what} is on {', '.join(bad)} but the target is on {want}: load it with the method's "
                         f"artifact loader (spec.load(dir, target)) or move it with draft.to({str(want)!r})")
