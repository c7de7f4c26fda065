"""What a verify pass costs on this machine: seconds of one target pass against the number of rows in it.

Cost-aware drafting (``decoding.budget``) trades the tokens a bigger tree is expected to add against what
its extra rows cost. That price is a property of the target *and* the machine (kernels, cores, memory
bandwidth; see ``targets/row_kernels.py``), so it is measured through the ``Target`` contract itself:
``new_cache`` + ``forward`` with a tree mask over a committed prefix, the same call the engine makes. Any
target gets a curve this way, and the curve of one target object is measured once per process.

It is also a property of the context: every row attends over the whole cache. On SmolLM2-135M (2 cores)
one AR step costs 40 ms over 128 tokens and 56 ms over 1,536, while a second row costs 4 ms more at 128
and 3 ms at 1,536, so a curve measured over a short prefix makes drafting look dearer, relative to a
step, than it is over a long prompt. ``ContextVerifyCost`` holds one curve per context length and
interpolates between them.
"""

from __future__ import annotations

import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass

import torch

from draftlab.targets.probe import verify_passes

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (128, 1024, 2048)  # committed prefix lengths a curve is measured over (Spec-Bench prompts reach ~1.7k)


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of one target pass of ``rows`` rows, linearly interpolated between measured row counts
    (and extrapolated past the last from its last two points)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"need >= 2 increasing row counts with one time each, got {self.rows} / {self.seconds}")

    def __call__(self, rows: int | float, context: int | None = None) -> float:
        """``context`` is accepted for the shared signature and ignored: this is one context's curve."""
        r, s = self.rows, self.seconds
        i = min(max(bisect_left(r, rows), 1), len(r) - 1)  # segment [r[i-1], r[i]]
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return max(s[i - 1] + slope * (rows - r[i - 1]), 0.0)

    @property
    def step(self) -> float:
        """One decode row: the AR step, the unit the benchmarks print costs in."""
        return self(1)

    @classmethod
    def linear(cls, step: float, per_row: float, max_rows: int = 64) -> VerifyCost:
        """A synthetic curve ``step + per_row * (rows - 1)`` (tests, or a machine described by hand)."""
        return cls((1, max_rows), (step, step + per_row * (max_rows - 1)))


@dataclass(frozen=True)
class ContextVerifyCost:
    """Verify cost curves measured at increasing context lengths: linear in the context between two of them
    (attention over the cache is linear in its length), extrapolated past the longest from the last two, and
    held at the shortest one's below it (there the weights, not the cache, set the price)."""

    contexts: tuple[int, ...]
    curves: tuple[VerifyCost, ...]

    def __post_init__(self) -> None:
        if not self.curves or len(self.contexts) != len(self.curves) or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"need >= 1 increasing context lengths with one curve each, got {self.contexts}")

    def __call__(self, rows: int | float, context: int | None = None) -> float:
        c = self.contexts
        if context is None or len(c) == 1 or context <= c[0]:
            return self.curves[0](rows)
        i = min(bisect_left(c, context), len(c) - 1)  # segment [c[i-1], c[i]]
        lo, hi = self.curves[i - 1](rows), self.curves[i](rows)
        return max(lo + (hi - lo) * (context - c[i - 1]) / (c[i] - c[i - 1]), 0.0)

    @property
    def rows(self) -> tuple[int, ...]:
        return self.curves[0].rows

    @property
    def step(self) -> float:
        """One decode row over the shortest context."""
        return self(1)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device``: a GPU runs kernels asynchronously, so a wall clock read without
    this times the launches, not the pass. A no-op on the CPU (and on meta)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(calls: list, reps: int, device: torch.device | str | None = None) -> list[float]:
    """Median seconds of each call, the calls alternating in every repetition (a drift of the machine's
    speed spreads over all of them rather than tilting the comparison); one warm-up round first. ``device``:
    where the calls run, synchronised before each timer starts and before it is read."""
    times = [[] for _ in calls]
    with torch.no_grad():  # as the engine runs: inference mode would make a compiled target guard apart
        for call in calls:
            call()
        for _ in range(reps):
            for j, call in enumerate(calls):
                synchronize(device)
                t0 = time.perf_counter()
                call()
                synchronize(device)
                times[j].append(time.perf_counter() - t0)
    return [sorted(t)[len(t) // 2] for t in times]


def measure_verify_cost(target, rows: tuple[int, ...] = ROWS, *, context: int = 128, reps: int = 5) -> VerifyCost:
    """Median wall time of a verify-shaped pass (``verify_passes``) of each row count over one context."""
    passes = verify_passes(target, rows, context=context)
    return VerifyCost(tuple(rows), tuple(time_interleaved(passes, reps, target.device)))


def measure_context_cost(target, rows: tuple[int, ...] = ROWS, *, contexts: tuple[int, ...] = CONTEXTS,
                         reps: int = 5) -> ContextVerifyCost:
    """``measure_verify_cost`` at each context length (about 20 s for a 135M model on 2 cores)."""
    curves = tuple(measure_verify_cost(target, rows, context=c, reps=reps) for c in contexts)
    return ContextVerifyCost(tuple(contexts), curves)


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verify_cost(target) -> ContextVerifyCost:
    """This target's curves over ``CONTEXTS``, measured on first request, and again after the target moved
    to another device or dtype (the price of a pass is the device's)."""
    where = (str(target.device), str(target.dtype))
    try:
        seen = _MEASURED.get(target)
    except TypeError:  # a target that cannot be weakly referenced: measure each time it is asked
        return measure_context_cost(target)
    if seen is None or seen[0] != where:
        seen = _MEASURED[target] = (where, measure_context_cost(target))
    return seen[1]
