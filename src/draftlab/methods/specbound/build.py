"""SpecBound's registry entries (``conf/method/specbound.yaml``): the head builder and the artifact format.

The artifact is a directory with ``specbound_config.json`` (exit layers and the target geometry they
were trained for) and ``heads.safetensors`` (the ``W_l`` maps); the base model is the target itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftlab.methods.specbound.heads import ExitHeads, SpecBoundConfig, default_exit_layers
from draftlab.nn.placement import target_device
from draftlab.utils.atomic import atomic_dir
from draftlab.utils.errors import ConfigError

CONFIG_FILE = "specbound_config.json"
WEIGHTS_FILE = "heads.safetensors"


def build_draft(target, vocab=None, *, taps=None, exit_layers: list[int] | None = None) -> ExitHeads:
    """Fresh exit heads (identity maps) for ``target``, on its device; ``exit_layers`` None = L/5 .. 4L/5."""
    if vocab is not None:
        raise ConfigError("SpecBound (conf/method/specbound.yaml) drafts through the target's own LM head over "
                          "the full vocabulary; set method.draft_vocab_size: null")
    if taps is not None:
        raise ConfigError("SpecBound (conf/method/specbound.yaml) reads the target's own layers, not tapped "
                          "features; set method.taps: null")
    g = target.geometry
    layers = [int(i) for i in exit_layers] if exit_layers is not None else default_exit_layers(g.num_layers)
    return ExitHeads(SpecBoundConfig(exit_layers=tuple(layers), num_layers=g.num_layers, hidden_size=g.hidden_size,
                                     vocab_size=g.vocab_size)).to(target_device(target))


def save_artifact(heads: ExitHeads, out_dir: str | Path, *, target=None) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file({f"maps.{i}": w.detach().float().contiguous().cpu() for i, w in enumerate(heads.maps)},
                  str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(heads.config.to_dict(), indent=1))
    return out_dir


def load_artifact(path: str | Path, *, target=None, device: torch.device | str | None = None) -> ExitHeads:
    """The heads saved at ``path``, fp32, on ``device`` (default: ``target``'s device; the CPU without one)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing; a SpecBound artifact holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = SpecBoundConfig.from_dict(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{cfg_file}: not a SpecBound config: {exc}") from exc
    heads = ExitHeads(config)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights}: unreadable weights: {exc}") from exc
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{weights}: does not match {cfg_file}: {exc}") from exc
    if target is not None:
        heads.check_target(target)
    return heads.to(device=target_device(target, device), dtype=torch.float32)
