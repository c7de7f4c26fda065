"""The artifact of an SSD calibration (``calibrate.py`` measures it): per-position acceptance, the fitted power
law of the cache's miss rate, and every measured round's outcome, saved as ``calibration.json``. Its own module
so that the drafter reads it without importing the measurement (which imports the drafter)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftlab.utils.atomic import atomic_write_text


@dataclass
class Calibration:
    depth: int
    temperature: float
    accept: float  # per-position acceptance a
    power: float  # r of 1 - p_hit(F) = F^-r
    rounds: int
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # (j, rank of the bonus among j's candidates)
    source: dict = field(default_factory=dict)  # what was measured: target, base, prompts

    def miss_rate(self, width: int) -> float:
        """1 - p_hit of a uniform fan-out ``width`` over the measured outcomes."""
        return 1.0 - self.hit_rate([width] * (self.depth + 1))

    def hit_rate(self, fanout: list[int]) -> float:
        """The share of measured rounds whose outcome a cache with ``fanout`` holds."""
        if not self.outcomes:
            return 0.0
        return sum(rank < fanout[j] for j, rank in self.outcomes) / len(self.outcomes)

    def save(self, path: str | Path) -> Path:
        out = {"format": "draftlab-ssd-calibration/1", **asdict(self)}
        return atomic_write_text(Path(path), json.dumps(out, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable SSD calibration ({exc})") from exc
        if raw.get("format") != "draftlab-ssd-calibration/1":
            raise ValueError(f"{path}: field 'format': expected 'draftlab-ssd-calibration/1', got {raw.get('format')!r}")
        raw.pop("format")
        try:
            cal = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        cal.outcomes = [tuple(o) for o in cal.outcomes]
        return cal
