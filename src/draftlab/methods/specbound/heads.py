"""Exit heads and the annealed confidence threshold (ACT).

Shallow layers of a target are over-confident and often wrong through the shared LM head (on
SmolLM2-135M top-1 agreement with the final layer is 5-44 % at layers 4-27 of 30). An exit head at layer
``l`` maps the residual stream after ``l`` layers with a learned ``W_l [d, d]`` (initialised to the
identity, so an untrained head is the shared head) before the target's frozen final norm and LM head,
as AdaDecode's ``E* T_l`` does; only ``W_l`` trains. ACT divides the head's logits by
``T_l = 1 + alpha * (1 - l / L)`` for the exit decision only: shallow layers need a larger margin to exit,
and the draft token stays the head's argmax (or a sample of its own distribution).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


def act_temperature(layer: int, num_layers: int, alpha: float) -> float:
    """``T_l = 1 + alpha (1 - l / L)``: > 1 at shallow layers, 1 at the last."""
    return 1.0 + float(alpha) * (1.0 - layer / num_layers)


def default_exit_layers(num_layers: int) -> list[int]:
    """Heads after L/5, 2L/5, 3L/5 and 4L/5 layers (at least one head, never after the last layer)."""
    picks = {min(num_layers - 1, max(1, round(num_layers * f))) for f in (0.2, 0.4, 0.6, 0.8)}
    return sorted(picks)


@dataclass(frozen=True)
class SpecBoundConfig:
    """What an artifact must agree on with the target it drafts for."""

    exit_layers: tuple[int, ...]  # layers run before each head, ascending, in [1, L)
    num_layers: int
    hidden_size: int
    vocab_size: int

    def __post_init__(self):
        layers = tuple(int(i) for i in self.exit_layers)
        if not layers:
            raise ValueError("exit_layers is empty: SpecBound needs at least one exit head")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"exit_layers must be distinct and ascending, got {list(layers)}")
        bad = [i for i in layers if not 1 <= i < self.num_layers]
        if bad:
            raise ValueError(f"exit_layers {bad} are not in [1, {self.num_layers}): a head reads the residual "
                             f"stream after that many of the target's {self.num_layers} layers")
        object.__setattr__(self, "exit_layers", layers)

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_layers": list(self.exit_layers)}

    @classmethod
    def from_dict(cls, d: dict) -> SpecBoundConfig:
        return cls(exit_layers=tuple(d["exit_layers"]), num_layers=int(d["num_layers"]),
                   hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]))


class ExitHeads(nn.Module):
    """One ``W_l [d, d]`` per exit layer; logits through the target's final norm and LM head (frozen)."""

    def __init__(self, config: SpecBoundConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.maps = nn.ParameterList([nn.Parameter(torch.eye(d)) for _ in config.exit_layers])
        self._index = {layer: i for i, layer in enumerate(config.exit_layers)}

    @property
    def exit_layers(self) -> tuple[int, ...]:
        return self.config.exit_layers

    def logits(self, target, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """``hidden [B, T, d]`` after ``layer`` layers -> the exit head's logits ``[B, T, V]``."""
        if layer not in self._index:
            raise KeyError(f"no exit head after layer {layer}; heads: {list(self.exit_layers)}")
        w = self.maps[self._index[layer]]
        return target.lm_head(torch.nn.functional.linear(hidden, w.to(hidden.dtype)), norm=True)

    def check_target(self, target) -> None:
        g = target.geometry
        got = (g.num_layers, g.hidden_size, g.vocab_size)
        want = (self.config.num_layers, self.config.hidden_size, self.config.vocab_size)
        if got != want:
            raise ValueError(f"SpecBound heads were trained for a target with (layers, hidden, vocab) = {want}; "
                             f"target '{getattr(target, 'name', '?')}' has {got}")
