"""Calibrating Saguaro's fan-out on sample prompts: what verification accepts, and how often a cache would hit.

Plain speculative decoding with the primary's chains (``DraftModelDrafter`` or any drafter with a
``speculator``) records every round's outcome ``(j, t)``; a glue pass of the draft over the round's chain then
gives, for the position j where verification stopped, the rank of the bonus token t among that position's
candidates (``saguaro.candidates``: the draft's top tokens without the drafted one). From those:

- the per-position acceptance ``a`` (accepted / tried over all positions, the geometric law's MLE);
- the miss rate of a uniform fan-out F, ``P(rank >= F)``, and Saguaro's power law ``1 - p_hit(F) = F^-r``
  fitted by least squares in log-log over F = 1..``max_width``;
- ``hit_rate(fanout)`` for any fan-out vector, from the same outcomes (how the fan-out plot is drawn).

``Calibration`` is the artifact (``calibration.json``, written atomically): the SSD drafter reads it with
``fanout: geometric`` and ``calibration: <path>``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from draftlab.decoding.engine import GenerationConfig, speculative_generate
from draftlab.methods.ssd.saguaro import candidates
from draftlab.utils.atomic import atomic_write_text

RANK_CAP = 64  # ranks beyond this count as "never cached" (no fan-out gets near it)


@dataclass
class Calibration:
    depth: int
    temperature: float
    accept: float  # per-position acceptance a
    power: float  # r of 1 - p_hit(F) = F^-r
    rounds: int
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # (j, rank of the bonus among j's candidates)
    source: dict = field(default_factory=dict)  # what was measured: target, primary, prompts

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


def fit_power(miss: dict[int, float]) -> float:
    """r of ``miss(F) = F^-r``, least squares through the origin in (log F, -log miss) over F >= 2 with miss > 0
    (F = 1 carries no slope: log 1 = 0)."""
    pts = [(math.log(f), -math.log(m)) for f, m in miss.items() if f >= 2 and 0 < m < 1]
    if not pts:
        return 1.0  # nothing to fit (every outcome cached, or none): a neutral exponent
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    return float((x * y).sum() / (x * x).sum())


def measure(target, drafter, speculator, prompts: list[list[int]], *, depth: int, temperature: float,
            max_new_tokens: int = 128, seed: int = 0, max_width: int = 8, source: dict | None = None) -> Calibration:
    """Decode ``prompts`` with ``drafter`` (chains of ``depth``) and measure the outcomes (module docstring)."""
    tried = accepted = 0
    outcomes: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i,
                               stop_on_eos=True)
        out, stats = speculative_generate(target, prompt, drafter, cfg, trace=True)
        seq = list(prompt) + list(out)
        for r in stats.trace:
            if r.kept != len(r.path):  # a round cut at EOS or the budget has no next round to key
                continue
            chain = r.tokens[1:].tolist()
            j = len(r.path) - 1
            tried += min(j + 1, len(chain))
            accepted += j
            z = speculator.glue(seq[: r.anchor + 1], chain)  # [K+1, V]
            ranked = candidates(z[j], RANK_CAP, chain[j] if j < len(chain) else None)
            outcomes.append((j, ranked.index(r.bonus) if r.bonus in ranked else RANK_CAP))
    accept = min(max(accepted / tried, 1e-3), 1 - 1e-3) if tried else 0.5
    cal = Calibration(depth=int(depth), temperature=float(temperature), accept=accept, power=1.0,
                      rounds=len(outcomes), outcomes=outcomes, source=dict(source or {}))
    cal.power = fit_power({f: cal.miss_rate(f) for f in range(1, max_width + 1)})
    return cal
